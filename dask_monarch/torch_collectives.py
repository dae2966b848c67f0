"""``torch.distributed``'s own collectives given mesh tensors: refused, naming the mesh's way.

A PyTorch user reaches for ``torch.distributed.all_reduce(t)``; on a mesh
tensor torch answered "Default process group has not been initialized",
which says nothing of dask_monarch. There is no process group in the
client: a collective over mesh dims is a method of the tensor. Once a
process makes its first mesh, each collective of ``torch.distributed`` is
wrapped (c10d does not consult ``__torch_function__`` for a mesh tensor,
whose class turns it off to keep dispatch cheap): a call with a mesh tensor
among its arguments raises a ``TypeError`` that names what to call instead;
every other call goes to torch unchanged. Worker processes never make a
mesh, so their collectives stay torch's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tensor import Tensor

# collective -> the dask_monarch way, as said to the user
INSTEAD = {
    "all_reduce": 't.reduce_("gpu", "sum") in place, or t.reduce(dims, "sum"/"avg"/...)',
    "reduce": 't.reduce(dims, "sum") (every rank gets the result)',
    "all_gather": 't.reduce(dims, "stack") (the shards stacked along a new first dimension)',
    "all_gather_into_tensor": 't.reduce(dims, "stack")',
    "all_gather_single": 't.reduce(dims, "stack")',
    "gather": 't.reduce(dims, "stack"), or dask_monarch.inspect(t) for the values here',
    "reduce_scatter": 't.reduce(dims, "sum", scatter=True)',
    "reduce_scatter_tensor": 't.reduce(dims, "sum", scatter=True)',
    "reduce_scatter_single": 't.reduce(dims, "sum", scatter=True)',
    "scatter": 't.reduce(dims, "sum", scatter=True), or dask_monarch.put(local, mesh)',
    "broadcast": "t.slice_mesh(gpu=0).to_mesh(mesh) (rank gpu=0's value on every rank)",
    "all_to_all": 't.reduce(dims, "stack") and indexing, or t.to_mesh(other_mesh)',
    "all_to_all_single": 't.reduce(dims, "stack") and indexing, or t.to_mesh(other_mesh)',
    "send": "t.slice_mesh(...).to_mesh(other_mesh) (pipeline stages: docs/user_guide.md)",
    "recv": "t.slice_mesh(...).to_mesh(other_mesh) on the sending side",
    "isend": "t.slice_mesh(...).to_mesh(other_mesh)",
    "irecv": "t.slice_mesh(...).to_mesh(other_mesh) on the sending side",
}
_installed = False


def install(mesh_tensor: type[Tensor]) -> None:
    """Wrap ``torch.distributed``'s collectives (once per process; the first mesh does it).

    ``mesh_tensor`` is the class to refuse, passed in so this module imports none of the
    user API's (mesh.py, which calls this, has it at hand)."""
    global _installed
    if _installed:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    for name in INSTEAD:
        original = getattr(dist, name, None)
        if original is not None and not hasattr(original, "__dask_monarch_original__"):
            setattr(dist, name, _refusing(name, original, mesh_tensor))
    _installed = True


def _refusing(name: str, original: Callable, mesh_tensor: type[Tensor]) -> Callable:
    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        handle = _mesh_tensor(args, kwargs, mesh_tensor)
        if handle is not None:
            raise TypeError(
                f"torch.distributed.{name} got {handle._describe()}: a mesh has no process "
                "group in this process, and its collectives run over the mesh's dims on the "
                f"ranks: use {INSTEAD[name]} (README, 'What the API covers')"
            )
        return original(*args, **kwargs)

    collective.__dask_monarch_original__ = original  # type: ignore[attr-defined]
    return collective


def _mesh_tensor(args: tuple, kwargs: dict, mesh_tensor: type[Tensor]) -> Tensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, mesh_tensor):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, mesh_tensor):
                    return item
    return None


__all__ = ["INSTEAD", "install"]
