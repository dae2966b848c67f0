"""Scheduler preload: serve dask_monarch's dashboard page.

    dask scheduler --preload /path/to/plugins/dask_monarch_scheduler.py \\
        [--monarch-batched-interval=1ms]

Same as ``--preload dask_monarch.preload`` on a scheduler (see that module):
``<dashboard>/monarch/`` and the "Monarch" entry of the dashboard's "More..."
menu, and with ``--monarch-batched-interval`` the lower batched-send gaps.
Write options as ``--opt=value``.
"""

from dask_monarch.preload import dask_setup, dask_teardown  # noqa: F401
