"""The raw controller on a real 2-rank cluster: calls, errors, refs, status, groups, exit."""

from __future__ import annotations

import pytest
import torch
from helpers.raw import S0, S1, call, create_streams, failures, fetch, values

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Ref

BOTH = [0, 1]


@pytest.mark.exercises("CreateStream", "CallFunction", "GetRefUnitTestsOnly")
def test_chain_with_in_place_mutation(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
    ctrl.send(BOTH, call(1, Ref(2), "torch.ops.aten.add.Tensor", Ref(1), Ref(1)))
    ctrl.send(BOTH, call(2, None, "torch.ops.aten.add_.Scalar", Ref(2), 5, mutates=[Ref(2)]))
    ctrl.send(BOTH, call(3, Ref(3), "torch.ops.aten.mul.Tensor", Ref(2), Ref(1)))
    assert ctrl.sync() == []
    for rank in BOTH:
        assert torch.allclose(ctrl.get_ref(rank, Ref(3), S0), torch.full((3,), 7.0))
        assert torch.allclose(ctrl.get_ref(rank, Ref(2), S0), torch.full((3,), 7.0))
    assert ctrl.get_ref(0, Ref(99), S0) is None


def test_missing_argument_is_reported_once_with_the_torch_error(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ops.aten.rand.default"))
    reports = ctrl.sync()
    assert sorted((f.seq, f.rank) for f in failures(reports)) == [(0, 0), (0, 1)]
    assert all(
        "aten::rand() is missing value for argument 'size'" in f.error for f in failures(reports)
    )
    with pytest.raises(dm.RemoteException, match="missing value for argument 'size'"):
        ctrl.get_ref(0, Ref(1), S0)


def test_bad_function_path_poisons_the_mutated_ref(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.zeros", 2))
    ctrl.send(BOTH, call(1, None, "no_such_module.fn", Ref(1), mutates=[Ref(1)]))
    reports = failures(ctrl.sync())
    assert len(reports) == 2 and {r.seq for r in reports} == {1}
    assert "failed to resolve function no_such_module.fn" in reports[0].error
    with pytest.raises(dm.RemoteException, match="failed to resolve function"):
        ctrl.get_ref(1, Ref(1), S0)


def test_path_without_module_and_remote_impl(ctrl):
    create_streams(ctrl, [0], S0)
    ctrl.send(0, call(0, Ref(1), "nodots", 1))
    ctrl.send(0, call(1, Ref(2), "torch.ones", 1))
    ctrl.send(0, call(2, Ref(3), "helpers.remote_fns.remote_impl_holder", Ref(2)))
    reports = failures(ctrl.sync())
    assert len(reports) == 1 and "paths must be fully qualified" in reports[0].error
    assert torch.equal(ctrl.get_ref(0, Ref(3), S0), torch.full((1,), 100.0))


def test_dependent_failure_is_reported_once(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2, 3))
    ctrl.send(BOTH, call(1, Ref(2), "torch.ops.aten.mm.default", Ref(1), Ref(1)))  # fails
    ctrl.send(BOTH, call(2, Ref(3), "torch.ops.aten.relu.default", Ref(2)))  # depends
    ctrl.send(BOTH, call(3, Ref(4), "torch.ops.aten.relu.default", Ref(3)))  # depends
    ctrl.send(BOTH, call(4, Ref(5), "torch.ops.aten.relu.default", Ref(1)))  # independent
    reports = failures(ctrl.sync())
    assert sorted((r.seq, r.rank) for r in reports) == [(1, 0), (1, 1)]
    assert "mm" in reports[0].error or "mat1 and mat2" in reports[0].error
    with pytest.raises(dm.RemoteException) as info:
        ctrl.get_ref(1, Ref(4), S0)
    assert "mat1 and mat2" in str(info.value)
    assert torch.equal(ctrl.get_ref(1, Ref(5), S0), torch.ones(2, 3))


def test_functions_returning_tuples_none_dicts_and_plain_values(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
    ctrl.send(BOTH, call(1, [Ref(2), Ref(3)], "helpers.remote_fns.pair", Ref(1)))
    ctrl.send(BOTH, call(2, None, "helpers.remote_fns.nothing", Ref(1)))
    ctrl.send(BOTH, call(3, Ref(4), "helpers.remote_fns.number", Ref(1)))
    ctrl.send(BOTH, call(4, [Ref(5), Ref(6), None], "helpers.remote_fns.as_dict", Ref(1)))
    ctrl.send(BOTH, call(5, [Ref(7)], "helpers.remote_fns.pair", Ref(1)))  # wrong count
    reports = failures(ctrl.sync())
    assert [r.seq for r in reports] == [5, 5]
    assert "unexpected number of returns from op, expected 1, got 2" in reports[0].error
    assert torch.equal(ctrl.get_ref(0, Ref(2), S0), torch.full((2,), 2.0))
    assert torch.equal(ctrl.get_ref(0, Ref(3), S0), torch.full((2,), 2.0))
    assert ctrl.get_ref(1, Ref(4), S0) == 20
    assert torch.equal(ctrl.get_ref(1, Ref(5), S0), torch.full((2,), 2.0))
    assert torch.equal(ctrl.get_ref(1, Ref(6), S0), torch.zeros(2))


def test_dtype_device_layout_and_none_arguments(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(
        BOTH,
        call(
            0,
            Ref(1),
            "torch.zeros",
            2,
            3,
            dtype=torch.float64,
            device=torch.device("cpu"),
            layout=torch.strided,
        ),
    )
    ctrl.send(
        BOTH, call(1, Ref(2), "torch.ops.aten.sum.dim_IntList", Ref(1), [1], False, dtype=None)
    )
    ctrl.send(BOTH, call(2, Ref(3), "torch.full", [2], True, dtype=torch.bool))
    assert ctrl.sync() == []
    x = ctrl.get_ref(0, Ref(1), S0)
    assert x.dtype == torch.float64 and x.layout == torch.strided and x.shape == (2, 3)
    assert ctrl.get_ref(1, Ref(2), S0).shape == (2,)
    assert ctrl.get_ref(1, Ref(3), S0).dtype == torch.bool


@pytest.mark.exercises("DeleteRefs")
def test_delete_refs_reaches_every_stream(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    for stream in (S0, S1):
        ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 1, stream=stream))
        ctrl.send(BOTH, call(1, Ref(2), "torch.ones", 1, stream=stream))
    ctrl.send(BOTH, m.DeleteRefs([Ref(1), Ref(77)]))
    ctrl.sync()
    for rank in BOTH:
        for stream in (S0, S1):
            assert ctrl.get_ref(rank, Ref(1), stream) is None
            assert ctrl.get_ref(rank, Ref(2), stream) is not None


@pytest.mark.exercises("RequestStatus")
def test_request_status_after_100_calls_on_two_streams(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    for seq in range(100):
        stream = S0 if seq % 2 else S1
        ctrl.send(BOTH, call(seq, Ref(1000 + seq), "torch.ones", 1, stream=stream))
    ctrl.send(BOTH, m.RequestStatus(100))
    reports = ctrl.sync()
    assert sorted((r.seq, r.rank) for r in reports) == [(101, 0), (101, 1)]
    assert all(type(r) is m.Status for r in reports)


def test_request_status_with_no_streams_answers_at_once(ctrl):
    ctrl.send(BOTH, m.RequestStatus(4))
    assert sorted((r.seq, r.rank) for r in ctrl.sync()) == [(5, 0), (5, 1)]


@pytest.mark.exercises("SendValue")
def test_send_value_with_and_without_function_and_failing(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
    ctrl.send(0, fetch(1, Ref(1)))
    ctrl.send(BOTH, fetch(2, (Ref(1),), fn="torch.ops.aten.sum.default"))
    ctrl.send(1, fetch(3, (Ref(1), Ref(1))))  # two args and no function
    ctrl.send(1, fetch(4, (Ref(1),), fn="helpers.remote_fns.boom", mutates=[Ref(1)]))
    reports = ctrl.sync()
    got = values(reports)
    assert torch.equal(got[(1, 0)], torch.ones(3))
    assert got[(2, 0)].item() == 3.0 and got[(2, 1)].item() == 3.0
    assert (3, 1) not in got and (4, 1) not in got
    fails = {f.seq: f.error for f in failures(reports)}
    assert "expected only a single arg (and no kwargs) when no function is given" in fails[3]
    assert "boom from a remote function" in fails[4]
    with pytest.raises(dm.RemoteException, match="boom"):
        ctrl.get_ref(1, Ref(1), S0)
    assert [r.seq for r in reports] == sorted(r.seq for r in reports)


def test_fetched_value_is_a_snapshot(ctrl):
    create_streams(ctrl, [0], S0)
    ctrl.send(0, call(0, Ref(1), "torch.zeros", 2))
    ctrl.send(0, fetch(1, Ref(1)))
    ctrl.send(0, call(2, None, "torch.ops.aten.add_.Scalar", Ref(1), 1, mutates=[Ref(1)]))
    got = values(ctrl.sync())
    assert torch.equal(got[(1, 0)], torch.zeros(2))


@pytest.mark.exercises("CommandGroup")
def test_command_group_runs_in_order(ctrl):
    create_streams(ctrl, BOTH, S0)
    group = m.CommandGroup(
        [
            call(0, Ref(1), "torch.ones", 2),
            call(1, None, "torch.ops.aten.mul_.Scalar", Ref(1), 3, mutates=[Ref(1)]),
            fetch(2, Ref(1)),
        ]
    )
    ctrl.send(BOTH, group)
    got = values(ctrl.sync())
    assert torch.equal(got[(2, 0)], torch.full((2,), 3.0))
    assert torch.equal(got[(2, 1)], torch.full((2,), 3.0))


@pytest.mark.exercises("SetRefUnitTestsOnly")
def test_set_and_get_ref_test_hooks(ctrl):
    create_streams(ctrl, [1], S0)
    ctrl.send(1, m.SetRefUnitTestsOnly(Ref(5), {"a": [1, 2]}, S0))
    ctrl.send(1, m.GetRefUnitTestsOnly(Ref(5), S0))  # no reply port: nothing to return
    assert ctrl.sync() == []
    assert ctrl.get_ref(1, Ref(5), S0) == {"a": [1, 2]}


def test_wrong_stream_is_ref_not_found(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2, stream=S0))
    ctrl.send(BOTH, call(1, Ref(2), "torch.ops.aten.neg.default", Ref(1), stream=S1))
    reports = failures(ctrl.sync())
    assert [r.seq for r in reports] == [1, 1]
    assert "ref not found: r1" in reports[0].error
    with pytest.raises(dm.RemoteException, match="ref not found"):
        ctrl.get_ref(0, Ref(2), S1)


def test_test_panic_breaks_only_this_controller(client2):
    ctrl = dm.Controller(client2, world_size=2)
    create_streams(ctrl, BOTH, S0)
    ctrl.send(1, call(0, None, "__test_panic"))
    with pytest.raises(dm.DeviceException, match="__test_panic") as info:
        ctrl.sync(timeout=30)
    assert info.value.rank == 1
    with pytest.raises(dm.DeviceException):
        ctrl.send(0, m.RequestStatus(1))
    ctrl.close()
    with dm.Controller(client2, world_size=2) as fresh:
        create_streams(fresh, BOTH, S0)
        fresh.send(BOTH, call(0, Ref(1), "torch.ones", 1))
        assert fresh.sync() == []


@pytest.mark.exercises("Exit")
def test_exit_releases_the_rank_and_workers_stay_usable(client2):
    ctrl = dm.Controller(client2, world_size=2)
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 1))
    ctrl.send(BOTH, m.Exit())
    assert ctrl.sync() == []
    assert ctrl.exited == {0, 1}
    states = client2.run(lambda dask_worker: list(dask_worker.plugins["dask_monarch"].ranks))
    assert all(ctrl.token not in tokens for tokens in states.values())
    ctrl.close()
    with dm.Controller(client2, world_size=2) as fresh:
        create_streams(fresh, BOTH, S0)
        fresh.send(BOTH, call(0, Ref(1), "torch.ones", 1))
        fresh.send(BOTH, fetch(1, Ref(1)))
        assert len(values(fresh.sync())) == 2


def test_exit_with_an_error_is_raised(client2):
    ctrl = dm.Controller(client2, world_size=2)
    ctrl.send(BOTH, m.Exit(("rank 1", "the training script gave up")))
    with pytest.raises(dm.DeviceException, match="the training script gave up"):
        ctrl.sync(timeout=30)
    ctrl.close()


def test_two_controllers_are_isolated(client2):
    with dm.Controller(client2, world_size=2) as a, dm.Controller(client2, world_size=2) as b:
        for ctrl, value in ((a, 1.0), (b, 2.0)):
            create_streams(ctrl, BOTH, S0)
            ctrl.send(BOTH, call(0, Ref(1), "torch.full", [2], value))
        a.sync()
        b.sync()
        assert torch.equal(a.get_ref(0, Ref(1), S0), torch.full((2,), 1.0))
        assert torch.equal(b.get_ref(0, Ref(1), S0), torch.full((2,), 2.0))


def test_too_few_workers(client2):
    with pytest.raises(ValueError, match=r"needs 3 workers \(one per rank\) but the cluster has 2"):
        dm.Controller(client2, world_size=3)


def test_send_checks_its_arguments(ctrl):
    with pytest.raises(TypeError, match="worker message"):
        ctrl.send(0, "not a message")
    with pytest.raises(ValueError, match="outside"):
        ctrl.send(2, m.RequestStatus(0))
    ctrl.send(dm.ndslice.Slice.row_major([2]), m.RequestStatus(0))
    assert len(ctrl.sync()) == 2


def test_get_ref_of_an_unknown_stream(ctrl):
    with pytest.raises(ValueError, match="no stream 7"):
        ctrl.get_ref(0, Ref(1), m.StreamRef(7))
