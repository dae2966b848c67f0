"""The controller's dependency history: one failure poisons exactly its dependents.

The error model is docs/protocol.md §4.2.

Every invocation the client issues registers the refs it uses and defines.
A use links the invocation to the one that last defined the ref. When a rank
reports ``RemoteFunctionFailed`` for a seq, that invocation and everything
that (transitively) used what it defined fail with the same exception; an
invocation registered later that uses a failed definition is born failed.
Invocations that completed without failing can never fail any more, so they
are pruned as ranks report progress; failed definitions are kept, so late
users still fail.

Pure bookkeeping, no I/O: the mesh client calls it under its lock.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any


class Invocation:
    """One issued message that may still fail: what it defines, who used that, where.

    Thousands may wait for a Status, each a young object the garbage collector walks until
    they go: so one def or one user is kept as the int itself, not in a container of its own.
    """

    __slots__ = ("seq", "defs", "users", "failure", "origin")

    def __init__(
        self,
        seq: int,
        defs: int | tuple[int, ...],
        failure: BaseException | None = None,
        origin: Any = None,
    ) -> None:
        self.seq = seq
        self.defs = defs  # the ref it defines, or a tuple of them
        # none yet, a seq, then an array of seqs: the collector walks a list's every element
        # but none of an array's, and an append is O(1) where a tuple's is a copy (a definer
        # used 10 000 times: 50 us per use)
        self.users: tuple[()] | int | array = ()
        self.failure = failure
        self.origin = origin  # where the client issued it, for the error message

    def def_refs(self) -> tuple[int, ...]:
        defs = self.defs
        return defs if type(defs) is tuple else (defs,)

    def user_seqs(self) -> Iterable[int]:
        users = self.users
        return (users,) if type(users) is int else users

    def __repr__(self) -> str:
        return f"Invocation(seq={self.seq}, defs={self.defs}, failure={self.failure!r})"


class History:
    """Invocations that may still fail, and failures that may still be fetched."""

    def __init__(self) -> None:
        self.invocations: dict[int, Invocation] = {}  # pending or failed
        self.definer: dict[int, int] = {}  # ref -> seq of its pending or failed definer
        self.completed = 0  # every seq below this has completed on every rank

    def invoke(
        self, seq: int, uses: Iterable[int], defs: Iterable[int], origin: Any = None
    ) -> BaseException | None:
        """Register an invocation (issued at ``origin``); returns the failure it is born with."""
        failure = None
        invocations, definer = self.invocations, self.definer
        for ref in uses:
            producer = definer.get(ref)
            if producer is None:
                continue
            inv = invocations[producer]
            if inv.failure is not None:
                if failure is None:
                    failure = inv.failure
            elif producer >= self.completed:
                users = inv.users
                if type(users) is array:
                    users.append(seq)
                elif users == ():
                    inv.users = seq
                else:
                    inv.users = array("q", (users, seq))
        defs = tuple(defs)
        for ref in defs:
            definer[ref] = seq
        invocations[seq] = Invocation(seq, defs[0] if len(defs) == 1 else defs, failure, origin)
        return failure

    def fail(self, seq: int, failure: BaseException) -> list[int]:
        """``seq`` failed: it and its transitive users fail too. Returns the newly failed seqs."""
        newly = []
        todo = [seq]
        while todo:
            s = todo.pop()
            inv = self.invocations.get(s)
            if inv is None or inv.failure is not None:
                continue
            inv.failure = failure
            newly.append(s)
            todo.extend(inv.user_seqs())
            inv.users = ()
        return newly

    def failure(self, seq: int) -> BaseException | None:
        """The failure ``seq`` carries, if it failed and is still kept."""
        inv = self.invocations.get(seq)
        return None if inv is None else inv.failure

    def failure_of_ref(self, ref: int) -> BaseException | None:
        """The failure the current value of ``ref`` carries, if any."""
        producer = self.definer.get(ref)
        return None if producer is None else self.invocations[producer].failure

    def complete(self, upto: int) -> None:
        """Every seq below ``upto`` has run on every rank: forget those that did not fail."""
        for seq in range(self.completed, upto):
            inv = self.invocations.get(seq)
            if inv is None or inv.failure is not None:
                continue
            del self.invocations[seq]
            for ref in inv.def_refs():
                if self.definer.get(ref) == seq:
                    del self.definer[ref]
        self.completed = max(self.completed, upto)

    def drop(self, refs: Iterable[int]) -> None:
        """The client deleted these refs: nobody can use them again."""
        for ref in refs:
            self.definer.pop(ref, None)
