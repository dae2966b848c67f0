"""A stream's lane on one rank: a single-thread executor, its own ref table, its CUDA stream.

Dask runs a lane's segments through the ``executor`` annotation; the compiler
chains consecutive segments of a lane with graph edges, so a lane holds at
most one running task and runs its segments in order (DESIGN decisions 2, 3).
Each segment carries its index: a segment seen twice (Dask re-running work
after a lost worker) is refused, never re-executed.

Why lanes cannot starve each other: the worker runs at most ``nthreads``
tasks across *all* executors (dask-notes §12). The plugin raises
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

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ..protocol.messages import StreamCreationMode
from .calls import lookup
from .errors import ReplayRefused, SeqError

if TYPE_CHECKING:
    from .rank import RankState


_current = threading.local()


def current_lane() -> Lane:
    """The lane running on this thread (for functions that need to block it, like pipe.peek)."""
    return _current.lane


class Lane:
    """The executor, ref table and progress of one stream (or the control steps) of a rank."""

    def __init__(self, rank: RankState, label: Any, executor_name: str,
                 device: torch.device | None):
        self.rank = rank
        self.label = label  # stream id, or wire.CONTROL
        self.executor_name = executor_name
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=executor_name)
        self.device = device  # a CUDA device, or None on CPU
        self.env: dict[int, Any] = {}
        self.mode: StreamCreationMode | None = None
        self.cuda_stream = None
        self.next_index = 0
        self.recording = None  # the ReplayState while a CallRecording replays on this lane
        # progress, for the dashboard
        self.state = "idle"  # idle | running | waiting
        self.doing = ""
        self.last_seq = -1  # the newest seq a handler started (set by the handlers)
        self.done_seq = -1  # last_seq when the lane last finished a segment
        self.steps = 0
        self.segments = 0
        self.busy_since = 0.0
        self.busy_seconds = 0.0

    # -- values -------------------------------------------------------------------------------

    def value_of(self, ref_id: int) -> Any:
        """An argument's value: a device mesh or pipe if the id names one, else the stream's."""
        rank = self.rank
        if rank.meshes and ref_id in rank.meshes:
            return rank.meshes[ref_id]
        if rank.pipes and ref_id in rank.pipes:
            return rank.pipes[ref_id]
        return lookup(self.env, ref_id)

    # -- lifecycle ----------------------------------------------------------------------------

    def create(self, mode: StreamCreationMode) -> None:
        """``CreateStream``: a fresh, empty stream (re-creating an id replaces it)."""
        self.env.clear()
        self.mode = mode
        if self.device is not None:
            if mode is StreamCreationMode.CreateNewStream:
                self.cuda_stream = torch.cuda.Stream(device=self.device)
            else:
                self.cuda_stream = torch.cuda.default_stream(self.device)

    def claim_index(self, index: int) -> None:
        """Segments run exactly once and in order; anything else is a replay."""
        if index != self.next_index:
            raise ReplayRefused(
                f"stream {self.label}: segment {index} arrived when {self.next_index} was expected "
                "(Dask re-ran work, e.g. after a lost worker); refusing to execute it twice"
            )
        self.next_index += 1

    def set_waiting(self, what: str) -> None:
        self.state, self.doing = "waiting", what

    def set_running(self, what: str = "") -> None:
        self.state, self.doing = "running", what

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
        state = self.state
        return {
            "stream": self.label,
            "state": state,
            "doing": self.doing,
            "busy_for": round(time.monotonic() - self.busy_since, 3) if state != "idle" else 0,
            "last_seq": self.last_seq,
            "done_seq": self.done_seq,
            "refs": len(values),
            "errors": sum(1 for v in values if type(v) is SeqError),
            "tensor_bytes": sum(storages.values()),
            "steps": self.steps,
            "segments": self.segments,
            "busy_seconds": round(self.busy_seconds, 3),
        }

    def close(self) -> None:
        """Drop the stream's values (on release). The executor is the plugin's to retire:
        Dask may already have handed it work, which must still run (and return at once)."""
        self.env.clear()
