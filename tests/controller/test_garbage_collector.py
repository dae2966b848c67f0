"""The cyclic garbage collector: a training step leaves no reference cycles of dask_monarch's
own (their objects, tensors among them, would live until a collection), and nothing freezes
the GC in the middle of a collection."""

import gc
import sys
import types

import dask
import pytest
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


_scaled = dm.remote(lambda x, k: x * k.by, propagate=lambda x, k: x.clone())


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
            torch.randint(0, 9, (3,), generator=g)  # drawn by the client, placed
            _scaled(x, types.SimpleNamespace(by=2.0))  # pickled arguments

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


def test_the_client_and_the_ranks_collect_young_objects_less_often(mesh2, client2):
    """``dask_monarch.gc-threshold`` is set once per process, where the GC is frozen: on
    the client when a controller starts, on a worker when a rank is claimed."""
    want = tuple(dask.config.get("dask_monarch.gc-threshold"))
    assert want == (10000, 10, 10)
    assert gc.get_threshold() == want
    assert set(client2.run(gc.get_threshold).values()) == {want}


@pytest.mark.parametrize("value", [[10000, -1], [1.5], "700", [1, 2, 3, 4]])
def test_a_gc_threshold_that_is_not_up_to_three_whole_numbers_is_refused(monkeypatch, value):
    monkeypatch.setattr(config, "_tuned", False)
    with dask.config.set({"dask_monarch.gc-threshold": value}):
        with pytest.raises(ValueError, match="gc-threshold.*up to three whole numbers"):
            config.freeze_gc()
    assert not config._tuned  # a corrected setting is read again
    before = gc.get_threshold()
    try:
        with dask.config.set({"dask_monarch.gc-threshold": None, "dask_monarch.gc-freeze": False}):
            config.freeze_gc()  # null: Python's thresholds stay
        assert gc.get_threshold() == before and config._tuned
    finally:
        gc.set_threshold(*before)
