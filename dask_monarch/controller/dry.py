"""A controller that runs nothing: it checks and measures what it is sent (``dm.dry_run``).

:class:`DryController` stands in for a session's
:class:`~dask_monarch.controller.Controller` during a dry run. It takes the
same calls, but no message leaves the client: each flush goes through the
real :class:`~dask_monarch.controller.compiler.Compiler` (routing, seq
order, lane limits, the pre-dispatch check of collectives, sends, borrows
and exits: DESIGN decision 14), whose graph is dropped instead of
submitted, so a protocol error is raised as the ``DeviceException`` the
real run would break with, naming the rank, before any worker is touched.
Once broken, each call raises its own copy of that exception, as the real
controller does (``fresh_copy``): raising one object again grows its traceback.

Meanwhile it counts per rank the messages each rank would run, the live
tensor bytes (the user API tells it the bytes of each handle it makes:
:meth:`created`; ``DeleteRefs`` frees them once every ref of a storage is
gone, and so does :meth:`forgotten` for the refs of a compiled trace's own
handles) and their peak, and the bytes every ``Reduce`` and ``SendTensor``
would move (those of a recording at each ``CallRecording`` of it). Fetches
cannot have a value: their futures fail at once with :class:`DryRunError`.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .. import config
from ..exceptions import DeviceException
from ..protocol import messages as m
from ..protocol.messages import WORKER_MESSAGES
from ..protocol.wire import ActorCall, DropLane, ExpectResults
from .compiler import Compiler, InternalStep, PayloadError
from .controller import fresh_copy

_WORKER_MESSAGE_TYPES = frozenset(WORKER_MESSAGES)
_keys = itertools.count()
_KINDS = {
    (False, False): "all-reduce",
    (False, True): "reduce-scatter",
    (True, False): "all-gather",
    (True, True): "all-to-all",
}


class DryRunError(RuntimeError):
    """What a dry run cannot do: produce a value (a fetch), spawn an actor."""


@dataclass
class RankFigures:
    """What one rank would hold and do during the dry run."""

    rank: int
    messages: int = 0  # messages this rank would run (setup messages included)
    tensor_bytes: int = 0  # live tensor bytes made in the dry run, at its end
    peak_tensor_bytes: int = 0
    collective_bytes: int = 0  # what this rank puts into collectives
    sent_bytes: int = 0  # what it sends to other ranks (SendTensor)
    received_bytes: int = 0


@dataclass
class Collective:
    """One ``Reduce``: its kind, the mesh dims it spans, its ranks and bytes per rank."""

    result: int  # the result's ref id (one per collective)
    kind: str  # all-reduce, reduce-scatter, all-gather, all-to-all
    reduction: str
    dims: tuple[str, ...]
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # each member's input


@dataclass
class Send:
    """One ``SendTensor``: ``pairs`` of (from rank, to rank), each moving ``bytes``."""

    result: int
    pairs: list[tuple[int, int]] = field(default_factory=list)
    shape: tuple[int, ...] = ()
    dtype: str = ""
    bytes: int = 0


class _Storage:
    __slots__ = ("nbytes", "ranks", "refs")

    def __init__(self, nbytes: int, ranks: tuple[int, ...]) -> None:
        self.nbytes = nbytes
        self.ranks = ranks
        self.refs: set[int] = set()


class DryController:
    """Stands in for a Controller: compiles and checks every flush, submits nothing."""

    def __init__(self, real: Any, first_id: int, futures: dict) -> None:
        self._real = real
        self.world_size = real.world_size
        self.on_shutdown = None  # nothing to fail: a dry run's futures fail at once
        self.workers = real.workers  # the mesh's display (to_table) still names them
        self.backend = real.backend
        self.token = f"{real.token}-dry"
        self.span = None
        self.mesh_id = real.mesh_id  # errors in a dry run name the mesh as the real run would
        self.devices = real.devices  # what a CUDA op is checked against (tensor.cpu_ranks)
        self.first_id = first_id  # ref and stream ids below it existed before the dry run
        self._futures = futures  # the session's fetch futures: failed at once
        self._compiler = Compiler(self.token, [f"dry-{r}" for r in range(self.world_size)], {})
        self._flush_size = config.integer("flush.size", minimum=1)
        self._buffer: list[tuple[tuple[int, ...], Any]] = []
        self._broken: DeviceException | None = None
        self.closed = False
        self.ranks = [RankFigures(r) for r in range(self.world_size)]
        self.collectives: list[Collective] = []
        self.sends: list[Send] = []
        self.real_deletes: list[tuple[tuple[int, ...], int]] = []  # refs of the real run
        self.real_drops: list[m.StreamRef] = []  # streams of the real run that died meanwhile
        self._storages: dict[int, _Storage] = {}  # storage key -> what it holds
        # the user API's storage objects -> their keys, weakly: a storage's handles must die
        # as in a real run, and their DeleteRefs free it
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._ref_storage: dict[int, int] = {}  # ref id -> storage key
        self._borrowed: dict[int, int] = {}  # borrow id -> the borrowed ref
        # (rank, recording ref id) -> the commands defined to it in the dry run
        self._recordings: dict[tuple[int, int], list] = {}

    # -- the Controller calls the user API makes ----------------------------------------------

    def send(self, ranks: Any, message: Any) -> None:
        if self._broken is not None:
            raise fresh_copy(self._broken)
        if type(message) not in _WORKER_MESSAGE_TYPES:
            raise TypeError(f"expected a worker message, got {message!r}")
        ranks = self._ranks(ranks)
        for r in ranks:
            self.ranks[r].messages += 1
        self._account(ranks, message)
        self._buffer.append((ranks, message))
        if len(self._buffer) >= self._flush_size:
            self.flush()

    def _send_internal(self, ranks: tuple[int, ...], stream: m.StreamRef, step: Any) -> None:
        if self._broken is not None:
            raise fresh_copy(self._broken)
        for r in ranks:
            self.ranks[r].messages += 1
        self._buffer.append((ranks, InternalStep(stream.id, step)))

    def flush(self) -> None:
        self._flush(False)

    def ranks_idle(self) -> bool:
        """Nothing would start on the ranks: callers that flush to start idle ranks
        (``dm.ddp_hooks``) leave the messages buffered."""
        return False

    def can_wait_for_ranks(self) -> bool:
        """Nothing runs, so nothing ever catches up: a long dry run never waits."""
        return False

    def sync(self, timeout: float = 60) -> list:
        """Nothing runs: the final check of what would wait forever, no reports."""
        self._flush(True)
        return []

    def _flush(self, final: bool) -> None:
        buffer, self._buffer = self._buffer, []
        if self._broken is None and (buffer or final):
            try:
                plan = self._compiler.compile(buffer, final)
            except PayloadError as e:
                self._broken = DeviceException(e.cause, rank=e.rank)
            else:
                if plan.error is not None:
                    self._broken = DeviceException(plan.error.cause, rank=plan.error.rank)
        if self._broken is not None:
            raise fresh_copy(self._broken)

    @property
    def broken(self) -> DeviceException | None:
        return self._broken

    def drop_stream(self, ranks: Any, stream: m.StreamRef) -> None:
        if stream.id < self.first_id:  # a real stream died meanwhile: dropped after the run
            self.real_drops.append(stream)
            return
        self._send_internal(self._ranks(ranks), stream, DropLane())

    def name_stream(self, stream: m.StreamRef, name: str) -> None:
        pass

    def call_actor(
        self,
        ranks: Any,
        broker_id: tuple[str, int],
        seq: int,
        stream: m.StreamRef,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> None:
        step = ActorCall(tuple(broker_id), seq, method, m.ArgsKwargs.from_python(args, kwargs))
        self._send_internal(self._ranks(ranks), stream, step)

    def expect_results(
        self, ranks: Any, seq: int, stream: m.StreamRef, function: str, results: list
    ) -> None:
        """Counted as the step the ranks would get; there is no value to check it against."""
        step = ExpectResults(seq, function, tuple(results))
        self._send_internal(self._ranks(ranks), stream, step)

    def spawn_actor(self, ranks: Any, name: str, cls: type, *args: Any, **kwargs: Any) -> Any:
        raise DryRunError(
            f"mesh.spawn({name!r}, {cls.__name__}) inside a dry run: actors are real objects "
            "on the ranks, and a dry run touches no worker; spawn them before the dry run"
        )

    def waiting_for(self) -> str:
        return ""

    def drain(self, timeout: float = 60) -> None:
        self.flush()

    @property
    def client(self) -> Any:
        return self._real.client

    @property
    def debugging(self) -> dict:
        return {}  # no rank runs, none stops in pdb

    def attend_debugger(self) -> bool:
        return False

    def add_listener(self, listener: Any, *, consume: bool = False) -> None:
        """No rank reports: a listener would hear nothing."""

    def start_trace(self, limit: int | None = None) -> None:
        raise DryRunError("dm.trace inside a dry run: nothing runs, so there is nothing to trace")

    def collect_trace(self, stop: bool = True) -> list[dict]:
        return []

    def cancel_running(self, grace: float) -> list[dict]:
        return []  # nothing runs

    def close(self, timeout: float | None = None) -> None:
        self.closed = True

    def _ranks(self, ranks: Any) -> tuple[int, ...]:
        out = (ranks,) if type(ranks) is int else tuple(ranks)
        for r in out:
            if type(r) is not int or not 0 <= r < self.world_size:
                raise ValueError(f"rank {r!r} is outside this controller's {self.world_size} ranks")
        return out

    # -- accounting ---------------------------------------------------------------------------

    def created(self, ref: int, storage: Any, nbytes: int, ranks: tuple[int, ...]) -> None:
        """The user API made a handle of ref ``ref`` on ``ranks`` over ``storage`` (one
        object per storage; ``nbytes`` if that storage is new)."""
        key = self._keys.get(storage)
        if key is None:
            key = self._keys[storage] = next(_keys)
        storage = key
        held = self._storages.get(storage)
        if held is None:
            held = self._storages[storage] = _Storage(nbytes, ranks)
            for r in ranks:
                figures = self.ranks[r]
                figures.tensor_bytes += nbytes
                figures.peak_tensor_bytes = max(figures.peak_tensor_bytes, figures.tensor_bytes)
        held.refs.add(ref)
        self._ref_storage[ref] = storage

    def forgotten(self, ref: int) -> None:
        """The user API dropped ref ``ref`` without a ``DeleteRefs``: a handle a compiled
        trace made, which the ranks hold only inside a replay (that frees it)."""
        self._release(ref)

    def nothing_ran(self) -> DryRunError:
        return DryRunError(
            "this value was made inside a dask_monarch.dry_run block: nothing ran, so it has "
            "no value on the ranks; make it again outside the dry run"
        )

    def storages(self) -> list[Any]:
        """The storage objects of the handles made while it stood in (alive still)."""
        return list(self._keys)

    def _release(self, ref: int) -> None:
        key = self._ref_storage.pop(ref, None)
        if key is None:
            return
        held = self._storages[key]
        held.refs.discard(ref)
        if not held.refs:
            del self._storages[key]
            for r in held.ranks:
                self.ranks[r].tensor_bytes -= held.nbytes

    def _account(self, ranks: tuple[int, ...], msg: Any) -> None:
        t = type(msg)
        if t is m.DeleteRefs:
            for ref in msg.refs:
                if ref.id < self.first_id:
                    self.real_deletes.append((ranks, ref.id))
                else:
                    self._release(ref.id)
                    for r in ranks:
                        self._recordings.pop((r, ref.id), None)
        elif t is m.BorrowCreate:  # the borrowed handle shares the lender's storage
            lender = self._ref_storage.get(msg.tensor.id)
            self._release(msg.result.id)
            self._borrowed[msg.borrow] = msg.result.id
            if lender is not None:
                self._storages[lender].refs.add(msg.result.id)
                self._ref_storage[msg.result.id] = lender
        elif t is m.BorrowLastUse:  # the borrower's binding goes (not through DeleteRefs)
            ref = self._borrowed.pop(msg.borrow, None)
            if ref is not None:
                self._release(ref)
        elif t is m.Reduce:
            self._reduce(ranks, msg)
        elif t is m.DefineRecording:
            for r in ranks:
                commands = self._recordings.setdefault((r, msg.result.id), [])
                commands.extend(m.flatten_groups(msg.commands))
        elif t is m.CallRecording:
            self._replay(ranks, msg.recording.id)
        elif t is m.SendTensor:
            self._send(msg)
        elif t is m.SendResultOfActorCall or (t is m.SendValue and msg.destination is None):
            seq = msg.seq
            future = self._futures.pop(seq, None)
            if future is not None:
                future.set_exception(
                    DryRunError(
                        f"the fetch of seq {seq} has no value: nothing runs in a dry run "
                        "(dask_monarch.dry_run computes shapes, not values); fetch after the "
                        "dry run, or leave fetches out of the code you dry-run"
                    )
                )

    def _replay(self, ranks: tuple[int, ...], recording: int) -> None:
        """Count the collectives and sends a replay of ``recording`` runs: they are commands of
        the recording, not messages. Each rank's commands hold the same message objects (one
        trace), so each is counted once, with the ranks that run it."""
        members: dict[int, tuple[Any, list[int]]] = {}
        for r in ranks:
            for command in self._recordings.get((r, recording), ()):
                if type(command) is m.Reduce or type(command) is m.SendTensor:
                    members.setdefault(id(command), (command, []))[1].append(r)
        for command, involved in members.values():
            if type(command) is m.Reduce:
                self._reduce(tuple(involved), command)
            else:
                self._send(command)

    def _reduce(self, ranks: tuple[int, ...], msg: m.Reduce) -> None:
        factory = msg.factory
        nbytes = _nbytes(factory)
        op = getattr(msg.reduction, "value", msg.reduction)
        self.collectives.append(
            Collective(
                msg.result.id,
                _KINDS[(op == "stack", bool(msg.scatter))],
                str(op),
                tuple(msg.dims),
                ranks,
                tuple(factory.size),
                str(factory.dtype).removeprefix("torch."),
                nbytes,
            )
        )
        for r in ranks:
            self.ranks[r].collective_bytes += nbytes

    def _send(self, msg: m.SendTensor) -> None:
        factory = msg.factory
        nbytes = _nbytes(factory)
        pairs = list(zip(msg.from_ranks, msg.to_ranks))
        self.sends.append(
            Send(
                msg.result.id,
                pairs,
                tuple(factory.size),
                str(factory.dtype).removeprefix("torch."),
                nbytes,
            )
        )
        for src, dst in pairs:
            if src != dst:
                self.ranks[src].sent_bytes += nbytes
                self.ranks[dst].received_bytes += nbytes


def _nbytes(factory: m.Factory) -> int:
    return math.prod(factory.size) * factory.dtype.itemsize


def by_rank(records: list, ranks: int) -> dict[int, list]:
    """Records per rank they involve (collectives: members; sends: both ends)."""
    out: dict[int, list] = defaultdict(list)
    for record in records:
        involved = (
            record.ranks
            if isinstance(record, Collective)
            else {r for pair in record.pairs for r in pair}
        )
        for r in involved:
            out[r].append(record)
    return {r: out.get(r, []) for r in range(ranks)}
