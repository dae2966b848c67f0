"""``dask_monarch.preload``: the preload of ``dask worker``, ``dask scheduler`` and nannies.

``--preload dask_monarch.preload`` runs :func:`dask_setup` (options
``--monarch-rank=``, ``--monarch-gpu=``, ``--monarch-torch-threads=``);
:mod:`dask_monarch.deployment.preload` says what it does.
"""

from .deployment.preload import dask_setup, dask_teardown

__all__ = ["dask_setup", "dask_teardown"]
