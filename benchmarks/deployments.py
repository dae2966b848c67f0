"""A fetch on a stock-CLI cluster next to the embedded one (issue 38, item 4).

    python benchmarks/deployments.py [--n 200] [--repeat 3]

Three clusters of 2 CPU ranks on this machine, each with a fresh 2-rank mesh:

* ``embedded``: ``dm.LocalMeshCluster(n_ranks=2)``, which lowers Dask's
  batched-send gaps on its own scheduler and workers;
* ``stock``: ``dask scheduler --preload dask_monarch.preload`` and two
  ``dask worker --nthreads 1 --preload dask_monarch.preload --monarch-rank=i``,
  exactly as docs/deployment.md shows;
* ``stock + opt-in``: the same with ``--monarch-batched-interval=1ms`` added to
  every preload (the documented opt-in).

Per cluster, the median of ``--n`` round trips of ``x = x + 1`` on a scalar
then its fetch (``benchmarks/peers.py``'s ``fetch_latency``), over
``--repeat`` rounds taken in turn; the ratio to the embedded cluster's.
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

import torch
from distributed import Client
from peers import fetch_latency

import dask_monarch as dm

# What a rank worker of LocalMeshCluster or `dask monarch worker` runs without (Dask's config
# in the environment of the `dask` processes): no statistical profiler sampling every thread
# 100 times a second, an event-loop tick of 200 ms (Dask's: 20 ms).
LEAN = {
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    "DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL": "200ms",
}


# The `dask` command of this Python's environment, also when the venv is not activated
# (`.venv/bin/python benchmarks/deployments.py`), as LocalMeshCluster starts its scheduler.
DASK = (sys.executable, "-m", "dask")


@contextlib.contextmanager
def stock(opt_in: bool, lean: bool = False):
    """``dask scheduler`` and two ``dask worker`` processes, as docs/deployment.md starts them."""
    folder = tempfile.mkdtemp(prefix="dm-deploy-")
    file = os.path.join(folder, "sched.json")
    extra = ["--monarch-batched-interval=1ms"] if opt_in else []
    env = {**os.environ, **LEAN} if lean else None
    procs = [
        subprocess.Popen(
            [*DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--scheduler-file", file, "--preload", "dask_monarch.preload", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(file):
            if time.monotonic() > deadline:
                raise RuntimeError("the scheduler did not start")
            time.sleep(0.2)
        time.sleep(0.5)
        with open(file) as f:
            address = json.load(f)["address"]
        for rank in range(2):
            procs.append(
                subprocess.Popen(
                    [*DASK, "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
                     "--no-dashboard", "--preload", "dask_monarch.preload",
                     f"--monarch-rank={rank}", *extra],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                )
            )  # fmt: skip
        with Client(address) as client:
            client.wait_for_workers(2, timeout=120)
            yield client
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)


@contextlib.contextmanager
def embedded():
    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        yield client


def measure(client: Client, n: int) -> float:
    mesh = dm.device_mesh(client, gpu=2)
    try:
        with mesh.activate():
            fetch_latency(dm.fetch_shard, 20)  # warm: lanes, first segments
            return fetch_latency(dm.fetch_shard, n)
    finally:
        mesh.exit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    clusters = {
        "embedded": embedded,
        "stock": lambda: stock(False),
        "stock + opt-in": lambda: stock(True),
        "opt-in + lean": lambda: stock(True, lean=True),
    }
    results: dict[str, list[float]] = {name: [] for name in clusters}
    for round_ in range(args.repeat):
        names = list(clusters) if round_ % 2 == 0 else list(clusters)[::-1]
        for name in names:
            with clusters[name]() as client:
                results[name].append(measure(client, args.n))
        print(f"round {round_} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    base = statistics.median(results["embedded"])
    print(f"\nfetch round trip, median of {args.n} per round, {args.repeat} rounds:")
    for name, values in results.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v * 1e3:.2f}" for v in values)
        print(f"  {name:<16} {median * 1e3:6.2f} ms  x{median / base:4.2f} embedded  ({runs})")


if __name__ == "__main__":
    main()
