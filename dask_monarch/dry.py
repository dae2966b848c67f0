"""``with dm.dry_run(mesh) as run:`` — run a program on the client alone, against fake tensors.

The user API already works out every op's output shapes on the client with
fake tensors (:mod:`.propagation`). Inside a dry run the mesh's session talks
to a :class:`~dask_monarch.controller.dry.DryController` instead of its
controller: every message is built, checked and compiled as in a real run
(shape errors, wrong meshes and streams, and the pre-dispatch check of
collectives, sends and borrows raise as they would), and none is sent: no
worker is touched, no GPU memory allocated. ``run.report()`` then says, per
rank, the peak tensor bytes, the messages and the bytes each collective and
send would move.

What a dry run cannot do, and how it ends:

* fetches (``inspect``, ``fetch_shard``, actor results) have no value: their
  futures fail with :class:`~dask_monarch.controller.dry.DryRunError` at once;
  ``mesh.spawn`` raises it;
* ``mesh.exit()`` inside the block ends nothing: the mesh stays usable;
* the mesh comes out as it went in: its streams, communicators and the
  tensors made before keep working (deletes of those made during the block
  go to the ranks afterwards); a tensor made inside the block has no value
  on the ranks, so a later use fails with ``DryRunError``;
* memory counts the tensors the block makes (by their handles' metadata), not
  those that existed before, nor a rank's temporaries (collective buffers).

docs/observability.md.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .controller.dry import DryController, DryRunError, RankFigures, by_rank
from .tensor import Tensor, exited

if TYPE_CHECKING:
    from .controller.session import Session
    from .mesh import DeviceMesh

__all__ = ["DryRun", "DryRunError", "dry_run"]

# the session state a dry run replaces and puts back (refs created lazily on the ranks)
_LAZY = (
    "_streams",
    "_stream_objects",
    "_meshes",
    "_network",
    "_comms",
    "_dead_streams",
    "_status_requested_at",
)


class DryRun:
    """What a dry run measured: per-rank figures, collectives, sends, and :meth:`report`."""

    def __init__(self, mesh: DeviceMesh, controller: DryController) -> None:
        self.mesh = mesh
        self._controller = controller
        self.exited = False  # the program called mesh.exit() inside the block

    @property
    def ranks(self) -> dict[int, RankFigures]:
        """Per rank: ``messages``, ``peak_tensor_bytes``, ``tensor_bytes`` (at the end),
        ``collective_bytes``, ``sent_bytes``, ``received_bytes``."""
        return {f.rank: f for f in self._controller.ranks}

    @property
    def collectives(self) -> list:
        """Every ``Reduce``: kind, dims, ranks, shape, dtype, ``bytes`` each member puts in."""
        return list(self._controller.collectives)

    @property
    def sends(self) -> list:
        """Every ``SendTensor``: (from rank, to rank) ``pairs``, ``bytes`` each pair moves."""
        return list(self._controller.sends)

    @property
    def messages(self) -> int:
        """Messages all ranks together would run."""
        return sum(f.messages for f in self._controller.ranks)

    def report(self) -> str:
        """A per-rank table and the collectives and sends, in words."""
        world = self._controller.world_size
        lines = [
            f"dry run of {self.mesh!r}: {self.messages} messages, "
            f"{len(self._controller.collectives)} collectives, {len(self._controller.sends)} sends",
            f"{'rank':>4}  {'messages':>8}  {'peak tensors':>12}  {'at the end':>10}  "
            f"{'collectives':>11}  {'sent':>9}  {'received':>9}",
        ]
        for f in self._controller.ranks:
            lines.append(
                f"{f.rank:>4}  {f.messages:>8}  {_size(f.peak_tensor_bytes):>12}  "
                f"{_size(f.tensor_bytes):>10}  {_size(f.collective_bytes):>11}  "
                f"{_size(f.sent_bytes):>9}  {_size(f.received_bytes):>9}"
            )
        per_rank = by_rank([*self._controller.collectives, *self._controller.sends], world)
        if any(per_rank.values()):
            lines.append("collectives and sends (bytes per member / per pair):")
        for c in self._controller.collectives:
            lines.append(
                f"  {c.kind} ({c.reduction}) over {list(c.dims)} of ranks {list(c.ranks)}: "
                f"{c.dtype}{list(c.shape)}, {_size(c.bytes)} each"
            )
        for s in self._controller.sends:
            pairs = ", ".join(f"{a}->{b}" for a, b in s.pairs)
            lines.append(f"  send {s.dtype}{list(s.shape)} {pairs}: {_size(s.bytes)} each")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.report())

    def __repr__(self) -> str:
        return f"<DryRun of {self.mesh!r}: {self.messages} messages>"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@contextlib.contextmanager
def dry_run(mesh: DeviceMesh) -> Iterator[DryRun]:
    """Run the block on the client alone: check and measure every message, send none.

    Errors a real run would raise are raised here, before any worker runs
    anything: shapes and dtypes (propagation), meshes and streams (the
    client-side checks), and protocol errors such as collectives the ranks
    disagree on (``DeviceException`` naming the rank, from the pre-dispatch
    check). See the module docs for fetches, ``mesh.exit`` and what is
    counted.
    """
    session = mesh._session
    with session.lock:
        if session.closed:
            raise exited(mesh)
        if isinstance(session.controller, DryController):
            raise RuntimeError(f"{mesh!r} is already in a dry run")
        if session.capture is not None:
            raise RuntimeError("a dry run cannot start inside coalescing or a compiled trace")
        session.flush_pending()
        real = session.controller
        real.flush()  # what came before goes to the ranks as usual
        first_seq, first_id = session._seq, session.new_id()
        saved = {name: getattr(session, name) for name in _LAZY}
        definers = dict(session.history.definer)
        dry = DryController(real, first_id, session._futures)
        run = DryRun(mesh, dry)
        session.controller = dry
        session._streams, session._stream_objects, session._meshes = {}, {}, {}
        session._network, session._comms, session._dead_streams = False, set(), []

        def exit_inside(timeout: float = 600, cancel: bool = False) -> None:  # outlives the run
            run.exited = True

        session.exit = exit_inside  # type: ignore[method-assign]
        _track(session, dry)
    failed = True
    try:
        yield run
        failed = False
    finally:
        with session.lock:
            try:
                session.flush_pending()
                if not failed:
                    dry.sync()  # the final check: what would wait forever
            finally:
                _untrack(session)
                del session.exit
                _restore(session, real, dry, saved, definers, first_seq, first_id)


def _restore(
    session: Session,
    real: Any,
    dry: DryController,
    saved: dict,
    definers: dict,
    first_seq: int,
    first_id: int,
) -> None:
    """Put the session back as it was before the dry run; forget what the run made."""
    dead = [ref for ref in session._dead_streams if ref.id < first_id]
    session.controller = real
    for name, value in saved.items():
        setattr(session, name, value)
    # streams and refs of the real run that died meanwhile: dropped on the ranks from now on
    for ref in [*dry.real_drops, *dead]:
        for key, known in list(session._streams.items()):
            if known.id == ref.id:
                del session._streams[key]
        session._stream_objects.pop(ref.id, None)
        if ref not in session._dead_streams:
            session._dead_streams.append(ref)
    session._pending_deletes.extend(dry.real_deletes)
    history = session.history
    for seq in [s for s in history.invocations if s >= first_seq]:
        del history.invocations[seq]
    # refs made before: defined as before (the block's in-place ops never ran), unless their
    # definer completed meanwhile; refs made inside: see below
    made = [ref for ref in history.definer if ref >= first_id]
    history.definer = {ref: seq for ref, seq in definers.items() if seq in history.invocations}
    for seq in [s for s in session._futures if s >= first_seq]:
        session._futures.pop(seq).set_exception(_made_inside())
    for seq in [s for s in session._values if s >= first_seq]:
        del session._values[seq]
    if made:  # a later use of what the block made fails, saying why
        seq = session.new_seq()
        history.invoke(seq, [], made)
        history.fail(seq, _made_inside())


def _made_inside() -> DryRunError:
    return DryRunError(
        "this value was made inside a dask_monarch.dry_run block: nothing ran, so it has no "
        "value on the ranks; make it again outside the dry run"
    )


# -- the handles a dry run makes: their bytes --------------------------------------------------

_lock = threading.Lock()
# id(session) -> (its dry controller, StorageInfo -> the key the controller knows it by)
_dry: dict[int, tuple[DryController, weakref.WeakKeyDictionary]] = {}
_keys = itertools.count()
_original_new = Tensor.__dict__["__new__"]


def _counting_new(
    cls: type,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    dtype: Any,
    device: Any,
    session: Session,
    mesh: DeviceMesh,
    stream: Any,
    ref: Any,
    storage: Any = None,
    owns_ref: bool = True,
) -> Tensor:
    """``Tensor.__new__`` while a dry run is on: tells the dry controller what each handle
    holds. Installed only then, so a normal run never pays for it."""
    t = _original_new.__func__(
        cls, shape, stride, offset, dtype, device, session, mesh, stream, ref, storage, owns_ref
    )
    entry = _dry.get(id(session))
    if entry is not None and ref.id >= entry[0].first_id:
        controller, keys = entry
        key = keys.get(t._storage)
        if key is None:  # weakly keyed: a storage's handles must die as in a real run
            key = keys[t._storage] = next(_keys)
        nbytes = 0 if storage is not None else _extent(shape, stride, offset) * dtype.itemsize
        controller.created(ref.id, key, nbytes, mesh._ranks)
    return t


def _extent(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> int:
    """Elements a new storage holds for a tensor of this layout (0 when it is empty)."""
    if any(size == 0 for size in shape):
        return 0
    return offset + 1 + sum((size - 1) * step for size, step in zip(shape, stride))


def _track(session: Session, controller: DryController) -> None:
    with _lock:
        if not _dry:
            Tensor.__new__ = staticmethod(_counting_new)  # type: ignore[method-assign]
        _dry[id(session)] = (controller, weakref.WeakKeyDictionary())


def _untrack(session: Session) -> None:
    """Stop counting; the handles the dry run made stop owning their refs (nothing on the
    ranks to delete: their deaths send nothing)."""
    with _lock:
        controller, keys = _dry.pop(id(session))
        for info in list(keys):
            for handle in info.handles:
                if handle._ref.id >= controller.first_id:
                    handle._owns_ref = False
        if not _dry:
            Tensor.__new__ = _original_new  # type: ignore[method-assign]
