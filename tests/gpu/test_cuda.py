"""CUDA ranks: streams, hand-offs, collectives, recordings, fetches and memory, on real GPUs.

Run with ``python -m pytest -m gpu`` (README, "Testing"). On one GPU every test runs
except the multi-GPU NCCL ones; two ranks that share the GPU use ``backend: gloo``
(staged through host memory). tests/gpu/test_nccl.py has the clusters of its own: a
worker that sees every GPU, and NCCL failures.
"""

from __future__ import annotations

import os

import dask
import pytest
import torch
from helpers.gpus import GPUS, all_reduce, cuda_factory, needs_gpus
from helpers.raw import S0, S1, S2, call, create_streams, fetch, values
from helpers.workers import inlined_segments
from torch import nn

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Ref
from dask_monarch.ndslice import Slice

MESH = Ref(100)
MiB = 1 << 20


@pytest.fixture(scope="module")
def gpu_client(throwaway_cluster):
    """One rank worker per GPU (rotated CUDA_VISIBLE_DEVICES), as users start them."""
    with throwaway_cluster(GPUS, device="cuda") as (_, client):
        yield client


@pytest.fixture(scope="module")
def shared_client(throwaway_cluster):
    """Two workers that see only the first GPU: their CUDA ranks share it."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    options = {"env": {"CUDA_VISIBLE_DEVICES": first, "OMP_NUM_THREADS": "1"}}
    with throwaway_cluster(2, worker_options=options) as (_, client):
        yield client


def cuda_ctrl(client, world_size=1):
    return dm.Controller(client, world_size=world_size, device="cuda")


def test_ranks_use_cuda_and_their_own_gpu(gpu_client):
    with cuda_ctrl(gpu_client, GPUS) as ctrl:
        assert all(d.startswith("cuda") for d in ctrl.devices)
        create_streams(ctrl, list(range(GPUS)), S0)
        ctrl.send(list(range(GPUS)), fetch(0, (), fn="helpers.remote_fns.gpu_uuid"))
        uuids = values(ctrl.sync(timeout=120))
        assert len(set(uuids.values())) == GPUS


def test_borrows_across_streams_and_flushes(gpu_client):
    with cuda_ctrl(gpu_client) as ctrl:
        create_streams(ctrl, [0], S0, S1, S2)
        ctrl.send(0, call(0, Ref(1), "torch.ones", 64 * MiB // 4, device="cuda"))
        ctrl.send(0, m.BorrowCreate(Ref(2), 1, Ref(1), S0, S1))
        ctrl.flush()
        ctrl.send(0, m.BorrowFirstUse(1))
        ctrl.send(
            0, call(1, None, "torch.ops.aten.mul_.Scalar", Ref(2), 2, mutates=[Ref(2)], stream=S1)
        )
        ctrl.flush()
        ctrl.send(0, m.BorrowLastUse(1))
        ctrl.send(0, m.BorrowDrop(1))
        ctrl.send(0, m.BorrowCreate(Ref(3), 2, Ref(1), S0, S2))
        ctrl.send(0, m.BorrowFirstUse(2))
        ctrl.send(0, call(2, Ref(4), "torch.ops.aten.sum.default", Ref(3), stream=S2))
        ctrl.send(0, m.BorrowLastUse(2))
        ctrl.send(0, m.BorrowDrop(2))
        ctrl.send(0, fetch(3, Ref(4), stream=S2))
        got = values(ctrl.sync(timeout=120))
        assert got[(3, 0)].item() == 2 * (64 * MiB // 4)
        assert got[(3, 0)].device.type == "cpu"  # fetched values come back on the CPU


def test_first_segment_runs_on_a_new_cuda_stream(gpu_client):
    with cuda_ctrl(gpu_client) as ctrl:
        ctrl.send(0, m.CreateStream(S1, m.StreamCreationMode.CreateNewStream))
        ctrl.send(
            0, call(0, Ref(1), "helpers.remote_fns.current_cuda_stream_is_default", stream=S1)
        )
        ctrl.send(0, fetch(1, Ref(1), stream=S1))
        assert values(ctrl.sync(timeout=120)) == {(1, 0): False}


def test_same_rank_send_between_streams(gpu_client):
    with cuda_ctrl(gpu_client) as ctrl:
        create_streams(ctrl, [0], S0, S1)
        ctrl.send(0, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([1])))
        ctrl.send(0, call(0, Ref(1), "torch.full", (MiB,), 3.0, device="cuda"))
        r0 = Slice(0, [1], [1])
        ctrl.send(0, m.SendTensor(Ref(2), r0, r0, Ref(1), cuda_factory((MiB,)), S0, S1))
        ctrl.send(0, call(1, None, "torch.ops.aten.zero_.default", Ref(1), mutates=[Ref(1)]))
        ctrl.send(0, fetch(2, (Ref(2),), fn="torch.ops.aten.sum.default", stream=S1))
        assert values(ctrl.sync(timeout=120))[(2, 0)].item() == 3.0 * MiB


def test_user_api_reduce_on_a_comms_stream_recordings_and_compile(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=1)
    try:
        comms = dm.Stream("comms")
        with mesh.activate():
            x = torch.ones(1024, device="cuda")
            y, borrow = comms.borrow(x)
            with comms.activate():
                z = y.reduce("gpu", "sum")
                total = z.sum()
            borrow.drop()

            @dm.compile
            def step(a):
                return (a * 2 + 1).sum()

            first, second = step(x), step(x)
            assert dm.inspect(total).item() == 1024
            assert dm.inspect(first).item() == dm.inspect(second).item() == 3 * 1024
            # past recordings.generate-after the rank replays it as generated code
            later = [step(x) for _ in range((dm.config.get("recordings.generate-after") or 0) + 2)]
            assert {dm.inspect(s).item() for s in later} == {3 * 1024}
            assert str(dm.inspect(x).device) == "cpu"
    finally:
        mesh.exit()


def test_memory_returns_to_its_baseline_after_deletes(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=1)
    try:
        with mesh.activate():
            before = dm.inspect(
                dm.remote("helpers.remote_fns.cuda_allocated", propagate="inspect")()
            )
            tensors = [torch.ones(16 * MiB // 4, device="cuda") for _ in range(8)]
            during = dm.inspect(
                dm.remote("helpers.remote_fns.cuda_allocated", propagate="inspect")()
            )
            del tensors
            after = dm.inspect(
                dm.remote("helpers.remote_fns.cuda_allocated", propagate="inspect")()
            )
        assert during - before >= 8 * 16 * MiB
        assert after <= before + MiB
    finally:
        mesh.exit()


def test_random_state_includes_the_cuda_generator(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=1)
    try:
        with mesh.activate():
            dm.random.manual_seed(3)
            a = torch.rand(4, device="cuda")
            state = dm.random.get_state()
            b = torch.rand(4, device="cuda")
            dm.random.set_state(state)
            c = torch.rand(4, device="cuda")
            got_a, got_b, got_c = dm.inspect((a, b, c))
            flag = dm.inspect(state)[torch.get_rng_state().numel()]
        assert flag == 1 and torch.equal(got_b, got_c) and not torch.equal(got_a, got_b)
    finally:
        mesh.exit()


def test_one_rank_nccl_mesh_and_bitwise_reductions_are_refused(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=1)
    try:
        with mesh.activate():
            x = torch.ones(8, device="cuda", dtype=torch.int32)
            assert dm.inspect(x.reduce("gpu", "sum")).tolist() == [1] * 8
            with pytest.raises(ValueError, match="not supported by NCCL"):
                x.reduce("gpu", "bor")
    finally:
        mesh.exit()


def test_two_ranks_sharing_a_gpu_need_gloo(shared_client):
    with pytest.raises(ValueError, match="same GPU"):
        cuda_ctrl(shared_client, 2)
    with dask.config.set({"dask_monarch.backend": "gloo"}), cuda_ctrl(shared_client, 2) as ctrl:
        ranks = [0, 1]
        create_streams(ctrl, ranks, S0)
        ctrl.send(ranks, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2])))
        ctrl.send(ranks, m.BackendNetworkInit())
        ctrl.send(ranks, m.SplitComm(["gpu"], MESH, S0))
        ctrl.send(ranks, m.BackendNetworkPointToPointInit(S0, S0))
        ctrl.send(ranks, call(0, Ref(1), "torch.ones", 4, device="cuda"))
        ctrl.send(ranks, all_reduce(Ref(2), Ref(1), (4,), MESH, S0))
        ctrl.send(
            ranks,
            m.SendTensor(
                Ref(3), Slice(0, [1], [1]), Slice(1, [1], [1]), Ref(2), cuda_factory((4,)), S0, S0
            ),
        )
        ctrl.send(1, fetch(1, Ref(3)))
        assert values(ctrl.sync(timeout=120))[(1, 1)].tolist() == [2.0] * 4


@needs_gpus(2)
def test_nccl_collectives_and_a_pairwise_exchange_of_64_mib(gpu_client):
    with cuda_ctrl(gpu_client, 2) as ctrl:
        ranks = [0, 1]
        create_streams(ctrl, ranks, S0)
        ctrl.send(ranks, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2])))
        ctrl.send(ranks, m.BackendNetworkInit())
        ctrl.send(ranks, m.SplitComm(["gpu"], MESH, S0))
        ctrl.send(ranks, m.BackendNetworkPointToPointInit(S0, S0))
        n = 64 * MiB // 4
        ctrl.send(ranks, call(0, Ref(1), "helpers.remote_fns.per_rank", MESH, n, device="cuda"))
        ctrl.send(ranks, all_reduce(Ref(2), Ref(1), (n,), MESH, S0))
        one, two = Slice(0, [1], [1]), Slice(1, [1], [1])
        ctrl.send(ranks, m.SendTensor(Ref(3), one, two, Ref(1), cuda_factory((n,)), S0, S0))
        ctrl.send(ranks, m.SendTensor(Ref(3), two, one, Ref(1), cuda_factory((n,)), S0, S0))
        for rank in ranks:
            ctrl.send(rank, fetch(1, (Ref(3),), fn="torch.ops.aten.sum.default"))
            ctrl.send(rank, fetch(2, (Ref(2),), fn="torch.ops.aten.sum.default"))
        got = values(ctrl.sync(timeout=300))
        base = torch.arange(n, dtype=torch.float64).sum().item()
        assert got[(1, 0)].item() == pytest.approx(base + 20 * n, rel=1e-4)  # rank 1's tensor
        assert got[(1, 1)].item() == pytest.approx(base + 10 * n, rel=1e-4)
        assert got[(2, 0)].item() == pytest.approx(2 * base + 30 * n, rel=1e-4)


@needs_gpus(3)
def test_a_rank_that_sends_and_receives_in_one_message_does_not_deadlock(gpu_client):
    """0 -> 1 and 1 -> 2 in one SendTensor: rank 1 both sends and receives (one grouped call)."""
    with cuda_ctrl(gpu_client, 3) as ctrl:
        ranks = [0, 1, 2]
        create_streams(ctrl, ranks, S0)
        ctrl.send(ranks, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([3])))
        ctrl.send(ranks, m.BackendNetworkInit())
        ctrl.send(ranks, m.BackendNetworkPointToPointInit(S0, S0))
        n = 64 * MiB // 4
        ctrl.send(ranks, call(0, Ref(1), "helpers.remote_fns.per_rank", MESH, n, device="cuda"))
        ctrl.send(
            ranks,
            m.SendTensor(
                Ref(2), Slice(0, [2], [1]), Slice(1, [2], [1]), Ref(1), cuda_factory((n,)), S0, S0
            ),
        )
        for rank in (1, 2):
            ctrl.send(rank, fetch(1, (Ref(2),), fn="torch.ops.aten.amin.default"))
        got = values(ctrl.sync(timeout=300))
        assert got[(1, 1)].item() == 10 and got[(1, 2)].item() == 20


def test_cuda_ranks_run_every_segment_on_its_lane(gpu_client):
    """A fetch from a CUDA rank waits for its stream: never on the event loop (worker/inline.py)."""
    mesh = dm.device_mesh(gpu_client, gpu=1)
    try:
        with mesh.activate():
            x = torch.zeros((), device="cuda")
            for _ in range(3):
                x = x + 1
                dm.inspect(x)
            assert dm.inspect(x).item() == 3
        assert inlined_segments(gpu_client, mesh) == 0
    finally:
        mesh.exit()


# ------------------------------------------------------------------ NCCL on 2+ GPUs (issue 36)


def _on_each(mesh, t):
    return [dm.inspect(t, gpu=r) for r in range(mesh.sizes["gpu"])]


@needs_gpus(2)
def test_nccl_all_gather_reduce_scatter_and_all_to_all_over_two_ranks(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=2)
    try:
        with mesh.activate():
            rank = mesh.rank("gpu").float().to("cuda")
            x = torch.arange(4.0, device="cuda") + 10 * rank
            pairs = torch.arange(4.0, device="cuda").reshape(2, 2) + 10 * rank
            total = x.reduce("gpu", "sum")
            gathered = x.reduce("gpu", "stack")
            scattered = pairs.reduce("gpu", "sum", scatter=True)
            exchanged = pairs.reduce("gpu", "stack", scatter=True)
            got = [_on_each(mesh, t) for t in (total, gathered, scattered, exchanged)]
        xs = [torch.arange(4.0) + 10 * r for r in range(2)]
        ps = [torch.arange(4.0).reshape(2, 2) + 10 * r for r in range(2)]
        for r in range(2):
            assert torch.equal(got[0][r], xs[0] + xs[1])  # a reduce over 2 real ranks
            assert torch.equal(got[1][r], torch.stack(xs))
            assert torch.equal(got[2][r], (ps[0] + ps[1])[r])
            assert torch.equal(got[3][r], torch.stack([ps[0][r], ps[1][r]]))
    finally:
        mesh.exit()


@needs_gpus(2)
def test_a_reduce_with_a_failed_input_completes_on_every_gpu(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=2)
    try:
        with mesh.activate():
            x = torch.ones(8, device="cuda")
            bad = _fails_on_rank_one(x, mesh.rank("gpu"))
            total = bad.reduce("gpu", "sum")
            fine = x.reduce("gpu", "sum")  # the collective after it still runs
            assert [t.tolist() for t in _on_each(mesh, fine)] == [[2.0] * 8] * 2
            with pytest.raises(dm.RemoteException, match="rank one refuses"):
                dm.inspect(total)
    finally:
        mesh.exit()


@dm.remote(propagate=lambda x, r: x.clone())
def _fails_on_rank_one(x, rank):
    if int(rank) == 1:
        raise RuntimeError("rank one refuses")
    return x.clone()


def _p2p_setup(ctrl, ranks, *pairs):
    create_streams(ctrl, ranks, S0, S1)
    ctrl.send(ranks, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([len(ranks)])))
    ctrl.send(ranks, m.BackendNetworkInit())
    for src, dst in pairs:
        ctrl.send(ranks, m.BackendNetworkPointToPointInit(src, dst))


@needs_gpus(2)
def test_sends_between_streams_and_a_swap_on_nccl(gpu_client):
    with cuda_ctrl(gpu_client, 2) as ctrl:
        ranks = [0, 1]
        _p2p_setup(ctrl, ranks, (S0, S0), (S0, S1))
        n = 4 * MiB // 4
        f = cuda_factory((n,))
        one, two = Slice(0, [1], [1]), Slice(1, [1], [1])
        ctrl.send(ranks, call(0, Ref(1), "helpers.remote_fns.per_rank", MESH, n, device="cuda"))
        ctrl.send(ranks, m.SendTensor(Ref(2), one, two, Ref(1), f, S0, S1))  # 0 -> 1, 2 streams
        ctrl.send(ranks, m.SendTensor(Ref(3), one, two, Ref(1), f, S0, S0))  # a swap: two sends
        ctrl.send(ranks, m.SendTensor(Ref(3), two, one, Ref(1), f, S0, S0))  # of one result
        ctrl.send(1, fetch(1, (Ref(2),), fn="torch.ops.aten.amin.default", stream=S1))
        for rank in ranks:
            ctrl.send(rank, fetch(2, (Ref(3),), fn="torch.ops.aten.amin.default"))
        got = values(ctrl.sync(timeout=300))
        assert got[(1, 1)].item() == 10 and got[(2, 0)].item() == 20 and got[(2, 1)].item() == 10


@needs_gpus(3)
def test_a_shift_and_a_chain_of_sends_on_three_gpus(gpu_client):
    """A shift (0 -> 1 and 1 -> 2 in one message: rank 1 sends and receives in one grouped
    call) and a chain (0 -> 1, then 1 -> 2 of what arrived): both hung when a rank that only
    sends used a two-rank communicator and one that both sends and receives the group's."""
    with cuda_ctrl(gpu_client, 3) as ctrl:
        ranks = [0, 1, 2]
        _p2p_setup(ctrl, ranks, (S0, S0))
        n = 16 * MiB // 4
        f = cuda_factory((n,))
        one, two, three = (Slice(r, [1], [1]) for r in ranks)
        ctrl.send(ranks, call(0, Ref(1), "helpers.remote_fns.per_rank", MESH, n, device="cuda"))
        shift = m.SendTensor(Ref(2), Slice(0, [2], [1]), Slice(1, [2], [1]), Ref(1), f, S0, S0)
        ctrl.send(ranks, shift)
        ctrl.send([0, 1], m.SendTensor(Ref(3), one, two, Ref(1), f, S0, S0))
        ctrl.send([1, 2], m.SendTensor(Ref(4), two, three, Ref(3), f, S0, S0))
        for rank in (1, 2):
            ctrl.send(rank, fetch(1, (Ref(2),), fn="torch.ops.aten.amin.default"))
        ctrl.send(2, fetch(2, (Ref(4),), fn="torch.ops.aten.amin.default"))
        got = values(ctrl.sync(timeout=300))
        assert got[(1, 1)].item() == 10 and got[(1, 2)].item() == 20 and got[(2, 2)].item() == 10


@needs_gpus(2)
def test_a_pipeline_stage_hands_off_to_the_next_and_back(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=2)
    try:
        stage0, stage1 = mesh.slice(gpu=0), mesh.slice(gpu=1)
        with stage0.activate():
            activations = torch.arange(4.0, device="cuda") + 1
        moved = activations.to_mesh(stage1)
        with stage1.activate():
            out = moved * 2
            assert dm.inspect(out).tolist() == [2.0, 4.0, 6.0, 8.0]
        back = out.to_mesh(stage0)  # the other way, on the same stream
        with stage0.activate():
            assert dm.inspect(back + activations).tolist() == [3.0, 6.0, 9.0, 12.0]
            where = dm.remote("helpers.remote_fns.device_of", propagate="inspect")
            assert dm.inspect(where(back)) == "cuda:0"  # each rank's own GPU
    finally:
        mesh.exit()


def test_a_recording_replay_with_borrows(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=1)
    comms = dm.Stream("replayed_borrows")
    try:
        with mesh.activate():
            x = torch.ones(1024, device="cuda")

            @dm.compile
            def step(a):
                lent, borrow = comms.borrow(a, mutable=True)
                with comms.activate():
                    lent.mul_(2)
                borrow.drop()
                return a.sum()

            sums = [step(x) for _ in range((dm.config.get("recordings.generate-after") or 0) + 3)]
            got = [dm.inspect(s).item() for s in sums]
        assert got == [1024.0 * 2 ** (i + 1) for i in range(len(sums))]
    finally:
        mesh.exit()


def test_pipes_made_on_the_gpu_and_fed_from_a_lane(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=1)
    try:
        with mesh.activate():
            pipe = dm.create_pipe("helpers.remote_fns.cuda_loader", 3, max_messages=1)
            batches = [pipe.recv() for _ in range(3)]
            assert [dm.inspect(b).tolist() for b in batches] == [[float(i)] * 4 for i in range(3)]
            where = dm.remote("helpers.remote_fns.device_of", propagate="inspect")
            assert dm.inspect(where(batches[0])) == "cuda:0"
            echo = dm.create_pipe(
                "helpers.remote_fns.cuda_echo_loader",
                max_messages=1,
                propagate=lambda: (torch.empty(4, device="cuda"), ""),
            )
            echo.send(torch.arange(4.0, device="cuda") * 3)  # a lane's value into the pipe
            doubled, _ = echo.recv()
            assert dm.inspect(doubled).tolist() == [0.0, 6.0, 12.0, 18.0]
    finally:
        mesh.exit()


@needs_gpus(2)
def test_a_ddp_hooks_training_step_equals_the_local_one(gpu_client):
    mesh = dm.device_mesh(gpu_client, gpu=2)
    try:
        with mesh.activate():
            dm.random.manual_seed(0)
            model = nn.Linear(6, 1, device="cuda")
            start = [dm.inspect(p.detach(), gpu=0) for p in model.parameters()]
            x = torch.randn(4, 6, device="cuda") * (mesh.rank("gpu").float().to("cuda") + 1)
            with dm.ddp_hooks(model, "gpu"):
                (model(x) ** 2).mean().backward()  # the averages are given back at its end
                grads = [_on_each(mesh, p.grad) for p in model.parameters()]
            inputs = _on_each(mesh, x)
        local = nn.Linear(6, 1)
        with torch.no_grad():
            for p, w in zip(local.parameters(), start):
                p.copy_(w)
        expected = [torch.zeros_like(p) for p in local.parameters()]
        for data in inputs:
            local.zero_grad()
            (local(data) ** 2).mean().backward()
            for e, p in zip(expected, local.parameters()):
                e += p.grad / len(inputs)
        for (g0, g1), e in zip(grads, expected):
            assert torch.equal(g0, g1) and torch.allclose(g0, e, atol=1e-5)
    finally:
        mesh.exit()


def test_checkpoints_of_cuda_tensors_staged_on_their_own_stream(gpu_client, tmp_path):
    mesh = dm.device_mesh(gpu_client, gpu=1)
    try:
        with mesh.activate():
            x = torch.rand(1 << 20, device="cuda")
            first = dm.inspect(x[:4])
        future = dm.checkpoint.save({"x": x}, tmp_path, asynchronous=True)
        with mesh.activate():
            x.mul_(2)  # after the copy to host memory, while it is written
        future.result()
        with mesh.activate():
            y = torch.zeros(1 << 20, device="cuda")
        dm.checkpoint.load({"x": y}, tmp_path)
        with mesh.activate():
            assert y.device.type == "cuda" and torch.equal(dm.inspect(y[:4]), first)
            assert torch.equal(dm.inspect(x[:4]), first * 2)
    finally:
        mesh.exit()


def test_cuda_on_a_mesh_of_cpu_ranks_names_them(throwaway_cluster):
    """A client with a GPU, ranks without: refused on the client, naming the ranks."""
    options = {"env": {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}}
    with throwaway_cluster(2, worker_options=options) as (_, client):
        mesh = dm.device_mesh(client, gpu=2)
        try:
            with mesh.activate():
                for make in (lambda: torch.ones(2, device="cuda"), lambda: torch.ones(2).cuda()):
                    with pytest.raises(RuntimeError, match="ranks 0, 1 have no GPU") as info:
                        make()
                    assert "device='cpu'" in str(info.value)
                assert dm.inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]
        finally:
            mesh.exit()


def test_gpu_tensors_deep_in_a_fetched_value_come_back_on_the_cpu(gpu_client):
    """Inside a custom object (pickle's way) and one holding a lambda (cloudpickle's): the
    client gets CPU tensors, as for tensors in lists and dicts."""
    with cuda_ctrl(gpu_client) as ctrl:
        create_streams(ctrl, [0], S0)
        ctrl.send([0], fetch(0, ("cuda",), fn="helpers.remote_fns.holders"))
        plain, cloud = values(ctrl.sync(timeout=120))[(0, 0)]
    assert plain.t.device.type == "cpu" and plain.t.tolist() == [0.0, 1.0, 2.0]
    assert cloud.t.device.type == "cpu" and cloud.t.tolist() == [1.0, 1.0] and cloud.f() == 1


@dm.remote(propagate=lambda x: x.sum().cpu())
def _total_on_the_host(x):
    return x.sum().cpu()


@dm.remote(propagate=lambda x: x.sum())
def _total_said_on_the_gpu(x):
    return x.sum().cpu()  # its propagation said the GPU


def test_a_remote_function_may_return_a_cpu_tensor_its_propagation_declared(gpu_client):
    """Results are checked against the device their propagation declared: a CPU tensor is
    fine on a GPU rank where it said CPU, and refused where it said the GPU."""
    mesh = dm.device_mesh(gpu_client, gpu=1)
    try:
        with mesh.activate():
            x = torch.ones(8, device="cuda")
            total = _total_on_the_host(x)
            assert total.device.type == "cpu" and dm.inspect(total).item() == 8
            with pytest.raises(dm.RemoteException, match="ResultMismatch"):
                dm.inspect(_total_said_on_the_gpu(x))
    finally:
        mesh.exit()
