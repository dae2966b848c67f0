"""``with dm.trace("run.json"):`` — a Chrome/Perfetto trace of what every rank's lanes did.

On entry every rank of the traced meshes starts recording (each segment,
message and wait of each lane, with timestamps; free while no trace is on:
:mod:`dask_monarch.worker.tracing`). On exit the block's work is waited for,
the records are collected from every rank and written as one JSON file
(:mod:`dask_monarch.observability.chrome_trace`: a track per rank and stream,
flows for borrows, collectives and sends) that ui.perfetto.dev and
chrome://tracing open. The trace is also handed to the scheduler, whose
dashboard page links it (``/monarch/trace.json``), unless
``dask_monarch.trace.publish`` is false.

Dask's own view of the same run (task stream, transfers, worker profiles)
comes from ``distributed.performance_report``: pass ``performance_report=
"report.html"`` to write both from one block. docs/observability.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import config

if TYPE_CHECKING:
    from .controller import Controller
    from .mesh import DeviceMesh

logger = logging.getLogger("dask_monarch.trace")


class Trace:
    """What a ``dm.trace`` block wrote: ``path``, and the trace itself once the block ended."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.data: dict | None = None  # the Chrome trace (traceEvents ...), after the block

    @property
    def events(self) -> list[dict]:
        """The trace's events (empty until the block ended)."""
        return [] if self.data is None else self.data["traceEvents"]

    def __repr__(self) -> str:
        state = f"{len(self.events)} events" if self.data is not None else "recording"
        return f"Trace({self.path!r}, {state})"


@contextlib.contextmanager
def trace(
    path: str | os.PathLike,
    *,
    mesh: DeviceMesh | None = None,
    performance_report: str | os.PathLike | None = None,
    timeout: float = 600.0,
) -> Iterator[Trace]:
    """Trace the ranks of ``mesh`` (default: every mesh of this process that is not broken)
    into ``path``.

    The block's work is waited for at its end (up to ``timeout`` seconds), so
    the trace holds all of it. ``performance_report``: also write Dask's
    performance report of the block there. The trace is written even if the
    block raised (what ran until then), and a failure of the mesh still
    raises after it is written.
    """
    from .controller.controller import working_controllers

    result = Trace(path)
    if mesh is not None:
        controllers = [mesh._session.controller]
    else:  # a broken mesh left open runs nothing more: the others are still worth a trace
        controllers = working_controllers()
    if not controllers:
        raise RuntimeError(
            "dask_monarch.trace: no mesh is running in this process; create one with "
            "dask_monarch.device_mesh (or pass mesh=) before the trace block"
        )
    report = contextlib.nullcontext()
    if performance_report is not None:
        from distributed import performance_report as dask_report

        report = dask_report(filename=os.fspath(performance_report))
    origin = time.time()
    for controller in controllers:
        controller.start_trace()
    failed = False
    with report:
        try:
            yield result
        except BaseException:
            failed = True
            raise
        finally:
            meshes, error = _finish(controllers, timeout, drain=not failed)
            result.data = _write(result.path, meshes, origin, controllers)
            if error is not None and not failed:
                raise error


def _finish(
    controllers: list[Controller], timeout: float, drain: bool
) -> tuple[list[list[dict]], BaseException | None]:
    """Wait for the traced work (unless the block failed), then collect every rank's records;
    a failure of the wait is returned, to be raised once the trace is written."""
    error: BaseException | None = None
    if drain:
        for controller in controllers:
            try:
                controller.drain(timeout=timeout)
            except BaseException as e:  # written first, raised after
                error = error or e
    meshes = []
    for controller in controllers:
        try:
            meshes.append(controller.collect_trace())
        except Exception as e:
            logger.warning("the trace of mesh %s is lost: %s", controller.mesh_id, e)
            meshes.append([])
    return meshes, error


def _write(path: str, meshes: list[list[dict]], origin: float, controllers: list) -> dict:
    from .observability.chrome_trace import chrome_trace

    data = chrome_trace(meshes, origin)
    body = json.dumps(data, separators=(",", ":"), default=str)
    with open(path, "w", encoding="utf-8") as f:
        f.write(body)
    if config.get("trace.publish", True):
        _publish(controllers, body, data, path)
    return data


def _publish(controllers: list, body: str, data: dict, path: str) -> None:
    """Hand the trace to each scheduler the meshes run on (best effort: its page links it)."""
    from .observability.dashboard import publish_trace

    info: dict[str, Any] = {
        "time": time.time(),
        "events": len(data["traceEvents"]),
        "ranks": sum(c.world_size for c in controllers),
        "file": os.path.basename(path),
    }
    seen = set()
    for controller in controllers:
        client = controller.client
        if id(client) in seen:
            continue
        seen.add(id(client))
        try:
            client.run_on_scheduler(publish_trace, body, info)
        except Exception as e:  # the file is what counts; the page link is a convenience
            logger.info("the trace was not handed to the scheduler: %s", e)
