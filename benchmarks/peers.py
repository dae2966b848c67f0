"""dask_monarch next to Monarch 0.7.0: the same shapes, in one run, alternating.

    bash benchmarks/monarch_env.sh                  # once: makes /work/monarch-venv
    python benchmarks/peers.py --monarch-python /work/monarch-venv/bin/python \\
        [--rounds 3] [--ops 2000] [--fetches 100]

Monarch runs in its own Python (``torchmonarch`` pins its own torch; this
script starts it as a subprocess that serves one measurement at a time), on a
2-process mesh of its own (``this_host().spawn_procs(per_host={"gpus": 2})``,
tensor engine on CPU); dask_monarch on a 2-rank ``LocalMeshCluster`` in this
process. An untimed round warms both up; then each round runs every measurement
on both, the order swapped every round, so both see the same machine at the
same minutes. Measurements:

* ``t = t + 1`` on a 4-element tensor, ``--ops`` times, then one fetch
  (microseconds per op);
* ``acc = ones + acc`` on 100x100 tensors, ``--ops`` times, then one fetch;
* one ``x = x + 1`` on a scalar then ``fetch_shard(x).result()``, median of
  ``--fetches`` (milliseconds), next to a bare ``client.submit(f).result()``
  on the same Dask cluster.

dask_monarch also runs the 100x100 loop under ``dm.compile`` (blocks of 100
adds, 10x ``--ops`` so that the closing fetch is amortised; traced and
replayed ``recordings.generate-after`` times untimed, so that the ranks run
it as generated code) and locally, for the compiled-dispatch figure. Collectives are not
compared: Monarch 0.7.0's tensor engine has no CPU communicator (a
``reduce`` fails with "no comm found for stream"), so
``benchmarks/collectives.py`` compares ours with raw gloo instead. Prints
medians per round and over all rounds, and the ratios; and, for each
framework, the CPU all of its processes spent per op or per fetch (psutil's
user + system time of the client and everything it spawned: for dask_monarch
this process, the scheduler and the workers; for Monarch its subprocess and
the processes it spawned). On a machine with fewer cores than processes, that
CPU divided by the cores bounds the latency from below.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

PEERS = ("dask_monarch", "Monarch 0.7.0")  # whose CPU is counted: every process of each
PREFIX = "PEERS "  # result lines on the Monarch subprocess's stdout
BLOCK = 100  # adds per compiled call
COMPILED_SCALE = 10  # the compiled loop runs 10x --ops: its one closing fetch (ms) is amortised


# -- the measurements, written once for both (``fetch`` is the framework's fetch_shard) ----------


def add4(fetch, ops: int) -> float:
    """Seconds per ``t = t + 1`` on 4 elements, ``ops`` of them, then one fetch."""
    t = torch.zeros(4)
    fetch(t).result()
    start = time.perf_counter()
    for _ in range(ops):
        t = t + 1
    fetch(t).result()
    return (time.perf_counter() - start) / ops


def add100(fetch, ops: int) -> float:
    """Seconds per ``acc = ones + acc`` on 100x100, ``ops`` of them, then one fetch."""
    ones, acc = torch.ones(100, 100), torch.zeros(100, 100)
    fetch(acc).result()
    start = time.perf_counter()
    for _ in range(ops):
        acc = ones + acc
    fetch(acc).result()
    return (time.perf_counter() - start) / ops


def fetch_latency(fetch, n: int) -> float:
    """Median seconds of one ``x = x + 1`` on a scalar, then its fetch."""
    x = torch.zeros(())
    fetch(x).result()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        x = x + 1
        fetch(x).result()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


MEASURES = {"add4": add4, "add100": add100, "fetch": fetch_latency}


# -- Monarch, in its own Python ------------------------------------------------------------------


def serve_monarch() -> None:
    """The subprocess: a 2-process Monarch mesh; one JSON request per stdin line."""
    import torch._dynamo  # noqa: F401  (imported by the first fetch: slow on a loaded machine)
    from monarch.config import configure

    # a loaded machine is slow to spawn and to answer: Monarch's own limits (30 s and less) fail
    slow = "600s"
    configure(
        actor_spawn_max_idle=slow,
        mesh_proc_spawn_max_idle=slow,
        host_spawn_ready_timeout=slow,
        get_actor_state_max_idle=slow,
        get_proc_state_max_idle=slow,
        message_delivery_timeout=slow,
        supervision_watchdog_timeout=slow,
        mesh_attach_config_timeout=slow,
    )
    from monarch import fetch_shard
    from monarch.actor import this_host

    torch.set_num_threads(1)
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    with procs.activate():
        fetch_shard(torch.zeros(())).result()
        print(PREFIX + json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            request = json.loads(line)
            seconds = MEASURES[request["measure"]](fetch_shard, request["n"])
            print(PREFIX + json.dumps({"seconds": seconds}), flush=True)


def _cpu_seconds(processes: list) -> float:
    """User + system CPU seconds of ``processes`` (ones that ended meanwhile count nothing)."""
    import psutil  # here and below: Monarch's Python, which serves it, has no psutil

    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _tree(root: int, leave_out: set[int] = frozenset()) -> list:
    """Process ``root`` and its descendants, without the subtrees rooted at ``leave_out``."""
    import psutil

    out = []
    root = psutil.Process(root)
    for process in [root, *root.children(recursive=True)]:
        try:
            chain = {process.pid, *(p.pid for p in process.parents())}
        except psutil.Error:
            continue
        if not chain & leave_out:
            out.append(process)
    return out


class MonarchPeer:
    """The Monarch subprocess, asked for one measurement at a time."""

    def __init__(self, python: str) -> None:
        self.process = subprocess.Popen(
            [python, os.path.abspath(__file__), "--serve-monarch"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._read()  # ready

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
        raise RuntimeError(f"the Monarch subprocess ended (exit code {self.process.wait()})")

    def measure(self, name: str, n: int) -> float:
        self.process.stdin.write(json.dumps({"measure": name, "n": n}) + "\n")
        self.process.stdin.flush()
        return self._read()["seconds"]

    def processes(self) -> list:
        """Monarch's processes: its controller (the subprocess) and every process it spawned."""
        return _tree(self.process.pid)

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


# -- dask_monarch --------------------------------------------------------------------------------


def noop(x):
    return x


def dm_compiled(dm, ops: int) -> float:
    """Seconds per add of ``acc = ones + acc`` on 100x100 under ``dm.compile`` (blocks of 100)."""

    @dm.compile
    def block(acc, ones):
        for _ in range(BLOCK):
            acc = ones + acc
        return acc

    ones, acc = torch.ones(100, 100), torch.zeros(100, 100)
    for _ in range(dm.config.get("recordings.generate-after") or 0):
        acc = block(acc, ones)  # traced, defined and generated (worker/plan.py) untimed
    acc = block(acc, ones)
    dm.fetch_shard(acc).result()
    start = time.perf_counter()
    for _ in range(ops // BLOCK):
        acc = block(acc, ones)
    dm.fetch_shard(acc).result()
    return (time.perf_counter() - start) / (ops // BLOCK * BLOCK)


def local(ops: int) -> float:
    ones, acc = torch.ones(100, 100), torch.zeros(100, 100)
    start = time.perf_counter()
    for _ in range(ops):
        acc = ones + acc
    float(acc[0, 0])
    return (time.perf_counter() - start) / ops


def bare_submit(client, n: int) -> float:
    client.submit(noop, -1, pure=False).result()
    times = []
    for i in range(n):
        start = time.perf_counter()
        client.submit(noop, i, pure=False).result()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- the run -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--monarch-python", help="a Python with torchmonarch 0.7.0 installed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ops", type=int, default=2000, help="ops per dispatch measurement")
    parser.add_argument("--fetches", type=int, default=100, help="round trips per latency figure")
    parser.add_argument("--serve-monarch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_monarch:
        serve_monarch()
        return

    from distributed import Client

    import dask_monarch as dm

    torch.set_num_threads(1)
    n = {"add4": args.ops, "add100": args.ops, "fetch": args.fetches}
    results: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}  # CPU seconds per op or fetch, all processes

    def record(who: str, what: str, seconds: float) -> None:
        results.setdefault((who, what), []).append(seconds)

    def measured(who: str, what: str, processes: list, run, *args) -> None:
        """Record ``run(*args)``'s figure and the CPU its framework's processes spent on it."""
        before = _cpu_seconds(processes)
        seconds = run(*args)
        cpu.setdefault((who, what), []).append((_cpu_seconds(processes) - before) / n[what])
        record(who, what, seconds)

    peer = MonarchPeer(args.monarch_python) if args.monarch_python else None
    try:
        with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
            mesh = dm.device_mesh(client, gpu=2)
            # this process, the scheduler and the workers (not the Monarch subprocess)
            ours = _tree(os.getpid(), {peer.process.pid} if peer is not None else set())
            theirs = peer.processes() if peer is not None else []

            def on_mesh(fn, *args):
                with mesh.activate():
                    return fn(*args)

            # an untimed round first, full size, on both: caches, lanes, traces (the first
            # timed round of each was up to twice as slow as the others after 200 ops)
            for name, fn in MEASURES.items():
                on_mesh(fn, dm.fetch_shard, n[name])
                if peer is not None:
                    peer.measure(name, n[name])
            on_mesh(dm_compiled, dm, 10 * BLOCK)
            bare_submit(client, 10)
            for r in range(args.rounds):
                for name, fn in MEASURES.items():
                    order = ["dm", "monarch"] if r % 2 == 0 else ["monarch", "dm"]
                    for who in order:
                        if who == "dm":
                            measured(
                                "dask_monarch", name, ours, on_mesh, fn, dm.fetch_shard, n[name]
                            )
                        elif peer is not None:
                            measured("Monarch 0.7.0", name, theirs, peer.measure, name, n[name])
                    if name == "fetch":
                        record("bare Dask submit().result()", name, bare_submit(client, n[name]))
                    if name == "add100":  # 10x the ops: the closing fetch (ms) is amortised
                        compiled_ops = COMPILED_SCALE * n[name]
                        record(
                            "dask_monarch compiled", name, on_mesh(dm_compiled, dm, compiled_ops)
                        )
                        record("local torch", name, local(compiled_ops))
                print(f"round {r + 1} of {args.rounds} done", file=sys.stderr, flush=True)
            mesh.exit()
    finally:
        if peer is not None:
            peer.close()
    report(results, cpu, args)


def _listed(values: list[float], scale: float, digits: int = 1) -> str:
    return " / ".join(f"{v * scale:.{digits}f}" for v in values)


def report(results: dict, cpu: dict, args) -> None:
    def med(who: str, what: str) -> float | None:
        values = results.get((who, what))
        return statistics.median(values) if values else None

    def runs(who: str, what: str, scale: float) -> str:
        return _listed(results.get((who, what), []), scale)

    print(
        f"\n2 ranks, {args.rounds} alternating rounds; torch {torch.__version__}; "
        f"median of the rounds (each round's figure in brackets)"
    )
    rows = [
        ("add4", f"t = t + 1, 4 elements, {args.ops} ops then fetch", "us/op", 1e6),
        ("add100", f"acc = ones + acc, 100x100, {args.ops} ops then fetch", "us/op", 1e6),
        ("fetch", f"x = x + 1 then fetch_shard(x).result(), median of {args.fetches}", "ms", 1e3),
    ]
    for what, title, unit, scale in rows:
        print(f"\n{title} ({unit})")
        ours = med("dask_monarch", what)
        for who in (
            "dask_monarch",
            "Monarch 0.7.0",
            "dask_monarch compiled",
            "local torch",
            "bare Dask submit().result()",
        ):
            value = med(who, what)
            if value is None:
                continue
            line = f"  {who:<30}{value * scale:>10.2f}   [{runs(who, what, scale)}]"
            if who == "Monarch 0.7.0" and ours:
                ratio = value / ours
                line += (
                    f"   dask_monarch {ratio:.{1 if ratio >= 2 else 2}f}x faster"
                    if ratio >= 1
                    else f"   dask_monarch {1 / ratio:.2f}x slower"
                )
            if who == "bare Dask submit().result()" and ours:
                line += f"   dask_monarch / this = {ours / value:.2f}"
            if who == "dask_monarch compiled":
                base = med("local torch", what)
                line += f"   {(value - base) * scale:.2f} over local ({COMPILED_SCALE}x the ops)"
            print(line)
        spent = [(who, cpu[(who, what)]) for who in PEERS if (who, what) in cpu]
        if spent:
            figures = ", ".join(
                f"{who} {statistics.median(v) * scale:.2f} [{_listed(v, scale, 2)}]"
                for who, v in spent
            )
            print(f"  CPU {unit}, all of its processes (user + system): {figures}")


if __name__ == "__main__":
    main()
