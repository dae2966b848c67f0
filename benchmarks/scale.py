"""The control plane at scale, by simulation (issue 38): one mesh over 8 to 1 024 ranks here.

    python benchmarks/scale.py [--ranks 8 64 256 1024] [--rounds 20] [--per-process 128]
                               [--relay 0 16]

Real parts, as many as this 2-core machine holds: a ``dask scheduler``
process (dask_monarch's flush intake runs in it), rank workers that are real
``distributed.Worker`` objects with dask_monarch's plugin, ``--per-process``
of them in each of a few host processes (a thousand worker processes do not
fit here; each simulated rank still has its own comm to the scheduler, its
own lane thread and its own report stream to the controller), and the real
controller in this process.

Each round issues one op on every rank of a mesh over all of them
(``x = x + 1`` on one element: a segment per rank) and fetches ``x`` from
rank 0, which resolves only once every rank has run its segment. Per round
(the fetch's median over ``--rounds``, CPU over all of them), printed per
size with its growth over the smallest size:

* the fetch's round trip, from the op's issue to the value;
* the client's CPU (this process, every thread: dispatch, compiling the flush,
  the reports of every rank);
* the scheduler's CPU (its process; its CPU while idle, measured over the
  same time just before, is subtracted: heartbeats grow with the workers);
* the time from the issue to the last rank's segment start (each rank's
  plugin stamps its segment starts: ``dm.trace``'s records);
* the simulated ranks' CPU (their host processes', every thread): what the
  ranks themselves take of the machine's two cores, which a real cluster
  spreads over its hosts.

Each mesh runs once per ``--relay`` setting (``dask_monarch.flush.relay``:
0 makes a Dask task per rank and segment, k > 0 a task per wave that the
ranks' workers relay to each other in a tree of fan-out k).

Beside them, on the same cluster just before, the baseline: plain Dask asked
for what a flush asks of it, one tiny task pinned to each worker per round,
all waited for and rank 0's result read (its round trip, client CPU and
scheduler CPU per round).

The figures go to benchmarks/RESULTS.md ("Control plane at scale").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import dask
import psutil
import torch
from distributed import Client, wait

import dask_monarch as dm
from dask_monarch.controller.placement import registered_workers

HOST = """
import asyncio, sys
from distributed import Worker

async def main(address, first, count):
    workers = [
        Worker(address, nthreads=1, name=f"sim-{first + i:04d}", host="127.0.0.1",
               memory_limit=0, dashboard=False, validate=False)
        for i in range(count)
    ]
    await asyncio.gather(*workers)
    await asyncio.gather(*(w.finished() for w in workers))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


# Each Worker polls its process with psutil (a SystemMonitor, every 500 ms): a real host does
# it once, but here 128 simulated ranks poll the same process, which took 45 % of a host
# process's samples at 1 024 ranks (py-spy: psutil's /proc reads and num_fds), CPU that grows
# with a round's length rather than its work. Once a minute keeps the monitor but not its cost.
HOST_ENV = {"DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__INTERVAL": "60s"}


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


class Cluster:
    """A ``dask scheduler`` process and host processes of simulated rank workers."""

    def __init__(self, ranks: int, per_process: int) -> None:
        self.folder = tempfile.mkdtemp(prefix="dm-scale-")
        file = os.path.join(self.folder, "scheduler.json")
        env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__IDLE_TIMEOUT": "3600s"}
        self.scheduler = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--no-dashboard",
                "--scheduler-file",
                file,
                "--preload",
                "dask_monarch.deployment.comm_gaps",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(file):
            if time.monotonic() > deadline or self.scheduler.poll() is not None:
                raise RuntimeError("the scheduler did not start")
            time.sleep(0.2)
        time.sleep(0.5)
        with open(file) as f:
            self.address = json.load(f)["address"]
        self.hosts = []
        for first in range(0, ranks, per_process):
            count = min(per_process, ranks - first)
            self.hosts.append(
                subprocess.Popen(
                    [sys.executable, "-c", HOST, self.address, str(first), str(count)],
                    env={**env, "OMP_NUM_THREADS": "1", **HOST_ENV},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self.process = psutil.Process(self.scheduler.pid)

    def close(self) -> None:
        for p in [*self.hosts, self.scheduler]:
            p.terminate()
        for p in [*self.hosts, self.scheduler]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
            if p.poll() is None:
                p.kill()


def _plus_one(x: int) -> int:
    return x + 1


def _plain_dask(client: Client, rounds: int, cluster: Cluster, idle_rate: float) -> dict:
    """The baseline: per round one tiny task pinned to each worker (what a flush asks of
    Dask: a task per rank), all waited for, rank 0's result read, the futures let go of."""
    me = psutil.Process()
    workers = sorted(registered_workers(client))
    trips = []
    c0, s0, t0 = _cpu(me), _cpu(cluster.process), time.perf_counter()
    for r in range(rounds + 3):
        if r == 3:  # the first three warm the workers' connections
            trips.clear()
            c0, s0, t0 = _cpu(me), _cpu(cluster.process), time.perf_counter()
        start = time.perf_counter()
        futures = [
            client.submit(_plus_one, i, workers=[w], allow_other_workers=False, pure=False)
            for i, w in enumerate(workers)
        ]
        wait(futures)
        futures[0].result()
        trips.append(time.perf_counter() - start)
        del futures
    elapsed = time.perf_counter() - t0
    return {
        "dask_round_ms": statistics.median(trips) * 1e3,
        "dask_client_cpu_ms": (_cpu(me) - c0) / rounds * 1e3,
        "dask_scheduler_cpu_ms": (_cpu(cluster.process) - s0 - idle_rate * elapsed) / rounds * 1e3,
    }


def measure(ranks: int, rounds: int, per_process: int, relays: list[int]) -> dict:
    """Plain Dask, then a mesh per setting of ``dask_monarch.flush.relay``, on one cluster."""
    cluster = Cluster(ranks, per_process)
    try:
        with Client(cluster.address, timeout="120s") as client:
            client.wait_for_workers(ranks, timeout=600)
            time.sleep(1.0)
            idle_start, idle_cpu = time.perf_counter(), _cpu(cluster.process)
            time.sleep(2.0)
            idle_rate = (_cpu(cluster.process) - idle_cpu) / (time.perf_counter() - idle_start)
            result = {"ranks": ranks, "scheduler_idle_cpu": idle_rate}
            result.update(_plain_dask(client, rounds, cluster, idle_rate))
            for relay in relays:
                # 128 simulated ranks share each host process's event loop on two cores: at
                # 1 024 ranks a heartbeat can wait longer than a real worker's ever should
                settings = {
                    "dask_monarch.flush.relay": relay,
                    "dask_monarch.timeouts.unresponsive": "120s",
                }
                with dask.config.set(settings):
                    mesh = _mesh_rounds(client, cluster, ranks, rounds, idle_rate)
                result[relay] = mesh
    finally:
        cluster.close()
    return result


def _mesh_rounds(
    client: Client, cluster: Cluster, ranks: int, rounds: int, idle_rate: float
) -> dict:
    """One mesh over every rank: ``rounds`` of one op on every rank and a fetch from rank 0."""
    me = psutil.Process()
    hosts = [psutil.Process(p.pid) for p in cluster.hosts]
    start = time.perf_counter()
    mesh = dm.device_mesh(client, rank=ranks)
    setup = time.perf_counter() - start
    try:
        with mesh.activate():
            x = torch.zeros(1)
            for _ in range(3):  # warm: lanes, first segments, propagation
                x = x + 1
                dm.inspect(x)
            time.sleep(1.0)
            trips = []
            path = os.path.join(cluster.folder, "trace.json")
            origin = time.time()  # dm.trace's records count from its own start
            with dm.trace(path):
                issued = []
                c0, s0, t0 = _cpu(me), _cpu(cluster.process), time.perf_counter()
                h0 = sum(map(_cpu, hosts))
                for _ in range(rounds):
                    start = time.perf_counter()
                    issued.append(time.time() - origin)
                    x = x + 1
                    dm.inspect(x)
                    trips.append(time.perf_counter() - start)
                elapsed = time.perf_counter() - t0
                client_cpu = (_cpu(me) - c0) / rounds  # cpu_times ticks at 10 ms
                scheduler_cpu = (_cpu(cluster.process) - s0 - idle_rate * elapsed) / rounds
                ranks_cpu = (sum(map(_cpu, hosts)) - h0) / rounds
            last_start = _last_starts(path, issued, ranks)
    finally:
        mesh.exit()
    return {
        "setup_s": setup,
        "fetch_ms": statistics.median(trips) * 1e3,
        "client_cpu_ms": client_cpu * 1e3,
        "scheduler_cpu_ms": scheduler_cpu * 1e3,
        "ranks_cpu_ms": ranks_cpu * 1e3,
        "last_start_ms": statistics.median(last_start) * 1e3 if last_start else float("nan"),
    }


def _last_starts(path: str, issued: list[float], ranks: int) -> list[float]:
    """Per round: from its issue to the latest first segment start of a rank in that round."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    starts = sorted(
        (e["ts"] / 1e6, e.get("pid")) for e in events if e.get("ph") == "X" and "ts" in e
    )
    out = []
    bounds = [*issued[1:], float("inf")]
    for begin, end in zip(issued, bounds):
        first: dict = {}
        for ts, pid in starts:
            if begin <= ts < end and pid not in first:
                first[pid] = ts
        if len(first) >= ranks:
            out.append(max(first.values()) - begin)
    return out


def _name(relay: int) -> str:
    return "a task per segment" if relay == 0 else f"relayed, fan-out {relay}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-process", type=int, default=128)
    parser.add_argument(
        "--relay",
        type=int,
        nargs="+",
        default=[0, 16],
        help="settings of dask_monarch.flush.relay to run (0: a task per segment)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for n in args.ranks:
        r = measure(n, args.rounds, args.per_process, args.relay)
        results.append(r)
        print(
            f"{n:5d} ranks: plain Dask (a task per worker): round {r['dask_round_ms']:8.1f} ms, "
            f"client CPU {r['dask_client_cpu_ms']:7.1f} ms, scheduler CPU "
            f"{r['dask_scheduler_cpu_ms']:7.1f} ms per round",
            flush=True,
        )
        for relay in args.relay:
            m = r[relay]
            print(
                f"{'':12s}mesh, {_name(relay)}: fetch {m['fetch_ms']:8.1f} ms, client CPU "
                f"{m['client_cpu_ms']:7.1f} ms, scheduler CPU {m['scheduler_cpu_ms']:7.1f} ms, "
                f"ranks' CPU {m['ranks_cpu_ms']:7.1f} ms, last rank's start "
                f"{m['last_start_ms']:7.1f} ms per round; mesh made in {m['setup_s']:.1f} s",
                flush=True,
            )
    base = results[0]
    print(f"\ngrowth over {base['ranks']} ranks (goal at 1 024: at most 4x):")
    for r in results:
        parts = [
            f"plain Dask: round {r['dask_round_ms'] / base['dask_round_ms']:5.1f}x, scheduler "
            f"{r['dask_scheduler_cpu_ms'] / max(base['dask_scheduler_cpu_ms'], 1e-3):5.1f}x"
        ]
        for relay in args.relay:
            m, b = r[relay], base[relay]
            parts.append(
                f"{_name(relay)}: fetch {m['fetch_ms'] / b['fetch_ms']:5.1f}x, client "
                f"{m['client_cpu_ms'] / max(b['client_cpu_ms'], 1e-3):5.1f}x, scheduler "
                f"{m['scheduler_cpu_ms'] / max(b['scheduler_cpu_ms'], 1e-3):5.1f}x"
            )
        print(f"{r['ranks']:5d} ranks: " + "; ".join(parts))


if __name__ == "__main__":
    main()
