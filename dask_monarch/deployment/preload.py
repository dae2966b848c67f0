"""Preloads that make ``dask worker`` / ``dask scheduler`` processes ready for dask_monarch.

For clusters dask_monarch did not start (``dask scheduler``/``dask worker``,
dask-jobqueue, dask-kubernetes; docs/deployment.md)::

    dask scheduler --preload dask_monarch.preload                 # the /monarch/ page
    dask worker SCHEDULER --nthreads 1 --preload dask_monarch.preload --monarch-rank=0
    dask worker SCHEDULER --nthreads 1 --preload dask_monarch.preload \\
        --monarch-rank=1 --monarch-gpu=1

``plugins/dask_monarch_worker.py`` and ``plugins/dask_monarch_scheduler.py``
are the same preloads as files, for ``--preload /path/to/file.py``.
Options must be written ``--opt=value``: distributed hands preload options
to click as a list, and ``--opt value`` fails with "Got unexpected extra
argument" (docs/dask.md §7). Give ``dask worker`` the scheduler address as its
first argument: with only ``--scheduler-file``, its parser takes the first
preload option for the (then ignored) address, and the option is lost.
Each option can also come from the environment (``MONARCH_RANK``,
``MONARCH_GPU``, ``MONARCH_TORCH_THREADS``, ``MONARCH_BATCHED_INTERVAL``),
which avoids both pitfalls.

``--monarch-batched-interval=1ms`` (on the scheduler's preload and every
worker's) lowers Dask's batched-send gaps as ``LocalMeshCluster`` does for
its own cluster: a fetch then takes about as long as on the embedded cluster
instead of about twice as long (docs/deployment.md, "As fast as the embedded
cluster"). It is the cluster's setting, shared by every client, so only the
operator opts into it.

On a worker, the preload runs before the worker registers with the
scheduler, so the rank resource is advertised from the first moment and the
plugin exists before any task arrives. ``--preload-nanny`` works too: then
``--monarch-gpu``/``--monarch-torch-threads`` become environment variables of
the worker process the nanny starts (and restarts).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import click

# Imported here, not in dask_setup: a scheduler imports its preloads before its dashboard
# starts, and the "More..." menu entry must exist by then.
from ..observability import dashboard
from ..protocol.names import PLUGIN_NAME, RESOURCE_CAPACITY, RESOURCE_PREFIX, rank_resource
from .comm_gaps import LowerGaps
from .options import DURATION

if TYPE_CHECKING:
    from distributed import Nanny, Worker
    from distributed.core import Server

logger = logging.getLogger("dask_monarch.preload")


async def setup_worker(
    worker: Worker,
    rank: int | None = None,
    gpu: str | None = None,
    torch_threads: int | None = None,
    batched_interval: float | None = None,
) -> None:
    """Make ``worker`` a dask_monarch rank: GPU choice, rank resource, the plugin (which lowers
    the worker's batched-send gap to ``batched_interval`` seconds, when given)."""
    from ..worker import MonarchWorkerPlugin

    if gpu is not None:
        import torch

        if torch.cuda.is_initialized():
            raise RuntimeError(
                "--monarch-gpu: CUDA is already initialised in this worker; "
                "use --preload-nanny, or set CUDA_VISIBLE_DEVICES yourself"
            )
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    if torch_threads is not None:
        import torch

        torch.set_num_threads(torch_threads)
    if rank is not None:
        name = rank_resource(rank)
        state = worker.state
        others = [r for r in state.total_resources if r.startswith(RESOURCE_PREFIX) and r != name]
        if others:
            raise ValueError(
                f"--monarch-rank={rank}: worker {worker.name} already advertises "
                f"the rank resource {others[0]}"
            )
        # Before registration the scheduler learns the resources from the registration itself.
        state.total_resources[name] = RESOURCE_CAPACITY
        state.available_resources[name] = RESOURCE_CAPACITY
    if PLUGIN_NAME not in worker.plugins:
        plugin = MonarchWorkerPlugin(batched_interval=batched_interval)
        await worker.plugin_add(plugin, name=PLUGIN_NAME)
    logger.info(
        "worker %s is a dask_monarch rank%s",
        worker.name,
        f" ({rank_resource(rank)})" if rank is not None else "",
    )


def setup_nanny(
    nanny: Nanny,
    gpu: str | None = None,
    torch_threads: int | None = None,
    batched_interval: float | None = None,
) -> None:
    """Set the environment of the worker process a nanny starts (and restarts)."""
    if batched_interval is not None:  # the worker's preload (--preload) reads it
        nanny.env["MONARCH_BATCHED_INTERVAL"] = f"{batched_interval}s"
    if gpu is not None:
        nanny.env["CUDA_VISIBLE_DEVICES"] = gpu
    if torch_threads is not None:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            nanny.env[var] = str(torch_threads)


@click.command(name="dask_setup")
@click.option(
    "--monarch-rank",
    type=click.IntRange(min=0),
    default=None,
    envvar="MONARCH_RANK",
    help="Advertise the rank resource monarch-rank<N>: controllers take workers in "
    "rank order (default: monarch-<worker name>, given when first claimed).",
)
@click.option(
    "--monarch-gpu",
    default=None,
    metavar="DEVICES",
    envvar="MONARCH_GPU",
    help="Narrow CUDA_VISIBLE_DEVICES to DEVICES (indices or UUIDs, comma "
    "separated) before torch initialises CUDA.",
)
@click.option(
    "--monarch-torch-threads",
    type=click.IntRange(min=1),
    default=None,
    envvar="MONARCH_TORCH_THREADS",
    help="Torch intra-op threads of this worker.",
)
@click.option(
    "--monarch-batched-interval",
    type=DURATION,
    default=None,
    metavar="DURATION",
    envvar="MONARCH_BATCHED_INTERVAL",
    help="Lower the gap between the batches of this server's streams (Dask's batched "
    "sends: 2-5 ms by default) to DURATION, as LocalMeshCluster does for its own (1ms): "
    "on the scheduler (to workers and clients) and on every worker (to the scheduler). "
    "The cluster's setting, shared by all its clients: an operator's opt-in.",
)
async def dask_setup(
    server: Server,
    monarch_rank: int | None,
    monarch_gpu: str | None,
    monarch_torch_threads: int | None,
    monarch_batched_interval: float | None,
) -> None:
    """Preload hook for schedulers (the dashboard page), workers and nannies."""
    from distributed import Nanny, Scheduler, Worker

    gap = monarch_batched_interval
    if isinstance(server, Scheduler):
        if monarch_rank is not None or monarch_gpu is not None or monarch_torch_threads:
            raise click.UsageError("--monarch-* options are for workers, not the scheduler")
        dashboard.install(server)
        if gap is not None:
            server.add_plugin(LowerGaps(gap))
    elif isinstance(server, Nanny):
        if monarch_rank is not None:
            raise click.UsageError("--monarch-rank is a worker option (use --preload)")
        setup_nanny(server, monarch_gpu, monarch_torch_threads, gap)
    elif isinstance(server, Worker):
        await setup_worker(server, monarch_rank, monarch_gpu, monarch_torch_threads, gap)
    else:
        raise TypeError(f"dask_monarch.preload cannot set up {server!r}")


def dask_teardown(server: Server) -> None:
    """Nothing to undo: the worker plugin's own teardown releases every rank."""
