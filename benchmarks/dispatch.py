"""Dispatch rate: tiny messages through the raw controller, next to bare Dask tasks.

    python benchmarks/dispatch.py [--n 20000] [--repeat 5]

Prints, for N tiny ``CallFunction`` messages sent to 2 ranks and one ``sync``,
the messages per second and microseconds per message (a message counts once
however many ranks receive it; per-rank deliveries are printed too), next to
the rate of N tiny plain Dask tasks on the same cluster in the same run.
Medians over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from distributed import Client, wait

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef

S0 = StreamRef(0)


def noop(x):
    return x


def raw_dispatch(ctrl, n: int, function: m.FunctionPath, first_ref: int) -> float:
    """Seconds to send ``n`` tiny calls to both ranks and sync (construction included)."""
    args = ArgsKwargs.from_python((Ref(1), Ref(1)))
    start = time.perf_counter()
    for i in range(n):
        ctrl.send((0, 1), m.CallFunction(i, [Ref(first_ref + i)], [], function, args, S0, []))
    ctrl.sync(timeout=600)
    elapsed = time.perf_counter() - start
    ctrl.send((0, 1), m.DeleteRefs([Ref(first_ref + i) for i in range(n)]))
    ctrl.sync()
    return elapsed


def bare_dask(client, n: int) -> float:
    start = time.perf_counter()
    futures = client.map(noop, range(n), pure=False)
    wait(futures)
    elapsed = time.perf_counter() - start
    del futures
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="messages per run")
    parser.add_argument("--dask-n", type=int, default=2000, help="plain Dask tasks per run")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        ctrl = dm.Controller(client, world_size=2)
        ctrl.send((0, 1), m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
        ctrl.send((0, 1), m.CallFunction(0, [Ref(1)], [], m.FunctionPath("torch.ones"),
                                         ArgsKwargs.from_python((3,)), S0, []))
        ctrl.sync()
        rows = []
        for label, fn in (("aten.add (3 floats)", "torch.ops.aten.add.Tensor"),
                          ("no-op function", "operator.add")):
            function = m.FunctionPath(fn)
            raw_dispatch(ctrl, 1000, function, 10**6)  # warm up
            times = [raw_dispatch(ctrl, args.n, function, 10**7 * (r + 1))
                     for r in range(args.repeat)]
            rows.append((label, statistics.median(times)))
        bare_dask(client, 200)
        dask_time = statistics.median(bare_dask(client, args.dask_n) for _ in range(args.repeat))
        ctrl.close()

    print(f"\ndispatch of tiny CallFunction messages to 2 ranks, then sync "
          f"(median of {args.repeat}; torch {torch.__version__})")
    print(f"{'path':<34}{'messages/s':>12}{'us/message':>12}{'deliveries/s':>14}")
    for label, elapsed in rows:
        rate = args.n / elapsed
        print(f"{'dask_monarch, ' + label:<34}{rate:>12,.0f}{1e6 / rate:>12.1f}{2 * rate:>14,.0f}")
    rate = args.dask_n / dask_time
    print(f"{'bare dask, client.map no-op':<34}{rate:>12,.0f}{1e6 / rate:>12.1f}{rate:>14,.0f}")


if __name__ == "__main__":
    main()
