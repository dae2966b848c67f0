"""Running a job again after its mesh broke: ``dask-monarch run --max-restarts`` and ``dm.elastic``.

As under torchrun, a job that keeps checkpoints survives a lost rank by
running again from the start: it makes a new mesh and resumes from its
latest checkpoint. Between two runs the meshes the failed run left open are
closed, and the cluster gets time to bring the rank back (a nanny restarts a
killed worker; a supervisor a host's; or a spare worker is there already).
``DASK_MONARCH_RESTART`` tells the job which run it is (0 first).

Only a broken mesh (:class:`~dask_monarch.DeviceException`: a lost worker, a
rank that stopped answering) is a reason to run again; a failure of the
user's own code (:class:`~dask_monarch.RemoteException`, any other
exception) would fail again the same way, and ends the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import config
from ..controller.placement import registered_workers
from ..exceptions import DeviceException, RemoteException

if TYPE_CHECKING:
    from distributed import Client

    from ..controller.session import Session

ENV = "DASK_MONARCH_RESTART"
logger = logging.getLogger("dask_monarch.restarts")


def restart_cause(exc: BaseException) -> DeviceException | None:
    """The broken mesh that ``exc`` comes from, or None when it is the user's own failure.

    Follows ``__cause__``/``__context__``: a RemoteException met first (the
    user's code failed, perhaps while a mesh was breaking) is not a reason.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RemoteException):
            return None
        if isinstance(exc, DeviceException):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def set_run(restart: int) -> None:
    """Tell the job which run this is (``DASK_MONARCH_RESTART``, 0 first)."""
    os.environ[ENV] = str(restart)


def close_sessions(sessions: list[Session]) -> None:
    """Close meshes a failed run left open, their failures already told: a broken one as it
    is (its controller released its ranks when it broke; asking them to cancel would wait
    on the lost one), one still working released at once (``exit(cancel=True)``)."""
    for session in sessions:
        if session.closed:
            continue
        with contextlib.suppress(Exception):
            session.exit(cancel=session.controller.broken is None)


def wait_for_ranks(client: Client, n: int, say: Callable[[str], None]) -> None:
    """Wait until ``n`` workers are registered and running (``elastic.wait-for-ranks``); raise
    TimeoutError saying how many came back otherwise.

    Asks the scheduler itself, not ``client.wait_for_workers``: with a cluster
    object that hands the wait to the cluster, which replaces its list of
    workers with the scheduler's; the news of the worker just lost, arriving
    after that, names one the list lacks, and the cluster's watch of its
    workers ends with a KeyError (LocalMeshCluster then brings no rank back,
    and its close raises it).
    """
    timeout = config.seconds("elastic.wait-for-ranks") or 300
    start = time.monotonic()
    while True:
        workers = registered_workers(client).values()
        have = sum(w.get("status", "running") == "running" for w in workers)
        if have >= n:
            break
        if time.monotonic() - start > timeout:
            raise TimeoutError(
                f"waited {timeout:g}s for {n} ranks to run again, {have} came back "
                "(dask_monarch.elastic.wait-for-ranks)"
            )
        time.sleep(0.1)
    say(f"{n} ranks are up after {time.monotonic() - start:.1f}s; running again")


def describe(cause: DeviceException) -> str:
    """One line of a broken mesh's cause (its first line)."""
    return str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
