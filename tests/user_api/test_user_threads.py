"""The active mesh and stream are per thread and per asyncio task (contextvars)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)


def _drive(mesh, base: float, rounds: int, barrier: threading.Barrier, out: dict, key) -> None:
    """Activate ``mesh`` (and a stream of our own), compute, and check values, many times."""
    try:
        side = dm.Stream(f"side-{key}")
        barrier.wait(timeout=60)
        with mesh.activate():
            for i in range(rounds):
                x = torch.full((4,), base) + i
                with side.activate():
                    assert dm.get_active_stream() is side
                    y = torch.ones(2) * base
                assert dm.get_active_stream() is dm.get_active_stream() and \
                    dm.get_active_stream().name == "main"
                got = dm.inspect(x * 2)
                assert got.tolist() == [2 * (base + i)] * 4, (key, i, got)
                with side.activate():
                    assert dm.inspect(y).tolist() == [base, base]
        out[key] = "ok"
    except BaseException as e:  # reported by the main thread
        out[key] = e


def test_two_threads_drive_two_meshes_at_once(client2):
    meshes = [dm.device_mesh(client2, gpu=2), dm.device_mesh(client2, gpu=2)]
    try:
        out: dict = {}
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=_drive, args=(m, 10.0 * (k + 1), 15, barrier, out, k))
                   for k, m in enumerate(meshes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert out == {0: "ok", 1: "ok"}
    finally:
        for m in meshes:
            m.exit()


def test_a_thread_does_not_see_another_threads_mesh_or_stream(mesh2):
    seen = {}
    side = dm.Stream("side")

    def look() -> None:
        seen["stream"] = dm.get_active_stream()
        try:
            torch.ones(2) + 1  # plain local torch here: no mesh is active in this thread
            seen["local"] = True
        except BaseException as e:
            seen["local"] = e

    with mesh2.activate(), side.activate():
        t = threading.Thread(target=look)
        t.start()
        t.join(timeout=60)
    assert seen == {"stream": dm.get_active_stream(), "local": True}
    assert dm.get_active_stream().name == "main"


def test_asyncio_tasks_have_their_own_active_stream():
    a, b = dm.Stream("a"), dm.Stream("b")

    async def use(stream, other_started: asyncio.Event, started: asyncio.Event,
                  pause: float) -> str:
        with stream.activate():  # both tasks are inside their block at once; 'a' leaves first
            started.set()
            await other_started.wait()
            await asyncio.sleep(pause)
            return dm.get_active_stream().name

    async def main() -> list[str]:
        ea, eb = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(use(a, eb, ea, 0.01), use(b, ea, eb, 0.2))

    assert asyncio.run(main()) == ["a", "b"]
    assert dm.get_active_stream().name == "main"
