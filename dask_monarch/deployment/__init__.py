"""Deployment: the embedded cluster, preloads for ``dask scheduler``/``dask worker``, the CLI.

``cluster`` (``LocalMeshCluster``: one worker process per rank on 127.0.0.1)
and ``workers`` (the rank workers it and ``dask monarch worker`` start);
``preload`` (what ``--preload dask_monarch.preload`` sets up), ``comm_gaps``
and ``lifeline`` (scheduler preloads: Dask's batched-send gaps, and a scheduler
that ends with its parent); ``cli`` (the ``dask-monarch`` command), ``runner``
(``dask-monarch run``), ``cluster_info`` (``dask-monarch info``) and
``debug_shell`` (``dask-monarch debug``); ``restarts`` (``--max-restarts`` and
``dm.elastic``: a job run again after its mesh broke); ``options`` (the checked
values of their command-line options).
"""
