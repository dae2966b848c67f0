"""The hardened mode (docs/security.md) runs real programs end to end (issue 35 item 3).

The ranks here accept no pickled code (``dask_monarch.functions.allow-pickled:
false``) and call only ``torch`` and this suite's ``helpers.remote_fns`` by path: every
message and wire step the user API sends must be plain data to the restricted
unpickler, and the paths dask_monarch sends for itself must need no allow-list
entry. The programs are the notebooks' kinds: collectives, remote functions
with and without ``propagate``, borrows, streams dropped, pipes, recordings,
worker-resident objects, sends between meshes, generators.
"""

from __future__ import annotations

import dask
import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)

HARDENED = {
    "dask_monarch.functions.allow": ["torch", "helpers.remote_fns"],
    "dask_monarch.functions.allow-pickled": False,
}


@pytest.fixture(scope="module")
def hardened_client(throwaway_cluster):
    with throwaway_cluster(2, config=HARDENED) as (_, client):  # the nannies hand it on
        yield client


@pytest.fixture
def hmesh(hardened_client):
    mesh = dm.device_mesh(hardened_client, gpu=2)
    yield mesh
    mesh.exit()


def test_the_workers_accept_no_pickled_code(hardened_client):
    def setting():
        return dask.config.get("dask_monarch.functions.allow-pickled")

    assert set(hardened_client.run(setting).values()) == {False}


def test_ops_collectives_and_fetches(hmesh):
    with hmesh.activate():
        x = torch.arange(4.0) + hmesh.rank("gpu")
        assert dm.inspect(x.reduce("gpu", "sum"), gpu=1).tolist() == [1.0, 3.0, 5.0, 7.0]
        assert dm.inspect(x.reduce("gpu", "avg")).tolist() == [0.5, 1.5, 2.5, 3.5]
        assert dm.inspect(x.reduce("gpu", "stack")).shape == (2, 4)
        y = x.clone()
        y.reduce_("gpu", "max")
        assert dm.inspect(y, gpu=0).tolist() == [1.0, 2.0, 3.0, 4.0]


def test_remote_functions_with_and_without_propagate(hmesh):
    with hmesh.activate():
        x = torch.ones(3)
        declared = dm.remote("helpers.remote_fns.scaled", propagate=lambda x, by: x)
        assert dm.inspect(declared(x, 2)).tolist() == [2.0] * 3
        learned = dm.remote("helpers.remote_fns.scaled")  # propagation run on a rank
        assert dm.inspect(learned(x, 3)).tolist() == [3.0] * 3
        inspected = dm.remote("helpers.remote_fns.number", propagate="inspect")
        assert inspected.call_on_shard_and_fetch(x) == 30
        failing = dm.remote("helpers.remote_fns.boom", propagate=lambda x: x)
        with pytest.raises(dm.RemoteException, match="boom from a remote function"):
            dm.inspect(failing(x))
        assert dm.inspect(x + 1).tolist() == [2.0] * 3


def test_borrows_on_a_second_stream_that_is_then_dropped(hmesh):
    comms = dm.Stream("comms")
    with hmesh.activate():
        grad = torch.ones(4) * (hmesh.rank("gpu") + 1)
        lent, borrow = comms.borrow(grad, mutable=True)
        with comms.activate():
            lent.reduce_("gpu", "avg")
        borrow.drop()
        assert dm.inspect(grad, gpu=1).tolist() == [1.5] * 4
        seen, borrow = comms.borrow(grad)
        with comms.activate():
            doubled = seen * 2
        borrow.drop()
        with comms.activate():
            assert dm.inspect(doubled).tolist() == [3.0] * 4
    del comms, doubled, seen, lent  # the stream's lane goes (DropLane)
    import gc

    gc.collect()
    with hmesh.activate():
        assert dm.inspect(grad.sum()).item() == 6.0


def test_pipes(hmesh):
    with hmesh.activate():
        pipe = dm.create_pipe("helpers.remote_fns.loader", 3)
        batches = [pipe.recv() for _ in range(3)]
        assert [dm.inspect(b[0]).tolist() for b in batches] == [[0.0] * 2, [1.0] * 2, [2.0] * 2]


def test_recordings(hmesh):
    @dm.compile
    def step(w, x):
        return (w * x).sum() + 1

    with hmesh.activate():
        w, x = torch.ones(3), torch.arange(3.0)
        results = [dm.inspect(step(w, x)).item() for _ in range(4)]
        assert results == [4.0] * 4


def test_resident_objects_sends_between_meshes_and_generators(hmesh):
    add = dm.remote("helpers.remote_fns.add_to_total", propagate=lambda obj, x: torch.empty(()))
    with hmesh.activate():
        total = dm.OpaqueRef("helpers.remote_fns.running_total", 10)
        assert dm.inspect(add(total, torch.ones(2))).item() == 12.0
        total.drop()
        dm.random.manual_seed(0)
        drawn = dm.inspect(torch.rand(3), gpu=1)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(0)))
    first, second = hmesh.slice(gpu=0), hmesh.slice(gpu=1)
    with first.activate():
        v = torch.full((2,), 7.0)
    moved = v.to_mesh(second)
    with second.activate():
        assert dm.inspect(moved + 1).tolist() == [8.0, 8.0]


def test_a_training_step_with_ddp_hooks_and_the_debugger(hmesh):
    from torch import nn

    with hmesh.activate():
        dm.random.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        hooks = dm.ddp_hooks(model, "gpu")
        x = torch.ones(8, 4) * (hmesh.rank("gpu") + 1)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        hooks.remove()
        weights = [dm.inspect(model.weight, gpu=g) for g in range(2)]
        assert torch.equal(weights[0], weights[1])  # the gradients were averaged
        dm.breakpoint(x)  # every rank stops in pdb, by path
        for rank in hmesh.ranks:
            dm.debug.attach(rank, ["p values[0].shape", "c"], echo=False)
        assert dm.inspect(x.sum(), gpu=1).item() == 64.0


def test_checkpoints_and_run_steps(hmesh, hardened_client, tmp_path):
    with hmesh.activate():
        x = torch.arange(4.0)
        mine = hmesh.rank("gpu").float().reshape(1)
    dm.checkpoint.save({"x": x, "mine": mine, "n": 3}, tmp_path)
    future = dm.checkpoint.save({"x": x, "mine": mine, "n": 4}, tmp_path, asynchronous=True)
    future.result()
    with hmesh.activate():
        back = {"x": torch.zeros(4), "mine": torch.zeros(1), "n": 0}
    dm.checkpoint.load(back, tmp_path)
    assert back["n"] == 4 and dm.inspect(back["mine"], gpu=1).tolist() == [1.0]

    def setup(mesh):
        with mesh.activate():
            dm.random.manual_seed(0)  # generators alike: they are part of the snapshots
            return {"mesh": mesh, "w": torch.zeros(2)}

    def step(job, i):
        with job["mesh"].activate():
            job["w"].add_(i)

    run = dm.run_steps(
        step,
        3,
        mesh=lambda: dm.device_mesh(hardened_client, gpu=2),
        setup=setup,
        state=lambda job: {"w": job["w"]},
    )
    assert dm.inspect(run.job["w"]).tolist() == [3.0, 3.0]
    run.mesh.exit()
