"""Remote functions that stop in the debugger (test_debugger.py asserts their line numbers)."""

import torch

import dask_monarch as dm


def stop_and_double(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    breakpoint()
    z = y + 1
    return z


def stop_with_dm(x: torch.Tensor) -> torch.Tensor:
    w = x + 10
    dm.breakpoint()
    return w


def stop_where_positive(x: torch.Tensor) -> torch.Tensor:
    if x.item() > 0:
        breakpoint()
    return x.clone()
