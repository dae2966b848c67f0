"""Clean stops: Ctrl-C, a closed client, a killed scheduler and interpreter exit end promptly
with one clear message; rank workers survive SIGINT; a shared cluster's settings stay its own.

Tests that signal or kill processes use throw-away clusters (module fixtures), never the
shared session clusters; bounds are generous (they turn a hang into a failure, they do not
measure speed: the times are printed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from distributed import Client
from helpers.commands import child_environ, console_script
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch.controller.placement import registered_workers
from dask_monarch.protocol import names


def wait_for_line(process: subprocess.Popen, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if text in line:
            return
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError(
        f"no {text!r} from the child (exit {process.poll()}): {process.stderr.read()[-3000:]}"
    )


def gone(processes: list[psutil.Process], timeout: float) -> list[int]:
    """The pids among ``processes`` still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p.pid for p in processes if p.is_running() and p.status() != "zombie"]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


# -------------------------------------------------------------- Ctrl-C under dask-monarch run

LONG_SCRIPT = """\
import torch
import distributed
import dask_monarch as dm

mesh = dm.device_mesh(distributed.default_client(), gpu=2)
with mesh.activate():
    x = torch.ones(4)
    step = 0
    while True:  # a long run, stopped by Ctrl-C
        x = x + 1
        if step % 20 == 0:
            dm.inspect(x.sum())
            if step == 0:
                print("ready", flush=True)
        step += 1
"""


def _as_a_terminals_job() -> None:
    """Ctrl-C as a terminal delivers it: whatever started the test suite (a CI runner, a
    background job, ``time``) may have left SIGINT ignored or blocked, which every child
    inherits; a shell's foreground job has neither."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted_run(tmp_path: Path, name: str, script: str) -> tuple:
    """Run ``script`` under ``dask-monarch run`` in a process group of its own (a terminal's
    foreground job: the SIGINT reaches every process) and press Ctrl-C once it printed
    ``ready``: its exit code, its stderr, the processes it had started, the seconds it took."""
    (tmp_path / name).write_text(script)
    command = [console_script(), "run", "--ranks", "2", "--device", "cpu", "-q", name]
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=child_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        preexec_fn=_as_a_terminals_job,
    )
    try:
        wait_for_line(process, "ready", timeout=180)
        time.sleep(1)
        children = psutil.Process(process.pid).children(recursive=True)
        start = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, err, children, took


@pytest.mark.timeout(300)
def test_ctrl_c_stops_dask_monarch_run_promptly_with_one_message(tmp_path):
    code, err, children, took = interrupted_run(tmp_path, "long.py", LONG_SCRIPT)
    print(f"dask-monarch run stopped {took:.1f}s after Ctrl-C")
    assert len(children) >= 3  # the scheduler and the rank workers (at least)
    assert code == 130, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dask-monarch: interrupted (Ctrl-C) at long.py:"), err
    assert gone(children, timeout=30) == []  # nothing of the embedded cluster is left


FINALIZER_SCRIPT = """\
import time
import torch
import distributed
import dask_monarch as dm


class Slow:
    def __del__(self):  # where a Ctrl-C lands, most of the time
        time.sleep(0.2)


mesh = dm.device_mesh(distributed.default_client(), gpu=2)
with mesh.activate():
    x = torch.ones(4)
    dm.inspect(x)
    print("ready", flush=True)
    while True:
        x = x + 1
        Slow()
"""


@pytest.mark.timeout(300)
def test_a_ctrl_c_that_lands_in_a_finalizer_still_stops_the_script(tmp_path):
    """Python ignores an exception raised in ``__del__`` (it only prints it): a Ctrl-C that
    arrives while a finalizer runs was lost, and ``dask-monarch run`` went on for good. It is
    delivered again, once the finalizer returned."""
    code, err, children, _ = interrupted_run(tmp_path, "finalizer.py", FINALIZER_SCRIPT)
    assert code == 130, err
    assert err.strip().splitlines()[-1].startswith("dask-monarch: interrupted (Ctrl-C)"), err
    assert gone(children, timeout=30) == []


# --------------------------------------------------------------- rank workers survive SIGINT


@pytest.fixture(scope="module")
def own_cluster(throwaway_cluster):
    """A throw-away 2-rank cluster: these tests signal its workers."""
    with throwaway_cluster(2) as (cluster, client):
        yield cluster, client


def worker_pids(client) -> dict:
    return client.run(os.getpid)


@pytest.mark.timeout(180)
def test_a_rank_worker_survives_sigint_and_serves_the_next_mesh(own_cluster):
    cluster, client = own_cluster
    pids = worker_pids(client)
    for pid in pids.values():
        os.kill(pid, signal.SIGINT)
    time.sleep(3)  # time to die, if it were going to
    assert worker_pids(client) == pids
    assert len(registered_workers(client)) == 2
    mesh = dm.device_mesh(client, gpu=2)
    try:
        with mesh.activate():
            assert dm.inspect(torch.ones(2) * 3).tolist() == [3.0, 3.0]
    finally:
        mesh.exit()
    assert worker_pids(client) == pids


@pytest.mark.timeout(180)
def test_interrupt_main_in_a_remote_function_costs_no_rank(own_cluster):
    _, client = own_cluster
    pids = worker_pids(client)
    mesh = dm.device_mesh(client, gpu=2)
    try:
        with mesh.activate():
            interrupt = dm.remote("helpers.remote_fns.interrupt_main_then", propagate=lambda x: x)
            x = interrupt(torch.ones(2))
            assert dm.inspect(x).tolist() == [2.0, 2.0]  # the call ran to its end
            time.sleep(2)
            assert dm.inspect(x * 2).tolist() == [4.0, 4.0]
    finally:
        mesh.exit()
    assert worker_pids(client) == pids


@pytest.mark.timeout(180)
def test_keyboard_interrupt_in_a_remote_function_is_that_calls_error(own_cluster):
    _, client = own_cluster
    mesh = dm.device_mesh(client, gpu=2)
    try:
        with mesh.activate():
            raising = dm.remote(
                "helpers.remote_fns.raise_keyboard_interrupt", propagate=lambda x: x
            )
            bad = raising(torch.ones(2))
            with pytest.raises(dm.RemoteException, match="KeyboardInterrupt"):
                dm.inspect(bad)
            assert dm.inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]  # the mesh carries on
    finally:
        mesh.exit()


# ------------------------------------------------------ a closed client, a killed scheduler


@pytest.mark.timeout(180)
def test_client_closed_before_mesh_exit_ends_with_one_clear_error(own_cluster):
    cluster, _ = own_cluster
    client = Client(cluster)
    mesh = dm.device_mesh(client, gpu=2)
    with mesh.activate():
        assert dm.inspect(torch.ones(1)).item() == 1
    token = mesh._session.controller.token
    client.close()
    start = time.monotonic()
    with pytest.raises(dm.DeviceException, match="Client was closed") as info:
        mesh.exit()
    assert time.monotonic() - start < 60 and info.value.rank is None
    with Client(cluster) as other:  # the ranks were released

        def released() -> bool:
            held = other.run(lambda dask_worker: list(dask_worker.plugins["dask_monarch"].ranks))
            return not any(token in tokens for tokens in held.values())

        wait_until(released, 30, f"the workers to release controller {token}", every=0.2)


@pytest.mark.timeout(240)
def test_a_killed_scheduler_is_reported_as_such_and_the_cluster_closes():
    cluster = dm.LocalMeshCluster(n_ranks=2, device="cpu")
    client = Client(cluster)
    try:
        mesh = dm.device_mesh(client, gpu=2)
        with mesh.activate():
            x = torch.ones(2) + 1
            assert dm.inspect(x).tolist() == [2.0, 2.0]
            os.kill(cluster.scheduler.process.pid, signal.SIGKILL)
            with pytest.raises(
                dm.DeviceException, match="lost the connection to the scheduler"
            ) as info:
                dm.inspect(x * 2)
        assert info.value.rank is None  # not a lost rank
        with pytest.raises(dm.DeviceException, match="scheduler"):
            mesh.exit()
    finally:
        client.close()
        start = time.monotonic()
        cluster.close()
        took = time.monotonic() - start
    print(f"the cluster closed {took:.1f}s after its scheduler was killed")
    assert took < 25  # Dask alone waits 30 s per request to the dead scheduler


# ----------------------------------------------------------------- interpreter exit


EXIT_SCRIPT = """\
import sys
import torch
from distributed import Client
import dask_monarch as dm

client = Client(sys.argv[1])
mesh = dm.device_mesh(client, gpu=2)
with mesh.activate():
    x = torch.ones(3) + 1
    dm.inspect(x)
print("mesh", mesh._session.controller.mesh_id, flush=True)
# no mesh.exit(), no client.close(): the interpreter exits with the mesh open
"""


@pytest.mark.timeout(180)
def test_interpreter_exit_with_an_open_mesh_releases_it_with_one_message(own_cluster, tmp_path):
    cluster, client = own_cluster
    (tmp_path / "leave.py").write_text(EXIT_SCRIPT)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "leave.py", cluster.scheduler_address],
        cwd=tmp_path,
        env=child_environ(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    print(f"the script with an open mesh took {took:.1f}s")
    assert done.returncode == 0, done.stderr
    mesh_id = done.stdout.split()[-1]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "still open at interpreter exit" in lines[0], done.stderr
    assert mesh_id in lines[0] and "call mesh.exit()" in lines[0]
    held = client.run(lambda dask_worker: list(dask_worker.plugins["dask_monarch"].ranks))
    assert not any(mesh_id == names.mesh_id(t) for ts in held.values() for t in ts)  # released


# ------------------------------------------------------------ a shared cluster's settings


def gaps(client) -> tuple[dict, dict, dict]:
    """The batched-send gaps: scheduler->worker, scheduler->client, worker->scheduler."""

    def on_scheduler(dask_scheduler=None):
        return (
            {a: c.interval for a, c in dask_scheduler.stream_comms.items()},
            {c: b.interval for c, b in dask_scheduler.client_comms.items()},
        )

    to_workers, to_clients = client.run_on_scheduler(on_scheduler)
    from_workers = client.run(lambda dask_worker: dask_worker.batched_stream.interval)
    return to_workers, to_clients, from_workers


@pytest.mark.timeout(240)
def test_a_controller_leaves_a_shared_clusters_gaps_alone(tmp_path, throwaway_cluster):
    shared = throwaway_cluster(2, plain=True, dashboard_address="127.0.0.1:0")
    with shared as (cluster, observer):
        before = gaps(observer)
        with Client(cluster.scheduler_address) as client:
            own_gap = client.scheduler_comm.interval
            with dm.Controller(client, world_size=2) as ctrl:
                assert client.scheduler_comm.interval <= 0.001  # its own client's gap is lowered
                assert gaps(observer)[0] == before[0] and gaps(observer)[2] == before[2]
                assert ctrl.sync() == []
            assert client.scheduler_comm.interval == own_gap  # and given back
        after = gaps(observer)
        assert after[0] == before[0]  # scheduler -> workers
        assert after[2] == before[2]  # workers -> scheduler
        assert after[1][observer.id] == before[1][observer.id]  # scheduler -> another client


def test_local_mesh_cluster_lowers_its_own_gaps_from_the_start(own_cluster):
    _, client = own_cluster
    to_workers, to_clients, from_workers = gaps(client)
    assert set(to_workers.values()) == {0.001}
    assert to_clients[client.id] == 0.001
    assert set(from_workers.values()) == {0.001}
