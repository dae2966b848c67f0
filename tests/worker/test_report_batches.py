"""How a rank's reports leave it: what the controller waits for together, in one write; nothing
held behind a step that takes time."""

from __future__ import annotations

import threading
import time

import pytest
from raw import S0, call, create_streams, fetch, values

from dask_monarch import messages as m
from dask_monarch.messages import Ref
from dask_monarch.protocol.wire import Fetched, LaneDone

BOTH = [0, 1]


@pytest.fixture
def batches(ctrl):
    """Every batch of reports the client applies: (time, rank, [report types])."""
    seen: list[tuple[float, int, list[type]]] = []
    reports = ctrl._reports
    on_reports = reports.on_reports

    def recorded(rank, batch):
        seen.append((time.monotonic(), rank, [type(item) for item in batch]))
        return on_reports(rank, batch)

    reports.on_reports = recorded
    try:
        yield seen
    finally:
        reports.on_reports = on_reports


def _with(seen: list, rank: int, kind: type) -> list[type]:
    return next(types for _, r, types in seen if r == rank and kind in types)


def test_a_fetch_value_its_status_and_the_segment_end_arrive_in_one_batch(ctrl, batches):
    """The controller needs all three before the user's fetch returns: one write, one read."""
    create_streams(ctrl, BOTH, S0)
    ctrl.sync()
    for round_ in range(3):
        batches.clear()
        ref = Ref(round_ + 1)
        ctrl.send(BOTH, call(3 * round_, ref, "torch.full", (2,), float(round_)))
        ctrl.send(0, fetch(3 * round_ + 1, ref))
        ctrl.send(BOTH, m.RequestStatus(3 * round_ + 1))
        reports = ctrl.sync()
        assert values(reports)[(3 * round_ + 1, 0)].tolist() == [float(round_)] * 2
        assert set(_with(batches, 0, Fetched)) >= {Fetched, m.Status, LaneDone}
        assert set(_with(batches, 1, m.Status)) >= {m.Status, LaneDone}


def test_a_failure_and_the_status_after_it_arrive_in_one_batch(ctrl, batches):
    create_streams(ctrl, BOTH, S0)
    ctrl.sync()
    batches.clear()
    ctrl.send(0, call(0, Ref(1), "no_such_module.fn"))
    ctrl.send(0, m.RequestStatus(0))
    reports = ctrl.sync()
    assert [type(x) for x in reports] == [m.RemoteFunctionFailed, m.Status]
    assert set(_with(batches, 0, m.RemoteFunctionFailed)) >= {
        m.RemoteFunctionFailed,
        m.Status,
        LaneDone,
    }


def test_a_value_is_not_held_behind_a_slow_call_in_its_segment(ctrl, batches):
    """A value fetched before a long call leaves before that call runs, not with its segment."""
    create_streams(ctrl, [0], S0)
    ctrl.sync()
    batches.clear()
    ctrl.send(0, call(0, Ref(1), "torch.ones", 2))
    ctrl.send(0, fetch(1, Ref(1)))
    ctrl.send(0, call(2, None, "time.sleep", 1.5))
    ctrl.send(0, m.RequestStatus(2))
    ctrl.flush()
    fetched = threading.Event()
    ctrl._reports.listeners.append(lambda msg: fetched.set() if type(msg) is m.FetchResult else 0)
    assert fetched.wait(30)
    arrived = time.monotonic()
    ctrl.sync()
    done = next(t for t, rank, types in batches if LaneDone in types)
    assert done - arrived > 1.0, "the value waited for the call after it"
    assert LaneDone not in _with(batches, 0, Fetched)
