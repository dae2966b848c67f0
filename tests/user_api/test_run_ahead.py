"""How far the user's thread may run ahead of its ranks (``dask_monarch.flush.max-ahead``)."""

from __future__ import annotations

import time

import dask
import pytest
import torch

import dask_monarch as dm

SLEEP_S = 1.5
AHEAD = 64


def _mesh(client):
    with dask.config.set({"dask_monarch.flush.max-ahead": AHEAD}):
        return dm.device_mesh(client, gpu=2)


@pytest.mark.timeout(120)
def test_the_user_waits_once_it_is_max_ahead_of_its_ranks(client2):
    """A loop that never fetches stays within max-ahead messages of what every rank ran
    (the ranks are busy for SLEEP_S first): it waits, as CUDA's launch queue makes a host
    thread wait, and the values are right."""
    mesh = _mesh(client2)
    try:
        session = mesh._session
        slow_copy = dm.remote("helpers.remote_fns.slow_copy", propagate=lambda x, s: x.clone())
        with mesh.activate():
            x = slow_copy(torch.zeros(4), SLEEP_S)
            start, behind = time.monotonic(), []
            for _ in range(5 * AHEAD):
                x = x + 1
                behind.append(session._seq - session.history.completed)
            issued = time.monotonic() - start
            assert dm.inspect(x).tolist() == [5.0 * AHEAD] * 4
        assert max(behind) <= AHEAD + 1, max(behind)
        assert issued > SLEEP_S / 2, issued  # it waited for the ranks to pass the sleep
    finally:
        mesh.exit()


@pytest.mark.timeout(120)
def test_a_dry_run_never_waits_for_ranks(client2):
    """Nothing runs in a dry run, so nothing catches up: it must not wait."""
    mesh = _mesh(client2)
    try:
        with mesh.activate(), dm.dry_run(mesh) as dry:
            x = torch.zeros(4)
            for _ in range(5 * AHEAD):
                x = x + 1
        assert dry.ranks[0].messages >= 5 * AHEAD
    finally:
        mesh.exit()


@pytest.mark.parametrize("value", [1, "many", 2.5])
def test_a_bad_max_ahead_is_refused_before_any_worker_is_claimed(client2, value):
    with dask.config.set({"dask_monarch.flush.max-ahead": value}):
        with pytest.raises(ValueError, match="flush.max-ahead"):
            dm.device_mesh(client2, gpu=2)
    with dm.Controller(client2, world_size=2):  # both workers are still free
        pass
