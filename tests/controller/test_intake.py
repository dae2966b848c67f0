"""The scheduler's flush intake: one compact message per flush, ordinary Dask tasks from it."""

from __future__ import annotations

import time

import dask
import pytest
import torch
from distributed import get_task_stream
from distributed.diagnostics.plugin import SchedulerPlugin
from helpers.raw import S0, call, create_streams
from helpers.task_stream import wait_until_recorded

import dask_monarch as dm
from dask_monarch.controller import intake
from dask_monarch.controller.intake import PLUGIN_NAME, holder, missing_on
from dask_monarch.messages import Ref

BOTH = [0, 1]
pytestmark = pytest.mark.timeout(180)


class GraphUpdates(SchedulerPlugin):
    """Counts the scheduler's update-graph calls and keeps what it learns of new tasks."""

    name = "test-graph-updates"

    async def start(self, scheduler):
        self.scheduler = scheduler
        scheduler._test_updates = self.updates = []
        handler = scheduler.stream_handlers["update-graph"]

        async def counted(**kwargs):
            self.updates.append(sorted(map(str, kwargs.get("keys", ()))))
            return await handler(**kwargs)

        scheduler.stream_handlers["update-graph"] = counted


def _task_view(keys, dask_scheduler=None):
    """Each key's state, annotations and restrictions as the scheduler holds them."""
    out = {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        out[key] = (
            None
            if ts is None
            else (
                ts.state,
                dict(ts.annotations or {}),
                dict(ts.resource_restrictions or {}),
                sorted(dts.key for dts in ts.dependencies),
            )
        )
    return out


def _update_count(dask_scheduler=None):
    return len(dask_scheduler._test_updates)


def _held(token, dask_scheduler=None):
    """What the scheduler holds for controller ``token``: the holder's keys (None: no holder),
    the keys of its segments the scheduler knows, and who wants them."""
    cs = dask_scheduler.clients.get(f"dask_monarch-{token}")
    ours = [
        ts for key, ts in dask_scheduler.tasks.items() if type(key) is tuple and key[1] == token
    ]
    return {
        "holder": None if cs is None else sorted(str(ts.key) for ts in cs.wants_what),
        "tasks": {str(ts.key): ts.state for ts in ours},
        "wanted by": sorted({c.client_key for ts in ours for c in ts.who_wants or ()}),
        "cancelled": [
            str(ts.key)
            for ts in ours
            if any(
                s == "processing" and f == "released"
                for _, s, f, *_ in dask_scheduler.story(ts.key)
            )
        ],
    }


def _until(client, token, done, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        held = client.run_on_scheduler(_held, token)
        if done(held) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def test_a_flush_becomes_ordinary_tasks_without_update_graph(client2, tmp_path):
    client2.register_plugin(GraphUpdates(), name=GraphUpdates.name)
    ctrl = dm.Controller(client2, world_size=2)
    gate = tmp_path / "go"
    try:
        assert PLUGIN_NAME in client2.run_on_scheduler(
            lambda dask_scheduler=None: list(dask_scheduler.plugins)
        )
        create_streams(ctrl, BOTH, S0)
        ctrl.sync()
        before = client2.run_on_scheduler(_update_count)
        with get_task_stream(client2) as task_stream:
            # the lanes are held busy, so the second flush must follow the first
            ctrl.send(BOTH, call(0, None, "helpers.gates.wait_for_file", str(gate), 120))
            ctrl.flush()
            keys = list(ctrl._tails.values())  # held by the scheduler: the controller has keys
            ctrl.send(BOTH, call(1, Ref(2), "torch.ones", 3))
            ctrl.flush()
            later = dict(ctrl._tails)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                view = client2.run_on_scheduler(_task_view, list(later.values()))
                if all(v is not None for v in view.values()):
                    break
                time.sleep(0.05)
            gate.touch()
            assert ctrl.sync() == []
            wait_until_recorded(client2, ctrl.token)
        # no generic graph submission: the flushes came through the intake
        assert client2.run_on_scheduler(_update_count) == before
        for (rank, lane), key in later.items():
            state, annotations, resources, deps = view[key]
            assert state in ("waiting", "processing", "no-worker", "queued")
            assert annotations["executor"] == ctrl._compiler.executor(lane)
            assert resources == {ctrl.resources[rank]: 1} == annotations["resources"]
            previous = next(k for k in keys if k[2] == rank and k[3] == lane)
            assert deps == [previous]  # chained after the lane's previous segment
        assert torch.equal(ctrl.get_ref(1, Ref(2), S0), torch.ones(3))
        assert set(later.values()) <= {entry["key"] for entry in task_stream.data}
    finally:
        gate.touch()
        ctrl.close()


def test_with_the_intake_off_flushes_go_through_client_get(client2):
    client2.register_plugin(GraphUpdates(), name=GraphUpdates.name)
    with dask.config.set({"dask_monarch.flush.intake": False}):
        ctrl = dm.Controller(client2, world_size=2)
    try:
        create_streams(ctrl, BOTH, S0)
        ctrl.sync()
        before = client2.run_on_scheduler(_update_count)
        ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
        assert ctrl.sync() == []
        assert client2.run_on_scheduler(_update_count) > before
        assert torch.equal(ctrl.get_ref(0, Ref(1), S0), torch.ones(3))
    finally:
        ctrl.close()


def test_a_mesh_fetch_resolves_through_the_intake(mesh2):
    with mesh2.activate():
        x = torch.zeros(())
        for _ in range(3):
            x = x + 1
        assert float(dm.inspect(x)) == 3.0


def test_the_intake_checks_the_scheduler_internals_it_calls(client2):
    """The intake calls private scheduler methods: a distributed without them (another
    version) refuses the plugin, and the controller stays on Client.get."""
    assert client2.run_on_scheduler(lambda dask_scheduler=None: missing_on(dask_scheduler)) == []

    class OtherScheduler:  # a scheduler whose graph intake takes other arguments
        def client_releases_keys(self, keys, client, stimulus_id=None): ...
        def remove_client(self, client, stimulus_id=None): ...
        def log_event(self, topic, msg): ...
        def _find_lost_dependencies(self, dsk, keys): ...
        def _create_taskstate_from_graph(self, *, dsk, keys, client): ...

    missing = missing_on(OtherScheduler())
    assert "_create_taskstate_from_graph(annotations_by_type=)" in missing, missing
    assert missing_on(object()) == [
        "client_releases_keys",
        "remove_client",
        "log_event",
        "_find_lost_dependencies",
        "_create_taskstate_from_graph",
    ]


def test_the_scheduler_holds_the_tails_for_the_controller_and_lets_go_of_those_that_ran(
    client2, tmp_path
):
    """The client holds no segment (no future, no key-in-memory message per segment); the
    scheduler holds each lane's newest under the controller's own name until it ran."""
    gate = tmp_path / "go"
    ctrl = dm.Controller(client2, world_size=2)
    try:
        create_streams(ctrl, BOTH, S0)
        ctrl.send(BOTH, call(0, None, "helpers.gates.wait_for_file", str(gate), 120))
        ctrl.flush()
        for i in range(1, 4):  # flushes that follow the held ones
            ctrl.send(BOTH, call(i, Ref(i), "torch.ones", 3))
            ctrl.flush()
        tails = list(ctrl._tails.values())
        assert tails and all(type(tail) is tuple for tail in tails)
        held = _until(client2, ctrl.token, lambda h: set(map(str, tails)) <= set(h["tasks"]))
        assert held["wanted by"] == [holder(ctrl.token)], held
        assert set(map(str, tails)) <= set(held["holder"])
        assert not [key for key in client2.futures if type(key) is tuple and ctrl.token in key]
        gate.touch()
        assert ctrl.sync() == []
        held = _until(client2, ctrl.token, lambda h: not h["tasks"])
        assert held["tasks"] == {} and held["holder"] == [] and held["cancelled"] == [], held
    finally:
        gate.touch()
        ctrl.close()
    held = _until(client2, ctrl.token, lambda h: h["holder"] is None)
    assert held["holder"] is None, held  # the holder went with the controller


def test_a_tail_let_go_of_while_processing_is_kept_until_it_finished(client2, tmp_path):
    """Released while processing, the scheduler would cancel the task (missing from the task
    stream); the intake lets go of it once it finished."""
    gate = tmp_path / "go"
    ctrl = dm.Controller(client2, world_size=2)
    try:
        create_streams(ctrl, BOTH, S0)
        ctrl.sync()
        ctrl.send(BOTH, call(0, None, "helpers.gates.wait_for_file", str(gate), 120))
        ctrl.flush()
        keys = list(ctrl._tails.values())
        _until(
            client2, ctrl.token, lambda h: all(h["tasks"].get(str(k)) == "processing" for k in keys)
        )
        client2.loop.add_callback(intake.release, client2, ctrl.token, keys)
        time.sleep(0.5)
        held = client2.run_on_scheduler(_held, ctrl.token)
        assert all(held["tasks"][str(k)] == "processing" for k in keys), held
        gate.touch()
        assert ctrl.sync() == []
        held = _until(client2, ctrl.token, lambda h: not h["tasks"])
        assert held["tasks"] == {} and held["cancelled"] == [], held
    finally:
        gate.touch()
        ctrl.close()
