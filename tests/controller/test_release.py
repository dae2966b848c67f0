"""A controller lets go of its futures in batches, off a round trip's path, once Dask has
finished them (controller/release.py, docs/dask.md §11)."""

from __future__ import annotations

import time

import pytest
from distributed import Event

from dask_monarch.controller.release import DeferredRelease

pytestmark = pytest.mark.timeout(60)


def _on_scheduler(keys: list, dask_scheduler=None) -> dict:
    """Each key's state on the scheduler (None: forgotten) and whether it was ever cancelled."""
    return {
        key: (
            dask_scheduler.tasks[key].state if key in dask_scheduler.tasks else None,
            any(
                start == "processing" and finish == "released"
                for _, start, finish, *_ in dask_scheduler.story(key)
            ),
        )
        for key in keys
    }


def _on_scheduler_now(client, keys: list) -> list:
    return list(client.run_on_scheduler(_on_scheduler, keys).values())


def _until_forgotten(client, keys: list, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        states = client.run_on_scheduler(_on_scheduler, keys)
        if all(state is None for state, _ in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def _wait_for(event_name: str) -> int:
    Event(event_name).wait(30)
    return 1


def test_futures_let_go_of_are_released_together_after_a_pause(client2):
    futures = client2.map(lambda i: i, range(3), pure=False)
    client2.gather(futures)
    keys = [future.key for future in futures]
    released = DeferredRelease(client2.loop, after=1.0)
    released.add([*futures, None])
    del futures
    # our references are gone; the batch holds them for a second
    assert all(state == "memory" for state, _ in _on_scheduler_now(client2, keys))
    states = _until_forgotten(client2, keys)
    assert all(state is None for state, _ in states.values()), states


def test_a_future_still_processing_waits_for_a_later_batch(client2):
    """Released while processing, the scheduler would cancel the task (missing from the task
    stream); the batch keeps it until it finished."""
    # this client's scheduler: the default client is whichever the session made last
    event = Event("dask_monarch-test-release", client=client2)
    future = client2.submit(_wait_for, "dask_monarch-test-release", pure=False)
    key = future.key
    released = DeferredRelease(client2.loop, after=0.05)
    released.add([future])
    del future
    time.sleep(0.5)  # ten batches pass
    ((state, cancelled),) = _on_scheduler_now(client2, [key])
    assert (state, cancelled) == ("processing", False)
    event.set()
    states = _until_forgotten(client2, [key])
    assert states == {key: (None, False)}


def test_after_close_futures_go_at_once(client2):
    futures = client2.map(lambda i: i + 1, range(2), pure=False)
    client2.gather(futures)
    keys = [future.key for future in futures]
    released = DeferredRelease(client2.loop, after=3600.0)
    released.add(futures[:1])
    client2.sync(_close_on_loop, released)  # as a broken or closed controller does
    released.add(futures[1:])
    del futures
    states = _until_forgotten(client2, keys)
    assert all(state is None for state, _ in states.values()), states


async def _close_on_loop(released: DeferredRelease) -> None:
    released.close()
