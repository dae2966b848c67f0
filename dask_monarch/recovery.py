"""``dm.elastic``: a notebook's ``dask-monarch run --max-restarts``.

``dm.elastic(train, max_restarts=3)()`` calls ``train()``; when a mesh breaks
(:class:`~dask_monarch.DeviceException`: a rank was lost), it closes the
meshes that call made, waits until the cluster has its ranks again and calls
``train()`` once more, which resumes from its own checkpoint (the same
function that makes its mesh and loads ``dm.checkpoint.load`` when there is
one). The restart count is in ``DASK_MONARCH_RESTART`` (0 first) and each
restart is printed with its cause. A failure of the function itself
(:class:`~dask_monarch.RemoteException`, any other exception) is raised at
once: it would fail again. deployment/restarts.py holds what both share.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import distributed

from .controller.placement import registered_workers
from .controller.session import live_sessions
from .deployment import restarts

T = TypeVar("T")


def elastic(
    fn: Callable[..., T] | None = None,
    *,
    max_restarts: int = 3,
    client: distributed.Client | None = None,
    ranks: int | None = None,
) -> Any:
    """``fn`` that runs again, up to ``max_restarts`` times, when its mesh breaks.

    Usable as ``dm.elastic(fn, max_restarts=3)(*args)`` or as a decorator
    (``@dm.elastic(max_restarts=3)``). Before running again it waits
    (``dask_monarch.elastic.wait-for-ranks``) until ``client`` (default: Dask's
    default client) has ``ranks`` workers (default: as many as when the call
    started).
    """
    if type(max_restarts) is not int or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int of at least 0, got {max_restarts!r}")
    if fn is None:
        return lambda f: elastic(f, max_restarts=max_restarts, client=client, ranks=ranks)
    if not callable(fn):
        raise TypeError(f"dm.elastic needs a function, got {fn!r}")

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        dask_client = client if client is not None else distributed.default_client()
        n = ranks or len(registered_workers(dask_client))
        restart = 0
        while True:
            restarts.set_run(restart)
            before = set(live_sessions())
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                cause = restarts.restart_cause(e)
                if cause is None or restart >= max_restarts:
                    raise
                restarts.close_sessions([s for s in live_sessions() if s not in before])
                restart += 1
                _say(
                    f"the mesh broke ({restarts.describe(cause)}): restart {restart} of "
                    f"{max_restarts}; waiting for {n} ranks"
                )
                restarts.wait_for_ranks(dask_client, n, _say)

    return run


def _say(text: str) -> None:
    print(f"dask_monarch.elastic: {text}", file=sys.stderr, flush=True)
