"""The first collective and the first send at 8 to 256 ranks, gloo pairs lazy or eager.

    python benchmarks/rendezvous.py [--ranks 8 32 64 128 256] [--eager-up-to 64]

The simulated cluster of ``scale.py`` (a ``dask scheduler`` process, rank
workers that are real ``distributed.Worker`` objects with dask_monarch's
plugin, many to a host process, the real controller here), one mesh over
all ranks with ``dask_monarch.comm.gloo-connect`` set each way. Printed per
size and setting:

* the first reduce over every rank, to its value on rank 0: the world group of
  ``BackendNetworkInit`` with its warm-up all-reduce, the reduce's own group
  (``SplitComm``) and the reduce;
* a second reduce (every group made; gloo's pairs of a lazy group connected);
* the first send from rank 0 to the last rank (``to_mesh``): its stream pair's
  group over every rank (``BackendNetworkPointToPointInit``) and the send;
* the open file descriptors of the host processes after these (gloo's
  connections among them).

Eager groups connect every pair of members when made: ``N - 1`` connections
per rank and group, all inside this machine's host processes (past about 100
ranks the descriptors outgrow ``ulimit -n``, hence ``--eager-up-to``). The
figures go to benchmarks/RESULTS.md ("Issue 38, fourth round").
"""

from __future__ import annotations

import argparse
import time

import dask
import psutil
import torch
from distributed import Client
from scale import Cluster

import dask_monarch as dm


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(client: Client, cluster: Cluster, ranks: int, connect: str) -> dict:
    with dask.config.set({"dask_monarch.comm.gloo-connect": connect}):
        mesh = dm.device_mesh(client, rank=ranks)
    try:
        with mesh.activate():
            x = torch.ones(4)
            dm.inspect(x)  # lanes made, first segments run
            first = timed(lambda: dm.inspect(x.reduce("rank", "sum"), rank=0))
            second = timed(lambda: dm.inspect(x.reduce("rank", "sum"), rank=0))
            last = mesh.slice(rank=ranks - 1)
            send = timed(lambda: dm.inspect(x.slice_mesh(rank=0).to_mesh(last)))
        fds = sum(psutil.Process(p.pid).num_fds() for p in cluster.hosts)
    finally:
        mesh.exit()
    return {"first": first, "second": second, "send": send, "fds": fds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    parser.add_argument("--eager-up-to", type=int, default=64)
    parser.add_argument("--per-process", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for n in args.ranks:
        cluster = Cluster(n, args.per_process)
        try:
            with Client(cluster.address, timeout="120s") as client:
                client.wait_for_workers(n, timeout=600)
                idle = sum(psutil.Process(p.pid).num_fds() for p in cluster.hosts)
                settings = ["lazy", "eager"] if n <= args.eager_up_to else ["lazy"]
                for connect in settings:
                    with dask.config.set({"dask_monarch.timeouts.collective": "300s"}):
                        r = measure(client, cluster, n, connect)
                    print(
                        f"{n:4d} ranks, {connect:5s}: first reduce {r['first'] * 1e3:8.1f} ms, "
                        f"second {r['second'] * 1e3:6.1f} ms, first send "
                        f"{r['send'] * 1e3:8.1f} ms; host processes' fds {r['fds']} "
                        f"({idle} before)",
                        flush=True,
                    )
        finally:
            cluster.close()


if __name__ == "__main__":
    main()
