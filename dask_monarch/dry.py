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
* a compiled function is traced anew for the dry run (its recordings on the
  ranks name streams the dry run never created) and replays those of before
  after it; its memory is its results and what it keeps, as a real replay's:
  its intermediates count while it is traced only (a replay frees them);
* memory counts the tensors the block makes (by their handles' metadata), not
  those that existed before, nor a rank's temporaries (collective buffers).

docs/observability.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .controller.dry import DryController, DryRunError, RankFigures, by_rank
from .handles import exited

if TYPE_CHECKING:
    from .mesh import DeviceMesh

__all__ = ["DryRun", "DryRunError", "dry_run"]


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

    Parameters
    ----------
    mesh
        The mesh (or a view of it) whose program to run dry; its views take
        part too.

    Yields
    ------
    DryRun
        Per-rank figures once the block ends: ``run.ranks``, ``run.collectives``,
        ``run.sends``, ``run.report()``.
    """
    session = mesh._session
    with session.lock:
        if session.closed:
            raise exited(mesh)
        session.send_views()  # views made before are refs of before (session.substitute)
        dry = DryController(session.controller, session.new_id(), session.pending_fetches)
    run = DryRun(mesh, dry)

    def exit_inside() -> None:  # the mesh outlives its dry run
        run.exited = True

    with session.substitute(dry, exit_inside):
        yield run
        with session.lock:  # the final check: what would wait forever
            session.flush_pending()
            dry.sync()
