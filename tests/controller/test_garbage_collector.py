"""The cyclic garbage collector: a training step leaves no reference cycles of dask_monarch's
own (their objects, tensors among them, would live until a collection), and nothing freezes
the GC in the middle of a collection."""

import gc
import sys
import types

import torch
from torch import nn

import dask_monarch as dm
from dask_monarch import config


def test_nothing_freezes_during_a_collection():
    """Code a finalizer runs may reach ``freeze_new_imports`` while a collection is under
    way: freezing then would move the collection's own lists."""
    config.freeze_gc()  # as a controller does (once per process)
    before = config._modules_frozen
    sys.modules["dm_test_gc_freeze_other"] = types.ModuleType("dm_test_gc_freeze_other")
    config.GCState.collecting = True
    try:
        config.freeze_new_imports()
        assert config._modules_frozen == before
    finally:
        config.GCState.collecting = False
        del sys.modules["dm_test_gc_freeze_other"]


def test_a_training_step_leaves_no_cycles_of_dask_monarch_s_own(mesh2):
    """Forward, backward with ``ddp_hooks`` (a borrow, a reduce the precheck meets, a
    bucket's views), small values the client mirrors, a call with pickled arguments: nothing
    of dask_monarch's, and no tensor, is left for the cyclic collector. Before: a nested
    function that called itself per mirrored op, a pickler bound into its own dispatch table
    (its memo kept the pickled tensors), a borrow and its borrowed handle, a met slot and its
    events."""
    with mesh2.activate():
        dm.random.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        hooks = dm.ddp_hooks(model, "gpu")

        def step() -> None:
            x = torch.randn(5, 6) * (mesh2.rank("gpu") + 1)
            loss = (model(x) ** 2).mean() + torch.tensor([1.0, 2.0]).sum()  # mirrored
            loss.backward()
            model.zero_grad()
            g = torch.Generator().manual_seed(1)
            torch.randint(0, 9, (3,), generator=g)  # pickled arguments

        step()
        dm.inspect(model[0].weight)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(2):
                step()
            dm.inspect(model[0].weight)
            gc.collect()
            garbage = list(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        hooks.remove()
    ours = sorted(
        {
            f"{type(o).__module__}.{type(o).__qualname__}"
            for o in garbage
            if type(o).__module__.startswith("dask_monarch") or isinstance(o, torch.Tensor)
        }
    )
    functions = sorted(
        {
            o.__qualname__
            for o in garbage
            if isinstance(o, types.FunctionType) and o.__module__.startswith("dask_monarch")
        }
    )
    assert not ours and not functions, (ours, functions)
