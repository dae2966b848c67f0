"""Pickled functions are cached per rank process, and every lane's thread shares the cache."""

from __future__ import annotations

import cloudpickle
import pytest
from helpers.threads import race

from dask_monarch.messages import Cloudpickle, FunctionPath
from dask_monarch.worker import calls


def _constant(i):
    return lambda: i


@pytest.mark.timeout(120)
def test_lanes_resolving_pickled_functions_at_once_share_the_cache_safely():
    """Two lanes whose calls keep the cache full evict at the same time: neither may fail
    (one lane's eviction used to pop the key the other had just popped: a KeyError holding
    the function's pickle, reported as the user's call failing)."""
    functions = [Cloudpickle(cloudpickle.dumps(_constant(i))) for i in range(2000)]

    def lane(offset: int) -> None:
        for _ in range(20):
            for f in functions[offset::2]:
                calls.resolve_function(f)

    assert race(lambda: lane(0), lambda: lane(1)) == []
    assert calls.resolve_function(functions[7])() == 7


def test_an_op_the_worker_never_registered_says_where_to_define_it():
    """A torch.library op defined in __main__ or a notebook is sent by its torch.ops path; a
    worker that never imported its module said "No module named 'torch.ops.<namespace>'"."""
    with pytest.raises(calls.InvalidRemoteFunction, match="nowhere::op is not registered") as info:
        calls.resolve_function(FunctionPath("torch.ops.nowhere.op.default"))
    assert "client.run(importlib.import_module" in str(info.value)
