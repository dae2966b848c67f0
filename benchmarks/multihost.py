"""Controller cost per message and fetch latency at 2, 4 and 8 ranks, one rank per namespace host.

    sudo python benchmarks/multihost.py [--n 5000] [--fetches 100] [--repeat 3]

Builds the multi-host harness of the test suite (tests/multihost/netns.py:
a bridge, 8 network namespaces, a supervised ``dask worker`` in each, the
scheduler in the root namespace) and, for each world size, a raw controller
over that many hosts (``distinct_hosts=True``):

1. per-message cost: N tiny ``CallFunction`` messages sent to every rank,
   then one ``sync``: microseconds per message (a message counts once however
   many ranks receive it) and per delivery;
2. fetch latency: ``dm.inspect`` of a tiny value just computed on a mesh of
   that size (median).

Needs root (network namespaces). Medians over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from distributed import Client

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multihost"))
import netns  # noqa: E402

S0 = StreamRef(0)


def per_message(client: Client, ranks: int, n: int, repeat: int, distinct: bool) -> float:
    """Median seconds per message: ``n`` tiny calls to every rank, then one sync."""
    with dm.Controller(client, ranks, distinct_hosts=distinct) as ctrl:
        everyone = tuple(range(ranks))
        ctrl.send(everyone, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
        ones = ArgsKwargs.from_python((3,))
        ctrl.send(
            everyone, m.CallFunction(0, [Ref(1)], [], m.FunctionPath("torch.ones"), ones, S0, [])
        )
        ctrl.sync(timeout=300)
        add = m.FunctionPath("torch.ops.aten.add.Tensor")
        args = ArgsKwargs.from_python((Ref(1), Ref(1)))
        times = []
        seq = 1
        for r in range(repeat + 1):  # the first run warms up
            first = 10**6 * (r + 1)
            start = time.perf_counter()
            for i in range(n):
                ctrl.send(everyone, m.CallFunction(seq, [Ref(first + i)], [], add, args, S0, []))
                seq += 1
            ctrl.sync(timeout=600)
            elapsed = time.perf_counter() - start
            ctrl.send(everyone, m.DeleteRefs([Ref(first + i) for i in range(n)]))
            ctrl.sync(timeout=300)
            if r:
                times.append(elapsed / n)
    return statistics.median(times)


def fetch_latency(client: Client, ranks: int, fetches: int, distinct: bool) -> float:
    mesh = dm.device_mesh(client, distinct_hosts=distinct, host=ranks)
    samples = []
    with mesh.activate():
        x = torch.zeros(())
        dm.inspect(x)
        for _ in range(fetches):
            start = time.perf_counter()
            x = x + 1
            dm.inspect(x)
            samples.append(time.perf_counter() - start)
    mesh.exit()
    return statistics.median(samples)


def row(client: Client, label: str, ranks: int, args, distinct: bool = True) -> None:
    cost = per_message(client, ranks, args.n, args.repeat, distinct)
    latency = fetch_latency(client, ranks, args.fetches, distinct)
    print(
        f"| {label} | {ranks} | {cost * 1e6:.1f} | {cost * 1e6 / ranks:.1f} | "
        f"{latency * 1e3:.2f} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=5000, help="messages per run")
    parser.add_argument("--fetches", type=int, default=100, help="round trips timed")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", default="2,4,8")
    args = parser.parse_args()
    why = netns.why_not()
    if why:
        raise SystemExit(why)
    sizes = [int(s) for s in args.sizes.split(",")]
    print("| cluster | ranks | µs/message | µs/delivery | fetch latency (ms) |")
    print("|---|---|---|---|---|")
    # the same measures on one host, now (the machine's load changes the figures)
    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        row(client, "LocalMeshCluster, 127.0.0.1", 2, args, distinct=False)
    netns.clean_leftovers()
    hosts = netns.Hosts(max(sizes), 1, tag="b")
    try:
        hosts.start_scheduler()
        hosts.start_workers()
        with Client(hosts.scheduler_address, timeout="60s") as client:
            client.wait_for_workers(max(sizes), timeout=600)
            for ranks in sizes:
                row(client, f"{max(sizes)} namespace hosts", ranks, args)
    finally:
        hosts.close()


if __name__ == "__main__":
    main()
