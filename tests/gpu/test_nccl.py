"""A worker that sees every GPU, and NCCL failures that must not kill workers (issue 36).

Each part has a cluster of its own: ranks whose workers see every GPU take the next free one
(``pick_device``), which the rotated workers of test_cuda.py would hold; the failure tests
kill and stall ranks.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from helpers.gpus import all_reduce, needs_gpus
from helpers.raw import S0, call, create_streams, fetch, values

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Ref
from dask_monarch.ndslice import Slice

MESH = Ref(100)


# ------------------------------------------------------------------ a worker that sees every GPU


@pytest.fixture(scope="module")
def every_gpu_client(throwaway_cluster):
    """Two plain workers, each seeing every GPU: the second claims GPU 1."""
    with throwaway_cluster(2, plain=True, threads_per_worker=2) as (_, client):
        yield client


@needs_gpus(2)
def test_ranks_of_a_worker_that_sees_every_gpu_keep_everything_on_their_own(every_gpu_client):
    """On the rank whose GPU is cuda:1: a failed input's zeros and receive buffers (NCCL would
    fail on a tensor of another GPU), pipe values, actor state and the RNG state."""
    mesh = dm.device_mesh(every_gpu_client, gpu=2)
    try:
        where = dm.remote("helpers.remote_fns.device_of", propagate="inspect")
        with mesh.activate():
            devices = [dm.inspect(where(torch.zeros(1, device="cuda")), gpu=r) for r in range(2)]
            assert sorted(devices) == ["cuda:0", "cuda:1"]
            one = devices.index("cuda:1")
            x = torch.ones(4, device="cuda")
            for moved in (torch.ones(2).cuda(), torch.ones(2).to("cuda"), x.new_zeros(2)):
                assert dm.inspect(where(moved), gpu=one) == "cuda:1"  # not the client's cuda:0
            assert dm.inspect(where(torch.zeros(2, device=x.device)), gpu=one) == "cuda:1"
            bad = _fails_on_rank(x, mesh.rank("gpu"), one)
            total = bad.reduce("gpu", "sum")  # rank `one` takes part with zeros
            fine = x.reduce("gpu", "sum")
            assert dm.inspect(fine, gpu=one).tolist() == [2.0] * 4
            with pytest.raises(dm.RemoteException):
                dm.inspect(total, gpu=one)
            with pytest.warns(UserWarning, match="broadcast"):  # the other rank sends to `one`
                moved = dm.to_mesh(x.slice_mesh(gpu=1 - one), mesh)
            assert dm.inspect(where(moved), gpu=one) == "cuda:1"  # its receive buffer
            pipe = dm.create_pipe("helpers.remote_fns.cuda_loader", 2, max_messages=1)
            batch = pipe.recv()
            assert dm.inspect(where(batch), gpu=one) == "cuda:1"
            actors = mesh.spawn("on_gpu", __import__("helpers.remote_fns").remote_fns.CudaActor)
            assert actors.call("device").result(timeout=60)[one] == "cuda:1"
            dm.random.manual_seed(3)
            state = dm.random.get_state()
            a = torch.rand(4, device="cuda")
            dm.random.set_state(state)
            b = torch.rand(4, device="cuda")
            assert torch.equal(dm.inspect(a, gpu=one), dm.inspect(b, gpu=one))
    finally:
        mesh.exit()


@dm.remote(propagate=lambda x, r, which: x.clone())
def _fails_on_rank(x, rank, which):
    if int(rank) == which:
        raise RuntimeError("this rank refuses")
    return x.clone()


@needs_gpus(2)
def test_one_gpu_per_worker_process_whatever_the_device_setting(every_gpu_client):
    with (
        dm.Controller(every_gpu_client, world_size=2, device="auto") as auto,
        dm.Controller(every_gpu_client, world_size=2, device="cuda") as cuda,
    ):
        by_worker = dict(zip(auto.workers, auto.devices))
        assert by_worker == dict(zip(cuda.workers, cuda.devices))
        assert sorted(by_worker.values()) == ["cuda:0", "cuda:1"]


# ------------------------------------------------------------------ NCCL failures


@pytest.fixture(scope="module")
def failing_client(throwaway_cluster):
    """Two rank workers, one GPU each, with a short collective timeout."""
    short = {"dask_monarch.timeouts.collective": "15s"}
    with throwaway_cluster(2, config=short, device="cuda") as (_, client):
        yield client


def _in_an_all_reduce(ctrl):
    """Rank 0 waits in an NCCL all-reduce that rank 1, stuck in a sleep, never joins."""
    ranks = [0, 1]
    create_streams(ctrl, ranks, S0)
    ctrl.send(ranks, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2])))
    ctrl.send(ranks, m.BackendNetworkInit())
    ctrl.send(ranks, m.SplitComm(["gpu"], MESH, S0))
    ctrl.send(ranks, call(0, Ref(1), "torch.ones", 1 << 20, device="cuda"))
    ctrl.send(1, call(1, None, "helpers.remote_fns.sleep_then", 120))
    ctrl.send(ranks, all_reduce(Ref(2), Ref(1), (1 << 20,), MESH, S0))
    ctrl.send(0, fetch(2, (Ref(2),), fn="torch.ops.aten.sum.default"))
    ctrl.flush()


def _pids(client, ctrl):
    got = client.run(os.getpid, workers=list(ctrl.workers))
    return [got[address] for address in ctrl.workers]


def _usable(client, address):
    with dm.Controller(client, world_size=1, device="cuda", workers=[address]) as ctrl:
        create_streams(ctrl, [0], S0)
        ctrl.send(0, call(0, Ref(1), "torch.ones", 4, device="cuda"))
        ctrl.send(0, fetch(1, (Ref(1),), fn="torch.ops.aten.sum.default"))
        return values(ctrl.sync(timeout=120))[(1, 0)].item() == 4


@needs_gpus(2)
@pytest.mark.timeout(240)
def test_a_peer_later_than_the_timeout_fails_the_mesh_and_no_worker(failing_client):
    """NCCL's watchdog aborts the collective at the timeout; with torch's defaults it would end
    the Dask worker process too."""
    ctrl = dm.Controller(failing_client, world_size=2, device="cuda")
    pids = _pids(failing_client, ctrl)
    started = time.monotonic()
    try:
        _in_an_all_reduce(ctrl)
        with pytest.raises(dm.DeviceException, match="rank 0"):
            ctrl.sync(timeout=120)
        assert time.monotonic() - started < 90
    finally:
        ctrl.close()
    assert _pids(failing_client, ctrl) == pids  # both workers are the same processes
    assert all(_usable(failing_client, address) for address in ctrl.workers)


@needs_gpus(2)
@pytest.mark.timeout(240)
def test_a_lost_peer_during_an_nccl_collective_fails_the_mesh_and_the_others_survive(
    failing_client,
):
    ctrl = dm.Controller(failing_client, world_size=2, device="cuda")
    pids = _pids(failing_client, ctrl)
    survivor = ctrl.workers[0]
    try:
        _in_an_all_reduce(ctrl)
        time.sleep(3)  # rank 0 is in the all-reduce
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(dm.DeviceException):
            ctrl.sync(timeout=120)
        assert time.monotonic() - started < 60
    finally:
        ctrl.close()
    assert failing_client.run(os.getpid, workers=[survivor])[survivor] == pids[0]
    assert _usable(failing_client, survivor)
