"""A client process that dies without a word (SIGKILL) leaves nothing behind on the workers."""

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
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
