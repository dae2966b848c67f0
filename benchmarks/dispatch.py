"""Dispatch rate: tiny messages through the raw controller and ops through the user API.

    python benchmarks/dispatch.py [--n 20000] [--ops 10000] [--repeat 5]

1. Raw controller: N tiny ``CallFunction`` messages sent to 2 ranks, then one
   ``sync``: messages per second and microseconds per message (a message
   counts once however many ranks receive it; per-rank deliveries are printed
   too), next to N tiny plain Dask tasks on the same cluster.
2. User API, Monarch's dispatch benchmark shape: ``acc = ones + acc`` on
   100x100 tensors, ``ops`` times, then one fetch: locally, on a 2-rank mesh,
   under ``coalescing()``, and under ``compile`` (a compiled block of 100 adds
   called ``ops / 100`` times). Prints microseconds per op over the local run.
3. Latency: ``dm.inspect`` of a tiny value just computed on the mesh, next to
   ``client.submit(...).result()`` on the same cluster, with the figures that
   Monarch 0.7.0 and Ray 2.60 reach on this machine (quoted from
   docs/dask.md §11: they are not installed here).

Medians over the repeats.
"""

from __future__ import annotations

import argparse
import itertools
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
    """Seconds to send ``n`` tiny calls to both ranks and sync (construction included).

    Seqs follow the refs (``first_ref + i``): they must increase on a stream across runs.
    """
    args = ArgsKwargs.from_python((Ref(1), Ref(1)))
    start = time.perf_counter()
    for i in range(n):
        ctrl.send(
            (0, 1), m.CallFunction(first_ref + i, [Ref(first_ref + i)], [], function, args, S0, [])
        )
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


BLOCK = 100  # adds per compiled call


def chained_adds(n: int, mesh=None, mode: str = "plain") -> float:
    """Seconds for ``acc = ones + acc`` n times on 100x100, then one fetch of a value."""
    if mesh is None:
        ones, acc = torch.ones(100, 100), torch.zeros(100, 100)
        start = time.perf_counter()
        for _ in range(n):
            acc = ones + acc
        float(acc[0, 0])
        return time.perf_counter() - start
    with mesh.activate():
        ones, acc = torch.ones(100, 100), torch.zeros(100, 100)
        dm.inspect(acc[0, 0])
        if mode == "compile":

            @dm.compile
            def block(acc, ones):
                for _ in range(BLOCK):
                    acc = ones + acc
                return acc

            acc = block(acc, ones)  # trace and define outside the timing
            dm.inspect(acc[0, 0])
            start = time.perf_counter()
            for _ in range(n // BLOCK):
                acc = block(acc, ones)
        elif mode == "coalescing":
            start = time.perf_counter()
            with dm.coalescing():
                for _ in range(n):
                    acc = ones + acc
        else:
            start = time.perf_counter()
            for _ in range(n):
                acc = ones + acc
        dm.inspect(acc[0, 0])
        return time.perf_counter() - start


def user_api(client, ops: int, repeat: int) -> list[tuple[str, float]]:
    local = statistics.median(chained_adds(ops) for _ in range(repeat))
    rows = [("local torch", local / ops)]
    for mode in ("plain", "coalescing", "compile"):
        mesh = dm.device_mesh(client, gpu=2)
        chained_adds(min(ops, 1000), mesh, mode)  # warm up: caches, lanes, traces
        times = [chained_adds(ops, mesh, mode) for _ in range(repeat)]
        mesh.exit()
        rows.append((f"mesh, {mode}", (statistics.median(times) - local) / ops))
    return rows


# Quoted, not measured here: median ms per fetch of a tiny value (docs/dask.md §11).
PEER_FETCH_MS = {"Monarch 0.7.0": 2.4, "Ray 2.60": 0.89}


def latencies(client, n: int) -> list[tuple[str, float]]:
    """Median seconds: compute-then-fetch of a tiny mesh value, and a plain Dask round trip."""
    mesh = dm.device_mesh(client, gpu=2)
    fetches = []
    with mesh.activate():
        x = torch.zeros(())
        dm.inspect(x)
        for _ in range(n):
            start = time.perf_counter()
            x = x + 1
            dm.inspect(x)
            fetches.append(time.perf_counter() - start)
    mesh.exit()
    client.submit(noop, 0, pure=False).result()
    submits = []
    for i in range(n):
        start = time.perf_counter()
        client.submit(noop, i, pure=False).result()
        submits.append(time.perf_counter() - start)
    return [
        ("dask_monarch: op + dm.inspect", statistics.median(fetches)),
        ("bare dask: submit().result()", statistics.median(submits)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="messages per run")
    parser.add_argument("--dask-n", type=int, default=2000, help="plain Dask tasks per run")
    parser.add_argument("--ops", type=int, default=10000, help="user-API ops per run")
    parser.add_argument("--fetches", type=int, default=200, help="round trips timed")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        ctrl = dm.Controller(client, world_size=2)
        ctrl.send((0, 1), m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
        ctrl.send(
            (0, 1),
            m.CallFunction(
                0, [Ref(1)], [], m.FunctionPath("torch.ones"), ArgsKwargs.from_python((3,)), S0, []
            ),
        )
        ctrl.sync()
        rows = []
        bases = itertools.count(10**7, 10**7)  # seqs increase on a stream across runs
        for label, fn in (
            ("aten.add (3 floats)", "torch.ops.aten.add.Tensor"),
            ("no-op function", "operator.add"),
        ):
            function = m.FunctionPath(fn)
            raw_dispatch(ctrl, 1000, function, next(bases))  # warm up
            times = [raw_dispatch(ctrl, args.n, function, next(bases)) for _ in range(args.repeat)]
            rows.append((label, statistics.median(times)))
        bare_dask(client, 200)
        dask_time = statistics.median(bare_dask(client, args.dask_n) for _ in range(args.repeat))
        ctrl.close()
        api_rows = user_api(client, args.ops, args.repeat)
        latency_rows = latencies(client, args.fetches)

    print(
        f"\ndispatch of tiny CallFunction messages to 2 ranks, then sync "
        f"(median of {args.repeat}; torch {torch.__version__})"
    )
    print(f"{'path':<34}{'messages/s':>12}{'us/message':>12}{'deliveries/s':>14}")
    for label, elapsed in rows:
        rate = args.n / elapsed
        print(f"{'dask_monarch, ' + label:<34}{rate:>12,.0f}{1e6 / rate:>12.1f}{2 * rate:>14,.0f}")
    rate = args.dask_n / dask_time
    print(f"{'bare dask, client.map no-op':<34}{rate:>12,.0f}{1e6 / rate:>12.1f}{rate:>14,.0f}")
    print(f"\nuser API: acc = ones + acc on 100x100, {args.ops} ops then one fetch, 2 ranks")
    print(f"{'path':<34}{'us/op':>12}")
    for label, per_op in api_rows:
        suffix = "" if label == "local torch" else " over local"
        print(f"{label:<34}{per_op * 1e6:>12.1f}{suffix}")
    print(f"\nlatency of one round trip to the ranks (median of {args.fetches})")
    print(f"{'path':<34}{'ms':>12}")
    for label, seconds in latency_rows:
        print(f"{label:<34}{seconds * 1e3:>12.2f}")
    for peer, ms in PEER_FETCH_MS.items():
        print(f"{peer + ' fetch (quoted, §11)':<34}{ms:>12.2f}")


if __name__ == "__main__":
    main()
