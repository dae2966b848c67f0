"""``client.gather`` that understands MeshFutures, on the clients that drive a mesh.

``Client.gather`` finds the futures in its argument by type (a ``TaskRef``,
docs/dask.md §5) and hands back everything else unchanged: a MeshFuture
(``fetch_shard``, a remote call's result) would come back as itself, a silent
wrong answer. A MeshFuture cannot be a ``TaskRef`` without silencing
``distributed.wait``/``progress`` (which skip TaskRefs that are not Dask
futures), and distributed has no hook for other kinds of futures. So every
client a dask_monarch mesh runs on gets this gather in place of its bound one:
it waits for the MeshFutures in the argument (lists, tuples, sets, dicts,
nested, as Dask walks them), puts their values in their place, and gives the
rest to Dask's own gather, with the same ``errors=`` meaning. An argument
without MeshFutures costs one walk of its containers.
"""

from __future__ import annotations

import functools
from typing import Any

from distributed import Client

from .session import MeshFuture

_CONTAINERS = (list, tuple, set, frozenset)


def serve_gather(client: Client) -> None:
    """Give ``client`` (once) a ``gather`` that resolves MeshFutures, then calls Dask's."""
    if "gather" in vars(client):  # installed already (or the user put one there)
        return
    dask_gather = client.gather

    @functools.wraps(Client.gather)
    def gather(futures: Any, errors: str = "raise", direct: Any = None, asynchronous: Any = None):
        if _holds_mesh_future(futures):
            futures = _resolve(futures, errors)
        return dask_gather(futures, errors=errors, direct=direct, asynchronous=asynchronous)

    client.gather = gather


def _holds_mesh_future(value: Any) -> bool:
    if isinstance(value, MeshFuture):
        return True
    if type(value) in _CONTAINERS:
        return any(_holds_mesh_future(v) for v in value)
    if type(value) is dict:
        return any(_holds_mesh_future(v) for v in value.values())
    return False


def _resolve(value: Any, errors: str) -> Any:
    """``value`` with each MeshFuture replaced by its result (``errors="skip"``: None for a
    failed one, as Dask's gather gives a failed future)."""
    if isinstance(value, MeshFuture):
        if errors == "skip" and value.exception() is not None:
            return None
        return value.result()
    if type(value) in _CONTAINERS:
        return type(value)(_resolve(v, errors) for v in value)
    if type(value) is dict:
        return {k: _resolve(v, errors) for k, v in value.items()}
    return value
