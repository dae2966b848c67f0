"""NCCL's rules on CPU ranks (issue 36): one grouped point-to-point call per message, one lane
per communicator, checked orders (``dask_monarch.comm.emulate-nccl``), and what the worker makes
on the rank's device.

NCCL matches a communicator's operations by the order each rank issues them; gloo forgives
much of that. These tests run gloo ranks under the emulation, which checks every rank's
operations against its peers' (worker/nccl_rules.py), and show that what NCCL would hang
on or mix up fails the mesh with a message naming both ranks. To reach the ranks at all,
such sequences go past the pre-dispatch check, which refuses them (``unchecked``).
"""

from __future__ import annotations

import re

import dask
import pytest
import torch
from helpers.raw import S0, S1, call, create_streams, fetch, values
from torch._subclasses.fake_tensor import FakeTensorMode

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Factory, ReduceOp, Ref
from dask_monarch.ndslice import Slice
from dask_monarch.worker.device import CudaDevice, HostDevice

MESH = Ref(900)
BOTH = [0, 1]


def factory(shape=(3,), device="cpu"):
    return Factory(tuple(shape), torch.float32, torch.strided, device)


def one(rank):
    return Slice(rank, [1], [1])


@pytest.fixture
def emulated():
    with dask.config.set({"dask_monarch.comm.emulate-nccl": True}):
        yield


@pytest.fixture
def ctrl(client2, emulated):
    controller = dm.Controller(client2, world_size=2)
    yield controller
    controller.close()


@pytest.fixture
def ctrl3(client4, emulated):
    controller = dm.Controller(client4, world_size=3)
    yield controller
    controller.close()


class _Unchecked:
    """A pre-dispatch check that lets everything through (the worker's checks are under test)."""

    busy = ()

    def lane(self, *args):
        pass

    reduce = control = lane

    def settle(self):
        pass

    def waiting(self, *args):
        return None


def unchecked(ctrl):
    ctrl._compiler.check = _Unchecked()
    return ctrl


def setup(ctrl, ranks, streams=(S0,), split=True, p2p=((S0, S0),)):
    create_streams(ctrl, ranks, *streams)
    ctrl.send(ranks, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([len(ranks)])))
    ctrl.send(ranks, m.BackendNetworkInit())
    if split:
        ctrl.send(ranks, m.SplitComm(["gpu"], MESH, S0))
    for src, dst in p2p:
        ctrl.send(ranks, m.BackendNetworkPointToPointInit(src, dst))
    ctrl.send(ranks, call(0, Ref(1), "helpers.remote_fns.per_rank", MESH, 3))


def all_reduce(result, tensor, shape=(3,), device="cpu"):
    return m.Reduce(
        result, tensor, factory(shape, device), MESH, S0, ["gpu"], ReduceOp.SUM, False, False, None
    )


def per_rank(rank, n=3):
    return torch.arange(n, dtype=torch.float32) + 10 * (rank + 1)


# ------------------------------------------------------------------ the emulation checks


def test_every_communicator_of_an_emulated_rank_is_checked(ctrl):
    setup(ctrl, BOTH)
    ctrl.send(BOTH, all_reduce(Ref(2), Ref(1)))
    ctrl.send(BOTH, m.SendTensor(Ref(3), one(0), one(1), Ref(1), factory(), S0, S0))
    ctrl.send(BOTH, fetch(1, (), fn="helpers.remote_fns.checked_communicators"))
    got = values(ctrl.sync(timeout=60))
    for rank in BOTH:
        checked = got[(1, rank)]
        assert checked["world"] == 1  # the warm-up all-reduce
        assert checked["p2p/0/0"] == 1  # the send
        assert [n for n in checked if n.startswith("split/")] and sum(checked.values()) == 3
    assert torch.equal(ctrl.get_ref(1, Ref(3), S0), per_rank(0))


def test_a_collective_order_that_differs_between_ranks_fails_the_mesh_naming_both(ctrl):
    """gloo would pair rank 0's r10 with rank 1's r11 and return mixed-up sums."""
    unchecked(ctrl)
    setup(ctrl, BOTH)
    ctrl.send(BOTH, call(1, Ref(2), "torch.ops.aten.mul.Tensor", Ref(1), Ref(1)))
    ctrl.send(0, all_reduce(Ref(10), Ref(1)))
    ctrl.send(0, all_reduce(Ref(11), Ref(2)))
    ctrl.send(1, all_reduce(Ref(11), Ref(2)))
    ctrl.send(1, all_reduce(Ref(10), Ref(1)))
    with pytest.raises(dm.DeviceException) as raised:
        ctrl.sync(timeout=60)
    text = str(raised.value)
    assert "operation #0" in text and "(r10)" in text and "(r11)" in text
    assert "rank 0" in text and "rank 1" in text and "same order" in text


def test_a_send_order_that_differs_between_ranks_fails_the_mesh(ctrl):
    """gloo matches sends by tag, so this passes there; NCCL matches by order."""
    unchecked(ctrl)
    setup(ctrl, BOTH, split=False)
    ctrl.send(0, m.SendTensor(Ref(2), one(0), one(1), Ref(1), factory(), S0, S0))
    ctrl.send(0, m.SendTensor(Ref(3), one(0), one(1), Ref(1), factory(), S0, S0))
    ctrl.send(1, m.SendTensor(Ref(3), one(0), one(1), Ref(1), factory(), S0, S0))
    ctrl.send(1, m.SendTensor(Ref(2), one(0), one(1), Ref(1), factory(), S0, S0))
    with pytest.raises(dm.DeviceException) as raised:
        ctrl.sync(timeout=60)
    text = str(raised.value)
    assert "grouped call #0 between ranks" in text
    assert "SendTensor r2 (sends float32[3] to rank 1)" in text
    assert "SendTensor r3 (receives float32[3] from rank 0)" in text


def test_two_lanes_of_a_rank_on_one_communicator_fail_the_mesh(ctrl):
    """0 -> 1 and then 1 -> 0 over streams 0 -> 1: each rank sends on stream 0 and receives on
    stream 1 over one communicator, in an order that may differ between the ranks."""
    unchecked(ctrl)
    setup(ctrl, BOTH, streams=(S0, S1), split=False, p2p=((S0, S1),))
    ctrl.send(BOTH, m.SendTensor(Ref(2), one(0), one(1), Ref(1), factory(), S0, S1))
    ctrl.send(BOTH, m.SendTensor(Ref(3), one(1), one(0), Ref(1), factory(), S0, S1))
    with pytest.raises(dm.DeviceException) as raised:
        ctrl.sync(timeout=60)
    text = str(raised.value)
    assert "communicator p2p/0/1" in text
    # which it sees first depends on timing: the second lane, or the orders already differing
    # (both ranks received first: on NCCL, a deadlock)
    assert re.search(r"issues on it from stream [01] and from this stream", text) or (
        "grouped call #0 between ranks" in text and "receives float32[3]" in text
    )


# ------------------------------------------------------------------ refused before dispatch


@pytest.mark.parametrize(
    "sends, rank, earlier",
    [
        ([(Slice(0, [2], [1]), Slice(1, [2], [1]))], 1, "in the same message"),  # a shift
        ([(one(0), one(1)), (one(1), one(0))], 0, "in SendTensor r10"),
    ],
)
def test_a_rank_that_sends_and_receives_over_two_streams_is_refused_before_dispatch(
    client4, sends, rank, earlier
):
    ctrl = dm.Controller(client4, world_size=3)
    try:
        ranks = [0, 1, 2]
        setup(ctrl, ranks, streams=(S0, S1), split=False, p2p=((S0, S1),))
        for i, (frm, to) in enumerate(sends):
            ends = sorted({*frm, *to})
            ctrl.send(ends, m.SendTensor(Ref(10 + i), frm, to, Ref(1), factory(), S0, S1))
        with pytest.raises(dm.DeviceException) as raised:
            ctrl.sync(timeout=60)
        text = str(raised.value)
        assert f"rank {rank} would receive on stream 1" in text and earlier in text
        assert "only sends or only receives" in text
    finally:
        ctrl.close()


def test_to_mesh_both_ways_between_two_streams_is_refused_and_loses_nothing(mesh):
    comms = dm.Stream("rules")
    with mesh.activate():
        t = torch.ones(3)
        there = t.slice_mesh(host=0).to_mesh(mesh.slice(host=1), stream=comms)  # 0,1 -> 2,3
        with pytest.raises(ValueError, match="rank 2 would send over that pair of streams"):
            t.slice_mesh(host=1).to_mesh(mesh.slice(host=0), stream=comms)  # 2,3 -> 0,1
        back = t.slice_mesh(host=1).to_mesh(mesh.slice(host=0))  # one stream: fine
        with comms.activate():
            assert dm.inspect(there, gpu=0).tolist() == [1.0] * 3
        assert dm.inspect(back, gpu=1).tolist() == [1.0] * 3


# ------------------------------------------------------------------ shifts, chains, swaps


def test_three_ranks_shift_chain_and_swap_under_the_emulation(ctrl3):
    """A shift (rank 1 sends and receives in one message), a chain (0 -> 1, then 1 -> 2 of what
    arrived) and a swap: each rank one grouped call per message, on one communicator."""
    ranks = [0, 1, 2]
    setup(ctrl3, ranks, split=False)
    f = factory()
    ctrl3.send(
        ranks, m.SendTensor(Ref(2), Slice(0, [2], [1]), Slice(1, [2], [1]), Ref(1), f, S0, S0)
    )
    ctrl3.send([0, 1], m.SendTensor(Ref(3), one(0), one(1), Ref(1), f, S0, S0))
    ctrl3.send([1, 2], m.SendTensor(Ref(4), one(1), one(2), Ref(3), f, S0, S0))
    ctrl3.send([0, 1], m.SendTensor(Ref(5), one(0), one(1), Ref(1), f, S0, S0))  # a swap: two
    ctrl3.send([0, 1], m.SendTensor(Ref(5), one(1), one(0), Ref(1), f, S0, S0))  # sends, one ref
    ctrl3.send(ranks, fetch(1, (), fn="helpers.remote_fns.checked_communicators"))
    got = values(ctrl3.sync(timeout=120))
    assert got[(1, 1)]["p2p/0/0"] == 6  # the shift: 1 call with 2 peers; the chain 2; the swap 2
    assert torch.equal(ctrl3.get_ref(1, Ref(2), S0), per_rank(0))
    assert torch.equal(ctrl3.get_ref(2, Ref(2), S0), per_rank(1))
    assert torch.equal(ctrl3.get_ref(2, Ref(4), S0), per_rank(0))
    assert torch.equal(ctrl3.get_ref(0, Ref(5), S0), per_rank(1))
    assert torch.equal(ctrl3.get_ref(1, Ref(5), S0), per_rank(0))


# ------------------------------------------------------------------ the rank's device


@pytest.mark.parametrize("declared", ["cuda", "cuda:0", "cuda:3"])
def test_what_the_worker_makes_for_a_cuda_factory_lands_on_the_ranks_gpu(declared):
    """A worker that sees every GPU runs its rank on cuda:3; the client's handle says cuda:0."""
    with FakeTensorMode():
        device = CudaDevice(torch.device("cuda", 3))
        for made in (
            device.zeros(factory(device=declared)),
            device.empty(factory(device=declared)),
        ):
            assert made.device == torch.device("cuda", 3)
            assert made.shape == (3,) and made.dtype == torch.float32
        assert device.zeros(factory()).device == torch.device("cpu")  # a CPU tensor stays
    assert HostDevice().zeros(factory(device=declared)).device == torch.device("cpu")


def test_a_failed_input_and_a_receive_buffer_are_made_on_the_ranks_own_device(client2):
    """Raw messages whose factory names cuda:0 on CPU ranks: the zeros a failed input takes
    part with and the buffer a receive lands in are made on the rank's device, not cuda:0."""
    ctrl = dm.Controller(client2, world_size=2)
    try:
        setup(ctrl, BOTH)
        ctrl.send(BOTH, call(1, Ref(2), "helpers.remote_fns.boom", 1))
        ctrl.send(BOTH, all_reduce(Ref(3), Ref(2), device="cuda:0"))
        ctrl.send(
            BOTH, m.SendTensor(Ref(4), one(0), one(1), Ref(2), factory(device="cuda:0"), S0, S0)
        )
        ctrl.send(
            BOTH, m.SendTensor(Ref(5), one(1), one(0), Ref(1), factory(device="cuda:0"), S0, S0)
        )
        ctrl.sync(timeout=60)
        assert torch.equal(ctrl.get_ref(0, Ref(3), S0), torch.zeros(3))
        assert torch.equal(ctrl.get_ref(1, Ref(4), S0), torch.zeros(3))
        assert torch.equal(ctrl.get_ref(0, Ref(5), S0), per_rank(1))
    finally:
        ctrl.close()


# ------------------------------------------------------------------ threads that touch the device


@pytest.fixture(scope="module")
def counting_client(throwaway_cluster):
    """A plain (daemonic) Dask worker, whose pipes run their producers in threads, whose rank
    threads enter helpers.remote_fns.CountOps (the switch TORCH_CUDA_SANITIZER uses for torch's
    sanitizer); no segment runs on the event loop."""
    settings = {
        "dask_monarch.worker.dispatch-mode": "helpers.remote_fns.CountOps",
        "dask_monarch.worker.inline-segments": False,
        # Dask's default, said again: the process-wide value may have been left at False by
        # the rank nannies of other clusters, which set it around their starts
        "distributed.worker.daemon": True,
    }
    with throwaway_cluster(1, config=settings, plain=True) as (_, client):  # the workers
        yield client  # take the config they are started with


def _pipe(ctrl, fn, *args):
    ctrl.send(0, m.CreateDeviceMesh(MESH, ["dp"], Slice.row_major([1])))
    ctrl.send(0, m.CreatePipe(PIPE, "loader", fn, 1, MESH, ArgsKwargs.from_python(args, {})))


PIPE = Ref(901)


def test_the_dispatch_mode_switch_reaches_every_thread_that_runs_rank_work(counting_client):
    """Both lanes, a pipe's producer thread and an actor's constructor see their ops."""
    from helpers import remote_fns

    ctrl = dm.Controller(counting_client, world_size=1)
    try:
        create_streams(ctrl, [0], S0, S1)
        for seq, stream in enumerate((S0, S1)):
            ctrl.send(0, call(seq, Ref(10 + seq), "torch.ones", 4, stream=stream))
            add = call(2 + seq, Ref(20 + seq), "torch.add", Ref(10 + seq), 1, stream=stream)
            ctrl.send(0, add)
        _pipe(ctrl, "helpers.remote_fns.loader", 2)
        ctrl.send(0, m.PipeRecv(4, [Ref(30), Ref(31)], PIPE, S0))
        ctrl.spawn_actor(0, "zeros", remote_fns.ZerosActor)
        ctrl.send(0, fetch(5, (), fn="helpers.remote_fns.ops_seen"))
        seen = values(ctrl.sync(timeout=60))[(5, 0)]
        for stream in (S0, S1):
            lane = ctrl._compiler.executor(stream.id)
            assert any(name.startswith(lane) and n >= 2 for name, n in seen.items()), seen
        assert any(name.startswith("monarch-pipe-loader") for name in seen), seen
        assert any(name.startswith("monarch-actor") for name in seen), seen
    finally:
        ctrl.close()


def _handoffs(log, producer, consumer):
    recorded = {e[2] for e in log if e[0] == "record" and e[1] == producer}
    return {e[2] for e in log if e[0] == "wait" and e[1] == consumer and e[2] in recorded}


def test_a_producer_thread_and_an_actor_run_on_the_ranks_device_and_hand_off(counting_client):
    """The producer thread enters the rank's device and a stream of its own; a value a lane
    sends it and a value it sends back are hand-offs (an event each way, the block kept); an
    actor is built in a stream of its own, finished before a lane uses it."""
    from helpers import remote_fns

    ctrl = dm.Controller(counting_client, world_size=1)
    try:
        create_streams(ctrl, [0], S0)
        _pipe(ctrl, "helpers.remote_fns.echo_loader")
        ctrl.send(0, call(0, Ref(1), "torch.ones", 2))
        ctrl.send(0, m.SendValue(1, PIPE, [], None, ArgsKwargs.from_python((Ref(1),), {}), S0))
        ctrl.send(0, m.PipeRecv(2, [Ref(2), Ref(3), Ref(4)], PIPE, S0))
        ctrl.spawn_actor(0, "zeros", remote_fns.ZerosActor)
        ctrl.send(0, fetch(3, (Ref(2),)))
        ctrl.send(0, fetch(4, (), fn="helpers.remote_fns.device_log"))
        got = values(ctrl.sync(timeout=60))
        assert torch.equal(got[(3, 0)], torch.full((2,), 2.0))
        log = got[(4, 0)]
        assert ("stream", "pipe producer") in log and ("enter", "pipe producer") in log
        assert len(_handoffs(log, "0", "pipe producer")) == 1  # the lane's value, to the producer
        assert len(_handoffs(log, "pipe producer", "0")) == 1  # the producer's, to the lane
        assert ("keep", "pipe producer") in log and ("keep", "0") in log
        assert ("enter", "actor") in log and ("synchronize", "actor") in log
    finally:
        ctrl.close()
