"""Streams on the client (docs/protocol.md §1.6).

A :class:`Stream` is a named lane on every rank: work on different streams
runs concurrently, work on one stream in order. Its lane (a thread and a ref
table per rank) is created the first time a mesh uses it and ends once the
Stream object and every tensor on it are garbage, after everything it ran
(:meth:`Session.stream_ref <dask_monarch.controller.session.Session.stream_ref>`);
its name is what the dashboard and errors show. Create a stream once, not in
every step. Tensors belong to the stream that made them; another stream uses
them only through a borrow (:meth:`Stream.borrow`; :mod:`dask_monarch.borrows`
holds a borrow's steps).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from .borrows import Borrow, lend
from .protocol import messages as m

if TYPE_CHECKING:
    import torch

    from .mesh import DeviceMesh
    from .tensor import Tensor


class Stream:
    """A named stream; created on a mesh's ranks the first time it is used there."""

    def __init__(self, name: str, *, _default: bool = False) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"a stream needs a non-empty name, got {name!r}")
        self.name = name
        self.default = _default
        # session -> the stream's own random generators there (dm.random.seed_stream)
        self._generators: weakref.WeakKeyDictionary | None = None

    @property
    def creation_mode(self) -> m.StreamCreationMode:
        return (
            m.StreamCreationMode.UseDefaultStream
            if self.default
            else m.StreamCreationMode.CreateNewStream
        )

    @contextlib.contextmanager
    def activate(self) -> Iterator[Stream]:
        """Make this the stream new work runs on, inside the ``with`` block."""
        token = _active.set(self)
        try:
            yield self
        finally:
            _active.reset(token)

    def borrow(self, t: Tensor, mutable: bool = False) -> tuple[Tensor, Borrow]:
        """``t`` as seen from this stream, and the borrow that must be dropped to give it back.

        Immutable: both streams may read it, neither may change it. Mutable:
        only this stream may touch it until the drop, and its changes are
        visible to ``t``'s stream afterwards. Sends ``BorrowCreate``.
        """
        return lend(self, t, mutable)

    def generator_for(self, mesh: DeviceMesh, device: torch.device | None) -> Any:
        """This stream's own generator (an OpaqueRef) for a random op on ``mesh`` and
        ``device``, or None when it draws from the ranks' default generators."""
        own = self._generators.get(mesh._session) if self._generators is not None else None
        if own is None:
            return None
        if not own.ranks.issuperset(mesh._ranks):
            raise RuntimeError(
                f"stream {self.name!r} has generators of its own on ranks {sorted(own.ranks)} "
                f"only, not on every rank of {mesh!r}; call dask_monarch.random.seed_stream "
                "under a mesh that holds them all"
            )
        return own.cuda if device is not None and device.type == "cuda" else own.cpu

    def __repr__(self) -> str:
        return f"Stream({self.name!r})"


DEFAULT = Stream("main", _default=True)
# Per thread and per asyncio task, like the active mesh (tensor.py).
_active: ContextVar[Stream] = ContextVar("dask_monarch_active_stream", default=DEFAULT)


def get_active_stream() -> Stream:
    """The stream new work runs on (``main`` unless another one is active in this thread/task)."""
    return _active.get()
