"""Propagation from several client threads at once (pure: fake tensors, no cluster).

torch's FakeTensorMode keeps its kernel state on the mode object and checks it against a
thread-local flag: one mode used by two threads at once raised ``AssertionError: False,
True`` (two meshes saving checkpoints from two threads, whose remote function's
propagation shared one mode). Each thread now has its own.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from dask_monarch.remote_function import propagate_locally

pytestmark = pytest.mark.timeout(120)


def test_remote_function_propagation_runs_in_two_threads_at_once():
    errors = []

    def propagate_many() -> None:
        try:
            for _ in range(400):
                spec, _ = propagate_locally(lambda: torch.empty((), dtype=torch.int64), (), {})
                assert spec[0] == ()  # its shape
        except BaseException as e:  # noqa: BLE001  (any failure of the thread is the test's)
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython lets us
    try:
        threads = [threading.Thread(target=propagate_many) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
