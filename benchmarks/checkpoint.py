"""Checkpoints and lost ranks, measured next to their baselines (issue 39 item 6).

    python benchmarks/checkpoint.py [--ranks 2] [--mb 256] [--repeat 3] [--hidden 1024]

Three measurements on one ``LocalMeshCluster`` of ``--ranks`` CPU ranks, each
with its baseline in the same run:

* **save and load bandwidth**: ``dm.checkpoint.save`` and ``load`` of a
  replicated state of ``--mb`` MB (16 float32 tensors, equal on every rank)
  against ``torch.distributed.checkpoint.save`` and ``load`` of the same state
  by ``--ranks`` gloo processes that ``init_process_group`` as under torchrun,
  to the same file system, turn by turn, ``--repeat`` times. The figure is the
  checkpoint's size (each value is written once) over the wall time of the call
  (the load: until a fetch after it resolves). Medians; ratio = mesh time / DCP
  time.
* **async save cost**: data-parallel steps of an MLP (``--hidden``) with AdamW,
  timed step by step (each ends with a fetch of its loss), without saves and
  with ``dm.checkpoint.save(..., asynchronous=True)`` every 5th step; the
  median step, the steps that overlap a write, and the time the save call
  takes in the client.
* **kill to training**: rank 1's worker SIGKILLed in the middle of step 6 (it
  writes the time, then kills itself); the time until a step completes again,
  under ``dm.run_steps`` (replaced within the job, state from a replica) and
  under ``dm.elastic`` (what ``dask-monarch run --max-restarts`` runs: a new
  mesh, the latest checkpoint loaded, the steps since it run again).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import Client
from gloo_ranks import GlooRanks
from torch import nn

import dask_monarch as dm

TENSORS = 16


# -- the state ------------------------------------------------------------------------------------


def shapes(mb: int) -> list[tuple[int, int]]:
    rows = max(1, mb * 2**20 // 4 // TENSORS // 1024)
    return [(rows, 1024)] * TENSORS


def state_like(mb: int) -> dict[str, torch.Tensor]:
    """The state: the same on every rank (seeded), as a replicated model's would be."""
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(*s) for i, s in enumerate(shapes(mb))}


def nbytes(mb: int) -> int:
    return sum(r * c * 4 for r, c in shapes(mb))


# -- the baseline: plain DCP in a torchrun-style job ----------------------------------------------


def _dcp(rank: int, kind: str, mb: int, path: str) -> tuple[int, float]:
    """One rank of a plain DCP job: save or load the state, timed between barriers."""
    state = state_like(mb)
    dist.barrier()
    start = time.perf_counter()
    if kind == "save":
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.load(state, checkpoint_id=path)
    dist.barrier()
    return rank, time.perf_counter() - start


class PlainDCP(GlooRanks):
    """``world`` long-lived gloo processes that save or load when told."""

    def __init__(self, world: int, threads: int) -> None:
        super().__init__(world, _dcp, threads)

    def time(self, kind: str, mb: int, path: str) -> float:
        """The slowest rank's seconds to ``kind`` (save or load) ``mb`` MiB at ``path``."""
        return max(seconds for _, seconds in self.run(kind, mb, path))


# -- bandwidth ----------------------------------------------------------------------------------


def bandwidth(client: Client, ranks: int, mb: int, repeat: int, root: str) -> None:
    threads = max(1, (os.cpu_count() or 1) // ranks)  # as LocalMeshCluster gives each rank
    plain = PlainDCP(ranks, threads)
    mesh = dm.device_mesh(client, dp=ranks)
    times: dict[str, list[float]] = {
        k: [] for k in ("mesh save", "dcp save", "mesh load", "dcp load")
    }
    try:
        with mesh.activate():
            dm.random.manual_seed(0)
            state = {f"layer{i}.weight": torch.randn(*s) for i, s in enumerate(shapes(mb))}
            dm.inspect(state["layer0.weight"][0, 0])  # made on the ranks before any timing
        for turn in range(repeat + 1):  # the first turn warms up
            mesh_dir = os.path.join(root, f"mesh{turn}")
            dcp_dir = os.path.join(root, f"dcp{turn}")
            start = time.perf_counter()
            dm.checkpoint.save(state, mesh_dir)
            saved = time.perf_counter() - start
            plain_saved = plain.time("save", mb, dcp_dir)
            start = time.perf_counter()
            dm.checkpoint.load(state, mesh_dir)
            with mesh.activate():
                dm.inspect(state[f"layer{TENSORS - 1}.weight"][0, 0])  # every rank passed it
            loaded = time.perf_counter() - start
            plain_loaded = plain.time("load", mb, dcp_dir)
            if turn:
                times["mesh save"].append(saved)
                times["dcp save"].append(plain_saved)
                times["mesh load"].append(loaded)
                times["dcp load"].append(plain_loaded)
            shutil.rmtree(mesh_dir, ignore_errors=True)
            shutil.rmtree(dcp_dir, ignore_errors=True)
    finally:
        mesh.exit()
        plain.close()
    size = nbytes(mb)
    print(f"\n## save and load: {size / 2**20:.0f} MiB replicated on {ranks} ranks "
          f"(medians of {repeat})")  # fmt: skip
    print(f"{'':12s}{'seconds':>10s}{'GB/s':>8s}")
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"{name:12s}{seconds:10.3f}{size / seconds / 1e9:8.2f}")
    for what in ("save", "load"):
        ratio = statistics.median(times[f"mesh {what}"]) / statistics.median(times[f"dcp {what}"])
        print(f"{what} time ratio mesh / plain DCP: {ratio:.2f}")


# -- async save cost ----------------------------------------------------------------------------


def build(mesh: dm.DeviceMesh, hidden: int) -> dict:
    with mesh.activate():
        dm.random.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        me = mesh.rank("dp").reshape(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return {"mesh": mesh, "model": model, "optimizer": optimizer, "me": me}


def train_step(job: dict, i: int) -> float:
    mesh, model, optimizer = job["mesh"], job["model"], job["optimizer"]
    n = mesh.size()
    with mesh.activate():
        dm.random.manual_seed(1000 + i)
        x = torch.randn(n, 64, 256).index_select(0, job["me"]).squeeze(0)
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            p.grad.reduce_("dp", "avg")
        loss = loss.reduce("dp", "avg")
    optimizer.step()
    optimizer.zero_grad()
    return dm.inspect(loss).item()


def state_of(job: dict) -> dict:
    return {"model": job["model"].state_dict(), "optim": job["optimizer"].state_dict()}


def async_cost(client: Client, ranks: int, hidden: int, steps: int, root: str) -> None:
    mesh = dm.device_mesh(client, dp=ranks)
    job = build(mesh, hidden)
    alone, with_saves, during, calls = [], [], [], []
    try:
        for i in range(3):
            train_step(job, i)  # warm: the optimizer's state exists, the caches are filled
        pending = None
        for i in range(3, 3 + 2 * steps):
            saving = i >= 3 + steps  # the first half without saves, the second with
            start = time.perf_counter()
            if saving and i % 5 == 0:
                if pending is not None:
                    pending.result()
                call = time.perf_counter()
                pending = dm.checkpoint.save(state_of(job), root, asynchronous=True)
                calls.append(time.perf_counter() - call)
            writing = saving and pending is not None and not pending.done()
            train_step(job, i)
            took = time.perf_counter() - start
            if not saving:
                alone.append(took)
                continue
            with_saves.append(took)
            if writing:
                during.append(took)
        if pending is not None:
            pending.result()
    finally:
        mesh.exit()
    params = sum(p.numel() for p in job["model"].parameters())
    base = statistics.mean(alone)
    print(f"\n## async save cost: MLP 256-{hidden}-{hidden}, AdamW ({params * 12 / 2**20:.0f} MiB "
          f"of state), {ranks} ranks, a save every 5 steps")  # fmt: skip
    print(f"step without saves, mean (median)     : {base * 1e3:8.1f} ms "
          f"({statistics.median(alone) * 1e3:.1f}), {len(alone)} steps")  # fmt: skip
    print(f"step with saves, mean (median)        : {statistics.mean(with_saves) * 1e3:8.1f} ms "
          f"({statistics.median(with_saves) * 1e3:.1f}), {len(with_saves)} steps")  # fmt: skip
    if during:
        print(f"steps that began during a write, mean : {statistics.mean(during) * 1e3:8.1f} ms "
              f"({len(during)} steps)")  # fmt: skip
    print(f"cost per step (means)                 : "
          f"{(statistics.mean(with_saves) - base) / base * 100:8.1f} %")  # fmt: skip
    print(f"save call in the client, median       : {statistics.median(calls) * 1e3:8.1f} ms")


# -- kill to training ---------------------------------------------------------------------------

KILLED_AT = os.path.join(tempfile.gettempdir(), f"dm-bench-killed-{os.getpid()}")


def _die(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def kill_rank_1(mesh: dm.DeviceMesh) -> None:
    with mesh.slice(dp=1).activate():
        dm.remote(_die, propagate="inspect")(KILLED_AT)


def kill_to_training(client: Client, ranks: int, hidden: int, root: str) -> None:
    kill_step, steps = 6, 9
    done: dict[str, dict[int, float]] = {"run_steps": {}, "elastic": {}}

    def step(job, i):
        if i == kill_step and not step.killed:
            step.killed = True
            kill_rank_1(job["mesh"])
        train_step(job, i)
        done["run_steps"][i] = time.time()

    step.killed = False
    run = dm.run_steps(
        step,
        range(steps),
        mesh=lambda: dm.device_mesh(client, dp=ranks),
        setup=lambda mesh: build(mesh, hidden),
        state=state_of,
        load=lambda job, state: job["optimizer"].load_state_dict(state["optim"]),
    )
    run.mesh.exit()
    recovered = done["run_steps"][kill_step] - float(open(KILLED_AT).read())
    normal = statistics.median(
        b - a
        for a, b in zip(list(done["run_steps"].values())[:4], list(done["run_steps"].values())[1:5])
    )

    ckpt = os.path.join(root, "elastic")

    def train():
        first = os.environ["DASK_MONARCH_RESTART"] == "0"
        job = build(dm.device_mesh(client, dp=ranks), hidden)
        state = {**state_of(job), "step": -1}
        try:
            dm.checkpoint.load(state, ckpt)
            job["optimizer"].load_state_dict(state["optim"])
        except FileNotFoundError:
            pass
        for i in range(state["step"] + 1, steps):
            if first and i == kill_step:
                kill_rank_1(job["mesh"])
            train_step(job, i)
            done["elastic"].setdefault(i, time.time())  # the first time a step completes
            if not first:
                done["elastic"].setdefault("again", time.time())
            if i % 2 == 1:
                dm.checkpoint.save({**state_of(job), "step": i}, ckpt)
        job["mesh"].exit()

    dm.elastic(train, max_restarts=1, client=client)()
    restarted = done["elastic"]["again"] - float(open(KILLED_AT).read())
    os.remove(KILLED_AT)
    print(f"\n## kill to training: rank 1 SIGKILLed mid-step {kill_step}, {ranks} ranks")
    print(f"a step without faults              : {normal:8.2f} s")
    print(
        f"dm.run_steps (in-job recovery)     : {recovered:8.2f} s until step {kill_step} completes"
    )
    print(f"dm.elastic (--max-restarts)        : {restarted:8.2f} s until the first step after "
          "the restart completes")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dir", default=None, help="where to write [default: a temporary dir]")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="dm-checkpoint-bench-", dir=args.dir)
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, writing under {root}")
    try:
        with (
            dm.LocalMeshCluster(
                n_ranks=args.ranks, device="cpu", dashboard_address=None
            ) as cluster,
            Client(cluster) as client,
        ):
            bandwidth(client, args.ranks, args.mb, args.repeat, root)
            async_cost(client, args.ranks, args.hidden, args.steps, os.path.join(root, "async"))
            kill_to_training(client, args.ranks, args.hidden, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"\nload average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
