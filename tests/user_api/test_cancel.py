"""``mesh.exit(cancel=True)`` stops a runaway remote function (issue 35 item 6): within
``dask_monarch.timeouts.cancel`` where Python code runs, freeing its lane's thread and its
execution slot and saying where it was; a call in C code is named, with the worker to restart.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import pytest
import torch
from distributed import Client
from helpers.waiting import wait_until

import dask_monarch as dm

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def client(throwaway_cluster):
    """A cluster of this module's own: a call stuck in C keeps a worker's slot a while."""
    with throwaway_cluster(2) as (_, client):
        yield client


def _lines(path) -> int:
    return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def _started(path, n: int) -> None:
    wait_until(lambda: _lines(path) >= n, 60, f"the remote function started {n} times")


def _threads_of(token: str) -> int:
    return sum(t.name.startswith(f"monarch-{token}-") for t in threading.enumerate())


def _busy(dask_worker=None) -> int:
    return len(dask_worker.state.executing)


def _freed(client: Client, token: str, timeout: float = 60) -> None:
    """Wait until no worker runs a task or keeps a lane thread of controller ``token``."""
    deadline = time.monotonic() + timeout
    while True:
        threads = client.run(_threads_of, token)
        busy = client.run(_busy)
        if not any(threads.values()) and not any(busy.values()):
            return
        assert time.monotonic() < deadline, f"lane threads {threads}, executing tasks {busy}"
        time.sleep(0.1)


def test_a_spinning_function_is_interrupted_and_its_thread_and_slot_freed(client, tmp_path):
    marker = str(tmp_path / "started")
    mesh = dm.device_mesh(client, gpu=2)
    token = mesh._session.controller.token
    spin = dm.remote("helpers.remote_fns.spin", propagate=lambda x, path: x)
    with mesh.activate():
        out = spin(torch.ones(2), marker)
        later = out + 1  # queued behind it: never runs
    mesh._session.controller.flush()
    _started(marker, 2)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning) as caught:
        mesh.exit(cancel=True)
    assert time.monotonic() - start < 30  # timeouts.cancel is 5 s; generous on a busy machine
    text = str(caught[0].message)
    assert text.count("interrupted") == 2, text  # both ranks
    assert "in spin (" in text and "while True:" in text, text
    assert "restart_workers" not in text
    _freed(client, token)
    del later
    other = dm.device_mesh(client, gpu=2)  # the workers serve the next mesh
    with other.activate():
        assert dm.inspect(torch.ones(2).reduce("gpu", "sum")).tolist() == [2.0, 2.0]
    other.exit()


def test_the_cancelled_call_names_its_lane_once(client, tmp_path):
    """The rank's report of the call it cancelled read "stream 'main' (1): stream 'main' (1):
    the call of seq 1 was cancelled": the rank names the lane of every fatal error of a
    segment, and the cancel's own message named it again."""
    marker = str(tmp_path / "started")
    mesh = dm.device_mesh(client, gpu=2)
    spin = dm.remote("helpers.remote_fns.spin", propagate=lambda x, path: x)
    with mesh.activate():
        spin(torch.ones(2), marker)
    controller = mesh._session.controller
    controller.flush()
    _started(marker, 2)
    with pytest.warns(RuntimeWarning):
        mesh.exit(cancel=True)
    cause = str(wait_until(lambda: controller._broken, 30, "the rank's report of the cancel"))
    assert "the call of seq" in cause and "was cancelled" in cause, cause
    assert cause.count("stream 'main'") == 1, cause
    _freed(client, controller.token)


def test_a_call_in_c_code_is_named_with_the_worker_to_restart(client, tmp_path):
    marker = str(tmp_path / "started")
    mesh = dm.device_mesh(client, gpu=2)
    token = mesh._session.controller.token
    nap = dm.remote("helpers.remote_fns.sleep_in_c", propagate=lambda x, s, path: x)
    with mesh.activate():
        nap(torch.ones(2), 12.0, marker)
    mesh._session.controller.flush()
    _started(marker, 2)
    with pytest.warns(RuntimeWarning) as caught:
        mesh.exit(cancel=True)
    text = str(caught[0].message)
    assert text.count("in C code") == 2, text
    assert "time.sleep(seconds)" in text and "client.restart_workers([" in text, text
    _freed(client, token)  # once the sleep returned, the interrupt ends the call


def test_exit_with_nothing_running_is_quiet(client):
    import warnings

    mesh = dm.device_mesh(client, gpu=2)
    with mesh.activate():
        dm.inspect(torch.ones(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh.exit(cancel=True)
    with pytest.raises(RuntimeError, match="has exited"):
        with mesh.activate():
            dm.inspect(torch.ones(1))


def test_a_call_the_release_ends_is_not_interrupted_after_it_returned(client, tmp_path):
    """Cancelling releases the rank first, which may take a while and end the call itself:
    the interrupt must then not land in the idle lane thread (it died of it) or in Dask's
    code finishing the task."""
    import warnings

    from helpers import remote_fns

    client.run(remote_fns.executor_errors, True)
    marker = str(tmp_path / "started")
    mesh = dm.device_mesh(client, gpu=2)
    token = mesh._session.controller.token
    wait = dm.remote("helpers.remote_fns.returns_on_release", propagate=lambda x, path: x)
    with mesh.activate():
        wait(torch.ones(2), marker)
    mesh._session.controller.flush()
    _started(marker, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what it says of the calls is not the point here
        mesh.exit(cancel=True)
    _freed(client, token)
    assert not any(client.run(remote_fns.executor_errors).values())


def test_fetches_pending_at_a_cancel_are_failed_for_every_way_of_waiting(client, tmp_path):
    """``concurrent.futures.wait``/``as_completed`` and done callbacks do not poll the mesh as
    ``result()`` does: a fetch that no report can resolve any more must fail."""
    marker = str(tmp_path / "started")
    mesh = dm.device_mesh(client, gpu=2)
    spin = dm.remote("helpers.remote_fns.spin", propagate=lambda x, path: x)
    with mesh.activate():
        pending = dm.fetch_shard(spin(torch.ones(2), marker))
    called = threading.Event()
    pending.add_done_callback(lambda _: called.set())
    _started(marker, 2)
    with pytest.warns(RuntimeWarning):
        mesh.exit(cancel=True)
    done, _ = concurrent.futures.wait([pending], timeout=30)
    assert done == {pending} and called.wait(5)
    with pytest.raises((dm.DeviceException, RuntimeError)):
        pending.result(timeout=5)
