"""What the client knows of its ranks' progress from their reports, as pure bookkeeping."""

from __future__ import annotations

import threading

from dask_monarch.controller.intake import SegmentTask
from dask_monarch.controller.reports import Reports
from dask_monarch.protocol import messages as m
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


def _task(rank: int, lane: int, index: int, payload: tuple) -> SegmentTask:
    return SegmentTask(("seg", "tok", rank, lane, index), rank, lane, index, payload, [], "", "")


def test_segments_in_flight_are_kept_pickled_and_described_from_their_payload():
    """A lost worker's error says what it was running; the client keeps those segments as
    the bytes it sent, not as message objects that every garbage collection would walk."""
    reports = Reports("tok", threading.Condition(), lambda e: None)
    call = m.CallFunction(
        7,
        [m.Ref(1)],
        [],
        m.FunctionPath("torch.ops.aten.add.Tensor"),
        m.ArgsKwargs.from_python((m.Ref(0), 1)),
        m.StreamRef(1),
        [],
    )
    shared = m.dumps([call])
    reports.expect({(0, 1): 0, (1, 1): 0}, [_task(0, 1, 0, (shared,)), _task(1, 1, 0, (shared,))])
    kept = [payload for queue in reports.in_flight.values() for _, payload in queue]
    assert kept == [(shared,), (shared,)]
    with reports.progress:
        assert reports.running(1) == (
            "; it was running stream 1: CallFunction of torch.ops.aten.add.Tensor (seq 7)"
        )
    reports.on_reports(1, [LaneDone(1, 1, 0)])
    with reports.progress:
        assert reports.running(1) == ""  # it ran: nothing of it is kept
        assert [len(queue) for queue in reports.in_flight.values()] == [1, 0]
    reports.expect({(0, 1): 1}, [_task(0, 1, 1, (b"not a pickle",))])
    reports.on_reports(0, [LaneDone(0, 1, 0)])
    with reports.progress:
        assert reports.running(0) == (
            "; it was running stream 1: messages that cannot be read back (UnpicklingError)"
        )
