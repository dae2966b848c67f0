"""A data-parallel training job that loses a rank and finishes all the same (issue 39 item 4).

    dask-monarch run --ranks 2 --max-restarts 2 long_job.py OUT --checkpoint-dir D [--kill-at K]
    dask-monarch run --ranks 2 long_job.py OUT --recover [--kill-at K]

The kill tests run it (tests/deployment/test_long_jobs.py, tests/multihost/).
A small MLP trains on a mesh ``dp=2``; the data of step ``s`` is drawn from
seed ``1000 + s`` and each rank takes its half, so a step gives the same
result whenever it runs. ``--kill-at K`` SIGKILLs rank 1's worker in the
first run: in the middle of step K (after its forward and backward, before
the gradients are averaged), or with ``--kill-in checkpoint`` in the middle
of the save after step K (it waits for the save's temporary directory).
``--cut-at K`` instead writes ``cut <rank 1's worker>`` into the file
``--signal`` at the start of step K and waits (60 s at most) for the test to cut
that worker's host off the network and write ``done``.

Under ``--max-restarts`` the job saves a checkpoint every ``--save-every``
steps and resumes from the latest one; with ``--recover`` it runs its steps
with ``dm.run_steps``, which replaces a lost rank and runs the step again.
At the end it saves the final weights, the losses and the number of runs to
OUT (``torch.save``).
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import time

import torch
from torch import nn

import dask_monarch as dm

FEATURES = 8


def build(mesh: dm.DeviceMesh) -> dict:
    with mesh.activate():
        dm.random.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        me = mesh.rank("dp").reshape(1)
    # the optimizer steps outside mesh.activate(): its step counters are local tensors
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)
    return {"mesh": mesh, "model": model, "optimizer": optimizer, "me": me}


def train_step(job: dict, step: int, kill: bool = False) -> dm.Tensor:
    mesh, model, optimizer = job["mesh"], job["model"], job["optimizer"]
    with mesh.activate():
        dm.random.manual_seed(1000 + step)
        x = torch.randn(2, 4, FEATURES)  # both ranks' halves; each takes its own
        y = x.sum(-1, keepdim=True).tanh()
        x, y = x.index_select(0, job["me"]).squeeze(0), y.index_select(0, job["me"]).squeeze(0)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if kill:
            kill_rank_1(mesh)
        for p in model.parameters():
            p.grad.reduce_("dp", "avg")
        loss = loss.reduce("dp", "avg")
    optimizer.step()
    optimizer.zero_grad()
    return loss


def state_of(job: dict, step: int) -> dict:
    return {
        "model": job["model"].state_dict(),
        "optim": job["optimizer"].state_dict(),
        "step": step,
    }


# -- the faults ---------------------------------------------------------------------------------


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_in_save(root: str) -> None:
    """Wait for a save to be under way (its temporary directory exists), then die in it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        torn = glob.glob(os.path.join(root, ".checkpoint-*.tmp-*"))
        if torn:
            with open(os.path.join(root, "killed-in"), "w") as f:
                f.write(os.path.basename(torn[0]))
            _die()
        time.sleep(0.0005)


def kill_rank_1(mesh: dm.DeviceMesh) -> None:
    with mesh.slice(dp=1).activate():
        dm.remote(_die, propagate="inspect")()


def kill_rank_1_in_the_next_save(mesh: dm.DeviceMesh, root: str) -> None:
    with mesh.slice(dp=1).activate(), dm.Stream("killer").activate():
        dm.remote(_die_in_save, propagate="inspect")(root)


def wait_for_the_cut(signal_file: str, mesh: dm.DeviceMesh) -> None:
    """Ask the test to cut rank 1's host off the network (naming its worker); wait for it."""
    with open(signal_file, "w") as f:
        f.write(f"cut {mesh._session.controller.workers[1]}")
    deadline = time.monotonic() + 60
    while open(signal_file).read() != "done" and time.monotonic() < deadline:
        time.sleep(0.05)


# -- the two ways to survive ----------------------------------------------------------------------


def with_restarts(args: argparse.Namespace) -> tuple[dict, dict]:
    """Checkpoint every few steps; resume from the latest (a restart runs this again)."""
    first_run = os.environ.get("DASK_MONARCH_RESTART", "0") == "0"
    job = build(dm.device_mesh(dp=2))
    state = state_of(job, -1)
    try:
        dm.checkpoint.load(state, args.checkpoint_dir)
        job["optimizer"].load_state_dict(state["optim"])
    except FileNotFoundError:
        pass
    losses, saving = {}, None
    for step in range(state["step"] + 1, args.steps):
        kill = first_run and step == args.kill_at
        if kill and args.kill_in == "checkpoint":
            if saving is not None:  # the killer must meet the next save, not this one
                saving.result()
                saving = None
            kill_rank_1_in_the_next_save(job["mesh"], args.checkpoint_dir)
            kill = False
        if first_run and step == args.cut_at:
            wait_for_the_cut(args.signal, job["mesh"])
        loss = train_step(job, step, kill=kill and args.kill_in == "step")
        losses[step] = dm.inspect(loss).item()
        if step % args.save_every == args.save_every - 1:
            if saving is not None:
                saving.result()
            saving = dm.checkpoint.save(state_of(job, step), args.checkpoint_dir, asynchronous=True)
    if saving is not None:
        saving.result()
    return job, losses


def with_recovery(args: argparse.Namespace) -> tuple[dict, dict]:
    """Run the steps with dm.run_steps: a lost rank is replaced and its step runs again."""
    losses = {}

    def step(job: dict, i: int) -> None:
        kill = i == args.kill_at and not step.killed
        if i == args.cut_at and not step.killed:
            step.killed = True
            wait_for_the_cut(args.signal, job["mesh"])
        step.killed = step.killed or kill
        losses[i] = dm.inspect(train_step(job, i, kill=kill)).item()

    step.killed = False
    run = dm.run_steps(
        step,
        range(args.steps),
        mesh=lambda: dm.device_mesh(dp=2),
        setup=build,
        state=lambda job: {
            "model": job["model"].state_dict(),
            "optim": job["optimizer"].state_dict(),
        },
        load=lambda job, state: job["optimizer"].load_state_dict(state["optim"]),
    )
    return run.job, losses | {"recoveries": len(run.recoveries)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-in", choices=["step", "checkpoint"], default="step")
    parser.add_argument("--cut-at", type=int, default=None)
    parser.add_argument("--signal")
    parser.add_argument("--recover", action="store_true")
    args = parser.parse_args()
    job, losses = with_recovery(args) if args.recover else with_restarts(args)
    weights = dm.inspect([p.detach() for p in job["model"].parameters()])
    torch.save(
        {
            "weights": weights,
            "losses": losses,
            "run": int(os.environ.get("DASK_MONARCH_RESTART", "0")),
        },
        args.out,
    )
    job["mesh"].exit()


if __name__ == "__main__":
    main()
