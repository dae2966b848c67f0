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

import asyncio
import logging
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from distributed import Client
from distributed.comm.addressing import get_address_host

from .. import config
from .. import dask_internals as internals
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

logger = logging.getLogger("dask_monarch.controller")


def natural_key(text: str) -> tuple:
    """A sort key that orders the numbers inside ``text`` by value (``rank2 < rank10``)."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def registered_workers(client: Client) -> dict[str, dict]:
    """The workers the scheduler knows now, by address, each as the scheduler describes it.

    Asked of the scheduler directly: ``client.scheduler_info()`` fetches the
    same and then returns the client's cache, which the client's periodic
    refresh (``distributed.client.scheduler-info-interval``) may replace in
    between with one that has no per-worker entries: an empty ``"workers"``.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def choose_workers(
    client: Client,
    world_size: int,
    device: str,
    workers: list[str] | None,
    *,
    distinct_hosts: bool = False,
) -> list[str]:
    """The addresses of the ``world_size`` workers that become ranks 0, 1, ..., in that order.

    ``workers`` (addresses or worker names) are taken as given, in their order.
    Otherwise every registered worker is asked to describe itself. Those that
    answer within ``timeouts.placement`` are chosen from if they are enough: a
    worker that does not answer (a host cut off the network, still registered
    until the scheduler notices) is skipped, so a mesh over the remaining hosts
    starts at once. If they are too few, the others get up to
    ``timeouts.claim`` (a worker still starting up answers late). A worker
    that a heartbeat or an earlier choice found silent gets ``SUSPECT_TIMEOUT``
    only. ``distinct_hosts``: no two ranks on one host (the host of the
    worker's address).
    """
    known = registered_workers(client)
    timeout = config.seconds("timeouts.placement") or 0.0
    patience = max(timeout, config.seconds("timeouts.claim") or 0.0)
    if workers is not None:
        chosen = resolve_workers(workers, known)
        if len(chosen) != world_size:
            raise ValueError(
                f"workers= names {len(chosen)} workers for {world_size} ranks: give one per rank"
            )
        info, silent = describe_workers(
            client, chosen, timeout, patience, lambda info: len(info) == len(chosen)
        )
        if silent:
            raise ValueError(
                f"worker(s) {', '.join(silent)} did not answer (dask_monarch.timeouts.placement "
                f"{timeout:g}s, then timeouts.claim): cut off or frozen; choose other workers"
            )
        if device == "cuda":
            no_gpu = [a for a in chosen if not info[a]["gpus"]]
            if no_gpu:
                raise ValueError(f"device='cuda' but worker(s) {', '.join(no_gpu)} have no GPU")
        if distinct_hosts:
            hosts = [get_address_host(a) for a in chosen]
            shared = sorted({h for h in hosts if hosts.count(h) > 1})
            if shared:
                raise ValueError(
                    f"distinct_hosts=True but workers= puts several ranks on {', '.join(shared)}"
                )
        return chosen

    def candidates(info: dict[str, dict]) -> list[str]:
        """The workers that may become ranks, in rank order (:func:`rank_order`)."""
        if device == "cuda":
            info = {a: i for a, i in info.items() if i["gpus"]}

        chosen = sorted(info, key=lambda address: rank_order(address, info[address]))
        if distinct_hosts:
            first_of_host: dict[str, str] = {}
            for a in chosen:
                first_of_host.setdefault(get_address_host(a), a)
            chosen = list(first_of_host.values())
        return chosen

    info, silent = describe_workers(
        client,
        list(known),
        timeout,
        patience,
        lambda info: len(candidates(info)) >= world_size,
    )
    chosen = candidates(info)
    if len(chosen) < world_size:
        kind = "GPU workers" if device == "cuda" else "workers"
        where = " on distinct hosts" if distinct_hosts else ""
        text = (
            f"a mesh of {world_size} ranks needs {world_size} {kind}{where} (one per rank) "
            f"but the cluster has {len(chosen)} that answer"
        )
        if silent:
            text += f" ({len(silent)} did not answer: {', '.join(silent)})"
        raise ValueError(
            f"{text}: start more workers (dask-monarch run --ranks {world_size}, "
            f"LocalMeshCluster(n_ranks={world_size})) or make a mesh of fewer ranks"
        )
    if silent:
        logger.warning(
            "choosing ranks without worker(s) %s: they did not answer within %gs "
            "(dask_monarch.timeouts.placement)",
            ", ".join(silent),
            timeout,
        )
    return chosen[:world_size]


def resolve_workers(workers: list[str], known: dict[str, dict]) -> list[str]:
    """The addresses of ``workers`` (addresses or worker names), in their order."""
    if isinstance(workers, (str, bytes)) or not hasattr(workers, "__iter__"):
        raise TypeError(f"workers= must be a list of worker addresses or names, got {workers!r}")
    by_name = {str(i.get("name")): a for a, i in known.items()}
    chosen = []
    for w in workers:
        # an address the scheduler does not list (yet) is asked all the same, as Dask's
        # run() does: a worker re-registering after a restart keeps its place
        address = w if w in known or "://" in str(w) else by_name.get(str(w))
        if address is None:
            raise ValueError(
                f"no worker {w!r} in the cluster (workers: "
                f"{', '.join(sorted(by_name)) or 'none'}); give an address or a worker name"
            )
        if address in chosen:
            raise ValueError(f"worker {w!r} ({address}) is named twice in workers=")
        chosen.append(address)
    return chosen


SUSPECT_TIMEOUT = 1.0  # seconds a worker known to be silent gets to describe itself
_silent: set[str] = set()  # workers of this process's client that stopped answering lately


def note_silent(address: str) -> None:
    """Remember that ``address`` stopped answering (a heartbeat or a description).

    The next choice of ranks gives it ``SUSPECT_TIMEOUT`` instead of
    ``timeouts.placement``: a new mesh right after a host dropped off starts
    at once. It is forgotten as soon as it answers.
    """
    _silent.add(address)


def describe_workers(
    client: Client,
    addresses: list[str],
    timeout: float,
    patience: float,
    enough: Callable[[dict[str, dict]], bool],
) -> tuple[dict[str, dict], list[str]]:
    """Each worker's :func:`describe_worker`, and the addresses that did not answer.

    One request per worker, all at once, so a worker that does not answer
    holds up no other and costs ``timeout``, not a TCP timeout. If the answers
    by then are not ``enough``, the workers not known to be silent get until
    ``patience``.
    """

    async def every() -> dict[str, dict]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        tasks = {
            a: asyncio.ensure_future(internals.run_on(client, describe_worker, [a]))
            for a in addresses
        }

        def answers() -> dict[str, dict]:
            return {
                a: t.result()[a]
                for a, t in tasks.items()
                if t.done() and not t.cancelled() and t.exception() is None
            }

        async def wait(group: list[str], until: float) -> None:
            pending = [tasks[a] for a in group if not tasks[a].done()]
            if pending and until > loop.time():
                await asyncio.wait(pending, timeout=until - loop.time())

        trusted = [a for a in addresses if a not in _silent]
        await wait([a for a in addresses if a in _silent], start + min(timeout, SUSPECT_TIMEOUT))
        await wait(trusted, start + timeout)
        if not enough(answers()):
            await wait(trusted, start + patience)
        for a, t in tasks.items():
            if not t.done():
                t.cancel()
            elif not t.cancelled() and t.exception() is not None:
                logger.debug("worker %s did not describe itself: %r", a, t.exception())
        return answers()

    info = client.sync(every)
    silent = [a for a in addresses if a not in info]
    for a in addresses:
        if a in info:
            _silent.discard(a)
        else:
            note_silent(a)
    return info, silent


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
    gloo_connect = config.get("comm.gloo-connect", "lazy")
    if gloo_connect not in ("lazy", "eager"):
        raise ValueError(
            f"dask_monarch.comm.gloo-connect must be 'lazy' or 'eager', got {gloo_connect!r}"
        )
    settings = {
        "device": device,
        "collective_timeout": config.seconds("timeouts.collective"),
        "backend": backend,
        # check NCCL's per-communicator order on every rank (worker/nccl_rules.py)
        "emulate_nccl": bool(config.get("comm.emulate-nccl", False)),
        # gloo pairs connect at first use, not all at once per group (worker/groups.py)
        "gloo_connect": gloo_connect,
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
            entry = _client_gaps[id(comm)] = [internals.gap(comm), 0]
            internals.lower_gap(comm, interval)
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
                internals.set_gap(comm, entry[0])

    return restore


_gaps_lock = threading.Lock()
_client_gaps: dict[int, list] = {}  # id(a client's scheduler comm) -> [Dask's gap, controllers]


async def _create_lanes_by_address(
    token: str, by_address: dict[str, list[tuple]], dask_worker: Worker | None = None
) -> None:
    await create_lanes(token, by_address[dask_worker.address], dask_worker=dask_worker)
