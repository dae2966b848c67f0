"""Choosing ranks: workers that do not answer are skipped, named when too few remain.

A frozen worker (SIGSTOP) stays registered and its connections stay open, as a
host cut off the network does until the scheduler notices: asking it to
describe itself never returns. These tests freeze one, so they use a cluster
of their own.
"""

from __future__ import annotations

import time

import dask.config
import pytest
import torch
from helpers.workers import frozen

import dask_monarch as dm
from dask_monarch.controller import placement


@pytest.fixture(scope="module")
def client3(throwaway_cluster):
    with throwaway_cluster(3) as (_, client):
        yield client


@pytest.mark.timeout(180)
def test_a_frozen_worker_is_skipped_and_named(client3):
    workers = sorted(client3.sync(client3.scheduler.identity, n_workers=-1)["workers"])
    rank_order = dm.Controller(client3, 3)
    ordered = rank_order.workers
    rank_order.close()
    victim = ordered[0]  # would be rank 0
    with dask.config.set({"dask_monarch.timeouts.placement": "2s"}), frozen(client3, victim):
        start = time.monotonic()
        mesh = dm.device_mesh(client3, gpu=2)
        took = time.monotonic() - start
        try:
            assert mesh._session.controller.workers == ordered[1:]
            with mesh.activate():
                total = dm.inspect(torch.ones(1).reduce("gpu", "sum"))
            assert total.item() == 2.0
        finally:
            mesh.exit()
        print(f"\nmesh made without the frozen worker in {took:.1f}s")
        assert victim in placement._silent
        start = time.monotonic()
        with pytest.raises(ValueError, match="did not answer") as info:
            dm.device_mesh(client3, gpu=3)
        assert victim in str(info.value) and "has 2 that answer" in str(info.value)
        print(
            f"too few: ValueError in {time.monotonic() - start:.1f}s (the worker was known silent)"
        )
        with pytest.raises(ValueError, match=f"{victim}.*did not answer"):
            dm.device_mesh(client3, workers=[victim, ordered[1]], gpu=2)
    assert len(workers) == 3
    # thawed: it answers again and is chosen again
    mesh = dm.device_mesh(client3, gpu=3)
    try:
        assert mesh._session.controller.workers == ordered
    finally:
        mesh.exit()
    assert victim not in placement._silent
