"""A rank worker that dies always comes back on the embedded cluster (issue 35 item 2).

Dask's SpecCluster closes a nanny whose worker has not come back within
``distributed.deploy.lost-worker-timeout`` (15 s): on a loaded machine a
rank's replacement takes longer, and the cluster stayed one rank short for
good. These tests make that window tiny (so the replacement is always late)
and kill ranks in the ways a rank dies.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from distributed import Client
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch.controller.placement import registered_workers

pytestmark = pytest.mark.timeout(600)

SHORT_LOST_WORKER_WINDOW = {"distributed.deploy.lost-worker-timeout": "100ms"}


def _spin(stop) -> None:
    while not stop.is_set():
        pass


class cpu_load:
    """A busy process per core while the block runs (slows every restart down)."""

    def __enter__(self):
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.procs = [ctx.Process(target=_spin, args=(self.stop,)) for _ in range(os.cpu_count())]
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


async def _abort() -> None:
    os.abort()


async def _exit() -> None:
    os._exit(1)


def _replaced(client: Client, gone: set[str], n: int, timeout: float) -> list[str]:
    """Wait until ``n`` workers run, none of them at an address in ``gone``; their names."""

    def back() -> list[str] | None:
        workers = registered_workers(client)
        if len(workers) == n and not set(workers) & gone:
            return sorted(w["name"] for w in workers.values())
        return None

    return wait_until(back, timeout, f"{n} ranks back, none at {sorted(gone)}", every=0.2)


def _works(client: Client, n: int) -> None:
    mesh = dm.device_mesh(client, gpu=n)
    try:
        with mesh.activate():
            total = torch.ones(2).reduce("gpu", "sum")
            assert dm.inspect(total, gpu=0).tolist() == [float(n)] * 2
    finally:
        mesh.exit()


@pytest.mark.parametrize("how", ["abort", "exit"])
def test_ranks_killed_together_under_load_come_back(how, throwaway_cluster):
    kill = _abort if how == "abort" else _exit
    with throwaway_cluster(2, config=SHORT_LOST_WORKER_WINDOW) as (cluster, client):
        old = set(registered_workers(client))
        with cpu_load():
            client.run(kill, wait=False)  # both ranks at once
            # the replacements are slower than the lost-worker window, which closed their
            # nannies before: both ranks must come back all the same
            assert _replaced(client, old, 2, timeout=120) == ["rank0", "rank1"]
        assert sorted(cluster.workers) == ["rank0", "rank1"]
        _works(client, 2)


def test_a_rank_whose_nanny_gave_up_is_started_again_from_its_spec(throwaway_cluster):
    with throwaway_cluster(2, config=SHORT_LOST_WORKER_WINDOW) as (cluster, client):
        nanny = cluster.workers["rank1"]
        gone = {nanny.worker_address}
        cluster.sync(nanny.close, reason="nanny-instantiate-failed")  # as a failed restart does
        assert _replaced(client, gone, 2, timeout=120) == [
            "rank0",
            "rank1",
        ]
        # the cluster records its new nanny once the nanny's start returns, which may be just
        # after its worker registered with the scheduler
        wait_until(
            lambda: cluster.workers.get("rank1") not in (None, nanny), what="rank1's new nanny"
        )
        _works(client, 2)


def test_a_remove_for_a_worker_scheduler_info_already_dropped_is_no_error(throwaway_cluster):
    """``wait_for_workers`` (a user's, or Dask's own) replaces the cluster's
    ``scheduler_info`` with the scheduler's identity, which can drop a killed rank before
    the scheduler's "remove" for it arrives: that remove raised KeyError, which ended the
    cluster's watch of its workers (no more adds, removes, or restarts of lost ranks)."""
    with throwaway_cluster(2) as (cluster, client):
        old = next(a for a, w in registered_workers(client).items() if w["name"] == "rank1")
        client.run(_exit, workers=[old], wait=False)
        wait_until(lambda: old not in cluster.scheduler_info["workers"], what="rank1 removed")

        async def remove_again() -> None:  # the remove, after a refresh that dropped the worker
            cluster._update_worker_status("remove", old)

        cluster.sync(remove_again)
        client.wait_for_workers(2, timeout=120)
        assert not cluster._watch_worker_status_task.done()
        assert _replaced(client, {old}, 2, timeout=120) == ["rank0", "rank1"]
        # the watch still runs: the cluster hears of the next rank lost and back
        again = next(a for a, w in registered_workers(client).items() if w["name"] == "rank1")
        client.run(_exit, workers=[again], wait=False)
        wait_until(lambda: again not in cluster.scheduler_info["workers"], what="rank1 removed")
        assert _replaced(client, {old, again}, 2, timeout=120) == ["rank0", "rank1"]
