"""Aliases and borrows of a storage on the client, and the four steps of a borrow.

Handles that share storage (views, in-place results) share a
:class:`StorageInfo`: every live alias of a mutated storage is redefined by
the op (and poisoned together if it fails), and a storage lent to another
stream may not be used (mutable borrow) or changed (immutable borrow) until
the borrow is dropped. A borrow's steps, all sent from here: ``BorrowCreate``
(:func:`lend`, what :meth:`dask_monarch.Stream.borrow` does),
``BorrowFirstUse`` lazily, on the borrowed tensor's first use
(:func:`first_use`), and ``BorrowLastUse`` and ``BorrowDrop`` on
:meth:`Borrow.drop`.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from .handles import Handle
from .protocol import messages as m

if TYPE_CHECKING:
    import torch

    from .controller.session import Session
    from .stream import Stream
    from .tensor import Tensor


logger = logging.getLogger("dask_monarch.borrows")


class StorageInfo:
    """What the client knows of one storage on the ranks: its live aliases and borrows."""

    __slots__ = ("_handles", "_lent_mutably", "_lent", "borrow", "known", "lazy", "__weakref__")

    def __init__(self) -> None:
        self._handles: list[weakref.ref] = []  # live aliases (dead ones pruned when read)
        self.known = False  # some alias has a value the client knows (client_values)
        self.lazy = False  # some alias is (or was) a view not sent yet (tensor.py)
        self._lent_mutably = None  # weakref to the Borrow that took this storage away
        # immutable borrows out of this storage; weak, so that a borrow nobody holds is
        # collected (and drops itself, with a warning)
        self._lent: weakref.WeakSet | None = None
        self.borrow = None  # the Borrow this storage was lent through (borrower side)

    def add(self, handle: Tensor) -> None:
        self._handles.append(weakref.ref(handle))

    def remove(self, handle: Tensor) -> None:
        """``handle`` is no alias any more (``t.data = other`` rebound it elsewhere)."""
        self._handles = [r for r in self._handles if r() is not handle]

    @property
    def handles(self) -> list[Tensor]:
        alive = [h for h in (r() for r in self._handles) if h is not None]
        if len(alive) != len(self._handles):
            self._handles = [weakref.ref(h) for h in alive]
        return alive

    @property
    def lent(self) -> weakref.WeakSet:
        if self._lent is None:
            self._lent = weakref.WeakSet()
        return self._lent

    @property
    def lent_mutably(self) -> Borrow | None:
        return self._lent_mutably() if self._lent_mutably is not None else None

    @lent_mutably.setter
    def lent_mutably(self, borrow: Borrow | None) -> None:
        self._lent_mutably = weakref.ref(borrow) if borrow is not None else None

    def refs(self) -> list[int]:
        return [h._ref.id for h in self.handles if h._owns_ref]

    def learn(self, handle: Tensor, value: torch.Tensor) -> None:
        """The client knows the value of ``handle``, an alias of this storage: ``value``
        (client_values)."""
        handle._known = value
        self.known = True

    def forget_known(self) -> None:
        """The ranks change this storage in a way the client does not follow: no alias's
        value is known any more (client_values)."""
        if self.known:
            for h in self.handles:
                h._known = None
            self.known = False


class Borrow:
    """A tensor lent from one stream to another until :meth:`drop` (also a context manager)."""

    def __init__(
        self, session: Session, borrow_id: int, origin: Tensor, borrowed: Tensor, mutable: bool
    ) -> None:
        self.session = session
        self.id = borrow_id
        self.origin = origin
        self.borrowed = borrowed
        self.mutable = mutable
        self.first_used = False
        self.dropped = False

    def drop(self) -> None:
        """Give the tensor back: the borrowed handle (and its views) can no longer be used."""
        if self.dropped:
            return
        session = self.session
        with session.lock:
            capture = session.capture
            if capture is not None and capture.tracing and self not in capture.borrows:
                raise ValueError(
                    "cannot explicitly drop a tensor inside a compiled block that "
                    "was borrowed outside of it"
                )
            ranks = self.origin._mesh._ranks
            if not self.first_used:
                self.first_used = True
                session.send(ranks, m.BorrowFirstUse(self.id))
            storage = self.borrowed._storage
            views = [h for h in storage.handles if h is not self.borrowed and h._owns_ref]
            if views:
                session.send(ranks, m.DeleteRefs([h._ref for h in views]))
            for h in storage.handles:
                h.disown(f"the borrow {self.id} it came from was dropped")
            session.send(ranks, m.BorrowLastUse(self.id))
            session.send(ranks, m.BorrowDrop(self.id))
            seq = session.new_seq()
            origin = self.origin._storage
            if self.mutable:  # the lender's aliases now hold what the borrower made of them
                session.invoke(seq, [self.borrowed._ref.id], origin.refs())
                origin.lent_mutably = None
            else:
                session.invoke(seq, [], [])
                origin.lent.discard(self)
            self._release(storage)

    def forget(self, why: str) -> None:
        """Undo a borrow that never reached the ranks (its trace failed), on the client only.

        Dropping it would send the ranks the steps of a borrow they never saw,
        which breaks the mesh; leaving it would keep its lender lent.
        """
        with self.session.lock:
            for h in self.borrowed._storage.handles:
                h.disown(why)
            origin = self.origin._storage
            if self.mutable:
                origin.lent_mutably = None
            else:
                origin.lent.discard(self)
            self._release(self.borrowed._storage)

    def _release(self, storage: StorageInfo) -> None:
        """Dropped: let go of both tensors. The borrowed ones are unusable, and a dropped
        borrow that something still holds (a compiled function's trace holds the borrows it
        made) must not keep the lender's handle alive: the trace would count it as held
        outside, and its next replay would find it gone and trace again."""
        storage.borrow = None
        self.origin = self.borrowed = None
        self.dropped = True

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.drop()

    def __del__(self) -> None:
        if not getattr(self, "dropped", True) and not self.session.closed:
            warnings.warn(
                f"borrow {self.id} was garbage collected without drop(); dropping it", stacklevel=2
            )
            session = self.session
            if session.lock.acquire(blocking=False):
                try:
                    self.drop_quietly()
                finally:
                    session.lock.release()
            elif asyncio._get_running_loop() is not None:  # as worker/device.py asks it
                # a GC on the client's event loop while the user's thread holds the lock: the
                # loop must not wait for it (the user's thread may wait on the loop)
                session.adopt_orphan(self)
            else:
                self.drop_quietly()

    def drop_quietly(self) -> None:
        """:meth:`drop` for a finalizer: it must not raise; the mesh may be gone."""
        try:
            self.drop()
        except Exception as e:
            logger.debug("dropping garbage-collected borrow %s failed: %r", self.id, e)

    def __repr__(self) -> str:
        state = "dropped" if self.dropped else "active"
        kind = "mutable" if self.mutable else "immutable"
        return f"<Borrow {self.id} ({kind}, {state})>"


def lend(stream: Stream, t: Tensor, mutable: bool) -> tuple[Tensor, Borrow]:
    """``t`` as seen from ``stream``, and the borrow that gives it back (``BorrowCreate``).

    Immutable: both streams may read it, neither may change it. Mutable: only
    ``stream`` may touch it until the drop, and its changes are visible to
    ``t``'s stream afterwards.
    """
    if not isinstance(t, Handle) or not hasattr(t, "_storage"):
        raise TypeError(f"only mesh tensors can be borrowed, got {type(t).__name__}")
    session = t._session
    with session.lock:
        t._check()
        if stream is t._stream:
            raise ValueError(f"{t!r} already belongs to stream {stream.name!r}")
        if t._storage.borrow is not None:
            raise RuntimeError(f"{t!r} is itself borrowed; borrow the original tensor")
        if mutable and t._storage._lent:
            raise RuntimeError(f"cannot borrow {t!r} mutably: it is already borrowed immutably")
        src, dst = session.stream_ref(t._stream), session.stream_ref(stream)
        borrow_id, result = session.new_id(), session.new_ref()
        first_use(session, [t])
        t._settle_views()  # the lender's views are refs before it lends their base
        if mutable:  # the borrower may change it: the client stops following its value
            t._storage.forget_known()
        borrowed = type(t)(t._mkey, session, t._mesh, stream, result)
        session.issue([t], [result.id], [borrowed])
        session.send(t._mesh._ranks, m.BorrowCreate(result, borrow_id, t._ref, src, dst))
        handle = Borrow(session, borrow_id, t, borrowed, mutable)
        borrowed._storage.borrow = handle
        capture = session.capture
        if capture is not None and capture.tracing:
            capture.borrows.append(handle)
        if mutable:
            t._storage.lent_mutably = handle
        else:
            t._storage.lent.add(handle)
        return borrowed, handle


def first_use(session: Session, handles: list[Tensor]) -> None:
    """Borrowed tensors tell their lender's stream on their first use (lazily)."""
    for h in handles:
        borrow = h._storage.borrow
        if borrow is not None and not borrow.first_used:
            borrow.first_used = True
            message = m.BorrowFirstUse(borrow.id)
            capture = session.capture
            if capture is not None and capture.tracing and borrow not in capture.borrows:
                session.send_setup(h._mesh._ranks, message)  # borrowed outside: not recorded
            else:
                session.send(h._mesh._ranks, message)
