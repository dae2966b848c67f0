"""Long-lived gloo processes started as torchrun starts a job: the plain-PyTorch baselines'
ranks (``training.py``'s DDP, ``checkpoint.py``'s plain DCP). Each round tells every rank
what to do and collects one result per rank, so the rounds reuse the processes and their
process group as a long job would."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _serve(rank: int, world: int, port: int, threads: int, work, commands, results) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        while (command := commands[rank].get()) is not None:
            results.put(work(rank, *command))
    finally:
        dist.destroy_process_group()


class GlooRanks:
    """``world`` gloo processes; :meth:`run` has each call ``work(rank, *command)``."""

    def __init__(self, world: int, work: Callable[..., Any], threads: int = 1) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.world = world
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        self.context = mp.start_processes(
            _serve,
            args=(world, port, threads, work, self.commands, self.results),
            nprocs=world,
            join=False,
            start_method="spawn",
        )

    def run(self, *command: Any) -> list:
        """Every rank's result of ``work(rank, *command)``, in the order they finished."""
        for q in self.commands:
            q.put(command)
        return [self.results.get(timeout=600) for _ in range(self.world)]

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        self.context.join(60)
