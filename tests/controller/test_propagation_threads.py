"""Propagation from several client threads at once (pure: fake tensors, no cluster).

torch's FakeTensorMode keeps its kernel state on the mode object and checks it against a
thread-local flag: one mode used by two threads at once raised ``AssertionError: False,
True`` (two meshes saving checkpoints from two threads, whose remote function's
propagation shared one mode). Each thread now has its own.
"""

from __future__ import annotations

import pytest
import torch
from helpers.threads import race

from dask_monarch.remote_function import propagate_locally

pytestmark = pytest.mark.timeout(120)


def _propagate_many() -> None:
    for _ in range(400):
        spec, _ = propagate_locally(lambda: torch.empty((), dtype=torch.int64), (), {})
        assert spec[0] == ()  # its shape


def test_remote_function_propagation_runs_in_two_threads_at_once():
    assert race(_propagate_many, _propagate_many) == []
