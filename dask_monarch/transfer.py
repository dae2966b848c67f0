"""Moving tensors onto meshes: ``put`` from the client, ``to_mesh`` and ``slice_mesh`` between
meshes of one controller.

Semantics: docs/protocol.md §1.8.

A move is always a copy (``SendTensor``): ranks that keep a shard make an
eager deep copy, others receive it over the point-to-point communicator of
the (source stream, destination stream) pair. Dims are matched by name and
must agree in size; a destination dim the source lacks is a broadcast (one
send per destination slice). Each ``SendTensor`` goes at once to both ends of
every pair, so the pre-dispatch check (DESIGN decision 14) never refuses one
made here: a move that it would refuse, a rank both sending and receiving over
the communicator of two different streams, is refused here first with a
``ValueError`` that loses nothing (docs/architecture.md, "Streams and
hand-offs").
"""

from __future__ import annotations

import warnings
import weakref
from itertools import product
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .borrows import first_use
from .collectives import COLLECTIVE_GRADIENT, without_gradient
from .mesh import DeviceMesh
from .propagation import TensorMeta
from .protocol import messages as m
from .protocol.ndslice import Slice
from .stream import Stream, get_active_stream
from .tensor import Tensor, active_mesh, check_usable, contiguous, from_client


def put(tensors: Any, mesh: DeviceMesh | None = None, stream: Stream | None = None) -> Any:
    """The same value on every rank of ``mesh``: each local tensor in ``tensors`` becomes a
    mesh tensor holding it.

    Any size; the value travels once, inside the message that makes it. Under
    ``mesh.activate()``, ``torch.tensor(data)`` does the same for data, and a small local
    tensor used together with mesh tensors is placed by itself (docs/user_guide.md).

    Parameters
    ----------
    tensors
        A local tensor, or a pytree of them (other leaves pass through); or an
        ``nn.Module``, whose parameters and buffers are placed in place, as
        ``module.to(device)`` moves them (tied ones stay tied; each parameter is a new
        object, so make its optimizer after), and which is returned.
    mesh
        Where to place them (default: the active mesh).
    stream
        The stream they belong to (default: the active stream).
    """
    mesh = mesh or active_mesh()
    if mesh is None:
        raise RuntimeError("dask_monarch.put needs a mesh: mesh= or an active mesh")
    stream = stream or get_active_stream()
    if isinstance(tensors, torch.nn.Module):
        return _put_module(tensors, mesh, stream)

    def place(t: Any) -> Any:
        if isinstance(t, Tensor):
            raise TypeError(f"dask_monarch.put takes local tensors; {t._describe()} is on a mesh")
        if isinstance(t, torch.Tensor):
            return from_client(t.detach(), mesh, stream)
        return t

    return tree_map(place, tensors)


def _put_module(module: torch.nn.Module, mesh: DeviceMesh, stream: Stream) -> torch.nn.Module:
    """``module``'s local parameters and buffers replaced by mesh ones holding their values (a
    model built or loaded locally; ``module._apply(dm.put)`` would set ``param.data`` to a
    mesh tensor, which a local tensor cannot hold)."""
    placed: dict[int, torch.Tensor] = {}  # a tied weight is placed once, and stays tied

    def place(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        new = placed.get(id(t))
        if new is None:
            new = from_client(t.detach(), mesh, stream)
            if parameter:
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            placed[id(t)] = new
        return new

    for sub in module.modules():
        for kind, parameter in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in kind.items():
                if t is not None and not isinstance(t, Tensor):
                    kind[name] = place(t, parameter)
    return module


class MeshSliceTensor:
    """The shards of a tensor on a sub-mesh of its mesh; send them with :meth:`to_mesh`."""

    def __init__(self, tensor: Tensor, mesh: DeviceMesh) -> None:
        self.tensor = tensor
        self.mesh = mesh

    def to_mesh(self, mesh: DeviceMesh, stream: Stream | None = None) -> Tensor:
        t = self.tensor
        return without_gradient(
            t, lambda: _move(t, self.mesh, mesh, stream), "to_mesh of a slice", COLLECTIVE_GRADIENT
        )

    def __repr__(self) -> str:
        return f"MeshSliceTensor({self.tensor!r} on {self.mesh!r})"


def slice_mesh(tensors: Any, **selection: int | slice) -> Any:
    """The shards of every mesh tensor in ``tensors`` on ``mesh.slice(**selection)``."""
    return tree_map(
        lambda t: MeshSliceTensor(t, t._mesh.slice(**selection)) if isinstance(t, Tensor) else t,
        tensors,
    )


def to_mesh(tensors: Any, mesh: DeviceMesh, stream: Stream | None = None) -> Any:
    """Copy every mesh tensor (or mesh slice) in ``tensors`` onto ``mesh``."""

    def move(t: Any) -> Any:
        if isinstance(t, MeshSliceTensor):
            return t.to_mesh(mesh, stream)
        if not isinstance(t, Tensor):
            return t
        if not (t.requires_grad and torch.is_grad_enabled()):
            return _move(t, t._mesh, mesh, stream)
        if set(mesh.dims) == set(t._mesh.dims):
            return _Moved.apply(t, mesh, stream)
        return without_gradient(
            t,
            lambda: _move(t, t._mesh, mesh, stream),
            "a broadcasting to_mesh",
            COLLECTIVE_GRADIENT,
        )

    return tree_map(move, tensors, is_leaf=lambda x: isinstance(x, MeshSliceTensor))


class _Moved(torch.autograd.Function):
    """A move that autograd records: its gradient moves back, to the source's mesh and stream
    (a pipeline's stages, with no detach and backward(grad) at each boundary)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, mesh: DeviceMesh, stream: Stream | None) -> Tensor:
        ctx.source, ctx.stream = t._mesh, t._stream
        return _move(t, t._mesh, mesh, stream)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        return _move(grad, grad._mesh, ctx.source, ctx.stream), None, None


def _reorder(mesh: DeviceMesh, names: list[str]) -> Slice:
    """``mesh``'s slice with its dims in the order of ``names``."""
    index = [mesh.dims.index(n) for n in names]
    s = mesh.slice_
    return Slice(s.offset, [s.sizes[i] for i in index], [s.strides[i] for i in index])


def _move(t: Tensor, source: DeviceMesh, dest: DeviceMesh, stream: Stream | None) -> Tensor:
    check_usable(t)
    if source._session is not dest._session:
        raise ValueError(
            "to_mesh moves tensors between meshes of one device_mesh (one "
            "controller); fetch and re-create them to cross controllers"
        )
    missing = [d for d in source.dims if d not in dest.dims]
    if missing:
        raise ValueError(
            f"destination mesh does not have dimensions {missing} of the source "
            f"{source!r}; slice them away with slice_mesh first"
        )
    for d in source.dims:
        if source.sizes[d] != dest.sizes[d]:
            raise ValueError(
                f"dimension {d!r} has size {source.sizes[d]} on the source and "
                f"{dest.sizes[d]} on the destination"
            )
    common = [d for d in dest.dims if d in source.dims]
    broadcast = [d for d in dest.dims if d not in source.dims]
    if broadcast:
        warnings.warn(
            f"to_mesh broadcasts over {broadcast}: every slice of the destination gets a copy",
            stacklevel=3,
        )
    from_ranks = _reorder(source, common)
    pairs = []
    for coords in product(*(range(dest.sizes[b]) for b in broadcast)):
        part = dest.slice(**dict(zip(broadcast, coords))) if broadcast else dest
        pairs.append((from_ranks, _reorder(part, common)))
    stream = stream or get_active_stream()
    session = source._session
    with session.lock:  # one SendTensor per destination slice, all defining one ref
        src_ref = session.stream_ref(t._stream)
        dst_ref = session.stream_ref(stream)
        if src_ref.id != dst_ref.id:
            _one_role_per_rank(session, (src_ref.id, dst_ref.id), pairs, t._stream, stream)
        session.ensure_p2p(src_ref, dst_ref)
        first_use(session, [t])
        result = session.new_ref()
        factory = m.Factory(tuple(t.shape), t.dtype, t.layout, str(t.device))
        shape = tuple(t.shape)
        meta = TensorMeta(shape, contiguous(shape), 0, t.dtype, t.device)
        handle = Tensor(meta, session, dest, stream, result)
        session.issue([t], [result.id], [handle])
        for from_ranks, to_ranks in pairs:
            ranks = tuple(sorted(set(from_ranks) | set(to_ranks)))
            session.send(
                ranks, m.SendTensor(result, from_ranks, to_ranks, t._ref, factory, src_ref, dst_ref)
            )
        return handle


# session -> (from stream id, to stream id) -> rank -> "send" or "receive" over that pair
_ROLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _one_role_per_rank(
    session: Any, key: tuple[int, int], pairs: list, source: Stream, dest: Stream
) -> None:
    """Refuse a move in which a rank would send and receive over the communicator of two
    different streams (now or with earlier moves): NCCL runs a communicator's operations in
    the order a rank issues them, and the rank's two streams would issue them in an order
    that differs between ranks."""
    roles = _ROLES.setdefault(session, {}).setdefault(key, {})
    new: dict[int, str] = {}
    for from_ranks, to_ranks in pairs:
        for sender, receiver in zip(from_ranks, to_ranks):
            if sender == receiver:  # a copy on the rank: no communicator
                continue
            for rank, role in ((sender, "send"), (receiver, "receive")):
                before = new.get(rank) or roles.get(rank)
                if before is not None and before != role:
                    when = "in this move" if new.get(rank) else "in an earlier move"
                    raise ValueError(
                        f"to_mesh from stream {source.name!r} to stream {dest.name!r}: rank "
                        f"{rank} would {role} over that pair of streams and it {before}s over "
                        f"it {when}. NCCL runs a communicator's operations in the order a rank "
                        "issues them, and two streams of one rank would issue them in an order "
                        "that differs between ranks, which deadlocks. Move between overlapping "
                        "meshes on one stream (to_mesh(..., stream=the tensor's stream)), or "
                        f"move the other way from stream {dest.name!r} to {source.name!r}"
                    )
                new[rank] = role
    roles.update(new)
