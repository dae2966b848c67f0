"""A client process that dies without a word (SIGKILL) leaves nothing behind on the workers or
the scheduler."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

CHILD = """\
import sys
import time

from distributed import Client

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef

client = Client(sys.argv[1])
ctrl = dm.Controller(client, world_size=2)
modes = m.StreamCreationMode
for i in range(3):  # three streams: three lanes (and threads) per rank, plus the control lane
    mode = modes.UseDefaultStream if i == 0 else modes.CreateNewStream
    ctrl.send([0, 1], m.CreateStream(StreamRef(i), mode))
    ctrl.send([0, 1], m.CallFunction(i, [Ref(10 + i)], [], "torch.ones",
                                     ArgsKwargs.from_python((1000,), {}), StreamRef(i), []))
ctrl.sync()
# a segment still running when the process dies: the scheduler holds it for the controller
ctrl.send([0, 1], m.CallFunction(3, [], [], "time.sleep", ArgsKwargs.from_python((2,), {}),
                                 StreamRef(0), []))
ctrl.flush()
print("token", ctrl.token, flush=True)
time.sleep(600)
"""


def held(client) -> dict:
    """Per worker: the controller tokens its plugin holds, and its thread budget."""
    return client.run(
        lambda dask_worker: (
            sorted(dask_worker.plugins["dask_monarch"].ranks),
            dask_worker.state.nthreads,
        )
    )


def settled(client, timeout: float = 30) -> dict:
    """Per worker: its thread budget once no controller holds it and every lane of earlier
    tests has been retired (a lane's thread goes back after its last task returned)."""

    def state(dask_worker):
        plugin = dask_worker.plugins["dask_monarch"]
        return (bool(plugin.ranks) or plugin.extra_threads != 0), dask_worker.state.nthreads

    deadline = time.monotonic() + timeout
    while True:
        now = client.run(state)
        if not any(busy for busy, _ in now.values()) or time.monotonic() > deadline:
            return {address: nthreads for address, (_, nthreads) in now.items()}
        time.sleep(0.1)


def on_scheduler(client, token: str) -> tuple:
    """What the scheduler keeps for controller ``token``: whether its holder (a client name of
    the intake's) is there, and the segment tasks it knows."""

    def look(dask_scheduler):
        return (
            f"dask_monarch-{token}" in dask_scheduler.clients,
            sorted(str(k) for k in dask_scheduler.tasks if type(k) is tuple and k[1] == token),
        )

    return client.run_on_scheduler(look)


def read_line(process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            line = process.stdout.readline()
            if line:
                return line
        if process.poll() is not None:
            break
    raise AssertionError(
        f"the client process printed nothing (exit {process.poll()}): "
        f"{process.stderr.read() if process.poll() is not None else ''}"
    )


@pytest.mark.timeout(180)
def test_sigkilled_client_process_frees_its_controller_state(cluster2, client2):
    before = settled(client2)
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, cluster2.scheduler_address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        token = read_line(process, timeout=120).split()[1]
        deadline = time.monotonic() + 30
        while not on_scheduler(client2, token)[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert on_scheduler(client2, token)[0], "the scheduler holds its segments"
        during = held(client2)
        assert all(token in tokens for tokens, _ in during.values()), during
        assert all(nthreads == before[a] + 4 for a, (_, nthreads) in during.items()), during
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            now = held(client2)
            if all(
                token not in tokens and nthreads == before[a]
                for a, (tokens, nthreads) in now.items()
            ):
                break
            time.sleep(0.2)
        assert all(token not in tokens for tokens, _ in now.values()), now
        assert {a: nthreads for a, (_, nthreads) in now.items()} == before
        # the scheduler forgot the client, and with it what it held for its controller
        while on_scheduler(client2, token) != (False, []) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert on_scheduler(client2, token) == (False, [])
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
