"""Where the client's time goes, per op and per training step (issue 38, item 1).

    python benchmarks/client_profile.py [--what op|gpt2] [--n 20000] [--sort tottime]

``op``: ``acc = ones + acc`` on 100x100 mesh tensors (``benchmarks/peers.py``'s
shape), ``--n`` times: the wall time and the user thread's CPU per op, then
the same loop under cProfile. ``gpt2``: the eager data-parallel step of
``benchmarks/training.py --gpt2`` (the test suite's tiny transformers GPT-2,
AdamW, ``ddp_hooks``) on 2 ranks, ``--n`` steps (30 is plenty): per step and
per message, then under cProfile. Both on a 2-rank ``LocalMeshCluster``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
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


def gpt2_loop(mesh: dm.DeviceMesh, n: int) -> tuple:
    import training

    n = min(n, 200)
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

    def run(count: int) -> None:
        with mesh.activate():
            for i in range(count):
                loss = step(training.gpt2_batch(i))
            dm.inspect(loss)

    return run, n


def _cpu(workers: list) -> list[float]:
    """CPU seconds (user + system) of this process, then of each of ``workers``."""
    return [sum(p.cpu_times()[:2]) for p in [psutil.Process(), *workers]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("op", "gpt2"), default="op")
    parser.add_argument("--n", type=int, default=None, help="ops (20 000) or steps (30)")
    parser.add_argument("--sort", default="tottime", help="pstats order (tottime, cumulative)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        mesh = dm.device_mesh(client, dp=2)
        if args.what == "op":
            run, n = op_loop(mesh, args.n or 20000)
        else:
            run, n = gpt2_loop(mesh, args.n or 30)
        run(max(1, n // 10))  # warm: lanes, propagation caches, the optimizer's state
        controller = mesh._session.controller
        sent = controller.messages_sent
        workers = [psutil.Process(pid) for pid in client.run(os.getpid).values()]
        before = _cpu(workers)
        wall, cpu = time.perf_counter(), time.thread_time()
        run(n)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        spent = [(after - start) / n * 1e6 for start, after in zip(before, _cpu(workers))]
        messages = (controller.messages_sent - sent) / n
        unit = "op" if args.what == "op" else "step"
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
        profile = cProfile.Profile()
        profile.enable()
        run(n)
        profile.disable()
        pstats.Stats(profile).sort_stats(args.sort).print_stats(30)
        mesh.exit()


if __name__ == "__main__":
    main()
