"""The embedded cluster: one Dask worker process per rank on 127.0.0.1.

Every setting that matters for torch ranks is chosen here, not inherited:

* one worker process per rank, named ``rank<i>``, advertising the resource
  ``monarch-rank<i>`` (far above the number of lanes: it pins, never limits);
* ``nthreads=1`` for plain Dask tasks: stream lanes bring their own threads
  and raise the worker's thread budget as they are created;
* torch intra-op threads: the cores divided among the ranks (nanny workers
  default to ``OMP_NUM_THREADS=1``);
* workers are not daemonic, so pipes and data loaders can start processes;
* glibc keeps serving torch's large allocations from its heap
  (``MALLOC_MMAP_THRESHOLD_``): Dask's own malloc setting alone makes torch
  compute 2-3x slower in a worker (see :class:`RankNanny`);
* tensors are unmanaged memory to Dask (DESIGN decision 11): no spilling and
  no pausing (a paused rank would stall its lanes silently); a rank that
  crosses the terminate threshold is killed and its controller fails with
  ``DeviceException``;
* on GPUs, one worker per visible device with a rotated
  ``CUDA_VISIBLE_DEVICES``, as dask-cuda does;
* Dask's sampling profiler is off (``profile=True`` turns it on): it walks
  every thread's stack each 10 ms, which cost a 16 M-element gloo all-reduce
  12 % on a 2-core machine;
* the scheduler runs in its own process: a dask_monarch client is a busy
  Python loop, and a scheduler sharing its GIL answers late (measured: chain
  hops of 250 ms instead of 10 ms while the client sends messages);
* with a dashboard, the scheduler preloads :mod:`dask_monarch.dashboard`, so
  ``<dashboard>/monarch/`` shows every mesh, rank and stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time

import dask
import psutil
from distributed import Nanny, Scheduler, SpecCluster
from distributed.deploy.spec import ProcessInterface
from distributed.deploy.subprocess import SubprocessScheduler
from distributed.system import MEMORY_LIMIT

from ..protocol.names import RESOURCE_CAPACITY, rank_resource
from ..worker.plugin import MonarchWorkerPlugin

logger = logging.getLogger("dask_monarch.cluster")


class SchedulerProcess(SubprocessScheduler):
    """A scheduler in a subprocess that imports what the client imports.

    The scheduler unpickles task graphs, so it gets the client's ``sys.path``
    (an in-process scheduler would have it too); its log lines are forwarded
    to the ``dask_monarch.cluster`` logger, as a full pipe would block it.
    """

    async def _start(self) -> None:
        cmd = [sys.executable, "-m", "dask", "spec", "--spec",
               json.dumps({"cls": "distributed.Scheduler", "opts": self.scheduler_kwargs})]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self.process = await asyncio.create_subprocess_exec(*cmd, stderr=asyncio.subprocess.PIPE,
                                                            env=env)
        self._logs = asyncio.ensure_future(self._forward_logs())
        scheduler_file = self.scheduler_kwargs["scheduler_file"]
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and self.process.returncode is None:
            try:
                with open(scheduler_file) as f:
                    self.address = json.load(f)["address"]
                return
            except (OSError, json.JSONDecodeError):
                await asyncio.sleep(0.05)
        raise RuntimeError(f"the scheduler process did not start within {self.timeout}s "
                           f"(exit code {self.process.returncode})")

    async def close(self) -> None:
        """Stop forwarding logs, kill the process, wait for it and close its pipes.

        A killed scheduler leaves its scheduler file behind: it is removed here.
        """
        logs = getattr(self, "_logs", None)
        if logs is not None:
            logs.cancel()
        process, self.process = self.process, None
        if process is not None:
            if process.returncode is None:
                for child in psutil.Process(process.pid).children(recursive=True):
                    child.kill()
                process.kill()
                await process.wait()
            process._transport.close()  # or __del__ closes it after the loop is gone
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.scheduler_kwargs["scheduler_file"])
        await ProcessInterface.close(self)

    async def _forward_logs(self) -> None:
        stream = self.process.stderr if self.process else None
        while stream is not None:
            line = await stream.readline()
            if not line:
                return
            logger.debug("scheduler: %s", line.decode(errors="replace").rstrip())


# Dask starts workers with MALLOC_TRIM_THRESHOLD_=65536, which also turns off glibc's dynamic
# mmap threshold: every allocation over 128 KiB is then mmapped and unmapped on free, and
# torch pays page faults on each activation. Measured on an MLP step (1024 rows, 1024 hidden,
# one thread): 8.8 ms in a plain process, 25.8 ms with Dask's setting, 8.3 ms with this
# threshold added. Allocations below it come from the heap and are reused.
MALLOC_MMAP_THRESHOLD = str(64 << 20)


class RankNanny(Nanny):
    """A nanny whose worker process may have children (pipes, data loaders) and whose
    allocator serves torch well.

    Nanny reads ``distributed.worker.daemon`` from the global config of its
    own process each time it (re)starts the worker, not from its ``config``
    option, so the setting is applied around every start. The malloc setting
    must be in the environment before the process starts (``pre_spawn_env``);
    one the user gave (environment or Dask config) wins.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            self.pre_spawn_env.setdefault("MALLOC_MMAP_THRESHOLD_", MALLOC_MMAP_THRESHOLD)

    async def instantiate(self):
        with dask.config.set({"distributed.worker.daemon": False}):
            return await super().instantiate()


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


class LocalMeshCluster(SpecCluster):
    """A local cluster of ``n_ranks`` rank workers, ready for dask_monarch.

    ``device="cuda"`` starts one worker per GPU (``n_ranks=None``: all of
    them), ``"cpu"`` CPU ranks, ``"auto"`` CUDA if there are enough GPUs for
    ``n_ranks``, else CPU. A context manager, like every Dask cluster.
    """

    def __init__(self, n_ranks: int | None = None, device: str = "auto", *,
                 memory_limit: int | str | None = "auto", torch_threads: int | None = None,
                 dashboard_address: str | None = "127.0.0.1:0", scheduler_port: int = 0,
                 silence_logs: int = logging.WARNING, asynchronous: bool = False,
                 scheduler_process: bool = True, profile: bool = False,
                 worker_options: dict | None = None, **kwargs):
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if n_ranks is not None and (type(n_ranks) is not int or n_ranks < 1):
            raise ValueError(f"n_ranks must be a positive int or None, got {n_ranks!r}")
        gpus = _visible_gpus() if device != "cpu" else []
        if device == "auto":
            device = "cuda" if gpus and (n_ranks is None or len(gpus) >= n_ranks) else "cpu"
        if device == "cuda":
            if not gpus:
                raise ValueError("device='cuda' but no GPU is visible")
            n_ranks = len(gpus) if n_ranks is None else n_ranks
            if n_ranks > len(gpus):
                raise ValueError(f"n_ranks={n_ranks} but only {len(gpus)} GPUs are visible")
        elif n_ranks is None:
            raise ValueError("n_ranks is required for CPU ranks (no GPU to count)")
        self.n_ranks = n_ranks
        self.device = device
        cores = os.cpu_count() or 1
        threads = torch_threads or max(1, cores // n_ranks)
        if memory_limit == "auto":
            memory_limit = MEMORY_LIMIT // n_ranks
        workers = {}
        for i in range(n_ranks):
            env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
            if device == "cuda":  # worker i sees i, i+1, ..., 0, ..., i-1: its default GPU is i
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i:] + gpus[:i])
            options = {
                "name": f"rank{i}",
                "nthreads": 1,
                "host": "127.0.0.1",
                "resources": {rank_resource(i): RESOURCE_CAPACITY},
                "plugins": {MonarchWorkerPlugin()},
                "memory_limit": memory_limit,
                "env": env,
                "config": {
                    "distributed.worker.memory.target": False,
                    "distributed.worker.memory.spill": False,
                    "distributed.worker.memory.pause": False,
                    "distributed.worker.memory.terminate": 0.95,
                    "distributed.worker.profile.enabled": profile,
                },
                "dashboard_address": "127.0.0.1:0",
                "silence_logs": silence_logs,
                **(worker_options or {}),
            }
            workers[f"rank{i}"] = {"cls": RankNanny, "options": options}
        scheduler_options = {"host": "127.0.0.1", "port": scheduler_port,
                             "dashboard_address": dashboard_address}
        if dashboard_address is not None:  # the /monarch/ page (a preload reaches a subprocess)
            scheduler_options["preload"] = ["dask_monarch.dashboard"]
        if scheduler_process:
            scheduler = {"cls": SchedulerProcess,
                         "options": {"scheduler_kwargs": scheduler_options}}
        else:
            scheduler = {"cls": Scheduler, "options": scheduler_options}
        super().__init__(workers=workers, scheduler=scheduler, silence_logs=silence_logs,
                         asynchronous=asynchronous, name="LocalMeshCluster", **kwargs)

    def __repr__(self) -> str:
        return (f"LocalMeshCluster({self.n_ranks} {self.device} ranks, "
                f"scheduler={self.scheduler_address!r})")
