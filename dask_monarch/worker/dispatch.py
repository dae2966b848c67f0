"""One table from message type to handler: adding a message is one class and one handler.

Every handler takes ``(lane, message)``: the lane it runs on (a stream's lane,
or the rank's control lane for worker-level messages) and the message. The
rank-wide state is ``lane.rank``. Handlers run on the lane's thread, in
message order for that lane; their docstrings state blocking and error
behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import FatalError

HANDLERS: dict[type, Callable[[Any, Any], None]] = {}


def handles(*types: type):
    """Register the decorated function as the handler of ``types``."""

    def register(fn):
        for t in types:
            if t in HANDLERS:
                raise RuntimeError(f"{t.__name__} already handled by {HANDLERS[t].__qualname__}")
            HANDLERS[t] = fn
        return fn

    return register


def handle(lane, message) -> None:
    """Run one message on ``lane`` (used for nested messages: groups, recordings)."""
    try:
        handler = HANDLERS[type(message)]
    except KeyError:
        raise FatalError(f"no handler for {type(message).__name__}") from None
    handler(lane, message)
