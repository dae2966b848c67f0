"""Data-parallel training steps: dask_monarch next to torch's DistributedDataParallel.

    python benchmarks/training.py [--configs 32x64,1024x4096] [--gpt2 2,4] [--steps 100]
                                  [--repeat 3]

Two workloads. The MLP (``--configs``, 4 ranks), below. And (``--gpt2``, ranks
per run) the tiny transformers GPT-2 of the test suite (2 layers, 16 wide, 64
tokens; random init, no download), each rank training on its part of a global
batch of 8 sequences of 16 tokens with AdamW (``fused=True`` on every path: one
message for the whole update on a mesh, and a step count on the ranks that a
compiled step can replay), gradients averaged by DDP or ``dm.ddp_hooks``
(``attention_mask`` given, as a compiled step needs; docs/user_guide.md).

An MLP 16-H-1 trained with SGD (lr 0.2 x min(1, 32/H), ``foreach=True`` on every
path) on batches of B rows drawn on every rank from the same seed; each of 4
ranks trains on its quarter and the
gradients are averaged. Four paths, run alternately in the same minutes
(each round runs every configuration on every path, so they see the same
machine; the first round is a warm-up):

* ``local``: plain torch in this process on the full batch (the reference);
* ``ddp``: 4 gloo processes, each with ``torch.nn.parallel.DistributedDataParallel``
  (bucketed all-reduce overlapping backward);
* ``mesh``: a 2x2 ``LocalMeshCluster`` mesh, plain dispatch with ``dm.ddp_hooks``
  (bucketed all-reduce on a ``comms`` stream through mutable borrows, flushed as
  each bucket is ready);
* ``compiled``: the same step (data, forward, backward with the same hooks,
  SGD step) under ``dm.compile``: one ``CallRecording`` per step.

A run is one untimed step (the compiled path traces there), then ``--steps``
timed steps and the loss averaged over the ranks fetched to this process.
What a run costs once is in its figure too: the mesh's ranks start on the first
flush, and the closing fetch waits for what they still have to run; about
30 ms at 16-32-1 (loops of 10, 30 and 100 steps then a fetch, on one mesh):
1 ms per step over 30 steps (30 was the default until
2026-12-04; ``--steps 30`` still measures it), a third of that over 100. The
figures are medians over the rounds: milliseconds per step, CPU milliseconds
per step of each process (client = this process, scheduler, each worker; each
DDP process; psutil's user + system time, whose tick is 10 ms: use enough
steps), and ratios to DDP. The final weights of every path are compared with
``local``'s and DDP's (``allclose``, rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import psutil
import torch
import torch.distributed as dist
from distributed import Client
from gloo_ranks import GlooRanks
from torch import nn

import dask_monarch as dm
from dask_monarch.controller.placement import registered_workers

FEATURES = 16
WORLD = 4

DIMS = ("host", "gpu")
PATHS = ("local", "ddp", "mesh", "compiled")


def lr(hidden: int) -> float:
    """SGD's learning rate: 0.2, scaled down for wide layers (0.2 diverges at 1024 hidden)."""
    return 0.2 * min(1.0, 32 / hidden)


def sgd(model: nn.Module, hidden: int) -> torch.optim.Optimizer:
    """The optimizer of every path: SGD with torch's multi-tensor kernels (``foreach``), which
    torch picks by default only for plain CUDA tensors; on a mesh the update is then one
    message for all parameters instead of one per parameter (docs/user_guide.md)."""
    return torch.optim.SGD(model.parameters(), lr=lr(hidden), foreach=True)


def make_model(seed, hidden: int) -> nn.Module:
    seed(0)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def batch(batch_size: int):
    """The full batch of a step, drawn from the current generator (seeded once per run)."""
    x = torch.randn(batch_size, FEATURES)
    y = (x @ torch.linspace(-1, 1, FEATURES)).tanh().unsqueeze(1)  # a target the MLP can learn
    return x, y


GPT2_BATCH, GPT2_TOKENS = 8, 16


def gpt2_model(seed) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def gpt2_batch(step: int) -> torch.Tensor:
    """The global batch of a step: token ids drawn from a generator keyed by the step."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (GPT2_BATCH, GPT2_TOKENS), generator=generator)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def gpt2_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, attention_mask=torch.ones_like(ids), labels=ids).loss


def _cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


# -- plain torch ----------------------------------------------------------------------------


def sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, x, y) -> torch.Tensor:
    """One step as every unrolled path takes it: forward, MSE, backward, SGD."""
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


def run_local(hidden: int, batch_size: int, steps: int) -> dict:
    model = make_model(torch.manual_seed, hidden)
    optimizer = sgd(model, hidden)
    torch.manual_seed(1000)

    def step():
        return sgd_step(model, optimizer, *batch(batch_size))

    step()
    cpu, start = _cpu(), time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "cpu": {"client": _cpu() - cpu},
        "weights": [p.detach().clone() for p in model.parameters()],
    }


def run_local_gpt2(steps: int) -> dict:
    model = gpt2_model(torch.manual_seed)
    optimizer = adamw(model)

    def step(i: int) -> torch.Tensor:
        loss = gpt2_loss(model, gpt2_batch(i))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    step(0)
    cpu, start = _cpu(), time.perf_counter()
    for i in range(steps):
        loss = step(i + 1)
    loss.item()
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "cpu": {"client": _cpu() - cpu},
        "weights": [p.detach().clone() for p in model.parameters()],
    }


# -- torch.distributed: DistributedDataParallel, 4 gloo processes ---------------------------


def _ddp_gpt2(rank: int, world: int, steps: int) -> tuple:
    group = dist.new_group(list(range(world))) if world < dist.get_world_size() else None
    if rank >= world:
        return rank, 0.0, 0.0, None
    model = nn.parallel.DistributedDataParallel(gpt2_model(torch.manual_seed), process_group=group)
    optimizer = adamw(model.module)
    shard = GPT2_BATCH // world

    def step(i: int) -> torch.Tensor:
        ids = gpt2_batch(i)[rank * shard : (rank + 1) * shard]
        loss = gpt2_loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    step(0)
    dist.barrier(group)
    cpu, start = _cpu(), time.perf_counter()
    for i in range(steps):
        loss = step(i + 1)
    loss = loss.detach()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
    loss.item()
    elapsed = time.perf_counter() - start
    cpu = _cpu() - cpu
    weights = [p.detach().clone() for p in model.module.parameters()] if rank == 0 else None
    return rank, elapsed, cpu, weights


def _ddp_run(rank: int, hidden: int, batch_size: int, steps: int) -> tuple:
    if hidden == "gpt2":
        return _ddp_gpt2(rank, batch_size, steps)  # batch_size: the ranks of this run
    model = nn.parallel.DistributedDataParallel(make_model(torch.manual_seed, hidden))
    optimizer = sgd(model, hidden)
    torch.manual_seed(1000)
    shard = batch_size // WORLD

    def step():
        x, y = batch(batch_size)
        return sgd_step(
            model,
            optimizer,
            x[rank * shard : (rank + 1) * shard],
            y[rank * shard : (rank + 1) * shard],
        )

    step()
    dist.barrier()
    cpu, start = _cpu(), time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss = loss.detach()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # the loss, to "rank 0" as a fetch would
    loss.item()
    elapsed = time.perf_counter() - start
    cpu = _cpu() - cpu
    weights = [p.detach().clone() for p in model.module.parameters()] if rank == 0 else None
    return rank, elapsed, cpu, weights


class DDP(GlooRanks):
    """4 long-lived gloo processes that train when told (so every round reuses them)."""

    def __init__(self) -> None:
        super().__init__(WORLD, _ddp_run)

    def train(self, hidden: int | str, batch_size: int, steps: int) -> dict:
        out = sorted(self.run(hidden, batch_size, steps))
        ranks = batch_size if hidden == "gpt2" else WORLD
        return {
            "seconds": max(r[1] for r in out),
            "cpu": {f"rank {r[0]}": r[2] for r in out[:ranks]},
            "weights": out[0][3],
        }


# -- dask_monarch ---------------------------------------------------------------------------


def _process_cpu() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


class Mesh:
    """A 4-rank LocalMeshCluster; each run makes a 2x2 mesh, trains on it and exits it."""

    def __init__(self) -> None:
        self.cluster = dm.LocalMeshCluster(n_ranks=WORLD, device="cpu")
        self.client = Client(self.cluster)
        self.names = {}  # worker address -> "rank i"

    def _cpu(self) -> dict[str, float]:
        workers = self.client.run(_process_cpu)
        if not self.names:
            self.names = {a: f"worker {i}" for i, a in enumerate(sorted(workers))}
        out = {"client": _cpu(), "scheduler": self.client.run_on_scheduler(_process_cpu)}
        out.update({self.names[a]: v for a, v in workers.items()})
        return out

    def run(self, hidden: int, batch_size: int, steps: int, compiled: bool) -> dict:
        mesh = dm.device_mesh(self.client, host=2, gpu=2)
        comms = dm.Stream("comms")
        n = mesh.size(DIMS)
        with mesh.activate():
            model = make_model(dm.random.manual_seed, hidden)
            optimizer = sgd(model, hidden)
            hooks = dm.ddp_hooks(model, DIMS, stream=comms)
            me = mesh.rank(DIMS).reshape(1)  # this rank's position along the data dims
            dm.random.manual_seed(1000)

            def step():
                x, y = batch(batch_size)
                x = x.view(n, batch_size // n, FEATURES).index_select(0, me).squeeze(0)
                y = y.view(n, batch_size // n, 1).index_select(0, me).squeeze(0)
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if compiled:
                    optimizer.zero_grad()  # .grad is internal to the recording
                return loss.detach()

            if compiled:
                step = dm.compile(step)
            trace = time.perf_counter()
            dm.inspect(step().reduce(DIMS, "avg"))
            trace = time.perf_counter() - trace
            controller = mesh._session.controller
            before = self._cpu()
            flushes, messages = controller.flushes, controller.messages_sent
            start = time.perf_counter()
            for _ in range(steps):
                loss = step()
            dm.inspect(loss.reduce(DIMS, "avg")).item()
            elapsed = time.perf_counter() - start
            after = self._cpu()
            flushes = (controller.flushes - flushes) / steps
            messages = (controller.messages_sent - messages) / steps
            weights = dm.inspect([p.detach() for p in model.parameters()])
            hooks.remove()
        mesh.exit()
        return {
            "seconds": elapsed,
            "cpu": {k: after[k] - before[k] for k in after},
            "weights": weights,
            "first": trace,
            "flushes": flushes,
            "messages": messages,
        }

    def run_gpt2(self, ranks: int, steps: int, compiled: bool) -> dict:
        workers = sorted(registered_workers(self.client))[:ranks]
        mesh = dm.device_mesh(self.client, workers=workers, dp=ranks)
        with mesh.activate():
            model = gpt2_model(dm.random.manual_seed)
            optimizer = adamw(model)
            hooks = dm.ddp_hooks(model, "dp", stream=dm.Stream("comms"))
            me = mesh.rank("dp").reshape(1)

            def step(ids):
                shard = ids.view(ranks, -1, GPT2_TOKENS).index_select(0, me).squeeze(0)
                loss = gpt2_loss(model, shard)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                return loss.detach()

            if compiled:
                step = dm.compile(step)
            trace = time.perf_counter()
            dm.inspect(step(gpt2_batch(0)).reduce("dp", "avg"))
            trace = time.perf_counter() - trace
            controller = mesh._session.controller
            before = self._cpu()
            flushes, messages = controller.flushes, controller.messages_sent
            start = time.perf_counter()
            for i in range(steps):
                loss = step(gpt2_batch(i + 1))  # drawn on the ranks, as each DDP rank does
            dm.inspect(loss.reduce("dp", "avg")).item()
            elapsed = time.perf_counter() - start
            after = self._cpu()
            weights = dm.inspect([p.detach() for p in model.parameters()])
            hooks.remove()
        mesh.exit()
        used = {"client", "scheduler", *(self.names.get(w, w) for w in workers)}
        return {
            "seconds": elapsed,
            "cpu": {k: after[k] - before[k] for k in after if k in used},
            "weights": weights,
            "first": trace,
            "flushes": (controller.flushes - flushes) / steps,
            "messages": (controller.messages_sent - messages) / steps,
        }

    def close(self) -> None:
        self.client.close()
        self.cluster.close()


# -- the run --------------------------------------------------------------------------------


def _config(text: str) -> tuple[int, int]:
    hidden, batch_size = text.lower().split("x")
    return int(hidden), int(batch_size)


def _compare(runs: list[dict], reference: list[dict], name: str, atol: float = 1e-5) -> str:
    """``= local (max |dw| 1e-06)``: every run's final weights against the reference's
    (allclose, rtol 1e-4, ``atol``: shards sum in another order than the full batch, and
    Adam's division by the gradient's scale makes such last bits grow)."""
    if not reference:
        return f"(no {name} run)"
    diff, same = 0.0, True
    for r in runs:
        for a, b in zip(r["weights"], reference[0]["weights"]):
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                return f"not finite (against {name})"
            diff = max(diff, (a - b).abs().max().item())
            same = same and torch.allclose(a, b, rtol=1e-4, atol=atol)
    return f"{'=' if same else 'DIFFER from'} {name} (max |dw| {diff:.1e})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default="32x64,1024x4096",
        help="comma-separated HIDDENxBATCH (default: both of issue 16: 32x64,1024x4096)",
    )
    parser.add_argument(
        "--gpt2",
        default="2,4",
        help="comma-separated rank counts of the GPT-2 runs ('' for none; at most 4)",
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (after one warm-up)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"subset of {','.join(PATHS)}")
    args = parser.parse_args()
    configs = [_config(c) for c in args.configs.split(",") if c]
    gpt2 = [int(n) for n in args.gpt2.split(",") if n]
    paths = args.paths.split(",")
    torch.set_num_threads(1)

    ddp = DDP() if "ddp" in paths else None
    mesh = Mesh() if {"mesh", "compiled"} & set(paths) else None
    runs: dict[tuple, list[dict]] = defaultdict(list)
    loads = []
    try:
        for round_ in range(args.repeat + 1):
            for hidden, batch_size in configs:
                for path in paths if round_ % 2 == 0 else paths[::-1]:  # no path always first
                    if path == "local":
                        r = run_local(hidden, batch_size, args.steps)
                    elif path == "ddp":
                        r = ddp.train(hidden, batch_size, args.steps)
                    else:
                        r = mesh.run(hidden, batch_size, args.steps, path == "compiled")
                    if round_ > 0:
                        runs[(hidden, batch_size, path)].append(r)
            for ranks in gpt2:
                for path in paths if round_ % 2 == 0 else paths[::-1]:
                    if path == "local":
                        r = run_local_gpt2(args.steps)
                    elif path == "ddp":
                        r = ddp.train("gpt2", ranks, args.steps)
                    else:
                        r = mesh.run_gpt2(ranks, args.steps, path == "compiled")
                    if round_ > 0:
                        runs[("gpt2", ranks, path)].append(r)
            loads.append(os.getloadavg()[0])
            print(f"round {round_} done, load average {loads[-1]:.2f}", flush=True)
    finally:
        if ddp is not None:
            ddp.close()
        if mesh is not None:
            mesh.close()

    print(
        f"\ndata-parallel MLP {FEATURES}-H-1 (SGD, {WORLD} ranks) and GPT-2; {args.steps} "
        f"steps then one loss fetch; median of {args.repeat} rounds (torch {torch.__version__}); "
        "load average "
        f"(1 min) over the rounds {min(loads[1:] or loads):.2f}-{max(loads):.2f}, "
        f"{os.cpu_count()} cores"
    )
    sections = [(f"16-{h}-1, batch {b}", (h, b), 1e-5) for h, b in configs]
    sections += [
        (f"GPT-2 (tiny), {n} ranks, batch {GPT2_BATCH}x{GPT2_TOKENS}, AdamW", ("gpt2", n), 1e-4)
        for n in gpt2
    ]
    for title, (hidden, batch_size), atol in sections:
        print(f"\n{title}")
        ddp_ms = None
        if runs[(hidden, batch_size, "ddp")]:
            ddp_ms = statistics.median(r["seconds"] for r in runs[(hidden, batch_size, "ddp")])
        print(f"  {'path':<10}{'ms/step':>9}{'x DDP':>7}  CPU ms/step per process; final weights")
        for path in paths:
            rs = runs[(hidden, batch_size, path)]
            seconds = statistics.median(r["seconds"] for r in rs)
            ratio = f"{seconds / ddp_ms:.2f}" if ddp_ms else "-"
            cpu = {
                k: statistics.median(r["cpu"][k] for r in rs) / args.steps * 1e3
                for k in rs[0]["cpu"]
            }
            cpu_text = ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
            cpu_text += f" (sum {sum(cpu.values()):.1f})"
            same = ""
            if path != "local":
                local_runs = runs[(hidden, batch_size, "local")]
                same = "; weights " + _compare(rs, local_runs, "local", atol)
                if path != "ddp":
                    same += ", " + _compare(rs, runs[(hidden, batch_size, "ddp")], "DDP", atol)
            first = ""
            if "first" in rs[0]:
                first = (
                    f"; first step {statistics.median(r['first'] for r in rs) * 1e3:.0f} ms; "
                    f"per step {statistics.median(r['flushes'] for r in rs):.2f} flushes, "
                    f"{statistics.median(r['messages'] for r in rs):.0f} messages"
                )
            print(
                f"  {path:<10}{seconds / args.steps * 1e3:>9.2f}{ratio:>7}  {cpu_text}{same}{first}"
            )


if __name__ == "__main__":
    main()
