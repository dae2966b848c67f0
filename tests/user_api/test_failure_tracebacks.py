"""A failure that several fetches depend on is raised by each with the traceback of its own
fetch: the one exception object the history shares is not raised again (each raise would add
its frames to it, so a later fetch showed every earlier fetch site, and kept their locals,
mesh tensors included, alive)."""

from __future__ import annotations

import traceback

import dask
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


def test_each_call_on_a_broken_mesh_has_its_own_traceback(client2):
    with dask.config.set({"dask_monarch.limits.lanes": 2}):  # a third stream breaks it
        mesh = dm.device_mesh(client2, gpu=2)
    try:
        with mesh.activate():
            t = torch.ones(2)
            streams = [dm.Stream(f"s{i}") for i in range(3)]
            with pytest.raises(dm.DeviceException, match="limits.lanes"):
                for s in streams:
                    with s.activate():
                        torch.ones(1)
                    mesh._session.controller.flush()
            errors = []
            for fetch in (_first_site, _second_site, _second_site):
                with pytest.raises(dm.DeviceException) as info:
                    fetch(t)
                errors.append(info.value)
    finally:
        with pytest.raises(dm.DeviceException) as at_exit:
            mesh.exit()
    assert len({id(e) for e in errors}) == 3 and len({str(e) for e in errors}) == 1
    frames = ["".join(traceback.format_tb(e.__traceback__)) for e in (*errors, at_exit.value)]
    assert "_first_site" in frames[0] and "_second_site" not in frames[0]
    assert "_second_site" in frames[1] and "_first_site" not in frames[1]
    assert "_second_site" not in frames[3] and "_flush_loop" not in frames[3]
