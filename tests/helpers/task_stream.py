"""Waiting for Dask's task stream to hold a controller's segments.

The scheduler records a task in its task stream when it learns the task finished, which can
trail the reports a fetch returns on: a test that reads the task stream right after a fetch
waits here first.
"""

from __future__ import annotations

from distributed import Client

from helpers.waiting import wait_until

UNFINISHED = ("waiting", "queued", "processing", "no-worker")


def _unfinished(token: str, dask_scheduler=None) -> list:
    return [
        key
        for key, ts in dask_scheduler.tasks.items()
        if isinstance(key, tuple) and len(key) == 5 and key[1] == token
        if ts.state in UNFINISHED
    ]


def wait_until_recorded(client: Client, token: str, timeout: float = 60) -> None:
    """Return once no segment task of the controller ``token`` is left unfinished."""
    wait_until(
        lambda: not client.run_on_scheduler(_unfinished, token),
        timeout,
        f"controller {token}'s segments to finish",
        every=0.02,
    )
