"""Waiting for something that happens in another process or thread: one polling loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 60.0,
    what: str = "a condition",
    every: float = 0.05,
) -> T:
    """Call ``predicate`` every ``every`` seconds until it returns something true and return
    that; raise ``TimeoutError`` naming ``what`` after ``timeout`` seconds (a generous bound:
    it turns a hang into a failure, it measures nothing)."""
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)
    return found
