"""Deployment: the embedded cluster, preloads for `dask scheduler`/`dask worker`, the CLI."""
