"""However a controller ends, its workers get their whole thread budget back and no task sticks.

Fifty controllers end in a row on one throw-away cluster, each a different
way in rotation, most with segments still queued on their ranks; then every
worker's thread budget and executing set must be back where they started and
a normal mesh must run on the same workers. (Lost workers are in
test_isolation.py, which checks the surviving workers' budgets.)
"""

from __future__ import annotations

import time

import dask
import pytest
import torch
from distributed import Client
from helpers.raw import S0, S1, S3, call, create_streams, fetch, values

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Ref

BOTH = [0, 1]
BOUND = 60  # seconds: generous, it only turns a hang into a failure
SMALL = 30  # small segments queued per lane


@pytest.fixture(scope="module")
def throwaway(throwaway_cluster):
    with throwaway_cluster(2) as (cluster, client):
        yield cluster, client


def _budget(dask_worker) -> dict:
    state = dask_worker.state
    plugin = dask_worker.plugins.get("dask_monarch")
    return {
        "nthreads": state.nthreads,
        "executing": sorted(map(str, state.executing)),
        "stuck": sorted(
            f"{ts.key}: {ts.state}"
            for ts in state.tasks.values()
            if ts.state in ("executing", "cancelled", "resumed")
        ),
        "ranks": sorted(plugin.ranks) if plugin is not None else [],
    }


def _start(client: Client, i: int) -> dm.Controller:
    """A controller whose ranks are busy when it ends: a slow segment, then many small ones
    on two lanes, each its own task (a lane's executor is handed each as the one before
    returns: the moment at which a release used to cancel work Dask had handed it)."""
    ctrl = dm.Controller(client, world_size=2)
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, m.CreateDeviceMesh(Ref(50), ["gpu"], dm.ndslice.Slice(0, [2], [1])))
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
    ctrl.send(BOTH, call(1, Ref(2), "helpers.remote_fns.slow_copy", Ref(1), 0.05, stream=S0))
    ctrl.flush()
    for k in range(SMALL):
        ctrl.send(BOTH, call(2 + 2 * k, Ref(10 + k), "torch.ones", 1, stream=S0))
        ctrl.send(BOTH, call(3 + 2 * k, Ref(10 + k), "torch.ones", 1, stream=S1))
        ctrl.flush()
    time.sleep(0.02 * (i % 5))  # end it at a different point of the flow each time
    return ctrl


def _panic(client, address, i):
    ctrl = _start(client, i)
    ctrl.send(1, call(80, None, "__test_panic"))
    with pytest.raises(dm.DeviceException, match="__test_panic"):
        ctrl.sync(timeout=BOUND)
    ctrl.close()


def _protocol_error(client, address, i):
    ctrl = _start(client, i)
    ctrl.send(0, call(80, Ref(80), "torch.ones", 1, stream=S3))  # S3 was never created
    with pytest.raises(dm.DeviceException, match="never created"):
        ctrl.sync(timeout=BOUND)
    ctrl.close()


def _close_mid_run(client, address, i):
    ctrl = _start(client, i)
    ctrl.close()  # timeouts.close is short here: closes with the segments still queued


def _exit(client, address, i):
    ctrl = _start(client, i)
    ctrl.send(BOTH, m.Exit())
    assert ctrl.sync(timeout=BOUND) == []
    ctrl.close()


def _exit_with_error(client, address, i):
    ctrl = _start(client, i)
    ctrl.send(BOTH, m.Exit(("rank 0", "gave up")))
    with pytest.raises(dm.DeviceException, match="gave up"):
        ctrl.sync(timeout=BOUND)
    ctrl.close()


def _blocked_borrow_then_close(client, address, i):
    ctrl = _start(client, i)
    ctrl.send(
        BOTH, call(80, Ref(80), "helpers.remote_fns.slow_copy", Ref(1), 0.3)
    )  # the lender is busy
    ctrl.send(BOTH, m.BorrowCreate(Ref(81), 1, Ref(80), S0, S1))
    ctrl.send(BOTH, m.BorrowFirstUse(1))  # S1 waits here for the lender
    ctrl.flush()
    ctrl.send(BOTH, call(81, Ref(82), "torch.ops.aten.neg.default", Ref(81), stream=S1))
    ctrl.flush()
    ctrl.close()


def _client_closed(client, address, i):
    with Client(address, set_as_default=False) as own:
        ctrl = _start(own, i)
    with pytest.raises(dm.DeviceException, match="Client was closed"):
        ctrl.sync(timeout=BOUND)
    ctrl.close()


WAYS = [
    _panic,
    _protocol_error,
    _close_mid_run,
    _exit,
    _blocked_borrow_then_close,
    _exit_with_error,
    _client_closed,
]


def _normal_mesh(client) -> float:
    start = time.monotonic()
    with dm.Controller(client, world_size=2) as ctrl:
        create_streams(ctrl, BOTH, S0, S1)
        ctrl.send(BOTH, call(0, Ref(100), "torch.full", [3], 2.0))
        for i in range(20):
            ctrl.send(BOTH, call(1 + i, Ref(101 + i), "torch.ops.aten.add.Tensor", Ref(100 + i), 1))
        ctrl.send(BOTH, call(30, Ref(2), "torch.ones", 1, stream=S1))
        ctrl.send(BOTH, fetch(31, Ref(120)))
        got = values(ctrl.sync(timeout=BOUND))
    assert all(torch.equal(got[(31, r)], torch.full((3,), 22.0)) for r in BOTH), got
    return time.monotonic() - start


@pytest.mark.timeout(600)
def test_fifty_broken_controllers_leave_every_slot_free(throwaway):
    cluster, client = throwaway
    baseline = client.run(_budget)
    assert all(not b["executing"] and not b["ranks"] for b in baseline.values()), baseline
    before = _normal_mesh(client)
    start = time.monotonic()
    with dask.config.set({"dask_monarch.timeouts.close": "50ms"}):
        for i in range(50):
            WAYS[i % len(WAYS)](client, cluster.scheduler_address, i)
    broke = time.monotonic() - start

    deadline = time.monotonic() + BOUND
    while True:
        now = client.run(_budget)
        if now == baseline or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert now == baseline, f"before: {baseline}\nafter 50 broken controllers: {now}"
    after = _normal_mesh(client)
    print(
        f"50 controllers broken in {broke:.1f}s; a normal mesh took {before:.2f}s before "
        f"and {after:.2f}s after"
    )


def _retire_a_shut_down_executor(dask_worker) -> tuple[int, int]:
    """What a release meeting a lane whose dropped stream already shut its executor leaves."""
    from concurrent.futures import ThreadPoolExecutor

    plugin = dask_worker.plugins["dask_monarch"]
    before = (plugin.extra_threads, dask_worker.state.nthreads)
    executor = ThreadPoolExecutor(1)
    plugin.extra_threads += 1  # as _register does for a lane
    dask_worker.state.nthreads += 1
    executor.shutdown(wait=False)  # the lane's retire() on its last step
    plugin._retire(executor)  # the release's forget() reaching it before remove_lane
    after = (plugin.extra_threads, dask_worker.state.nthreads)
    return before, after


@pytest.mark.timeout(60)
def test_releasing_a_rank_whose_dropped_lane_already_ended_gives_its_thread_back(client2):
    for before, after in client2.run(_retire_a_shut_down_executor).values():
        assert after == before
