"""Reduce, SendTensor and process groups over torch.distributed (gloo on CPU)."""

from __future__ import annotations

import dask
import pytest
import torch
from helpers.raw import S0, S1, call, create_streams, failures, fetch, values

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Factory, ReduceOp, Ref
from dask_monarch.ndslice import Slice

# also run with dask_monarch.comm.emulate-nccl (tests/conftest.py)
pytestmark = pytest.mark.nccl_rules

MESH = Ref(900)


def expected_input(rank, shape, dtype=torch.float32):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n) + 10 * (rank + 1)).to(dtype).reshape(shape)


def setup_mesh(ctrl, sizes, names, streams=(S0,), split=(), mesh=MESH, ranks=None):
    world = list(range(ctrl.world_size))
    create_streams(ctrl, world, *streams)
    ranks = ranks or Slice.row_major(sizes)
    ctrl.send(list(ranks), m.CreateDeviceMesh(mesh, list(names), ranks))
    ctrl.send(world, m.BackendNetworkInit())
    for stream in streams:
        for dims in split:
            ctrl.send(world, m.SplitComm(list(dims), mesh, stream))


def make_inputs(ctrl, ranks, ref, shape, dtype=torch.float32, stream=S0, mesh=MESH):
    ctrl.send(
        ranks, call(0, ref, "helpers.remote_fns.per_rank", mesh, *shape, dtype=dtype, stream=stream)
    )


def reduce_msg(
    result,
    tensor,
    shape,
    dims,
    reduction,
    *,
    scatter=False,
    in_place=False,
    out=None,
    dtype=torch.float32,
    stream=S0,
    mesh=MESH,
):
    factory = Factory(tuple(shape), dtype, torch.strided, "cpu")
    return m.Reduce(
        result, tensor, factory, mesh, stream, list(dims), reduction, scatter, in_place, out
    )


def fetch_all(ctrl, ranks, refs, stream=S0):
    for i, ref in enumerate(refs):
        ctrl.send(ranks, fetch(1000 + i, ref, stream=stream))
    got = values(ctrl.sync(timeout=120))
    return {(ref, rank): got[(1000 + i, rank)] for i, ref in enumerate(refs) for rank in ranks}


ALL_REDUCE = [
    (ReduceOp.SUM, lambda xs: sum(xs)),
    (ReduceOp.AVG, lambda xs: sum(xs) / len(xs)),
    (ReduceOp.MIN, lambda xs: torch.stack(xs).min(0).values),
    (ReduceOp.MAX, lambda xs: torch.stack(xs).max(0).values),
    (ReduceOp.PRODUCT, lambda xs: torch.stack(xs).prod(0)),
]


@pytest.mark.exercises("CreateDeviceMesh", "BackendNetworkInit", "SplitComm", "Reduce")
def test_every_all_reduce_op_on_two_ranks(ctrl):
    setup_mesh(ctrl, [2], ["gpu"], split=[("gpu",)])
    make_inputs(ctrl, [0, 1], Ref(1), (3,))
    for i, (op, _) in enumerate(ALL_REDUCE):
        ctrl.send([0, 1], reduce_msg(Ref(10 + i), Ref(1), (3,), ["gpu"], op))
    got = fetch_all(ctrl, [0, 1], [Ref(10 + i) for i in range(len(ALL_REDUCE))])
    xs = [expected_input(r, (3,)) for r in (0, 1)]
    for i, (_, local) in enumerate(ALL_REDUCE):
        for rank in (0, 1):
            assert torch.allclose(got[(Ref(10 + i), rank)], local(xs)), ALL_REDUCE[i][0]


def test_bitwise_reductions_on_integers(ctrl):
    setup_mesh(ctrl, [2], ["gpu"], split=[("gpu",)])
    make_inputs(ctrl, [0, 1], Ref(1), (4,), dtype=torch.int64)
    ops = [
        (ReduceOp.BAND, torch.bitwise_and),
        (ReduceOp.BOR, torch.bitwise_or),
        (ReduceOp.BXOR, torch.bitwise_xor),
    ]
    for i, (op, _) in enumerate(ops):
        ctrl.send([0, 1], reduce_msg(Ref(10 + i), Ref(1), (4,), ["gpu"], op, dtype=torch.int64))
    got = fetch_all(ctrl, [0, 1], [Ref(10 + i) for i in range(3)])
    a, b = (expected_input(r, (4,), torch.int64) for r in (0, 1))
    for i, (_, local) in enumerate(ops):
        assert torch.equal(got[(Ref(10 + i), 1)], local(a, b))


def test_stack_scatter_in_place_and_out(ctrl):
    setup_mesh(ctrl, [2], ["gpu"], split=[("gpu",)])
    make_inputs(ctrl, [0, 1], Ref(1), (2, 3))
    shape = (2, 3)
    ctrl.send([0, 1], reduce_msg(Ref(10), Ref(1), shape, ["gpu"], "stack"))  # all-gather
    ctrl.send([0, 1], reduce_msg(Ref(11), Ref(1), shape, ["gpu"], ReduceOp.SUM, scatter=True))
    ctrl.send([0, 1], reduce_msg(Ref(12), Ref(1), shape, ["gpu"], "stack", scatter=True))
    ctrl.send([0, 1], call(1, Ref(2), "torch.zeros", 2, 3))
    ctrl.send([0, 1], reduce_msg(Ref(13), Ref(1), shape, ["gpu"], ReduceOp.MAX, out=Ref(2)))
    ctrl.send([0, 1], call(2, Ref(3), "torch.ops.aten.clone.default", Ref(1)))
    ctrl.send([0, 1], reduce_msg(Ref(14), Ref(3), shape, ["gpu"], ReduceOp.SUM, in_place=True))
    got = fetch_all(ctrl, [0, 1], [Ref(10), Ref(11), Ref(12), Ref(2), Ref(3), Ref(14)])
    a, b = expected_input(0, shape), expected_input(1, shape)
    for rank in (0, 1):
        assert torch.equal(got[(Ref(10), rank)], torch.stack([a, b]))
        assert torch.equal(got[(Ref(11), rank)], (a + b)[rank])
        assert torch.equal(got[(Ref(12), rank)], torch.stack([a[rank], b[rank]]))
        assert torch.equal(got[(Ref(2), rank)], torch.maximum(a, b))  # out was written
        assert torch.equal(got[(Ref(3), rank)], a + b)  # in place
        assert torch.equal(got[(Ref(14), rank)], a + b)


def test_transposed_inputs_outputs_and_in_place_tensors(ctrl):
    """NCCL takes contiguous tensors only (gloo takes any): a transposed input, ``out`` or
    in-place tensor is reduced through a contiguous copy, and what it views gets the
    result."""
    setup_mesh(ctrl, [2], ["gpu"], split=[("gpu",)])
    make_inputs(ctrl, [0, 1], Ref(1), (2, 2))
    shape = (2, 2)
    seq = iter(range(1, 100))

    def transposed(ref, source):
        ctrl.send([0, 1], call(next(seq), ref, "torch.ops.aten.t.default", source))

    def copy(ref):
        ctrl.send([0, 1], call(next(seq), ref, "torch.ops.aten.clone.default", Ref(1)))

    transposed(Ref(2), Ref(1))
    ctrl.send([0, 1], reduce_msg(Ref(10), Ref(2), shape, ["gpu"], ReduceOp.SUM))
    ctrl.send([0, 1], call(next(seq), Ref(3), "torch.zeros", 2, 2))
    transposed(Ref(4), Ref(3))
    ctrl.send([0, 1], reduce_msg(Ref(11), Ref(2), shape, ["gpu"], ReduceOp.SUM, out=Ref(4)))
    copy(Ref(5))
    transposed(Ref(6), Ref(5))
    ctrl.send([0, 1], reduce_msg(Ref(12), Ref(6), shape, ["gpu"], ReduceOp.SUM, in_place=True))
    copy(Ref(7))
    transposed(Ref(8), Ref(7))
    ctrl.send(
        [0, 1], reduce_msg(Ref(13), Ref(8), shape, ["gpu"], "stack", scatter=True, in_place=True)
    )
    got = fetch_all(ctrl, [0, 1], [Ref(10), Ref(3), Ref(5), Ref(7)])
    a, b = expected_input(0, shape).T, expected_input(1, shape).T
    for rank in (0, 1):
        assert torch.equal(got[(Ref(10), rank)], a + b)
        assert torch.equal(got[(Ref(3), rank)], (a + b).T)  # written through the out view
        assert torch.equal(got[(Ref(5), rank)], (a + b).T)  # in place, through the view
        assert torch.equal(got[(Ref(7), rank)], torch.stack([a[rank], b[rank]]).T)


def test_errored_input_takes_part_with_zeros_and_reports_nothing(ctrl):
    setup_mesh(ctrl, [2], ["gpu"], split=[("gpu",)])
    make_inputs(ctrl, [0], Ref(1), (3,))
    ctrl.send(1, call(0, Ref(1), "helpers.remote_fns.boom", 1))  # rank 1's input fails
    ctrl.send([0, 1], reduce_msg(Ref(2), Ref(1), (3,), ["gpu"], ReduceOp.SUM))
    ctrl.send([0, 1], fetch(5, Ref(2)))
    reports = ctrl.sync(timeout=120)
    assert [(f.seq, f.rank) for f in failures(reports)] == [(0, 1)]
    got = values(reports)
    for rank in (0, 1):
        assert torch.equal(got[(5, rank)], expected_input(0, (3,)))


def test_collectives_on_two_streams_interleave_without_deadlock(ctrl):
    setup_mesh(ctrl, [2], ["gpu"], streams=(S0, S1), split=[("gpu",)])
    for stream in (S0, S1):
        make_inputs(ctrl, [0, 1], Ref(1), (2,), stream=stream)
    # rank 0 is slow on stream 0, rank 1 on stream 1: each rank reaches the two streams'
    # collectives in a different order; separate communicators keep them apart
    ctrl.send(0, call(1, Ref(5), "helpers.remote_fns.slow_copy", Ref(1), 0.3, stream=S0))
    ctrl.send(1, call(1, Ref(5), "helpers.remote_fns.slow_copy", Ref(1), 0.3, stream=S1))
    for i in range(10):
        for stream in (S0, S1):
            ctrl.send(
                [0, 1],
                reduce_msg(
                    Ref(100 + i),
                    Ref(1) if i == 0 else Ref(99 + i),
                    (2,),
                    ["gpu"],
                    ReduceOp.SUM,
                    stream=stream,
                ),
            )
    got = {}
    for stream in (S0, S1):
        got[stream] = fetch_all(ctrl, [0, 1], [Ref(109)], stream=stream)
    base = expected_input(0, (2,)) + expected_input(1, (2,))
    for stream in (S0, S1):
        for rank in (0, 1):
            assert torch.equal(got[stream][(Ref(109), rank)], base * 2**9)


@pytest.mark.exercises("BackendNetworkPointToPointInit", "SendTensor")
def test_send_tensor_between_ranks_and_copy_on_the_same_rank(ctrl):
    setup_mesh(ctrl, [2], ["gpu"])
    ctrl.send([0, 1], m.BackendNetworkPointToPointInit(S0, S0))
    make_inputs(ctrl, [0, 1], Ref(1), (3,))
    factory = Factory((3,), torch.float32, torch.strided, "cpu")
    r0, r1 = Slice(0, [1], [1]), Slice(1, [1], [1])
    ctrl.send([0, 1], m.SendTensor(Ref(2), r0, r1, Ref(1), factory, S0, S0))  # 0 -> 1
    ctrl.send([0], m.SendTensor(Ref(3), r0, r0, Ref(1), factory, S0, S0))  # 0 -> 0: a copy
    ctrl.send([0], call(1, None, "torch.ops.aten.add_.Scalar", Ref(1), 100, mutates=[Ref(1)]))
    swap = Slice.row_major([2])
    ctrl.send([0, 1], m.SendTensor(Ref(4), swap, Slice(0, [2], [1]), Ref(1), factory, S0, S0))
    got = values(ctrl.sync(timeout=120) + [])
    assert got == {}
    assert torch.equal(ctrl.get_ref(1, Ref(2), S0), expected_input(0, (3,)))
    assert torch.equal(ctrl.get_ref(0, Ref(3), S0), expected_input(0, (3,)))  # not +100
    assert torch.equal(ctrl.get_ref(0, Ref(1), S0), expected_input(0, (3,)) + 100)


def test_send_tensor_across_streams_on_one_rank(ctrl):
    setup_mesh(ctrl, [2], ["gpu"], streams=(S0, S1))
    make_inputs(ctrl, [0], Ref(1), (2,))
    factory = Factory((2,), torch.float32, torch.strided, "cpu")
    r0 = Slice(0, [1], [1])
    ctrl.send([0], m.SendTensor(Ref(2), r0, r0, Ref(1), factory, S0, S1))
    ctrl.sync()
    assert torch.equal(ctrl.get_ref(0, Ref(2), S1), expected_input(0, (2,)))


def test_send_tensor_of_an_errored_value_sends_zeros(ctrl):
    setup_mesh(ctrl, [2], ["gpu"])
    ctrl.send([0, 1], m.BackendNetworkPointToPointInit(S0, S0))
    ctrl.send(0, call(0, Ref(1), "helpers.remote_fns.boom", 1))
    factory = Factory((2,), torch.float32, torch.strided, "cpu")
    ctrl.send(
        [0, 1],
        m.SendTensor(Ref(2), Slice(0, [1], [1]), Slice(1, [1], [1]), Ref(1), factory, S0, S0),
    )
    assert len(failures(ctrl.sync())) == 1
    assert torch.equal(ctrl.get_ref(1, Ref(2), S0), torch.zeros(2))


def test_fatal_without_communicators(client2):
    for message, text in [
        (reduce_msg(Ref(2), Ref(1), (3,), ["gpu"], ReduceOp.SUM), "SplitComm was not sent"),
        (
            m.SendTensor(
                Ref(2),
                Slice(0, [1], [1]),
                Slice(1, [1], [1]),
                Ref(1),
                Factory((3,), torch.float32, torch.strided, "cpu"),
                S0,
                S0,
            ),
            "BackendNetworkPointToPointInit was not sent",
        ),
    ]:
        ctrl = dm.Controller(client2, world_size=2)
        setup_mesh(ctrl, [2], ["gpu"])
        make_inputs(ctrl, [0, 1], Ref(1), (3,))
        ctrl.send([0, 1], message)
        with pytest.raises(dm.DeviceException, match=text):
            ctrl.sync(timeout=60)
        ctrl.close()


# ------------------------------------------------------------------ 4 ranks: a 2x2 mesh


def test_sub_mesh_reductions_on_a_2x2_mesh(ctrl4):
    world = [0, 1, 2, 3]
    setup_mesh(ctrl4, [2, 2], ["host", "gpu"], split=[("gpu",), ("host",), ("host", "gpu")])
    make_inputs(ctrl4, world, Ref(1), (2,))
    ctrl4.send(world, reduce_msg(Ref(10), Ref(1), (2,), ["gpu"], ReduceOp.SUM))
    ctrl4.send(world, reduce_msg(Ref(11), Ref(1), (2,), ["host"], ReduceOp.SUM))
    ctrl4.send(world, reduce_msg(Ref(12), Ref(1), (2,), ["gpu", "host"], ReduceOp.SUM))
    ctrl4.send(world, reduce_msg(Ref(13), Ref(1), (2,), ["host"], "stack"))
    got = fetch_all(ctrl4, world, [Ref(10), Ref(11), Ref(12), Ref(13)])
    x = [expected_input(r, (2,)) for r in world]
    for rank in world:
        host, gpu = divmod(rank, 2)
        assert torch.equal(got[(Ref(10), rank)], x[2 * host] + x[2 * host + 1])  # per host
        assert torch.equal(got[(Ref(11), rank)], x[gpu] + x[2 + gpu])
        assert torch.equal(got[(Ref(12), rank)], sum(x))
        assert torch.equal(got[(Ref(13), rank)], torch.stack([x[gpu], x[2 + gpu]]))


def test_reduce_on_a_sliced_sub_mesh(ctrl4):
    host1 = Slice(2, [2], [1])  # ranks 2 and 3
    setup_mesh(ctrl4, None, ["gpu"], split=[("gpu",)], ranks=host1)
    make_inputs(ctrl4, [2, 3], Ref(1), (2,))
    ctrl4.send([2, 3], reduce_msg(Ref(2), Ref(1), (2,), ["gpu"], ReduceOp.SUM))
    got = fetch_all(ctrl4, [2, 3], [Ref(2)])
    assert torch.equal(got[(Ref(2), 3)], expected_input(2, (2,)) + expected_input(3, (2,)))


def test_broadcast_with_one_send_per_destination(ctrl4):
    world = [0, 1, 2, 3]
    setup_mesh(ctrl4, [2, 2], ["host", "gpu"])
    ctrl4.send(world, m.BackendNetworkPointToPointInit(S0, S0))
    make_inputs(ctrl4, [0], Ref(1), (3,))
    factory = Factory((3,), torch.float32, torch.strided, "cpu")
    source = Slice(0, [1], [1])
    for dest in (1, 2, 3):
        ctrl4.send(
            [0, dest], m.SendTensor(Ref(2), source, Slice(dest, [1], [1]), Ref(1), factory, S0, S0)
        )
    got = fetch_all(ctrl4, [1, 2, 3], [Ref(2)])
    for dest in (1, 2, 3):
        assert torch.equal(got[(Ref(2), dest)], expected_input(0, (3,)))


@pytest.mark.exercises("CreateRemoteProcessGroup", "SplitCommForProcessGroup")
def test_process_group_udf(ctrl4):
    world = [0, 1, 2, 3]
    setup_mesh(ctrl4, [2, 2], ["host", "gpu"])
    group = Ref(901)
    ctrl4.send(world, m.CreateRemoteProcessGroup(group, MESH, ["gpu"]))
    ctrl4.send(world, m.SplitCommForProcessGroup(group, S0))
    make_inputs(ctrl4, world, Ref(1), (2,))
    results = [Ref(20 + i) for i in range(6)]
    ctrl4.send(
        world,
        call(5, results, "helpers.remote_fns.pg_collectives", Ref(1), group, MESH, groups=[group]),
    )
    got = fetch_all(ctrl4, world, results)
    x = [expected_input(r, (2,)) for r in world]
    for rank in world:
        host, gpu = divmod(rank, 2)
        pair = [x[2 * host], x[2 * host + 1]]
        total, gathered, first, received, group_rank, size = (got[(r, rank)] for r in results)
        assert torch.equal(total, pair[0] + pair[1])
        assert torch.equal(gathered, torch.stack(pair))
        assert torch.equal(first, pair[0])
        assert torch.equal(received, pair[1 - gpu])
        assert (group_rank, size) == (gpu, 2)


# well below the collective timeout (60 s): a member left waiting for its peer fails the test
@pytest.mark.timeout(40, func_only=True)
def test_a_process_group_call_whose_input_failed_on_one_rank_runs_on_no_rank(ctrl):
    """Rank 1's input failed, so rank 1 skips the call; rank 0 must not enter its collectives
    and wait there until gloo's timeout (which broke the group): no member runs the call,
    rank 0's results hold rank 1's error naming it, nothing new is reported, and the group
    serves the next call."""
    setup_mesh(ctrl, [2], ["gpu"])
    group = Ref(901)
    ctrl.send([0, 1], m.CreateRemoteProcessGroup(group, MESH, ["gpu"]))
    ctrl.send([0, 1], m.SplitCommForProcessGroup(group, S0))
    make_inputs(ctrl, [0], Ref(1), (2,))
    ctrl.send(1, call(0, Ref(1), "helpers.remote_fns.boom", 1))  # rank 1's input fails
    ctrl.send([0, 1], call(1, Ref(2), "helpers.remote_fns.per_rank", MESH, 2))
    failed = [Ref(20 + i) for i in range(6)]
    ctrl.send(
        [0, 1],
        call(5, failed, "helpers.remote_fns.pg_collectives", Ref(1), group, MESH, groups=[group]),
    )
    results = [Ref(30 + i) for i in range(6)]
    ctrl.send(
        [0, 1],
        call(6, results, "helpers.remote_fns.pg_collectives", Ref(2), group, MESH, groups=[group]),
    )
    ctrl.send([0, 1], fetch(7, results[0]))
    reports = ctrl.sync(timeout=30)
    assert [(f.seq, f.rank) for f in failures(reports)] == [(0, 1)]
    total = expected_input(0, (2,)) + expected_input(1, (2,))
    got = values(reports)
    assert torch.equal(got[(7, 0)], total) and torch.equal(got[(7, 1)], total)
    for rank in (0, 1):
        with pytest.raises(dm.RemoteException, match="boom from a remote function") as info:
            ctrl.get_ref(rank, failed[0], S0)
        if rank == 0:
            assert "rank 1, a member of the process group" in str(info.value)


def all_reduce_of_ones(ctrl, device: str) -> torch.Tensor:
    setup_mesh(ctrl, [2], ["gpu"], split=[("gpu",)])
    ctrl.send([0, 1], call(0, Ref(1), "torch.ones", 4, device=device))
    ctrl.send(
        [0, 1],
        m.Reduce(
            Ref(2),
            Ref(1),
            Factory((4,), torch.float32, torch.strided, device),
            MESH,
            S0,
            ["gpu"],
            ReduceOp.SUM,
            False,
            False,
            None,
        ),
    )
    return fetch_all(ctrl, [0, 1], [Ref(2)])[(Ref(2), 1)]


def test_backend_setting_is_checked_and_gloo_is_honoured(client2):
    with dask.config.set({"dask_monarch.backend": "mpi"}):
        with pytest.raises(ValueError, match="dask_monarch.backend must be 'auto' or 'gloo'"):
            dm.Controller(client2, world_size=2)
    with dask.config.set({"dask_monarch.backend": "gloo"}):
        with dm.Controller(client2, world_size=2) as ctrl:
            assert torch.equal(all_reduce_of_ones(ctrl, "cpu"), torch.full((4,), 2.0))
