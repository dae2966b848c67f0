"""The client's time for one step of torch's AdamW against the number of parameter tensors.

    python benchmarks/optimizer_step.py [--params 50 200 800] [--steps 8] [--no-model]

Real models have hundreds of parameter tensors (GPT-2 small 148, a 7B Llama
291), and an optimizer step names each of them several times: the fused
step's one op takes 5 lists of them, the ``foreach`` step reads each step
count with ``.item()``, the default step sends a dozen ops per parameter. For
each size and each of torch's three AdamW implementations (``fused=True``,
``foreach=True``, the default), the median over ``--steps`` steps (the first
two left out) of the user thread's wall time inside ``optimizer.step()`` on a
2-rank ``LocalMeshCluster``, next to the same step of plain local torch on
the same parameters. The parameters are tiny (4 elements): what is timed is
the client's work per tensor, not the ranks' arithmetic.

Then a whole data-parallel step of a model with as many parameter tensors
(``Linear(4, 4)`` layers): forward, backward with ``dm.ddp_hooks``,
``clip_grad_norm_``, ``AdamW(foreach=True)``; the wall time per step (to the
loss fetched) and the CPU time per step of the client's process and of each
rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import psutil
import torch
from distributed import Client
from torch import nn

import dask_monarch as dm

KINDS: dict[str, dict] = {"fused": {"fused": True}, "foreach": {"foreach": True}, "default": {}}


def step_times(count: int, kind: str, steps: int, sync: Callable[[torch.Tensor], object]) -> float:
    """Median milliseconds of ``optimizer.step()`` with ``count`` parameters (under whatever
    mesh is active); ``sync`` waits for the work sent so far."""
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(count)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, **KINDS[kind])
    times = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.ones(4)
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
        optimizer.zero_grad()
    sync(params[0])
    return statistics.median(times[2:]) * 1e3


def model_step(
    mesh: dm.DeviceMesh, client: Client, count: int, steps: int
) -> tuple[float, list[float]]:
    """Wall milliseconds per data-parallel step with ``count`` parameters, and the CPU
    milliseconds per step of this process and of each rank."""
    with mesh.activate():
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(count // 2)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        dm.ddp_hooks(model, "dp")
        x = torch.randn(2, 4)

        def step() -> torch.Tensor:
            loss = model(x).sum()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            return loss

        dm.inspect(step())
        pids = client.run(os.getpid).values()
        processes = [psutil.Process(), *map(psutil.Process, pids)]
        cpu = [sum(p.cpu_times()[:2]) for p in processes]
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        dm.inspect(loss)
        wall = (time.perf_counter() - start) / steps * 1e3
        used = [(sum(p.cpu_times()[:2]) - c) / steps * 1e3 for p, c in zip(processes, cpu)]
    return wall, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, nargs="+", default=[50, 200, 800])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-model", action="store_true", help="the optimizer steps only")
    args = parser.parse_args()
    print("| parameters | AdamW | mesh, client ms per step | local torch, ms | × local |")
    print("|---|---|---|---|---|")
    with dm.LocalMeshCluster(2) as cluster, Client(cluster) as client:
        mesh = dm.device_mesh(client, dp=2)
        for count in args.params:
            for kind in KINDS:
                with mesh.activate():
                    on_mesh = step_times(count, kind, args.steps, dm.inspect)
                local = step_times(count, kind, args.steps, lambda t: t)
                print(
                    f"| {count} | {kind} | {on_mesh:.2f} | {local:.3f} | {on_mesh / local:.0f} |",
                    flush=True,
                )
        if not args.no_model:
            print("\n| parameters | data-parallel step, ms | CPU ms per step: client, ranks |")
            print("|---|---|---|")
            for count in args.params:
                wall, used = model_step(mesh, client, count, max(args.steps // 2, 2))
                cpu = ", ".join(f"{c:.0f}" for c in used)
                print(f"| {count} | {wall:.1f} | {cpu} |", flush=True)
        mesh.exit()


if __name__ == "__main__":
    main()
