"""Reports: what a controller's ranks tell it, on one stream per rank that the rank's worker serves.

Reports come back on that stream (:mod:`dask_monarch.worker.plugin`) rather
than through task results: a fetch costs no extra gather, and a lost worker
shows up at once as a closed stream. A rank reports the segments it finished
(``LaneDone``), controller messages (``Status``, ``RemoteFunctionFailed``, and
fetched values, unpickled here into ``FetchResult``), what a probe read
(``RefValue``), its exit (``Exited``), failures that break the mesh
(``Fatal``), values that a message without a seq failed (``ValueFailed``,
for the listeners: the user API knows which seq defined the value) and its
answers to the controller's heartbeat (``Heartbeat``, read by
:mod:`~dask_monarch.controller.liveness`) and the lanes that stopped in or left
the debugger (``DebuggerPaused``, :mod:`~dask_monarch.controller.debugging`).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from distributed.comm import Comm, connect
from distributed.comm.core import CommClosedError

from ..exceptions import DeviceException
from ..protocol.liveness import lane_name, missing_peers
from ..protocol.messages import FetchResult, FunctionPath, RemoteFunctionFailed, Status
from ..protocol.rules import RULES
from ..protocol.wire import (
    DebuggerPaused,
    Exited,
    Fatal,
    Fetched,
    Heartbeat,
    LaneDone,
    RefValue,
    ValueFailed,
)

logger = logging.getLogger("dask_monarch.controller")

SCHEDULER_GRACE_S = 0.2  # a report stream ended: did the client lose its scheduler meanwhile?


class Reports:
    """What a controller's ranks have reported so far, and the streams the reports arrive on.

    Batches are applied on the client's event loop, under ``progress`` (the
    controller's condition, which they wake); a report that breaks the mesh
    goes to ``fail`` with ``progress`` held.
    """

    def __init__(
        self,
        token: str,
        progress: threading.Condition,
        fail: Callable[[DeviceException], None],
        client_problem: Callable[[], str | None] = lambda: None,
        scheduler: Any = None,
    ) -> None:
        self.token = token
        self.scheduler = scheduler  # the client's scheduler rpc: why a worker was lost
        self.progress = progress
        self.fail = fail
        self.client_problem = client_problem  # why the client lost its scheduler, if it did
        self.expected: dict[tuple[int, Any], int] = {}  # (rank, lane) -> newest segment
        self.done: dict[tuple[int, Any], int] = {}  # (rank, lane) -> last finished segment
        self._idle: bool | None = True  # caught_up(), kept until expected or done change
        self.inbox: list = []  # controller messages not yet returned by a sync
        self.keep_inbox = True  # False once a listener consumes them (the user API)
        self.replies: dict[int, RefValue] = {}  # probe -> what it read
        self.listeners: list[Callable[[Any], None]] = []
        # after a batch that finished segments, with the (rank, lane)s that did
        self.on_done: Callable[[list], None] | None = None
        self.exited: set[int] = set()
        self.comms: dict[int, Comm] = {}  # rank -> its report stream
        self.beats: dict[int, Heartbeat] = {}  # rank -> its latest answer to the heartbeat
        self.answered: dict[int, float] = {}  # rank -> when it came (time.monotonic())
        self.names: dict[int, str] = {}  # stream id -> the name the user gave it
        self.retired = 0  # segments of dropped lanes, no longer in expected/done
        # (rank, lane) -> [(index, payload)] of segments submitted and not yet run: a lost
        # worker's message says what it was running (pruned as they run: no payload outlives
        # it). Pickled, as sent: thousands of messages in flight kept as objects would be
        # walked by every garbage collection of the client (the client runs ahead).
        self.in_flight: dict[tuple[int, Any], deque] = {}
        self.debugging: dict[str, DebuggerPaused] = {}  # session -> a lane paused in pdb
        self.on_debugger: Callable[[DebuggerPaused], None] | None = None  # told of each

    # -- the streams --------------------------------------------------------------------------

    async def subscribe(self, workers: list[str], connection_args: dict) -> None:
        """Open the report stream of every rank (``workers[rank]``) and start reading it."""
        comms = await asyncio.gather(*(self._subscribe(a, connection_args) for a in workers))
        for rank, comm in enumerate(comms):
            self.comms[rank] = comm
            asyncio.ensure_future(self._read(rank, workers[rank], comm))

    async def _subscribe(self, address: str, connection_args: dict) -> Comm:
        comm = await connect(address, **connection_args)
        comm.name = f"dask_monarch reports {self.token}"
        await comm.write({"op": "dask_monarch_reports", "token": self.token, "reply": False})
        return comm

    async def _read(self, rank: int, address: str, comm: Comm) -> None:
        try:
            while True:
                batch = await comm.read()
                self.on_reports(rank, batch)
        except (CommClosedError, OSError) as e:
            logger.debug("report stream of rank %d ended: %r", rank, e)
        except asyncio.CancelledError:  # the client's event loop is going away, not the worker
            with self.progress:
                self.fail(
                    DeviceException(
                        self.client_problem()
                        or (
                            "the client's event loop stopped (was its Client closed?), so no "
                            "report can arrive; close meshes before their client"
                        )
                    )
                )
            raise
        except Exception as e:  # a report we cannot read: the mesh cannot be trusted
            logger.exception("bad report from rank %d", rank)
            with self.progress:
                self.fail(DeviceException(f"unreadable report from its worker: {e!r}", rank=rank))
            return
        if self.comms.get(rank) is not comm:  # hung up on purpose
            return
        # Workers close when they lose the scheduler: a lost scheduler is not a lost rank.
        problem = self.client_problem()
        if problem is None:
            await asyncio.sleep(SCHEDULER_GRACE_S)
            problem = self.client_problem()
        why = await self._memory_kill(address) if problem is None else ""
        with self.progress:  # a no-op once the controller is closed
            self.fail(
                DeviceException(problem)
                if problem is not None
                else DeviceException(
                    f"lost connection to its worker {address} "
                    f"({why or 'the worker died, restarted or was removed'}){self.running(rank)}",
                    rank=rank,
                )
            )

    async def _memory_kill(self, address: str) -> str:
        """Why the worker at ``address`` went, if its nanny killed it for its memory."""
        if self.scheduler is None:
            return ""
        try:  # the nanny logs this event before it terminates the worker (docs/dask.md)
            events = await asyncio.wait_for(
                self.scheduler.events(topic="worker-restart-memory"), 2.0
            )
        except Exception as e:
            logger.debug("no memory events from the scheduler: %r", e)
            return ""
        for _, event in reversed(list(events or ())):
            if isinstance(event, dict) and event.get("worker") == address:
                return (
                    f"its nanny killed it for exceeding its memory limit: it used "
                    f"{event.get('rss', 0) / 2**20:.0f} MiB (see distributed.worker.memory."
                    "terminate and the worker's memory_limit)"
                )
        return ""

    def hang_up(self) -> None:
        """Abort every report stream (the workers then free this controller's state)."""
        comms = list(self.comms.values())
        self.comms.clear()
        for comm in comms:
            try:
                comm.abort()
            except Exception as e:  # its event loop is gone: the process's exit closes it
                logger.debug("aborting a report stream: %r", e)

    # -- what they say ------------------------------------------------------------------------

    def on_reports(self, rank: int, batch: list) -> None:
        """Apply one batch of ``rank``'s reports, then hand its controller messages to listeners."""
        delivered = []  # for the inbox and the listeners, in arrival order
        seqless = False  # a ValueFailed is among them: for the listeners only
        debugger = []  # DebuggerPaused reports, for on_debugger
        finished = []  # the lanes whose LaneDone advanced
        with self.progress:
            for item in batch:
                t = type(item)
                if t is LaneDone:
                    key = (item.rank, item.lane)
                    if item.index > self.done.get(key, -1):
                        self.done[key] = item.index
                        self._idle = None
                        finished.append(key)
                        queue = self.in_flight.get(key)
                        while queue and queue[0][0] <= item.index:
                            queue.popleft()
                elif t is Fetched:
                    delivered.append(_fetch_result(item))
                elif t is Status or t is RemoteFunctionFailed:
                    delivered.append(item)
                elif t is ValueFailed:  # not a controller message (no seq)
                    delivered.append(item)
                    seqless = True
                elif t is RefValue:
                    if item.probe > 0:
                        self.replies[item.probe] = item
                elif t is Fatal:
                    cause = item.cause + self.late_note(item.rank) + self.paused_note()
                    self.fail(DeviceException(cause, rank=item.rank))
                elif t is Exited:
                    self.exited.add(item.rank)
                    if item.error is not None:
                        source, text = item.error
                        self.fail(
                            DeviceException(
                                f"Exit with an error from {source or 'an unknown source'}: {text}",
                                rank=item.rank,
                            )
                        )
                elif t is Heartbeat:
                    self.beats[item.rank] = item
                    self.answered[item.rank] = time.monotonic()
                elif t is DebuggerPaused:
                    if item.paused:
                        self.debugging[item.session] = item
                    else:
                        self.debugging.pop(item.session, None)
                    debugger.append(item)
            if self.keep_inbox and delivered:
                self.inbox.extend(
                    [x for x in delivered if type(x) is not ValueFailed] if seqless else delivered
                )
            self.progress.notify_all()
        if finished and self.on_done is not None:
            self.on_done(finished)
        for msg in delivered:
            for listener in self.listeners:
                listener(msg)
        if debugger and self.on_debugger is not None:
            for item in debugger:
                self.on_debugger(item)

    def late_note(self, rank: int) -> str:
        """Who ``rank``'s lanes were waiting for as it failed (a collective or send that timed
        out names only the rank that waited): the peers not in the wait, and what each was
        doing, from the latest heartbeats (``progress`` held)."""
        beat = self.beats.get(rank)
        if beat is None:
            return ""

        def lanes_of(r: int) -> dict | None:
            theirs = self.beats.get(r)
            return None if theirs is None else {p.lane: p for p in theirs.lanes}

        def outstanding(r: int, lane: Any) -> int:
            index = self.expected.get((r, lane))
            return 0 if index is None else max(0, index - self.done.get((r, lane), -1))

        late = [
            peer
            for p in beat.lanes
            if p.state == "waiting" and p.peers
            for peer in missing_peers(rank, p, lanes_of, outstanding)
        ]
        return f" (it was waiting for {'; '.join(late)})" if late else ""

    def paused_note(self) -> str:
        """Why a collective may have timed out: the ranks paused in pdb (``progress`` held)."""
        if not self.debugging:
            return ""
        paused = "; ".join(
            f"rank {p.rank} at {p.where} since seq {p.seq}" for p in self.debugging.values()
        )
        return (
            f" (meanwhile paused in the debugger: {paused}; a collective or send waits for a "
            "paused member at most dask_monarch.timeouts.collective: raise it before creating "
            "the mesh to debug ranks that take part in collectives)"
        )

    def expect(self, counts: dict[tuple[int, Any], int], tasks: list = ()) -> None:
        """A flush was submitted: ``counts`` gives each of its lanes' newest segment,
        ``tasks`` (its SegmentTasks) what they run."""
        with self.progress:
            self.expected.update(counts)
            self._idle = None
            done, in_flight = self.done, self.in_flight
            for task in tasks:
                key = (task.rank, task.lane)
                queue = in_flight.get(key)
                if queue is None:
                    queue = in_flight[key] = deque()
                last = done.get(key, -1)
                while queue and queue[0][0] <= last:
                    queue.popleft()
                queue.append((task.index, task.payload))

    def running(self, rank: int) -> str:
        """What ``rank``'s lanes were running or about to run (the caller holds ``progress``):
        the first unfinished segment of each lane, by the seqs and functions in it."""
        parts = []
        for (r, lane), queue in sorted(self.in_flight.items(), key=str):
            last = self.done.get((r, lane), -1)
            first = (
                next((payload for index, payload in queue if index > last), None)
                if r == rank
                else None
            )
            if first:
                where = "control steps" if lane == "control" else f"stream {lane}"
                parts.append(f"{where}: {describe_payload(first)}")
        return f"; it was running {'; '.join(parts)}" if parts else ""

    def ranks_idle(self) -> bool:
        """Every segment submitted so far has run (any thread; asked on every send once a
        buffer is old enough, so the answer is kept until a flush or a report changes it)."""
        idle = self._idle
        if idle is None:
            with self.progress:
                idle = self._idle = self.caught_up()
        return idle

    def caught_up(self) -> bool:
        """Every segment submitted so far has run (the caller holds ``progress``)."""
        done = self.done
        return all(done.get(lane, -1) >= index for lane, index in self.expected.items())

    def describe(self, lane: Any) -> str:
        """``stream 'comms' (3)``, ``stream 3`` without a name, or ``control steps``."""
        return lane_name(lane, self.names.get(lane))

    def segments(self) -> tuple[int, int]:
        """Segments submitted and segments finished (the caller holds ``progress``)."""
        expected = sum(index + 1 for index in self.expected.values()) + self.retired
        done = (
            sum(min(self.done.get(lane, -1), index) + 1 for lane, index in self.expected.items())
            + self.retired
        )
        return expected, done

    def retire(self, dropping: dict[tuple[int, Any], int]) -> list[tuple[int, Any]]:
        """Forget the dropped lanes of ``dropping`` whose last segment ran; returns them
        (the caller holds ``progress``)."""
        gone = [lane for lane, index in dropping.items() if self.done.get(lane, -1) >= index]
        for lane in gone:
            self.retired += self.expected.pop(lane, -1) + 1
            self.done.pop(lane, None)
            self._idle = None
        return gone

    def take_inbox(self) -> list:
        """The controller messages since the last call (the caller holds ``progress``)."""
        messages, self.inbox = self.inbox, []
        return messages


def describe(steps: list, most: int = 3) -> str:
    """A segment's work for an error message: the messages in it that run user code (else all),
    by seq and function."""
    users = [s for s in steps if getattr(RULES.get(type(s)), "user_code", False)]
    names = []
    for step in users or steps:
        fn = getattr(step, "function", None)
        seq = getattr(step, "seq", None)
        what = type(step).__name__
        if type(fn) is FunctionPath:
            what = f"{what} of {fn.path}"
        elif fn is not None:
            what = f"{what} of a pickled function"
        names.append(what if seq is None else f"{what} (seq {seq})")
    more = f" and {len(names) - most} more messages" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def describe_payload(payload: tuple[bytes, ...]) -> str:
    """:func:`describe` of a segment's pickled steps (the client pickled them: it may load
    them back)."""
    try:
        steps = [step for chunk in payload for step in pickle.loads(chunk)]
    except Exception as e:  # a value in them that cannot be loaded here
        return f"messages that cannot be read back ({type(e).__name__})"
    return describe(steps)


def _fetch_result(item: Fetched) -> FetchResult | RemoteFunctionFailed:
    try:
        return FetchResult(item.seq, item.rank, pickle.loads(item.payload))
    except Exception as e:
        return RemoteFunctionFailed(
            item.seq, item.rank, f"the fetched value cannot be unpickled on the client: {e!r}"
        )
