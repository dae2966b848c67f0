"""Everything one controller holds on one rank, and how its segments run.

A :class:`RankState` is created when a controller claims the worker and lives
until ``Exit``, ``Controller.close`` or the controller's report stream drops
(a dead notebook kernel): then every lane, table and communicator it owns is
released, and the Dask worker carries on.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from distributed.protocol.serialize import ToPickle

from .. import config
from ..protocol import names
from ..protocol.messages import StreamCreationMode
from ..protocol.rules import RecordingChunks
from ..protocol.wire import CONTROL, Fatal, Heartbeat, LaneDone
from .device import device_for
from .dispatch import HANDLERS
from .errors import FatalError, SeqError, format_exception
from .lane import Lane, _current
from .recording import forget_lane
from .restricted import RestrictedPickleError
from .restricted import loads as restricted_loads
from .user_groups import forget as forget_user_groups

if TYPE_CHECKING:
    from collections.abc import Callable

    from distributed.batched import BatchedSend

    from .plugin import MonarchWorkerPlugin

WAIT_POLL_S = 0.05

logger = logging.getLogger("dask_monarch.worker")


class RankState:
    """One controller's rank on this worker: lanes, worker-level tables, reports."""

    def __init__(
        self,
        plugin: MonarchWorkerPlugin,
        token: str,
        rank: int,
        world_size: int,
        device: torch.device | None,
        settings: dict,
    ):
        self.plugin = plugin
        self.loop = plugin.worker.loop
        self.loop_thread = getattr(plugin, "loop_thread", None)  # the event loop's thread id
        self.token = token
        self.rank = rank
        self.world_size = world_size
        self.torch_device = device  # a CUDA device, or None on CPU
        self.settings = settings
        self.lanes: dict[int, Lane] = {}
        self.device = device_for(device)  # streams, events and hand-offs (worker/device.py)
        self.control = Lane(self, CONTROL, names.executor_name(token, CONTROL))
        self.meshes: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.borrows: dict[int, Any] = {}
        self.probes: dict[int, int] = {}
        self.failed: str | None = None
        self.released = False
        self.abort = threading.Event()  # set on failure or release: blocking waits give up
        # (seq, traceback text, time) of the latest fresh failures, for the dashboard
        self.recent_errors: deque[tuple[int, str, float]] = deque(
            maxlen=config.integer("dashboard.errors", minimum=0)
        )
        self.created = time.time()
        self._stream = None  # BatchedSend to the controller, once it subscribed
        self._pending: list = []
        # reports made on lane threads that the event loop has not taken yet (see report)
        self._outbox: list = []
        self._outbox_lock = threading.Lock()
        self._closers: list = []
        self.comms = None  # worker.comm.Comms, made on first use
        self.user_groups: dict = {}  # the user's checked views of its groups (user_groups.py)
        self.handlers = HANDLERS  # message type -> handler (recordings replay through it too)
        # no pickled code accepted: batches load plain data only (docs/security.md)
        self.loads = (
            pickle.loads if config.get("functions.allow-pickled", True) else restricted_loads
        )
        self.recordings: dict[int, Any] = {}
        self.chunks = RecordingChunks(FatalError)  # a recording whose chunks are arriving
        self.replays: dict[int, Any] = {}  # CallRecording seq -> ReplayState
        self.pipes: dict[int, Any] = {}
        self.actors: dict[tuple, Any] = {}  # broker id -> actor instance
        self.actor_locks: dict[tuple, threading.Lock] = {}  # broker id -> one call at a time
        self.actor_calls: dict[tuple, Any] = {}  # (broker id, seq) -> ActorCall
        self.trace = None  # a worker.tracing.TraceLog while dm.trace is on (checked per segment)
        self.inbox = None  # worker.relay.Inbox, made when the first relayed segment arrives

    # -- lanes --------------------------------------------------------------------------------

    def executor_name(self, stream_id: int) -> str:
        return names.executor_name(self.token, stream_id)

    def add_lane(
        self, stream_id: int, mode: StreamCreationMode, name: str | None = None
    ) -> Lane | None:
        """Create the lane of a stream and its device stream (on the event loop, before a task
        names it); ``name`` is what the dashboard and errors call it."""
        if stream_id in self.lanes:
            return None
        lane = self.lanes[stream_id] = Lane(
            self, stream_id, self.executor_name(stream_id), mode, name
        )
        return lane

    def drop_lane(self, lane: Lane) -> None:
        """The stream's last step (on its lane's thread): free its communicators, refs and
        thread; the plugin then forgets the lane and gives its thread back (on the loop)."""
        comms = self.comms
        if comms is not None:
            comms.release_stream(
                lane.label,
                drain=lambda: self.device.drain(lane.stream, self.abort.is_set, comms.timeout),
            )
        if self.recordings:
            forget_lane(self, lane.label)
        lane.retire()
        self.loop.add_callback(self.plugin.remove_lane, self, lane)

    def all_lanes(self) -> list[Lane]:
        return [*self.lanes.values(), self.control]

    def on_loop(self) -> bool:
        """Whether this thread is the worker's event loop (a quick segment: worker/inline.py)."""
        return threading.get_ident() == self.loop_thread

    # -- running ------------------------------------------------------------------------------

    def run_segment(
        self, label: Any, index: int, payload: tuple[bytes, ...], steps: list | None = None
    ) -> int:
        """Run one segment of steps on its lane, in order; called on the lane's thread (or on
        the event loop, for a quick segment: worker/inline.py).

        ``payload`` holds pickled lists of steps: the part every rank shares, then
        this rank's own (``wire.Payload``); ``steps``, if given, are what it holds,
        already unpickled.

        A segment queued before the controller failed or left returns at once
        and runs nothing, and one that fails fatally returns once the failure
        is reported: their tasks end normally (no Dask error, no slot held),
        and the controller learns of the failure from the ``Fatal`` report,
        led by the lane's title: the one place that names the lane of a fatal error.
        """
        if self.failed is not None or self.released:
            return 0
        lane = self.control if label == CONTROL else self.lanes.get(label)
        if lane is None:
            raise FatalError(
                f"rank {self.rank}: no lane for stream {label} (never created, or dropped)"
            )
        try:
            lane.claim_index(index)
            if steps is None:
                steps = self.load_steps(payload)
            lane.state, lane.busy_since, lane.running = "running", time.monotonic(), steps
            _current.lane = lane
            trace = self.trace
            with self.device.running(lane.stream):
                if trace is None:
                    self._run_steps(lane, steps)
                else:
                    trace.run_steps(self, lane, steps, index)
        except FatalError as e:
            self.fail(f"{lane.title}: {e}")
            return 0
        except BaseException as e:
            self.fail(f"{lane.title}: internal error: {format_exception(e)}")
            if not isinstance(e, Exception):  # SystemExit & co. would stop the Dask worker
                raise FatalError(f"{lane.title}: internal error: {e!r}") from e
            raise
        finally:
            lane.state, lane.doing, lane.running = "idle", "", None
            lane.busy_seconds += time.monotonic() - lane.busy_since
        lane.segments += 1
        lane.done_seq = lane.last_seq
        self.report(LaneDone(self.rank, label, index))
        return len(steps)

    def load_steps(self, payload: tuple[bytes, ...]) -> list:
        """The steps of a segment's payload, in order (a FatalError if they cannot be loaded)."""
        try:
            steps = self.loads(payload[0])
            for more in payload[1:]:
                steps += self.loads(more)
        except RestrictedPickleError as e:  # a message holds more than plain data
            raise FatalError(f"rank {self.rank}: a message refused: {e}") from None
        except BaseException as e:  # a value whose unpickling raises, or exits
            raise FatalError(
                f"rank {self.rank}: the segment's messages cannot be unpickled "
                f"(a value in them raised {type(e).__name__}: {e})"
            ) from None
        return steps

    def _run_steps(self, lane: Lane, steps: list) -> None:
        table = self.handlers
        done = 0
        try:
            for step in steps:
                table[type(step)](lane, step)
                done += 1
        except KeyError:
            if type(steps[done]) not in table:
                raise FatalError(f"no handler for {type(steps[done]).__name__}") from None
            raise
        finally:
            lane.steps += done

    # -- reports ------------------------------------------------------------------------------

    def report(self, item: Any) -> None:
        """Send ``item`` to the controller (thread-safe, in call order).

        Reports made before the event loop took the previous ones join them:
        a fetch's value, its ``Status`` and the segment's ``LaneDone`` cost
        one wake-up of the loop and one write, not three (the controller
        waits for all of them, and on a loaded machine every wake-up of a
        thread costs milliseconds: benchmarks/latency.py).
        """
        with self._outbox_lock:
            outbox = self._outbox
            outbox.append(item)
            if len(outbox) > 1:  # a delivery is already on its way to the loop
                return
        self.loop.add_callback(self._deliver_outbox)

    def _deliver_outbox(self) -> None:
        with self._outbox_lock:
            items, self._outbox = self._outbox, []
        for item in items:
            self._deliver(item)

    def _deliver(self, item: Any) -> None:
        if self._stream is not None:
            self._stream.send(ToPickle(item))
        else:
            self._pending.append(item)

    def attach(self, stream: BatchedSend) -> None:
        """The controller subscribed: flush what was reported before (on the event loop)."""
        self._stream = stream
        pending, self._pending = self._pending, []
        for item in pending:
            stream.send(ToPickle(item))

    def heartbeat(self, beat: int) -> Heartbeat:
        """The answer to the controller's heartbeat ``beat`` (on the event loop, never locks)."""
        now = time.monotonic()
        return Heartbeat(self.rank, beat, tuple(lane.progress(now) for lane in self.all_lanes()))

    def record_error(self, error: SeqError) -> None:
        """Keep a fresh failure for the dashboard (the latest ``dashboard.errors`` of them)."""
        self.recent_errors.append((error.seq, error.error, time.time()))

    # -- synchronisation ----------------------------------------------------------------------

    def arrive(self, probe: int, lanes: int) -> bool:
        """A lane passed status probe ``probe``; True for the last of its ``lanes`` lanes."""
        with self.lock:
            seen = self.probes.get(probe, 0) + 1
            if seen >= lanes:
                self.probes.pop(probe, None)
                return True
            self.probes[probe] = seen
            return False

    def wait(
        self,
        lane: Lane,
        event: threading.Event,
        what: str,
        timeout: float | None = None,
        peers: tuple = (),
    ) -> None:
        """Block ``lane`` until ``event`` is set; give up if the controller fails or leaves.

        ``what`` and ``peers`` say what the lane waits on (:meth:`Lane.set_waiting`).
        """
        if event.is_set():
            return
        before = (lane.state, lane.doing)
        lane.set_waiting(what, peers=peers)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not event.wait(WAIT_POLL_S):
                if self.abort.is_set():
                    raise FatalError(
                        f"stopped waiting for {what}: {self.failed or 'the rank was released'}"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise FatalError(f"timed out after {timeout}s waiting for {what}")
        finally:
            lane.state, lane.doing = before
            if self.trace is not None:
                self.trace.wait_end(lane)

    # -- failure and release ------------------------------------------------------------------

    def fail(self, cause: str) -> None:
        """The controller is broken on this rank: tell it, wake every blocked lane."""
        with self.lock:
            if self.failed is not None:
                return
            self.failed = cause
        self.abort.set()
        self.report(Fatal(self.rank, cause))

    def release(self) -> None:
        """Free everything this controller holds here (idempotent, any thread)."""
        with self.lock:
            if self.released:
                return
            self.released = True
        self.abort.set()
        for close in self.closers():
            try:
                close()
            except Exception as e:  # a half-built communicator must not keep the rest alive
                logger.debug(
                    "rank %d of %s: releasing %r failed: %r", self.rank, self.token, close, e
                )
        forget_user_groups(self.user_groups)
        self.meshes.clear()
        self.borrows.clear()
        self.actors.clear()
        self.actor_locks.clear()
        self.actor_calls.clear()
        self.loop.add_callback(self.plugin.forget, self)

    def closers(self) -> list:
        """Release hooks of the rank's resources; lanes last so waits end first."""
        return [*self._closers, *(lane.close for lane in self.all_lanes())]

    def on_release(self, hook: Callable[[], object]) -> None:
        """Run ``hook`` when the rank is released (communicators, pipes, actors)."""
        self._closers.append(hook)

    # -- dashboard ----------------------------------------------------------------------------

    @property
    def messages(self) -> int:
        """Messages run so far on every lane (each lane counts its own: no shared counter)."""
        return sum(lane.steps for lane in self.all_lanes())

    def snapshot(self) -> dict:
        """What the dashboard shows for this rank (on the event loop; reads, never locks).

        ``time`` is this worker's clock, so that a reader can turn successive
        ``messages``/``steps`` counts into rates; tensor bytes count each
        storage once, even when a borrow shares it between two lanes.
        """
        lanes = self.all_lanes()
        storages: dict[int, int] = {}
        views = []
        for lane in lanes:
            own = lane.storages()
            storages.update(own)
            views.append(lane.snapshot(own))
        return {
            "token": self.token,
            "rank": self.rank,
            "world_size": self.world_size,
            "device": str(self.torch_device or "cpu"),
            "failed": self.failed,
            "released": self.released,
            "time": time.time(),
            "messages": sum(view["steps"] for view in views),
            "last_done_seq": max((lane.done_seq for lane in lanes), default=-1),
            "refs": sum(view["refs"] for view in views),
            "tensor_bytes": sum(storages.values()),
            "uptime": round(time.time() - self.created, 1),
            "lanes": views,
            "meshes": [repr(m) for m in list(self.meshes.values())],
            "borrows": sorted(map(str, list(self.borrows))),
            "errors": [{"seq": s, "error": e, "time": t} for s, e, t in list(self.recent_errors)],
        }
