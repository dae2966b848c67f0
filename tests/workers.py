"""Helpers that act on a rank's worker process from the test (not through Dask)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

from distributed import Client


@contextlib.contextmanager
def frozen(client: Client, address: str) -> Iterator[None]:
    """The worker process at ``address`` frozen with SIGSTOP (SIGCONT on the way out)."""
    pid = client.run(os.getpid, workers=[address])[address]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _inlined(dask_worker=None) -> int:
    plugin = dask_worker.plugins["dask_monarch"]
    return sum(lane.inlined for state in plugin.ranks.values() for lane in state.all_lanes())


def inlined_segments(client: Client, workers: list[str] | None = None) -> int:
    """Segments run on the event loop so far (worker/inline.py), on every worker or on
    ``workers``."""
    return sum(client.run(_inlined, workers=workers).values())
