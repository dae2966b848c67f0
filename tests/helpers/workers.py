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


def _inlined(token: str, dask_worker=None) -> int:
    state = dask_worker.plugins["dask_monarch"].ranks.get(token)
    return 0 if state is None else sum(lane.inlined for lane in state.all_lanes())


def inlined_segments(client: Client, mesh, workers: list[str] | None = None) -> int:
    """Segments of ``mesh``'s controller run on the event loop so far (worker/inline.py), on
    every worker or on ``workers``. Counted per controller: another controller's ranks leave
    their workers at any moment (a fixture's ``mesh.exit()``), and their counts with them."""
    token = mesh._session.controller.token
    return sum(client.run(_inlined, token, workers=workers).values())
