"""Quick segments run on the worker's event loop (worker/inline.py): which ones, and that they
behave as on their lane's thread: values, failures, order, the task stream."""

from __future__ import annotations

import pytest
import torch
from helpers.raw import call, fetch
from helpers.workers import inlined_segments

import dask_monarch as dm
from dask_monarch.messages import DeleteRefs, Ref
from dask_monarch.protocol.wire import StatusProbe
from dask_monarch.worker.errors import SeqError
from dask_monarch.worker.inline import QUICK_NUMEL, QUICK_STEPS, is_quick

SMALL = {1: torch.ones(4), 2: torch.ones(2, 2)}
PROBE = StatusProbe(5, 0, 1)


# -- which segments are quick (pure) -----------------------------------------------------------


def test_a_small_op_its_fetch_and_the_status_probe_are_quick():
    steps = [call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), 1), fetch(2, Ref(3)), PROBE]
    assert is_quick(steps, SMALL)
    assert is_quick([DeleteRefs([Ref(1)]), PROBE], SMALL)
    assert is_quick([call(1, Ref(3), "torch.ops.aten.mul_.Tensor", Ref(1), Ref(1))], SMALL)


@pytest.mark.parametrize(
    "step",
    [
        call(1, Ref(3), "helpers.remote_fns.pair", Ref(1)),  # user code can do anything
        call(1, Ref(3), "torch.ops.aten.arange.default", 10**9),  # not a bounded op
        call(1, Ref(3), "torch.ops.aten.view.default", Ref(1), [2, 2]),  # a list argument
        call(1, Ref(3), "torch.ops.c10d.barrier.default", Ref(1)),  # not ATen
        call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(9), 1),  # not a tensor here (yet)
        call(1, Ref(3), "torch.ops.aten._to_copy.default", Ref(1), device=torch.device("cpu")),
        fetch(2, Ref(1), fn="helpers.remote_fns.number"),  # a function computes the value
    ],
    ids=["user function", "arange", "list argument", "c10d", "unknown ref", "device", "fn"],
)
def test_anything_that_could_wait_or_run_long_is_not(step):
    assert not is_quick([step, PROBE], SMALL)


def test_sizes_are_bounded_through_the_segment():
    big = {1: torch.ones(QUICK_NUMEL + 1)}
    assert not is_quick([fetch(1, Ref(1))], big)
    # a result made in the segment counts as the product of its inputs
    env = {1: torch.ones(257), 2: torch.ones(256)}  # 65 792 > QUICK_NUMEL
    assert not is_quick([call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), Ref(2))], env)
    env = {1: torch.ones(16), 2: torch.ones(16)}
    steps = [
        call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), Ref(2)),  # at most 256
        call(2, Ref(4), "torch.ops.aten.mul.Tensor", Ref(3), Ref(3)),  # at most 65 536
        fetch(3, Ref(4)),
    ]
    assert is_quick(steps, env)
    steps.insert(2, call(3, Ref(5), "torch.ops.aten.mul.Tensor", Ref(4), Ref(1)))
    assert not is_quick(steps, env)


def test_an_errored_input_passes_its_failure_on_quickly():
    error = SeqError(1, "boom")
    assert is_quick([call(2, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), 1)], {1: error})


def test_long_segments_keep_their_thread():
    step = call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), 1)
    assert is_quick([step] * QUICK_STEPS, SMALL)
    assert not is_quick([step] * (QUICK_STEPS + 1), SMALL)


# -- on a real mesh ----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_fetch_runs_on_the_event_loop_and_a_user_function_on_its_lane(client2, mesh2):
    with mesh2.activate():
        x = torch.zeros(3)
        dm.inspect(x)
        before = inlined_segments(client2, mesh2)
        for i in range(5):
            x = x + 1
            assert dm.inspect(x).tolist() == [i + 1.0] * 3
        quick = inlined_segments(client2, mesh2)
        assert quick >= before + 5 * 2  # both ranks' segment of each round trip
        rank0 = [mesh2._session.controller.workers[0]]
        quick = inlined_segments(client2, mesh2, rank0)
        where = dm.remote("helpers.remote_fns.thread_name", propagate=lambda *a: "")
        assert where.call_on_shard_and_fetch(x).startswith("monarch-")  # the lane's thread
        big = torch.zeros(QUICK_NUMEL + 1)
        assert dm.inspect((big + 1).sum()).item() == QUICK_NUMEL + 1
        # neither the call nor the big op ran on the loop
        assert inlined_segments(client2, mesh2, rank0) == quick


@pytest.mark.timeout(120)
def test_a_failure_passed_on_by_the_loop_is_raised_like_any_other(client2, mesh2):
    boom = dm.remote("helpers.remote_fns.boom", propagate=lambda x: x)
    with mesh2.activate():
        x = torch.ones(2)
        failed = boom(x)  # fails on the ranks, on the lane's thread
        with pytest.raises(dm.RemoteException, match="boom from a remote function"):
            dm.inspect(failed)
        controller = mesh2._session.controller
        controller.drain(timeout=60)  # every segment sent so far ran (and was counted)
        before = inlined_segments(client2, mesh2)
        with pytest.raises(dm.RemoteException, match="boom from a remote function"):
            dm.inspect(failed + 1)  # the op and its fetch only pass the failure on
        # the client knew the root failed and raised at once: wait for the ranks' segment
        controller.drain(timeout=60)
        assert inlined_segments(client2, mesh2) == before + 2  # each rank's, on the loop
        assert dm.inspect(x * 3).tolist() == [3.0, 3.0]  # the mesh carries on


@pytest.mark.timeout(120)
def test_segments_run_on_the_loop_are_ordinary_tasks_in_the_task_stream(client2, mesh2):
    from distributed import get_task_stream
    from helpers.task_stream import wait_until_recorded

    token = mesh2._session.controller.token
    with mesh2.activate():
        x = torch.zeros(())
        dm.inspect(x)
        wait_until_recorded(client2, token)
        before = inlined_segments(client2, mesh2)
        with get_task_stream(client2) as stream:
            for _ in range(3):
                x = x + 1
                dm.inspect(x)
            wait_until_recorded(client2, token)
        assert inlined_segments(client2, mesh2) == before + 3 * 2
        ours = [e for e in stream.data if isinstance(e["key"], tuple) and e["key"][1] == token]
        assert len(ours) == 3 * 2  # one task per rank per round trip, each recorded
        assert {e["key"][0] for e in ours} == {"monarch_ops"}  # named as on a thread
        assert all(e["status"] == "OK" and e["startstops"] for e in ours)


@pytest.mark.timeout(180)
def test_the_switch_keeps_every_segment_on_its_lane(throwaway_cluster):
    no_inlining = {"dask_monarch.worker.inline-segments": False}
    with throwaway_cluster(2, config=no_inlining) as (_, client):
        mesh = dm.device_mesh(client, gpu=2)
        with mesh.activate():
            x = torch.zeros(())
            for _ in range(3):
                x = x + 1
                dm.inspect(x)
            assert dm.inspect(x).item() == 3
        assert inlined_segments(client, mesh) == 0
        mesh.exit()


# -- no user code on the loop (DESIGN decision 17) ---------------------------------------------


def test_steps_holding_a_users_value_are_not_unpickled_on_the_loop():
    import pickle

    from helpers.remote_fns import SlowUnpickle

    from dask_monarch.worker.inline import small_steps

    plain = [call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), 1), PROBE]
    assert small_steps((pickle.dumps(plain),)) == plain
    # unpickling this would sleep: the steps are not judged, the lane's thread loads them
    users = [call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), SlowUnpickle(1, 60)), PROBE]
    assert small_steps((pickle.dumps(plain), pickle.dumps(users))) is None


def test_an_op_on_a_tensor_subclass_keeps_its_thread():
    class Logged(torch.Tensor):  # its __torch_function__ is Python, run on every op
        pass

    env = {1: torch.ones(4).as_subclass(Logged)}
    assert not is_quick([call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), 1)], env)
    assert is_quick([call(1, Ref(3), "torch.ops.aten.add.Tensor", Ref(1), 1)], SMALL)
