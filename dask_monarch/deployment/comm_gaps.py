"""Dask's batched-send gaps on a cluster dask_monarch started (a scheduler preload).

Dask waits a fixed gap between the batches of each of its streams
(docs/dask.md §11): scheduler→worker 5 ms, scheduler→client 2 ms,
worker→scheduler 2 ms. They set the latency floor of a flush, so
:class:`~dask_monarch.deployment.cluster.LocalMeshCluster` lowers them to
``dask_monarch.comm.batched-interval`` on its own scheduler (this preload)
and its own rank workers (the worker plugin's ``batched_interval``), from the
start. A controller never changes them on a cluster it did not start: they are
the cluster's, shared by every client (DESIGN decision 12).

The preload also works on a scheduler started by hand, for an operator who
wants the same latency on a cluster of their own::

    dask scheduler --preload dask_monarch.deployment.comm_gaps --batched-interval=1ms
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from distributed.diagnostics.plugin import SchedulerPlugin

from ..dask_internals import lower_scheduler_gaps
from .options import DURATION

if TYPE_CHECKING:
    from distributed import Scheduler

PLUGIN_NAME = "dask_monarch-comm-gaps"


class LowerGaps(SchedulerPlugin):
    """Lower the gap of the scheduler's stream to every worker and client to ``interval``."""

    name = PLUGIN_NAME

    def __init__(self, interval: float) -> None:
        if interval < 0:
            raise ValueError(f"a batched-send gap cannot be negative, got {interval}")
        self.interval = interval

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        lower_scheduler_gaps(scheduler, self.interval)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        lower_scheduler_gaps(scheduler, self.interval, worker)

    def add_client(self, scheduler: Scheduler, client: str) -> None:
        # called before the scheduler makes the client's stream: lower it right after
        scheduler.loop.add_callback(lower_scheduler_gaps, scheduler, self.interval, client)


@click.command(name="dask_setup")
@click.option(
    "--batched-interval",
    type=DURATION,
    default="1ms",
    show_default=True,
    help="The gap of the scheduler's streams to workers and clients.",
)
def dask_setup(scheduler: Scheduler, batched_interval: float) -> None:
    """Preload hook: add :class:`LowerGaps` to the scheduler."""
    scheduler.add_plugin(LowerGaps(batched_interval))
