"""Each use of distributed's private parts (dask_monarch/dask_internals.py) against the
installed distributed, and nowhere else in the package.

An in-process cluster: its scheduler's and workers' objects are reachable from here, and
``client.run``/``run_on_scheduler`` run code on its event loop, where Dask runs its own.
"""

from __future__ import annotations

import io
import re
import time
import tokenize
from pathlib import Path

import pytest
from distributed import Client, LocalCluster
from distributed.batched import BatchedSend
from distributed.scheduler import TaskGroup, TaskPrefix
from distributed.worker_state_machine import TaskState as WorkerTaskState

from dask_monarch import dask_internals as internals
from dask_monarch.controller.placement import registered_workers

pytestmark = pytest.mark.timeout(120)
PACKAGE = Path(internals.__file__).parent
PRIVATE = re.compile(
    r"_create_taskstate_from_graph|_find_lost_dependencies|_send_to_scheduler_safe|"
    r"client\._run\b|\.state\.nthreads|\.run_spec\b|recent_message_log|dask\._task_spec|"
    r"_all_durations_us|\._duration_us|\._types\b|\._size\b"
)


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1) as cluster:
        with Client(cluster) as client:
            yield client


def _inc(x: int) -> int:
    return x + 1


def test_the_installed_distributed_has_every_piece():
    assert internals.missing() == []
    internals.require()


def _code(path: Path) -> dict[int, str]:
    """The source of ``path`` line by line, without its strings and comments."""
    lines: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            lines[tok.start[0]] = lines.get(tok.start[0], "") + tok.string
    return lines


def test_no_other_module_touches_a_private_name_of_distributed():
    found = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "dask_internals.py"
        for n, line in _code(path).items()
        if PRIVATE.search(line)
    ]
    assert found == []


def test_create_tasks_makes_tasks_as_update_graph_does(client):
    def make(dask_scheduler=None):
        key = ("dm-internals-create", 0)
        dsk = {key: internals.Task(key, _inc, 1)}
        keys = set(dsk)
        assert internals.lost_dependencies(dask_scheduler, dsk, keys) is False
        internals.create_tasks(
            dask_scheduler,
            start=time.time(),
            dsk=dsk,
            keys=keys,
            ordered={key: 0},
            client=next(iter(dask_scheduler.clients)),
            annotations_by_type={},
            global_annotations=None,
            stimulus_id="dm-internals-test",
            submitting_task=None,
            span_metadata=internals.SpanMetadata(collections=[]),
            fifo_timeout=60.0,
        )
        return key in dask_scheduler.tasks

    assert client.run_on_scheduler(make)


def test_scheduler_gaps_names_what_a_scheduler_lacks():
    assert internals.scheduler_gaps(object()) == [
        "_find_lost_dependencies",
        "_create_taskstate_from_graph",
    ]


def test_task_groups_fold_into_one():
    assert internals.groups_foldable()
    prefix = TaskPrefix("monarch_ops")
    kept, other = TaskGroup("monarch_ops", prefix), TaskGroup("monarch_ops", prefix)
    kept.states["forgotten"], other.states["forgotten"] = 2, 3
    kept._duration_us, other._duration_us = 10, 5
    other.start, other.stop = 1.0, 9.0
    internals.fold_group(kept, other)
    assert kept.states["forgotten"] == 5 and kept._duration_us == 15
    assert (kept.start, kept.stop) == (1.0, 9.0)


def test_span_of_finds_a_tasks_group_span(client):
    future = client.submit(_inc, 1, key="dm-internals-span")
    assert future.result() == 2

    def span_name(dask_scheduler=None):
        ts = dask_scheduler.tasks["dm-internals-span"]
        span = internals.span_of(dask_scheduler, ts.group)
        return None if span is None else span.name

    assert client.run_on_scheduler(span_name) is not None


def test_a_workers_task_spec_can_be_read_and_replaced(client):
    future = client.submit(_inc, 2, key="dm-internals-spec")
    assert future.result() == 3

    def spec(dask_worker=None):
        ts = internals.worker_task(dask_worker, "dm-internals-spec")
        return ts is not None and internals.task_spec(ts) is not None

    assert all(client.run(spec).values())
    ts = WorkerTaskState("k", run_spec=internals.Task("k", _inc, 1))
    replaced = internals.Task("k", _inc, 2)
    internals.set_task_spec(ts, replaced)
    assert internals.task_spec(ts) is replaced


def test_execution_slots_come_and_go(client):
    def slots(dask_worker=None):
        before = dask_worker.state.nthreads
        internals.add_execution_slot(dask_worker)
        during = dask_worker.state.nthreads
        internals.add_execution_slot(dask_worker, -1)
        return before, during, dask_worker.state.nthreads

    ((before, during, after),) = client.run(slots).values()
    assert (during, after) == (before + 1, before)


def test_batched_send_gaps_and_logs():
    stream = BatchedSend(interval="5ms")
    assert internals.gap(stream) == 0.005
    internals.lower_gap(stream, 0.001)
    internals.lower_gap(stream, 0.010)  # never raised
    assert internals.gap(stream) == 0.001
    internals.set_gap(stream, 0.004)
    assert internals.gap(stream) == 0.004
    stream.recent_message_log.append(["a batch"])
    assert internals.sent_log(stream) == [["a batch"]]
    internals.keep_no_log(stream)
    stream.recent_message_log.append(["another"])
    assert internals.sent_log(stream) == []


def test_the_schedulers_gaps_are_lowered(client):
    def gaps(dask_scheduler=None):
        internals.lower_scheduler_gaps(dask_scheduler, 0.0005)
        comms = [*dask_scheduler.stream_comms.values(), *dask_scheduler.client_comms.values()]
        return [internals.gap(c) for c in comms]

    assert set(client.run_on_scheduler(gaps)) == {0.0005}


def test_a_client_sends_on_its_own_stream_and_runs_on_workers(client):
    def listen(dask_scheduler=None):
        got = dask_scheduler.dm_internals_got = []
        dask_scheduler.stream_handlers["dm-internals"] = lambda client, x: got.append(x)

    client.run_on_scheduler(listen)
    internals.send_to_scheduler(client, {"op": "dm-internals", "x": 7})
    deadline = time.monotonic() + 30
    while client.run_on_scheduler(lambda dask_scheduler=None: dask_scheduler.dm_internals_got) != [
        7
    ]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers = list(registered_workers(client))
    answers = client.sync(lambda: internals.run_on(client, lambda: 41, workers))
    assert list(answers.values()) == [41]
