"""The client under a controller: a lost scheduler or lost futures fail the controller at once.

A controller learns what its ranks did from their report streams
(:mod:`.reports`), but its work reaches them through the client's scheduler.
When the client loses its scheduler connection it cancels every future it
holds (and the scheduler forgets their keys); when the scheduler cancels or
fails a segment's task, no report of it may ever come. Either way the
controller would wait on reports forever, so :class:`ClientWatch` looks at the
client and at the controller's tail futures a few times a second, on the
client's event loop, and breaks the controller with a ``DeviceException``
that names the cause (DESIGN decision 12).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distributed import Client
from tornado.ioloop import PeriodicCallback

from ..exceptions import DeviceException

INTERVAL_MS = 50  # how often the client and the tail futures are looked at

# why a future was cancelled (``FutureCancelledError.reason``) -> what the user is told
_REASONS = {
    "scheduler-connection-lost": "the client lost its connection to the scheduler",
    "scheduler-restart": "the scheduler restarted",
}


class ClientWatch:
    """Break a controller once its client or its tail futures can no longer deliver its work.

    ``problem`` says why the client cannot carry work any more (closed, or
    its scheduler lost), or None; ``tails`` gives the futures of the newest
    segment of each lane (any thread may replace them); ``fail`` breaks the
    controller (it does nothing once the controller is broken or closed; a
    lost client is not logged there: whoever waits raises it, and scripts
    that close their client first should end with one message, not many).
    Start and stop it from any thread.
    """

    def __init__(
        self,
        client: Client,
        problem: Callable[[], str | None],
        tails: Callable[[], list],
        fail: Callable[..., None],
    ) -> None:
        self.client = client
        self.problem = problem
        self.tails = tails
        self.fail = fail
        self._erred: set = set()  # keys seen erred once: a Fatal report gets a tick to win
        self._callback = PeriodicCallback(self.check, INTERVAL_MS)

    def start(self) -> None:
        self.client.loop.add_callback(self._callback.start)

    def stop(self) -> None:
        try:
            self.client.loop.add_callback(self._callback.stop)
        except Exception:  # the client's loop is gone: nothing runs the callback any more
            self._callback.stop()

    def check(self) -> None:
        """Fail the controller if its client or one of its tail futures says its work is lost."""
        problem = self.problem()
        if problem is not None:
            self._callback.stop()
            self.fail(DeviceException(problem), log=False)
            return
        cause = self.lost_work()
        if cause is not None:
            self._callback.stop()
            self.fail(cause)

    def lost_work(self) -> DeviceException | None:
        """Why a tail future says its work will never be reported, or None."""
        for future in self.tails():
            state = future.status
            if state == "cancelled":
                return DeviceException(_cancelled(future), rank=rank_of(future.key))
            if state == "error":
                if future.key not in self._erred:
                    self._erred.add(future.key)
                    continue
                return DeviceException(
                    f"Dask failed the task of segment {future.key!r}: {_error_text(future)}",
                    rank=rank_of(future.key),
                )
        return None


def _cancelled(future: Any) -> str:
    exc = future._state.exception  # FutureCancelledError: key, reason, msg
    reason = getattr(exc, "reason", None) or "unknown"
    what = _REASONS.get(
        reason,
        "the scheduler cancelled its work"
        + ("" if reason == "unknown" else f" (reason: {reason})"),
    )
    return (
        f"{what}: segment {future.key!r} and the rest of the mesh's work are lost; "
        "create a new mesh"
    )


def _error_text(future: Any) -> str:
    exc = future._state.exception
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"


def rank_of(key: Any) -> int | None:
    """The rank in a segment key ``(name, token, rank, lane, index)``."""
    if isinstance(key, tuple) and len(key) == 5 and type(key[2]) is int:
        return key[2]
    return None
