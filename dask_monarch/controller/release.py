"""Letting go of segment tails: in batches, once Dask has finished them, off a fetch's path.

A controller holds each lane's newest segment (its *tail*) so that the next
flush can follow it: by key, where the scheduler's flush intake holds its
tasks for it (controller/intake.py), or as a future, where its flushes go
through ``Client.get``. Once a flush replaced a tail, or its rank reported it
done, the controller lets go, and the scheduler forgets the task and tells
the worker to free it. Let go at once, that work sat on the next round trip's
path: the scheduler handled the releases that rode behind a flush before it
wrote the flush's ``compute-task``, and each worker freed the old key before
its lane started; in a loop of one op and a fetch it cost about 1 ms of 4.5
(docs/dask.md §11). :class:`DeferredRelease` holds the tails let go of and
hands them over together every :data:`RELEASE_AFTER_S` on the client's event
loop: one message between round trips.

A tail whose task Dask has not finished must wait for a later batch: a
rank's report that a segment ran can beat the worker's ``task-finished`` to
the scheduler, and a task released while ``processing`` is cancelled there
(missing from the task stream and the span's figures, its payload left in the
scheduler's log to the worker). The intake keeps such keys itself; futures
wait here (:func:`drop_finished`).

Tails are taken in on the client's loop, behind whatever the caller queued
there before (``add_callback`` keeps order), so a flush that follows a tail
is sent before that tail can be let go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

RELEASE_AFTER_S = 0.1  # a batch waits this long (a future whose task has not finished: longer)


def drop_finished(futures: list) -> list:
    """Drop the futures whose task Dask finished (the client releases them); keep the rest."""
    return [future for future in futures if future.status == "pending"]


class DeferredRelease:
    """The tails a controller let go of, handed to ``let_go`` in batches on ``loop`` (a
    client's); ``let_go`` returns those to keep for the next batch."""

    def __init__(
        self,
        loop: Any,
        let_go: Callable[[list], list] = drop_finished,
        after: float = RELEASE_AFTER_S,
    ) -> None:
        self._loop = loop
        self._let_go = let_go
        self._after = after
        self._held: list = []
        self._armed = False  # a batch is due
        self._closed = False

    def add(self, tails: Iterable) -> None:
        """Let go of ``tails`` (Nones skipped) in the next batch; from any thread."""
        tails = [tail for tail in tails if tail is not None]
        if tails and not self._closed:
            try:
                self._loop.add_callback(self._take, tails)
            except (AttributeError, RuntimeError):  # the client's loop is gone: let go now
                pass

    def close(self) -> None:
        """Drop everything held, and whatever comes later (on the loop): futures go at once,
        keys with their holder (the controller went)."""
        self._closed = True
        self._held.clear()

    def _take(self, tails: list) -> None:
        if self._closed:
            return
        self._held.extend(tails)
        if not self._armed:
            self._armed = True
            self._loop.call_later(self._after, self._release)

    def _release(self) -> None:
        self._armed = False
        if not self._closed:
            self._held = self._let_go(self._held)
        if self._held and not self._closed:
            self._armed = True
            self._loop.call_later(self._after, self._release)
