"""Collectives: dask_monarch Reduce and SendTensor against plain torch.distributed (gloo).

    python benchmarks/collectives.py [--repeat 5] [--ops 10] [--more-ops 50]

For 1 M and 16 M float32 elements on 2 ranks: an in-place all-reduce (Reduce
SUM) and a rank 0 -> rank 1 send (SendTensor, which makes a new tensor on the
receiver), timed as ``ops`` operations in a row then a sync, next to the same
operations in two plain processes that called ``init_process_group("gloo")``
(receiving into a new tensor each time too; a barrier before and after).
Both stay up for the whole run and take turns, one repeat each, so they see
the same machine. Medians over the repeats; ratio = ours / plain.

Every dask_monarch figure carries one flush and one sync round trip (a few
milliseconds, benchmarks/latency.py) spread over ``ops`` operations. The run
also times ``--more-ops`` operations per sync, and prints the marginal cost
of one more operation, ``(t[more] - t[ops]) / (more - ops)``, on both sides:
what a collective costs once the round trip is paid.
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


def _plain(rank, port, sizes, commands, results):
    """One of the two plain processes: runs ``(kind, size name, ops)`` commands until None."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )
    tensors = {name: torch.ones(n) for name, n in sizes.items()}
    while True:
        command = commands[rank].get()
        if command is None:
            break
        kind, name, ops = command
        x, n = tensors[name], sizes[name]
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
        elapsed = time.perf_counter() - start
        del received
        if rank == 0:
            results.put(elapsed)
    dist.destroy_process_group()


class PlainTorch:
    """Two gloo processes that stay up and time one batch of operations on request."""

    def __init__(self, sizes) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.commands = [ctx.SimpleQueue(), ctx.SimpleQueue()]
        self.results = ctx.SimpleQueue()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.context = mp.start_processes(
            _plain,
            args=(port, sizes, self.commands, self.results),
            nprocs=2,
            join=False,
            start_method="spawn",
        )

    def time(self, kind: str, name: str, ops: int) -> float:
        for queue in self.commands:
            queue.put((kind, name, ops))
        return self.results.get()

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        self.context.join()


# -- dask_monarch --------------------------------------------------------------------------------


class Ours:
    """A 2-rank mesh on the raw controller, with a communicator for reduces and for sends."""

    def __init__(self, sizes) -> None:
        self.cluster = dm.LocalMeshCluster(n_ranks=2, device="cpu")
        self.client = Client(self.cluster)
        self.ctrl = ctrl = dm.Controller(self.client, world_size=2)
        both = self.both = [0, 1]
        ctrl.send(both, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
        ctrl.send(both, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2])))
        ctrl.send(both, m.BackendNetworkInit())
        ctrl.send(both, m.SplitComm(["gpu"], MESH, S0))
        ctrl.send(both, m.BackendNetworkPointToPointInit(S0, S0))
        self.inputs, self.factories = {}, {}
        for seq, (name, n) in enumerate(sizes.items()):
            x = self.inputs[name] = Ref(10 + seq)
            self.factories[name] = Factory((n,), torch.float32, torch.strided, "cpu")
            fn = m.FunctionPath("torch.ones")
            ctrl.send(both, m.CallFunction(seq, [x], [], fn, ArgsKwargs.from_python((n,)), S0, []))
        ctrl.sync(timeout=600)

    def time(self, kind: str, name: str, ops: int) -> float:
        ctrl, both, x, factory = self.ctrl, self.both, self.inputs[name], self.factories[name]
        start = time.perf_counter()
        for i in range(ops):
            result = Ref(100 + i)
            if kind == "reduce":
                message = m.Reduce(
                    result, x, factory, MESH, S0, ["gpu"], ReduceOp.SUM, False, True, None
                )
            else:
                message = m.SendTensor(
                    result, Slice(0, [1], [1]), Slice(1, [1], [1]), x, factory, S0, S0
                )
            ctrl.send(both, message)
        ctrl.sync(timeout=600)
        elapsed = time.perf_counter() - start
        ctrl.send(both, m.DeleteRefs([Ref(100 + i) for i in range(ops)]))
        ctrl.sync(timeout=600)  # freeing them (gigabytes at 16 M) must not land in the next timing
        return elapsed

    def close(self) -> None:
        self.ctrl.close()
        self.client.close()
        self.cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--ops", type=int, default=10)
    parser.add_argument("--more-ops", type=int, default=50, help="0: no marginal cost")
    args = parser.parse_args()
    counts = [args.ops] + ([args.more_ops] if args.more_ops > args.ops else [])
    plain, mine = PlainTorch(SIZES), Ours(SIZES)
    times: dict[tuple, list[float]] = {}
    try:
        for r in range(args.repeat + 1):  # the first repeat warms up and is dropped
            for kind in ("reduce", "send"):
                for name in SIZES:
                    for ops in counts:
                        sides = (("plain", plain), ("ours", mine))
                        for side, runner in sides if r % 2 == 0 else sides[::-1]:
                            elapsed = runner.time(kind, name, ops)
                            if r:
                                times.setdefault((side, kind, name, ops), []).append(elapsed)
    finally:
        mine.close()
        plain.close()

    def per_op(side, kind, name, ops):
        return statistics.median(times[(side, kind, name, ops)]) / ops

    print(
        f"\n2 ranks, float32, {args.ops} operations then a sync, median of {args.repeat} "
        "(plain and ours taking turns)"
    )
    print(f"{'operation':<26}{'plain gloo ms':>14}{'dask_monarch ms':>17}{'ratio':>8}")
    for kind, label in (("reduce", "all-reduce SUM"), ("send", "send rank 0 -> 1")):
        for name in SIZES:
            a, b = per_op("plain", kind, name, args.ops), per_op("ours", kind, name, args.ops)
            print(f"{label + ' ' + name:<26}{a * 1e3:>14.2f}{b * 1e3:>17.2f}{b / a:>8.2f}")
    if len(counts) == 2:
        more = args.more_ops
        gap = more - args.ops
        print(f"\nmarginal cost of one more operation, (t[{more}] - t[{args.ops}]) / {gap}")
        print(f"{'operation':<26}{'plain gloo ms':>14}{'dask_monarch ms':>17}{'ratio':>8}")
        for kind, label in (("reduce", "all-reduce SUM"), ("send", "send rank 0 -> 1")):
            for name in SIZES:
                a, b = (
                    (
                        statistics.median(times[(side, kind, name, more)])
                        - statistics.median(times[(side, kind, name, args.ops)])
                    )
                    / (more - args.ops)
                    for side in ("plain", "ours")
                )
                print(f"{label + ' ' + name:<26}{a * 1e3:>14.2f}{b * 1e3:>17.2f}{b / a:>8.2f}")


if __name__ == "__main__":
    main()
