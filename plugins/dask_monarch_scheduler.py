"""Scheduler preload: serve dask_monarch's dashboard page.

    dask scheduler --preload /path/to/plugins/dask_monarch_scheduler.py

Same as ``--preload dask_monarch.dashboard``: ``<dashboard>/monarch/`` and
the "Monarch" entry of the dashboard's "More..." menu.
"""

from dask_monarch.dashboard import dask_setup  # noqa: F401
