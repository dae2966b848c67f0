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
