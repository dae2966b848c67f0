"""The scheduler's flush intake: one compact message per flush, ordinary Dask tasks from it."""

from __future__ import annotations

import time

import dask
import pytest
import torch
from distributed import get_task_stream
from distributed.diagnostics.plugin import SchedulerPlugin
from raw import S0, call, create_streams

import dask_monarch as dm
from dask_monarch.controller.intake import PLUGIN_NAME, missing_on
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
            ctrl.send(BOTH, call(0, None, "gates.wait_for_file", str(gate), 120))
            ctrl.flush()
            keys = [future.key for future in ctrl._tails.values()]
            ctrl.send(BOTH, call(1, Ref(2), "torch.ones", 3))
            ctrl.flush()
            later = {lane: f.key for lane, f in ctrl._tails.items()}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                view = client2.run_on_scheduler(_task_view, list(later.values()))
                if all(v is not None for v in view.values()):
                    break
                time.sleep(0.05)
            gate.touch()
            assert ctrl.sync() == []
            # the task stream records a task when the scheduler learns it finished, which can
            # trail the reports: wait until none of them is processing any more
            while time.monotonic() < deadline:
                states = client2.run_on_scheduler(_task_view, list(later.values()))
                if all(v is None or v[0] == "memory" for v in states.values()):
                    break
                time.sleep(0.05)
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
        def report(self, msg, client=None): ...
        def client_releases_keys(self, keys, client, stimulus_id=None): ...
        def _find_lost_dependencies(self, dsk, keys): ...
        def _create_taskstate_from_graph(self, *, dsk, keys, client): ...

    missing = missing_on(OtherScheduler())
    assert "_create_taskstate_from_graph(annotations_by_type=)" in missing, missing
    assert missing_on(object()) == [
        "_find_lost_dependencies",
        "client_releases_keys",
        "report",
        "_create_taskstate_from_graph",
    ]
