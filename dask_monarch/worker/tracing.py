"""A rank's trace recorder: what each lane ran and waited on, with timestamps (``dm.trace``).

Off by default, and then free: ``RankState.run_segment`` checks
``RankState.trace`` once per segment and runs the plain step loop when it is
None; the only other reads are in :meth:`~.lane.Lane.set_waiting` and the end
of a wait, which block anyway. While a trace is on, each segment, each
message and each wait becomes one record ``(lane, kind, name, start, end,
args)`` in wall-clock seconds of this worker (the controller corrects the
clock offset and links the records into flows:
:mod:`dask_monarch.observability.trace`). Records beyond ``limit`` are
counted, not kept, so a forgotten trace cannot exhaust the worker.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..protocol import messages as m
from ..protocol.wire import CONTROL

if TYPE_CHECKING:
    from .lane import Lane
    from .rank import RankState

Record = tuple  # (lane label, kind, name, start, end, args)


def _describe(step: Any, lane: Lane) -> tuple[str, dict]:
    """A message's event name and the fields that identify it (seq, borrow, collective)."""
    t = type(step)
    name = t.__name__
    args: dict[str, Any] = {}
    seq = getattr(step, "seq", None)
    if type(seq) is int:
        args["seq"] = seq
    if t is m.CallFunction:
        fn = step.function
        path = getattr(fn, "path", None)
        name = f"CallFunction {path}" if isinstance(path, str) else "CallFunction"
    elif t in (m.BorrowCreate, m.BorrowFirstUse, m.BorrowLastUse, m.BorrowDrop):
        args["borrow"] = step.borrow
    elif t is m.Reduce:
        args["result"] = step.result.id
        args["reduction"] = str(getattr(step.reduction, "value", step.reduction))
        args["dims"] = list(step.dims)
        args["shape"] = list(step.factory.size)
    elif t is m.SendTensor:  # which rank this one sends to / receives from: the flow's ends
        args["result"] = step.result.id
        args["shape"] = list(step.factory.size)
        me, senders, receivers = lane.rank.rank, list(step.from_ranks), list(step.to_ranks)
        if lane.label == step.from_stream.id and me in senders:
            args["to"] = receivers[senders.index(me)]
        if lane.label == step.to_stream.id and me in receivers:
            args["from"] = senders[receivers.index(me)]
    return name, args


class TraceLog:
    """The records of one rank while a trace is on (appended by its lanes' threads)."""

    def __init__(self, limit: int) -> None:
        self.records: list[Record] = []
        self.limit = limit
        self.dropped = 0
        self.waits: dict[Any, tuple[float, str, tuple, int | None]] = {}  # lane -> open wait

    def add(self, record: Record) -> None:
        if len(self.records) < self.limit:
            self.records.append(record)  # list.append is atomic: lanes need no lock
        else:
            self.dropped += 1

    def run_steps(self, rank: RankState, lane: Lane, steps: list, index: int) -> None:
        """``RankState._run_steps`` with a record per message and one for the segment."""
        table = rank.handlers
        label = lane.label
        start = time.time()
        done = 0
        try:
            for step in steps:
                t0 = time.time()
                try:
                    table[type(step)](lane, step)
                finally:
                    name, args = _describe(step, lane)
                    self.add((label, "message", name, t0, time.time(), args))
                done += 1
        except KeyError:
            if type(steps[done]) not in table:
                from .errors import FatalError

                raise FatalError(f"no handler for {type(steps[done]).__name__}") from None
            raise
        finally:
            lane.steps += done
            self.add((label, "segment", f"segment {index}", start, time.time(), {"steps": done}))

    def wait_begin(self, lane: Lane, what: str, peers: tuple, seq: int | None) -> None:
        """The lane starts waiting (a previous wait of the lane ends here)."""
        now = time.time()
        self.wait_end(lane, now)
        self.waits[lane.label] = (now, what, peers, seq)

    def wait_end(self, lane: Lane, now: float | None = None) -> None:
        opened = self.waits.pop(lane.label, None)
        if opened is None:
            return
        start, what, peers, seq = opened
        args: dict[str, Any] = {"what": what, "peers": [list(p) for p in peers]}
        if seq is not None:
            args["seq"] = seq
        self.add((lane.label, "wait", _wait_name(what), start, now or time.time(), args))


def _wait_name(what: str) -> str:
    """A short event name for a wait: its first words ("borrow 3", "all-reduce (sum)")."""
    head = what.split(" (", 1)[0] if not what.startswith(("all-", "reduce-")) else what
    head = head.split(" over ", 1)[0]
    return f"wait: {head}"[:80]


def start(state: RankState, limit: int) -> float:
    """Turn the trace on for ``state`` (a fresh log); returns this worker's clock."""
    state.trace = TraceLog(limit)
    return time.time()


def collect(state: RankState, stop: bool = True) -> dict:
    """The rank's records so far, its lanes' names and this worker's clock; ``stop`` ends it."""
    log = state.trace
    if stop:
        state.trace = None
    now = time.time()
    if log is None:
        return {"rank": state.rank, "records": [], "dropped": 0, "lanes": {}, "now": now}
    for label in list(log.waits):  # a wait still open: its end is now
        lane = state.control if label == CONTROL else state.lanes.get(label)
        if lane is not None:
            log.wait_end(lane, now)
    lanes = {lane.label: lane.title for lane in state.all_lanes()}
    return {
        "rank": state.rank,
        "records": list(log.records),
        "dropped": log.dropped,
        "lanes": lanes,
        "now": now,
    }
