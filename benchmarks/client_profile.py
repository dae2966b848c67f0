"""Where the client's time goes, per op and per training step (issue 38, item 1).

    python benchmarks/client_profile.py [--what op|reuse|literal|gpt2|gpt2-compiled]
                                        [--n 20000] [--sort tottime] [--spy] [--gc]

``op``: ``acc = ones + acc`` on 100x100 mesh tensors (``benchmarks/peers.py``'s
shape), ``--n`` times: the wall time and the user thread's CPU per op, then
the same loop under cProfile. ``reuse``: ``y = w + w``, one tensor read by every
op while the ranks are behind; ``literal``: ``torch.tensor([0.5, 2.0])``, a local
value placed on the mesh.
``gpt2``: the eager data-parallel step of
``benchmarks/training.py --gpt2`` (the test suite's tiny transformers GPT-2,
AdamW, ``ddp_hooks``) on 2 ranks, ``--n`` steps (30 is plenty): per step and
per message, then under cProfile; ``gpt2-compiled``: the same step under
``dm.compile``. All on a 2-rank ``LocalMeshCluster``.

``--gc``: the time the client's cyclic garbage collections took in the timed loop, per
op or step, and their count per generation.

``--spy``: where the ranks' time goes too. py-spy (``pip install py-spy``, not a
dependency) samples each rank process during the timed loop, only while a
thread holds the GIL (``--gil``: Python's own work, not the ops, whose torch
bindings release it), and the lines that held it most are printed per rank.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import os
import pstats
import signal
import subprocess
import tempfile
import time

import psutil
import torch
from distributed import Client

import dask_monarch as dm


def op_loop(mesh: dm.DeviceMesh, n: int) -> tuple:
    with mesh.activate():
        ones, acc = torch.ones(100, 100), torch.zeros(100, 100)

        def run(count: int) -> None:
            nonlocal acc
            for _ in range(count):
                acc = ones + acc
            dm.inspect(acc.sum())

        return run, n


def reuse_loop(mesh: dm.DeviceMesh, n: int) -> tuple:
    """``y = w + w`` on 256x256 tensors, ``w`` made at the start of the loop: one tensor read
    by every op while the ranks are behind (as they are behind a GPU's client), each op a
    user of the op that made ``w`` in the client's history until the ranks report."""

    def run(count: int) -> None:
        with mesh.activate():
            w = torch.ones(256, 256)
            for _ in range(count):
                y = w + w
            dm.inspect(y.sum())

    return run, n


def literal_loop(mesh: dm.DeviceMesh, n: int) -> tuple:
    """``torch.tensor([0.5, 2.0])`` under the mesh: a local value placed on the ranks (what
    transformers' caches and masks make every step)."""

    def run(count: int) -> None:
        with mesh.activate():
            for _ in range(count):
                t = torch.tensor([0.5, 2.0])
            dm.inspect(t.sum())

    return run, n


LOOPS = {"op": op_loop, "reuse": reuse_loop, "literal": literal_loop}


def gpt2_loop(mesh: dm.DeviceMesh, n: int, compiled: bool = False) -> tuple:
    import training

    n = min(n, 5000 if compiled else 200)  # an eager step under cProfile is slow
    with mesh.activate():
        model = training.gpt2_model(dm.random.manual_seed)
        optimizer = training.adamw(model)
        dm.ddp_hooks(model, "dp", stream=dm.Stream("comms"))
        me = mesh.rank("dp").reshape(1)

    def step(ids: torch.Tensor) -> torch.Tensor:
        shard = ids.view(2, -1, training.GPT2_TOKENS).index_select(0, me).squeeze(0)
        loss = training.gpt2_loss(model, shard)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    if compiled:
        step = dm.compile(step)

    def run(count: int) -> None:
        with mesh.activate():
            for i in range(count):
                loss = step(training.gpt2_batch(i))
            dm.inspect(loss)

    return run, n


SPY_RATE = 250  # py-spy's samples per second


def _spy(pids: list[int], folder: str) -> list:
    """py-spy recording each of ``pids`` (GIL-holding samples only) into ``folder``."""
    return [
        subprocess.Popen(
            [
                "py-spy",
                "record",
                "--gil",
                "--nonblocking",
                "-r",
                str(SPY_RATE),
                "-f",
                "raw",
                "-p",
                str(pid),
                "-o",
                os.path.join(folder, f"rank{i}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i, pid in enumerate(pids)
    ]


def _hottest(path: str, n: int = 15) -> tuple[int, list[str]]:
    """The samples of a py-spy raw recording, and its ``n`` lines that held the GIL most."""
    lines: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for record in f:
            stack, _, count = record.rstrip().rpartition(" ")
            if stack:
                lines[stack.split(";")[-1]] += int(count)
                total += int(count)
    return total, [f"{c / total:6.1%}  {line}" for line, c in lines.most_common(n)]


class _CollectionTimer:
    """The client's cyclic garbage collections while it runs, per generation (gc.callbacks):
    every young object a message keeps alive until the ranks report is walked by them."""

    def __init__(self) -> None:
        self.count, self.seconds, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start

    def stop(self) -> None:
        gc.callbacks.remove(self._note)

    def report(self, n: int, unit: str) -> str:
        per = ", ".join(
            f"gen {g}: {c} ({s * 1e3:.0f} ms)"
            for g, (c, s) in enumerate(zip(self.count, self.seconds))
        )
        return f"GC: {sum(self.seconds) / n * 1e6:.2f} us per {unit}; collections {per}"


def _cpu(workers: list) -> list[float]:
    """CPU seconds (user + system) of this process, then of each of ``workers``."""
    return [sum(p.cpu_times()[:2]) for p in [psutil.Process(), *workers]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=(*LOOPS, "gpt2", "gpt2-compiled"), default="op")
    parser.add_argument("--n", type=int, default=None, help="ops (20 000) or steps (30)")
    parser.add_argument("--sort", default="tottime", help="pstats order (tottime, cumulative)")
    parser.add_argument("--spy", action="store_true", help="py-spy the ranks (see above)")
    parser.add_argument("--gc", action="store_true", help="time the client's GC (see above)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        mesh = dm.device_mesh(client, dp=2)
        if args.what in LOOPS:
            run, n = LOOPS[args.what](mesh, args.n or 20000)
        else:
            run, n = gpt2_loop(mesh, args.n or 30, compiled=args.what == "gpt2-compiled")
        run(max(1, n // 10))  # warm: lanes, propagation caches, the optimizer's state
        controller = mesh._session.controller
        sent = controller.messages_sent
        workers = [psutil.Process(pid) for pid in client.run(os.getpid).values()]
        folder = tempfile.mkdtemp(prefix="dm-spy-") if args.spy else None
        spies = _spy([w.pid for w in workers], folder) if folder else []
        gc_timer = _CollectionTimer() if args.gc else None
        before = _cpu(workers)
        wall, cpu = time.perf_counter(), time.thread_time()
        run(n)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        if gc_timer is not None:
            gc_timer.stop()
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its recording as it stops
            spy.wait()
        spent = [(after - start) / n * 1e6 for start, after in zip(before, _cpu(workers))]
        messages = (controller.messages_sent - sent) / n
        unit = "op" if args.what in LOOPS else "step"
        print(
            f"per {unit}: {wall / n * 1e6:.1f} us wall, {cpu / n * 1e6:.1f} us of the user "
            f"thread's CPU; {messages:.0f} messages per {unit}, "
            f"{cpu / n / max(messages, 1) * 1e6:.1f} us of CPU per message"
        )
        print(
            f"CPU per {unit}, us: this process (client and scheduler) {spent[0]:.1f}, ranks "
            + ", ".join(f"{s:.1f}" for s in spent[1:])
            + f"; all {sum(spent):.1f} on {psutil.cpu_count()} cores"
        )
        if gc_timer is not None:
            print(gc_timer.report(n, unit))
        for i in range(len(spies)):
            samples, hottest = _hottest(os.path.join(folder, f"rank{i}.txt"))
            print(
                f"rank {i}: held the GIL {samples / SPY_RATE / n * 1e6:.0f} us per {unit}; "
                "the lines that held it most (py-spy --gil):"
            )
            print("\n".join(hottest))
        profile = cProfile.Profile()
        profile.enable()
        run(n)
        profile.disable()
        pstats.Stats(profile).sort_stats(args.sort).print_stats(30)
        mesh.exit()


if __name__ == "__main__":
    main()
