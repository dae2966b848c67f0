"""A lane waiting on a peer that never comes is freed when its controller fails or leaves.

Issue 13: no wait on a worker is unbounded; each gives up when its controller
fails or releases the rank, not at the collective timeout (long here, so that
a lane that waits for it shows). The controllers break on purpose and their
lanes would hold a worker for minutes if the fix regressed, so the tests run on
a throw-away cluster.
"""

from __future__ import annotations

import time

import dask
import pytest
import torch
from distributed import Client
from helpers.raw import S0, call, create_streams
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Ref
from dask_monarch.ndslice import Slice

BOTH = [0, 1]
MESH = Ref(900)
COLLECTIVE_TIMEOUT = 120.0  # what the waits must not last


@pytest.fixture(scope="module")
def client(throwaway_cluster):
    with throwaway_cluster(2) as (_, client):
        yield client


def _running(token: str, dask_worker=None) -> list[str]:
    return [str(ts.key) for ts in dask_worker.state.executing if token in str(ts.key)]


def running(client: Client, token: str) -> list[str]:
    """The tasks of controller ``token`` the workers are executing."""
    return [key for keys in client.run(_running, token).values() for key in keys]


def seconds_until_free(client: Client, ctrl: dm.Controller) -> float:
    """Seconds until the workers run no task of ``ctrl`` (its lane gave up its wait)."""
    start = time.monotonic()
    wait_until(lambda: not running(client, ctrl.token), 2 * COLLECTIVE_TIMEOUT, "the lane")
    return time.monotonic() - start


def two_ranks_past_backend_network_init(client: Client) -> dm.Controller:
    """A controller of two ranks that made the world group and a tensor r1 on stream S0."""
    with dask.config.set({"dask_monarch.timeouts.collective": f"{COLLECTIVE_TIMEOUT}s"}):
        ctrl = dm.Controller(client, world_size=2)
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, m.CreateDeviceMesh(MESH, ["gpu"], Slice(0, [2], [1])))
    ctrl.send(BOTH, m.BackendNetworkInit())
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
    assert ctrl.sync(timeout=120) == []
    return ctrl


def rank0_in_a_rendezvous_rank1_never_joins(client: Client) -> dm.Controller:
    """A controller whose rank 0 sits in the rendezvous of a SplitComm rank 1 never got."""
    ctrl = two_ranks_past_backend_network_init(client)
    ctrl.send(0, m.SplitComm(["gpu"], MESH, S0))
    ctrl.flush()
    wait_until(lambda: running(client, ctrl.token), 60, "rank 0 to enter the rendezvous")
    time.sleep(0.5)  # well inside the wait
    assert running(client, ctrl.token)
    return ctrl


@pytest.mark.timeout(400)
def test_a_rendezvous_gives_up_when_its_controller_is_closed(client):
    ctrl = rank0_in_a_rendezvous_rank1_never_joins(client)
    ctrl.close(timeout=0)
    took = seconds_until_free(client, ctrl)
    print(f"the lane was free {took:.1f}s after close")
    assert took < COLLECTIVE_TIMEOUT / 2  # not at the collective timeout


@pytest.mark.timeout(400)
def test_a_rendezvous_gives_up_when_its_controller_fails(client):
    ctrl = rank0_in_a_rendezvous_rank1_never_joins(client)
    try:
        ctrl.send(1, call(1, None, "__test_panic"))
        with pytest.raises(dm.DeviceException):
            ctrl.sync(timeout=120)
        took = seconds_until_free(client, ctrl)
        print(f"the lane was free {took:.1f}s after the failure")
        assert took < COLLECTIVE_TIMEOUT / 2
    finally:
        ctrl.close()
    with dm.Controller(client, world_size=2) as other:  # the workers serve the next one
        create_streams(other, BOTH, S0)
        other.send(BOTH, call(0, Ref(1), "torch.ones", 2))
        assert other.sync(timeout=120) == []


def _pretend_arrived(prefix: str, rank: int, token: str, dask_worker=None) -> None:
    """Write ``rank``'s arrival at the rendezvous under ``prefix`` into controller ``token``'s
    store (on its rank 0's worker), as if that rank had reached it and then left."""
    import torch.distributed as dist

    from dask_monarch.protocol.names import PLUGIN_NAME
    from dask_monarch.worker.comm import announce_arrival

    comms = dask_worker.plugins[PLUGIN_NAME].ranks[token].comms
    announce_arrival(dist.PrefixStore(prefix, comms.server), rank, 2)


@pytest.mark.timeout(400)
def test_a_group_whose_peer_left_after_arriving_is_given_up_with_its_controller(client):
    """Rank 1 came to the rendezvous and left: rank 0 sits in gloo's connect to it (which
    retries until the collective timeout); closing the controller frees the lane at once.
    Groups that connect every pair when made (``comm.gloo-connect: eager``); the next test
    is the same with a group that connects at its first operation."""
    settings = {
        "dask_monarch.timeouts.collective": f"{COLLECTIVE_TIMEOUT}s",
        "dask_monarch.comm.gloo-connect": "eager",
    }
    with dask.config.set(settings):
        ctrl = dm.Controller(client, world_size=2)
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, m.CreateDeviceMesh(MESH, ["gpu"], Slice(0, [2], [1])))
    ctrl.send(BOTH, m.BackendNetworkInit())
    assert ctrl.sync(timeout=120) == []
    rank0 = ctrl.workers[0]  # its worker holds the store
    prefix = f"world/split/{MESH.id}/{S0.id}/gpu/0-1/"
    client.run(_pretend_arrived, prefix, 1, ctrl.token, workers=[rank0])
    ctrl.send(0, m.SplitComm(["gpu"], MESH, S0))
    ctrl.flush()
    wait_until(lambda: running(client, ctrl.token), 60, "rank 0 to enter the rendezvous")
    time.sleep(2)  # past the arrivals, inside gloo's connect
    assert running(client, ctrl.token)
    ctrl.close(timeout=0)
    took = seconds_until_free(client, ctrl)
    print(f"the lane was free {took:.1f}s after close")
    assert took < COLLECTIVE_TIMEOUT / 2


@pytest.mark.timeout(400)
def test_a_lazy_group_whose_peer_left_is_given_up_in_its_first_operation(client):
    """The same, with ``comm.gloo-connect: lazy`` (the default): rank 0's group is made
    without connecting, and its first reduce sits in gloo's connect to rank 1 (inside the
    operation, until the collective timeout); closing the controller frees the lane."""
    ctrl = two_ranks_past_backend_network_init(client)
    client.run(
        _pretend_arrived,
        f"world/split/{MESH.id}/{S0.id}/gpu/0-1/",
        1,
        ctrl.token,
        workers=[ctrl.workers[0]],
    )
    ctrl.send(0, m.SplitComm(["gpu"], MESH, S0))
    factory = m.Factory((2,), torch.float32, torch.strided, "cpu")
    ctrl.send(
        0, m.Reduce(Ref(2), Ref(1), factory, MESH, S0, ["gpu"], m.ReduceOp.SUM, False, False, None)
    )
    ctrl.flush()
    wait_until(lambda: running(client, ctrl.token), 60, "rank 0 to start the reduce")
    time.sleep(2)  # inside the reduce's connect to rank 1
    assert running(client, ctrl.token)
    ctrl.close(timeout=0)
    took = seconds_until_free(client, ctrl)
    print(f"the lane was free {took:.1f}s after close")
    assert took < COLLECTIVE_TIMEOUT / 2


@pytest.mark.timeout(120)
def test_connecting_to_a_store_that_is_gone_gives_up_when_told():
    """torch retries a refused connection until the store's timeout; the rank tries in short
    attempts and stops once its controller failed or released it (the store left with it)."""
    from dask_monarch.worker import groups

    store, port = groups.start_store("127.0.0.1", 60)
    del store  # the controller's store is gone: its port refuses connections
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        groups.connect_store("127.0.0.1", port, 60, lambda: time.monotonic() - start > 1)
    took = time.monotonic() - start
    print(f"gave up after {took:.1f}s")
    assert took < 30  # not at the 60 s timeout
