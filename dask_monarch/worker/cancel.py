"""``mesh.exit(cancel=True)`` on a rank: stop what a controller runs here, now.

A remote function that never returns (a loop that does not end, a wait on
something that never comes) holds its lane's thread and a Dask execution
slot until the worker restarts, burning CPU if it spins. Cancelling releases
the rank (queued segments return at once, lanes blocked in a borrow, a
collective or a send give up) and raises :class:`Cancelled` in the thread of
every lane that is running a call, through CPython's asynchronous exceptions
(``PyThreadState_SetAsyncExc``). Python code sees it at its next bytecode; a
call inside C code (``time.sleep``, a long torch kernel, a blocking socket)
sees it only when that C call returns. The call then fails as a cancelled
one, its segment ends, and its thread and slot go back to the worker.

:func:`cancel` waits up to ``grace`` seconds for the interrupted lanes to
stop and says, per lane, where each call was and whether it stopped: one
still running is in C code, named by its innermost Python line, and only a
restart of its worker frees it (``client.restart_workers``).
"""

from __future__ import annotations

import ctypes
import linecache
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rank import RankState

POLL_S = 0.02


class Cancelled(BaseException):
    """Raised in a lane's thread by ``mesh.exit(cancel=True)`` (a BaseException, so that
    ``except Exception`` in user code does not swallow it)."""


def cancel(state: RankState, grace: float) -> list[dict]:
    """Release ``state`` and interrupt its running calls (on a thread, not the loop).

    Returns one dict per lane that was busy: ``rank``, ``lane`` (its title),
    ``seq`` (the message it ran), ``where`` (innermost user frame and its
    line), ``stopped`` (False: still in C code after ``grace`` seconds).
    """
    busy = []
    for lane in state.all_lanes():
        if lane.state == "idle":
            continue
        ident = lane.thread_ident()
        frame = sys._current_frames().get(ident) if ident is not None else None
        busy.append((lane, ident, lane.doing, lane.last_seq, _where(lane, frame)))
    state.release()  # queued work returns at once; blocked waits give up
    for lane, ident, doing, seq, where in busy:
        # only a thread in user code: an idle executor's thread (a segment on the event loop)
        # would die of it, and torch's own C calls cannot be interrupted anyway
        if where and not doing and _still_in(lane, ident, seq):
            _raise_in(ident, Cancelled)
    deadline = time.monotonic() + grace
    while any(lane.state != "idle" for lane, *_ in busy) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return [
        {
            "rank": state.rank,
            "lane": lane.title,
            "seq": seq,
            "doing": doing,
            "where": where,
            "stopped": lane.state == "idle",
        }
        for lane, _, doing, seq, where in busy
    ]


def _still_in(lane, ident: int, seq: int) -> bool:
    """Whether ``lane``'s thread still runs the user code of call ``seq``, as when the cancel
    looked. The release in between may take a while (a pipe's producer, a communicator) and
    end the call itself (a collective, a wait on the rank): raised in the idle executor's
    thread, or in Dask's code finishing the task, the exception would kill the thread, or
    leave the task executing forever."""
    if lane.state == "idle" or lane.doing or lane.last_seq != seq:
        return False
    return lane.user_frame(sys._current_frames().get(ident)) is not None


def _raise_in(ident: int, exc: type[BaseException]) -> None:
    """Raise ``exc`` in the thread ``ident`` at its next bytecode (CPython's async exception)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc))


def _where(lane, frame) -> str:
    """The lane's innermost user frame and the line it runs: where a cancel finds it."""
    where = lane.where(frame)
    if not where:
        return ""
    code_line = ""
    user = lane.user_frame(frame)
    if user is not None:
        code_line = linecache.getline(user.f_code.co_filename, user.f_lineno).strip()
    return f"{where}: {code_line}" if code_line else where
