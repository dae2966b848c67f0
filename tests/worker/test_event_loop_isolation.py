"""Nothing a user wrote runs on a worker's event loop (DESIGN decision 17, issue 35 item 1):
one controller's slow unpickling or slow ``__del__`` never stalls another controller that
shares its workers."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers.remote_fns import SlowUnpickle

import dask_monarch as dm

STALL_S = 12.0  # longer than the heartbeat's freeze limit (timeouts.unresponsive, 10 s)
GAP_S = 2.0  # generous: a stalled loop shows a gap of STALL_S


def round_trip_gaps(mesh, until: threading.Event, seconds: float) -> list[float]:
    """Round trips on ``mesh`` for ``seconds`` (or until ``until``): the time each took."""
    gaps = []
    with mesh.activate():
        x = torch.zeros(2)
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until.is_set():
            start = time.monotonic()
            x = x + 1
            dm.inspect(x)
            gaps.append(time.monotonic() - start)
    return gaps


@pytest.mark.timeout(180)
def test_a_slow_unpickle_and_a_slow_del_leave_another_controllers_loop_alone(client2):
    culprit = dm.device_mesh(client2, gpu=2)
    victim = dm.device_mesh(client2, gpu=2)
    try:
        with victim.activate():  # warm: lanes made, first flush done
            dm.inspect(torch.zeros(1))
        plus = dm.remote("helpers.remote_fns.plus", propagate=lambda x, n: x)
        with culprit.activate():
            x = torch.zeros(2)
            dm.inspect(x)
            slow = dm.OpaqueRef("helpers.remote_fns.SlowDel", STALL_S)
            dm.inspect(x)  # the object exists on the ranks
            slow.drop()  # its __del__ sleeps, wherever the rank frees it
            late = plus(x, SlowUnpickle(1, STALL_S))  # unpickling the argument sleeps
            culprit._session.controller.flush()
        done = threading.Event()
        gaps = round_trip_gaps(victim, done, STALL_S + 2)
        assert max(gaps) < GAP_S, f"the victim's longest round trip took {max(gaps):.2f}s"
        with culprit.activate():
            assert dm.inspect(late).tolist() == [1.0, 1.0]  # the culprit's work did run
    finally:
        for mesh in (culprit, victim):
            try:
                mesh.exit()
            except (dm.DeviceException, dm.RemoteException):
                pass
