"""Rank workers: a Dask worker process per rank (LocalMeshCluster and `dask monarch worker`).

A rank worker is a :class:`RankNanny` whose worker process is set up for
torch: its rank resource (``monarch-rank<i>``, far above the number of lanes:
it pins, never limits), the plugin, ``nthreads=1`` for plain Dask tasks
(stream lanes bring their own threads), torch's intra-op threads, a
non-daemonic process (pipes and data loaders start processes), glibc's heap
for torch's allocations, tensors as unmanaged memory (no spilling, no
pausing: a paused rank would stall its lanes silently), and on GPUs a
``CUDA_VISIBLE_DEVICES`` rotated so that the worker's default device is its
own GPU, as dask-cuda does. :func:`rank_worker_options` is that recipe;
:func:`run_node` starts one worker per GPU of a node against any scheduler
(the ``dask monarch worker`` command).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import dask
from distributed import Nanny

from ..protocol.names import RESOURCE_CAPACITY, rank_resource
from ..worker import MonarchWorkerPlugin

if TYPE_CHECKING:
    from distributed.core import Status

logger = logging.getLogger("dask_monarch.deployment")

# Dask starts workers with MALLOC_TRIM_THRESHOLD_=65536, which also turns off glibc's dynamic
# mmap threshold: every allocation over 128 KiB is then mmapped and unmapped on free, and
# torch pays page faults on each activation. Measured on an MLP step (1024 rows, 1024 hidden,
# one thread): 8.8 ms in a plain process, 25.8 ms with Dask's setting, 8.3 ms with this
# threshold added. Allocations below it come from the heap and are reused.
MALLOC_MMAP_THRESHOLD = str(64 << 20)
# Dask's trim threshold also gives the heap's top back to the OS whenever more than 64 KiB of
# it is free: each step's activations then fault their pages in again (an MLP step of 1024
# rows and 1024 hidden: about 350 page faults and 0.7-2.7 ms of system time per step, none at
# this threshold). Only Dask's default is replaced: a value the user configured stays.
MALLOC_TRIM_THRESHOLD = str(64 << 20)
DASK_TRIM_THRESHOLD = "65536"
# Dask times every server's event loop fifty times a second (the tick, which logs when the loop
# was blocked longer than distributed.admin.tick.limit, 3 s): on an idle rank worker that was
# two thirds of its event loop's CPU (22 ms per second; 7.5 ms at 200 ms), taken from the
# lanes' cores while they run; on a LocalMeshCluster's idle scheduler, 12 of its 20 ms per
# second. 200 ms still sees a loop blocked for seconds. Only Dask's default is replaced: a
# value the user configured stays.
TICK_INTERVAL = "200ms"
DASK_TICK_INTERVAL = "20ms"


def tick_interval() -> str | None:
    """The tick of the servers dask_monarch starts: ``TICK_INTERVAL`` where the user kept
    Dask's default, else None (theirs stays)."""
    if dask.config.get("distributed.admin.tick.interval") == DASK_TICK_INTERVAL:
        return TICK_INTERVAL
    return None


class RankNanny(Nanny):
    """A nanny whose worker process may have children (pipes, data loaders), whose
    allocator serves torch well, and that samples no system figures of its own.

    Nanny reads ``distributed.worker.daemon`` from the global config of its
    own process each time it (re)starts the worker, not from its ``config``
    option, so the setting is applied around every start. The malloc settings
    must be in the environment before the process starts (``pre_spawn_env``);
    one the user gave (environment or Dask config) wins.

    Every Dask server samples CPU, memory, network and disk twice a second
    (``SystemMonitor``) and times its event loop fifty times a second (the
    tick, which logs at info level when the loop was blocked); a nanny's
    figures are shown and sent nowhere (its worker reports its own). A
    ``LocalMeshCluster``'s nannies live in the client's process, whose GIL
    the user's thread needs: four of them spent 40 of its 75 ms of idle CPU
    per second on these (benchmarks/RESULTS.md). The memory monitor, which
    restarts a worker near its memory limit, stays.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for figures in ("monitor", "tick"):
            self.periodic_callbacks.pop(figures, None)
        if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            self.pre_spawn_env.setdefault("MALLOC_MMAP_THRESHOLD_", MALLOC_MMAP_THRESHOLD)
        for env in (self.pre_spawn_env, self.env):  # the worker process applies both
            if str(env.get("MALLOC_TRIM_THRESHOLD_")) == DASK_TRIM_THRESHOLD:
                env["MALLOC_TRIM_THRESHOLD_"] = MALLOC_TRIM_THRESHOLD

    async def instantiate(self) -> Status:
        with _not_daemonic():
            return await super().instantiate()


_starting = 0  # RankNanny starts in progress (all on one event loop)
_daemon_before: Any = None


@contextlib.contextmanager
def _not_daemonic() -> Iterator[None]:
    """``distributed.worker.daemon: false`` while any RankNanny starts its worker, and what
    it was before once the last start ends. Nested ``dask.config.set`` blocks of concurrent
    starts would end out of order and leave the setting false in the user's process."""
    global _starting, _daemon_before
    if _starting == 0:
        _daemon_before = dask.config.get("distributed.worker.daemon", True)
        dask.config.set({"distributed.worker.daemon": False})
    _starting += 1
    try:
        yield
    finally:
        _starting -= 1
        if _starting == 0:
            dask.config.set({"distributed.worker.daemon": _daemon_before})


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as the hardware reports them.

    ``torch.cuda.device_count()`` asks NVML, as dask-cuda does (else the CUDA
    driver), honouring ``CUDA_VISIBLE_DEVICES`` and without initialising CUDA
    in this process; a host without a GPU or driver, or a CPU build of torch,
    has none whatever ``CUDA_VISIBLE_DEVICES`` says (a CPU host that set it
    started "1 cuda ranks" that then failed). With the variable set, the GPUs
    keep its names (indices or UUIDs), as many as the hardware has among them.
    """
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(count)]
    return [d.strip() for d in visible.split(",") if d.strip()][:count]


def parse_gpus(text: str) -> list[str]:
    """``--gpus 0,1,3`` (indices or UUIDs) as a list; refuses empty items and duplicates."""
    gpus = [g.strip() for g in text.split(",")]
    if not all(gpus):
        raise ValueError(f"--gpus {text!r}: an empty item (write e.g. 0,1,2)")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {text!r}: a GPU is named twice (two ranks would share it)")
    return gpus


def rotated(gpus: list[str], index: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of the worker for ``gpus[index]``: that GPU first, then the rest
    (so device 0 in the worker is its own GPU, and peer access still sees every GPU)."""
    return ",".join(gpus[index:] + gpus[:index])


def rank_worker_options(
    name: str,
    *,
    rank: int | None,
    torch_threads: int,
    memory_limit: int | str | None,
    gpus: list[str] | None = None,
    gpu_index: int = 0,
    host: str | None = None,
    profile: bool = False,
    silence_logs: int = logging.WARNING,
    batched_interval: float | None = None,
) -> dict:
    """The :class:`RankNanny` options of one rank worker (see the module docstring).

    ``batched_interval`` lowers the gap of the worker's stream to the scheduler
    (only on clusters dask_monarch starts: :mod:`.comm_gaps`).
    """
    env = {"OMP_NUM_THREADS": str(torch_threads), "MKL_NUM_THREADS": str(torch_threads)}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = rotated(gpus, gpu_index)
    options = {
        "name": name,
        "nthreads": 1,
        "plugins": {MonarchWorkerPlugin(batched_interval=batched_interval)},
        "memory_limit": memory_limit,
        "env": env,
        "config": {
            "distributed.worker.memory.target": False,
            "distributed.worker.memory.spill": False,
            "distributed.worker.memory.pause": False,
            "distributed.worker.memory.terminate": 0.95,
            "distributed.worker.profile.enabled": profile,
        },
        "silence_logs": silence_logs,
    }
    tick = tick_interval()
    if tick is not None:
        options["config"]["distributed.admin.tick.interval"] = tick
    if rank is not None:
        options["resources"] = {rank_resource(rank): RESOURCE_CAPACITY}
    if host is not None:
        options["host"] = host
        options["dashboard_address"] = f"{host}:0"
    return options


async def run_node(
    scheduler: str | None,
    scheduler_file: str | None,
    gpus: list[str],
    *,
    first_rank: int | None,
    torch_threads: int | None,
    memory_limit: int | str | None,
    host: str | None,
    name_prefix: str | None,
    batched_interval: float | None = None,
) -> None:
    """Start one rank worker per GPU (``gpus``) and run until they stop or a signal arrives."""
    from distributed._signals import wait_for_signals
    from distributed.system import MEMORY_LIMIT

    if not gpus:
        raise ValueError(
            "no GPU is visible on this node (give --gpus, or use dask worker "
            "with --preload dask_monarch.preload for CPU ranks)"
        )
    threads = torch_threads or max(1, (os.cpu_count() or 1) // len(gpus))
    if memory_limit == "auto":
        memory_limit = MEMORY_LIMIT // len(gpus)
    prefix = name_prefix or socket.gethostname()
    nannies = [
        RankNanny(
            scheduler,
            scheduler_file=scheduler_file,
            **rank_worker_options(
                f"{prefix}-gpu{gpu}",
                rank=None if first_rank is None else first_rank + i,
                torch_threads=threads,
                memory_limit=memory_limit,
                gpus=gpus,
                gpu_index=i,
                host=host,
                batched_interval=batched_interval,
            ),
        )
        for i, gpu in enumerate(gpus)
    ]

    async def finish() -> None:
        await asyncio.gather(*nannies)
        logger.info("%d rank workers started (GPUs %s)", len(nannies), ",".join(gpus))
        await asyncio.gather(*(n.finished() for n in nannies))

    async def stop_on_signal() -> None:
        signum = await wait_for_signals()
        await asyncio.gather(*(n.close(timeout=10, reason=f"signal-{signum}") for n in nannies))

    tasks = [asyncio.create_task(finish()), asyncio.create_task(stop_on_signal())]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in done:
        task.result()
