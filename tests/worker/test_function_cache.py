"""Pickled functions are cached per rank process, and every lane's thread shares the cache."""

from __future__ import annotations

import sys
import threading

import cloudpickle
import pytest

from dask_monarch.messages import Cloudpickle
from dask_monarch.worker import calls


def _constant(i):
    return lambda: i


@pytest.mark.timeout(120)
def test_lanes_resolving_pickled_functions_at_once_share_the_cache_safely():
    """Two lanes whose calls keep the cache full evict at the same time: neither may fail
    (one lane's eviction used to pop the key the other had just popped: a KeyError holding
    the function's pickle, reported as the user's call failing)."""
    functions = [Cloudpickle(cloudpickle.dumps(_constant(i))) for i in range(2000)]
    errors: list[BaseException] = []

    def lane(offset: int) -> None:
        try:
            for _ in range(20):
                for f in functions[offset::2]:
                    calls.resolve_function(f)
        except BaseException as e:  # noqa: B036 - reported by the test
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: the race shows in a fraction of a second
    try:
        threads = [threading.Thread(target=lane, args=(offset,)) for offset in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert calls.resolve_function(functions[7])() == 7
