"""Remote functions that block a lane until the test lets them go (by creating a file)."""

import contextlib
import os

from helpers.waiting import wait_until


def wait_for_file(path, timeout=60.0):
    """Block until ``path`` exists (or ``timeout`` passes): a lane the test holds busy."""
    with contextlib.suppress(TimeoutError):  # the lane goes on: the test's own checks fail
        wait_until(lambda: os.path.exists(path), timeout, f"the file {path}", every=0.02)
