"""A flush is all or nothing: an unserialisable message is refused or fails the controller."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers.raw import S0, call, create_streams

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Ref

BOTH = [0, 1]


class PicklesOnce:
    """Passes the check at send, then fails to pickle when the flush serialises it."""

    def __init__(self) -> None:
        self.calls = 0

    def __reduce__(self):
        self.calls += 1
        if self.calls > 1:
            raise TypeError("PicklesOnce pickles only once")
        return (PicklesOnce, ())


pytestmark = pytest.mark.timeout(180)


def test_unpicklable_value_is_refused_at_send_and_the_rest_runs(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
    with pytest.raises(TypeError, match="SetRefUnitTestsOnly.value cannot be serialised"):
        ctrl.send(BOTH, m.SetRefUnitTestsOnly(Ref(2), threading.Lock(), S0))
    ctrl.send(BOTH, m.SetRefUnitTestsOnly(Ref(3), {"plain": [1, 2]}, S0))
    assert ctrl.sync(timeout=60) == []
    assert ctrl.progress()["state"] == "running"
    for rank in BOTH:
        assert torch.equal(ctrl.get_ref(rank, Ref(1), S0, timeout=60), torch.ones(3))
        assert ctrl.get_ref(rank, Ref(3), S0, timeout=60) == {"plain": [1, 2]}


def test_value_that_stops_pickling_after_send_fails_the_controller_at_sync(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(2), "torch.ones", 3))
    ctrl.send(BOTH, m.SetRefUnitTestsOnly(Ref(1), PicklesOnce(), S0))
    with pytest.raises(dm.DeviceException, match="SetRefUnitTestsOnly"):
        ctrl.sync(timeout=60)
    assert ctrl.progress()["state"] == "broken"
    with pytest.raises(dm.DeviceException, match="SetRefUnitTestsOnly"):
        ctrl.get_ref(0, Ref(1), S0, timeout=60)


def test_background_flush_failure_is_raised_not_swallowed(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.sync(timeout=60)
    ctrl.send(BOTH, m.SetRefUnitTestsOnly(Ref(1), PicklesOnce(), S0))
    deadline = time.monotonic() + 30  # the idle flusher meets the error first
    while ctrl.broken is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(ctrl.broken, dm.DeviceException)
    with pytest.raises(dm.DeviceException, match="SetRefUnitTestsOnly"):
        ctrl.sync(timeout=60)
    with pytest.raises(dm.DeviceException, match="SetRefUnitTestsOnly"):
        ctrl.get_ref(1, Ref(1), S0, timeout=60)
