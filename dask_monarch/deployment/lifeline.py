"""A scheduler preload: the scheduler ends when the process that started it dies.

LocalMeshCluster starts its scheduler in a session of its own, so that a
terminal's Ctrl-C reaches the client (which then closes the cluster in order)
and not the scheduler. The price is that nothing would stop that scheduler if
the client's process were killed outright. So the client keeps the write end
of a pipe that is the scheduler's stdin: when the client's process ends, for
any reason, the pipe closes, and this preload closes the scheduler (and, if
that takes too long, ends its process).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Scheduler

CLOSE_TIMEOUT = 5.0  # seconds a scheduler whose parent died gets to close


def dask_setup(scheduler: Scheduler) -> None:
    """Watch stdin on a daemon thread; at its end, close ``scheduler``."""
    stdin = sys.stdin.buffer if sys.stdin is not None else None
    if stdin is None:
        return
    loop = scheduler.loop

    def watch() -> None:
        while stdin.read(1 << 16):
            pass  # nothing is ever written: only the end matters
        loop.add_callback(scheduler.close, reason="its parent process ended")
        deadline = threading.Timer(CLOSE_TIMEOUT, os._exit, (0,))
        deadline.daemon = True
        deadline.start()

    threading.Thread(target=watch, name="dask_monarch-lifeline", daemon=True).start()
