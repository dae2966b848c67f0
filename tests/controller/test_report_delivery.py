"""Reports reach a mesh's futures on the client's event loop, which the user's thread may be
waiting on (a flush that adds lanes asks the workers through ``client.run``): delivering them
must never wait on that thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def client(throwaway_cluster):
    """A cluster of this module's own: a deadlocked client would hang every later test."""
    with throwaway_cluster(2) as (_, client):
        yield client


def _in_thread(body, timeout: float) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = body()
        except BaseException as e:  # reported by the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "deadlock: the user's thread and the client's loop wait on each other"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_report_arriving_while_an_op_adds_a_lane_does_not_deadlock(client):
    mesh = dm.device_mesh(client, gpu=2)
    session = mesh._session
    slow = dm.remote("helpers.remote_fns.slow_copy", propagate=lambda x, seconds: x)
    try:

        def body():
            with mesh.activate():
                x = torch.ones(2)
                pending = dm.fetch_shard(slow(x, 0.3))  # its report comes in ~0.3 s
                # what every op does: send while holding the session's lock; the report
                # arrives meanwhile, and the op's flush adds a lane (client.run)
                with session.lock:
                    time.sleep(1.5)
                    side = dm.Stream("side")
                    with side.activate():
                        y = torch.ones(3) * 2
                    session.controller.flush()
                with side.activate():
                    got = dm.inspect(y, timeout=30)
                return pending.result(timeout=30), got

        first, second = _in_thread(body, 60)
        assert first.tolist() == [1.0, 1.0] and second.tolist() == [2.0, 2.0, 2.0]
    finally:
        mesh.exit(timeout=30)


def test_fetches_from_a_thread_while_another_makes_streams(client):
    mesh = dm.device_mesh(client, gpu=2)
    with mesh.activate():
        w = torch.ones(2)
    stop = threading.Event()
    fetched = []

    def fetcher() -> None:
        with mesh.activate():
            while not stop.is_set():
                fetched.append(dm.inspect(w, timeout=30))

    def body() -> int:
        t = threading.Thread(target=fetcher, daemon=True)
        t.start()
        try:
            with mesh.activate():
                for i in range(300):
                    side = dm.Stream(f"s{i}")  # a new lane in (almost) every flush
                    with side.activate():
                        torch.ones(1)
                    time.sleep(0.002)
        finally:
            stop.set()
            t.join(30)
        return len(fetched)

    try:
        assert _in_thread(body, 120) > 0
    finally:
        mesh.exit(timeout=30)


def test_a_fetch_in_a_done_callback_is_refused_not_left_to_hang(client):
    """Done callbacks run on the client's event loop, where reports arrive: a fetch that
    waited there could never resolve (and stopped the loop: heartbeats, every mesh)."""
    mesh = dm.device_mesh(client, gpu=2)
    try:
        with mesh.activate():
            x = torch.ones(2)
            y = x * 5
            seen: list = []

            def callback(f) -> None:
                try:
                    seen.append((f.result(), dm.inspect(y, timeout=20)))  # the first is done
                except BaseException as e:
                    seen.append(e)

            f = dm.fetch_shard(x)
            f.add_done_callback(callback)
            assert f.result(timeout=30).tolist() == [1.0, 1.0]
            start = time.monotonic()
            while not seen and time.monotonic() - start < 30:
                time.sleep(0.05)
            (error,) = seen
            assert isinstance(error, RuntimeError), error
            assert "event loop" in str(error) and "done callback" in str(error)
            assert time.monotonic() - start < 5
            assert dm.inspect(y, timeout=30).tolist() == [5.0, 5.0]  # the mesh still works
    finally:
        mesh.exit(timeout=30)
