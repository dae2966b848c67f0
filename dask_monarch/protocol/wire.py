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


class ExpectResults(NamedTuple):
    """What the call of ``seq`` on this stream returns, as its propagation said: per result
    ref, ``(shape, dtype, device type)`` of a tensor (``"cuda"``: the rank's GPU), or None
    (not checked). ``function`` names it in the error of a result that is something else
    (see Controller.expect_results)."""

    seq: int
    function: str
    results: tuple


class DropLane(NamedTuple):
    """The last step of a stream's lane (:meth:`Controller.drop_stream`): free its refs, its
    communicators and its thread, after everything the stream ran before."""


# Every step class above: plain data, which a worker that accepts no pickled code loads
# (worker/restricted.py).
STEPS = (StatusProbe, ReadRef, ActorCall, ExpectResults, DropLane)


class Payload:
    """A segment's pickled steps, as a task argument that the worker running it empties.

    ``data`` is a tuple of pickled lists of steps, to be run in order: the part
    of a segment that every rank shares is pickled once (the compiler's
    ``_Payloads``).

    Dask keeps a task's arguments after it ran: the worker's stimulus log
    holds its last ``distributed.admin.low-level-log-length`` events, each
    with its task (docs/dask.md §13). A large argument in a message would stay
    on the worker until a thousand more events passed; taken out of this
    holder as the segment starts, it lives only as long as the segment runs.
    """

    __slots__ = ("data", "steps")

    def __init__(self, data: tuple[bytes, ...] | None) -> None:
        self.data = data
        # the steps, once the worker that runs them unpickled them ahead of time to judge
        # them (worker/inline.py); never sent
        self.steps: list | None = None

    def __reduce__(self) -> tuple:
        return (Payload, (self.data,))

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.data or ()))

    def take(self) -> tuple[bytes, ...] | None:
        """The pickles, once; None for a holder already taken."""
        data, self.data = self.data, None
        return data

    def take_steps(self) -> list | None:
        """The steps unpickled ahead of time, once (None if they were not)."""
        steps, self.steps = self.steps, None
        return steps


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


class LaneProgress(NamedTuple):
    """What one lane is doing, as the worker's event loop sees it (a heartbeat, the dashboard).

    ``state`` is ``idle``, ``running`` or ``waiting``; ``doing`` names what it
    runs or waits on ("" while a call runs); ``seq`` is the seq of the message
    it waits in, when that message has one, and ``next_seq`` otherwise the
    first seq after it in the running segment (the one the wait holds back);
    ``for_s`` how long it has been in
    this state; ``peers`` the ``(rank, lane)`` pairs a wait needs (the other
    members of a collective, the other end of a send or copy); ``where`` the
    innermost frame outside dask_monarch and torch of a call that runs long.
    """

    lane: Any
    state: str
    doing: str
    seq: int | None
    next_seq: int | None
    last_seq: int
    done_seq: int
    segments: int
    for_s: float
    peers: tuple
    where: str


class Heartbeat(NamedTuple):
    """The answer to the controller's heartbeat ``beat``: every lane of ``rank``.

    Answered from the worker's event loop, never from a lane, so a rank whose
    lanes are all blocked still answers; one that does not is frozen or cut off.
    """

    rank: int
    beat: int
    lanes: tuple  # of LaneProgress


class DebuggerPaused(NamedTuple):
    """A lane of ``rank`` stopped in pdb (``paused``) at ``where`` in ``seq``, or resumed
    (``paused`` False): ``session`` is what ``dm.debug.attach`` and ``dask-monarch debug``
    drive (:mod:`dask_monarch.worker.debugger`)."""

    rank: int
    lane: Any
    seq: int
    where: str
    session: str
    paused: bool
