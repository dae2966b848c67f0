"""A compiled function's recordings live on the ranks as long as the client can replay them.

Each check counts the recordings of the mesh's own controller on every worker
(the shared cluster also runs other tests' controllers), after the client's
pending deletes went out and every lane ran what was sent before.
"""

from __future__ import annotations

import gc

import pytest
import torch

import dask_monarch as dm
from dask_monarch.protocol.names import PLUGIN_NAME

pytestmark = pytest.mark.timeout(300)

_hold = dm.remote("helpers.gates.wait_for_file", propagate=lambda path, timeout: None)


def _recordings(token: str, dask_worker=None) -> int:
    return len(dask_worker.plugins[PLUGIN_NAME].ranks[token].recordings)


def recordings_now(client, mesh) -> list[int]:
    """The recordings each worker holds for ``mesh`` right now (nothing is waited for)."""
    return sorted(client.run(_recordings, mesh._session.controller.token).values())


def recordings_held(client, mesh) -> list[int]:
    """The recordings each worker holds for ``mesh`` once everything sent so far ran."""
    mesh._session.flush_pending()
    mesh._session.controller.sync()
    return recordings_now(client, mesh)


def test_a_collected_compiled_function_frees_its_recordings_on_every_rank(client2, mesh2):
    @dm.compile
    def step(x):
        return x * 2 + 1

    with mesh2.activate():
        y = step(torch.ones(2))  # traced: a recording
        y = step(y)  # replayed
        z = step(torch.ones(3))  # another shape: another recording
        gc.collect()
        assert recordings_held(client2, mesh2) == [2, 2]  # alive: kept
        assert dm.inspect(y).tolist() == [7.0, 7.0] and dm.inspect(z).tolist() == [3.0] * 3
        del step
        gc.collect()
        assert recordings_held(client2, mesh2) == [0, 0]
        assert dm.inspect(y + z[:2]).tolist() == [10.0, 10.0]  # the outputs live on


def test_a_replaced_trace_frees_its_recording(client2, mesh2):
    """A trace made again (a tensor it used was replaced) leaves the old recording to die."""
    with mesh2.activate():
        w = torch.ones(2)

        @dm.compile
        def step(x):
            return x + w

        step(torch.zeros(2))
        w = torch.full((2,), 2.0)
        out = step(torch.zeros(2))  # traced again: the first recording is garbage
        gc.collect()
        assert recordings_held(client2, mesh2) == [1, 1]
        assert dm.inspect(out).tolist() == [2.0, 2.0]


def test_a_replay_sent_before_the_function_died_runs_before_its_recording_goes(
    client2, mesh2, tmp_path
):
    """The delete follows the replays sent before it on every lane the recording runs on,
    also while one of those lanes is held busy and the other is not."""
    gate = tmp_path / "gate"
    with mesh2.activate():
        side = dm.Stream("side")

        @dm.compile
        def step(x):
            y = x * 2
            seen, borrow = side.borrow(y)
            with side.activate():
                total = seen.sum()
            borrow.drop()
            return y, total

        x = torch.ones(2)
        step(x)  # traced and defined
        assert recordings_held(client2, mesh2) == [1, 1]
        _hold(str(gate), 120.0)  # the main lanes wait for the gate
        y, total = step(x)  # a replay queued behind the gate
        del step
        gc.collect()
        mesh2._session.flush_pending()
        mesh2._session.controller.flush()
        assert recordings_now(client2, mesh2) == [1, 1]  # its replay has not run yet
        gate.touch()
        assert dm.inspect(y).tolist() == [2.0, 2.0]
        with side.activate():
            assert dm.inspect(total).item() == 4.0
        assert recordings_held(client2, mesh2) == [0, 0]


def test_a_function_collected_in_a_dry_run_frees_its_recording_after_it(client2, mesh2):
    """A dry run sends nothing: the recording of a function it outlived goes after it."""

    @dm.compile
    def step(x):
        return x + 1

    with mesh2.activate():
        y = step(torch.ones(2))
        assert recordings_held(client2, mesh2) == [1, 1]
        with dm.dry_run(mesh2):
            del step
            gc.collect()
            torch.ones(2) + 1  # sends the delete to the stand-in
        assert recordings_now(client2, mesh2) == [1, 1]
        assert recordings_held(client2, mesh2) == [0, 0]
        assert dm.inspect(y).tolist() == [2.0, 2.0]


def test_a_dry_run_keeps_the_recordings_of_before_and_deletes_none_of_its_own(client2, mesh2):
    """A compiled function traced in a dry run (its recording there is the stand-in's) sends
    the ranks no delete of that recording once the dry run is over."""

    @dm.compile
    def step(x):
        return x + 1

    controller = mesh2._session.controller
    deleted, send = [], controller.send

    def observe(ranks, message):
        if type(message) is dm.messages.DeleteRefs:
            deleted.extend(ref.id for ref in message.refs)
        send(ranks, message)

    with mesh2.activate():
        y = step(step(torch.ones(2)))  # traced and replayed: one recording
        with dm.dry_run(mesh2) as run:
            step(step(torch.ones(2)))  # traced for the dry run, replayed there
        made_inside = range(run._controller.first_id, mesh2._session.new_id())
        controller.send = observe
        try:
            del run
            gc.collect()
            assert recordings_held(client2, mesh2) == [1, 1]
            assert dm.inspect(step(y)).tolist() == [4.0, 4.0]  # replays its recording
            del step
            gc.collect()
            assert recordings_held(client2, mesh2) == [0, 0]
        finally:
            del controller.send
        assert deleted and not [ref for ref in deleted if ref in made_inside]
