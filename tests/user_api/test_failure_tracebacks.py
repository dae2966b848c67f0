"""A failure that several fetches depend on is raised by each with the traceback of its own
fetch: the one exception object the history shares is not raised again (each raise would add
its frames to it, so a later fetch showed every earlier fetch site, and kept their locals,
mesh tensors included, alive)."""

from __future__ import annotations

import traceback

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(120)


def _first_site(t):
    return dm.inspect(t)


def _second_site(t):
    return dm.inspect(t)


def _caught(fetch, t) -> dm.RemoteException:
    with pytest.raises(dm.RemoteException) as info:
        fetch(t)
    return info.value


def test_each_fetch_of_one_failure_has_its_own_traceback(mesh2):
    boom = dm.remote("helpers.remote_fns.boom", propagate=lambda x: x)
    with mesh2.activate():
        bad = boom(torch.ones(2))
        first = _caught(_first_site, bad * 2)
        second = _caught(_second_site, bad + 1)
        again = [_caught(_second_site, bad - 1) for _ in range(5)]
        assert dm.inspect(torch.ones(2) * 3).tolist() == [3.0, 3.0]  # unrelated work runs
    for e in (first, second, *again):
        assert "boom from a remote function" in str(e)
        assert (e.rank, e.seq) == (first.rank, first.seq)
    frames = ["".join(traceback.format_tb(e.__traceback__)) for e in (first, second, *again)]
    assert "_first_site" in frames[0] and "_second_site" not in frames[0]
    assert "_second_site" in frames[1] and "_first_site" not in frames[1]
    assert len({len(traceback.extract_tb(e.__traceback__)) for e in (second, *again)}) == 1
