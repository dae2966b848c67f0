"""Letting go of segment futures: in batches, once Dask has finished them, off a fetch's path.

A controller holds the future of each lane's newest segment (its *tail*) so
that the next flush can follow it. Once a flush replaced it, or its rank
reported it done, the controller lets go: the client sends
``client-releases-keys``, the scheduler forgets the task and tells the worker
to free it, and the worker says it did. Let go at once, that work sat on the
next round trip's path: the scheduler handled the releases that rode behind a
flush before it wrote the flush's ``compute-task``, and each worker freed the
old key before its lane started; in a loop of one op and a fetch it cost
about 1 ms of 4.5 (docs/dask.md §11). :class:`DeferredRelease` holds those
futures and drops them together every :data:`RELEASE_AFTER_S` on the client's
event loop: the same messages, in one batch, between round trips.

It also keeps a future whose task Dask has not finished for the next batch:
a rank's report that a segment ran can beat the worker's ``task-finished`` to
the scheduler, and a task released while ``processing`` is cancelled there
(missing from the task stream and the span's figures, its payload left in the
scheduler's log to the worker).

Futures are taken in on the client's loop, behind whatever the caller queued
there before (``add_callback`` keeps order), so a flush that follows a tail
is sent before that tail can be let go.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

RELEASE_AFTER_S = 0.1  # a batch waits this long (a future whose task has not finished: longer)


class DeferredRelease:
    """The futures a controller let go of, dropped in batches on ``loop`` (a client's)."""

    def __init__(self, loop: Any, after: float = RELEASE_AFTER_S) -> None:
        self._loop = loop
        self._after = after
        self._held: list = []
        self._armed = False  # a batch is due
        self._closed = False

    def add(self, futures: Iterable) -> None:
        """Let go of ``futures`` (Nones skipped) in the next batch; from any thread."""
        futures = [future for future in futures if future is not None]
        if futures and not self._closed:
            try:
                self._loop.add_callback(self._take, futures)
            except (AttributeError, RuntimeError):  # the client's loop is gone: let go now
                pass

    def close(self) -> None:
        """Let go of everything now, and of whatever comes later at once (on the loop)."""
        self._closed = True
        self._held.clear()

    def _take(self, futures: list) -> None:
        if self._closed:
            return
        self._held.extend(futures)
        if not self._armed:
            self._armed = True
            self._loop.call_later(self._after, self._release)

    def _release(self) -> None:
        self._armed = False
        # a future dropped here is released by the client, with the others, on this loop pass
        self._held = [future for future in self._held if future.status == "pending"]
        if self._held and not self._closed:
            self._armed = True
            self._loop.call_later(self._after, self._release)
