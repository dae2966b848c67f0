"""A fetch's round trip with quick segments on the worker's event loop, and on their lane's thread.

    python benchmarks/inline_segments.py [--pairs 8] [--n 300]

One 2-rank ``LocalMeshCluster``; ``x = x + 1`` on a scalar, then
``fetch_shard(x).result()``, ``--n`` times per half of a pair. Each pair runs
once with quick segments on the event loop (``worker/inline.py``, the default)
and once with every segment on its lane's thread (the worker plugin's
``inline`` switch, flipped through ``client.run``), the order swapped every
pair, so both see the same machine at the same minutes. Prints each half's
median, the medians over the pairs, how many pairs the event loop won, and the
CPU all processes (client, scheduler, workers; psutil user + system) spent per
round trip on each path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import psutil
import torch
from distributed import Client

import dask_monarch as dm

PATHS = ("event loop", "lane thread")


def set_inline(on: bool, dask_worker=None) -> bool:
    dask_worker.plugins["dask_monarch"].inline = on
    return on


def pid(dask_worker=None, dask_scheduler=None) -> int:
    return os.getpid()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8, help="alternating pairs of runs")
    parser.add_argument("--n", type=int, default=300, help="round trips per run")
    args = parser.parse_args()

    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        mesh = dm.device_mesh(client, gpu=2)
        processes = [psutil.Process(), psutil.Process(client.run_on_scheduler(pid))]
        processes += [psutil.Process(p) for p in client.run(pid).values()]

        def cpu() -> float:
            return sum(sum(p.cpu_times()[:2]) for p in processes)

        medians: dict[str, list[float]] = {path: [] for path in PATHS}
        cpus: dict[str, list[float]] = {path: [] for path in PATHS}
        with mesh.activate():
            x = torch.zeros(())
            for _ in range(50):  # warm: every comm open, every code path run once
                x = x + 1
                dm.inspect(x)
            for pair in range(args.pairs):
                order = PATHS if pair % 2 == 0 else PATHS[::-1]
                for path in order:
                    client.run(set_inline, path == "event loop")
                    times = []
                    before = cpu()
                    for _ in range(args.n):
                        start = time.perf_counter()
                        x = x + 1
                        dm.fetch_shard(x).result()
                        times.append(time.perf_counter() - start)
                    cpus[path].append((cpu() - before) / args.n * 1e3)
                    medians[path].append(statistics.median(times) * 1e3)
            expected = 50 + args.pairs * 2 * args.n
            assert dm.inspect(x).item() == expected, "wrong value"
        client.run(set_inline, True)
        mesh.exit()

    print(f"torch {torch.__version__}; {args.pairs} alternating pairs of {args.n} round trips")
    print("x = x + 1, then fetch_shard(x).result(): median ms per run")
    for path in PATHS:
        runs = " / ".join(f"{v:.2f}" for v in medians[path])
        print(f"  {path:<12} {statistics.median(medians[path]):6.2f}   [{runs}]")
    won = sum(a < b for a, b in zip(*medians.values()))
    ratio = statistics.median(medians[PATHS[0]]) / statistics.median(medians[PATHS[1]])
    print(f"  the event loop won {won} of {args.pairs} pairs; ratio of the medians {ratio:.2f}")
    print("CPU ms per round trip, all processes (user + system), median of the runs")
    for path in PATHS:
        print(f"  {path:<12} {statistics.median(cpus[path]):6.2f}")


if __name__ == "__main__":
    main()
