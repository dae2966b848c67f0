"""The client's GC freeze follows the user's imports (config.freeze_new_imports at a flush)."""

import gc
import sys
import types

import torch

import dask_monarch as dm
from dask_monarch import config


def test_a_flush_freezes_what_modules_imported_since_brought(mesh2):
    """A user who imports a library after the mesh started (transformers: 60 000 objects)
    would pay for walking them in every full collection: the next flush freezes them."""
    name = "dm_test_gc_freeze_module"
    module = types.ModuleType(name)
    module.table = [{"n": i} for i in range(1000)]  # objects the GC would walk
    sys.modules[name] = module
    try:
        with mesh2.activate():
            x = torch.ones(2) + 1
            assert dm.inspect(x).tolist() == [2.0, 2.0]  # a fetch flushes
        assert config._modules_frozen == len(sys.modules)
        assert all(o is not module.table for o in gc.get_objects())  # frozen: not walked
    finally:
        del sys.modules[name]


def test_nothing_freezes_during_a_collection():
    """A finalizer may flush (a mesh tensor's deletes) while a collection runs: freezing then
    would move the collection's own lists; it waits for the next flush instead."""
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
