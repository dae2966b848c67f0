"""What ``dm.inspect`` / ``dm.fetch_shard`` cannot fetch is refused saying what to do."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(120)


def test_fetching_a_mesh_slice_says_to_move_it_first(mesh2):
    with mesh2.activate():
        t = torch.ones(2) * 3
        shards = t.slice_mesh(gpu=1)
        for obj in (shards, [shards, t]):
            with pytest.raises(TypeError, match=r"to_mesh") as info:
                dm.inspect(obj)
            assert "cannot be pickled" not in str(info.value)
        assert dm.inspect(t, gpu=1).tolist() == [3.0, 3.0]  # what it says to do works


def test_a_failed_fetch_hands_its_failure_to_exception_and_gather_skip(mesh2):
    """``MeshFuture.exception()`` returns the failure, whatever its type (as
    ``concurrent.futures`` does): a fetch of what a dry run made fails with DryRunError."""
    with dm.dry_run(mesh2):
        with mesh2.activate():
            made = torch.ones(2) * 2
    with mesh2.activate():
        future = dm.fetch_shard(made)
        error = future.exception(timeout=30)
        assert type(error).__name__ == "DryRunError", error
        assert dm.gather([future], errors="skip") == [None]
        assert dm.inspect(torch.ones(1)).tolist() == [1.0]
