"""Collectives: dask_monarch Reduce and SendTensor against plain torch.distributed (gloo).

    python benchmarks/collectives.py [--repeat 5] [--ops 10]

For 1 M and 16 M float32 elements on 2 ranks: an in-place all-reduce (Reduce
SUM) and a rank 0 -> rank 1 send (SendTensor, which makes a new tensor on the
receiver), timed as ``ops`` operations in a row then a sync, next to the same
operations in two plain processes that called ``init_process_group("gloo")``
(receiving into a new tensor each time too). Medians over the repeats;
ratio = ours / plain.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed import Client

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Factory, ReduceOp, Ref, StreamRef
from dask_monarch.ndslice import Slice

S0 = StreamRef(0)
MESH = Ref(1)
SIZES = {"1M": 1 << 20, "16M": 1 << 24}


# -- plain torch.distributed ---------------------------------------------------------------------


def _plain(rank, port, sizes, ops, repeat, queue):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    out = {}
    for name, n in sizes.items():
        x = torch.ones(n)
        for kind in ("reduce", "send"):
            times = []
            for _ in range(repeat + 1):
                received = []  # like SendTensor: every receive makes a new tensor
                dist.barrier()
                start = time.perf_counter()
                for _ in range(ops):
                    if kind == "reduce":
                        dist.all_reduce(x)
                    elif rank == 0:
                        dist.send(x, 1)
                    else:
                        received.append(torch.empty(n))
                        dist.recv(received[-1], 0)
                dist.barrier()
                times.append(time.perf_counter() - start)
                del received
            out[(kind, name)] = statistics.median(times[1:]) / ops
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def plain_torch(sizes, ops, repeat) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _plain, args=(port, sizes, ops, repeat, queue), nprocs=2, start_method="spawn"
    )
    return queue.get()


# -- dask_monarch --------------------------------------------------------------------------------


def ours(sizes, ops, repeat) -> dict:
    out = {}
    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        with dm.Controller(client, world_size=2) as ctrl:
            both = [0, 1]
            ctrl.send(both, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
            ctrl.send(both, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2])))
            ctrl.send(both, m.BackendNetworkInit())
            ctrl.send(both, m.SplitComm(["gpu"], MESH, S0))
            ctrl.send(both, m.BackendNetworkPointToPointInit(S0, S0))
            seq = 0
            for name, n in sizes.items():
                x = Ref(10)
                ctrl.send(
                    both,
                    m.CallFunction(
                        seq,
                        [x],
                        [],
                        m.FunctionPath("torch.ones"),
                        ArgsKwargs.from_python((n,)),
                        S0,
                        [],
                    ),
                )
                seq += 1  # seqs increase on a stream
                ctrl.sync()
                factory = Factory((n,), torch.float32, torch.strided, "cpu")
                for kind in ("reduce", "send"):
                    times = []
                    for _ in range(repeat + 1):
                        start = time.perf_counter()
                        for i in range(ops):
                            result = Ref(100 + i)
                            if kind == "reduce":
                                ctrl.send(
                                    both,
                                    m.Reduce(
                                        result,
                                        x,
                                        factory,
                                        MESH,
                                        S0,
                                        ["gpu"],
                                        ReduceOp.SUM,
                                        False,
                                        True,
                                        None,
                                    ),
                                )
                            else:
                                ctrl.send(
                                    both,
                                    m.SendTensor(
                                        result,
                                        Slice(0, [1], [1]),
                                        Slice(1, [1], [1]),
                                        x,
                                        factory,
                                        S0,
                                        S0,
                                    ),
                                )
                        ctrl.sync(timeout=600)
                        times.append(time.perf_counter() - start)
                        ctrl.send(both, m.DeleteRefs([Ref(100 + i) for i in range(ops)]))
                    out[(kind, name)] = statistics.median(times[1:]) / ops
                ctrl.send(both, m.DeleteRefs([x]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ops", type=int, default=10)
    args = parser.parse_args()
    plain = plain_torch(SIZES, args.ops, args.repeat)
    mine = ours(SIZES, args.ops, args.repeat)
    print(f"\n2 ranks, float32, {args.ops} operations then a sync, median of {args.repeat}")
    print(f"{'operation':<26}{'plain gloo ms':>14}{'dask_monarch ms':>17}{'ratio':>8}")
    for kind, label in (("reduce", "all-reduce SUM"), ("send", "send rank 0 -> 1")):
        for name in SIZES:
            a, b = plain[(kind, name)], mine[(kind, name)]
            print(f"{label + ' ' + name:<26}{a * 1e3:>14.2f}{b * 1e3:>17.2f}{b / a:>8.2f}")


if __name__ == "__main__":
    main()
