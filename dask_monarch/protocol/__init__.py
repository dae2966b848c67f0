"""The protocol: plain data that crosses between the controller and its ranks.

``messages`` (Monarch's worker messages and the controller-bound replies),
``ndslice`` (slices of global ranks), ``wire`` (dask_monarch's own internal
steps), ``names`` (executor, plugin and resource names and the output
description that both sides build alike). No behaviour lives here: the
compiler routes these, the worker runs them.
"""
