"""The embedded cluster: one Dask worker process per rank on 127.0.0.1.

Every setting that matters for torch ranks is chosen here, not inherited:

* one rank worker per rank, named ``rank<i>`` and advertising the resource
  ``monarch-rank<i>``, set up by :func:`~.workers.rank_worker_options` (the same
  recipe ``dask monarch worker`` uses on a GPU node: threads, allocator,
  memory manager, non-daemonic processes, rotated ``CUDA_VISIBLE_DEVICES``);
* torch intra-op threads: the cores divided among the ranks;
* a rank that crosses the memory manager's terminate threshold is killed
  and its controller fails with ``DeviceException`` (DESIGN decision 11);
* Dask's sampling profiler is off (``profile=True`` turns it on): it walks
  every thread's stack each 10 ms, which cost a 16 M-element gloo all-reduce
  12 % on a 2-core machine;
* the scheduler runs in its own process: a dask_monarch client is a busy
  Python loop, and a scheduler sharing its GIL answers late (measured: chain
  hops of 250 ms instead of 10 ms while the client sends messages); its event
  loop is timed every 200 ms rather than Dask's 20, as the rank workers' are
  (:data:`.workers.TICK_INTERVAL`): 12 of its 20 ms of CPU per idle second;
* with a dashboard, the scheduler preloads :mod:`dask_monarch.dashboard`, so
  ``<dashboard>/monarch/`` shows every mesh, rank and stream;
* Dask's batched-send gaps of its scheduler and workers are lowered to
  ``dask_monarch.comm.batched-interval`` from the start (:mod:`.comm_gaps`):
  this cluster is dask_monarch's own, so no controller has to change them;
* the scheduler runs in a session of its own, so a terminal's Ctrl-C reaches
  the client, not the scheduler, which stays up until the client has closed
  (it also ends if this process dies: it watches its stdin); the rank workers
  ignore SIGINT (:mod:`dask_monarch.worker.signals`).
* ``security=Security(...)`` (or ``True``: ``Security.temporary()``) runs every
  comm over ``tls://``: scheduler, workers, client and the controllers' report
  streams (docs/security.md);
* a cluster that fails to start stops what it started (scheduler process,
  workers) before raising;
* a rank worker that dies (killed, aborted, out of memory) always comes
  back: its nanny's restart is awaited however long it takes on a loaded
  machine, and a nanny that gave up is made again from the rank's spec
  (:meth:`LocalMeshCluster._await_rank`; Dask's ``SpecCluster`` closes a
  nanny whose worker is not back within ``distributed.deploy.lost-worker-timeout``,
  which left the cluster a rank short for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import time
from typing import Any

import dask
import psutil
from dask.utils import parse_timedelta
from distributed import Scheduler, Security, SpecCluster
from distributed.core import Status
from distributed.deploy.cluster import Cluster
from distributed.deploy.spec import ProcessInterface
from distributed.deploy.subprocess import SubprocessScheduler
from distributed.system import MEMORY_LIMIT

from .. import config
from .workers import RankNanny, rank_worker_options, tick_interval, visible_gpus

logger = logging.getLogger("dask_monarch.cluster")


class SchedulerProcess(SubprocessScheduler):
    """A scheduler in a subprocess that imports what the client imports.

    The scheduler unpickles task graphs, so it gets the client's ``sys.path``
    (an in-process scheduler would have it too); its log lines are forwarded
    to the ``dask_monarch.cluster`` logger, as a full pipe would block it. It
    runs in a session of its own (a terminal's Ctrl-C is the client's to
    handle: the scheduler must outlive the client's close) and ends when this
    process does (:mod:`.lifeline`).
    """

    def __init__(self, *args: Any, security: Security | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.security = security

    async def _start(self) -> None:
        options = dict(self.scheduler_kwargs)
        preload = list(options.get("preload") or [])
        argv = list(options.get("preload_argv") or [[] for _ in preload])
        options["preload"] = [*preload, "dask_monarch.deployment.lifeline"]
        options["preload_argv"] = [*argv, []]
        cmd = [
            sys.executable,
            "-m",
            "dask",
            "spec",
            "--spec",
            json.dumps({"cls": "distributed.Scheduler", "opts": options}),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
            **tls_environment(self.security),
        }
        tick = tick_interval()
        if tick is not None:
            env["DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL"] = tick
        self.process = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._logs = asyncio.ensure_future(self._forward_logs())
        self._watch = asyncio.ensure_future(self._watch_process(self.process))
        scheduler_file = self.scheduler_kwargs["scheduler_file"]
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and self.process.returncode is None:
            try:
                with open(scheduler_file) as f:
                    self.address = json.load(f)["address"]
                return
            except (OSError, json.JSONDecodeError):
                await asyncio.sleep(0.05)
        raise RuntimeError(
            f"the scheduler process did not start within {self.timeout}s "
            f"(exit code {self.process.returncode})"
        )

    async def close(self) -> None:
        """Stop forwarding logs, kill the process, wait for it and close its pipes.

        A killed scheduler leaves its scheduler file behind: it is removed here.
        """
        for task in (getattr(self, "_logs", None), getattr(self, "_watch", None)):
            if task is not None:
                task.cancel()
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

    @property
    def lost(self) -> bool:
        """The scheduler process ended without being closed (killed, crashed)."""
        return self.status == Status.failed

    async def _watch_process(self, process: asyncio.subprocess.Process) -> None:
        """A scheduler that dies is marked failed: closing the cluster then skips it."""
        code = await process.wait()
        if self.process is process and self.status == Status.running:
            logger.warning(
                "the scheduler process of %s ended on its own (exit code %s)", self.address, code
            )
            self.status = Status.failed

    async def _forward_logs(self) -> None:
        stream = self.process.stderr if self.process else None
        while stream is not None:
            line = await stream.readline()
            if not line:
                return
            logger.debug("scheduler: %s", line.decode(errors="replace").rstrip())


# Security fields -> the Dask config a process reads them from (a Security object cannot go
# through the scheduler's JSON spec; in-memory PEM text works there as it does in the object).
_TLS_CONFIG = {
    "tls_ca_file": "DASK_DISTRIBUTED__COMM__TLS__CA_FILE",
    "tls_ciphers": "DASK_DISTRIBUTED__COMM__TLS__CIPHERS",
    "tls_client_cert": "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT",
    "tls_client_key": "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY",
    "tls_scheduler_cert": "DASK_DISTRIBUTED__COMM__TLS__SCHEDULER__CERT",
    "tls_scheduler_key": "DASK_DISTRIBUTED__COMM__TLS__SCHEDULER__KEY",
    "tls_worker_cert": "DASK_DISTRIBUTED__COMM__TLS__WORKER__CERT",
    "tls_worker_key": "DASK_DISTRIBUTED__COMM__TLS__WORKER__KEY",
}


def tls_environment(security: Security | None) -> dict[str, str]:
    """Environment variables that give a subprocess the TLS settings of ``security``."""
    if security is None:
        return {}
    env = {
        var: getattr(security, field)
        for field, var in _TLS_CONFIG.items()
        if getattr(security, field, None)
    }
    env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] = str(bool(security.require_encryption))
    return env


def uses_tls(security: Security | None) -> bool:
    """Whether ``security`` asks for TLS; refuses encryption required without certificates."""
    if security is None:
        return False
    has_certs = bool(
        security.tls_ca_file
        and security.tls_scheduler_cert
        and security.tls_worker_cert
        and security.tls_client_cert
    )
    if security.require_encryption and not has_certs:
        raise ValueError(
            "security requires encryption but has no CA file and scheduler, worker and client "
            "certificates: give them (Security(tls_ca_file=..., tls_scheduler_cert=..., ...)) "
            "or use Security.temporary() (security=True)"
        )
    return has_certs


def _rank_number(name: Any) -> tuple:
    """``rank12`` -> (0, 12): rank workers in rank order, any other name after them."""
    number = str(name).removeprefix("rank")
    return (0, int(number), "") if number.isdigit() else (1, 0, str(name))


def _in_spawned_import_of_main() -> bool:
    """Whether this runs in the top level of a script a spawned child process re-imports
    (as ``__mp_main__``): a script without the ``__main__`` guard starting a cluster."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False


class LocalMeshCluster(SpecCluster):
    """A local cluster of ``n_ranks`` rank workers, ready for dask_monarch.

    Every rank is a worker process of its own under a nanny, on 127.0.0.1,
    with the dask_monarch plugin and a resource that pins rank ``i``'s tasks
    (``rank0`` .. ``rank<n-1>``). A context manager, like every Dask cluster;
    ``scale(n)`` adds or removes ranks from the highest.

    Parameters
    ----------
    n_ranks
        How many rank workers; None with ``device="cuda"``: one per visible GPU.
    device
        ``"cuda"``: one worker per GPU (GPUs found by asking the hardware);
        ``"cpu"``: CPU ranks; ``"auto"``: CUDA if enough GPUs for ``n_ranks``,
        else CPU.
    memory_limit
        Each worker's memory limit (bytes or ``"4GiB"``); ``"auto"``: the
        machine's memory shared equally; None: no limit.
    torch_threads
        Torch's intra-op threads per rank; None: the cores shared equally.
    dashboard_address
        Where the scheduler's dashboard (with the ``/monarch/`` page) listens;
        None: no dashboard.
    scheduler_port
        The scheduler's port; 0: any free one.
    silence_logs
        The log level below which the cluster's processes stay quiet.
    asynchronous
        As Dask's clusters: True inside a running event loop (``await cluster``).
    scheduler_process
        Run the scheduler in a process of its own (the default: the client's
        event loop never holds it up); False: in this process's loop.
    profile
        Keep distributed's statistical profiler on in the rank workers (off
        by default: it samples every thread, lanes included).
    worker_options
        More keyword arguments for each rank's nanny and worker.
    security
        A :class:`distributed.Security` with certificates, or ``True`` for
        ``Security.temporary()``; every comm is then ``tls://``.
    **kwargs
        Passed to :class:`distributed.SpecCluster`.
    """

    def __init__(
        self,
        n_ranks: int | None = None,
        device: str = "auto",
        *,
        memory_limit: int | str | None = "auto",
        torch_threads: int | None = None,
        dashboard_address: str | None = "127.0.0.1:0",
        scheduler_port: int = 0,
        silence_logs: int = logging.WARNING,
        asynchronous: bool = False,
        scheduler_process: bool = True,
        profile: bool = False,
        worker_options: dict | None = None,
        security: Security | bool | None = None,
        **kwargs: Any,
    ) -> None:
        if _in_spawned_import_of_main():
            raise RuntimeError(
                "LocalMeshCluster() ran again in a process it started, which imports the "
                "script first (multiprocessing's spawn): put the code that makes the cluster "
                'under `if __name__ == "__main__":` (README)'
            )
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if n_ranks is not None and (type(n_ranks) is not int or n_ranks < 1):
            raise ValueError(f"n_ranks must be a positive int or None, got {n_ranks!r}")
        gpus = visible_gpus() if device != "cpu" else []
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
        if security is True:
            security = Security.temporary()
        elif security is False:
            security = None
        tls = uses_tls(security)
        self.n_ranks = n_ranks
        self.device = device
        cores = os.cpu_count() or 1
        threads = torch_threads or max(1, cores // n_ranks)
        if memory_limit == "auto":
            memory_limit = MEMORY_LIMIT // n_ranks
        gap = config.seconds("comm.batched-interval")
        self._gpus = gpus if device == "cuda" else []
        self._rank_settings = {
            "torch_threads": threads,
            "memory_limit": memory_limit,
            "gpus": gpus if device == "cuda" else None,
            "host": "127.0.0.1",
            "profile": profile,
            "silence_logs": silence_logs,
            "batched_interval": gap,
        }
        self._rank_extra = {
            **({"security": security} if security is not None else {}),
            **(worker_options or {}),
        }
        workers = dict(self._rank_spec(i) for i in range(n_ranks))
        scheduler_options: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": scheduler_port,
            "dashboard_address": dashboard_address,
        }
        if tls:
            scheduler_options["protocol"] = "tls"
        preloads = {}  # module -> argv (a preload reaches a scheduler subprocess too)
        if dashboard_address is not None:  # the /monarch/ page
            preloads["dask_monarch.dashboard"] = []
        if gap is not None:
            preloads["dask_monarch.deployment.comm_gaps"] = [f"--batched-interval={gap}s"]
        if preloads:
            scheduler_options["preload"] = list(preloads)
            scheduler_options["preload_argv"] = list(preloads.values())
        if scheduler_process:
            scheduler = {
                "cls": SchedulerProcess,
                "options": {"scheduler_kwargs": scheduler_options, "security": security},
            }
        else:
            scheduler = {"cls": Scheduler, "options": {**scheduler_options, "security": security}}
        super().__init__(
            workers=workers,
            scheduler=scheduler,
            silence_logs=silence_logs,
            asynchronous=asynchronous,
            name="LocalMeshCluster",
            security=security,
            **kwargs,
        )

    def _rank_spec(self, i: int) -> tuple[str, dict]:
        """The name and the worker spec of rank ``i`` (the recipe every rank worker follows)."""
        options = rank_worker_options(f"rank{i}", rank=i, gpu_index=i, **self._rank_settings)
        return f"rank{i}", {"cls": RankNanny, "options": {**options, **self._rank_extra}}

    def new_worker_spec(self) -> dict:
        """The next rank worker: the lowest rank not running (Dask's scale() adds these)."""
        i = next(i for i in itertools.count() if f"rank{i}" not in self.worker_spec)
        name, spec = self._rank_spec(i)
        return {name: spec}

    @property
    def _supports_scaling(self) -> bool:
        return True

    def scale(self, n: int = 0, memory: Any = None, cores: Any = None) -> Any:
        """Run ``n`` rank workers: ``rank0 .. rank<n-1>`` (the highest ranks go first).

        A mesh holding a rank that goes away breaks (DeviceException); ranks
        keep their names and rank resources, so the workers that stay keep
        their ranks. CUDA ranks are limited to the visible GPUs.
        """
        if memory is not None or cores is not None:
            raise ValueError("LocalMeshCluster.scale takes a number of ranks, not memory or cores")
        if type(n) is not int or n < 0:
            raise ValueError(f"scale(n): n must be a non-negative int, got {n!r}")
        if getattr(self, "device", None) == "cuda" and n > len(self._gpus):
            raise ValueError(f"scale({n}) but only {len(self._gpus)} GPUs are visible")
        # Dask's scale() removes the last workers of the spec: keep it in rank order
        ordered = sorted(self.worker_spec, key=_rank_number)
        self.worker_spec = {name: self.worker_spec[name] for name in ordered}
        result = super().scale(n)
        self.n_ranks = n
        return result

    def _update_worker_status(self, op: str, msg: Any) -> None:
        """A rank worker that left is awaited until it is back (:meth:`_await_rank`), instead of
        SpecCluster's closing its nanny after ``distributed.deploy.lost-worker-timeout``.

        The worker may already be gone from ``scheduler_info``: ``wait_for_workers`` (a
        user's, or Dask's) replaces it with the scheduler's identity, which can drop the
        worker before its "remove" arrives. A KeyError here would end Dask's watch of the
        workers for good, so the name comes from the nanny that ran it instead.
        """
        if op != "remove":
            Cluster._update_worker_status(self, op, msg)  # the scheduler's view
            return
        info = self.scheduler_info["workers"].pop(msg, None)
        name = info["name"] if info is not None else self._rank_at(msg)
        if name is not None:
            delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
            asyncio.get_running_loop().call_later(delay, self._await_rank, name, delay)

    def _rank_at(self, address: str) -> str | None:
        """The rank whose nanny runs (or last ran) the worker at ``address``, if any."""
        for name, nanny in self.workers.items():
            if getattr(nanny, "worker_address", None) == address:
                return name
        return None

    def _await_rank(self, name: str, delay: float) -> None:
        """Rank ``name`` left the scheduler ``delay`` ago: wait on while its nanny restarts it,
        or make it again from its spec if the nanny gave up (a failed or timed-out start).

        A rank scaled away (no longer in the spec) or a closing cluster is left alone.
        """
        if self.status != Status.running or name not in self.worker_spec:
            return
        if any(w["name"] == name for w in self.scheduler_info["workers"].values()):
            return  # back
        nanny = self.workers.get(name)
        process = getattr(nanny, "process", None)
        restarting = (
            nanny is not None
            and nanny.status == Status.running
            and not (process is not None and process.status == Status.failed)
        )
        if restarting:
            asyncio.get_running_loop().call_later(delay, self._await_rank, name, delay)
            return
        logger.warning("the nanny of %s gave up restarting it: starting the rank again", name)
        if nanny is not None:
            del self.workers[name]
            self._futures.add(asyncio.ensure_future(nanny.close()))
        self._futures.add(self._correct_state())

    async def _close(self) -> None:
        """Close as SpecCluster does, and stop whatever that leaves running.

        With its scheduler process gone (killed, crashed), the workers are
        closed without asking it (which would wait 30 s per request to
        connect). A start that failed half-way (e.g. a comm refused) makes
        Dask's close raise before it reaches the scheduler: its process, and
        the workers', would outlive us.
        """
        scheduler = self.scheduler
        lost = isinstance(scheduler, SchedulerProcess) and scheduler.lost
        if lost:
            self.shutdown_scheduler = False
        try:
            await super()._close()
        finally:
            for worker in list(self.workers.values()):
                if getattr(worker, "process", None) is not None:
                    with contextlib.suppress(Exception):
                        await worker.close(timeout=5)
            if isinstance(scheduler, SchedulerProcess) and scheduler.process is not None:
                await scheduler.close()

    def __repr__(self) -> str:
        return (
            f"LocalMeshCluster({self.n_ranks} {self.device} ranks, "
            f"scheduler={self.scheduler_address!r})"
        )
