"""How a failed call is recorded: poisoned slots, and one report per fresh failure.

A fresh failure makes one :class:`SeqError`, reported once, that the call's
results and mutated inputs all hold; a dependent failure (an input already
held an error) poisons them with the same root and reports nothing. Inside a
recording's replay the failure belongs to the replay, which reports it once
for the ``CallRecording``. Every handler that runs user code records its
failures here.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..protocol.messages import Ref, RemoteFunctionFailed
from .calls import poison
from .cancel import Cancelled
from .errors import DependentError, FatalError, SeqError
from .lane import Lane


def fail_call(
    lane: Lane, seq: int, results: Sequence[Ref | None], mutates: Sequence[Ref], exc: BaseException
) -> SeqError:
    """A fresh failure: one SeqError, reported once, poisoning results and mutates.

    A call that ``mesh.exit(cancel=True)`` interrupted is no failure of the user's: its
    rank was released, and the segment ends here (worker/cancel.py)."""
    if isinstance(exc, Cancelled):
        raise FatalError(f"the call of seq {seq} was cancelled") from None
    if lane.recording is not None:
        error = lane.recording.fresh_error(lane.rank, exc)
        poison(lane.env, results, mutates, error)
        return error
    error = SeqError.from_exception(seq, exc)
    poison(lane.env, results, mutates, error)
    lane.rank.record_error(error)
    lane.rank.report(RemoteFunctionFailed(seq, lane.rank.rank, error.error))
    return error


def call_failed(
    lane: Lane, seq: int, results: Sequence[Ref | None], mutates: Sequence[Ref], exc: BaseException
) -> None:
    """A call raised: a dependent failure reuses its root, anything else is fresh."""
    if isinstance(exc, DependentError):
        dependent_failure(lane, results, mutates, exc.root)
    else:
        fail_call(lane, seq, results, mutates, exc)


def dependent_failure(
    lane: Lane, results: Sequence[Ref | None], mutates: Sequence[Ref], root: SeqError
) -> None:
    """An input held an error: poison with the same root, report nothing."""
    poison(lane.env, results, mutates, root)
    if lane.recording is not None:
        lane.recording.dependent(root)
