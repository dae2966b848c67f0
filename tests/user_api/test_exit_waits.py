"""``mesh.exit(timeout=...)`` waits ``timeout`` seconds for the ranks and no longer: the
ranks are released either way (docs of ``DeviceMesh.exit``)."""

from __future__ import annotations

import time

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def client(throwaway_cluster):
    """A cluster of this module's own: the call exit() gives up on keeps running a while."""
    with throwaway_cluster(2) as (_, client):
        yield client


def test_exit_that_times_out_returns_after_its_timeout(client):
    mesh = dm.device_mesh(client, gpu=2)
    slow = dm.remote("helpers.remote_fns.slow_copy", propagate=lambda x, seconds: x)
    with mesh.activate():
        slow(torch.ones(2), 12.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"mesh.exit\(\) waited 1.0s for the ranks"):
        mesh.exit(timeout=1.0)
    took = time.monotonic() - start
    # not another timeouts.close (10 s) of draining on top
    assert took < 6, f"mesh.exit(timeout=1.0) took {took:.1f}s"
    assert mesh._session.closed and mesh._session.controller.closed
    with pytest.raises(RuntimeError, match="has exited"):
        with mesh.activate():
            pass
