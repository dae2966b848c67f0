"""A worker keeps its rank across meshes, and LocalMeshCluster.scale(n) adds and removes ranks.

Each test starts its own cluster: scaling changes it, and the mixed cluster
is not a LocalMeshCluster.
"""

from __future__ import annotations

import logging

import pytest
import torch
from distributed import Client, Nanny, Scheduler, SpecCluster
from distributed.utils_test import captured_logger
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch.controller.placement import registered_workers
from dask_monarch.protocol.names import RESOURCE_CAPACITY, rank_resource

pytestmark = pytest.mark.timeout(600)


def _ranks_by_name(client: Client, controller: dm.Controller) -> dict[str, int]:
    names = {a: w["name"] for a, w in registered_workers(client).items()}
    return {names[address]: rank for rank, address in enumerate(controller.workers)}


def test_mixed_workers_keep_their_ranks_across_meshes():
    """Workers started with a rank resource come first, the others by name, whatever ran
    before (the resource a claim gives a worker without a rank changes nothing)."""

    def worker(name: str, rank: int | None = None) -> dict:
        resources = {rank_resource(rank): RESOURCE_CAPACITY} if rank is not None else {}
        options = {"name": name, "nthreads": 1, "resources": resources, "host": "127.0.0.1"}
        return {"cls": Nanny, "options": options}

    workers = {
        "plain-b": worker("plain-b"),
        "ranked": worker("ranked", rank=0),
        "plain-a": worker("plain-a"),
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None, "host": "127.0.0.1"}}
    with SpecCluster(workers, scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(3, timeout=240)
        seen = []
        for world_size in (1, 2, 3, 1, 3):
            controller = dm.Controller(client, world_size=world_size)
            try:
                seen.append(_ranks_by_name(client, controller))
            finally:
                controller.close()
        assert seen[0] == {"ranked": 0}
        assert seen[1] == {"ranked": 0, "plain-a": 1}
        assert seen[2] == seen[4] == {"ranked": 0, "plain-a": 1, "plain-b": 2}
        assert seen[3] == seen[0]


def test_scale_adds_and_removes_rank_workers(throwaway_cluster):
    with (
        captured_logger("tornado.application", level=logging.ERROR) as tornado_log,
        captured_logger("distributed", level=logging.ERROR) as dask_log,
        throwaway_cluster(2) as (cluster, client),
    ):
        cluster.scale(3)
        client.wait_for_workers(3, timeout=240)
        assert cluster.n_ranks == 3 and sorted(cluster.worker_spec) == ["rank0", "rank1", "rank2"]
        info = registered_workers(client)
        assert {w["name"]: sorted(w["resources"]) for w in info.values()} == {
            f"rank{i}": [rank_resource(i)] for i in range(3)
        }
        mesh = dm.device_mesh(client, gpu=3)
        with mesh.activate():
            total = torch.ones(2).reduce("gpu", "sum")
            assert dm.inspect(total, gpu=2).tolist() == [3.0, 3.0]
        assert _ranks_by_name(client, mesh._session.controller) == {
            "rank0": 0,
            "rank1": 1,
            "rank2": 2,
        }
        mesh.exit()
        cluster.scale(1)
        wait_until(
            lambda: len(registered_workers(client)) == 1,
            240,
            "scale(1) to remove the workers",
            every=0.2,
        )
        remaining = registered_workers(client).values()
        assert [w["name"] for w in remaining] == ["rank0"] and cluster.n_ranks == 1
    for log in (tornado_log, dask_log):
        assert "TypeError" not in log.getvalue(), log.getvalue()
