"""Streams and borrows on the client (monarch-semantics §1.6).

A :class:`Stream` is a named lane on every rank: work on different streams
runs concurrently, work on one stream in order. Tensors belong to the stream
that made them; another stream uses them only through a borrow, which the
client turns into the four borrow messages at the right moments (first use
lazily, last use and drop on :meth:`Borrow.drop`).
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .protocol import messages as m

if TYPE_CHECKING:
    from .tensor import Tensor


class Stream:
    """A named stream; created on a mesh's ranks the first time it is used there."""

    def __init__(self, name: str, *, _default: bool = False):
        if not isinstance(name, str) or not name:
            raise TypeError(f"a stream needs a non-empty name, got {name!r}")
        self.name = name
        self.default = _default

    @property
    def creation_mode(self) -> m.StreamCreationMode:
        return (m.StreamCreationMode.UseDefaultStream if self.default
                else m.StreamCreationMode.CreateNewStream)

    @contextlib.contextmanager
    def activate(self) -> Iterator[Stream]:
        """Make this the stream new work runs on, inside the ``with`` block."""
        _active.append(self)
        try:
            yield self
        finally:
            _active.pop()

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """``t`` as seen from this stream, and the borrow that must be dropped to give it back.

        Immutable: both streams may read it, neither may change it. Mutable:
        only this stream may touch it until the drop, and its changes are
        visible to ``t``'s stream afterwards.
        """
        from .tensor import Tensor

        if not isinstance(t, Tensor):
            raise TypeError(f"only mesh tensors can be borrowed, got {type(t).__name__}")
        return t._client.borrow(t, self, mutable)

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


DEFAULT = Stream("main", _default=True)
_active: list[Stream] = [DEFAULT]


def get_active_stream() -> Stream:
    """The stream new work runs on (``main`` unless another one is active)."""
    return _active[-1]


class Borrow:
    """A tensor lent from one stream to another until :meth:`drop` (also a context manager)."""

    def __init__(self, client, borrow_id: int, origin: Tensor, borrowed: Tensor, mutable: bool):
        self.client = client
        self.id = borrow_id
        self.origin = origin
        self.borrowed = borrowed
        self.mutable = mutable
        self.first_used = False
        self.dropped = False

    def drop(self) -> None:
        """Give the tensor back: the borrowed handle (and its views) can no longer be used."""
        if not self.dropped:
            self.client.drop_borrow(self)

    def __enter__(self) -> Borrow:
        return self

    def __exit__(self, *exc) -> None:
        self.drop()

    def __del__(self):
        if not getattr(self, "dropped", True) and not self.client.closed:
            warnings.warn(f"borrow {self.id} was garbage collected without drop(); dropping it",
                          stacklevel=2)
            with contextlib.suppress(Exception):
                self.drop()

    def __repr__(self) -> str:
        state = "dropped" if self.dropped else "active"
        kind = "mutable" if self.mutable else "immutable"
        return f"<Borrow {self.id} ({kind}, {state})>"


def drop_trace() -> str:
    """Where a tensor was dropped, for the DROPPED error."""
    return "".join(traceback.format_stack(limit=8)[:-2])
