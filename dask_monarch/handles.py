"""Handles: values on the ranks that the client holds by ref (Monarch's ``Referenceable``).

A mesh :class:`~dask_monarch.Tensor` and a :class:`~dask_monarch.OpaqueRef`
are both a ref on the ranks of one mesh, on one stream, owned by the client
object: it passes the client-side checks at every use, travels as its ref
(``__monarch_ref__``), and is deleted on the ranks when it is dropped or
garbage-collected (batched into ``DeleteRefs``). This base holds what they
share; each adds its own checks (:meth:`Handle._check`) and what it holds.
"""

from __future__ import annotations

import threading
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .controller.session import Session
    from .mesh import DeviceMesh
    from .protocol import messages as m
    from .stream import Stream


class Handle:
    """A value on every rank of a mesh, held by the client as its ref."""

    __slots__ = ()  # the subclasses keep their fields as they like (a torch.Tensor has a dict)

    _ref: m.Ref
    _session: Session
    _mesh: DeviceMesh
    _stream: Stream
    _owns_ref: bool  # deleting it on the ranks is this handle's job
    _dropped: str | None  # where it was dropped, once it was
    _lazy = None  # a mesh tensor's view not sent yet (tensor.py); other handles never are

    @property
    def mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def stream(self) -> Stream:
        return self._stream

    def __monarch_ref__(self) -> m.Ref:
        self._check()
        return self._ref

    def _check(self) -> None:
        """The client-side checks of every use (docs/protocol.md §1.2)."""
        if self._session.closed:
            raise exited(self._mesh)
        if self._dropped is not None:
            raise misuse(
                f"DROPPED: {self!r} was dropped and cannot be used; it was dropped at:\n"
                f"{self._dropped}"
            )

    def _nbytes(self) -> int:
        """What it holds on each rank, as far as the client knows (deletes batch by it)."""
        return 0

    def drop(self) -> None:
        """Delete the value on the ranks now; the handle cannot be used afterwards."""
        if self._dropped is None:
            self._dropped = drop_trace()
            if self._owns_ref:
                self._owns_ref = False
                self._session.drop_ref(self._mesh._ranks, self._ref, self._nbytes())

    def disown(self, why: str | None = None) -> None:
        """Leave the value on the ranks to someone else (a recording, a borrow's end, a dry
        run): this handle will not delete it. ``why``: the handle is unusable from now on."""
        self._owns_ref = False
        if why is not None and self._dropped is None:
            self._dropped = why

    def rebind(self, ref: m.Ref) -> None:
        """Point the handle at ``ref`` (a replay's new value), deleting the value it owned."""
        if self._owns_ref:
            self._session.drop_ref(self._mesh._ranks, self._ref, self._nbytes())
        self._ref = ref
        self._owns_ref = True

    @property
    def dropped(self) -> bool:
        return self._dropped is not None

    def __del__(self) -> None:
        if getattr(self, "_owns_ref", False) and self._dropped is None:
            self._session.drop_ref(self._mesh._ranks, self._ref, self._nbytes())


last_misuse = threading.local()  # .value: the last misuse() error of this thread


def misuse(text: str) -> TypeError:
    """A client-side check failed (docs/protocol.md §1.2): a TypeError, remembered for operators.

    torch turns a TypeError raised inside ``a + b`` into ``NotImplemented``, and
    Python then reports only "unsupported operand types"; the operators of
    :class:`~dask_monarch.Tensor` raise the remembered error instead.
    """
    error = TypeError(text)
    last_misuse.value = error
    return error


def exited(mesh: DeviceMesh) -> RuntimeError:
    return RuntimeError(
        f"{mesh!r} has exited (mesh.exit()): its tensors are gone and it runs "
        "nothing more; create a new mesh with dask_monarch.device_mesh"
    )


def drop_trace() -> str:
    """Where a handle was dropped, for the DROPPED error."""
    return "".join(traceback.format_stack(limit=8)[:-2])
