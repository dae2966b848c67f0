"""The messages ranks send back to their controller."""

from typing import Any

from .checked import checked


@checked
class Status:
    """Rank ``rank`` has completed every seq below ``seq`` (the answer to RequestStatus)."""

    seq: int
    rank: int


@checked
class FetchResult:
    """The value a ``SendValue``/``SendResultOfActorCall`` computed (tensors on CPU)."""

    seq: int
    rank: int
    value: Any


@checked
class RemoteFunctionFailed:
    """A fresh failure of ``seq`` on ``rank``; ``error`` holds the remote traceback text."""

    seq: int
    rank: int
    error: str


CONTROLLER_MESSAGES: tuple[type, ...] = (Status, FetchResult, RemoteFunctionFailed)
