"""A failure stays inside its controller (DESIGN decision 12).

Meshes share one Client (raw controllers and user-API meshes mixed); one of
them breaks while the others have work in flight: by a fatal error on a rank,
a protocol error, ``close`` mid-run or a lost worker. The others finish their
work with the right values, on the same connection to the scheduler, and keep
working. A controller whose client loses the scheduler, or whose futures are
cancelled under it, fails at once with ``DeviceException``.

These tests break and kill things, so they use their own throw-away cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import dask
import pytest
import torch
from distributed import Client, Future
from helpers.raw import S0, S1, S3, call, create_streams, fetch, values
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.placement import choose_workers, registered_workers
from dask_monarch.messages import Ref

BOTH = [0, 1]
BOUND = 60  # seconds: generous, it only turns a hang into a failure

slow_copy = dm.remote("helpers.remote_fns.slow_copy", propagate=lambda x, seconds: x.clone())
panic = dm.remote("__test_panic", propagate=lambda x: x.clone())


@pytest.fixture(scope="module")
def cluster3(throwaway_cluster):
    with throwaway_cluster(3) as (cluster, client):
        yield cluster, client


@pytest.fixture
def client(cluster3):
    cluster, client = cluster3
    client.wait_for_workers(3, timeout=BOUND)  # a test before may have killed one
    return client


def _budget(dask_worker) -> tuple:
    """The worker's thread budget as (threads, tasks executing, ranks held); a settled worker
    has its configured threads, nothing executing and no rank (no lane holds a slot)."""
    plugin = dask_worker.plugins.get("dask_monarch")
    return (
        dask_worker.state.nthreads,
        len(dask_worker.state.executing),
        sorted(plugin.ranks) if plugin is not None else [],
    )


def _wait_settled(client: Client, workers: list[str], why: str) -> None:
    """Wait until ``workers`` hold no lane, task or rank: the state each test starts from and
    must leave behind, whatever ran before it on this shared cluster."""

    registered = registered_workers(client)  # the threads each started with
    quiet = {a: (registered[a]["nthreads"], 0, []) for a in workers}

    def settled() -> bool:
        return client.run(_budget, workers=workers) == quiet

    wait_until(settled, timeout=BOUND, what=f"{workers} to have their whole thread budget {why}")


# -- meshes that keep working ------------------------------------------------------------------


class RawMesh:
    """A raw controller with work in flight: a slow step, then steps queued behind it."""

    def __init__(self, client: Client, workers: list[str] | None = None) -> None:
        self.ctrl = dm.Controller(client, world_size=2, workers=workers)
        create_streams(self.ctrl, BOTH, S0, S1)
        self.ctrl.send(BOTH, m.CreateDeviceMesh(Ref(50), ["gpu"], dm.ndslice.Slice(0, [2], [1])))
        self.ctrl.send(BOTH, call(0, Ref(1), "torch.zeros", 2))
        self.ctrl.sync(timeout=BOUND)
        self.seq, self.value, self.ref = 1, 0.0, 1

    def start(self) -> None:
        ctrl = self.ctrl
        ctrl.send(
            BOTH,
            call(self.seq, Ref(self.ref + 1), "helpers.remote_fns.slow_copy", Ref(self.ref), 0.5),
        )
        ctrl.flush()
        for i in range(5):  # each its own task, queued behind the slow one
            ref = self.ref + 2 + i
            ctrl.send(
                BOTH,
                call(self.seq + 1 + 2 * i, Ref(ref), "torch.ops.aten.add.Tensor", Ref(ref - 1), 1),
            )
            ctrl.send(BOTH, call(self.seq + 2 + 2 * i, Ref(ref), "torch.ones", 1, stream=S1))
            ctrl.flush()
        self.ref += 6
        self.value += 5
        self.seq += 11

    def finish(self) -> None:
        self.ctrl.send(BOTH, fetch(self.seq, Ref(self.ref)))
        got = values(self.ctrl.sync(timeout=BOUND))
        self.seq += 1
        for rank in BOTH:
            assert torch.equal(got[(self.seq - 1, rank)], torch.full((2,), self.value)), got

    def close(self) -> None:
        self.ctrl.close()


class UserMesh:
    """A user-API mesh with work in flight: a slow remote function, then ops behind it."""

    def __init__(self, client: Client) -> None:
        self.mesh = dm.device_mesh(client, gpu=2)
        with self.mesh.activate():
            self.x = torch.full((2,), 10.0)
            self.side = dm.Stream("side")
        self.value = 10.0
        self.futures: list = []

    def start(self) -> None:
        with self.mesh.activate():
            self.x = slow_copy(self.x, 0.5)
            for _ in range(5):
                self.x = self.x + 1
                self.mesh._session.controller.flush()  # each its own task
            with self.side.activate():
                extra = dm.fetch_shard(torch.ones(1) * 2, gpu=0)
            self.value += 5
            self.futures = [(dm.fetch_shard(self.x, gpu=1), [self.value] * 2), (extra, [2.0])]

    def finish(self) -> None:
        for future, expected in self.futures:
            assert future.result(timeout=BOUND).tolist() == expected

    def close(self) -> None:
        self.mesh.exit()


# -- ways to break a controller ---------------------------------------------------------------


def _victim_raw(client, workers=None) -> RawMesh:
    victim = RawMesh(client, workers)
    victim.start()
    return victim


def break_by_panic(client, order):
    victim = _victim_raw(client)
    victim.ctrl.send(1, call(100, None, "__test_panic"))
    with pytest.raises(dm.DeviceException, match="__test_panic"):
        victim.ctrl.sync(timeout=BOUND)
    victim.close()


def break_by_protocol_error(client, order):
    victim = _victim_raw(client)
    victim.ctrl.send(0, call(100, Ref(100), "torch.ones", 1, stream=S3))  # never created
    with pytest.raises(dm.DeviceException, match="never created"):
        victim.ctrl.sync(timeout=BOUND)
    victim.close()


def break_by_close(client, order):
    victim = _victim_raw(client)
    with dask.config.set({"dask_monarch.timeouts.close": "50ms"}):
        victim.close()  # its work is still running and queued


def break_by_lost_worker(client, order):
    victim = _victim_raw(client, [order[0], order[2]])  # the others do not use order[2]
    pid = client.run(os.getpid, workers=[order[2]])[order[2]]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(dm.DeviceException, match="lost connection"):
        victim.ctrl.sync(timeout=BOUND)
    victim.close()


def break_user_mesh_by_panic(client, order):
    victim = UserMesh(client)
    victim.start()
    with victim.mesh.activate():
        broken = panic(victim.x)
    with pytest.raises(dm.DeviceException, match="__test_panic"):
        dm.inspect(broken)
    with contextlib.suppress(dm.DeviceException):
        victim.close()


BREAKS = [
    break_by_panic,
    break_by_protocol_error,
    break_by_close,
    break_user_mesh_by_panic,
    break_by_lost_worker,
]  # the lost worker last: its restart takes a while


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n_meshes", [2, 4])
@pytest.mark.parametrize("way", BREAKS, ids=lambda f: f.__name__.removeprefix("break_"))
def test_a_broken_mesh_never_touches_the_others_on_its_client(client, way, n_meshes):
    order = choose_workers(client, 3, "auto", None)
    _wait_settled(client, order[:2], "before it starts (an earlier victim may still wind down)")
    kinds = (
        [RawMesh, UserMesh, RawMesh]
        if way is break_user_mesh_by_panic
        else [UserMesh, RawMesh, UserMesh]
    )
    others = [kind(client) for kind in kinds[: n_meshes - 1]]
    try:
        connection = client.scheduler_comm
        for other in others:
            other.start()
        way(client, order)
        broke = time.monotonic()
        for other in others:
            other.finish()  # the work in flight when the victim broke
        for other in others:
            other.start()
            other.finish()  # and new work
        print(
            f"{way.__name__} with {n_meshes} meshes: the others finished "
            f"{time.monotonic() - broke:.2f}s after the break"
        )
        assert client.scheduler_comm is connection  # the shared Client was never dropped
        assert client.status == "running"
    finally:
        for other in others:
            other.close()
    # the surviving workers got their whole thread budget back (a lost worker included)
    _wait_settled(client, order[:2], "back")


# -- the client under a controller ------------------------------------------------------------


def _blocked(client: Client, gate: str) -> dm.Controller:
    """A controller whose lanes wait on ``gate`` (a file the test creates to let them go)."""
    ctrl = dm.Controller(client, world_size=2)
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, None, "helpers.gates.wait_for_file", gate, 3 * BOUND))
    ctrl.send(BOTH, call(1, Ref(1), "torch.ones", 1))
    ctrl.flush()
    return ctrl


@pytest.mark.timeout(300)
def test_futures_cancelled_under_a_controller_fail_it_at_once(client, tmp_path):
    gate = str(tmp_path / "gate")
    survivor = RawMesh(client)
    ctrl = _blocked(client, gate)
    try:
        survivor.start()
        key = ctrl._tails[(0, 0)]  # the scheduler holds it for the controller, by key
        start = time.monotonic()
        client.cancel([Future(key, client)])  # another user's cancel: not theirs, kept
        time.sleep(0.5)
        assert ctrl._broken is None
        client.cancel([Future(key, client)], force=True)  # forced: the work is lost
        with pytest.raises(dm.DeviceException, match="cancelled") as info:
            ctrl.sync(timeout=BOUND)
        print(f"broke {time.monotonic() - start:.2f}s after the cancel: {info.value}")
        assert info.value.rank == 0
        survivor.finish()
        survivor.start()
        survivor.finish()
    finally:
        open(gate, "w").close()
        ctrl.close()
        survivor.close()


@pytest.mark.timeout(300)
def test_a_client_that_loses_its_scheduler_fails_its_meshes_at_once(cluster3, tmp_path):
    cluster, _ = cluster3
    gate = str(tmp_path / "gate")
    with Client(cluster.scheduler_address, set_as_default=False) as own:
        ctrl = _blocked(own, gate)
        mesh = UserMesh(own)
        try:
            mesh.start()
            start = time.monotonic()
            own.scheduler_comm.comm.abort()  # the connection drops (the client reconnects)
            with pytest.raises(dm.DeviceException, match="connection to the scheduler"):
                ctrl.sync(timeout=BOUND)
            with pytest.raises(dm.DeviceException, match="connection to the scheduler"):
                mesh.finish()
            print(f"both broke within {time.monotonic() - start:.2f}s")
        finally:
            open(gate, "w").close()
            ctrl.close()
            with contextlib.suppress(dm.DeviceException):
                mesh.close()
