"""Memory over a long run: RSS of the scheduler, each worker and the client, sampled as ops run.

    python benchmarks/soak.py [--ops 1000000] [--samples 20] [--warmup 0.1]
    python benchmarks/soak.py --big [--big-mib 256] [--rounds 3]

Default mode: on a 2-rank ``LocalMeshCluster``, ``acc = acc + ones`` on
10x10 tensors ``--ops`` times through the user API (each op is a
``CallFunction`` and the old ``acc``'s ``DeleteRefs``), with a ``dm.inspect``
every ``--fetch-every`` ops. At ``--samples`` points it waits for the value
just computed, then reads the RSS of every process (after a garbage
collection and glibc's ``malloc_trim``: what is held, not what the allocator
kept of what was once used), the tasks the scheduler and each worker hold,
and the task groups the scheduler's spans keep. It prints a table and the growth of each
process from the end of the warm-up (the first ``--warmup`` fraction of the
ops) to the end, and checks that ``acc`` holds the number of adds (order
held over the whole run).

``--big``: a ``--big-mib`` MiB tensor made on the client is passed to a
remote function on the mesh, then one made on the ranks is used by an op
(``--rounds`` times each). Once the call ran and the tensor was dropped,
every process should be back near where it started: prints each process's
RSS at the start, once the call ran (the tensor still alive), and after.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import psutil
import torch
from distributed import Client

import dask_monarch as dm


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _scheduler_tasks(dask_scheduler=None) -> int:
    return len(dask_scheduler.tasks)


def _scheduler_groups(dask_scheduler=None) -> int:
    """Task groups the scheduler's spans keep (docs/dask.md §13: every one they ever saw)."""
    spans = dask_scheduler.extensions.get("spans")
    return sum(len(span.groups) for span in spans.spans.values()) if spans is not None else 0


def _worker_tasks(dask_worker=None) -> int:
    return len(dask_worker.state.tasks)


def _trim() -> int:
    """Return freed heap to the OS (glibc), so RSS shows what is held, not what was once used."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS may stay higher than what is held
        pass
    return _rss()


def sample(client: Client, trim: bool = False) -> dict:
    """RSS (bytes) of the scheduler, each worker and this client; tasks each one holds."""
    rss = _trim if trim else _rss
    workers = client.run(rss)
    tasks = client.run(_worker_tasks)
    return {
        "scheduler": client.run_on_scheduler(rss),
        "workers": [workers[w] for w in sorted(workers)],
        "client": rss(),
        "scheduler_tasks": client.run_on_scheduler(_scheduler_tasks),
        "scheduler_groups": client.run_on_scheduler(_scheduler_groups),
        "worker_tasks": [tasks[w] for w in sorted(tasks)],
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:8.1f}"


def soak(client: Client, ops: int, samples: int, warmup: float, fetch_every: int) -> None:
    mesh = dm.device_mesh(client, gpu=2)
    every = max(ops // samples, 1)
    rows: list[tuple[int, float, dict]] = []
    start = time.perf_counter()
    with mesh.activate():
        ones, acc = torch.ones(10, 10), torch.zeros(10, 10)
        dm.inspect(acc[0, 0])
        rows.append((0, 0.0, sample(client, trim=True)))
        _print_header(len(rows[0][2]["workers"]))
        _print_row(*rows[0])
        for i in range(1, ops + 1):
            acc = acc + ones
            if i % fetch_every == 0 or i % every == 0:
                dm.inspect(acc[0, 0])
            if i % every == 0:
                rows.append((i, time.perf_counter() - start, sample(client, trim=True)))
                _print_row(*rows[-1])
        final = float(dm.inspect(acc[0, 0]))
    flushes = mesh._session.controller.flushes
    mesh.exit()
    elapsed = time.perf_counter() - start
    print(
        f"\n{ops} ops in {elapsed:.1f} s ({elapsed / ops * 1e6:.1f} us/op), {flushes} flushes, "
        f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}; acc = {final:.0f}"
    )
    if final != ops:
        print(f"ORDER BROKEN: acc should be {ops}")
    base = next(row for row in rows if row[0] >= warmup * ops)
    print(f"growth from op {base[0]} (end of warm-up) to op {rows[-1][0]}:")
    for name, first, last, peak in _series(base[2], rows[-1][2], [r[2] for r in rows]):
        print(
            f"  {name:<12} {_mib(first)} -> {_mib(last)} MiB: {100 * (last - first) / first:+.1f} %"
            f", {(last - first) / (rows[-1][0] - base[0]):+.1f} B/op"
            f" (peak after warm-up {_mib(peak)} MiB)"
        )


def _series(first: dict, last: dict, all_: list[dict]):
    after = all_[all_.index(first) :]
    yield "scheduler", first["scheduler"], last["scheduler"], max(s["scheduler"] for s in after)
    for w in range(len(first["workers"])):
        yield (
            f"worker {w}",
            first["workers"][w],
            last["workers"][w],
            max(s["workers"][w] for s in after),
        )
    yield "client", first["client"], last["client"], max(s["client"] for s in after)


def _print_header(workers: int) -> None:
    cols = ["ops", "s", "sched MiB", *(f"w{w} MiB" for w in range(workers)), "client MiB"]
    cols += ["sched tasks", *(f"w{w} tasks" for w in range(workers)), "span groups"]
    print("".join(f"{c:>12}" for c in cols))


def _print_row(i: int, t: float, s: dict) -> None:
    cells = [f"{i}", f"{t:.1f}", _mib(s["scheduler"]), *map(_mib, s["workers"]), _mib(s["client"])]
    cells += [str(s["scheduler_tasks"]), *map(str, s["worker_tasks"]), str(s["scheduler_groups"])]
    print("".join(f"{c:>12}" for c in cells), flush=True)


def _big_call(x, big):
    """What the remote function does with the big argument: reads it, keeps nothing of it."""
    return x + big[:1]


def big(client: Client, mib: int, rounds: int) -> None:
    mesh = dm.device_mesh(client, gpu=2)
    touch = dm.remote(_big_call, propagate=lambda x, big: x.clone())
    names = ["scheduler", *(f"worker {w}" for w in range(2)), "client"]

    def flat(s: dict) -> list[int]:
        return [s["scheduler"], *s["workers"], s["client"]]

    with mesh.activate():
        x = torch.zeros(1)
        dm.inspect(touch(x, torch.zeros(1)))  # warm up: the function's first call
        before = flat(sample(client, trim=True))
        print(f"{'':<10}" + "".join(f"{n:>12}" for n in names) + "   (MiB)")
        print(f"{'start':<10}" + "".join(f"{_mib(v):>12}" for v in before))
        for r in range(rounds):
            for where in ("client", "mesh"):
                if where == "client":  # travels in the message, pickled
                    with dm.no_mesh.activate():
                        arg = torch.ones(mib * 2**20 // 4)
                    y = touch(x, arg)
                else:  # made on the ranks, used by an op, then dropped
                    arg = torch.ones(mib * 2**20 // 4)
                    y = x + arg[:1]
                value = float(dm.inspect(y[0]))
                during = flat(sample(client))
                del arg, y
                dm.inspect(x + 0)  # one more round trip: the tails of that call are released
                time.sleep(0.5)
                after = flat(sample(client, trim=True))
                print(f"{f'{r}: {where}':<10}" + "".join(f"{_mib(v):>12}" for v in during))
                print(f"{'  after':<10}" + "".join(f"{_mib(v):>12}" for v in after))
                assert value == 1.0, value
        print(
            f"{'held':<10}"
            + "".join(f"{_mib(a - b):>12}" for a, b in zip(after, before))
            + f"   (after - start; the argument was {mib} MiB)"
        )
        s = sample(client)
        print(f"tasks held: scheduler {s['scheduler_tasks']}, workers {s['worker_tasks']}")
    mesh.exit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of ops to warm up")
    parser.add_argument("--fetch-every", type=int, default=10_000)
    parser.add_argument("--big", action="store_true", help="the large-argument case")
    parser.add_argument("--big-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        print(
            f"torch {torch.__version__}, pid {os.getpid()}, "
            f"{psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB"
        )
        if args.big:
            big(client, args.big_mib, args.rounds)
        else:
            soak(client, args.ops, args.samples, args.warmup, args.fetch_every)


if __name__ == "__main__":
    main()
