"""Memory stays bounded while a controller lives: Dask forgets each segment once it ran.

Each segment used to depend on the previous one of its lane forever, so the
scheduler and the workers kept every released task of a live controller, and
its payload; and Dask's worker-side log of recent events kept each task's
arguments (docs/dask.md §13).
"""

from __future__ import annotations

import gc
import pickle
import time

import pytest
import torch

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller import intake
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef
from dask_monarch.protocol.wire import Payload

S0 = StreamRef(0)
ADD = m.FunctionPath("torch.ops.aten.add.Tensor")
BIG = 64 * 2**20  # bytes of the large argument
HELD = 8 * 2**20  # a task or event whose pickle is larger still holds the argument


def _count(tasks: dict, token: str) -> int:
    return sum(1 for key in list(tasks) if type(key) is tuple and token in key)


def _scheduler_tasks(token: str, dask_scheduler=None) -> int:
    return _count(dask_scheduler.tasks, token)


def _worker_tasks(token: str, dask_worker=None) -> int:
    return _count(dask_worker.state.tasks, token)


def _tasks_held(client, token: str) -> tuple[int, list[int]]:
    scheduler = client.run_on_scheduler(_scheduler_tasks, token)
    return scheduler, list(client.run(_worker_tasks, token).values())


def _settled(client, token: str, most: int, timeout: float = 30) -> tuple[int, list[int]]:
    """The tasks of ``token`` the scheduler and workers hold, once at most ``most`` (releases
    travel asynchronously), or what they hold after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        held = _tasks_held(client, token)
        if max(held[0], *held[1]) <= most or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_a_live_controller_holds_o1_tasks_after_many_flushes(ctrl, client2):
    """After K flushes, synced one by one or sent while the lane is busy, the scheduler and
    the workers hold a bounded number of the controller's tasks, not O(K)."""
    ctrl.send((0, 1), m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
    args = ArgsKwargs.from_python((1.0, 2.0))
    seq = 0
    for _ in range(30):  # one flush per op, each synced
        ctrl.send((0, 1), m.CallFunction(seq, [Ref(1)], [], ADD, args, S0, []))
        ctrl.send((0, 1), m.DeleteRefs([Ref(1)]))
        seq += 1
        ctrl.sync()
    held = _settled(client2, ctrl.token, 2)
    assert held[0] <= 4 and max(held[1]) <= 2, held  # a lane and the control lane per rank
    slow = m.FunctionPath("time.sleep")
    for _ in range(30):  # flushes while the lane is still busy: chained, then let go
        ctrl.send(
            (0, 1), m.CallFunction(seq, [Ref(1)], [], slow, ArgsKwargs.from_python((0.01,)), S0, [])
        )
        ctrl.send((0, 1), m.DeleteRefs([Ref(1)]))
        seq += 1
        ctrl.flush()
    ctrl.sync()
    held = _settled(client2, ctrl.token, 2)
    assert held[0] <= 4 and max(held[1]) <= 2, held
    # order still held: a value built step by step is right
    ctrl.send(
        (0, 1),
        m.CallFunction(
            seq, [Ref(2)], [], m.FunctionPath("torch.zeros"), ArgsKwargs.from_python((1,)), S0, []
        ),
    )
    for i in range(1, 21):
        ctrl.send(
            (0, 1),
            m.CallFunction(
                seq + i, [Ref(2 + i)], [], ADD, ArgsKwargs.from_python((Ref(1 + i), 1.0)), S0, []
            ),
        )
        ctrl.flush()
    assert ctrl.get_ref(1, Ref(22), S0).item() == 20.0


def _largest(specs: list) -> int:
    return max((len(pickle.dumps(s, protocol=5)) for s in specs if s is not None), default=0)


def _scheduler_payload(token: str, dask_scheduler=None) -> int:
    """Bytes of the largest pickled task of ``token`` the scheduler keeps."""
    return _largest([ts.run_spec for key, ts in list(dask_scheduler.tasks.items()) if token in key])


def _worker_payload(token: str, dask_worker=None) -> int:
    """Bytes of the largest pickled task of ``token`` a worker keeps: its tasks, and the task of
    every event in its log of recent events."""
    state = dask_worker.state
    specs = [ts.run_spec for key, ts in list(state.tasks.items()) if token in key]
    specs += [
        getattr(ev, "run_spec", None)
        for ev in list(state.stimulus_log)
        if token in str(getattr(ev, "key", ""))
    ]
    return _largest(specs)


@pytest.mark.timeout(300)
def test_a_big_argument_is_freed_everywhere_once_it_ran(mesh2, client2):
    """A large tensor passed to a remote function is kept by no process once the call ran:
    not by the scheduler's tasks, not by the workers' tasks or event logs, not by the client."""
    token = mesh2._session.controller.token
    fn = dm.remote("tests.helpers.remote_fns.first_plus", propagate=lambda x, big: x.clone())
    with mesh2.activate():
        x = torch.zeros(1)
        float(dm.inspect(x[0]))
        with dm.no_mesh.activate():
            big = torch.ones(BIG // 4)
        y = fn(x, big)
        assert float(dm.inspect(y[0])) == 1.0
        del big, y
        gc.collect()
        float(dm.inspect((x + 0)[0]))  # a later flush: whatever waits for one to let go does
        deadline = time.monotonic() + 30
        while True:
            scheduler = client2.run_on_scheduler(_scheduler_payload, token)
            workers = list(client2.run(_worker_payload, token).values())
            if max(scheduler, *workers) < HELD or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert scheduler < HELD, f"the scheduler keeps a task of {scheduler} bytes"
        assert max(workers) < HELD, f"the workers keep tasks of {workers} bytes"
        reports = mesh2._session.controller._reports
        kept = sum(len(queue) for queue in reports.in_flight.values())
        assert kept == 0, f"the client keeps the steps of {kept} segments that ran"


def _span_record(span_id: str, dask_scheduler=None) -> dict:
    """How many spans the scheduler keeps, and the groups and task states of ``span_id``."""
    spans = dask_scheduler.extensions["spans"].spans
    span = spans.get(span_id)
    groups = list(span.groups) if span is not None else []
    states: dict = {}
    for tg in groups:
        for state, count in tg.states.items():
            states[state] = states.get(state, 0) + count
    return {
        "spans": len(spans),
        "groups": sorted(tg.name for tg in groups),
        "states": {s: n for s, n in states.items() if n},
    }


@pytest.mark.timeout(300)
def test_the_scheduler_keeps_a_bounded_record_of_ran_segments(ctrl, client2):
    """Flush after flush, each once the lanes went idle: the scheduler keeps no new span and
    no new task group per flush (docs/dask.md §13), and the controller's span still counts
    every segment that ran."""
    ctrl.send((0, 1), m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
    args = ArgsKwargs.from_python((1.0, 2.0))
    span_id = f"dask_monarch-{ctrl.token}"

    def flushes(first: int, n: int) -> None:
        for seq in range(first, first + n):
            ctrl.send((0, 1), m.CallFunction(seq, [Ref(1)], [], ADD, args, S0, []))
            ctrl.send((0, 1), m.DeleteRefs([Ref(1)]))
            ctrl.sync()
            _settled(client2, ctrl.token, 0)  # every task forgotten: its groups emptied

    flushes(0, 5)
    before = client2.run_on_scheduler(_span_record, span_id)
    flushes(5, 40)
    after = client2.run_on_scheduler(_span_record, span_id)
    assert after["spans"] == before["spans"], (before, after)  # no default span per flush
    assert after["groups"] == before["groups"], (before, after)  # one group per name
    with ctrl._progress:
        submitted, ran = ctrl._reports.segments()
    assert submitted == ran
    assert after["states"] == {"forgotten": ran}, after  # the folded groups' figures add up


@pytest.mark.timeout(300)
def test_a_span_keeps_one_group_per_name_however_many_flushes(mesh2, client2):
    """A ``dm.span`` around many fetches, each after the lanes went idle: its record on the
    scheduler stays one task group per name, and counts every segment."""
    with mesh2.activate():
        x = torch.zeros(1)
        with dm.span("soak") as span_id:
            for i in range(30):
                x = x + 1
                assert float(dm.inspect(x[0])) == i + 1
                if i == 4:
                    before = client2.run_on_scheduler(_span_record, span_id)
    after = client2.run_on_scheduler(_span_record, span_id)
    assert set(after["groups"]) == set(before["groups"]), (before, after)
    per_name = max(after["groups"].count(g) for g in after["groups"])
    assert per_name <= 2, after  # per name: the group kept for all, and the live one
    assert all(span_id[:8] in g for g in after["groups"]), after  # still the span's own
    assert sum(after["states"].values()) >= 2 * 30, after  # a segment per rank and fetch


def _report_log(token: str, dask_worker=None) -> int:
    """Batches of controller ``token``'s report stream this worker still keeps in its log."""
    stream = dask_worker.plugins["dask_monarch"].ranks[token]._stream
    return len(stream.recent_message_log)


def _payload_bytes(dask_scheduler=None) -> int:
    """Bytes of segment payloads anything on the scheduler still holds (its logs included)."""
    gc.collect()
    return sum(o.nbytes for o in gc.get_objects() if type(o) is Payload)


def _cancelled_segments(token: str, dask_scheduler=None) -> list:
    """Segments of ``token`` the scheduler released while they were processing (their client
    let go too early): missing from the task stream, their payload kept in logs."""
    return [
        t.key
        for t in list(dask_scheduler.transition_log)
        if token in t.key and (t.start, t.finish) == ("processing", "released")
    ]


def _graph_bytes(client, token: str) -> int:
    """Bytes of payload of controller ``token``'s flushes in the client's log of batches it
    sent: the scheduler intake's messages, or ``update-graph``'s pickled graphs."""
    total = 0
    for batch in list(client.scheduler_comm.recent_message_log):
        for msg in batch if type(batch) is list else ():
            if type(msg) is not dict:
                continue
            if msg.get("op") == intake.OP and msg.get("token") == token:
                segments = getattr(msg["segments"], "data", ())
                total += sum(Payload(segment[4]).nbytes for segment in segments)
            elif msg.get("op") == "update-graph" and token in next(iter(msg["keys"]), ()):
                total += sum(len(f) for f in getattr(msg["expr_ser"], "frames", ()))
    return total


@pytest.mark.timeout(300)
def test_values_and_arguments_are_kept_by_no_process_once_they_ran(mesh2, client2):
    """Many fetches and calls with a 256 KiB argument through the user API, each message
    under the 1 MB up to which Dask logs the batches it sends: once they ran, the client
    keeps neither the reports the user API handled (until a ``sync`` that never comes) nor
    the graphs it sent, the scheduler no payload, the workers no report."""
    token = mesh2._session.controller.token
    reports = mesh2._session.controller._reports
    fn = dm.remote("tests.helpers.remote_fns.first_plus", propagate=lambda x, big: x.clone())
    with mesh2.activate():
        x = torch.zeros(1)
        with dm.no_mesh.activate():
            arg = torch.ones(64 * 1024)  # 256 KiB
        for i in range(20):
            assert float(dm.inspect(fn(x + i, arg)[0])) == i + 1
            assert float(dm.inspect((x + i)[0])) == i
        del arg
        deadline = time.monotonic() + 30
        while True:  # the graph of the last flush leaves the client's log on its report
            held = (_graph_bytes(client2, token), client2.run_on_scheduler(_payload_bytes))
            if max(held) < 2**18 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert held[0] < 2**18, f"the client's log keeps {held[0]} bytes of graphs"
    assert held[1] < 2**18, f"the scheduler keeps {held[1]} bytes of payloads"
    assert len(reports.inbox) == 0, f"the controller keeps {len(reports.inbox)} reports"
    kept = list(client2.run(_report_log, token).values())
    assert kept == [0, 0], f"the workers keep {kept} batches of reports"
    # a fetch's segment reports before Dask hears it finished: the next flush holds it till then
    assert client2.run_on_scheduler(_cancelled_segments, token) == []
