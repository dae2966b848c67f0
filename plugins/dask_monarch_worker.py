"""Worker preload: make a ``dask worker`` a dask_monarch rank.

    dask worker SCHEDULER --nthreads 1 \\
        --preload /path/to/plugins/dask_monarch_worker.py --monarch-rank=0 [--monarch-gpu=0]

Same as ``--preload dask_monarch.preload`` (see that module): advertises the
rank resource ``monarch-rank<N>``, narrows CUDA_VISIBLE_DEVICES, installs the
WorkerPlugin before the worker registers. Write options as ``--opt=value``.
"""

from dask_monarch.preload import dask_setup, dask_teardown  # noqa: F401
