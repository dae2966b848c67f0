"""Liveness: the controller's own heartbeat to its ranks, and what it says about stuck lanes.

DESIGN decision 13. Every ``dask_monarch.timeouts.heartbeat`` the controller
asks each rank's worker, on the rank's report stream, what its lanes are doing;
the worker answers from its event loop, never from a lane
(:class:`~dask_monarch.protocol.wire.Heartbeat`). With the reports
(:mod:`.reports`: which segments each lane has run) the controller knows, per
rank and lane, the last completed seq and what the lane is blocked on:

* a rank whose worker has not answered for ``timeouts.unresponsive`` (a
  frozen process, e.g. stopped with SIGSTOP, or one cut off from the client)
  fails the controller with :class:`~dask_monarch.DeviceException`;
* a lane that has work outstanding and has completed nothing for
  ``timeouts.liveness`` is reported once, until it moves again, as a
  :class:`~dask_monarch.LivenessWarning` (``warnings.warn`` on the client, and
  a log record);
* a blocking call that times out describes the lanes it waits on in the same
  words (:mod:`dask_monarch.protocol.liveness`).

Everything here runs on the client's event loop, except :meth:`Liveness.pending`
and :meth:`Liveness.lane_status`, which read under the controller's
``progress`` condition.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from distributed.comm import Comm

from ..exceptions import DeviceException, LivenessWarning
from ..protocol.liveness import explain, stuck_seq
from ..protocol.names import HEARTBEAT_OP
from ..protocol.wire import LaneProgress
from .placement import note_silent
from .reports import Reports

logger = logging.getLogger("dask_monarch.controller")


class Liveness:
    """The heartbeat of one controller, and its view of every lane's progress."""

    def __init__(
        self,
        mesh_id: str,
        workers: list[str],
        reports: Reports,
        progress: threading.Condition,
        fail: Callable[[DeviceException], None],
        *,
        interval: float,
        unresponsive: float,
        liveness: float,
    ) -> None:
        self.mesh_id = mesh_id  # what its messages call the mesh
        self.workers = workers
        self.reports = reports
        self.progress = progress
        self.fail = fail  # called with ``progress`` held
        self.interval = interval
        self.unresponsive = unresponsive
        self.liveness = liveness
        self.floor = time.monotonic()  # silence is counted from here at the earliest
        self.clocks: dict[tuple[int, Any], tuple[tuple, float]] = {}  # lane -> (marker, since)
        self.warned: set[tuple[int, Any]] = set()
        self.issued: list[LivenessWarning] = []  # the warnings given so far (newest last)
        self._beats = itertools.count(1)
        self._writing: set[int] = set()
        self._task: asyncio.Task | None = None
        self._stopped = False

    # -- the heartbeat ------------------------------------------------------------------------

    def start(self) -> None:
        """Start beating (on the event loop; a no-op with ``timeouts.heartbeat`` off)."""
        if self._task is None and not self._stopped and self.interval > 0:
            self.floor = time.monotonic()
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        """Stop beating (on the event loop; before the report streams are hung up)."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        last = time.monotonic()
        while not self._stopped:
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            if now - last > max(3 * self.interval, self.unresponsive / 2):
                # the client itself did not run (a suspended laptop, a blocked event loop):
                # the ranks' silence meanwhile says nothing about them
                self.floor = now
            last = now
            try:
                self.tick(now)
            except Exception:
                logger.exception("liveness check of mesh %s failed", self.mesh_id)

    def tick(self, now: float) -> None:
        """Judge the answers so far, ask every rank again, report stalled lanes."""
        reports = self.reports
        with self.progress:
            comms = dict(reports.comms)
            answered = dict(reports.answered)
        for rank in sorted(comms):
            silent = now - max(answered.get(rank, self.floor), self.floor)
            if silent > self.unresponsive:
                self._unresponsive(rank, silent)
                return
        for rank, comm in comms.items():
            if rank not in self._writing:
                self._writing.add(rank)
                asyncio.ensure_future(self._ask(rank, comm, next(self._beats)))
        self.check_stalls(now)

    async def _ask(self, rank: int, comm: Comm, beat: int) -> None:
        try:
            await comm.write({"op": HEARTBEAT_OP, "beat": beat})
        except Exception as e:  # a closed stream: its reader reports it
            logger.debug("heartbeat to rank %d of mesh %s not sent: %r", rank, self.mesh_id, e)
        finally:
            self._writing.discard(rank)

    def _unresponsive(self, rank: int, silent: float) -> None:
        self.stop()
        note_silent(self.workers[rank])  # a new mesh does not wait for it (placement)
        with self.progress:
            self.fail(
                DeviceException(
                    f"its worker {self.workers[rank]} has not answered the controller's heartbeat "
                    f"for {silent:.1f}s (dask_monarch.timeouts.unresponsive is "
                    f"{self.unresponsive:g}s): the process is frozen (stopped, e.g. by SIGSTOP "
                    "or a debugger) or cut off from this client",
                    rank=rank,
                )
            )

    # -- stalled lanes ------------------------------------------------------------------------

    def check_stalls(self, now: float) -> None:
        """Warn once about the lanes that have completed nothing for ``liveness`` seconds.

        A lane's clock restarts whenever it completes a segment or starts a
        new seq; a lane with nothing outstanding has no clock. Lanes stuck
        together (one lane waiting on another, the members of a collective)
        stall within moments of each other: a warning also names the lanes
        stalled for half the time, so one stuck mesh gives one warning.
        """
        reports = self.reports
        stalled = []
        with self.progress:
            beats = reports.beats
            for key, index in reports.expected.items():
                finished = reports.done.get(key, -1)
                if finished >= index:
                    continue
                p = _lane(beats, *key)
                marker = (finished, p.last_seq if p is not None else None)
                clock = self.clocks.get(key)
                if clock is None or clock[0] != marker:
                    self.clocks[key] = (marker, now)
                    self.warned.discard(key)
                elif key not in self.warned and now - clock[1] >= self.liveness / 2:
                    stalled.append((key, now - clock[1]))
            for key in [
                k for k in self.clocks if reports.done.get(k, -1) >= reports.expected.get(k, -1)
            ]:
                del self.clocks[key]
                self.warned.discard(key)
            if not any(age >= self.liveness for _, age in stalled):
                return
            self.warned.update(key for key, _ in stalled)
            warning = self._warning(stalled)
        self._issue(warning)

    def _warning(self, stalled: list[tuple[tuple[int, Any], float]]) -> LivenessWarning:
        """One warning for the lanes that stalled at once (the caller holds ``progress``)."""
        beats = self.reports.beats
        order = {"waiting": 0, "running": 1}
        stalled = sorted(
            stalled,
            key=lambda item: (
                order.get(getattr(_lane(beats, *item[0]), "state", ""), 2),
                str(item[0]),
            ),
        )
        lines = [
            f"rank {rank}, {self.reports.describe(lane)} has completed no message for "
            f"{age:.1f}s; "
            f"{self._explain(rank, lane)}"
            for (rank, lane), age in stalled
        ]
        text = lines[0]
        if len(lines) > 1:
            text += "\nAlso without progress:\n" + "\n".join(f"  {line}" for line in lines[1:])
        text += (
            f"\n(mesh {self.mesh_id}; dask_monarch.timeouts.liveness is "
            f"{self.liveness:g}s; the mesh keeps waiting)"
        )
        (rank, lane), _ = stalled[0]
        p = _lane(beats, rank, lane)
        seq = None if p is None else stuck_seq(p)
        waiting_on = (
            "" if p is None else p.doing or explain(rank, p, self._lanes_of, self._outstanding)
        )
        return LivenessWarning(
            text, rank=rank, stream=lane, seq=seq, waiting_on=waiting_on, stalls=tuple(lines)
        )

    def _issue(self, warning: LivenessWarning) -> None:
        self.issued.append(warning)
        del self.issued[:-16]
        logger.warning("%s", warning)
        try:
            warnings.warn(warning, stacklevel=1)
        except Exception as e:  # warnings turned into errors: the log record stays
            logger.debug("LivenessWarning not issued as a warning: %r", e)

    # -- words --------------------------------------------------------------------------------

    def _explain(self, rank: int, lane: Any) -> str:
        """What ``lane`` of ``rank`` is doing (the caller holds ``progress``)."""
        reports = self.reports
        if self.interval <= 0:
            return "unknown (dask_monarch.timeouts.heartbeat is off)"
        answered = reports.answered.get(rank)
        silent = time.monotonic() - max(answered or self.floor, self.floor)
        stale = silent > 2 * self.interval + 1
        p = _lane(reports.beats, rank, lane)
        if p is None:
            if stale or answered is None:
                return f"its worker has not answered the heartbeat for {silent:.1f}s"
            return "the lane did not exist yet when its worker last answered the heartbeat"
        text = explain(rank, p, self._lanes_of, self._outstanding)
        if stale:
            text += (
                f" (as its worker last answered the heartbeat, {silent:.1f}s ago: it has "
                "not answered since)"
            )
        return text

    def _lanes_of(self, rank: int) -> dict[Any, LaneProgress] | None:
        beat = self.reports.beats.get(rank)
        return None if beat is None else {p.lane: p for p in beat.lanes}

    def _outstanding(self, rank: int, lane: Any) -> int:
        reports = self.reports
        index = reports.expected.get((rank, lane))
        return 0 if index is None else max(0, index - reports.done.get((rank, lane), -1))

    def lane_status(self, rank: int, lane: Any) -> str:
        """``lane`` of ``rank`` in words (the caller holds ``progress``)."""
        return self._explain(rank, lane)

    def pending(self) -> str:
        """Every lane that has not run all it was sent, and what it is doing (``progress`` held).

        What a timeout says: the same words as a LivenessWarning.
        """
        reports = self.reports
        pending = [
            f"rank {rank}, {reports.describe(lane)} "
            f"(ran {reports.done.get((rank, lane), -1) + 1} of {index + 1} segments; "
            f"{self._explain(rank, lane)})"
            for (rank, lane), index in sorted(reports.expected.items(), key=str)
            if reports.done.get((rank, lane), -1) < index
        ]
        return "; ".join(pending)

    def lanes(self) -> list[dict]:
        """Every lane of every rank as its latest heartbeat and the reports show it."""
        reports = self.reports
        now = time.monotonic()
        out = []
        with self.progress:
            for rank in sorted(reports.beats):
                for p in reports.beats[rank].lanes:
                    key = (rank, p.lane)
                    clock = self.clocks.get(key)
                    out.append(
                        {
                            **p._asdict(),
                            "rank": rank,
                            "segments_sent": reports.expected.get(key, -1) + 1,
                            "segments_done": reports.done.get(key, -1) + 1,
                            "stalled_for": round(now - clock[1], 3) if clock else 0.0,
                            "status": self._explain(rank, p.lane),
                        }
                    )
        return out


def _lane(beats: dict, rank: int, lane: Any) -> LaneProgress | None:
    beat = beats.get(rank)
    if beat is None:
        return None
    for p in beat.lanes:
        if p.lane == lane:
            return p
    return None
