"""The compiler: a controller's buffered messages become one Dask graph per flush.

Each rank's messages are cut into *segments*: runs of consecutive steps for
one lane (a stream), or for the rank's control lane (worker-level messages:
meshes, communicators, recordings, pipes, Exit). A segment is one task,
pinned to its rank by a resource annotation and to its lane by the
``executor`` annotation. Order holds by construction (DESIGN decision 3):

* a lane's segment depends on that lane's previous segment (across flushes,
  through the tail future the controller holds), so a lane runs its messages
  in message order and never holds two tasks at once;
* a control step depends on the previous control step, and a lane segment
  that follows a control step in message order depends on it (DESIGN
  decision 5), so worker-level effects are in place before later messages;
* ``Exit`` drains: it depends on every lane's tail;
* an edge to a segment that its rank already reported done is left out: the
  order it would enforce already holds. Without it, Dask forgets each
  segment once it ran and nothing follows it: a chain of edges would keep
  every released task of a lane, and its payload, on the scheduler and the
  worker for as long as the controller lives (docs/dask.md §13);
* a dropped stream's lane (``DropLane``, its last step) leaves the compiler's
  lanes once planned; Exit still follows its tail until the controller has
  seen it run (:meth:`Compiler.forget_dropped`).

Messages for every stream of a rank (``DeleteRefs``, ``RequestStatus``) are
fanned out to each lane; ``CallRecording`` to each lane its recording uses.
Borrows synchronise their two lanes inside the rank (one-shot channels), not
through edges, which would make the graph cyclic.

Which lane runs a message is decided per rank by :mod:`.routing`, in
Monarch's per-rank mailbox order; :mod:`.precheck` then checks what the
flush's collectives, sends, borrows and exits would wait on (DESIGN decision
14). Only those messages pay for the check: the fast path (calls, fetches)
does not. A message it cannot route, or a flush that would hang or whose
ranks disagree on a collective, is a :class:`ProtocolError`: nothing of that
flush is submitted (earlier flushes are), and the controller fails with
``DeviceException`` naming the rank.
So is a message whose ``seq`` does not increase on its stream of a rank
(failures are reported by seq: two messages with one seq would blur which one
failed), and a stream beyond the ``limits.lanes`` lanes a rank may hold (each
lane is a thread on the worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from itertools import count as counter
from operator import attrgetter, is_not
from typing import Any

import cloudpickle
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from .. import config
from ..protocol import messages as m
from ..protocol.names import executor_name, task_name
from ..protocol.rules import CHECKED, FAMILY, ON_NAMED_STREAM
from ..protocol.wire import CONTROL, DropLane
from .intake import RelayTask, SegmentTask, make_task
from .precheck import Precheck
from .routing import InternalStep, Probes, ProtocolError, RankRouter

__all__ = [
    "Compiler",
    "InternalStep",
    "PayloadError",
    "Plan",
    "ProtocolError",
    "Segment",
    "segment_name",
]

# Messages that carry the seq failures are reported under: (seq, stream) (RequestStatus
# repeats the last seq; recordings run on several streams and are checked among themselves).
_SEQ_OF = {
    t: attrgetter("seq", "stream")
    for t in (m.CallFunction, m.SendValue, m.PipeRecv, m.SendResultOfActorCall)
}
_SEQ_OF[m.CallActorMethod] = attrgetter("call.seq", "call.stream")
_SEQ_OF[m.CallRecording] = lambda msg: (msg.seq, None)

# Families of bookkeeping steps: a segment is named after its other work, if any.
_BOOKKEEPING = ("status", "stream", "delete")
# A segment of mixed work is named after the first of these it holds: communication, then
# replays, then ops, then fetches (the task stream shows compute, communication, fetches).
_PRECEDENCE = (
    *("reduce", "send", "recording", "call", "actor", "pipe", "fetch", "borrow", "ref"),
    *("comm", "mesh", "exit"),  # control steps: communicators, meshes, exit
    *_BOOKKEEPING,  # a segment of bookkeeping only
)


def segment_name(steps: list, span_label: str = "") -> str:
    """``monarch_<what dominates>`` (``monarch_ops``, ``monarch_reduce``, ...), with the label
    of the ``dask_monarch.span`` it was issued in (:func:`~..protocol.names.span_label`)."""
    types = set(map(type, steps))
    families = {FAMILY.get(t, "segment") for t in types if t is not m.CommandGroup}
    if m.CommandGroup in types:  # a coalesced group: named after what is inside
        for s in steps:
            if type(s) is m.CommandGroup:
                families.update(FAMILY.get(type(inner), "segment") for inner in s.messages)
    work = families.difference(_BOOKKEEPING) or families
    if len(work) == 1:
        family = work.pop()
    else:
        family = next((f for f in _PRECEDENCE if f in work), "segment")
    return task_name(family, span_label)


@dataclass
class Segment:
    rank: int
    lane: Any
    index: int
    after: list  # keys this segment must follow
    steps: list = field(default_factory=list)

    def key(self, token: str, span_label: str = "") -> tuple:
        return (segment_name(self.steps, span_label), token, self.rank, self.lane, self.index)


@dataclass
class _LaneTail:
    next_index: int = 0
    key: tuple | None = None  # the last submitted (or planned) segment's key
    barrier: int = -1  # the control step index this lane last followed


@dataclass
class Plan:
    """One flush: tasks to submit, lanes to create first; or a protocol error and nothing."""

    tasks: list[SegmentTask | RelayTask]  # one per segment, or per wave when relayed
    keys: list
    tails: dict  # (rank, lane) -> key of the newest segment (none when relayed)
    # rank -> (stream id, creation mode) of the lanes to create before submitting
    new_lanes: dict[int, list[tuple[int, m.StreamCreationMode]]]
    counts: dict[tuple, int]  # (rank, lane) -> index of the newest segment
    messages: int
    error: ProtocolError | None = None
    rendezvous: bool = False  # a BackendNetworkInit is in it: the store must exist first
    dropped: dict[tuple, int] = field(default_factory=dict)  # (rank, lane) -> its last segment
    token: str = ""
    segments: list[SegmentTask] = field(default_factory=list)  # every rank's, relayed or not

    @property
    def graph(self) -> HighLevelGraph | None:
        """The tasks as a graph for ``Client.get``: a layer per segment holding its annotations
        (the scheduler's intake takes ``tasks`` as they are: controller/intake.py)."""
        if not self.tasks:
            return None
        layers = {}
        for task in self.tasks:
            key = task.key
            name = f"{key[0]}-{self.token}-{task.rank}-{task.lane}-{task.index}"
            layers[name] = MaterializedLayer(
                {key: make_task(self.token, task)},
                annotations={"resources": {task.resource: 1}, "executor": task.executor},
            )
        return HighLevelGraph(layers, {name: set() for name in layers})


class Compiler:
    """Turns a controller's buffer into one graph per flush (see module docs)."""

    def __init__(
        self,
        token: str,
        resources: list[str],
        done: dict | None = None,
        relay: int = 0,
        addresses: list[str] | None = None,
    ):
        self.token = token
        self.resources = resources
        # fan-out of relayed flushes (worker/relay.py); 0: a task per segment
        self.relay = relay if addresses is not None and len(resources) > 1 else 0
        self.addresses = addresses  # rank -> its worker, where relayed segments go
        probes = Probes()
        self.routers = [RankRouter(rank, probes) for rank in range(len(resources))]
        self.lanes: dict[tuple[int, Any], _LaneTail] = {}
        self.created: set[tuple[int, int]] = set()  # lanes that exist on their worker
        self.dropped: dict[tuple[int, Any], _LaneTail] = {}  # dropped lanes Exit still follows
        self.lane_counts = [0] * len(resources)  # streams each rank holds a lane for
        self.max_lanes = config.integer("limits.lanes", minimum=1)
        self.seqs: dict[tuple[int, Any], int] = {}  # (rank, stream) -> the newest seq sent
        self.done = {} if done is None else done  # (rank, lane) -> last segment run
        self.check = Precheck(len(resources), self.done)
        self.refused: ProtocolError | None = None  # why a flush was refused (then broken)
        self.span_label = ""  # of the dask_monarch.span the next flush was issued in

    def executor(self, lane: Any) -> str:
        return executor_name(self.token, lane)

    def compile(
        self, buffer: list[tuple[tuple[int, ...], Any]], final: bool | tuple[int, int] = False
    ) -> Plan:
        """The plan of one flush; ``final``: nothing more will be sent before a wait on every
        lane (``True``) or on one ``(rank, stream)``, so what waits for more is refused."""
        segments: list[Segment] = []
        open_lanes: dict[int, dict[Any, Segment]] = {}
        open_control: dict[int, Segment] = {}
        new_lanes: dict[int, list[tuple[int, m.StreamCreationMode]]] = {}
        routers = self.routers
        check = self.check
        error = None
        count = 0
        rendezvous = False
        dropped: list[tuple[int, Any]] = []
        seqs = self.seqs
        # A run of calls on the same ranks and stream (a loop of ops) joins the same segments:
        # their seqs are checked against the run's last and recorded when the run ends.
        run_ranks, run_stream, run_segments, run_seq = None, None, [], -1
        for ranks, msg in buffer:
            if (
                ranks is run_ranks
                and type(msg) is m.CallFunction
                and msg.stream is run_stream
                and msg.seq > run_seq
            ):
                run_seq = msg.seq
                for seg in run_segments:
                    seg.steps.append(msg)
                count += 1
                continue
            if run_ranks is not None:  # the run ended
                _record_seq(seqs, run_ranks, run_stream, run_seq)
                run_ranks = None
            try:
                seq_of = _SEQ_OF.get(type(msg))
                if seq_of is not None:
                    seq, stream = seq_of(msg)
                    for rank in ranks:
                        if seq <= seqs.get((rank, stream), -1):
                            self._bad_seq(rank, stream, seq, msg)
                reduce = type(msg) is m.Reduce
                if reduce or type(msg) in ON_NAMED_STREAM:
                    # the hot path: one lane per rank, no fan-out (a Reduce is also checked)
                    stream = int(msg.stream)
                    joined = []
                    for rank in ranks:
                        per_rank = open_lanes.get(rank)
                        seg = per_rank.get(stream) if per_rank else None
                        if seg is None:
                            router = routers[rank]
                            if router.exited or stream not in router.streams:
                                list(router.route(msg))  # raises the ProtocolError
                            seg = self._lane(
                                rank, stream, open_lanes, open_control, segments, new_lanes
                            )
                        if reduce:
                            check.reduce(rank, stream, msg)
                        seg.steps.append(msg)
                        joined.append(seg)
                    if type(msg) is m.CallFunction:  # a run may start here
                        run_ranks, run_stream = ranks, msg.stream
                        run_segments, run_seq = joined, msg.seq
                else:
                    checked = type(msg) in CHECKED
                    deletes = type(msg) is m.DeleteRefs  # maybe of recordings
                    for rank in ranks:
                        if deletes:
                            check.delete(rank, msg)
                        for lane, step, drains in routers[rank].route(msg):
                            if lane == CONTROL:
                                seg = self._control(
                                    rank, open_control, open_lanes, segments, drains
                                )
                                check.control(rank, step)
                                if type(step) is m.BackendNetworkInit:
                                    rendezvous = True
                            else:
                                seg = self._lane(
                                    rank, lane, open_lanes, open_control, segments, new_lanes
                                )
                                if checked:
                                    check.lane(rank, lane, step, seg.index)
                            seg.steps.append(step)
                            if type(step) is DropLane:  # its last step: close the segment
                                dropped.append((rank, lane))
                                del open_lanes[rank][lane]
            except ProtocolError as e:
                error = e
                break
            if seq_of is not None:
                for rank in ranks:
                    seqs[(rank, stream)] = seq
            count += 1
        if run_ranks is not None:
            _record_seq(seqs, run_ranks, run_stream, run_seq)
        if error is None:
            try:
                check.settle()
            except ProtocolError as e:
                error = e
            if error is None and final:
                error = check.waiting(*final) if type(final) is tuple else check.waiting()
        if error is not None:  # refused: nothing of this flush runs
            self.refused = error
            return Plan([], [], {}, {}, {}, 0, error)
        plan = self._plan(segments, new_lanes, count, error)
        plan.rendezvous = rendezvous
        for lane in dropped:  # after _plan: the tails hold their final keys
            tail = self.dropped[lane] = self.lanes.pop(lane)
            self.created.discard(lane)
            self.lane_counts[lane[0]] -= 1  # a released lane no longer counts to the cap
            plan.dropped[lane] = tail.next_index - 1
        return plan

    def forget_dropped(self, lane: tuple[int, Any]) -> None:
        """The last segment of dropped ``lane`` ran: Exit need not follow it any more."""
        self.dropped.pop(lane, None)

    def _bad_seq(self, rank: int, stream: Any, seq: int, msg: Any) -> None:
        where = "recordings" if stream is None else f"stream {int(stream)}"
        raise ProtocolError(
            rank,
            f"{type(msg).__name__}.seq={seq} does not increase: {where} "
            f"of this rank was already sent seq {self.seqs[(rank, stream)]}; "
            "give every message a new, larger seq",
        )

    def _lane(self, rank, lane, open_lanes, open_control, segments, new_lanes) -> Segment:
        per_rank = open_lanes.setdefault(rank, {})
        seg = per_rank.get(lane)
        if seg is None:
            if (rank, lane) not in self.created:
                if self.lane_counts[rank] >= self.max_lanes:
                    raise ProtocolError(
                        rank,
                        f"stream {lane} would be this rank's lane number "
                        f"{self.lane_counts[rank] + 1}, over the limit "
                        f"dask_monarch.limits.lanes={self.max_lanes} "
                        "(a lane is a thread on the worker): use fewer "
                        "streams, or raise the limit",
                    )
                self.lane_counts[rank] += 1
                self.created.add((rank, lane))
                new_lanes.setdefault(rank, []).append((lane, self.routers[rank].streams[lane]))
            tail = self.lanes.setdefault((rank, lane), _LaneTail())
            after = self._pending((rank, lane), tail)
            control = self.lanes.get((rank, CONTROL))
            if control is not None and control.next_index - 1 > tail.barrier:
                after += self._pending((rank, CONTROL), control)
                tail.barrier = control.next_index - 1
            seg = per_rank[lane] = self._new(rank, lane, tail, after, segments)
        open_control.pop(rank, None)  # a later control step must follow this lane work
        return seg

    def _control(self, rank, open_control, open_lanes, segments, drains) -> Segment:
        seg = open_control.get(rank)
        if seg is not None and drains and seg.steps:
            # a draining step (Exit) waits for every lane: it starts a segment of its own, or
            # the control steps before it in the segment would wait for those lanes too (a
            # rendezvous the peers' lane work follows would then wait on itself)
            seg = None
        if seg is None:
            tail = self.lanes.setdefault((rank, CONTROL), _LaneTail())
            after = self._pending((rank, CONTROL), tail)
            seg = open_control[rank] = self._new(rank, CONTROL, tail, after, segments)
        if drains:
            for lane, t in [*self.lanes.items(), *self.dropped.items()]:
                if lane[0] == rank and lane[1] != CONTROL:
                    seg.after.extend(k for k in self._pending(lane, t) if k not in seg.after)
        open_lanes.pop(rank, None)  # later lane work must follow this control step
        return seg

    def _pending(self, lane: tuple[int, Any], tail: _LaneTail) -> list:
        """``[key]`` of the lane's newest segment, or ``[]`` when there is none or it already
        ran (an edge to it would only keep it alive on the scheduler: see the module docs)."""
        if tail.key is None or self.done.get(lane, -1) >= tail.next_index - 1:
            return []
        return [tail.key]

    def _new(self, rank, lane, tail: _LaneTail, after, segments) -> Segment:
        seg = Segment(rank, lane, tail.next_index, after)
        tail.next_index += 1
        tail.key = _PendingKey(seg)
        segments.append(seg)
        return seg

    def _plan(self, segments: list[Segment], new_lanes, count, error) -> Plan:
        final = {id(seg): seg.key(self.token, self.span_label) for seg in segments}
        for tail in self.lanes.values():  # later flushes follow the real keys
            if isinstance(tail.key, _PendingKey):
                tail.key = final[id(tail.key.segment)]
        tasks, tails, counts = [], {}, {}
        payloads = _Payloads(segments)
        resources = self.resources
        for seg in segments:
            key = final[id(seg)]
            tails[(seg.rank, seg.lane)] = key
            counts[(seg.rank, seg.lane)] = seg.index
            after = [final[id(k.segment)] if isinstance(k, _PendingKey) else k for k in seg.after]
            tasks.append(
                SegmentTask(
                    key,
                    seg.rank,
                    seg.lane,
                    seg.index,
                    payloads.get(seg),
                    after,
                    resources[seg.rank],
                    self.executor(seg.lane),
                )
            )
        submitted, keys = tasks, list(final.values())
        if self.relay:  # a task per wave; each rank orders its own segments: no tails
            submitted = self._waves(tasks)
            keys, tails = [w.key for w in submitted], {}
        return Plan(
            submitted,
            keys,
            tails,
            new_lanes,
            counts,
            count,
            error,
            token=self.token,
            segments=tasks,
        )

    def _waves(self, tasks: list[SegmentTask]) -> list[RelayTask]:
        """One task per wave: the n-th segment of a lane in this flush, on every rank that has
        one. Each rank's entry carries its edges as ``(lane, index)`` of its own rank."""
        waves: dict[tuple, list[SegmentTask]] = {}
        seen: dict[tuple, int] = {}
        for task in tasks:
            n = seen.get((task.rank, task.lane), 0)
            seen[(task.rank, task.lane)] = n + 1
            waves.setdefault((task.lane, n), []).append(task)
        relayed = []
        for (lane, _), members in waves.items():
            members.sort(key=attrgetter("rank"))
            blobs: list[bytes] = []
            where: dict[int, int] = {}  # id of a pickle -> its place in blobs
            entries = []
            for task in members:
                ids = []
                for blob in task.payload:
                    at = where.get(id(blob))
                    if at is None:
                        at = where[id(blob)] = len(blobs)
                        blobs.append(blob)
                    ids.append(at)
                after = [(key[3], key[4]) for key in task.after]
                entries.append((task.rank, task.index, ids, after, self.addresses[task.rank]))
            first = members[0]
            wave = {
                "token": self.token,
                "lane": lane,
                "fanout": self.relay,
                "blobs": blobs,
                "entries": entries,
            }
            relayed.append(
                RelayTask(
                    first.key,
                    first.rank,
                    lane,
                    first.index,
                    wave,
                    [],
                    first.resource,
                    first.executor,
                )
            )
        return relayed


def _record_seq(seqs: dict, ranks: tuple[int, ...], stream: Any, seq: int) -> None:
    for rank in ranks:
        seqs[(rank, int(stream))] = seq


class _PendingKey:
    """The key of a segment still being filled (its name depends on its final steps)."""

    __slots__ = ("segment",)

    def __init__(self, segment: Segment):
        self.segment = segment

    def __eq__(self, other):
        return isinstance(other, _PendingKey) and other.segment is self.segment

    def __hash__(self):
        return id(self.segment)


class _Payloads:
    """Pickles a flush's segments, each step once where ranks share it.

    The ranks of a mesh are sent the same message objects, so the segments of
    one lane and index on every rank hold the same steps, but for a few steps
    made per rank at the end (a fetch's status probe, a delete of one rank's
    refs). A payload is a tuple of pickles: the prefix that every rank's
    segment shares (by identity), pickled once, then the segment's own rest,
    pickled once per distinct rest. (Pickled whole per rank, a fetch after
    1 000 buffered messages on 4 ranks pickled each of them 4 times, 3 µs a
    time.)
    """

    def __init__(self, segments: list[Segment]):
        by_position: dict[tuple, list[Segment]] = {}
        for seg in segments:
            by_position.setdefault((seg.lane, seg.index), []).append(seg)
        self._shared: dict[tuple, tuple[int, bytes]] = {}  # position -> (prefix length, pickle)
        for position, segs in by_position.items():
            first = segs[0]
            length = len(first.steps)
            for seg in segs[1:]:
                length = _common_prefix(first.steps, seg.steps, length)
            if len(segs) > 1 and length:
                self._shared[position] = (length, _dumps(first.steps[:length], first.rank))
        self._rests: dict[tuple, bytes] = {}  # (lane, index, ids of the rest's steps) -> pickle

    def get(self, seg: Segment) -> tuple[bytes, ...]:
        length, shared = self._shared.get((seg.lane, seg.index), (0, b""))
        rest = seg.steps[length:] if length else seg.steps
        if not rest:
            return (shared,)
        # The same step objects (alive in the segments: their ids are theirs) pickle alike; a
        # dict finds them at once where a search of every rank's rest was N² at N ranks.
        key = (seg.lane, seg.index, *map(id, rest))
        payload = self._rests.get(key)
        if payload is None:
            payload = self._rests[key] = _dumps(rest, seg.rank)
        return (shared, payload) if length else (payload,)


def _common_prefix(a: list, b: list, limit: int) -> int:
    """How many leading steps, up to ``limit``, ``a`` and ``b`` share (the same objects)."""
    limit = min(limit, len(a), len(b))
    return next(compress(counter(), map(is_not, a[:limit], b[:limit])), limit)


class PayloadError(Exception):
    """A step of a flush that cannot be serialised: the flush cannot be sent at all."""

    def __init__(self, rank: int, step: Any, error: BaseException):
        cause = (
            f"{type(step).__name__} {_describe(step)} cannot be serialised "
            f"({type(error).__name__}: {error}); nothing of this flush was sent"
        )
        super().__init__(f"rank {rank}: {cause}")
        self.rank = rank
        self.cause = cause


def _describe(step: Any) -> str:
    seq = getattr(step, "seq", None)
    ref = getattr(step, "reference", None)
    return f"seq {seq}" if seq is not None else f"for {ref}" if ref is not None else ""


def _dumps(steps: list, rank: int = 0) -> bytes:
    try:
        return m.dumps(steps)
    except Exception:  # closures or __main__ objects in a SetRef value, say
        try:
            return cloudpickle.dumps(steps, protocol=5)
        except Exception as e:
            raise PayloadError(rank, _culprit(steps), e) from e


def _culprit(steps: list) -> Any:
    """The first step that cannot be serialised on its own (the first step if none)."""
    for step in steps:
        try:
            cloudpickle.dumps(step, protocol=5)
        except Exception:
            return getattr(step, "step", step)  # an InternalStep names what it carries
    return steps[0]
