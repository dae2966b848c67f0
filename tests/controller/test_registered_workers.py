"""Counting a cluster's workers: never from ``client.scheduler_info()``'s cache.

``Client.scheduler_info()`` asks the scheduler for every worker, stores the
answer in the client's cache and returns the cache; the client's periodic
refresh (``distributed.client.scheduler-info-interval``, 2 s) stores answers
without per-worker entries in the same cache, and can do so in between. The
caller then sees ``"workers": {}``: a mesh sized from it would have no rank,
and a test that looked a worker up in it failed with a ``KeyError`` in CI.
With a refresh every 5 ms that happened to 207 of 3 000 calls here; the
library asks the scheduler through :func:`registered_workers` instead.
"""

from __future__ import annotations

import dask
from distributed import Client

from dask_monarch.controller.placement import registered_workers
from dask_monarch.deployment.cluster_info import describe_cluster

FAST_REFRESH = {"distributed.client.scheduler-info-interval": "5ms"}


def test_registered_workers_sees_every_worker_while_the_cache_is_refreshed(cluster2):
    with dask.config.set(FAST_REFRESH), Client(cluster2.scheduler_address) as client:
        client.wait_for_workers(2)
        counts = {len(registered_workers(client)) for _ in range(1000)}
    assert counts == {2}


def test_dask_monarch_info_lists_every_worker_while_the_cache_is_refreshed(cluster2):
    with dask.config.set(FAST_REFRESH):
        counts = {
            len(describe_cluster(cluster2.scheduler_address, None)["workers"]) for _ in range(10)
        }
    assert counts == {2}
