"""The rank side of remote debugging: pdb on a lane's thread, its input and output on a channel.

``breakpoint()`` (``sys.breakpointhook``, installed by the plugin) and
``dm.breakpoint()`` called on a lane's thread start a :class:`RemotePdb` on
the caller's frame: a ``pdb.Pdb`` whose stdin and stdout are a
:class:`DebugSession` of this worker. The lane stays on its thread, blocked
in pdb, and says so to the controller's heartbeat ("waiting on the debugger
at f.py:12"), so a liveness warning names the breakpoint, not a hang. The
other lanes, the other ranks and every value on them keep running and
waiting as they would.

Whoever reaches the scheduler can drive a session: :func:`list_sessions`
and :func:`exchange` run on the worker's event loop through
``Client.run`` (the controller's user, ``dm.debug.attach`` and
``dask-monarch debug``), so no connection beyond Dask's own is needed.
The controller also gets a ``DebuggerPaused`` report when a session opens
and when it ends, to tell its user at once.

``c`` resumes the lane; ``q`` raises ``bdb.BdbQuit`` in the function, which
fails that call (``RemoteFunctionFailed``) and nothing else. A controller
that fails or leaves while a rank is paused quits its sessions. This module
imports neither torch nor the lanes at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import linecache
import os
import pdb
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..protocol.names import rank_function

if TYPE_CHECKING:
    from types import FrameType, TracebackType

POLL_S = 0.05  # how often a paused lane checks that its controller is still there
SESSIONS: dict[str, DebugSession] = {}  # session id -> session, every open one of this process
_lock = threading.Lock()
_counter = itertools.count(1)
_local = threading.local()  # .suppressed: breakpoints are ignored (shape propagation)
_previous_hook: Any = None
# Frames pdb never stops in while stepping: the machinery around a user function.
SKIP = [
    "dask_monarch.worker.rank",
    "dask_monarch.worker.handlers",
    "dask_monarch.worker.calls",
    "dask_monarch.worker.dispatch",
    "dask_monarch.worker.recording",
    "dask_monarch.worker.plan",
    "dask_monarch.worker.plugin",
    "distributed.*",
    "concurrent.*",
    "threading",
    "contextlib",
]


class DebugSession:
    """One pause of one lane: pdb's input queue and output buffer, shared with its drivers."""

    def __init__(self, lane: Any, where: str, header: str) -> None:
        rank = lane.rank
        self.id = f"{rank.rank}-{uuid.uuid4().hex[:6]}{next(_counter)}"
        self.lane = lane
        self.token = rank.token
        self.rank = rank.rank
        self.where = where
        self.header = header
        self.since = time.time()
        self.cond = threading.Condition()
        self.inputs: deque[str] = deque()
        self.output: list[str] = []  # printed since a driver last took it
        self.screen: list[str] = []  # printed since pdb last took a command (ends in its prompt)
        self.prompts = 0  # times pdb asked for a command
        self.waiting = False  # pdb waits for a command now
        self.ended = False
        self.seq = -1
        self._before: tuple | None = None

    # -- pdb's side (the lane's thread) -------------------------------------------------------

    def write(self, text: str) -> None:
        with self.cond:
            self.output.append(text)
            self.screen.append(text)

    def readline(self) -> str:
        """The next command; a controller that failed or left makes it ``q``."""
        abort = self.lane.rank.abort
        with self.cond:
            self.prompts += 1
            self.waiting = True
            try:
                while not self.inputs:
                    if abort.is_set():
                        self.output.append("q  (the controller failed or left)\n")
                        return "q\n"
                    self.cond.wait(POLL_S)
                line = self.inputs.popleft()
                self.screen = []  # the command answers what was shown
            finally:
                self.waiting = False
        return line if line.endswith("\n") else line + "\n"

    def open(self) -> None:
        """The lane stops here: register, tell the controller, show it in the heartbeat."""
        from ..protocol.wire import DebuggerPaused

        lane = self.lane
        if self._before is not None:  # a step (n, s) stopped again: the same pause
            return
        self._before = (lane.state, lane.doing, lane.seq, lane.peers, lane.since)
        seq = lane.recording.seq if lane.recording is not None else lane.last_seq
        self.seq = seq
        with _lock:
            SESSIONS[self.id] = self
        with self.cond:
            self.ended = False
        lane.set_waiting(
            f"the debugger: rank {self.rank} paused at {self.where} (attach with "
            f"dm.debug.attach({self.rank}) or `dask-monarch debug`)",
            seq=seq if seq >= 0 else None,
        )
        lane.rank.report(DebuggerPaused(self.rank, lane.label, seq, self.where, self.id, True))

    def close(self) -> None:
        """The lane resumed (``c``) or quit (``q``): unregister, restore the lane's state."""
        from ..protocol.wire import DebuggerPaused

        with _lock:
            SESSIONS.pop(self.id, None)
        with self.cond:
            self.ended = True
        lane = self.lane
        if self._before is not None:
            lane.state, lane.doing, lane.seq, lane.peers, lane.since = self._before
            self._before = None
        lane.rank.report(
            DebuggerPaused(self.rank, lane.label, self.seq, self.where, self.id, False)
        )

    # -- the drivers' side (the event loop) ---------------------------------------------------

    def info(self, address: str) -> dict:
        lane = self.lane
        return {
            "session": self.id,
            "token": self.token,
            "rank": self.rank,
            "stream": lane.label,
            "stream_title": lane.title,
            "seq": self.seq,
            "where": self.where,
            "since": self.since,
            "worker": address,
            "waiting": self.waiting,
        }

    def take_output(self) -> str:
        with self.cond:
            text, self.output = "".join(self.output), []
        return text

    def take_screen(self) -> str:
        """What a driver that attaches now sees: the pause's header, then everything printed
        since pdb last took a command, up to its prompt (another driver may have taken it)."""
        with self.cond:
            self.output = []
            shown = "".join(self.screen)
        return shown if shown.startswith(self.header) else f"{self.header}\n{shown}"


class _Channel(io.TextIOBase):
    """pdb's stdin and stdout: a session's command queue and output buffer."""

    def __init__(self, session: DebugSession) -> None:
        self.session = session

    def write(self, text: str) -> int:
        self.session.write(text)
        return len(text)

    def readline(self, size: int | None = -1) -> str:
        return self.session.readline()

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class RemotePdb(pdb.Pdb):
    """pdb whose console is a :class:`DebugSession`; each stop (re)opens the session."""

    def __init__(self, session: DebugSession) -> None:
        channel = _Channel(session)
        super().__init__(stdin=channel, stdout=channel, skip=SKIP, nosigint=True, readrc=False)
        self.session = session
        self.prompt = f"(Pdb rank {session.rank}) "
        self._resumed = False
        self._first = True

    def interaction(self, frame: FrameType | None, traceback: TracebackType | None) -> None:
        session = self.session
        if self._first:
            self._first = False
            session.write(session.header + "\n")
        session.open()
        self._resumed = False
        try:
            super().interaction(frame, traceback)
        finally:
            if self._resumed:
                session.close()

    def do_continue(self, arg: str) -> bool | None:
        self._resumed = True
        return super().do_continue(arg)

    do_c = do_cont = do_continue

    def do_quit(self, arg: str) -> bool | None:
        self._resumed = True
        self.message(f"quitting: the call fails with bdb.BdbQuit on rank {self.session.rank}")
        return super().do_quit(arg)

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> bool | None:
        self._resumed = True
        return super().do_EOF(arg)


# -- starting a session ----------------------------------------------------------------------


def lane_of_thread() -> Any:
    """The lane running on this thread, if this is a lane's thread (else None)."""
    if "dask_monarch.worker.lane" not in sys.modules:
        return None
    from .lane import _current

    return getattr(_current, "lane", None)


def pause(frame: Any, what: str, where: str | None = None) -> bool:
    """Stop this lane's thread in pdb at ``frame``; False if this thread is no lane's.

    A lane that runs a function on fake tensors (:func:`suppressed`), or whose
    controller failed or left (nobody could attach), does not stop.
    """
    lane = lane_of_thread()
    if lane is None:
        return False
    if getattr(_local, "suppressed", False):
        return True
    if lane.rank.released or lane.rank.failed is not None:
        return True
    if where is None:
        where = frame_location(frame)
    seq = lane.recording.seq if lane.recording is not None else lane.last_seq
    header = (
        f"rank {lane.rank.rank}, {lane.title}, seq {seq}: {what} at {where}\n"
        "'c' resumes the rank, 'q' fails the call (bdb.BdbQuit); other ranks keep running"
    )
    session = DebugSession(lane, where, header)
    RemotePdb(session).set_trace(frame)  # the last call here: pdb stops at frame's next line
    return True


def frame_location(frame: Any) -> str:
    """``f.py:12 in step: y = x * 2``: the frame's file, line, function and the line's source
    (functions sent by value bring theirs: :mod:`dask_monarch.protocol.source`)."""
    code = frame.f_code
    where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
    line = linecache.getline(code.co_filename, frame.f_lineno, frame.f_globals).strip()
    return f"{where}: {line}" if line else where


def breakpointhook(*args: Any, **kwargs: Any) -> Any:
    """``sys.breakpointhook``: remote pdb on a lane's thread, the previous hook elsewhere."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return None
    if lane_of_thread() is None:
        return (_previous_hook or sys.__breakpointhook__)(*args, **kwargs)
    return pause(sys._getframe(1), "breakpoint()")


def install_breakpointhook() -> None:
    """Make ``breakpoint()`` on a lane's thread open a remote session (once per process)."""
    global _previous_hook
    if sys.breakpointhook is not breakpointhook:
        _previous_hook = sys.breakpointhook
        sys.breakpointhook = breakpointhook


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Ignore breakpoints on this thread (a function run on fake tensors to learn shapes)."""
    before = getattr(_local, "suppressed", False)
    _local.suppressed = True
    try:
        yield
    finally:
        _local.suppressed = before


@rank_function
def remote_breakpoint(*values: Any, where: str = "") -> None:
    """What ``dm.breakpoint(*tensors)`` issued by the controller runs on each rank: a stop with
    the local shards of the tensors in ``values``."""
    pause(sys._getframe(0), "dm.breakpoint()", f"{where or '?'} (on the controller)")
    return None  # pdb stops on this line: ``p values`` shows the shards


# -- driving sessions (Client.run, on the worker's event loop) -------------------------------


async def list_sessions(token: str | None = None, dask_worker: Any = None) -> list[dict]:
    """The open sessions of this worker (of controller ``token`` if given)."""
    with _lock:
        sessions = list(SESSIONS.values())
    address = dask_worker.address if dask_worker is not None else ""
    return [s.info(address) for s in sessions if token is None or s.token == token]


async def exchange(
    session_id: str,
    line: str | None = None,
    timeout: float = 30.0,
    attach: bool = False,
    dask_worker: Any = None,
) -> dict:
    """Send ``line`` (None: nothing) to a session; return pdb's output once it asks again.

    ``ended`` says the session closed (``c`` or ``q``); ``waiting`` that pdb
    waits for the next command; neither: ``timeout`` passed while the lane ran
    (a ``n`` over a long call), the output so far is returned. ``attach``
    (a driver's first exchange): the output starts with what pdb showed since
    its last command, header and prompt included, even if another driver
    took it already.
    """
    with _lock:
        session = SESSIONS.get(session_id)
    if session is None:
        return {"output": "", "ended": True, "waiting": False, "found": False}
    with session.cond:
        asked = session.prompts
        if line is not None:
            session.inputs.append(line)
            session.cond.notify_all()
        elif session.waiting:
            asked -= 1  # it already asks: return what it printed
    deadline = time.monotonic() + timeout
    while True:
        with session.cond:
            ready = session.ended or (session.waiting and session.prompts > asked)
        if ready or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    shown = session.take_screen() if attach and line is None else session.take_output()
    return {
        "output": shown,
        "ended": session.ended,
        "waiting": session.waiting,
        "found": True,
    }


__all__ = [
    "DebugSession",
    "RemotePdb",
    "breakpointhook",
    "exchange",
    "install_breakpointhook",
    "list_sessions",
    "pause",
    "remote_breakpoint",
    "suppressed",
]
