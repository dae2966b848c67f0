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


fails_partway = dm.remote("helpers.remote_fns.pg_fails_partway", propagate=lambda x, pg, at: x)


@pytest.mark.parametrize("fails_at", [0, 1, 2])
def test_a_function_taking_a_process_group_that_raises_partway_on_one_rank(mesh2, fails_at):
    """Group rank 1's function raises before its first all-reduce, between the two, or after
    both: its peer, waiting to check its next all-reduce or done, learns of it at once and
    fails with its error, naming the rank; the group serves the next call."""
    with mesh2.activate():
        pg = mesh2.process_group("gpu")
        start = time.monotonic()
        total = fails_partway(torch.ones(2), pg, fails_at)
        for gpu in (0, 1):
            with pytest.raises(dm.RemoteException, match="gave up before all-reduce") as info:
                dm.inspect(total, gpu=gpu)
            assert "rank 1" in str(info.value)
        assert time.monotonic() - start < PROMPT_S
        total = fails_partway(torch.ones(2), pg, -1)  # the same group serves the next call
        assert dm.inspect(total, gpu=1).tolist() == [4.0, 4.0]
        assert time.monotonic() - start < PROMPT_S


def test_members_of_a_process_group_that_call_different_numbers_of_collectives(mesh2):
    """Group rank 1 calls one all-reduce more than its peer, whose function has returned: both
    fail naming the mismatch, at once; the group serves the next call."""
    pg_extra = dm.remote("helpers.remote_fns.pg_fails_partway", propagate=lambda x, pg, a, e: x)
    with mesh2.activate():
        pg = mesh2.process_group("gpu")
        start = time.monotonic()
        total = pg_extra(torch.ones(2), pg, -1, 1)
        for gpu in (0, 1):
            with pytest.raises(dm.RemoteException, match="CollectiveMismatch"):
                dm.inspect(total, gpu=gpu)
        assert time.monotonic() - start < PROMPT_S
        total = pg_extra(torch.ones(2), pg, -1, 0)
        assert dm.inspect(total, gpu=0).tolist() == [4.0, 4.0]


def test_a_function_taking_two_process_groups_that_raises_between_them(mesh2):
    """Group rank 1 raises after its all-reduce on the first group while its peer waits in
    one on the second: rank 1 closes the call on both groups at once, so its peer meets it
    on the second and then closes the first with it."""
    between = dm.remote("helpers.remote_fns.pg_fails_between_groups", propagate=lambda x, a, b: x)
    with mesh2.activate():
        first, second = mesh2.process_group("gpu"), mesh2.process_group("gpu")
        start = time.monotonic()
        total = between(torch.ones(2), first, second)
        for gpu in (0, 1):
            with pytest.raises(dm.RemoteException, match="gave up between its groups"):
                dm.inspect(total, gpu=gpu)
        assert time.monotonic() - start < PROMPT_S
        total, *_ = pg_collectives(torch.ones(2), second, mesh2)
        assert dm.inspect(total, gpu=0).tolist() == [2.0, 2.0]


def test_a_compiled_step_whose_process_group_call_raises_partway_on_one_rank(mesh2):
    """In a replay, the failing member's error belongs to the replay; its peer, waiting in the
    second all-reduce, fails with it all the same, and the next replay runs."""
    partway = dm.remote("helpers.remote_fns.pg_positive_partway", propagate=lambda x, pg: x)
    with mesh2.activate():
        pg = mesh2.process_group("gpu")

        @dm.compile
        def step(x):
            return partway(x, pg)

        good = torch.ones(2)
        assert dm.inspect(step(good), gpu=0).tolist() == [4.0, 4.0]  # traced
        assert dm.inspect(step(good), gpu=0).tolist() == [4.0, 4.0]  # replayed
        bad = torch.ones(2) - 2 * mesh2.rank("gpu")
        _raises_the_root(lambda: dm.inspect(step(bad), gpu=0))
        assert dm.inspect(step(good), gpu=1).tolist() == [4.0, 4.0]
