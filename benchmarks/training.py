"""Training steps of the README's example (examples/train_mlp.py) against its baselines.

    python benchmarks/training.py [--steps 20] [--repeat 3] [--hidden 32] [--batch 64]

Milliseconds per step of data-parallel MLP training on 4 ranks (a 2x2 mesh,
gradients averaged on a separate stream through borrows, as in the example),
next to the same training in one process (plain torch, the full batch) and in
4 plain ``torch.distributed`` processes (gloo; each trains on its quarter and
all-reduces its gradients). The mesh run fetches the loss at its first and last
step and the weights at the end, as the example does with a long fetch interval.
Medians over the repeats, after one warm-up run each.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed import Client
from torch import nn

import dask_monarch as dm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_mlp  # noqa: E402

FEATURES = 16
WORLD = 4


def _ddp(rank, port, args, queue):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    model = train_mlp.make_model(torch.manual_seed, FEATURES, args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    times = []
    for _ in range(args.repeat + 1):
        dist.barrier()
        start = time.perf_counter()
        for step in range(args.steps):
            x, y = train_mlp.batch(torch.manual_seed, step, args.batch, FEATURES)
            shard = args.batch // WORLD
            x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            optimizer.step()
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)  # the one fetch of the loss
        times.append(time.perf_counter() - start)
    if rank == 0:
        queue.put(statistics.median(times[1:]) / args.steps)
    dist.destroy_process_group()


def plain_ddp(args) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_ddp, args=(port, args, queue), nprocs=WORLD, start_method="spawn")
    return queue.get()


def local(args) -> float:
    def run():
        start = time.perf_counter()
        train_mlp.train_locally(
            args.steps, args.batch, FEATURES, args.hidden, fetch_every=args.steps
        )
        return time.perf_counter() - start

    run()
    return statistics.median(run() for _ in range(args.repeat)) / args.steps


def on_mesh(args) -> float:
    with dm.LocalMeshCluster(n_ranks=WORLD, device="cpu") as cluster, Client(cluster) as client:

        def run():
            mesh = dm.device_mesh(client, host=2, gpu=2)
            start = time.perf_counter()
            train_mlp.train_on_mesh(
                mesh, args.steps, args.batch, FEATURES, args.hidden, fetch_every=args.steps
            )
            elapsed = time.perf_counter() - start
            mesh.exit()
            return elapsed

        run()
        return statistics.median(run() for _ in range(args.repeat)) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    rows = [
        ("plain torch, 1 process, full batch", local(args)),
        ("plain torch.distributed, 4 gloo processes", plain_ddp(args)),
        ("dask_monarch, 2x2 mesh", on_mesh(args)),
    ]
    print(
        f"\ndata-parallel MLP {FEATURES}-{args.hidden}-1, batch {args.batch}, {args.steps} steps "
        f"then one loss fetch; median of {args.repeat} (torch {torch.__version__})"
    )
    print(f"{'path':<44}{'ms/step':>10}")
    for label, seconds in rows:
        print(f"{label:<44}{seconds * 1e3:>10.2f}")


if __name__ == "__main__":
    main()
