"""Functions the multi-host tests run on workers with ``client.run`` (pickled by value)."""

from __future__ import annotations

import os


def tokens(dask_worker=None) -> list[str]:
    """The controllers that hold a rank on this worker."""
    plugin = dask_worker.plugins.get("dask_monarch")
    return sorted(plugin.ranks) if plugin is not None else []


def pid() -> int:
    return os.getpid()


def set_config(key: str, value) -> None:
    """Set a dask config key in this worker process (as its environment would)."""
    import dask

    dask.config.set({key: value})


def threads_of(token: str) -> list[str]:
    """The live threads of controller ``token``'s lanes in this worker (``monarch-<token>-...``)."""
    import threading

    return sorted(t.name for t in threading.enumerate() if f"monarch-{token}-" in t.name)
