"""How many GPUs this machine shows the tests, a skip for tests that need more, and raw
messages of CUDA tensors."""

from __future__ import annotations

import pytest
import torch

from dask_monarch import messages as m

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs, {GPUS} visible")


def cuda_factory(shape, dtype=torch.float32) -> m.Factory:
    return m.Factory(tuple(shape), dtype, torch.strided, "cuda")


def all_reduce(result, tensor, shape, mesh, stream, dims=("gpu",)) -> m.Reduce:
    """A raw sum all-reduce of a CUDA tensor of ``shape`` over ``dims``."""
    return m.Reduce(
        result,
        tensor,
        cuda_factory(shape),
        mesh,
        stream,
        list(dims),
        m.ReduceOp.SUM,
        False,
        False,
        None,
    )
