"""Liveness: a frozen rank fails its mesh, a stuck lane is named once, timeouts say the same.

The frozen-rank tests stop a worker process (SIGSTOP), so they run on their own
throw-away cluster; the stuck-lane tests only hold a lane at a gate and run on
the shared 2-rank cluster.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import dask.config
import pytest
import torch
from helpers.raw import S0, S1, S2, call, create_streams, fetch
from helpers.waiting import wait_until
from helpers.workers import frozen

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Ref
from dask_monarch.ndslice import Slice

BOTH = [0, 1]
# short clocks: a heartbeat every 200 ms, a silent rank fails after 3 s ...
FROZEN = {"dask_monarch.timeouts.heartbeat": "200ms", "dask_monarch.timeouts.unresponsive": "3s"}
# ... a stalled lane warns after 2 s (a loaded machine may slow a worker, never for a minute)
STUCK = {
    "dask_monarch.timeouts.heartbeat": "200ms",
    "dask_monarch.timeouts.unresponsive": "60s",
    "dask_monarch.timeouts.liveness": "2s",
}


@pytest.fixture(scope="module")
def frozen_client(throwaway_cluster):
    with throwaway_cluster(2) as (_, client):
        yield client


def liveness_warnings(caught) -> list[dm.LivenessWarning]:
    return [w.message for w in caught if issubclass(w.category, dm.LivenessWarning)]


# -------------------------------------------------------------------------------- frozen ranks


@pytest.mark.timeout(300)
def test_a_frozen_rank_fails_the_controller_naming_it(frozen_client):
    with dask.config.set(FROZEN):
        ctrl = dm.Controller(frozen_client, world_size=2)
    try:
        create_streams(ctrl, BOTH, S0)
        ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
        assert ctrl.sync(timeout=60) == []
        with frozen(frozen_client, ctrl.workers[1]):
            start = time.monotonic()
            ctrl.send(BOTH, call(1, Ref(2), "torch.ones", 2))
            with pytest.raises(dm.DeviceException) as info:
                ctrl.sync(timeout=120)
            elapsed = time.monotonic() - start
        print(f"a frozen rank failed its controller after {elapsed:.1f}s (unresponsive: 3s)")
        assert info.value.rank == 1
        assert "heartbeat" in info.value.cause and ctrl.workers[1] in info.value.cause
        assert 2.5 < elapsed < 60  # the configured 3 s, not a TCP timeout and never a hang
        with pytest.raises(dm.DeviceException):
            ctrl.send(0, call(2, Ref(3), "torch.ones", 1))
    finally:
        start = time.monotonic()
        ctrl.close()
        assert time.monotonic() - start < 30
    # the stopped worker carries on and serves a new controller
    with dm.Controller(frozen_client, world_size=2) as fresh:
        create_streams(fresh, BOTH, S0)
        fresh.send(BOTH, call(0, Ref(1), "torch.ones", 1))
        assert fresh.sync(timeout=60) == []


@pytest.mark.timeout(300)
def test_inspect_on_a_frozen_rank_raises_device_exception(frozen_client):
    with dask.config.set(FROZEN):
        mesh = dm.device_mesh(frozen_client, gpu=2)
    try:
        with mesh.activate():
            x = torch.ones(3)
            assert dm.inspect(x, gpu=1).tolist() == [1.0, 1.0, 1.0]
            with frozen(frozen_client, mesh._session.controller.workers[1]):
                start = time.monotonic()
                with pytest.raises(dm.DeviceException) as info:
                    dm.inspect(x + 1, gpu=1)  # no timeout: the heartbeat ends the wait
                elapsed = time.monotonic() - start
        print(f"dm.inspect on a frozen rank raised after {elapsed:.1f}s")
        assert info.value.rank == 1 and "heartbeat" in str(info.value)
        assert elapsed < 60
    finally:
        with contextlib.suppress(dm.DeviceException):
            mesh.exit()


# -------------------------------------------------------------------------------- stuck lanes


@pytest.mark.timeout(300)
def test_a_lane_blocked_on_a_borrow_gets_one_warning_and_timeouts_say_the_same(
    client2, tmp_path, caplog
):
    gate = tmp_path / "gate"
    with dask.config.set(STUCK):
        ctrl = dm.Controller(client2, world_size=2)
    try:
        create_streams(ctrl, BOTH, S0, S1)
        ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
        assert ctrl.sync(timeout=60) == []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                # rank 0: the lender is held at a gate before its BorrowCreate, so the borrower
                # stream waits at its first use, before the fetch of seq 2
                ctrl.send(0, call(1, None, "helpers.gates.wait_for_file", str(gate), 120))
                ctrl.send(0, m.BorrowCreate(Ref(2), 1, Ref(1), S0, S1))
                ctrl.send(0, m.BorrowFirstUse(1))
                ctrl.send(0, fetch(2, Ref(2), stream=S1))
                ctrl.send(0, m.BorrowLastUse(1))
                ctrl.send(0, m.BorrowDrop(1))
                ctrl.flush()
                wait_until(lambda: liveness_warnings(caught), what="a LivenessWarning")
                time.sleep(3 * 2.0)  # three more liveness periods of the same stall
                with pytest.raises(TimeoutError) as sync_timeout:
                    ctrl.sync(timeout=0.5)
                with pytest.raises(TimeoutError) as read_timeout:
                    ctrl.get_ref(0, Ref(2), S1, timeout=0.5)
                lanes = {(lane["rank"], lane["lane"]): lane for lane in ctrl.lanes()}
            finally:
                gate.touch()
            assert [type(r) for r in ctrl.sync(timeout=60)] == [m.FetchResult]
        (warning,) = liveness_warnings(caught)  # one stall, one warning
        assert (warning.rank, warning.stream, warning.seq) == (0, 1, 2)
        assert warning.waiting_on == "borrow 1 (the lender's BorrowCreate)"
        text = str(warning)
        assert text.startswith("rank 0, stream 1 has completed no message for ")
        assert "before seq 2: waiting" in text and "on borrow 1 (the lender's BorrowCreate)" in text
        # the lender, stuck with it, is in the same warning: where its call is
        assert "rank 0, stream 0 has completed no message" in text
        assert "seq 1: running for" in text and "in wait_for_file (" in text
        assert len(warning.stalls) == 2
        assert any(
            "LivenessWarning" not in r.getMessage()
            and "rank 0, stream 1 has completed" in r.getMessage()
            for r in caplog.records
            if r.name.startswith("dask_monarch")
        )
        # the timeouts say the same
        for timeout in (sync_timeout, read_timeout):
            assert "rank 0, stream 1" in str(timeout.value)
            assert "before seq 2: waiting" in str(timeout.value)
            assert "borrow 1 (the lender's BorrowCreate)" in str(timeout.value)
        assert "wait_for_file" in str(sync_timeout.value)  # and what holds the lender
        stuck = lanes[(0, 1)]
        assert stuck["state"] == "waiting" and stuck["next_seq"] == 2
        assert stuck["stalled_for"] >= 2.0 and "borrow 1" in stuck["status"]
        assert lanes[(1, 1)]["state"] == "idle" and lanes[(1, 1)]["stalled_for"] == 0.0
    finally:
        ctrl.close()


@pytest.mark.timeout(300)
def test_a_reduce_sent_to_some_members_names_the_missing_peers(client2, tmp_path):
    """A collective that one member never got: the warning comes well before the collective's
    own timeout and says which peer is not there, and what it does instead."""
    with dask.config.set({**STUCK, "dask_monarch.timeouts.collective": "20s"}):
        ctrl = dm.Controller(client2, world_size=2)
    mesh_ref = Ref(100)
    try:
        create_streams(ctrl, BOTH, S0)
        ctrl.send(BOTH, m.CreateDeviceMesh(mesh_ref, ["gpu"], dm.ndslice.Slice(0, [2], [1])))
        ctrl.send(BOTH, m.BackendNetworkInit())
        ctrl.send(BOTH, m.SplitComm(["gpu"], mesh_ref, S0))
        ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
        assert ctrl.sync(timeout=60) == []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = time.monotonic()
            factory = m.Factory((2,), torch.float32, torch.strided, "cpu")
            ctrl.send(
                0,
                m.Reduce(
                    Ref(2),
                    Ref(1),
                    factory,
                    mesh_ref,
                    S0,
                    ["gpu"],
                    m.ReduceOp.SUM,
                    False,
                    False,
                    None,
                ),
            )
            ctrl.flush()
            (warning,) = wait_until(lambda: liveness_warnings(caught), what="a LivenessWarning")
            elapsed = time.monotonic() - start
            print(f"the partial Reduce was reported after {elapsed:.1f}s")
            assert elapsed < 20  # before the collective's own timeout (20 s here, 60 s default)
            assert (warning.rank, warning.stream) == (0, 0)
            assert warning.waiting_on == (
                "all-reduce (sum) over ['gpu'] of mesh r100 with ranks 0, 1"
            )
            assert (
                "still waiting for rank 1 stream 0 (idle after seq 0: it has run everything "
                "sent to it)"
            ) in str(warning)
            # then the collective's own timeout fails the mesh: the lane does not outlive it
            with pytest.raises(dm.DeviceException, match="Reduce over"):
                ctrl.sync(timeout=120)
        assert len(liveness_warnings(caught)) == 1
    finally:
        ctrl.close()


@pytest.mark.timeout(300)
def test_waits_on_a_pipe_a_borrow_and_a_copy_are_named_and_end_with_their_controller(client2):
    """Three lanes of rank 0 wait on each other behind a pipe whose producer never sends: the
    warning names each wait; when the controller fails, every one of them gives up."""
    with dask.config.set(STUCK):
        ctrl = dm.Controller(client2, world_size=2)
    pipe, one_rank = Ref(901), Slice.row_major([1])
    factory = m.Factory((3,), torch.float32, torch.strided, "cpu")
    try:
        create_streams(ctrl, BOTH, S0, S1, S2)
        ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
        ctrl.send(0, m.CreateDeviceMesh(Ref(900), ["dp"], one_rank))
        ctrl.send(
            0,
            m.CreatePipe(
                pipe,
                "echo",
                "helpers.remote_fns.echo_loader",
                1,
                Ref(900),
                m.ArgsKwargs.from_python((), {}),
            ),
        )
        assert ctrl.sync(timeout=60) == []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctrl.send(0, m.PipeRecv(1, [Ref(2)], pipe, S0))  # the echo producer never sends
            ctrl.send(0, m.BorrowCreate(Ref(3), 1, Ref(1), S0, S1))
            ctrl.send(0, m.BorrowFirstUse(1))
            ctrl.send(0, m.SendTensor(Ref(4), one_rank, one_rank, Ref(1), factory, S0, S2))
            ctrl.flush()
            (warning,) = wait_until(lambda: liveness_warnings(caught), what="a LivenessWarning")
        text = str(warning)
        assert "rank 0, stream 0 has completed no message for " in text
        assert (
            "seq 1: waiting" in text
            and "on pipe 'echo' (its producer on this rank has not sent a value)" in text
        )
        assert "on borrow 1 (the lender's BorrowCreate)" in text
        assert (
            "on the copy of r1 from stream 0; still waiting for rank 0 stream 0 (seq 1: "
            "waiting" in text
        )
        with pytest.raises(dm.DeviceException, match="__test_panic"):
            ctrl.send(1, call(2, None, "__test_panic"))
            ctrl.sync(timeout=60)
        token, address = ctrl.token, ctrl.workers[0]

        def busy_lane_threads(dask_worker=None) -> list[str]:
            """The controller's lane threads still inside dask_monarch (a wait, a segment)."""
            import sys
            import threading

            frames, busy = sys._current_frames(), []
            for thread in threading.enumerate():
                frame = frames.get(thread.ident)
                while thread.name.startswith(f"monarch-{token}") and frame is not None:
                    if "dask_monarch" in frame.f_code.co_filename:
                        busy.append(thread.name)
                        break
                    frame = frame.f_back
            return busy

        wait_until(
            lambda: client2.run(busy_lane_threads, workers=[address])[address] == [],
            what="rank 0's waiting lanes to give up",
        )
    finally:
        ctrl.close()


@pytest.mark.timeout(300)
def test_mesh_future_result_timeout_names_the_stuck_lane(client2, tmp_path):
    gate = tmp_path / "gate"
    hold = dm.remote("helpers.gates.wait_for_file", propagate=lambda path, timeout: None)
    with dask.config.set(STUCK):
        mesh = dm.device_mesh(client2, gpu=2)
    try:
        with mesh.activate():
            x = torch.ones(2)
            assert dm.inspect(x).tolist() == [1.0, 1.0]
            try:
                hold(str(gate), 120)
                future = dm.fetch_shard(x, gpu=1)
                controller = mesh._session.controller
                wait_until(
                    lambda: any(
                        lane["rank"] == 1 and lane["state"] == "running"
                        for lane in controller.lanes()
                    ),
                    what="the gate to run on rank 1",
                )
                with pytest.raises(TimeoutError) as info:
                    future.result(timeout=1.5)
                with pytest.raises(TimeoutError) as inspected:
                    dm.inspect(x, gpu=0, timeout=0.5)
            finally:
                gate.touch()
            assert future.result(timeout=60).tolist() == [1.0, 1.0]
        text = str(info.value)
        assert text.startswith(f"the fetch of seq {future.seq} did not resolve within 1.5s: ")
        assert "rank 1, stream" in text and "running for" in text
        assert "wait_for_file" in text
        assert "rank 0, stream" in str(inspected.value)
    finally:
        mesh.exit(timeout=60)


def test_liveness_warning_is_public_and_a_user_warning():
    assert issubclass(dm.LivenessWarning, UserWarning)
    warning = dm.LivenessWarning("text", rank=1, stream=2, seq=3, waiting_on="borrow 4")
    assert (warning.rank, warning.stream, warning.seq, warning.waiting_on) == (1, 2, 3, "borrow 4")
