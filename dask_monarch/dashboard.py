"""``dask_monarch.dashboard``: the scheduler preload of the ``/monarch/`` page.

``dask scheduler --preload dask_monarch.dashboard`` runs :func:`dask_setup`;
the page itself is :mod:`dask_monarch.observability.dashboard`.
"""

from .observability.dashboard import dask_setup, install

__all__ = ["dask_setup", "install"]
