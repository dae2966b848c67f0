"""Smaller mistakes get a clear error before anything runs (issue 35 item 7)."""

from __future__ import annotations

import contextlib
import re
import time

import dask
import pytest
import torch
from helpers.raw import S0, create_streams

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Factory, Ref
from dask_monarch.ndslice import Slice

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_an_average_of_integers_is_refused_on_the_client(mesh2, dtype):
    with mesh2.activate():
        x = torch.ones(4, dtype=dtype)
        with pytest.raises(TypeError, match=f"avg.*{str(dtype).removeprefix('torch.')}"):
            x.reduce("gpu", "avg")
        with pytest.raises(TypeError, match="avg"):
            x.reduce_("gpu", "avg")
        assert dm.inspect(torch.ones(2).reduce("gpu", "avg")).tolist() == [1.0, 1.0]


def test_a_raw_integer_average_is_refused_before_dispatch(ctrl):
    create_streams(ctrl, [0, 1], S0)
    ctrl.send([0, 1], m.CreateDeviceMesh(Ref(1), ["gpu"], Slice.row_major([2])))
    ctrl.send([0, 1], m.BackendNetworkInit())
    ctrl.send([0, 1], m.SplitComm(["gpu"], Ref(1), S0))
    factory = Factory((2,), torch.int64, torch.strided, "cpu")
    with pytest.raises(dm.DeviceException, match="Reduce of r3: avg of torch.int64"):
        ctrl.send(
            [0, 1],
            m.Reduce(
                Ref(3), Ref(2), factory, Ref(1), S0, ["gpu"], m.ReduceOp.AVG, False, False, None
            ),
        )
        ctrl.sync(timeout=60)


def test_a_mesh_over_ranks_the_controller_does_not_have_is_refused(ctrl):
    create_streams(ctrl, [0, 1], S0)
    with pytest.raises(dm.DeviceException, match=r"CreateDeviceMesh r1: .*ranks \[2, 3\]"):
        ctrl.send([0, 1], m.CreateDeviceMesh(Ref(1), ["gpu"], Slice.row_major([4])))
        ctrl.sync(timeout=60)


def test_a_reduce_over_a_dim_the_mesh_lacks_says_so(ctrl):
    create_streams(ctrl, [0, 1], S0)
    ctrl.send([0, 1], m.CreateDeviceMesh(Ref(1), ["gpu"], Slice.row_major([2])))
    ctrl.send([0, 1], m.BackendNetworkInit())
    factory = Factory((2,), torch.float32, torch.strided, "cpu")
    with pytest.raises(
        dm.DeviceException, match=r"mesh r1 \(dims \['gpu'\]\) has no dims \['host'\]"
    ):
        ctrl.send(
            [0, 1],
            m.Reduce(
                Ref(3), Ref(2), factory, Ref(1), S0, ["host"], m.ReduceOp.SUM, False, False, None
            ),
        )
        ctrl.sync(timeout=60)


@pytest.mark.parametrize("timeout", [-1, float("nan"), "1"])
def test_a_wait_with_a_timeout_that_is_no_duration_is_refused(ctrl, mesh2, timeout):
    with pytest.raises((ValueError, TypeError), match="timeout"):
        ctrl.sync(timeout=timeout)
    with pytest.raises((ValueError, TypeError), match="timeout"):
        ctrl.drain(timeout=timeout)
    with pytest.raises((ValueError, TypeError), match="timeout"):
        ctrl.get_ref(0, Ref(1), S0, timeout=timeout)
    with pytest.raises((ValueError, TypeError), match="timeout"):
        mesh2.exit(timeout=timeout)
    assert ctrl.sync(timeout=60) == []


_sleep_on = dm.remote("helpers.remote_fns.sleep_on", propagate=lambda x, r, s, secs: x)


@contextlib.contextmanager
def _mesh_with_a_3s_collective_timeout(client):
    """A gpu=2 mesh under a 3 s collective timeout, exited afterwards (it may be broken)."""
    with dask.config.set({"dask_monarch.timeouts.collective": "3s"}):
        mesh = dm.device_mesh(client, gpu=2)
    try:
        yield mesh
    finally:
        with contextlib.suppress(dm.DeviceException, dm.RemoteException):
            mesh.exit()


def _use_the_workers_first(client) -> None:
    """Two meshes come and go on ``client``'s workers (the order in which the lazily
    connected gloo waits below were seen to outlast their timeout)."""
    for _ in range(2):
        mesh = dm.device_mesh(client, gpu=2)
        with mesh.activate():
            dm.inspect(torch.ones(2) + 1)
        mesh.exit()


def _reduce_with_a_late_member(client) -> tuple[dm.DeviceException, float]:
    """A reduce under a 3 s collective timeout whose rank 1 sleeps 12 s first: the
    DeviceException it raises, and the seconds it took."""
    with _mesh_with_a_3s_collective_timeout(client) as mesh, mesh.activate():
        x = _sleep_on(torch.ones(2), mesh.rank("gpu"), 1, 12.0)
        start = time.monotonic()
        with pytest.raises(dm.DeviceException) as info:
            dm.inspect(x.reduce("gpu", "sum"))
        return info.value, time.monotonic() - start


def test_a_collective_that_times_out_names_the_member_it_waited_for(client2):
    error, _ = _reduce_with_a_late_member(client2)
    text = str(error)
    assert error.rank == 0, text  # the rank whose collective timed out
    assert "rank 1 stream" in text and "in sleep_on (" in text, text  # and the late one


@pytest.mark.timeout(120)
def test_a_collective_times_out_when_other_meshes_used_the_workers_before(client2):
    """The same wait after two meshes came and went on these workers: the ports the run
    draws make rank 0 the side of its lazily connected gloo pair that waits for rank 1 to
    connect, and gloo's op then waited out rank 1's 12 s sleep (it failed in this order,
    and passed alone). The rank's own deadline ends it at the timeout (groups.finish)."""
    _use_the_workers_first(client2)
    error, seconds = _reduce_with_a_late_member(client2)
    assert re.search("[Tt]imed out", str(error)), str(error)
    assert seconds < 9.0  # not the 12 s of the sleep


def test_a_first_send_to_a_late_receiver_ends_at_its_timeout_or_when_it_arrives(client2):
    """A late member for a send: rank 1 receives only after an 8 s sleep, over a pair
    that lazily connected gloo has not connected yet (meshes came and went on these
    workers first), under a 3 s collective timeout. Gloo's send usually times out at 3 s
    (a DeviceException that says so); on some runs it waits for the receiver, as a
    collective's member waiting to connect did (groups.finish), and the value then
    arrives intact once the receiver is there. Either way nothing hangs and nothing is
    wrong; the second case is why a send's wait is not bounded by the timeout."""
    _use_the_workers_first(client2)
    with _mesh_with_a_3s_collective_timeout(client2) as mesh:
        sender, receiver = mesh.slice(gpu=0), mesh.slice(gpu=1)
        with sender.activate():
            x = torch.ones(2) + 1
        with receiver.activate():
            _sleep_on(torch.ones(2), 0, 0, 8.0)  # the receiving lane is busy first
        start = time.monotonic()
        moved = x.to_mesh(receiver)
        with receiver.activate():
            try:
                got = dm.inspect(moved + 1)
            except dm.DeviceException as e:
                assert time.monotonic() - start < 7.0, str(e)  # at the timeout, not the sleep
                assert re.search("[Tt]imed out", str(e)), str(e)
            else:
                assert got.tolist() == [3.0, 3.0]
                assert time.monotonic() - start >= 7.0  # it waited for the receiver


@pytest.mark.timeout(40, func_only=True)
def test_a_call_reaching_only_some_members_of_its_process_group_is_refused(mesh2):
    """Rank 0 alone would wait for rank 1 in the group's collectives (in the call's start
    exchange, before the function runs) until the collective timeout."""
    pg_collectives = dm.remote(
        "helpers.remote_fns.pg_collectives",
        propagate=lambda x, pg, mesh: (x.clone(), torch.stack([x, x]), x.clone(), x.clone(), 0, 0),
    )
    pg = mesh2.process_group("gpu")
    alone = mesh2.slice(gpu=0)
    with alone.activate():
        with pytest.raises(TypeError, match=r"GROUP_MEMBERS: .*members \[0, 1\].*ranks \[0\]"):
            pg_collectives(torch.ones(2), pg, mesh2)
    with mesh2.activate():  # nothing was sent: the group serves the whole mesh
        total, *_ = pg_collectives(torch.ones(2), pg, mesh2)
        assert dm.inspect(total, gpu=1).tolist() == [2.0, 2.0]
