"""Data-parallel training of a small MLP on every rank of a cluster, checked against one process.

    dask-monarch run --ranks 4 examples/train_mlp.py --steps 10   # embedded cluster, 4 ranks
    dask-monarch run examples/train_mlp.py                        # 2 CPU ranks (or a GPU each)
    dask-monarch run --scheduler-file sched.json examples/train_mlp.py   # an existing cluster
    python examples/train_mlp.py                                  # 4 ranks, started here
    dask-monarch run --ranks 4 --max-restarts 3 examples/train_mlp.py \
        --checkpoint-dir ckpt --resume                            # survives a lost rank

Every worker of the cluster becomes a rank of a ``host x gpu`` mesh (2x2 for
4 ranks, 1x2 for 2). Every rank builds the same model (same seed) and draws
the same full batch, then trains on its own share of it. Gradients are averaged over both mesh
dims on a separate "comms" stream: each gradient is borrowed mutably by that
stream, reduced in place there, and given back. The loss, averaged over the
mesh, is fetched every few steps. The same training in one local process on
the full batch must give the same losses and weights.

With ``--checkpoint-dir DIR`` the model and optimizer state are saved to DIR
every ``--save-every`` steps (``dm.checkpoint.save``, asynchronously: the
write overlaps the next steps); with ``--resume`` a run starts from the
latest checkpoint there. Each step's data depend only on the step number, so
a run resumed after a lost rank (``--max-restarts``) ends with the weights of
one that lost nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import dask_monarch as dm

DIMS = ("host", "gpu")


def make_model(seed, features: int, hidden: int) -> nn.Module:
    seed(0)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def batch(seed, step: int, batch_size: int, features: int):
    """The full batch of a step: the same on every rank and locally (seeded by the step)."""
    seed(1000 + step)
    x = torch.randn(batch_size, features)
    y = (x @ torch.linspace(-1, 1, features)).tanh().unsqueeze(1)  # a target the MLP can learn
    return x, y


def train_on_mesh(
    mesh: dm.DeviceMesh,
    steps: int = 30,
    batch_size: int = 64,
    features: int = 16,
    hidden: int = 32,
    lr: float = 0.2,
    fetch_every: int = 5,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    save_every: int = 10,
):
    """Train data-parallel on ``mesh``; returns (step, mean loss) pairs and the final weights.

    ``checkpoint_dir``: save a checkpoint there every ``save_every`` steps (and
    after the last); ``resume``: start from its latest checkpoint, if any.
    """
    n = mesh.size(DIMS)
    comms = dm.Stream("comms")  # once: a stream is a lane (a thread) on every rank
    losses = []
    with mesh.activate():
        seed = dm.random.manual_seed  # seeds every rank of the mesh
        model = make_model(seed, features, hidden)  # same seed on every rank: same model
        # foreach: each op of the update is one message for all parameters (user guide)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, foreach=True)
        me = mesh.rank(DIMS).reshape(1)  # this rank's position along the data-parallel dims
        start = resume_from(checkpoint_dir, model, optimizer) if resume else 0
        saving = None
        for step in range(start, steps):
            x, y = batch(seed, step, batch_size, features)
            x = x.view(n, batch_size // n, features).index_select(0, me).squeeze(0)  # my shard
            y = y.view(n, batch_size // n, 1).index_select(0, me).squeeze(0)
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            borrows = [comms.borrow(p.grad, mutable=True) for p in model.parameters()]
            with comms.activate():
                for grad, _ in borrows:
                    grad.reduce_(DIMS, "avg")
            for _, borrow in borrows:
                borrow.drop()
            optimizer.step()
            if step % fetch_every == 0 or step == steps - 1:
                losses.append((step, dm.inspect(loss.reduce(DIMS, "avg")).item()))
            if checkpoint_dir and (step % save_every == save_every - 1 or step == steps - 1):
                if saving is not None:
                    saving.result()  # one write at a time: the previous one is done by now
                state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
                saving = dm.checkpoint.save(state, checkpoint_dir, asynchronous=True)
        if saving is not None:
            print(f"  saved {saving.result()}")
        weights = dm.inspect([p.detach() for p in model.parameters()])
    return losses, weights


def resume_from(checkpoint_dir: str | None, model: nn.Module, optimizer) -> int:
    """Load the latest checkpoint in ``checkpoint_dir`` into the model and the optimizer;
    returns the step to go on from (0 without a checkpoint)."""
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": -1}
    try:
        dm.checkpoint.load(state, checkpoint_dir)  # the model's tensors are filled in place
    except FileNotFoundError:
        return 0
    optimizer.load_state_dict(state["optim"])
    print(f"  resumed after step {state['step']} from {checkpoint_dir}")
    return state["step"] + 1


def train_locally(
    steps: int = 30,
    batch_size: int = 64,
    features: int = 16,
    hidden: int = 32,
    lr: float = 0.2,
    fetch_every: int = 5,
):
    """The same training in this process, on the full batch."""
    model = make_model(torch.manual_seed, features, hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(torch.manual_seed, step, batch_size, features)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % fetch_every == 0 or step == steps - 1:
            losses.append((step, loss.item()))
    return losses, [p.detach() for p in model.parameters()]


def mesh_dims(ranks: int) -> dict[str, int]:
    """``host x gpu`` sizes for ``ranks`` ranks: two "hosts" when they split evenly."""
    return (
        {"host": 2, "gpu": ranks // 2}
        if ranks >= 4 and ranks % 2 == 0
        else {"host": 1, "gpu": ranks}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checkpoint-dir", help="save a checkpoint here every --save-every steps")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument(
        "--resume", action="store_true", help="start from the latest checkpoint in --checkpoint-dir"
    )
    args = parser.parse_args()
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    import distributed

    try:
        client = distributed.default_client()
        cluster = None
    except ValueError:  # not run by dask-monarch: start an embedded cluster
        cluster = dm.LocalMeshCluster(n_ranks=4, device="auto")
        client = distributed.Client(cluster)
    try:
        ranks = len(client.nthreads())  # every worker of the cluster
        mesh = dm.device_mesh(client, **mesh_dims(ranks))
        batch_size = max(ranks, 64 - 64 % ranks)  # an equal share per rank
        print(f"training on {mesh} ({mesh.size()} ranks: {mesh.ranks})")
        start = time.perf_counter()
        losses, weights = train_on_mesh(
            mesh,
            steps=args.steps,
            batch_size=batch_size,
            checkpoint_dir=args.checkpoint_dir,
            resume=args.resume,
            save_every=args.save_every,
        )
        elapsed = time.perf_counter() - start
        mesh.exit()
        for step, loss in losses:
            print(f"  step {step:3d}  loss {loss:.5f}")
        local_losses, local_weights = train_locally(steps=args.steps, batch_size=batch_size)
        same = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(weights, local_weights))
        local = dict(local_losses)  # a resumed run fetched the losses of its own steps only
        close = all(abs(loss - local[step]) < 1e-4 for step, loss in losses)
        print(
            f"{args.steps} steps in {elapsed:.2f}s; matches single-process training: "
            f"losses {close}, weights {same}"
        )
        if not (same and close):
            raise SystemExit("the mesh and the local run disagree")
    finally:
        if cluster is not None:
            client.close()
            cluster.close()


if __name__ == "__main__":
    main()
