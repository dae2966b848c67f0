"""Random state on every rank of the active mesh (``dm.random``).

``manual_seed(s)`` gives every rank the same seed, so factories like
``torch.rand`` draw the same values everywhere; ``get_state`` returns each
rank's generator state as a mesh tensor for ``set_state``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .remote_function import remote
from .tensor import Tensor, active_mesh

if TYPE_CHECKING:
    from .mesh import DeviceMesh


def _active() -> DeviceMesh:
    mesh = active_mesh()
    if mesh is None:
        raise RuntimeError("dask_monarch.random needs an active mesh (with mesh.activate())")
    return mesh


_seed = remote("torch.manual_seed", propagate="inspect")
_get_state = remote("torch.get_rng_state",
                    propagate=lambda: torch.empty(torch.get_rng_state().shape, dtype=torch.uint8))
_set_state = remote("torch.set_rng_state", propagate="inspect")


def manual_seed(seed: int) -> None:
    """Seed the generator of every rank of the active mesh with ``seed``."""
    _active()
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    _seed(seed)


def get_state() -> Tensor:
    """Every rank's generator state, as a mesh tensor."""
    _active()
    return _get_state()


def set_state(state: Tensor) -> None:
    """Restore states returned by :func:`get_state`."""
    _active()
    _set_state(state)
