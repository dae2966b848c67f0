"""Remote functions that block a lane until the test lets them go (by creating a file).

Their loops are their own, not ``helpers.waiting.wait_until``: the liveness reports name the
innermost frame of a running call, and the tests look for ``wait_for_file`` there."""

import os
import time


def wait_for_file(path, timeout=60.0):
    """Block until ``path`` exists (or ``timeout`` passes): a lane the test holds busy."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
