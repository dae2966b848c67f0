"""Worker-resident objects: a Python object on every rank, held by handle (``dm.OpaqueRef``).

``loader = dm.OpaqueRef(make_loader, path, batch=32)`` runs ``make_loader`` on
every rank of the active mesh, on the active stream, and keeps what it returns
in that stream's ref table (docs/protocol.md §2.1: a ref holds any Python
value). The client holds only the handle: a ``@dm.remote`` function called
with it receives the rank's object. It is a remote call (``CallFunction`` of
the rank-side builder, ``worker/resident.py``, which binds the object whole),
so everything a ref does, it does: deleted on the ranks when the handle is
dropped or collected (the batched ``DeleteRefs``), a failing factory poisons
exactly what uses the object (docs/protocol.md §4), and the worker carries on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch.utils._pytree import tree_flatten

from .borrows import first_use
from .handles import Handle, misuse
from .mesh import RemoteProcessGroup
from .protocol import messages as m
from .protocol.messages.values import resolvable
from .stream import Stream, get_active_stream
from .tensor import Tensor, placement

if TYPE_CHECKING:
    from .mesh import DeviceMesh

BUILD = "dask_monarch.worker.resident.build"  # the rank's side (worker/resident.py), by path


class OpaqueRef(Handle):
    """``factory(*args, **kwargs)``'s result on every rank of the active mesh, held by handle.

    Mesh tensors, process groups and other OpaqueRefs among the arguments
    arrive as the rank's values. The object lives on the stream that was
    active when it was made; remote functions on that stream receive it.
    :meth:`drop` (or garbage collection of the handle) deletes it on the ranks.
    """

    def __init__(self, factory: Callable | str, *args: Any, **kwargs: Any) -> None:
        if not (callable(factory) or isinstance(factory, str)):
            raise TypeError(f"OpaqueRef needs a callable or an import path, got {factory!r}")
        self._dropped: str | None = None
        self._owns_ref = False
        name = factory if isinstance(factory, str) else getattr(factory, "__qualname__", "?")
        self._name = name
        leaves = tree_flatten((args, kwargs))[0]
        handles, objects = split_handles(leaves)
        groups = [x for x in leaves if isinstance(x, RemoteProcessGroup)]
        mesh, stream = place(handles, objects, f"OpaqueRef({name})", groups)
        if any(h.requires_grad for h in handles):
            warnings.warn(
                f"OpaqueRef({name}) is given mesh tensors that require grad: on the ranks "
                "they are values without .grad (gradients are the client's autograd's), so "
                "an optimizer built there steps on nothing. Step the optimizer on the client "
                "(torch.optim under mesh.activate()), or pass the gradients to your remote "
                "function and set p.grad there",
                stacklevel=2,
            )
        session = mesh._session
        with session.lock:
            if session.capture is not None and session.capture.tracing:
                raise RuntimeError(
                    f"OpaqueRef({name}) cannot be made inside a compiled function (a replay "
                    "would make it again every call); make it outside and pass it in"
                )
            stream_ref = session.stream_ref(stream)
            for group in groups:
                session.ensure_group_split(group.mesh._ranks, group.ref, stream_ref)
            first_use(session, handles)
            ref = session.new_ref()
            seq = session.issue([*handles, *objects], [ref.id])
            session.send(
                mesh._ranks,
                m.CallFunction(
                    seq,
                    [None],
                    [ref],  # bound whole by the builder; poisoned here if it fails
                    m.FunctionPath(BUILD),
                    m.ArgsKwargs.from_python((ref.id, resolvable(factory), *args), kwargs),
                    stream_ref,
                    [g.ref for g in groups],
                ),
            )
        self._ref, self._session, self._mesh, self._stream = ref, session, mesh, stream
        self._owns_ref = True

    def __repr__(self) -> str:
        state = " dropped" if self._dropped is not None else ""
        mesh = getattr(self, "_mesh", None)
        stream = getattr(self, "_stream", None)
        where = f", mesh={mesh!r}, stream={stream.name!r}, ref={self._ref}" if mesh else ""
        return f"dask_monarch.OpaqueRef({self._name}{where}{state})"

    def __reduce__(self) -> Any:
        raise TypeError(
            f"{self!r} stands for an object on the ranks and cannot be pickled; pass it as "
            "an argument of a remote function (it arrives there as the rank's object)"
        )


def split_handles(leaves: Sequence[Any]) -> tuple[list[Tensor], list[OpaqueRef]]:
    """The mesh tensors and the OpaqueRefs among pytree leaves."""
    handles: list[Tensor] = []
    objects: list[OpaqueRef] = []
    for x in leaves:
        if isinstance(x, Tensor):
            handles.append(x)
        elif type(x) is OpaqueRef:
            objects.append(x)
    return handles, objects


def place(
    handles: list[Tensor],
    objects: list[OpaqueRef],
    what: str,
    groups: Sequence[RemoteProcessGroup] = (),
) -> tuple[DeviceMesh, Stream]:
    """Where a use of tensors and OpaqueRefs runs: :func:`~dask_monarch.tensor.placement`, and
    every OpaqueRef on that mesh and the active stream. With only OpaqueRefs, their mesh.
    Each of ``groups`` (the process groups the call takes) must have all its members there
    (:func:`check_groups`)."""
    if not objects:
        mesh, stream = placement(handles, what, "borrow it first")
        check_groups(groups, mesh, what)
        return mesh, stream
    if handles:
        mesh, stream = placement(handles, what, "borrow it first")
    else:
        mesh, stream = objects[0]._mesh, get_active_stream()
    for obj in objects:
        obj._check()
        if obj._mesh is not mesh and obj._mesh != mesh:
            raise misuse(
                f"WRONG_MESH: {obj!r} lives on {obj._mesh!r}, but {what} runs on {mesh!r}; "
                "make the object on that mesh"
            )
        if obj._stream is not stream:
            raise misuse(
                f"WRONG_STREAM: {obj!r} lives on stream {obj._stream.name!r}, but stream "
                f"{stream.name!r} is active; use it under {obj._stream.name!r}.activate() "
                "(objects cannot be borrowed)"
            )
    check_groups(groups, mesh, what)
    return mesh, stream


def check_groups(groups: Sequence[RemoteProcessGroup], mesh: DeviceMesh, what: str) -> None:
    """Refuse a call on ``mesh`` that takes a process group some of whose members it does
    not run on: the members it reaches would wait for the others in the call's first
    exchange (worker/user_groups.py) until the collective timeout, and break the mesh."""
    for group in groups:
        split = group._split_by(mesh._slice)
        if split is None:
            continue
        rank, members = split
        ranks = list(mesh._ranks)
        if members is None:
            raise misuse(
                f"GROUP_MEMBERS: {what} runs on ranks {ranks} of {mesh!r}, but rank {rank} is "
                f"not a member of {group!r} (its members are ranks {list(group.mesh._ranks)}); "
                "call it on the group's mesh or a sub-mesh of whole groups"
            )
        missing = [r for r in members if r not in ranks]
        raise misuse(
            f"GROUP_MEMBERS: {what} takes {group!r}, whose members {members} (rank {rank}'s "
            f"group) are not all among the call's ranks {ranks} of {mesh!r}: ranks {missing} "
            "would not run it, and the others would wait for them in the group until the "
            "collective timeout; call it on the group's mesh, or make the group on the mesh "
            "the call runs on"
        )
