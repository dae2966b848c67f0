"""``dask_monarch.dashboard``: the scheduler preload of the ``/monarch/`` page.

``dask scheduler --preload dask_monarch.dashboard`` runs :func:`dask_setup`;
listed in ``distributed.scheduler.http.routes``, its ``routes`` are served;
the page itself is :mod:`dask_monarch.observability.dashboard`.
"""

from .observability.dashboard import dask_setup, install, routes

__all__ = ["dask_setup", "install", "routes"]
