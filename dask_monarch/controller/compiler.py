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
* ``Exit`` drains: it depends on every lane's tail.

Messages for every stream of a rank (``DeleteRefs``, ``RequestStatus``) are
fanned out to each lane; ``CallRecording`` to each lane its recording uses.
Borrows synchronise their two lanes inside the rank (one-shot channels), not
through edges, which would make the graph cyclic.

The compiler also keeps Monarch's per-rank mailbox order: it knows every
stream, borrow and recording of a rank, because routing needs them (a
``BorrowFirstUse`` names only its borrow). A message it cannot route (unknown
stream, borrow out of order, recording misuse, anything after ``Exit``) is a
:class:`ProtocolError`: the valid prefix is submitted, then the controller
fails with ``DeviceException`` naming the rank.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
from dask._task_spec import Task, TaskRef
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

from ..protocol import messages as m
from ..protocol.names import executor_name
from ..protocol.wire import CONTROL, ReadRef, StatusProbe
from ..worker.plugin import run_segment


class ProtocolError(Exception):
    """A message that breaks Monarch's protocol on ``rank`` (fatal for the controller)."""

    def __init__(self, rank: int, cause: str):
        super().__init__(f"rank {rank}: {cause}")
        self.rank = rank
        self.cause = cause


# --------------------------------------------------------------------------- routing

# Messages that run on the one stream they name (the compiler's fast path).
_STREAM_MESSAGES = frozenset({m.CallFunction, m.SendValue, m.PipeRecv, m.SetRefUnitTestsOnly,
                              m.GetRefUnitTestsOnly, m.Reduce, m.SendResultOfActorCall})
_LANE_MESSAGES = (m.CallFunction, m.SendValue, m.PipeRecv, m.SetRefUnitTestsOnly,
                  m.GetRefUnitTestsOnly, m.Reduce, m.RecordingFormal, m.RecordingResult,
                  m.SendResultOfActorCall)
_CONTROL_MESSAGES = (m.CreateDeviceMesh, m.CreateRemoteProcessGroup, m.BackendNetworkInit,
                     m.BackendNetworkPointToPointInit, m.SplitComm, m.SplitCommForProcessGroup,
                     m.CreatePipe, m.DefineRecording)

CREATED, FIRST_USED, LAST_USED = "created", "first-used", "last-used"


@dataclass
class _Borrow:
    from_stream: int
    to_stream: int
    state: str = CREATED


@dataclass
class _Definition:
    """A recording whose chunks are still arriving."""

    ref: int
    next_index: int
    total: int
    commands: list = field(default_factory=list)


class RankRouter:
    """Monarch's worker mailbox order for one rank: which lane runs each message."""

    def __init__(self, rank: int):
        self.rank = rank
        self.streams: dict[int, None] = {}  # insertion-ordered set of stream ids
        self.borrows: dict[int, _Borrow] = {}
        self.recordings: dict[int, tuple[int, ...]] = {}  # complete recording -> its streams
        self.defining: _Definition | None = None
        self.exited = False

    def error(self, cause: str) -> ProtocolError:
        return ProtocolError(self.rank, cause)

    def stream(self, ref: m.StreamRef, what: str) -> int:
        if ref.id not in self.streams:
            raise self.error(f"{what} names stream {ref.id}, which was never created on this rank")
        return ref.id

    def route(self, msg: Any) -> Iterable[tuple[Any, Any, bool]]:
        """Yield ``(lane, step, drains)`` for one message; ``lane`` is a stream id or CONTROL."""
        if self.exited:
            raise self.error(f"{type(msg).__name__} sent after Exit")
        t = type(msg)
        if t is m.RequestStatus and self.defining is not None:
            raise self.error(f"RequestStatus while recording r{self.defining.ref} is being defined")
        if t is m.CallActorMethod:
            yield self.stream(msg.call.stream, "CallActorMethod"), msg, False
        elif t in _LANE_MESSAGES:
            yield self.stream(msg.stream, t.__name__), msg, False
        elif t is m.CommandGroup:
            for inner in msg.messages:
                yield from self.route(inner)
        elif t is m.CreateStream:
            self.streams[msg.id.id] = None
            yield msg.id.id, msg, False
        elif t is m.DeleteRefs:
            for stream in self.streams:
                yield stream, msg, False
        elif t is m.RequestStatus:
            lanes = len(self.streams)
            probe = StatusProbe(msg.seq, _next_probe(), max(lanes, 1))
            if lanes:
                for stream in self.streams:
                    yield stream, probe, False
            else:
                yield CONTROL, probe, False
        elif t in (m.BorrowCreate, m.BorrowFirstUse, m.BorrowLastUse, m.BorrowDrop):
            yield self.route_borrow(msg), msg, False
        elif t is m.SendTensor:
            yield from self.route_send(msg)
        elif t is m.CallRecording:
            streams = self.recordings.get(msg.recording.id)
            if streams is None:
                raise self.error(f"CallRecording of r{msg.recording.id}, which is not a "
                                 "completely defined recording")
            for stream in streams:
                yield stream, msg, False
        elif t is m.DefineRecording:
            self.define(msg)
            yield CONTROL, msg, False
        elif t in _CONTROL_MESSAGES:
            yield CONTROL, msg, False
        elif t is m.Exit:
            self.exited = True
            yield CONTROL, msg, True
        elif t is InternalStep:
            yield self.stream(m.StreamRef(msg.stream), type(msg.step).__name__), msg.step, False
        else:
            raise self.error(f"{t.__name__} is not a worker message")

    def route_borrow(self, msg) -> int:
        t = type(msg)
        if t is m.BorrowCreate:
            if msg.borrow in self.borrows:
                raise self.error(f"BorrowCreate of borrow {msg.borrow}, which already exists")
            src = self.stream(msg.from_stream, "BorrowCreate")
            dst = self.stream(msg.to_stream, "BorrowCreate")
            self.borrows[msg.borrow] = _Borrow(src, dst)
            return src
        borrow = self.borrows.get(msg.borrow)
        if borrow is None:
            raise self.error(f"{t.__name__} of unknown borrow {msg.borrow}")
        expected = {m.BorrowFirstUse: CREATED, m.BorrowLastUse: FIRST_USED,
                    m.BorrowDrop: LAST_USED}[t]
        if borrow.state != expected:
            raise self.error(f"{t.__name__} of borrow {msg.borrow} in state '{borrow.state}' "
                             f"(expected '{expected}')")
        if t is m.BorrowFirstUse:
            borrow.state = FIRST_USED
            return borrow.to_stream
        if t is m.BorrowLastUse:
            borrow.state = LAST_USED
            return borrow.to_stream
        del self.borrows[msg.borrow]
        return borrow.from_stream

    def route_send(self, msg: m.SendTensor):
        sender = self.rank in msg.from_ranks
        receiver = self.rank in msg.to_ranks
        if not sender and not receiver:
            raise self.error("SendTensor sent to a rank that neither sends nor receives")
        src = self.stream(msg.from_stream, "SendTensor") if sender else None
        dst = self.stream(msg.to_stream, "SendTensor") if receiver else None
        if src is not None:
            yield src, msg, False
        if dst is not None and dst != src:
            yield dst, msg, False

    def define(self, msg: m.DefineRecording) -> None:
        d = self.defining
        if d is None:
            if msg.index != 0:
                raise self.error(f"DefineRecording r{msg.result.id} starts at chunk {msg.index}")
            if msg.result.id in self.recordings:
                raise self.error(f"DefineRecording r{msg.result.id}, which is already defined")
            d = self.defining = _Definition(msg.result.id, 0, msg.ntotal_messages)
        elif msg.result.id != d.ref:
            raise self.error(f"DefineRecording r{msg.result.id} while r{d.ref} is being defined")
        if msg.index != d.next_index:
            raise self.error(f"DefineRecording r{d.ref}: chunk {msg.index} arrived when "
                             f"{d.next_index} was expected")
        if msg.ntotal_messages != d.total:
            raise self.error(f"DefineRecording r{d.ref}: chunk {msg.index} says "
                             f"{msg.ntotal_messages} chunks, the first said {d.total}")
        d.commands.extend(msg.commands)
        d.next_index += 1
        if d.next_index == d.total:
            streams: dict[int, None] = {}
            for command in m.flatten_groups(d.commands):
                for ref in _streams_of(command):
                    streams[self.stream(ref, f"recording r{d.ref}")] = None
            self.recordings[d.ref] = tuple(streams)
            self.defining = None


def _streams_of(msg) -> list[m.StreamRef]:
    """The streams a recorded command runs on."""
    t = type(msg)
    if t is m.CallActorMethod:
        return [msg.call.stream]
    if t in (m.BorrowCreate, m.SendTensor, m.BackendNetworkPointToPointInit):
        return [msg.from_stream, msg.to_stream]
    stream = getattr(msg, "stream", None)
    return [stream] if isinstance(stream, m.StreamRef) else []


_probe_counter = iter(range(1, 2**63))


def _next_probe() -> int:
    return next(_probe_counter)


class InternalStep:
    """A compiler-made step for one lane of one rank (e.g. a ref read for ``get_ref``)."""

    __slots__ = ("stream", "step")

    def __init__(self, stream: int, step: Any):
        self.stream = stream
        self.step = step


# --------------------------------------------------------------------------- segments

# Task group names (the dashboard groups by ``key_split``, i.e. the key's first element).
_FAMILY = {
    m.CallFunction: "call", m.SendValue: "fetch", m.Reduce: "reduce", m.SendTensor: "send",
    m.BorrowCreate: "borrow", m.BorrowFirstUse: "borrow", m.BorrowLastUse: "borrow",
    m.BorrowDrop: "borrow", m.CallRecording: "recording", m.DefineRecording: "recording",
    m.RecordingFormal: "recording", m.RecordingResult: "recording", m.PipeRecv: "pipe",
    m.CreatePipe: "pipe", m.SendResultOfActorCall: "actor", m.CallActorMethod: "actor",
    m.SetRefUnitTestsOnly: "ref", m.GetRefUnitTestsOnly: "ref", ReadRef: "ref",
    m.CreateDeviceMesh: "mesh", m.CreateRemoteProcessGroup: "comm", m.BackendNetworkInit: "comm",
    m.BackendNetworkPointToPointInit: "comm", m.SplitComm: "comm",
    m.SplitCommForProcessGroup: "comm", m.Exit: "exit", StatusProbe: "status",
    m.CreateStream: "stream", m.DeleteRefs: "delete",
}
_BOOKKEEPING = ("status", "stream", "delete")


def segment_name(steps: list) -> str:
    """``monarch_<what ran>``: the family of the segment's work, ``segment`` when mixed."""
    families = {_FAMILY.get(type(s), "segment") for s in steps}
    work = families.difference(_BOOKKEEPING) or families
    return f"monarch_{work.pop()}" if len(work) == 1 else "monarch_segment"


@dataclass
class Segment:
    rank: int
    lane: Any
    index: int
    after: list  # keys this segment must follow
    steps: list = field(default_factory=list)

    def key(self, token: str) -> tuple:
        return (segment_name(self.steps), token, self.rank, self.lane, self.index)


@dataclass
class _LaneTail:
    next_index: int = 0
    key: tuple | None = None  # the last submitted (or planned) segment's key
    barrier: int = -1  # the control step index this lane last followed


@dataclass
class Plan:
    """One flush: a graph to submit, lanes to create first, and maybe a protocol error."""

    graph: HighLevelGraph | None
    keys: list
    tails: dict  # (rank, lane) -> key of the newest segment
    new_lanes: dict[int, list[int]]  # rank -> stream ids to create before submitting
    counts: dict[tuple, int]  # (rank, lane) -> index of the newest segment
    messages: int
    error: ProtocolError | None = None
    rendezvous: bool = False  # a BackendNetworkInit is in it: the store must exist first


class Compiler:
    """Turns a controller's buffer into one graph per flush (see module docs)."""

    def __init__(self, token: str, resources: list[str]):
        self.token = token
        self.resources = resources
        self.routers = [RankRouter(rank) for rank in range(len(resources))]
        self.lanes: dict[tuple[int, Any], _LaneTail] = {}
        self.created: set[tuple[int, int]] = set()  # lanes that exist on their worker

    def executor(self, lane: Any) -> str:
        return executor_name(self.token, lane)

    def compile(self, buffer: list[tuple[tuple[int, ...], Any]]) -> Plan:
        segments: list[Segment] = []
        open_lanes: dict[int, dict[Any, Segment]] = {}
        open_control: dict[int, Segment] = {}
        new_lanes: dict[int, list[int]] = {}
        routers = self.routers
        error = None
        count = 0
        rendezvous = False
        for ranks, msg in buffer:
            try:
                if type(msg) in _STREAM_MESSAGES:  # the hot path: one lane per rank, no fan-out
                    stream = int(msg.stream)
                    for rank in ranks:
                        per_rank = open_lanes.get(rank)
                        seg = per_rank.get(stream) if per_rank else None
                        if seg is None:
                            router = routers[rank]
                            if router.exited or stream not in router.streams:
                                list(router.route(msg))  # raises the ProtocolError
                            seg = self._lane(rank, stream, open_lanes, open_control, segments,
                                             new_lanes)
                        seg.steps.append(msg)
                else:
                    for rank in ranks:
                        for lane, step, drains in routers[rank].route(msg):
                            if lane == CONTROL:
                                seg = self._control(rank, open_control, open_lanes, segments,
                                                    drains)
                                if type(step) is m.BackendNetworkInit:
                                    rendezvous = True
                            else:
                                seg = self._lane(rank, lane, open_lanes, open_control, segments,
                                                 new_lanes)
                            seg.steps.append(step)
            except ProtocolError as e:
                error = e
                break
            count += 1
        plan = self._plan(segments, new_lanes, count, error)
        plan.rendezvous = rendezvous
        return plan

    def _lane(self, rank, lane, open_lanes, open_control, segments, new_lanes) -> Segment:
        per_rank = open_lanes.setdefault(rank, {})
        seg = per_rank.get(lane)
        if seg is None:
            if (rank, lane) not in self.created:
                self.created.add((rank, lane))
                new_lanes.setdefault(rank, []).append(lane)
            tail = self.lanes.setdefault((rank, lane), _LaneTail())
            after = [tail.key] if tail.key is not None else []
            control = self.lanes.get((rank, CONTROL))
            if control is not None and control.next_index - 1 > tail.barrier:
                after.append(control.key)
                tail.barrier = control.next_index - 1
            seg = per_rank[lane] = self._new(rank, lane, tail, after, segments)
        open_control.pop(rank, None)  # a later control step must follow this lane work
        return seg

    def _control(self, rank, open_control, open_lanes, segments, drains) -> Segment:
        seg = open_control.get(rank)
        if seg is None:
            tail = self.lanes.setdefault((rank, CONTROL), _LaneTail())
            after = [tail.key] if tail.key is not None else []
            seg = open_control[rank] = self._new(rank, CONTROL, tail, after, segments)
        if drains:
            seg.after.extend(
                t.key for (r, lane), t in self.lanes.items()
                if r == rank and lane != CONTROL and t.key is not None and t.key not in seg.after
            )
        open_lanes.pop(rank, None)  # later lane work must follow this control step
        return seg

    def _new(self, rank, lane, tail: _LaneTail, after, segments) -> Segment:
        seg = Segment(rank, lane, tail.next_index, after)
        tail.next_index += 1
        tail.key = _PendingKey(seg)
        segments.append(seg)
        return seg

    def _plan(self, segments: list[Segment], new_lanes, count, error) -> Plan:
        final = {id(seg): seg.key(self.token) for seg in segments}
        for tail in self.lanes.values():  # later flushes follow the real keys
            if isinstance(tail.key, _PendingKey):
                tail.key = final[id(tail.key.segment)]
        layers, tails, counts = {}, {}, {}
        payloads = _Payloads()
        for seg in segments:
            key = final[id(seg)]
            tails[(seg.rank, seg.lane)] = key
            counts[(seg.rank, seg.lane)] = seg.index
            after = [TaskRef(final[id(k.segment)] if isinstance(k, _PendingKey) else k)
                     for k in seg.after]
            task = Task(key, run_segment, self.token, seg.rank, seg.lane, seg.index,
                        payloads.get(seg), *after)
            layers[f"{key[0]}-{self.token}-{seg.rank}-{seg.lane}-{seg.index}"] = MaterializedLayer(
                {key: task},
                annotations={"resources": {self.resources[seg.rank]: 1},
                             "executor": self.executor(seg.lane)},
            )
        graph = HighLevelGraph(layers, {name: set() for name in layers}) if layers else None
        return Plan(graph, list(final.values()), tails, new_lanes, counts, count, error)


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
    """Pickles each segment's steps once; ranks with identical steps share the bytes."""

    def __init__(self):
        self._by_lane: dict[Any, list[tuple[list, bytes]]] = {}

    def get(self, seg: Segment) -> bytes:
        candidates = self._by_lane.setdefault((seg.lane, len(seg.steps)), [])
        for steps, payload in candidates:
            if all(a is b for a, b in zip(steps, seg.steps)):
                return payload
        payload = _dumps(seg.steps)
        candidates.append((seg.steps, payload))
        return payload


def _dumps(steps: list) -> bytes:
    try:
        return pickle.dumps(steps, protocol=5)
    except Exception:  # closures or __main__ objects in a SetRef value, say
        return cloudpickle.dumps(steps, protocol=5)
