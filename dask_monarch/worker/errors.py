"""The worker's two error classes (docs/protocol.md §4.1).

User errors are values: a fresh failure makes one :class:`SeqError` that every
slot it poisons shares by identity; using a poisoned slot raises
:class:`DependentError`, which reuses the root and reports nothing. Protocol
errors raise :class:`FatalError`: the controller is broken on this rank, the
Dask worker carries on.
"""

from __future__ import annotations

import traceback


class SeqError:
    """The root cause of a user error: the failing ``seq`` and the remote traceback text."""

    __slots__ = ("seq", "error")

    def __init__(self, seq: int, error: str):
        self.seq = seq
        self.error = error

    @classmethod
    def from_exception(cls, seq: int, exc: BaseException) -> SeqError:
        return cls(seq, format_exception(exc))

    def __str__(self) -> str:
        return self.error

    def __repr__(self) -> str:
        first = self.error.strip().splitlines()[-1] if self.error.strip() else ""
        return f"SeqError(seq={self.seq}, {first!r})"


class DependentError(Exception):
    """An input slot held an error: the call fails with the same root, unreported."""

    def __init__(self, root: SeqError):
        super().__init__(root)
        self.root = root

    def __str__(self) -> str:
        return f"Computation depended on an input that failed with error: {self.root}"


class RefNotFound(Exception):
    """A ref the call names is not in this stream's table (a fresh user error)."""

    def __init__(self, ref_id: int):
        super().__init__(f"ref not found: r{ref_id}")


class FatalError(Exception):
    """A protocol violation or internal failure: breaks this controller on this rank.

    Raised in a lane, its text does not name the lane ("this stream" where it must refer to
    it): ``RankState.run_segment`` reports it led by the lane's title, once."""


class ReplayRefused(FatalError):
    """Dask tried to run a message a second time (e.g. after a worker restart)."""


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
