"""Collectives on mesh tensors: ``reduce`` and ``reduce_`` (docs/protocol.md §1.7).

``t.reduce("gpu", "sum")`` all-reduces over a mesh dim; ``"stack"`` gathers
(``[n, *shape]``); ``scatter=True`` reduce-scatters (``shape[1:]``, dim 0 must
be the group size) or, with ``"stack"``, exchanges chunks (all-to-all);
``out=`` writes into an existing tensor; ``reduce_`` works in place. The
communicators are created on the ranks the first time a (mesh, stream, dims)
is used.

The compiler refuses collectives whose members disagree before dispatch
(DESIGN decision 14), but none can come from here: each ``Reduce`` goes at
once to every rank of the tensor's mesh, so every member of each group gets
the same collectives, in the same order, with one factory. A tensor whose
value on a rank does not have its handle's shape (a remote function that lied
about its result) fails the result instead, and that rank takes part with
zeros (docs/protocol.md §3.11).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from .borrows import first_use
from .propagation import TensorMeta
from .protocol import messages as m
from .protocol.messages import ReduceOp
from .tensor import Tensor, check_usable, contiguous, mutated_refs, placement

if TYPE_CHECKING:
    from .mesh import DeviceMesh

REDUCTIONS: dict[str, ReduceOp | str] = {
    "sum": ReduceOp.SUM,
    "avg": ReduceOp.AVG,
    "product": ReduceOp.PRODUCT,
    "prod": ReduceOp.PRODUCT,
    "min": ReduceOp.MIN,
    "max": ReduceOp.MAX,
    "band": ReduceOp.BAND,
    "bor": ReduceOp.BOR,
    "bxor": ReduceOp.BXOR,
    "stack": "stack",
}

# Bitwise reductions: gloo has them, NCCL does not (it would fail the collective on every rank).
NCCL_UNSUPPORTED = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


def _reduce(
    t: Tensor,
    dims: str | Sequence[str],
    reduction: str,
    scatter: bool,
    mesh: DeviceMesh | None,
    out: Tensor | None,
    in_place: bool,
) -> Tensor:
    if mesh is not None:
        raise NotImplementedError(
            "reduce(mesh=...) is not supported: reduce over dims of the tensor's own mesh"
        )
    if not isinstance(t, Tensor):
        raise TypeError(f"reduce needs a mesh tensor, got {type(t).__name__}")
    check_usable(t)
    own = t._mesh
    names = (dims,) if isinstance(dims, str) else tuple(dims)
    if not names:
        names = own.dims
    for d in names:
        if d not in own.dims:
            raise KeyError(f"{d!r} is not a dimension of {own!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"repeated dimension in {list(names)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, got {reduction!r}")
    op = REDUCTIONS[reduction]
    if op is ReduceOp.AVG and not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(
            f"reduce(..., 'avg') of a {t.dtype} tensor: the average of integers is no "
            f"{str(t.dtype).removeprefix('torch.')}; reduce 'sum' and divide, or make the "
            "tensor floating point first (t.float())"
        )
    if op in NCCL_UNSUPPORTED and t.device.type == "cuda" and own._session.backend != "gloo":
        raise ValueError(
            f"reduction {reduction!r} is not supported by NCCL, the backend of "
            f"CUDA tensors on {own!r}: reduce an integer sum instead, or set "
            "dask_monarch.backend to 'gloo' before creating the mesh"
        )
    if len(names) > 1 and (op == "stack" or scatter):
        kind = "stack" if op == "stack" else "scatter"
        raise ValueError(f"{kind} is not valid for multiple dimensions {list(names)}")
    if out is not None and in_place:
        raise ValueError("reduce_ works in place: it takes no out=")
    if in_place and (scatter or op == "stack"):
        raise ValueError(
            "an in-place reduce cannot stack or scatter (the shape changes)"
            if not (op == "stack" and scatter)
            else "an in-place all-to-all is not supported; use out="
        )
    n = own.size(names)
    shape = tuple(t.shape)
    if scatter and (len(shape) == 0 or shape[0] != n):
        raise TypeError(
            f"When scattering, the first dimension of the tensor must be the size "
            f"of the reduced dims ({n}), got shape {list(shape)}"
        )
    if op == "stack":
        result_shape = shape if scatter else (n, *shape)
    else:
        result_shape = shape[1:] if scatter else shape
    inputs = [t] if out is None else [t, out]
    _, stream = placement(inputs, "reduce", "borrow it first")
    if out is not None and tuple(out.shape) != result_shape:
        raise ValueError(
            f"Reduce expects the shape to be torch.Size({list(result_shape)}), "
            f"got {list(out.shape)}"
        )
    dims = tuple(sorted(names))
    session = own._session
    with session.lock:
        stream_ref = session.stream_ref(stream)
        mesh_ref = session.mesh_ref(own.dims, own.slice_)
        session.ensure_split(mesh_ref, stream_ref, dims)
        first_use(session, inputs)
        result = session.new_ref()
        target = t if in_place else out
        if target is not None:  # the result lands in an existing storage: it is redefined
            storage, mutates = target._storage, mutated_refs([target])
            stride, offset = tuple(target.stride()), target.storage_offset()
        else:
            storage, mutates = None, []
            stride, offset = contiguous(result_shape), 0
        meta = TensorMeta(result_shape, stride, offset, t.dtype, t.device)
        handle = Tensor(meta, session, own, stream, result, storage)
        session.issue(inputs, [result.id] + mutates, [handle])
        factory = m.Factory(tuple(t.shape), t.dtype, t.layout, str(t.device))
        session.send(
            own._ranks,
            m.Reduce(
                result,
                t._ref,
                factory,
                mesh_ref,
                stream_ref,
                list(dims),
                op,
                scatter,
                in_place,
                out._ref if out is not None else None,
            ),
        )
    if target is not None:  # as any in-place op: backward refuses what saved its old value
        torch.autograd.graph.increment_version(target)
    if in_place:
        return t
    return out if out is not None else handle


class _NoGradient(torch.autograd.Function):
    """The result of ``run()``, a collective of ``t``, given a backward that raises ``why``."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, run: Callable[[], Tensor], why: str) -> Tensor:
        ctx.why = why
        return run()

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:
        raise RuntimeError(ctx.why)


# Why a collective has no gradient, for its error.
COLLECTIVE_GRADIENT = (
    "A collective's gradient depends on how the ranks' losses make one objective (Megatron's "
    "tensor parallelism sums forward and passes the gradient through; "
    "torch.distributed.nn.functional.all_reduce sums it over the ranks): "
)


def without_gradient(t: Tensor, run: Callable[[], Tensor], what: str, because: str = "") -> Tensor:
    """``run()``, made from ``t`` where autograd cannot see (a collective, a remote function):
    if ``t`` requires grad, a result that says so when backward reaches it, where it would
    have had no gradient at all, silently (the layers before a tensor-parallel sum were never
    trained). ``because`` says why there is none, ahead of the way out."""
    if not (t.requires_grad and torch.is_grad_enabled()):
        return run()
    why = (
        f"{what} has no gradient, and backward reached it from a tensor that requires grad. "
        f"{because}write the gradient you mean as a torch.autograd.Function "
        "(docs/user_guide.md, 'Collectives and autograd'), or pass t.detach() where no "
        "gradient should flow"
    )
    return _NoGradient.apply(t, run, why)


def reduce(
    tensors: Any,
    dims: str | Sequence[str],
    reduction: str = "sum",
    scatter: bool = False,
    mesh: DeviceMesh | None = None,
    out: Any = None,
) -> Any:
    """A collective over mesh ``dims`` of every mesh tensor in ``tensors`` (a pytree).

    Parameters
    ----------
    tensors
        A mesh tensor, or a pytree of them (other leaves pass through).
    dims
        The mesh dimension(s) to reduce over; ``()`` for all of them.
    reduction
        ``"sum"``, ``"avg"``, ``"product"``/``"prod"``, ``"min"``, ``"max"``,
        ``"band"``, ``"bor"``, ``"bxor"`` (an all-reduce), or ``"stack"`` (an
        all-gather: a new leading dim of the reduced size).
    scatter
        Reduce-scatter (or, with ``"stack"``, all-to-all): dim 0 must equal
        the size of ``dims``, each rank keeps its part.
    mesh
        Not supported (``NotImplementedError``): the tensors' own mesh is used.
    out
        Tensors (a pytree like ``tensors``) to write the results into.

    Returns
    -------
    The results, in ``tensors``' structure. docs/protocol.md §1.7.
    """
    if out is not None:
        return tree_map(
            lambda t, o: _reduce(t, dims, reduction, scatter, mesh, o, False), tensors, out
        )
    what = f"reduce({dims!r}, {reduction!r}{', scatter=True' if scatter else ''})"

    def one(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        return without_gradient(
            t,
            lambda: _reduce(t, dims, reduction, scatter, mesh, None, False),
            what,
            COLLECTIVE_GRADIENT,
        )

    return tree_map(one, tensors)


def reduce_(
    tensors: Any,
    dims: str | Sequence[str],
    reduction: str = "sum",
    scatter: bool = False,
    mesh: DeviceMesh | None = None,
) -> Any:
    """In-place :func:`reduce`: each tensor holds the result afterwards."""
    return tree_map(
        lambda t: (
            _reduce(t, dims, reduction, scatter, mesh, None, True) if isinstance(t, Tensor) else t
        ),
        tensors,
    )
