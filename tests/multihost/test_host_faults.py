"""Faults across hosts: a host cut off the network mid-run, its return, the scheduler killed.

Three namespace hosts, one rank worker each, supervised as docs/deployment.md
says. The tests run in file order and share the hosts: the partition, then
what the remaining hosts can do, then the healed host, then the scheduler's
death (last: it ends the cluster). Each prints the time it measured.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import dask
import probes
import pytest
import torch
from conftest import exit_quietly, make_hosts, wait_for_host

import dask_monarch as dm
from dask_monarch.controller.placement import registered_workers

# The tests are phases of one run on shared hosts, in file order (above): never shuffled.
pytestmark = pytest.mark.random_order(disabled=True)

COLLECTIVE_TIMEOUT = 15.0  # seconds; the default (60 s) would only make the test slower
WORKER_TTL = "20s"  # the scheduler drops a silent worker after this (Dask's default: 5 min)
times: dict[str, float] = {}


@pytest.fixture(scope="module")
def hosts_client():
    with dask.config.set({"dask_monarch.timeouts.collective": f"{COLLECTIVE_TIMEOUT}s"}):
        yield from make_hosts(
            3, 1, tag="f", scheduler_env={"DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": WORKER_TTL}
        )


@pytest.fixture(scope="module")
def state():
    return {}


def _report(name: str, seconds: float) -> None:
    times[name] = seconds
    print(f"\n[multihost] {name}: {seconds:.1f}s")


@pytest.mark.timeout(300)
def test_partition_fails_the_controller_naming_the_rank(hosts_client, state):
    """Host 2 drops off the network while ranks 0 and 1 wait for it in a collective."""
    hosts, client = hosts_client
    full = dm.device_mesh(client, host=3)
    other = dm.device_mesh(client, workers=["h0w0", "h1w0"], host=2)  # not on host 2
    lost = full._session.controller.workers[2]
    state.update(full=full, other=other, token=full._session.controller.token, lost=lost)
    assert hosts.host_of(lost) == 2
    state["pid"] = client.run(probes.pid, workers=[lost])[lost]
    with full.activate():
        x = torch.ones(4)
        dm.inspect(x)  # everything set up before the cut
        with full.slice(host=2).activate():
            dm.remote("time.sleep", propagate=lambda s: None)(3.0)
        total = x.reduce("host", "sum")  # ranks 0 and 1 wait in it for rank 2
        fut = dm.fetch_shard(total, {"host": 0})
    time.sleep(1.0)
    cut = time.monotonic()
    hosts.partition(2)
    state["cut"] = cut
    with pytest.raises(dm.DeviceException) as info:
        fut.result(timeout=120)
    _report("partition -> DeviceException", time.monotonic() - cut)
    assert info.value.rank == 2, info.value
    assert "heartbeat" in str(info.value)

    # another controller, on the other hosts, is undisturbed
    start = time.monotonic()
    with other.activate():
        y = torch.ones(2) * 3
        total = dm.inspect(y.reduce("host", "sum"))
    assert total.tolist() == [6.0, 6.0]
    _report("other controller's reduce during the partition", time.monotonic() - start)


@pytest.mark.timeout(300)
def test_new_mesh_over_the_remaining_hosts(hosts_client, state):
    """While the lost worker is still registered, a new mesh skips it and works."""
    hosts, client = hosts_client
    known = [hosts.host_of(a) for a in registered_workers(client)]
    print(f"\n[multihost] hosts registered at the scheduler: {sorted(known)}")
    start = time.monotonic()
    mesh = dm.device_mesh(client, host=2)
    try:
        assert [hosts.host_of(a) for a in mesh._session.controller.workers] == [0, 1]
        with mesh.activate():
            total = dm.inspect(torch.ones(2).reduce("host", "sum"))
        assert total.tolist() == [2.0, 2.0]
    finally:
        exit_quietly(mesh)
    _report("new mesh over the remaining hosts (made, used, exited)", time.monotonic() - start)


@pytest.mark.timeout(300)
def test_ranks_blocked_with_the_lost_rank_recover(hosts_client, state):
    """Ranks 0 and 1 drop the broken controller, and their lanes blocked in the collective
    with rank 2 end at the collective timeout; the workers serve other controllers."""
    hosts, client = hosts_client
    exit_quietly(state["full"])  # returns at once: the controller is broken
    token = state["token"]
    survivors = state["other"]._session.controller.workers
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT + 90
    released = None
    while True:
        held = client.run(probes.tokens, workers=survivors)
        if released is None and not any(token in t for t in held.values()):
            released = time.monotonic() - state["cut"]
        threads = client.run(probes.threads_of, token, workers=survivors)
        if released is not None and not any(threads.values()):
            break
        assert time.monotonic() < deadline, f"ranks 0, 1 still hold {token}: {held}, {threads}"
        time.sleep(0.5)
    _report("partition -> ranks 0, 1 released the broken controller", released)
    _report(
        f"partition -> their lanes left the collective (timeout {COLLECTIVE_TIMEOUT:g}s)",
        time.monotonic() - state["cut"],
    )
    with state["other"].activate():
        total = dm.inspect(torch.full((2,), 2.0).reduce("host", "sum"))
    assert total.tolist() == [4.0, 4.0]


@pytest.mark.timeout(420)
def test_healed_host_gets_a_new_worker(hosts_client, state):
    """The scheduler drops the cut-off worker; once the link is back, its supervisor's new
    worker registers and a new mesh uses it."""
    hosts, client = hosts_client
    deadline = time.monotonic() + 180
    while state["lost"] in registered_workers(client):
        assert time.monotonic() < deadline, "the scheduler kept the cut-off worker"
        time.sleep(0.5)
    _report(
        f"partition -> scheduler dropped the worker (worker-ttl {WORKER_TTL})",
        time.monotonic() - state["cut"],
    )
    healed = time.monotonic()
    hosts.heal(2)
    address = wait_for_host(client, hosts, 2, timeout=300)
    _report("heal -> a new worker of host 2 answers", time.monotonic() - healed)
    assert client.run(probes.pid, workers=[address])[address] != state["pid"]  # replaced
    start = time.monotonic()
    mesh = dm.device_mesh(client, distinct_hosts=True, host=3)
    try:
        assert sorted(hosts.host_of(a) for a in mesh._session.controller.workers) == [0, 1, 2]
        assert address in mesh._session.controller.workers
        with mesh.activate():
            total = dm.inspect(torch.ones(2).reduce("host", "sum"))
        assert total.tolist() == [3.0, 3.0]
    finally:
        exit_quietly(mesh)
    _report("mesh over the healed hosts", time.monotonic() - start)
    exit_quietly(state["other"])


_SCRIPT = """
import sys, time
import torch
from distributed import Client
import dask_monarch as dm

client = Client(sys.argv[1])
mesh = dm.device_mesh(client, host=3)
with mesh.activate():
    x = torch.ones(2)
    dm.inspect(x)
    print("ready", flush=True)
    try:
        while True:
            x = x + 1
            dm.inspect(x)
            time.sleep(0.1)
    except Exception as e:
        print(f"raised {type(e).__name__}: {e}", flush=True)
# no close, no exit: the interpreter's exit must not hang
"""


@pytest.mark.timeout(300)
def test_scheduler_killed(hosts_client, state, tmp_path):
    """Every controller raises within seconds; close() and interpreter exit do not hang."""
    hosts, client = hosts_client
    script = tmp_path / "session.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    other = subprocess.Popen(
        [sys.executable, str(script), hosts.scheduler_address],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert other.stdout.readline().strip() == "ready", other.stdout.read()
        meshes = [dm.device_mesh(client, host=3), dm.device_mesh(client, host=2)]
        xs = []
        for mesh in meshes:
            with mesh.activate():
                xs.append(torch.ones(2))
                dm.inspect(xs[-1])
        killed = time.monotonic()
        hosts.scheduler.kill()
        for i, mesh in enumerate(meshes):
            with pytest.raises(dm.DeviceException) as info:
                with mesh.activate():
                    while time.monotonic() - killed < 120:
                        xs[i] = xs[i] + 1
                        dm.inspect(xs[i])
                        time.sleep(0.1)
            _report(f"scheduler killed -> controller {i} raises", time.monotonic() - killed)
            print(f"[multihost]   {info.value}")
            assert "scheduler" in str(info.value).lower()
        start = time.monotonic()
        for mesh in meshes:
            exit_quietly(mesh)
        _report("close() of both controllers", time.monotonic() - start)
        out, _ = other.communicate(timeout=120)
        _report("scheduler killed -> other process raised and exited", time.monotonic() - killed)
        assert "raised DeviceException" in out, out
        assert other.returncode == 0, out
    finally:
        other.kill()
        print("\n[multihost] times: " + ", ".join(f"{k}: {v:.1f}s" for k, v in times.items()))
