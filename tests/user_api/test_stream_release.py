"""A Stream's lane lives as long as the Stream: garbage streams end their lanes and threads.

Each check counts the lanes and lane threads of the mesh's own controller on
every worker (the shared cluster also runs other tests' controllers).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import warnings

import pytest
import torch
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch.protocol.names import PLUGIN_NAME, executor_name, executor_prefix

pytestmark = pytest.mark.timeout(300)


def _own_lanes(token: str, dask_worker=None) -> tuple[int, int, list]:
    """(lanes, lane threads, lane names) of controller ``token`` on this worker."""
    state = dask_worker.plugins[PLUGIN_NAME].ranks[token]
    prefix = executor_prefix(token)
    threads = [t for t in threading.enumerate() if t.name.startswith(prefix)]
    names = sorted(str(lane.name) for lane in state.lanes.values())
    return len(state.all_lanes()), len(threads), names


def own_lanes(client, mesh) -> dict:
    return client.run(_own_lanes, mesh._session.controller.token)


def settle(client, mesh, expected: dict, timeout: float = 60) -> dict:
    """The lane counts once they equal ``expected`` (or the last ones seen, after timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        now = {a: counts[:2] for a, counts in own_lanes(client, mesh).items()}
        if now == expected or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def averaged_step(x: dm.Tensor) -> dm.Tensor:
    """What a training step that makes its "comms" stream each time does (train_mlp, before)."""
    comms = dm.Stream("comms")
    grad, borrow = comms.borrow(x, mutable=True)
    with comms.activate():
        grad.reduce_("gpu", "avg")
    borrow.drop()
    return x * 1


BASELINE = (2, 2)  # the main stream and the control steps: two lanes, two threads


def test_streams_made_every_step_leave_no_lanes_or_threads(client2, mesh2):
    with mesh2.activate():
        x = averaged_step(torch.ones(4))  # the first collective also starts the control lane
        gc.collect()
        dm.inspect(x)
        baseline = {a: BASELINE for a in own_lanes(client2, mesh2)}
        assert settle(client2, mesh2, baseline) == baseline
        for _ in range(25):
            x = averaged_step(x)
        gc.collect()  # a borrow and its tensors form a cycle: the cyclic GC frees them
        assert dm.inspect(x).tolist() == [1.0] * 4  # also sends the drops
        assert settle(client2, mesh2, baseline) == baseline
        x = averaged_step(x)  # the mesh carries on; a new stream gets a new communicator
        assert dm.inspect(x).tolist() == [1.0] * 4


def test_a_live_stream_keeps_its_lane_and_shows_its_name(client2, mesh2):
    comms = dm.Stream("comms")
    with mesh2.activate():
        with comms.activate():
            y = torch.ones(2) + 1
            dm.inspect(y)
            gc.collect()
            dm.inspect(y)
        session = mesh2._session
        thread = executor_name(session.controller.token, session.stream_ref(comms).id) + "_0"
        for _, _, names in own_lanes(client2, mesh2).values():
            assert names == ["comms"]
        state = client2.run(lambda dask_worker: dask_worker.plugins[PLUGIN_NAME].state_snapshot())
        for snapshots in state.values():
            (mine,) = [s for s in snapshots if s["token"] == session.controller.token]
            assert sorted(str(lane["name"]) for lane in mine["lanes"]) == ["None", "comms"]
        del y  # the tensor alone keeps the stream: both must go
        assert dm.inspect(torch.zeros(1)).item() == 0
        assert all(names == ["comms", "main"] for _, _, names in own_lanes(client2, mesh2).values())
        del comms
        gc.collect()
        dm.inspect(torch.zeros(1))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = client2.run(lambda: [t.name for t in threading.enumerate()])
            lanes = own_lanes(client2, mesh2)
            if all(thread not in names for names in found.values()) and all(
                n == ["main"] for _, _, n in lanes.values()
            ):
                break
            time.sleep(0.2)
        assert all(thread not in names for names in found.values())
        assert all(names == ["main"] for _, _, names in lanes.values())


def test_an_undropped_borrow_collected_with_its_stream_gives_the_tensor_back(mesh2):
    def leak(x):
        side = dm.Stream("side")
        y, _ = side.borrow(x, mutable=True)
        with side.activate():
            y.add_(1)
        # neither the borrow nor the stream survives this call

    with mesh2.activate():
        x = torch.zeros(3)
        with pytest.warns(UserWarning, match="without drop"):
            leak(x)
            gc.collect()
        x.add_(1)  # the lender has its tensor back
        assert dm.inspect(x).tolist() == [2.0] * 3


def test_a_borrow_collected_on_the_event_loop_while_the_lock_is_held_does_not_block_it(
    mesh2, client2
):
    """A cyclic GC on the client's event loop thread finalized an undropped borrow while the
    user's thread held the session lock: Borrow.__del__ waited for the lock on the loop, so
    nothing the user's thread waited for on the loop came (a deadlock). The borrow is now
    dropped once the lock is free, before its dead stream is."""

    def leak(x):
        side = dm.Stream("side")
        y, borrow = side.borrow(x, mutable=True)
        with side.activate():
            y.add_(1)
        borrow.cycle = borrow  # only the cyclic GC finalizes it, with its stream

    session = mesh2._session
    collected = threading.Event()

    async def collect_on_the_loop() -> None:  # as an allocation on the loop may start one
        gc.collect()
        collected.set()

    with mesh2.activate():
        x = torch.zeros(3)
        gc.disable()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                leak(x)
                with session.lock:  # the user's thread, inside a user-API call
                    client2.loop.add_callback(collect_on_the_loop)
                    assert collected.wait(30), "the event loop waited for the session lock"
                    client2.sync(asyncio.sleep, 0.01, callback_timeout=30)  # the loop answers
                wait_until(lambda: not session._orphans, 30, "the borrow dropped")
        finally:
            gc.enable()
        x.add_(1)  # the lender has its tensor back
        assert dm.inspect(x).tolist() == [2.0] * 3


def test_a_compiled_function_keeps_the_streams_it_runs_on(mesh2):
    @dm.compile
    def twice_on_a_side_stream(x):
        side = dm.Stream("inner")
        y, borrow = side.borrow(x)
        with side.activate():
            z = y * 2
        borrow.drop()
        out, back = dm.get_active_stream().borrow(z)
        result = out + 0
        back.drop()
        return result

    with mesh2.activate():
        x = torch.ones(2)
        first = twice_on_a_side_stream(x)
        gc.collect()
        dm.inspect(first)
        again = twice_on_a_side_stream(x)  # replays on the "inner" lane: it must still exist
        assert dm.inspect(again).tolist() == [2.0, 2.0]
