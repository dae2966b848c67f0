"""Internal data between a controller and its workers that is not Monarch's protocol.

Steps are what the compiler adds to lane segments besides worker messages;
reports are what a rank sends back on its report stream besides the public
controller messages (:class:`~dask_monarch.messages.Status` and
:class:`~dask_monarch.messages.RemoteFunctionFailed`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

CONTROL = "control"  # the lane label of a rank's control steps


# --------------------------------------------------------------------------- steps


class StatusProbe(NamedTuple):
    """``RequestStatus(seq)`` fanned out to each of a rank's ``lanes`` lanes; the last to
    pass it answers ``Status(seq + 1)``."""

    seq: int
    probe: int
    lanes: int


class ReadRef(NamedTuple):
    """A ``GetRefUnitTestsOnly`` whose reply goes to :meth:`Controller.get_ref` (``probe``)."""

    probe: int
    message: Any


class ActorCall(NamedTuple):
    """The method an actor runs for the actor-call message of ``seq`` (see Controller.call_actor);
    Refs in the arguments stand for the message's ``local_state`` values."""

    broker_id: tuple
    seq: int
    method: str
    args_kwargs: Any


# --------------------------------------------------------------------------- reports


class LaneDone(NamedTuple):
    """Segment ``index`` of ``lane`` (a stream id or ``CONTROL``) ran to its end."""

    rank: int
    lane: Any
    index: int


class Fatal(NamedTuple):
    """A protocol or internal error: the controller is broken on this rank."""

    rank: int
    cause: str


class ValueFailed(NamedTuple):
    """A message without a seq (``Reduce``, ``SendTensor``) failed ``ref`` on ``rank``; the
    user API fails the seq that defined ``ref`` (a :class:`RemoteFunctionFailed` for it)."""

    rank: int
    ref: int
    error: str


class Fetched(NamedTuple):
    """A fetched value, pickled on the worker at the moment it was computed."""

    seq: int
    rank: int
    payload: bytes


class RefValue(NamedTuple):
    """Reply to :class:`ReadRef`: ``state`` is ``"absent"``, ``"ok"`` (``value`` = pickled
    bytes) or ``"error"`` (``value`` = the error text)."""

    probe: int
    rank: int
    state: str
    value: Any


class Exited(NamedTuple):
    """``Exit`` ran on ``rank``; ``error`` is the error it was given, if any."""

    rank: int
    error: Any
