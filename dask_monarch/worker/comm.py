"""Collectives and point-to-point sends over torch.distributed.

Semantics: docs/protocol.md §3.11-§3.15, §3.19.

Monarch does these with NCCL only; here CPU tensors go over gloo and CUDA
tensors over NCCL (:mod:`.groups`). The controller starts a TCPStore on rank
0's worker when it first sends ``BackendNetworkInit`` and tells every rank
where it is; each group is then built over that store under its own prefix:

* the world group (``BackendNetworkInit``), warmed up with a 1-element all-reduce;
* one group per (mesh, stream, sorted dims) for ``Reduce`` (``SplitComm``);
* one group per (from stream, to stream) for ``SendTensor``
  (``BackendNetworkPointToPointInit``);
* one group per (remote process group, stream) for user functions
  (``SplitCommForProcessGroup``).

Each stream has groups of its own, so collectives on two streams of a rank
never share a communicator and cannot pair the wrong operations. NCCL's rules
hold on both backends (docs/architecture.md, "Streams and hand-offs"):

* every communicator is made at the message that declares it, on the control
  lane, so every rank makes them in message order (NCCL's is made there too,
  eagerly, never inside a lane's first operation);
* one lane issues a communicator's operations on a rank, in message order: a
  (mesh, stream, dims) group and a process group by their stream's lane, and a
  (from stream, to stream) point-to-point one by the sender's lane on senders
  and the receiver's on receivers; a rank that would both send and receive
  over a pair of different streams is refused before dispatch
  (``controller/precheck.py``, ``transfer.py``);
* every send and receive of one ``SendTensor`` on a rank is one grouped call
  on that communicator (``groups.point_to_point``).

``dask_monarch.comm.emulate-nccl`` checks the order at run time on gloo
(:mod:`.nccl_rules`). With ``backend: gloo`` on CUDA ranks, what dask_monarch
sends through gloo is staged through pinned host memory: gloo's transport
reads host memory only.

A rank whose input errored still takes part with zeros (its peers never
hang); Reduce and SendTensor report nothing. An input whose shape or dtype is
not the ``factory`` the client declared (a wrong ``propagate``, say) would
make peers receive garbage or abort gloo: it is a fresh failure of the result
(reported as :class:`~dask_monarch.protocol.wire.ValueFailed`) and the rank
takes part with zeros of the declared shape. A failure inside a collective (a
peer gone, a timeout) is fatal: the controller fails with DeviceException.

No wait on a peer outlives its controller: a rendezvous polls for its members
(:meth:`Comms.arrive`), then builds the group on a thread of its own (gloo
retries a member that left until the timeout), and a gloo collective is
waited for in slices (:func:`.groups.finish`), both giving up as soon as the controller fails or
releases the rank, instead of at the collective timeout; a send or receive
fails fast when the peer's release closes its communicator. An NCCL operation
only enqueues work on the device: :mod:`.nccl_watch` follows it to its end.

Every handler here shares one :class:`Comms` per rank (its store, groups and
hand-offs), which is why they live in one module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..protocol.messages import (
    BackendNetworkInit,
    BackendNetworkPointToPointInit,
    CreateRemoteProcessGroup,
    Factory,
    Reduce,
    ReduceOp,
    SendTensor,
    SplitComm,
    SplitCommForProcessGroup,
)
from ..protocol.wire import ValueFailed
from . import groups
from .errors import FatalError, SeqError
from .lane import Lane
from .nccl_rules import OpSequence
from .nccl_watch import NcclWatch

if TYPE_CHECKING:
    from ..protocol.messages import Ref
    from .rank import RankState

_MISSING = object()
ARRIVAL_POLL_S = 0.05  # how often a rendezvous checks its members and its controller
# (stack?, scatter?) -> the collective a Reduce is
_KINDS = {
    (False, False): "all-reduce",
    (False, True): "reduce-scatter",
    (True, False): "all-gather",
    (True, True): "all-to-all",
}
_TORCH_OPS = {op: getattr(dist.ReduceOp, op.name) for op in ReduceOp}
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn
# with a FutureWarning on every call)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comms:
    """The rendezvous and communicators one controller holds on one rank."""

    def __init__(self, state: RankState):
        self.state = state
        self.server = None  # the TCPStore server, on rank 0
        self.rendezvous: tuple[str, int] | None = None
        self.store = None
        self.prefix = ""
        self.world = None
        self.splits: dict[tuple, Any] = {}  # (mesh, stream, dims) -> group
        self.members: dict[tuple, tuple[str, tuple]] = {}  # same key -> (ranks text, peers)
        self.p2p: dict[tuple[int, int], Any] = {}
        self.remote_defs: dict[int, tuple[int, tuple[str, ...]]] = {}  # group ref -> (mesh, dims)
        self.remote: dict[tuple[int, Any], Any] = {}  # (group ref, stream) -> group
        self.handoffs: dict[Any, tuple[threading.Event, list]] = {}
        self.dropped: set[int] = set()  # streams dropped on this rank (their p2p may go)
        self.lock = threading.Lock()
        # dask_monarch.comm.emulate-nccl: each communicator's operations, checked (nccl_rules.py)
        self.emulate = bool(state.settings.get("emulate_nccl"))
        # dask_monarch.comm.gloo-connect: gloo pairs connect at first use (groups.new_group)
        self.lazy = state.settings.get("gloo_connect", "lazy") == "lazy"
        self.sequences: dict[Any, OpSequence] = {}  # group -> its checked sequence
        self.watch = NcclWatch(state)

    @property
    def host(self) -> str:
        """The address this rank's store listens on and its gloo pairs bind to."""
        return groups.reachable_host(self.state.plugin.worker.address)

    @property
    def timeout(self) -> float:
        return float(self.state.settings.get("collective_timeout") or 60.0)

    def group(
        self, key: str, ranks: list[int], what: str, lane: Lane, checked: bool = True
    ) -> dist.ProcessGroup:
        """A new group of ``ranks`` (global, in group order), named ``key`` under our prefix.

        Its rendezvous blocks ``lane`` until every member's control steps
        reach the same message (``what``): the lane shows it as waiting on them.
        ``checked``: dask_monarch issues its operations (emulate-nccl checks them;
        not a process group's, which user functions drive).
        """
        state = self.state
        cuda = None
        if state.torch_device is not None:
            cuda = "gloo" if state.settings.get("backend", "auto") == "gloo" else "nccl"
        peers = tuple((r, lane.label) for r in ranks if r != state.rank)
        waiting = f"{what} (the rendezvous of ranks {_ranks_text(ranks)})"
        lane.set_waiting(waiting, peers=peers)
        try:
            self.arrive(f"{self.prefix}{key}/", ranks, what)
            # gloo connects to every member inside the constructor, retrying a member that left
            # until the timeout: built on a thread of its own, so that the lane is free as soon as
            # the controller fails or releases the rank (the thread ends at that timeout)
            built: list = []
            done = threading.Event()

            def build() -> None:
                try:
                    pg = groups.new_group(
                        self.store,
                        f"{self.prefix}{key}/",
                        ranks,
                        state.rank,
                        host=self.host,
                        timeout=self.timeout,
                        cuda=cuda,
                        device=state.torch_device,
                        lazy=self.lazy,
                    )
                    checks = self.emulate and checked
                    built.append((pg, self._sequence(key, ranks) if checks else None))
                except BaseException as e:
                    built.append(e)
                finally:
                    done.set()

            threading.Thread(target=build, name=f"{lane.executor_name}-group", daemon=True).start()
            state.wait(lane, done, waiting, peers=peers)
            if isinstance(built[0], BaseException):
                raise built[0]
            pg, sequence = built[0]
            if sequence is not None:
                self.sequences[pg] = sequence
            return pg
        finally:
            lane.set_running()

    def _sequence(self, key: str, ranks: list[int]) -> OpSequence:
        """The checked operation sequence of the group ``key`` (emulate-nccl), over a store
        client of its own (a lane polling it must not hold another lane's client)."""
        host, port = self.rendezvous
        client = groups.connect_store(host, port, self.timeout, self.state.abort.is_set)
        store = dist.PrefixStore(f"{self.prefix}{key}/ops/", client)
        return OpSequence(store, key, ranks, self.state.rank, self.timeout, self.stopped)

    def stopped(self) -> str | None:
        """Why a wait on peers gives up now (the controller failed or released the rank)."""
        if not self.state.abort.is_set():
            return None
        return self.state.failed or "the rank was released"

    def check_collective(self, lane: Lane, pg: Any, what: str) -> None:
        """emulate-nccl: ``lane`` issues ``what`` on ``pg`` next; every member must too."""
        sequence = self.sequences.get(pg)
        if sequence is not None:
            sequence.collective(lane, what)

    def arrive(self, prefix: str, ranks: list[int], what: str) -> None:
        """Say this rank reached the rendezvous under ``prefix``; wait until every member did.

        The part of building a group that waits on peers, done here in short
        polls rather than inside gloo's store wait: it gives up as soon as the
        controller fails or releases the rank (a member that never comes would
        otherwise hold the lane until the collective timeout), and a timeout
        names the members that never came. Each member polls one key, which
        the last to arrive sets (:func:`announce_arrival`): polling every
        member's key would cost the store ``N`` checks per member and poll,
        ``N²`` in all, at hundreds of ranks more than it serves.
        """
        state = self.state
        store = dist.PrefixStore(prefix, self.store)
        announce_arrival(store, state.rank, len(ranks))
        deadline = time.monotonic() + self.timeout
        while not store.check([ALL_ARRIVED]):
            if state.abort.is_set():
                raise FatalError(
                    f"{what}: rank {state.rank} stopped waiting for the rendezvous of ranks "
                    f"{_ranks_text(ranks)}: {state.failed or 'the rank was released'}"
                )
            if time.monotonic() > deadline:
                missing = [r for r in ranks if not store.check([f"arrived/{r}"])]
                raise FatalError(
                    f"{what}: ranks {_ranks_text(missing)} never reached the rendezvous of "
                    f"ranks {_ranks_text(ranks)} within {self.timeout:g}s "
                    "(dask_monarch.timeouts.collective): send it to every member"
                )
            time.sleep(ARRIVAL_POLL_S)

    def handoff(self, key: Any) -> tuple[threading.Event, list]:
        """A one-shot channel between two lanes of this rank (same-rank copies)."""
        with self.lock:
            return self.handoffs.setdefault(key, (threading.Event(), []))

    def release_stream(self, stream: int, drain: Callable[[], None] | None = None) -> None:
        """Free the communicators of a dropped ``stream``.

        Its Reduce and process-group communicators go at once: every rank ran
        the stream's collectives before its last step. A point-to-point
        communicator goes once both its streams were dropped here. An NCCL
        group is aborted (``groups.release_group``), which ends its operations
        in flight, and on the host they were only enqueued: ``drain`` first
        waits for the stream's device work (its peers' halves of the last
        collectives would otherwise wait for ours until their timeout).
        """
        self.dropped.add(stream)
        gone = [self.splits.pop(k) for k in [k for k in self.splits if k[1] == stream]]
        gone += [self.remote.pop(k) for k in [k for k in self.remote if k[1] == stream]]
        gone += [
            self.p2p.pop(k)
            for k in [k for k in self.p2p if stream in k and all(s in self.dropped for s in k)]
        ]
        if drain is not None and any(groups.uses_nccl(pg) for pg in gone):
            drain()
        for pg in gone:
            self.sequences.pop(pg, None)
            groups.release_group(pg)

    def close(self) -> None:
        for pg in [self.world, *self.splits.values(), *self.p2p.values(), *self.remote.values()]:
            if pg is not None:
                groups.release_group(pg)
        self.world = self.store = self.server = None
        self.splits.clear()
        self.p2p.clear()
        self.remote.clear()
        self.sequences.clear()
        self.watch.clear()


ALL_ARRIVED = "complete"  # the key of a rendezvous that every member reached


def announce_arrival(store: dist.Store, rank: int, members: int) -> None:
    """Mark ``rank`` arrived at the rendezvous of ``members`` ranks under ``store``'s prefix;
    the last to arrive marks it complete (:data:`ALL_ARRIVED`)."""
    store.set(f"arrived/{rank}", b"1")  # who came: a timeout names who did not
    if store.add("arrivals", 1) == members:
        store.set(ALL_ARRIVED, b"1")


def comms_of(state: RankState) -> Comms:
    comms = getattr(state, "comms", None)
    if comms is None:
        comms = state.comms = Comms(state)
        state.on_release(comms.close)
    return comms


# -- rendezvous (called through Client.run by the controller) --------------------------------


def start_rendezvous(state: RankState) -> tuple[str, int]:
    """Start the controller's store on this worker (rank 0); returns ``(host, port)``."""
    comms = comms_of(state)
    if comms.server is None:
        comms.server, port = groups.start_store(comms.host, comms.timeout)
        comms.rendezvous = (comms.host, port)
    return comms.rendezvous


def set_rendezvous(state: RankState, host: str, port: int) -> None:
    comms_of(state).rendezvous = (host, port)


# -- worker-level messages (control lane) ----------------------------------------------------


def _fatal_call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except FatalError:
        raise
    except Exception as e:
        raise FatalError(f"{what} failed: {type(e).__name__}: {e}") from e


def backend_network_init(lane: Lane, msg: BackendNetworkInit) -> None:
    """Join the world group of every rank (blocks until all ranks arrive; idempotent)."""
    comms = comms_of(lane.rank)
    if comms.world is not None:
        return
    if comms.rendezvous is None:
        raise FatalError("BackendNetworkInit: the controller set up no rendezvous")
    host, port = comms.rendezvous
    if comms.server is not None:
        comms.store = comms.server
    else:
        comms.store = _fatal_call(
            "connecting to the controller's store",
            groups.connect_store,
            host,
            port,
            comms.timeout,
            lane.rank.abort.is_set,
        )
    comms.prefix = f"{msg.unique_id or 'world'}/"
    world = list(range(lane.rank.world_size))
    comms.world = _fatal_call(
        "BackendNetworkInit", comms.group, "world", world, "BackendNetworkInit", lane
    )
    cuda = lane.rank.torch_device is not None and groups.uses_nccl(comms.world)
    warm_up = torch.ones(1, device=lane.rank.torch_device if cuda else "cpu")
    what = f"the BackendNetworkInit warm-up all-reduce of ranks {_ranks_text(world)}"
    lane.set_waiting(what, peers=tuple((r, lane.label) for r in world if r != lane.rank.rank))
    _fatal_call("BackendNetworkInit warm-up", comms.check_collective, lane, comms.world, "warm-up")
    work = _fatal_call(
        "BackendNetworkInit warm-up", dist.all_reduce, warm_up, group=comms.world, async_op=True
    )
    _fatal_call("BackendNetworkInit warm-up", _finish, lane, work, cuda, what)
    lane.set_running()


def split_comm(lane: Lane, msg: SplitComm) -> None:
    """Create the communicator Reduce uses for (mesh, stream, sorted dims).

    Sent to every rank; a no-op without a world group or on a rank outside
    the mesh. Members rendezvous among themselves.
    """
    comms = comms_of(lane.rank)
    mesh = lane.rank.meshes.get(msg.device_mesh.id)
    if comms.world is None or mesh is None:
        return
    dims = tuple(sorted(msg.dims))
    key = (msg.device_mesh.id, msg.stream.id, dims)
    if key in comms.splits:
        raise FatalError(
            f"SplitComm: stream {msg.stream.id} already has a communicator for "
            f"dims {list(dims)} of mesh r{msg.device_mesh.id}"
        )
    unknown = [d for d in dims if d not in mesh.dims]
    if unknown:
        raise FatalError(f"SplitComm: mesh r{msg.device_mesh.id} has no dims {unknown}")
    ranks = mesh.ranks_for_dims(list(dims)) if dims else mesh.all_ranks
    name = f"split/{msg.device_mesh.id}/{msg.stream.id}/{','.join(dims)}/{_ranks_key(ranks)}"
    comms.splits[key] = _fatal_call(
        "SplitComm", comms.group, name, ranks, f"SplitComm of stream {msg.stream.id}", lane
    )
    me = lane.rank.rank
    comms.members[key] = (_ranks_text(ranks), tuple((r, msg.stream.id) for r in ranks if r != me))


def point_to_point_init(lane: Lane, msg: BackendNetworkPointToPointInit) -> None:
    """Create the communicator SendTensor uses from ``from_stream`` to ``to_stream``."""
    comms = comms_of(lane.rank)
    key = (msg.from_stream.id, msg.to_stream.id)
    if comms.world is None or key in comms.p2p:
        return
    world = list(range(lane.rank.world_size))
    comms.p2p[key] = _fatal_call(
        "BackendNetworkPointToPointInit",
        comms.group,
        f"p2p/{key[0]}/{key[1]}",
        world,
        f"BackendNetworkPointToPointInit of streams {key[0]}->{key[1]}",
        lane,
    )


def create_remote_process_group(lane: Lane, msg: CreateRemoteProcessGroup) -> None:
    """Remember a process group over some dims of a mesh; fatal on a duplicate id.

    Semantics: docs/protocol.md §3.14.
    """
    comms = comms_of(lane.rank)
    if msg.device_mesh.id not in lane.rank.meshes:
        raise FatalError(
            f"CreateRemoteProcessGroup r{msg.result.id}: unknown device mesh r{msg.device_mesh.id}"
        )
    if msg.result.id in comms.remote_defs:
        raise FatalError(f"CreateRemoteProcessGroup: r{msg.result.id} already exists")
    comms.remote_defs[msg.result.id] = (msg.device_mesh.id, tuple(sorted(msg.dims)))


def split_comm_for_process_group(lane: Lane, msg: SplitCommForProcessGroup) -> None:
    """Create the torch ProcessGroup a user function gets for a remote group on a stream."""
    comms = comms_of(lane.rank)
    if comms.world is None:
        return
    definition = comms.remote_defs.get(msg.remote_process_group.id)
    if definition is None:
        raise FatalError(
            f"SplitCommForProcessGroup: unknown process group r{msg.remote_process_group.id}"
        )
    key = (msg.remote_process_group.id, msg.stream.id)
    if key in comms.remote:
        return
    mesh_id, dims = definition
    mesh = lane.rank.meshes[mesh_id]
    ranks = mesh.ranks_for_dims(list(dims)) if dims else mesh.all_ranks
    name = f"pg/{key[0]}/{key[1]}/{_ranks_key(ranks)}"
    comms.remote[key] = _fatal_call(
        "SplitCommForProcessGroup",
        comms.group,
        name,
        ranks,
        f"SplitCommForProcessGroup r{key[0]} of stream {key[1]}",
        lane,
        checked=False,
    )


def process_groups_for(lane: Lane, refs: Iterable[Ref]) -> dict[int, dist.ProcessGroup]:
    """The torch groups a CallFunction lists, for this lane's stream (fatal if missing)."""
    comms = comms_of(lane.rank)
    found = {}
    for ref in refs:
        pg = comms.remote.get((ref.id, lane.label))
        if pg is None:
            raise FatalError(
                f"process group r{ref.id} has no communicator on this stream "
                "(SplitCommForProcessGroup was not sent)"
            )
        found[ref.id] = pg
    return found


def _ranks_key(ranks: list[int]) -> str:
    return "-".join(map(str, ranks))


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


# -- stream messages -------------------------------------------------------------------------


def _input(lane: Lane, ref, what: str):
    value = lane.env.get(ref.id, _MISSING)
    if value is _MISSING:
        raise FatalError(f"{what}: r{ref.id} is not on this stream")
    return value


class ValueMismatch(Exception):
    """A tensor is not what the client declared it to be (shape or dtype)."""


def _declared(lane: Lane, value: Any, factory: Factory, what: str, ref) -> SeqError | None:
    """The fresh failure of an input that does not match its declared ``factory``, else None.

    Reported once, naming the op, the rank and both metadata; the caller
    takes part with ``factory.zeros()`` so that its peers never see garbage.
    """
    if type(value) is SeqError:
        return None
    if isinstance(value, torch.Tensor):
        if value.dtype is factory.dtype and tuple(value.shape) == factory.size:
            return None
        actual = f"shape {tuple(value.shape)} dtype {value.dtype}"
    else:
        actual = f"a {type(value).__name__}, not a tensor"
    exc = ValueMismatch(
        f"{what} on rank {lane.rank.rank}: r{ref.id} is {actual}, but the client declared shape "
        f"{factory.size} dtype {factory.dtype} (the function that made it returned something "
        "else than its propagation said: fix its propagate or its result); this rank took part "
        "with zeros of the declared shape"
    )
    if lane.recording is not None:
        return lane.recording.fresh_error(lane.rank, exc)
    error = SeqError.from_exception(lane.last_seq, exc)
    lane.rank.record_error(error)
    return error


def _report_mismatch(lane: Lane, error: SeqError, result) -> None:
    if lane.recording is None:
        lane.rank.report(ValueFailed(lane.rank.rank, result.id, error.error))


def reduce(lane: Lane, msg: Reduce) -> None:
    """A collective over the mesh dims; every member takes part, even with an error.

    Semantics: docs/protocol.md §3.11.

    An errored input is replaced by zeros from the factory, made on the rank's
    device (``out`` is then ignored), and the result is a valid tensor; nothing
    is reported. Missing inputs, a missing communicator and failures inside the
    collective are fatal.
    """
    dims = tuple(sorted(msg.dims))
    state = lane.rank
    comms = comms_of(state)
    key = (msg.mesh.id, lane.label, dims)
    pg = comms.splits.get(key)
    if pg is None:
        raise FatalError(
            f"Reduce over {list(dims)} of mesh r{msg.mesh.id}: this stream "
            "has no communicator for them (SplitComm was not sent)"
        )
    value = _input(lane, msg.tensor, "Reduce")
    out = _input(lane, msg.out, "Reduce out") if msg.out is not None else None
    if type(value) is SeqError:
        if lane.recording is not None:
            lane.recording.dependent(value)
        value, out = state.device.zeros(msg.factory), None
    if type(out) is SeqError:
        out = None
    mismatch = _declared(
        lane, value, msg.factory, f"Reduce {msg.reduction!r} over {list(dims)}", msg.tensor
    )
    if mismatch is not None:
        value, out = state.device.zeros(msg.factory), None
    members, peers = comms.members[key]
    op = getattr(msg.reduction, "value", msg.reduction)
    kind = _KINDS[(op == "stack", bool(msg.scatter))]
    what = f"{kind} ({op}) over {list(dims)} of mesh r{msg.mesh.id} with ranks {members}"
    lane.set_waiting(what, peers=peers)
    signature = f"{kind} {op} of {_metadata(msg.factory)} (r{msg.result.id})"
    _fatal_call(f"Reduce over {list(dims)}", comms.check_collective, lane, pg, signature)
    output = _fatal_call(f"Reduce over {list(dims)}", _collective, lane, pg, msg, value, out, what)
    lane.set_running()
    if mismatch is not None:
        _report_mismatch(lane, mismatch, msg.result)
        lane.env[msg.result.id] = mismatch
        for ref in (msg.out, msg.tensor if msg.in_place else None):
            if ref is not None:
                lane.env[ref.id] = mismatch
        return
    lane.env[msg.result.id] = output


def _metadata(factory: Factory) -> str:
    return f"{str(factory.dtype).removeprefix('torch.')}{list(factory.size)}"


_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


def _finish(lane: Lane, work, cuda: bool, what: str) -> None:
    """Wait for a collective; give up when the controller fails or releases the rank.

    A gloo op is waited for in slices (a peer that never comes holds the op,
    not the lane, until the collective timeout); an NCCL op is only enqueued
    on the device here, so its wait never blocks on a peer: the lane's stream
    waits for it, and :class:`NcclWatch` follows it to its end.
    """
    state = lane.rank
    if cuda:
        work.wait()
        comms_of(state).watch.add(work, what)
        return
    if not groups.finish(work, state.abort.is_set, comms_of(state).timeout):
        raise FatalError(
            f"stopped waiting for its peers: {state.failed or 'the rank was released'}"
        )


def _collective(
    lane: Lane, pg, msg: Reduce, value: torch.Tensor, out: torch.Tensor | None, what: str
) -> torch.Tensor:
    if value.is_cuda and not groups.uses_nccl(pg):
        return _through_host(lane, pg, msg, value, out, what)
    n = pg.size()
    cuda = value.is_cuda
    if msg.reduction == "stack":
        if not msg.scatter:  # all-gather: [n, *shape]
            if msg.in_place:
                raise FatalError("Reduce: an in-place stack is not possible (the shape grows)")
            output = value.new_empty((n, *value.shape))
            work = _all_gather(
                output.view(-1), value.contiguous().view(-1), group=pg, async_op=True
            )
            _finish(lane, work, cuda, what)
        else:  # all-to-all: chunks along dim 0
            output = value if msg.in_place else out if out is not None else value.clone()
            source = (
                value.clone(memory_format=torch.contiguous_format)
                if output is value
                else value.contiguous()
            )
            gathered = (
                output
                if output.is_contiguous()
                else torch.empty_like(output, memory_format=torch.contiguous_format)
            )
            work = dist.all_to_all_single(gathered, source, group=pg, async_op=True)
            _finish(lane, work, cuda, what)
            if gathered is not output:
                output.copy_(gathered)
            return output
    else:
        op = _TORCH_OPS[msg.reduction]
        if msg.reduction in _BITWISE and cuda:
            raise FatalError(
                f"Reduce {msg.reduction.name}: NCCL (the backend of CUDA tensors "
                "here) has no bitwise reductions; use dask_monarch.backend: gloo"
            )
        if msg.scatter:  # reduce-scatter: shape[1:]
            if msg.in_place:
                raise FatalError("Reduce: an in-place scatter is not possible (the shape shrinks)")
            if value.dim() == 0 or value.shape[0] != n:
                raise FatalError(
                    f"Reduce: scattering needs dim 0 of size {n}, got {tuple(value.shape)}"
                )
            output = value.new_empty(value.shape[1:])
            work = _reduce_scatter(
                output.view(-1), value.contiguous().view(-1), op=op, group=pg, async_op=True
            )
            _finish(lane, work, cuda, what)
        else:  # all-reduce, of a contiguous tensor (NCCL refuses others), copied back after
            output = value if msg.in_place else out
            if output is None:
                reduced = output = value.clone(memory_format=torch.contiguous_format)
            elif output.is_contiguous():
                reduced = output
                if output is not value:
                    output.copy_(value)
            else:
                reduced = value.clone(memory_format=torch.contiguous_format)
            _finish(lane, dist.all_reduce(reduced, op=op, group=pg, async_op=True), cuda, what)
            if reduced is not output:
                output.copy_(reduced)
            return output
    if out is not None:
        out.copy_(output)
        return out
    return output


def _through_host(
    lane: Lane, pg, msg: Reduce, value: torch.Tensor, out: torch.Tensor | None, what: str
) -> torch.Tensor:
    """A collective of CUDA tensors over gloo (``backend: gloo`` on a CUDA rank): on pinned
    host copies, the lane's stream synchronised first, the result copied back after.

    gloo's transport reads host memory; some of its ops stage CUDA tensors
    themselves and others would read device pointers as host ones. In place
    and ``out`` keep their meaning: the result lands in the same device tensor.
    """
    host_out = _to_host(out) if out is not None else None
    result = _collective(lane, pg, msg, _to_host(value), host_out, what)
    if msg.in_place:
        value.copy_(result)
        return value
    if out is not None:
        out.copy_(result)
        return out
    return result.to(value.device)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor, complete when this returns (the copy waits for
    the lane's stream, which made the tensor)."""
    host = _host_like(tensor)
    host.copy_(tensor)
    return host


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, pin_memory=True)


def send_tensor(lane: Lane, msg: SendTensor) -> None:
    """Copy tensors between two equally sized rank slices, paired in row-major order.

    Semantics: docs/protocol.md §3.19.

    A sender sends its tensor (zeros if it errored); a receiver binds a fresh
    buffer and receives into it, both made on the rank's device. A rank sending
    to itself binds a deep copy (an error is copied as the error); when the two
    streams differ, the copy crosses from the sending lane to the receiving
    lane inside the rank, as a hand-off: an event recorded on the sender's
    stream, waited on by the receiver's, which also keeps the copy's block from
    reuse. Everything a lane sends and receives for the message is one grouped
    call on the (from stream, to stream) communicator, on every backend: NCCL
    would deadlock on a pairwise exchange issued as two calls, and mixes
    communicators when some ranks group and others do not. (A rank both sends
    and receives remotely only when the two streams are one: the pre-dispatch
    check refuses the rest.)
    """
    state = lane.rank
    me = state.rank
    sending = lane.label == msg.from_stream.id and me in msg.from_ranks
    receiving = lane.label == msg.to_stream.id and me in msg.to_ranks
    if not sending and not receiving:
        raise FatalError(f"SendTensor: rank {me} neither sends nor receives on this stream")
    if len(msg.from_ranks) != len(msg.to_ranks):
        raise FatalError(
            f"SendTensor of r{msg.tensor.id}: from_ranks has {len(msg.from_ranks)} "
            f"ranks but to_ranks has {len(msg.to_ranks)}; ranks pair one to one, so "
            "both slices must have the same size"
        )
    to_rank = msg.to_ranks.get(msg.from_ranks.index(me)) if sending else None
    from_rank = msg.from_ranks.get(msg.to_ranks.index(me)) if receiving else None
    comms = comms_of(state)
    value = _input(lane, msg.tensor, "SendTensor") if sending else None
    if type(value) is SeqError and lane.recording is not None:
        lane.recording.dependent(value)
    if sending:
        mismatch = _declared(lane, value, msg.factory, f"SendTensor to rank {to_rank}", msg.tensor)
        if mismatch is not None:
            _report_mismatch(lane, mismatch, msg.result)
            value = mismatch  # sent as zeros of the declared shape, bound as the error
    handoff_key = msg.result.id if lane.recording is None else (lane.recording.seq, msg.result.id)

    if to_rank == me:  # a copy that stays on this rank: never shares storage with the source
        copy = value if type(value) is SeqError else value.clone()
        if receiving:
            lane.env[msg.result.id] = copy
        else:
            event, box = comms.handoff(handoff_key)
            box.append((copy, state.device.record(lane.stream)))
            event.set()
    if from_rank == me and not sending:
        event, box = comms.handoff(handoff_key)
        state.wait(
            lane,
            event,
            f"the copy of r{msg.tensor.id} from stream {msg.from_stream.id}",
            peers=((me, msg.from_stream.id),),
        )
        copy, copied = box[0]
        state.device.wait(lane.stream, copied)
        state.device.keep(copy, lane.stream)
        lane.env[msg.result.id] = copy
        with comms.lock:
            comms.handoffs.pop(handoff_key, None)

    remote_send = sending and to_rank != me
    remote_recv = receiving and from_rank != me
    if not (remote_send or remote_recv):
        return
    pg = comms.p2p.get((msg.from_stream.id, msg.to_stream.id))
    if pg is None:
        raise FatalError(
            f"SendTensor from stream {msg.from_stream.id} to {msg.to_stream.id}: no "
            "communicator (BackendNetworkPointToPointInit was not sent)"
        )
    tag = msg.result.id % (2**31 - 1)
    if remote_send and remote_recv:
        what = (
            f"send r{msg.tensor.id} to rank {to_rank} and receive r{msg.result.id} from "
            f"rank {from_rank}"
        )
        peers = ((to_rank, msg.to_stream.id), (from_rank, msg.from_stream.id))
    elif remote_send:
        what = f"send r{msg.tensor.id} to rank {to_rank} (stream {msg.to_stream.id})"
        peers = ((to_rank, msg.to_stream.id),)
    else:
        what = f"receive r{msg.result.id} from rank {from_rank} (stream {msg.from_stream.id})"
        peers = ((from_rank, msg.from_stream.id),)
    lane.set_waiting(what, peers=peers)

    def exchange():
        metadata = _metadata(msg.factory)
        sequence = comms.sequences.get(pg)
        if sequence is not None:
            sequence.point_to_point(
                lane,
                f"SendTensor r{msg.result.id}",
                {to_rank: metadata} if remote_send else {},
                {from_rank: metadata} if remote_recv else {},
            )
        send = recv = None
        if remote_send:
            tensor = state.device.zeros(msg.factory) if type(value) is SeqError else value
            send = (tensor.contiguous(), to_rank)
        buffer = state.device.empty(msg.factory) if remote_recv else None
        if remote_recv:
            recv = (buffer, from_rank)
        on_gpu = (send[0] if send is not None else buffer).is_cuda
        nccl = on_gpu and groups.uses_nccl(pg)
        if on_gpu and not nccl:  # gloo on a CUDA rank: host copies
            send = (_to_host(send[0]), send[1]) if send is not None else None
            recv = (_host_like(buffer), from_rank) if recv is not None else None
        works = groups.point_to_point(pg, send, recv, tag)
        if nccl:  # enqueued on the device: the lane's stream waits, the watch follows it
            for work in works:
                work.wait()
                comms.watch.add(work, f"SendTensor r{msg.result.id} ({what})")
        else:
            # a plain wait: a timed wait on a gloo send or receive closes its pair when it
            # expires (the peer's release closes it, so this one fails fast then too)
            for work in works:
                work.wait()
        if recv is not None:
            if recv[0] is not buffer:
                buffer.copy_(recv[0])
            lane.env[msg.result.id] = buffer

    _fatal_call(f"SendTensor of r{msg.tensor.id}", exchange)
    lane.set_running()
