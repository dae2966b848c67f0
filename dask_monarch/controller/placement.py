"""Placement: which workers a controller's ranks run on, and the per-rank state it sets up there.

The workers are chosen in a stable order (:func:`rank_order`: GPU workers
first, explicit rank resources next, then names in natural order), claimed
as ranks, given lanes as flushes need them and, for the first collective, a
store rendezvous. Each step is one
``client.run`` on the workers concerned; the functions here hold no state (but
who lowered a client's batched-send gap), the
:class:`~dask_monarch.controller.Controller` keeps what they return.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from distributed import Client

from .. import config
from ..protocol.names import RESOURCE_PREFIX
from ..worker import (
    claim_rank,
    create_lanes,
    describe_worker,
    release_controller,
    set_rendezvous,
    start_rendezvous,
)

if TYPE_CHECKING:
    from distributed import Worker

    from ..protocol.messages import StreamCreationMode


def natural_key(text: str) -> tuple:
    """A sort key that orders the numbers inside ``text`` by value (``rank2 < rank10``)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def choose_workers(
    client: Client, world_size: int, device: str, workers: list[str] | None
) -> list[str]:
    """The addresses of the ``world_size`` workers that become ranks 0, 1, ..., in that order."""
    info = client.run(describe_worker, workers=workers)
    if device == "cuda":
        info = {a: i for a, i in info.items() if i["gpus"]}
    if len(info) < world_size:
        kind = "GPU workers" if device == "cuda" else "workers"
        raise ValueError(
            f"Controller needs {world_size} {kind} but the cluster has {len(info)}; "
            "start more workers or ask for a smaller world_size"
        )

    return sorted(info, key=lambda address: rank_order(address, info[address]))[:world_size]


_RANK_RESOURCE = re.compile(re.escape(RESOURCE_PREFIX) + r"rank(\d+)$")


def rank_order(address: str, described: dict) -> tuple:
    """The sort key that makes ranks stable: a worker keeps its rank across meshes.

    GPU workers first; among them, workers started with a rank resource
    (``monarch-rank<N>``) by N; then the others by name in natural order
    (``w2 < w10``), then address. The resource a worker without a rank gets
    when a controller first claims it (``monarch-<name>``) plays no part, so
    the order does not depend on which meshes ran before.
    """
    match = _RANK_RESOURCE.match(described["resource"] or "")
    explicit = (0, int(match.group(1))) if match else (1, 0)
    return (not described["gpus"], explicit, natural_key(str(described["name"])), address)


def claim_ranks(
    client: Client, token: str, workers: list[str], device: str, backend: str
) -> tuple[list[str], list[str]]:
    """Make ``workers[r]`` rank ``r`` of controller ``token``; returns their resources and devices.

    The resource is the one each rank's tasks are pinned with; the device is
    where the rank keeps its tensors (``device`` resolved on the worker).
    """
    if backend not in ("auto", "gloo"):
        raise ValueError(f"dask_monarch.backend must be 'auto' or 'gloo', got {backend!r}")
    settings = {
        "device": device,
        "collective_timeout": config.seconds("timeouts.collective"),
        "backend": backend,
    }
    ranks = {address: rank for rank, address in enumerate(workers)}
    replies = client.run(claim_rank, token, ranks, len(workers), settings, workers=workers)
    if backend != "gloo":
        shared = _sharing_a_gpu([replies[a] for a in workers])
        if shared:
            client.run(release_controller, token, workers=workers)
            raise ValueError(
                f"ranks {shared[0]} and {shared[1]} ({workers[shared[0]]}, "
                f"{workers[shared[1]]}) are on the same GPU, and NCCL needs a GPU per rank: give "
                "each worker its own GPU (dask monarch worker, --monarch-gpu, a rotated "
                "CUDA_VISIBLE_DEVICES), or set dask_monarch.backend to 'gloo'"
            )
    return [replies[a]["resource"] for a in workers], [replies[a]["device"] for a in workers]


def _sharing_a_gpu(replies: list[dict]) -> tuple[int, int] | None:
    """Two ranks whose claims named the same GPU, if any."""
    seen: dict[str, int] = {}
    for rank, reply in enumerate(replies):
        gpu = reply.get("gpu")
        if gpu is not None:
            if gpu in seen:
                return seen[gpu], rank
            seen[gpu] = rank
    return None


def add_lanes(
    client: Client,
    token: str,
    workers: list[str],
    new_lanes: dict[int, list[tuple[int, StreamCreationMode]]],
    names: dict[int, str],
) -> None:
    """Create the lanes ``(stream id, creation mode)`` a flush needs for the first time, by
    rank, with the names the dashboard and errors show (``names``: stream id -> name, where
    one was given)."""
    client.run(
        _create_lanes_by_address,
        token,
        {
            workers[r]: [(i, mode, names.get(i)) for i, mode in lanes]
            for r, lanes in new_lanes.items()
        },
        workers=[workers[r] for r in new_lanes],
    )


def open_rendezvous(client: Client, token: str, workers: list[str]) -> tuple[str, int]:
    """Start the store that collectives rendezvous through, on rank 0's worker (never here).

    Every rank is told its address; returns it.
    """
    first = workers[0]
    host, port = client.run(start_rendezvous, token, workers=[first])[first]
    client.run(set_rendezvous, token, host, port, workers=workers)
    return host, port


def lower_client_gap(client: Client) -> Callable[[], None]:
    """Lower the gap of ``client``'s own stream to the scheduler while a controller uses it.

    Dask waits 10 ms between the batches a client sends; flushes ride on them,
    so each controller lowers the gap to ``comm.batched-interval`` (null leaves
    it alone). Only this process's client changes: the scheduler's and the
    workers' gaps are the cluster's, shared by every client, and only a cluster
    dask_monarch started lowers them (deployment/comm_gaps.py). Returns the
    function that gives the gap back; the last controller of a client restores
    Dask's value.
    """
    interval = config.seconds("comm.batched-interval")
    comm = client.scheduler_comm
    if interval is None or comm is None:
        return lambda: None
    with _gaps_lock:
        entry = _client_gaps.get(id(comm))
        if entry is None:
            entry = _client_gaps[id(comm)] = [comm.interval, 0]
            comm.interval = min(comm.interval, interval)
        entry[1] += 1
    returned = False

    def restore() -> None:
        nonlocal returned
        with _gaps_lock:
            if returned:
                return
            returned = True
            entry[1] -= 1
            if entry[1] == 0 and _client_gaps.get(id(comm)) is entry:
                del _client_gaps[id(comm)]
                comm.interval = entry[0]

    return restore


_gaps_lock = threading.Lock()
_client_gaps: dict[int, list] = {}  # id(a client's scheduler comm) -> [Dask's gap, controllers]


async def _create_lanes_by_address(
    token: str, by_address: dict[str, list[tuple]], dask_worker: Worker | None = None
) -> None:
    await create_lanes(token, by_address[dask_worker.address], dask_worker=dask_worker)
