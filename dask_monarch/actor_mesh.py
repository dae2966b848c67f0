"""Actors on a mesh: one instance per rank, methods fed with mesh tensors (``mesh.spawn``).

``mesh.spawn("opt", Optimizer, lr=0.1)`` creates a Dask actor per rank.
``actors.call("step", grads)`` runs a method on every rank with the rank's
shard of each mesh tensor argument and returns a future of the per-rank
values; ``actors.call_tensor("scale", t, propagate=...)`` returns a mesh
tensor instead. Calls run on the active stream, in order with its tensor work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils._pytree import tree_flatten, tree_map

from .remote_function import _propagate_locally
from .tensor import Tensor, check_usable


class ActorMesh:
    """One actor per rank of a mesh; see :meth:`DeviceMesh.spawn`."""

    def __init__(self, mesh, name: str, cls: type, *args: Any, **kwargs: Any):
        self.mesh = mesh
        self.name = name
        self._client = mesh._client
        self.broker = self._client.controller.spawn_actor(mesh._ranks, name, cls, *args, **kwargs)

    def _prepare(self, args: tuple, kwargs: dict):
        leaves = tree_flatten((args, kwargs))[0]
        handles = [x for x in leaves if isinstance(x, Tensor)]
        for h in handles:
            check_usable(h)
            if h._mesh != self.mesh:
                raise TypeError(f"WRONG_MESH: {h!r} is not on {self.mesh!r}")
        local_args, local_kwargs = tree_map(lambda x: x._ref if isinstance(x, Tensor) else x,
                                            (args, kwargs))
        return handles, local_args, local_kwargs

    def call(self, method: str, *args: Any, **kwargs: Any):
        """Run ``method`` on every rank; a future of the values, in rank order."""
        handles, local_args, local_kwargs = self._prepare(args, kwargs)
        return self._client.actor_call(self, method, handles, local_args, local_kwargs, None)

    def call_tensor(self, method: str, *args: Any, propagate: Callable | None = None,
                    **kwargs: Any) -> Any:
        """Run ``method`` on every rank; what it returns stays there, as mesh tensors."""
        if propagate is None or not callable(propagate):
            raise ValueError("call_tensor needs propagate=: a function of fake tensors that "
                             "returns tensors shaped like the method's result")
        handles, local_args, local_kwargs = self._prepare(args, kwargs)
        spec, _ = _propagate_locally(propagate, args, kwargs)
        return self._client.actor_call(self, method, handles, local_args, local_kwargs, spec)

    def __repr__(self) -> str:
        return f"<ActorMesh {self.name!r} on {self.mesh!r}>"

