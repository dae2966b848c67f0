"""What an op costs the client the first time it meets its inputs' metadata.

    python benchmarks/first_propagation.py [--repeat 200] [--steps 16]

The client plans an op's outputs by running torch's fake kernel once per
kind of inputs (propagation.py), and keeps the plan: the first step of a
model, a batch of a sequence length not seen before, or a new model pays it
for every op. First the fake run alone (``Propagator.run_fake``, median of
``--repeat``) for ``add``, ``mm``, ``view`` and a ``_foreach_add`` over 100
tensors; then eager steps of the test suite's tiny transformers GPT-2 (2
ranks, AdamW) whose sequence length changes every step (5, 6, ... tokens:
every op meets new shapes), against the same lengths once more (every plan
cached), per step to the last loss fetched.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import training
from distributed import Client

import dask_monarch as dm

aten = torch.ops.aten


def fake_runs(mesh: dm.DeviceMesh, repeat: int) -> None:
    with mesh.activate():
        a, b = torch.ones(4, 8), torch.ones(8, 4)
        tensors = [torch.ones(4) for _ in range(100)]
        cases = {
            "add": (aten.add.Tensor, (a, a)),
            "mm": (aten.mm.default, (a, b)),
            "view": (aten.view.default, (a, [32])),
            "_foreach_add over 100 tensors": (aten._foreach_add.Scalar, (tensors, 1.0)),
        }
        for name, (op, args) in cases.items():
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                mesh._propagator.run_fake(op, args, {})
                times.append(time.perf_counter() - start)
            print(f"| {name} | {statistics.median(times) * 1e6:.0f} µs |", flush=True)


def new_lengths(mesh: dm.DeviceMesh, steps: int) -> None:
    with mesh.activate():
        model = training.gpt2_model(dm.random.manual_seed)
        optimizer = training.adamw(model)

        def step(tokens: int) -> torch.Tensor:
            ids = torch.randint(0, 64, (4, tokens))
            loss = training.gpt2_loss(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        dm.inspect(step(4))
        for label in ("new every step", "seen before"):
            start = time.perf_counter()
            for tokens in range(5, 5 + steps):
                loss = step(tokens)
            dm.inspect(loss)
            per_step = (time.perf_counter() - start) / steps * 1e3
            print(f"| GPT-2 step, sequence lengths {label} | {per_step:.1f} ms |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # transformers' notes on the tiny model's config
    with dm.LocalMeshCluster(2) as cluster, Client(cluster) as client:
        mesh = dm.device_mesh(client, dp=2)
        print("| first propagation | median |\n|---|---|")
        fake_runs(mesh, args.repeat)
        new_lengths(mesh, args.steps)
        mesh.exit()


if __name__ == "__main__":
    main()
