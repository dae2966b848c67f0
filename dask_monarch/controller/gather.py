"""``dm.gather``: the values of MeshFutures, and of Dask futures beside them, in one call.

``Client.gather`` finds the futures in its argument by type (a ``TaskRef``,
docs/dask.md §5) and hands back everything else unchanged: given a MeshFuture
(``fetch_shard``, a remote call's result) it would give back the MeshFuture
itself. A MeshFuture cannot be a ``TaskRef`` without silencing
``distributed.wait``/``progress`` (which skip TaskRefs that are not Dask
futures), and distributed has no hook for other kinds of futures; nor does
dask_monarch patch the user's ``Client``. So :func:`gather` is the call that
knows both: it waits for the MeshFutures in its argument (lists, tuples,
sets, dicts, nested, as Dask walks them), puts their values in their place,
and gives what remains to the Dask futures' own client, with the same
``errors=`` meaning. An argument without MeshFutures costs one walk of its
containers.
"""

from __future__ import annotations

from typing import Any

from distributed import Future

from .futures import MeshFuture

_CONTAINERS = (list, tuple, set, frozenset)


def gather(futures: Any, errors: str = "raise") -> Any:
    """The values of the MeshFutures and Dask futures in ``futures`` (a future, or lists,
    tuples, sets and dicts of them, nested), in their place.

    Parameters
    ----------
    futures
        A ``MeshFuture`` or ``distributed.Future``, or containers of them mixed
        with other values (which pass through).
    errors
        ``"raise"`` raises the first failure (a ``RemoteException`` for a
        MeshFuture); ``"skip"`` gives None for a failed future, as
        ``Client.gather`` does.
    """
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors= is 'raise' or 'skip', got {errors!r}")
    resolved = _resolve(futures, errors) if _holds(futures, MeshFuture) else futures
    dask_future = _first(resolved, Future)
    if dask_future is not None:
        resolved = dask_future.client.gather(resolved, errors=errors)
    return resolved


def _holds(value: Any, kind: type) -> bool:
    return _first(value, kind) is not None


def _first(value: Any, kind: type) -> Any:
    """The first ``kind`` in ``value``'s containers (None if none)."""
    if isinstance(value, kind):
        return value
    items = value.values() if type(value) is dict else value if type(value) in _CONTAINERS else ()
    for v in items:
        found = _first(v, kind)
        if found is not None:
            return found
    return None


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
