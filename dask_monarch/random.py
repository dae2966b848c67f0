"""Random state on every rank of the active mesh (``dm.random``).

``manual_seed(s)`` gives every rank the same seed (CPU and CUDA generators),
so factories like ``torch.rand`` draw the same values everywhere;
``get_state`` returns each rank's generator states as a mesh tensor of bytes
for ``set_state``: the CPU generator's, then a flag and the state of the
rank's CUDA generator (zeros on ranks that have not used CUDA).
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


CUDA_STATE_BYTES = 16  # Philox: seed and offset


def _states() -> torch.Tensor:
    """This rank's generator states as one byte tensor (runs on the rank)."""
    cuda = torch.zeros(1 + CUDA_STATE_BYTES, dtype=torch.uint8)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state = torch.cuda.get_rng_state()
        if state.numel() != CUDA_STATE_BYTES:
            raise RuntimeError(f"dask_monarch.random expects a {CUDA_STATE_BYTES}-byte CUDA "
                               f"generator state, this torch has {state.numel()}")
        cuda[0], cuda[1:] = 1, state
    return torch.cat([torch.get_rng_state(), cuda])


def _set_states(states: torch.Tensor) -> None:
    """Restore what :func:`_states` returned (runs on the rank)."""
    split = states.numel() - 1 - CUDA_STATE_BYTES
    torch.set_rng_state(states[:split].clone())
    if states[split].item():
        torch.cuda.set_rng_state(states[split + 1:].clone())


_seed = remote("torch.manual_seed", propagate="inspect")
_get_state = remote(
    "dask_monarch.random._states",
    propagate=lambda: torch.empty(torch.get_rng_state().numel() + 1 + CUDA_STATE_BYTES,
                                  dtype=torch.uint8))
_set_state = remote("dask_monarch.random._set_states", propagate=lambda states: None)


def manual_seed(seed: int) -> None:
    """Seed the generator of every rank of the active mesh with ``seed``."""
    _active()
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    _seed(seed)


def get_state() -> Tensor:
    """Every rank's generator states (CPU and CUDA), as a mesh tensor of bytes."""
    _active()
    return _get_state()


def set_state(state: Tensor) -> None:
    """Restore states returned by :func:`get_state`."""
    _active()
    _set_state(state)
