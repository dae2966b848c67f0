"""The embedded cluster's rank workers are set up for torch (deployment/cluster.py)."""

from __future__ import annotations

import multiprocessing
import os

import pytest
from dask.utils import parse_timedelta
from distributed import Client

from dask_monarch.deployment.workers import (
    MALLOC_MMAP_THRESHOLD,
    MALLOC_TRIM_THRESHOLD,
    TICK_INTERVAL,
)


def _worker_facts(dask_worker=None) -> dict:
    import torch

    return {
        "name": dask_worker.name,
        "resources": dict(dask_worker.state.total_resources),
        "daemon": multiprocessing.current_process().daemon,
        "torch_threads": torch.get_num_threads(),
        "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "trim_threshold": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
        "tick_ms": dask_worker.periodic_callbacks["tick"].callback_time,
    }


def test_rank_workers_are_named_pinned_and_tuned_for_torch(client2):
    facts = sorted(client2.run(_worker_facts).values(), key=lambda f: f["name"])
    assert [f["name"] for f in facts] == ["rank0", "rank1"]
    for i, f in enumerate(facts):
        assert f"monarch-rank{i}" in f["resources"]
        assert not f["daemon"]  # pipes and data loaders may start processes
        assert f["torch_threads"] == max(1, (os.cpu_count() or 1) // 2)
        assert f["mmap_threshold"] == MALLOC_MMAP_THRESHOLD  # torch allocations stay on the heap
        assert f["trim_threshold"] == MALLOC_TRIM_THRESHOLD  # ... and keep their pages
        assert f["tick_ms"] == parse_timedelta(TICK_INTERVAL) * 1000  # the loop timed less often


def test_the_scheduler_process_times_its_loop_as_seldom_as_the_ranks(client2):
    """Dask's 20 ms tick cost an idle scheduler 12 of its 20 ms of CPU per second."""

    def tick_ms(dask_scheduler=None) -> float:
        return dask_scheduler.periodic_callbacks["tick"].callback_time

    assert client2.run_on_scheduler(tick_ms) == parse_timedelta(TICK_INTERVAL) * 1000


def test_closing_the_cluster_removes_its_scheduler_file():
    """The scheduler process is killed on close, so the file it wrote is removed for it."""
    import dask_monarch as dm

    with dm.LocalMeshCluster(n_ranks=1, device="cpu") as cluster, Client(cluster) as client:
        scheduler_file = cluster.scheduler.scheduler_kwargs["scheduler_file"]
        assert os.path.exists(scheduler_file)
        mesh = dm.device_mesh(client, gpu=1)
        mesh.exit()
    assert not os.path.exists(scheduler_file)


def test_starting_ranks_leaves_the_daemon_setting_of_the_users_process_as_it_was():
    """Each rank's nanny starts its worker non-daemonic (pipes start processes); ranks start
    concurrently, and the user's own setting is what it was once they have."""
    import dask

    import dask_monarch as dm

    with dask.config.set({"distributed.worker.daemon": True}):
        with dm.LocalMeshCluster(n_ranks=3, device="cpu"):
            assert dask.config.get("distributed.worker.daemon") is True
        assert dask.config.get("distributed.worker.daemon") is True


def test_rank_workers_see_their_own_gpu_first():
    from dask_monarch.deployment.workers import parse_gpus, rotated

    gpus = parse_gpus("0, 1,2,3")
    assert [rotated(gpus, i) for i in range(4)] == ["0,1,2,3", "1,2,3,0", "2,3,0,1", "3,0,1,2"]
    for bad in ("0,,1", "0,1,0"):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(bad)


def test_nannies_in_the_clients_process_sample_nothing_for_nobody(cluster2):
    """A nanny's system figures and loop ticks are shown nowhere: its worker reports its own.
    Its memory monitor, which restarts a worker near its memory limit, stays."""
    nannies = list(cluster2.workers.values())
    assert nannies
    for nanny in nannies:
        assert "monitor" not in nanny.periodic_callbacks
        assert "tick" not in nanny.periodic_callbacks
        if nanny.memory_manager.memory_limit:
            assert "memory_monitor" in nanny.periodic_callbacks
