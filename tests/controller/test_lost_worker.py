"""A lost worker breaks its controller quickly and cleanly; nothing runs twice.

These tests kill worker processes, so they make their own throw-away cluster.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers.raw import S0, call, create_streams

import dask_monarch as dm
from dask_monarch.messages import Ref


@pytest.fixture
def fresh_cluster(throwaway_cluster):
    with throwaway_cluster(2) as (_, client):
        yield client


def _lines(path) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return len(f.read().splitlines())


@pytest.mark.timeout(420)
def test_killed_worker_raises_device_exception_and_nothing_reruns(fresh_cluster, tmp_path):
    client = fresh_cluster
    marker = str(tmp_path / "ran")
    ctrl = dm.Controller(client, world_size=2)
    create_streams(ctrl, [0, 1], S0)
    ctrl.send(1, call(0, Ref(1), "helpers.remote_fns.sleep_then", 5.0, marker))
    ctrl.flush()
    deadline = time.monotonic() + 30
    while _lines(marker) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _lines(marker) == 1
    victim = ctrl.workers[1]
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)

    start = time.monotonic()
    with pytest.raises(dm.DeviceException) as info:
        ctrl.sync(timeout=60)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and "lost connection" in str(info.value)
    # what the rank was running, read back from the segment's pickled payload
    assert "it was running stream 0: CallFunction of helpers.remote_fns.sleep_then (seq 0)" in str(
        info.value
    )
    with pytest.raises(dm.DeviceException):
        ctrl.send(0, call(1, Ref(2), "torch.ones", 1))

    start = time.monotonic()
    ctrl.close()
    assert time.monotonic() - start < 5

    with dm.Controller(client, world_size=1) as fresh:
        create_streams(fresh, [0], S0)
        fresh.send(0, call(0, Ref(1), "torch.ones", 1))
        assert fresh.sync(timeout=60) == []

    client.wait_for_workers(2, timeout=240)  # the nanny restarted rank 1 (slow when loaded)
    time.sleep(2)
    assert _lines(marker) == 1  # the message that was running did not run again
