"""A stream's lane on one rank: a single-thread executor, its own ref table, its device stream.

Dask runs a lane's segments through the ``executor`` annotation; the compiler
chains each segment of a lane to the one before with a graph edge while that
one has not run, so a lane holds at most one running task and runs its
segments in order (DESIGN decisions 2, 3).
Each segment carries its index: a segment seen twice (Dask re-running work
after a lost worker) is refused, never re-executed.

Why lanes cannot starve each other: the worker runs at most ``nthreads``
tasks across *all* executors (docs/dask.md §12). The plugin raises
``nthreads`` by one for every lane it creates and the chain edges keep at most
one task per lane executing, so a task whose lane is free always finds a
thread: a lane blocked in a borrow wait or a collective holds only its own
slot. The rank resource each task asks for is advertised with a capacity far
above the number of lanes, so it pins tasks without limiting them. Blocking
waits are interruptible: they give up when the controller fails or releases
the rank, so a blocked lane never outlives its controller. A released lane
keeps its thread until every task Dask handed its executor has returned
(:meth:`~dask_monarch.worker.plugin.MonarchWorkerPlugin.forget`): nothing
cancels work Dask owns, so no task is left holding an execution slot.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ..protocol.messages import StreamCreationMode
from ..protocol.wire import CONTROL, LaneProgress, StatusProbe
from .calls import lookup
from .errors import ReplayRefused, SeqError

if TYPE_CHECKING:
    from .rank import RankState


_current = threading.local()
WHERE_AFTER_S = 1.0  # a call running this long is located (its innermost user frame)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOT_A_SEQ = (StatusProbe,)  # steps whose ``seq`` field is not a message's own seq
_OUTER = (f"{os.sep}distributed{os.sep}", f"{os.sep}concurrent{os.sep}futures{os.sep}")


def current_lane() -> Lane:
    """The lane running on this thread (for functions that need to block it, like pipe.peek)."""
    return _current.lane


class Lane:
    """The executor, ref table and progress of one stream (or the control steps) of a rank."""

    def __init__(
        self,
        rank: RankState,
        label: Any,
        executor_name: str,
        mode: StreamCreationMode = StreamCreationMode.UseDefaultStream,
        name: str | None = None,
    ):
        self.rank = rank
        self.label = label  # stream id, or wire.CONTROL
        self.name = name  # the name the user gave the stream (dm.Stream("comms")), if any
        self.executor_name = executor_name
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=executor_name)
        self.env: dict[int, Any] = {}
        self.mode = mode
        # Made with the lane, before any segment: every step, the first segment's too, runs in it.
        self.stream = rank.device.stream(str(label), mode)
        self.next_index = 0
        self.recording = None  # the ReplayState while a CallRecording replays on this lane
        self.expected = None  # wire.ExpectResults of the next CallFunction, if it was sent one
        # progress, for the dashboard
        self.state = "idle"  # idle | running | waiting
        self.doing = ""
        self.seq: int | None = None  # the seq of the message a wait is in, if it has one
        self.running: list | None = None  # the steps of the segment being run
        self.peers: tuple = ()  # (rank, lane) pairs the current wait needs
        self.since = 0.0  # when the current wait began
        self.last_seq = -1  # the newest seq a handler started (set by the handlers)
        self.done_seq = -1  # last_seq when the lane last finished a segment
        self.steps = 0
        self.segments = 0
        self.busy_since = 0.0
        self.busy_seconds = 0.0
        self.inlined = 0  # segments run on the event loop (worker/inline.py)

    @property
    def title(self) -> str:
        """How errors and logs name the lane: ``stream 'comms' (7)``, ``stream 7``, ``control
        steps``."""
        if self.label == CONTROL:
            return "control steps"
        return f"stream {self.name!r} ({self.label})" if self.name else f"stream {self.label}"

    # -- values -------------------------------------------------------------------------------

    def value_of(self, ref_id: int) -> Any:
        """An argument's value: a device mesh or pipe if the id names one, else the stream's."""
        rank = self.rank
        if ref_id in rank.meshes:
            return rank.meshes[ref_id]
        if rank.pipes and ref_id in rank.pipes:
            return rank.pipes[ref_id]
        return lookup(self.env, ref_id)

    # -- lifecycle ----------------------------------------------------------------------------

    def create(self, mode: StreamCreationMode) -> None:
        """``CreateStream``: a fresh, empty stream (re-creating an id replaces it).

        The device stream was made with the lane, in the mode the controller
        announced; a re-creation in another mode switches to a new device
        stream at once, for the rest of this segment too.
        """
        self.env.clear()
        if mode is not self.mode:
            self.mode = mode
            self.stream = self.rank.device.stream(str(self.label), mode)
            self.rank.device.switch(self.stream)

    def claim_index(self, index: int) -> None:
        """Segments run exactly once and in order; anything else is a replay."""
        if index != self.next_index:
            raise ReplayRefused(
                f"segment {index} arrived when {self.next_index} was expected "
                "(Dask re-ran work, e.g. after a lost worker); refusing to execute it twice"
            )
        self.next_index += 1

    def set_waiting(self, what: str, seq: int | None = None, peers: tuple = ()) -> None:
        """The lane blocks on ``what`` (in message ``seq``, if it has one), needing ``peers``.

        ``what`` reads after "waiting on": name the thing and whose move it
        waits for ("borrow 3 (the lender's BorrowCreate)"); liveness warnings,
        timeouts and the dashboard show it as is.
        """
        self.seq, self.peers, self.since = seq, peers, time.monotonic()
        self.state, self.doing = "waiting", what
        trace = self.rank.trace  # a wait blocks anyway: one read is free here
        if trace is not None:
            trace.wait_begin(self, what, peers, seq)

    def set_running(self, what: str = "") -> None:
        self.state, self.doing = "running", what
        trace = self.rank.trace
        if trace is not None:
            trace.wait_end(self)

    def progress(self, now: float) -> LaneProgress:
        """What the lane is doing (read from the event loop, never locks; see :meth:`snapshot`)."""
        state, doing = self.state, self.doing
        if state == "waiting":
            seq = self.seq
            if seq is None and self.recording is not None:
                seq = self.recording.seq
            following = self.next_seq() if seq is None else None
            return LaneProgress(
                self.label,
                state,
                doing,
                seq,
                following,
                self.last_seq,
                self.done_seq,
                self.segments,
                round(now - self.since, 3),
                self.peers,
                "",
            )
        for_s = round(now - self.busy_since, 3) if state != "idle" else 0.0
        located = state == "running" and not doing and for_s >= WHERE_AFTER_S
        where = self.where() if located else ""
        return LaneProgress(
            self.label,
            state,
            doing,
            None,
            None,
            self.last_seq,
            self.done_seq,
            self.segments,
            for_s,
            (),
            where,
        )

    def next_seq(self) -> int | None:
        """The first seq of the running segment that the lane has not started, if any."""
        last = self.last_seq
        for step in self.running or ():
            seq = getattr(step, "seq", None)
            if type(seq) is int and seq > last and type(step) not in _NOT_A_SEQ:
                return seq
        return None

    def thread_ident(self) -> int | None:
        """The id of the lane's thread (None before its executor started one)."""
        prefix = f"{self.executor_name}_"  # ThreadPoolExecutor names its threads <prefix>_<i>
        return next((t.ident for t in threading.enumerate() if t.name.startswith(prefix)), None)

    def user_frame(self, frame: Any = None) -> Any:
        """The innermost frame outside dask_monarch and torch of ``frame``'s stack (default: the
        lane's thread's), or None when the thread runs no user code."""
        if frame is None:
            ident = self.thread_ident()
            frame = sys._current_frames().get(ident) if ident is not None else None
        while frame is not None:
            name = frame.f_code.co_filename
            if any(part in name for part in _OUTER):  # below the segment: no user code ran
                return None
            if not name.startswith(_PACKAGE) and f"{os.sep}torch{os.sep}" not in name:
                return frame
            frame = frame.f_back
        return None

    def where(self, frame: Any = None) -> str:
        """Where the lane's thread is: its innermost frame outside dask_monarch and torch."""
        user = self.user_frame(frame)
        if user is None:
            return ""
        return f"in {user.f_code.co_name} ({user.f_code.co_filename}:{user.f_lineno})"

    def storages(self) -> dict[int, int]:
        """The tensors' storages this lane's table holds: data pointer -> bytes."""
        # list(): one C-level copy, safe while the lane thread changes the table
        out = {}
        for v in list(self.env.values()):
            if isinstance(v, torch.Tensor):
                storage = v.untyped_storage()
                out[storage.data_ptr()] = storage.nbytes()
        return out

    def snapshot(self, storages: dict[int, int] | None = None) -> dict:
        """What the dashboard shows for this lane (read from the event loop, never locks).

        Reads plain attributes that the lane's thread writes; a snapshot may
        mix two moments of a running lane, which a progress display tolerates.
        """
        values = list(self.env.values())
        if storages is None:
            storages = self.storages()
        now = time.monotonic()
        progress = self.progress(now)
        state = progress.state
        return {
            "stream": self.label,
            "name": self.name,
            "state": state,
            "doing": progress.doing,
            "busy_for": round(now - self.busy_since, 3) if state != "idle" else 0,
            "seq": progress.seq,
            "next_seq": progress.next_seq,
            "for_s": progress.for_s,
            "peers": [list(peer) for peer in progress.peers],
            "where": progress.where,
            "last_seq": self.last_seq,
            "done_seq": self.done_seq,
            "refs": len(values),
            "errors": sum(1 for v in values if type(v) is SeqError),
            "tensor_bytes": sum(storages.values()),
            "steps": self.steps,
            "segments": self.segments,
            "busy_seconds": round(self.busy_seconds, 3),
            "inlined": self.inlined,
        }

    def discard(self, values: list) -> None:
        """Drop ``values`` on this lane's thread, after what it was handed before: a step run
        on the event loop removed them, and their ``__del__`` is user code, which must not
        stall the loop (DESIGN decision 17). The next segment of the lane runs after it, as
        if the lane had freed them itself."""
        try:
            self.executor.submit(values.clear)
        except RuntimeError:  # the lane was retired: any thread but the loop's will do
            self.rank.plugin.drain.submit(values.clear)

    def close(self) -> None:
        """Drop the stream's values (on release). The executor is the plugin's to retire:
        Dask may already have handed it work, which must still run (and return at once)."""
        self.env.clear()

    def retire(self) -> None:
        """The stream was dropped (its last step runs now, on this lane's thread): free its
        refs and let the thread end after this segment. Blocks freed here go back to the
        allocator on this lane's device stream, in order after its queued work."""
        self.env.clear()
        self.executor.shutdown(wait=False)
