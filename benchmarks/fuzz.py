"""Fuzz the raw protocol: thousands of random sequences on a 2-rank cluster, none may hang.

    python benchmarks/fuzz.py --sequences 10000 --seed 0 --parallel 4

Each sequence (tests/compiler/fuzz.py: streams, calls, borrows in and out of
order, reduces with and without all members, sends, fetches, deletes,
recordings, exits; sent as a program or per rank, some mutated) runs on a
fresh raw Controller and ends in results (``ok``), a refusal before dispatch
(the compiler's pre-dispatch check or routing), a DeviceException from the
ranks (``failed``), or a hang: a sync that timed out, or a collective that
waited for a peer until its timeout. ``--parallel N`` runs N sequences at a
time, each on its own Controller on the same two workers (a concurrency fuzz
too: one controller's failure must not touch the others); each keeps its own
bounds. After each sequence its controller's tasks must leave the workers
within the collective timeout (every wait gives up when its controller
fails or releases the rank); every ``--check-every`` sequences a normal
controller must run a call and a fetch on them. The summary counts each
outcome, valid sequences refused (false alarms), worker restarts (a worker
process that changed) and the time; it lists the seeds of hangs and false
alarms (rerun one with ``--sequences 1 --seed S --verbose``). Interrupted
(Ctrl-C, SIGTERM), it prints the summary of the sequences it ran and the first
seed not run, to continue from.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import dask
from dask.utils import parse_timedelta
from distributed import Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "compiler"))

import fuzz  # noqa: E402

import dask_monarch as dm  # noqa: E402

PIDS_EVERY = 20  # sequences between two looks at the workers' process ids


def _pids(client: Client) -> set[int]:
    return set(client.run(os.getpid).values())


def _start() -> tuple[dm.LocalMeshCluster, Client]:
    cluster = dm.LocalMeshCluster(n_ranks=2, device="cpu")
    client = Client(cluster)
    client.wait_for_workers(2)
    return cluster, client


def _one(client: Client, seed: int, bound: float, rest_bound: float) -> tuple:
    """Run sequence ``seed``; then wait for its controller's tasks to leave the workers."""
    sequence = fuzz.generate(seed)
    outcome = fuzz.run(client, sequence, bound=bound)
    rest = fuzz.quiesce(client, timeout=rest_bound, token=outcome.token)
    return seed, sequence, outcome, rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0, help="the first sequence's seed")
    parser.add_argument("--parallel", type=int, default=1, help="sequences run at a time")
    parser.add_argument("--bound", type=float, default=60.0, help="seconds a final sync may take")
    parser.add_argument(
        "--collective-timeout", default="15s", help="dask_monarch.timeouts.collective on the ranks"
    )
    parser.add_argument("--check-every", type=int, default=50)
    parser.add_argument("--progress-every", type=int, default=100)
    parser.add_argument("--verbose", action="store_true", help="print every sequence's outcome")
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.CRITICAL)
    logging.getLogger("dask_monarch").setLevel(logging.CRITICAL)

    counts: collections.Counter = collections.Counter()
    hangs, false_alarms, unhealthy = [], [], []
    restarts = wedged = waited = 0
    waited_s = 0.0
    start = time.monotonic()
    config = {"dask_monarch.timeouts.collective": args.collective_timeout}
    rest_bound = parse_timedelta(args.collective_timeout) + 30
    dask.config.set(config)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    cluster, client = _start()
    pool = ThreadPoolExecutor(args.parallel, thread_name_prefix="fuzz")
    pending: set[Future] = set()
    done_seeds: set[int] = set()
    n = 0
    submitted = 0
    restart = lost = False
    looked = 0
    try:
        pids = _pids(client)
        while submitted < args.sequences or pending:
            while submitted < args.sequences and len(pending) < args.parallel and not restart:
                if lost:  # a worker died: its nanny starts another
                    client.wait_for_workers(2, timeout=300)
                    lost = False
                seed = args.seed + submitted
                pending.add(pool.submit(_one, client, seed, args.bound, rest_bound))
                submitted += 1
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                seed, sequence, outcome, rest = future.result()
                done_seeds.add(seed)
                counts[outcome.kind] += 1
                counts[("valid" if sequence.valid else "invalid", outcome.kind)] += 1
                n += 1
                lost = lost or outcome.kind == "lost"
                if outcome.kind == "hang":
                    hangs.append(seed)
                if sequence.valid and outcome.kind == "refused":
                    false_alarms.append(seed)
                if args.verbose or outcome.kind in ("hang", "lost"):
                    print(
                        f"seed {seed}: {outcome.kind} in {outcome.seconds:.2f}s, "
                        f"{len(sequence)} messages, valid={sequence.valid} "
                        f"{outcome.error[:300]}",
                        flush=True,
                    )
                if rest is None:  # a lost execution slot: start a fresh cluster to go on
                    wedged += 1
                    restart = True
                    print(
                        f"seed {seed}: workers still executing "
                        f"{fuzz.executing(client, outcome.token)[:4]} {rest_bound:.0f}s after "
                        "the sequence ended; starting a new cluster",
                        flush=True,
                    )
                elif rest > 0.5:
                    if rest > 5 or args.verbose:
                        print(f"seed {seed}: its tasks took {rest:.1f}s to leave", flush=True)
                    waited += 1
                    waited_s += rest
                if n % args.check_every == 0 or n == args.sequences:
                    if not fuzz.healthy(client):
                        unhealthy.append(seed)
                        print(f"seed {seed}: the health check failed", flush=True)
                if n % args.progress_every == 0:
                    print(
                        f"{n} sequences, {time.monotonic() - start:.0f}s: "
                        f"{dict((k, v) for k, v in counts.items() if isinstance(k, str))}",
                        flush=True,
                    )
            if n - looked < PIDS_EVERY and not (lost or restart or not pending):
                continue  # each look asks every worker: not after every sequence
            looked = n
            now = _pids(client)
            if now != pids:
                restarts += len(pids - now)
                print(f"a worker restarted (pids {sorted(pids)} -> {sorted(now)})", flush=True)
                pids = now
            if restart and not pending:
                client.close()
                cluster.close()
                cluster, client = _start()
                pids = _pids(client)
                restart = False
    except KeyboardInterrupt:
        print(f"interrupted after {n} sequences")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        client.close()
        cluster.close()
    elapsed = time.monotonic() - start
    first_missing = next(
        (args.seed + i for i in range(args.sequences) if args.seed + i not in done_seeds),
        args.seed + args.sequences,
    )
    print()
    valid = sum(v for k, v in counts.items() if isinstance(k, tuple) and k[0] == "valid")
    print(
        f"sequences: {n} (seeds from {args.seed}; every seed below {first_missing} ran; "
        f"{valid} valid; {args.parallel} at a time)"
    )
    print(f"ok: {counts['ok']}")
    print(
        f"refused before dispatch: {counts['refused']} "
        f"(valid sequences refused: {len(false_alarms)})"
    )
    print(
        f"failed with DeviceException: {counts['failed']} (and {counts['lost']} when a worker died)"
    )
    print(f"hangs: {len(hangs)}{' ' + str(sorted(hangs)[:20]) if hangs else ''}")
    print(f"worker restarts: {restarts}")
    print(
        f"health checks failed: {len(unhealthy)}; clusters restarted because a worker "
        f"kept executing a finished controller's task: {wedged}"
    )
    print(f"sequences whose tasks took over 0.5s to leave: {waited} ({waited_s:.0f}s)")
    print(f"time: {elapsed:.0f}s ({elapsed / max(n, 1) * 1000:.0f} ms per sequence)")
    if false_alarms:
        print(f"valid sequences refused: {sorted(false_alarms)[:20]}")


if __name__ == "__main__":
    main()
