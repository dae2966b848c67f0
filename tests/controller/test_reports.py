"""What the client knows of its ranks' progress from their reports, as pure bookkeeping."""

from __future__ import annotations

import threading

from dask_monarch.controller.reports import Reports
from dask_monarch.protocol.wire import LaneDone


def test_ranks_idle_follows_flushes_reports_and_retired_lanes():
    """The answer is kept between changes (it is asked on every send): every change to what
    was sent or what ran must renew it."""
    reports = Reports("tok", threading.Condition(), lambda e: None)
    assert reports.ranks_idle()  # nothing sent
    reports.expect({(0, 1): 0, (1, 1): 0})
    assert not reports.ranks_idle()
    reports.on_reports(0, [LaneDone(0, 1, 0)])
    assert not reports.ranks_idle()  # rank 1 still runs its segment
    reports.on_reports(1, [LaneDone(1, 1, 0)])
    assert reports.ranks_idle()
    reports.expect({(1, 2): 0})  # a new lane
    assert not reports.ranks_idle()
    reports.on_reports(1, [LaneDone(1, 2, 0), LaneDone(1, 2, 0)])  # a repeat changes nothing
    assert reports.ranks_idle()
    reports.expect({(0, 1): 2})
    assert not reports.ranks_idle()
    with reports.progress:
        assert reports.retire({(0, 1): 2}) == []  # its last segment has not run
    reports.on_reports(0, [LaneDone(0, 1, 2)])
    with reports.progress:
        assert reports.retire({(0, 1): 2}) == [(0, 1)]
    assert reports.ranks_idle()
