"""A value that failed on one rank only, passed to something every rank takes part in.

The failed rank skips a call whose input failed (docs/protocol.md §4.1); its
peers must not wait for it in a collective until the collective timeout (60 s
here), after which the mesh was broken. Each test's own timeout is well below
that: a peer left waiting fails it. A fetch raises the original error, naming
the rank, and the mesh serves the next call.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(40, func_only=True)

positive = dm.remote("helpers.remote_fns.positive", propagate=lambda x: x)
pg_collectives = dm.remote(
    "helpers.remote_fns.pg_collectives",
    propagate=lambda x, pg, mesh: (x.clone(), torch.stack([x, x]), x.clone(), x.clone(), 0, 0),
)
PROMPT_S = 20.0  # far below the collective timeout (a peer that waited out gloo's takes 60 s)


def _failed_on_rank_1(mesh):
    """A value that holds an error on rank 1 (``gpu`` 1) only."""
    return positive(torch.ones(2) - 2 * mesh.rank("gpu"))


def _raises_the_root(fetch):
    start = time.monotonic()
    with pytest.raises(dm.RemoteException, match="a negative input") as info:
        fetch()
    assert "rank 1" in str(info.value)
    assert time.monotonic() - start < PROMPT_S


def test_a_reduce_over_a_dim_whose_input_failed_on_one_rank(mesh2):
    with mesh2.activate():
        y = _failed_on_rank_1(mesh2)
        total = y.reduce("gpu", "sum")
        _raises_the_root(lambda: dm.inspect(total, gpu=0))
        assert dm.inspect(torch.ones(2).reduce("gpu", "sum")).tolist() == [2.0, 2.0]


def test_a_function_taking_a_process_group_whose_input_failed_on_one_rank(client2, mesh2):
    pids = client2.run(os.getpid)
    with mesh2.activate():
        pg = mesh2.process_group("gpu")
        y = _failed_on_rank_1(mesh2)
        total, *_ = pg_collectives(y, pg, mesh2)
        for gpu in (0, 1):
            _raises_the_root(lambda gpu=gpu: dm.inspect(total, gpu=gpu))
        start = time.monotonic()
        total, *_ = pg_collectives(torch.ones(2), pg, mesh2)  # the same group serves the next
        assert dm.inspect(total, gpu=0).tolist() == [2.0, 2.0]
        assert time.monotonic() - start < PROMPT_S
    assert client2.run(os.getpid) == pids


def test_a_checkpoint_save_of_a_value_that_failed_on_one_rank(mesh2, tmp_path):
    with mesh2.activate():
        y = _failed_on_rank_1(mesh2)
        _raises_the_root(lambda: dm.checkpoint.save({"w": y}, tmp_path))
        start = time.monotonic()
        w = torch.ones(2)
        saved = dm.checkpoint.save({"w": w}, tmp_path)  # the mesh saves the next
        assert time.monotonic() - start < PROMPT_S
        w.zero_()
        dm.checkpoint.load({"w": w}, saved)
        assert dm.inspect(w, gpu=1).tolist() == [1.0, 1.0]


def test_a_compiled_step_whose_process_group_call_follows_a_failure_on_one_rank(mesh2):
    """In a replay, rank 1's replay has failed before the call: it skips what runs user code,
    but its peer is about to ask it whether it can start the call."""
    with mesh2.activate():
        pg = mesh2.process_group("gpu")

        @dm.compile
        def step(x):
            total, *_ = pg_collectives(positive(x), pg, mesh2)
            return total

        good = torch.ones(2)
        assert dm.inspect(step(good), gpu=0).tolist() == [2.0, 2.0]  # traced
        assert dm.inspect(step(good), gpu=0).tolist() == [2.0, 2.0]  # replayed
        bad = torch.ones(2) - 2 * mesh2.rank("gpu")
        _raises_the_root(lambda: dm.inspect(step(bad), gpu=0))
        assert dm.inspect(step(good), gpu=1).tolist() == [2.0, 2.0]
