"""Values are what the client declared, and user code cannot kill a rank (issue 14).

Every test here could kill or corrupt a worker before the fix, so they share
a throw-away cluster of their own, never the session clusters.
"""

from __future__ import annotations

import contextlib
import sys

import dask
import pytest
import torch
from helpers.raw import S0, S1, S2, call, create_streams

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Factory, Ref
from dask_monarch.ndslice import Slice
from dask_monarch.protocol.wire import ValueFailed

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(throwaway_cluster):
    with throwaway_cluster(2) as (_, c):
        yield c


@pytest.fixture
def mesh(client):
    mesh = dm.device_mesh(client, gpu=2)
    yield mesh
    with contextlib.suppress(dm.RemoteException, dm.DeviceException):
        mesh.exit()


@pytest.fixture
def ctrl(client):
    controller = dm.Controller(client, world_size=2)
    yield controller
    controller.close()


# -------------------------------------------------------------------- declared metadata


def _three_sevens(x):
    return torch.full((3,), 7.0)


def _float64_on_rank_one(x, rank):
    return torch.ones(3, dtype=torch.float64 if int(rank) == 1 else torch.float32)


def test_a_wrong_propagate_fails_the_sent_value_instead_of_corrupting_it(mesh):
    lying = dm.remote(_three_sevens, propagate=lambda x: torch.empty(5))
    stage0, stage1 = mesh.slice(gpu=0), mesh.slice(gpu=1)
    with stage0.activate():
        y = lying(torch.zeros(1))
    moved = y.to_mesh(stage1)
    with stage1.activate():
        with pytest.raises(dm.RemoteException) as info:
            dm.inspect(moved)
    text = str(info.value.traceback or info.value)
    # caught where the result was bound, before the send could trust it
    assert "_three_sevens" in text and "rank 0" in text
    assert "(3,)" in text and "(5,)" in text  # the real and the declared shape
    with mesh.activate():  # the ranks live on
        assert dm.inspect(torch.ones(2) + 1, gpu=1).tolist() == [2.0, 2.0]


def test_a_reduce_whose_dtype_differs_between_ranks_fails_that_value(mesh):
    mixed = dm.remote(_float64_on_rank_one, propagate=lambda x, r: torch.empty(3))
    with mesh.activate():
        x = mixed(torch.zeros(1), mesh.rank("gpu"))
        total = x.reduce("gpu", "sum")
        with pytest.raises(dm.RemoteException) as info:
            dm.inspect(total, gpu=1)
        text = str(info.value.traceback or info.value)
        # caught where rank 1 bound its input, before the Reduce could trust it
        assert "_float64_on_rank_one" in text and "rank 1" in text
        assert "torch.float64" in text and "torch.float32" in text
        with pytest.raises(dm.RemoteException, match="_float64_on_rank_one"):  # as a whole
            dm.inspect(total, gpu=0)
        assert dm.inspect(torch.ones(2) * 3, gpu=1).tolist() == [3.0, 3.0]  # no gloo abort


@pytest.mark.exercises("Reduce")
def test_a_rank_whose_reduce_input_mismatches_takes_part_with_zeros(ctrl):
    heard = []
    ctrl.add_listener(lambda item: heard.append(item) if type(item) is ValueFailed else None)
    create_streams(ctrl, [0, 1], S0)
    mesh = Ref(900)
    ctrl.send([0, 1], m.CreateDeviceMesh(mesh, ["gpu"], Slice.row_major([2])))
    ctrl.send([0, 1], m.BackendNetworkInit())
    ctrl.send([0, 1], m.SplitComm(["gpu"], mesh, S0))
    ctrl.send(0, call(0, Ref(1), "torch.ones", 3))
    ctrl.send(1, call(0, Ref(1), "torch.ones", 3, dtype=torch.float64))
    factory = Factory((3,), torch.float32, torch.strided, "cpu")
    ctrl.send(
        [0, 1],
        m.Reduce(Ref(2), Ref(1), factory, mesh, S0, ["gpu"], m.ReduceOp.SUM, False, False, None),
    )
    ctrl.sync(timeout=120)
    assert torch.equal(ctrl.get_ref(0, Ref(2), S0), torch.ones(3))  # 1 + rank 1's zeros
    with pytest.raises(dm.RemoteException, match="ValueMismatch"):
        ctrl.get_ref(1, Ref(2), S0)
    assert [(x.rank, x.ref) for x in heard] == [(1, 2)]


def _setup_p2p(ctrl, *streams):
    create_streams(ctrl, [0, 1], *(streams or (S0,)))
    ctrl.send([0, 1], m.BackendNetworkInit())
    ctrl.send([0, 1], m.BackendNetworkPointToPointInit(S0, S0))


@pytest.mark.exercises("SendTensor")
def test_send_tensor_whose_factory_is_larger_sends_zeros_and_says_so(ctrl):
    heard = []
    ctrl.add_listener(lambda item: heard.append(item) if type(item) is ValueFailed else None)
    _setup_p2p(ctrl)
    ctrl.send(0, call(0, Ref(1), "torch.full", [3], 7.0))
    factory = Factory((5,), torch.float32, torch.strided, "cpu")
    ctrl.send(
        [0, 1],
        m.SendTensor(Ref(2), Slice(0, [1], [1]), Slice(1, [1], [1]), Ref(1), factory, S0, S0),
    )
    ctrl.sync(timeout=120)
    assert torch.equal(ctrl.get_ref(1, Ref(2), S0), torch.zeros(5))  # never [7, 7, 7, 0, junk]
    assert len(heard) == 1 and heard[0].rank == 0 and heard[0].ref == 2
    assert "shape (3,)" in heard[0].error and "shape (5,)" in heard[0].error


@pytest.mark.exercises("SendTensor")
def test_send_tensor_between_slices_of_different_sizes_says_so(ctrl):
    _setup_p2p(ctrl)
    ctrl.send([0, 1], call(0, Ref(1), "torch.ones", 2))
    factory = Factory((2,), torch.float32, torch.strided, "cpu")
    ctrl.send(
        [0, 1],
        m.SendTensor(Ref(2), Slice(0, [1], [1]), Slice(0, [2], [1]), Ref(1), factory, S0, S0),
    )
    with pytest.raises(dm.DeviceException, match="same size"):
        ctrl.sync(timeout=120)


def test_a_rank_holds_at_most_limits_lanes_streams(client):
    with dask.config.set({"dask_monarch.limits.lanes": 2}):
        controller = dm.Controller(client, world_size=2)
    try:
        create_streams(controller, [0, 1], S0, S1)
        controller.sync(timeout=120)
        create_streams(controller, [0, 1], S2)
        with pytest.raises(dm.DeviceException, match=r"limits\.lanes=2"):
            controller.sync(timeout=120)
    finally:
        controller.close()


# -------------------------------------------------------------------- user code and ranks


def _exits(x):
    sys.exit(3)


def _interrupts(x):
    raise KeyboardInterrupt("from a remote function")


def _generator_exit(x):
    raise GeneratorExit("from a remote function")


class _ExitsWhenUnpickled:
    def __reduce__(self):
        return (sys.exit, (4,))


def _takes(x, obj):
    return x.clone()


@pytest.mark.parametrize(
    "fn, name",
    [
        (_exits, "SystemExit"),
        (_interrupts, "KeyboardInterrupt"),
        (_generator_exit, "GeneratorExit"),
    ],
)
def test_base_exceptions_of_remote_functions_are_remote_failures(mesh, fn, name):
    bad = dm.remote(fn, propagate=lambda x: x.clone())
    with mesh.activate():
        y = bad(torch.ones(2))
        with pytest.raises(dm.RemoteException) as info:
            dm.inspect(y, gpu=1)
        assert name in str(info.value.traceback or info.value)
        assert "internal error" not in str(info.value.traceback or info.value)
        assert dm.inspect(torch.ones(2) + 4, gpu=1).tolist() == [5.0, 5.0]  # the ranks live on


def test_an_argument_that_exits_when_unpickled_is_a_remote_failure(mesh):
    takes = dm.remote(_takes, propagate=lambda x, obj: x.clone())
    with mesh.activate():
        y = takes(torch.ones(2), _ExitsWhenUnpickled())
        with pytest.raises(dm.RemoteException, match="SystemExit"):
            dm.inspect(y, gpu=0)
        assert dm.inspect(torch.ones(2) + 5, gpu=0).tolist() == [6.0, 6.0]


def test_a_set_ref_value_that_exits_when_unpickled_breaks_only_its_controller(ctrl, client):
    create_streams(ctrl, [0, 1], S0, S1)
    ctrl.send([0], m.SetRefUnitTestsOnly(Ref(1), _ExitsWhenUnpickled(), S1))
    with pytest.raises(dm.DeviceException, match="cannot be unpickled"):
        ctrl.sync(timeout=120)
    other = dm.Controller(client, world_size=2)  # the workers survived
    try:
        create_streams(other, [0, 1], S0)
        other.send([0, 1], call(0, Ref(1), "torch.ones", 2))
        assert torch.equal(other.get_ref(1, Ref(1), S0), torch.ones(2))
    finally:
        other.close()


# -------------------------------------------------------------------- a rank that dies anyway


def test_a_process_exit_names_what_the_lane_was_running(throwaway_cluster):
    with throwaway_cluster(2) as (_, c):
        controller = dm.Controller(c, world_size=2)
        try:
            create_streams(controller, [0, 1], S0)
            controller.send([0, 1], call(0, Ref(1), "torch.ones", 2))
            controller.sync(timeout=120)
            controller.send(1, call(1, Ref(2), "helpers.remote_fns.exit_process", Ref(1)))
            with pytest.raises(dm.DeviceException) as info:
                controller.sync(timeout=120)
            text = str(info.value)
            assert "rank 1" in text and "lost connection" in text
            assert "stream 0: CallFunction of helpers.remote_fns.exit_process (seq 1)" in text
        finally:
            controller.close()


def test_a_memory_limit_kill_says_so(throwaway_cluster):
    with throwaway_cluster(2, memory_limit="1GiB") as (_, c):
        controller = dm.Controller(c, world_size=2)
        try:
            create_streams(controller, [0, 1], S0)
            controller.send([0, 1], call(0, Ref(1), "torch.ones", 2))
            controller.sync(timeout=120)
            controller.send(0, call(1, Ref(2), "helpers.remote_fns.allocate", Ref(1), 1536))
            with pytest.raises(dm.DeviceException) as info:
                controller.sync(timeout=120)
            text = str(info.value)
            assert "rank 0" in text and "memory limit" in text
            assert "helpers.remote_fns.allocate" in text
        finally:
            controller.close()


def test_fetching_a_value_whose_propagation_lied_says_so(mesh):
    lying = dm.remote(_three_sevens, propagate=lambda x: torch.empty(3, 4))
    with mesh.activate():
        y = lying(torch.zeros(1))
        assert y.shape == (3, 4)  # what the client believes
        with pytest.raises(
            dm.RemoteException,
            match=r"_three_sevens on rank \d: result 0 \(r\d+\) is shape \(3,\).*said shape "
            r"\(3, 4\)",
        ):
            dm.inspect(y, gpu=1)


def test_a_result_that_is_not_what_propagate_said_fails_where_it_is_bound(mesh):
    """The rank checks a remote function's result against its propagation as it binds it:
    that value fails naming the function, the rank and both metadata; what depends on it
    is poisoned with the same error; the worker lives on."""
    lying = dm.remote(_three_sevens, propagate=lambda x: torch.empty(5))
    with mesh.activate():
        y = lying(torch.zeros(1))
        later = y * 2  # depends on it: poisoned with the same root
        with pytest.raises(dm.RemoteException) as info:
            dm.inspect(y, gpu=1)
        text = str(info.value.traceback or info.value)
        assert "remote function test_integrity._three_sevens on rank " in text
        assert "shape (3,) dtype torch.float32" in text  # what it returned
        assert "shape (5,) dtype torch.float32" in text  # what its propagation said
        assert info.value.seq is not None  # reported by the rank, as RemoteFunctionFailed
        with pytest.raises(dm.RemoteException) as dependent:
            dm.inspect(later, gpu=1)
        assert "_three_sevens" in str(dependent.value.traceback or dependent.value)
        wrong_dtype = dm.remote(
            _three_sevens, propagate=lambda x: torch.empty(3, dtype=torch.int64)
        )
        with pytest.raises(dm.RemoteException, match=r"torch\.int64"):
            dm.inspect(wrong_dtype(torch.zeros(1)), gpu=0)
        assert dm.inspect(torch.ones(2) + 1, gpu=1).tolist() == [2.0, 2.0]  # a good op works


def _meta_result(x):
    return torch.empty(3, device="meta")


def _sparse_result(x):
    return torch.ones(3).to_sparse()


def _strided_view(x):
    return torch.arange(6.0)[::2]  # a view with a stride of 2: dense and strided, fine


@pytest.mark.parametrize(
    "fn, actual",
    [(_meta_result, "on device meta"), (_sparse_result, "layout torch.sparse_coo")],
    ids=["meta", "sparse"],
)
def test_a_result_on_another_device_or_layout_fails_where_it_is_bound(mesh, fn, actual):
    """Shape and dtype are not all a propagation says: the value is a dense tensor on the
    rank's device. One that is not fails at once, instead of breaking a later send."""
    lying = dm.remote(fn, propagate=lambda x: torch.empty(3))
    with mesh.activate():
        y = lying(torch.zeros(1))
        moved = y.slice_mesh(gpu=0).to_mesh(mesh.slice(gpu=1))  # the sender's input failed
    with mesh.slice(gpu=1).activate():
        with pytest.raises(dm.RemoteException, match=actual):
            dm.inspect(moved)
    with mesh.activate():
        assert dm.inspect(torch.ones(2) + 1, gpu=1).tolist() == [2.0, 2.0]
        fine = dm.remote(_strided_view, propagate=lambda x: torch.empty(3))
        assert dm.inspect(fine(torch.zeros(1)), gpu=1).tolist() == [0.0, 2.0, 4.0]


@pytest.mark.exercises("SendTensor")
@pytest.mark.parametrize("device, layout", [("meta", torch.strided), ("cpu", torch.sparse_coo)])
def test_send_tensor_whose_factory_cannot_be_made_is_refused_before_it_runs(ctrl, device, layout):
    _setup_p2p(ctrl)
    ctrl.send([0, 1], call(0, Ref(1), "torch.ones", 2))
    factory = Factory((2,), torch.float32, layout, device)
    with pytest.raises(dm.DeviceException, match="SendTensor of r1.*cannot be made"):
        ctrl.send(
            [0, 1],
            m.SendTensor(Ref(2), Slice(0, [1], [1]), Slice(1, [1], [1]), Ref(1), factory, S0, S0),
        )
        ctrl.sync(timeout=30)
