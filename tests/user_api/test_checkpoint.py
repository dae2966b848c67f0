"""dm.checkpoint: DCP checkpoints of mesh state, written by the ranks, torn writes harmless.

The optimizers step outside ``mesh.activate()``: their step counters are then
local tensors (plain values of the state), as torch makes them.
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)


def _train(mesh, model, optimizer, steps, start=0):
    for step in range(start, start + steps):
        with mesh.activate():
            dm.random.manual_seed(100 + step)
            x = torch.randn(8, 4)
            loss = model(x).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _model(mesh):
    with mesh.activate():
        dm.random.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, foreach=True)


def _weights(model):
    return [w.clone() for w in dm.inspect([p.detach() for p in model.parameters()])]


def test_model_and_adamw_round_trip_and_train_on_as_before(mesh2, tmp_path):
    model, optimizer = _model(mesh2)
    _train(mesh2, model, optimizer, 3)
    with mesh2.activate():
        rng = dm.random.get_state()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 3, "rng": rng}
    path = dm.checkpoint.save(state, tmp_path)
    assert path == str(tmp_path / "checkpoint-000001")
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-000001"
    _train(mesh2, model, optimizer, 2, start=3)  # the reference goes on
    expected = _weights(model)

    fresh, fresh_optimizer = _model(mesh2)
    _train(mesh2, fresh, fresh_optimizer, 1, start=50)  # other values everywhere
    with mesh2.activate():
        template = {
            "model": fresh.state_dict(),
            "optim": torch.optim.AdamW(fresh.parameters(), lr=0.05).state_dict(),
            "step": 0,
            "rng": dm.random.get_state(),
        }
    loaded = dm.checkpoint.load(template, tmp_path)
    assert loaded is template and loaded["step"] == 3
    fresh_optimizer.load_state_dict(loaded["optim"])  # entries the template lacked were added
    with mesh2.activate():
        dm.random.set_state(loaded["rng"])
    _train(mesh2, fresh, fresh_optimizer, 2, start=3)
    for got, want in zip(_weights(fresh), expected):
        assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist=True
def test_replicated_values_are_written_once_and_per_rank_ones_by_each_rank(mesh2, tmp_path):
    model, _ = _model(mesh2)
    with mesh2.activate():
        mine = mesh2.rank("gpu").float() * torch.ones(3)  # differs across the ranks
    path = dm.checkpoint.save({"model": model.state_dict(), "mine": mine, "lr": 0.1}, tmp_path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    keys = set(metadata.state_dict_metadata)
    assert {"model.0.weight", "mine@rank0", "mine@rank1", "lr"} <= keys
    assert "mine" not in keys
    writers = {}
    for index, info in metadata.storage_data.items():
        writers.setdefault(index.fqn, set()).add(info.relative_path)
    assert all(len(files) == 1 for files in writers.values()), writers
    files = {f for names in writers.values() for f in names}
    assert {"__0_0.distcp", "__1_0.distcp"} <= files  # both ranks wrote a share

    # the format is DCP's own: one process reads a replicated tensor with dcp.load
    plain = {"model.0.weight": torch.empty(8, 4), "mine@rank1": torch.empty(3)}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert torch.equal(plain["model.0.weight"], dm.inspect(model[0].weight.detach()))
    assert plain["mine@rank1"].tolist() == [1.0, 1.0, 1.0]

    with mesh2.activate():
        back = {"model": model.state_dict(), "mine": torch.zeros(3), "lr": 0.0}
    dm.checkpoint.load(back, tmp_path)
    assert dm.inspect(back["mine"], gpu=1).tolist() == [1.0, 1.0, 1.0]
    assert dm.inspect(back["mine"], gpu=0).tolist() == [0.0, 0.0, 0.0]
    assert back["lr"] == 0.1


@dm.remote(propagate=lambda t: torch.empty((), dtype=torch.float64))
def _now(t):
    return torch.tensor(time.time(), dtype=torch.float64)


def test_asynchronous_save_keeps_the_values_of_its_call_while_training_goes_on(mesh2, tmp_path):
    with mesh2.activate():
        big = torch.ones(2_000_000)  # a write that takes a while
        small = torch.zeros(4)
    future = dm.checkpoint.save({"big": big, "small": small}, tmp_path, asynchronous=True)
    with mesh2.activate():
        ran_at = _now(small)  # issued after the save, on the training stream
        small.add_(1)  # changes nothing that is being written
        big.mul_(3)
    ran_at = dm.inspect(ran_at).item()
    path = future.result(timeout=120)
    assert ran_at < os.path.getmtime(os.path.join(path, ".metadata"))  # ran before the commit
    with mesh2.activate():
        back = {"big": torch.zeros(2_000_000), "small": torch.ones(4)}
    dm.checkpoint.load(back, path)
    assert dm.inspect(back["small"]).tolist() == [0.0] * 4
    assert dm.inspect(back["big"][:3]).tolist() == [1.0] * 3
    assert dm.inspect(small).tolist() == [1.0] * 4


def test_a_torn_write_leaves_the_last_complete_checkpoint(mesh2, tmp_path):
    with mesh2.activate():
        x = torch.full((3,), 5.0)
    dm.checkpoint.save({"x": x}, tmp_path)
    torn = tmp_path / ".checkpoint-000002.tmp-deadbeef"  # what a save killed midway leaves
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half")
    with mesh2.activate():
        back = {"x": torch.zeros(3)}
    dm.checkpoint.load(back, tmp_path)
    assert dm.inspect(back["x"]).tolist() == [5.0] * 3
    path = dm.checkpoint.save({"x": x}, tmp_path)
    assert path.endswith("checkpoint-000002") and not torn.exists()


def test_two_meshes_saving_into_one_directory_at_once_both_complete(client4, tmp_path):
    """Two jobs saving into one directory at once (a notebook cell run again while the mesh of
    its first run still saves): each save gets a number of its own, and neither removes the
    other's temporary directory as a torn write's."""
    meshes = {4.0: dm.device_mesh(client4, gpu=2), 2.0: dm.device_mesh(client4, gpu=2)}
    saved = {}

    def saves(value):
        try:
            with meshes[value].activate():
                x = torch.full((50_000,), value)
            saved[value] = [dm.checkpoint.save({"x": x}, tmp_path) for _ in range(3)]
        except Exception as e:
            saved[value] = e

    try:
        threads = [threading.Thread(target=saves, args=(value,)) for value in meshes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        assert not any(isinstance(paths, Exception) for paths in saved.values()), saved
        assert len(set(saved[4.0]) | set(saved[2.0])) == 6
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        for value, mesh in meshes.items():
            for path in saved[value]:
                with mesh.activate():
                    back = {"x": torch.zeros(50_000)}
                dm.checkpoint.load(back, path)
                assert dm.inspect(back["x"][:2]).tolist() == [value] * 2
    finally:
        for mesh in meshes.values():
            mesh.exit()


def test_a_save_into_one_checkpoint_is_refused(mesh2, tmp_path):
    """load(state, path) takes a checkpoint's own directory too, and it wins over a
    ``latest`` there: a save nested inside one would be ignored by the load of that path."""
    with mesh2.activate():
        x = torch.full((2,), 1.0)
    first = dm.checkpoint.save({"x": x}, tmp_path)
    with pytest.raises(dm.RemoteException, match="is a checkpoint, not a directory of them"):
        dm.checkpoint.save({"x": x}, first)
    assert sorted(os.listdir(first)) == sorted(
        n for n in os.listdir(first) if n.endswith(".distcp") or n == ".metadata"
    )


def test_load_refuses_a_state_that_does_not_match_before_changing_anything(mesh2, tmp_path):
    with mesh2.activate():
        x = torch.ones(3)
        wrong = {"x": torch.zeros(4), "extra": torch.zeros(1)}
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        dm.checkpoint.load(wrong, tmp_path)
    dm.checkpoint.save({"x": x, "n": 1}, tmp_path)
    with pytest.raises(ValueError) as info:
        dm.checkpoint.load(wrong, tmp_path)
    text = str(info.value)
    assert "'x' was saved with shape [3]" in text and "['extra']" in text
    assert dm.inspect(wrong["x"]).tolist() == [0.0] * 4
    assert "n" not in wrong


def test_lists_tuples_and_empty_containers_load_back_as_they_were_saved(mesh2, tmp_path):
    with mesh2.activate():
        w = torch.ones(2)
    groups = [{"betas": (0.9, 0.99), "params": [0]}]
    saved = {
        "w": w,
        "history": [0.5, 0.25],
        "rng": (3, (1, 2), None),
        "optim": {"state": {}, "param_groups": groups},
        "extras": [[1, w]],
    }
    dm.checkpoint.save(saved, tmp_path)

    with mesh2.activate():
        clash = {"w": torch.zeros(2), "history": {}}  # a dict where a list was saved
    with pytest.raises(ValueError, match="'history' is a dict in the state, a list saved"):
        dm.checkpoint.load(clash, tmp_path)
    assert clash["history"] == {} and "rng" not in clash  # nothing changed

    with mesh2.activate():
        template = {"w": torch.zeros(2), "history": [0.0]}  # a shorter list, entries missing
    loaded = dm.checkpoint.load(template, tmp_path)
    assert loaded["history"] == [0.5, 0.25]
    assert loaded["rng"] == (3, (1, 2), None)
    assert loaded["optim"] == {"state": {}, "param_groups": groups}
    assert type(loaded["extras"]) is list and loaded["extras"][0][0] == 1
    assert dm.inspect(loaded["extras"][0][1]).tolist() == [1.0, 1.0]


def test_a_load_changes_no_list_it_was_given(mesh2, tmp_path):
    """A scheduler's state_dict() shares its lists (_last_lr) with the scheduler: a load
    wrote the saved values into them, changing the live scheduler (and any state dict taken
    before) ahead of load_state_dict, as torch never does."""
    with mesh2.activate():
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        dm.checkpoint.save({"sched": sched.state_dict()}, tmp_path)
        for _ in range(2):
            opt.step()
            sched.step()
        kept = sched.state_dict()
        loaded = dm.checkpoint.load({"sched": sched.state_dict()}, tmp_path)
        assert kept["_last_lr"] == [0.025] and sched.get_last_lr() == [0.025]
        assert loaded["sched"]["_last_lr"] == [0.1]
        sched.load_state_dict(loaded["sched"])
        assert sched.get_last_lr() == [0.1]


def test_a_checkpoint_of_four_ranks_loads_onto_two(mesh, mesh2, tmp_path):
    model, _ = _model(mesh)
    with mesh.activate():
        mine = mesh.rank(("host", "gpu")).float().reshape(1)
    dm.checkpoint.save({"model": model.state_dict(), "mine": mine}, tmp_path)
    expected = _weights(model)

    small, _ = _model(mesh2)
    with torch.no_grad(), mesh2.activate():
        for p in small.parameters():
            p.zero_()
    with mesh2.activate():
        mismatched = {"model": small.state_dict(), "mine": torch.zeros(1)}
    with pytest.raises(ValueError, match="'mine' differed across the 4 ranks"):
        dm.checkpoint.load(mismatched, tmp_path)
    assert all(not w.any() for w in _weights(small))  # nothing loaded
    with pytest.warns(RuntimeWarning, match=r"entries \['mine'\] differed across them"):
        loaded = dm.checkpoint.load({"model": small.state_dict()}, tmp_path)
    assert "mine" not in loaded
    for got, want in zip(_weights(small), expected):
        assert torch.equal(got, want)
    for gpu in (0, 1):
        got = dm.inspect([p.detach() for p in small.parameters()], gpu=gpu)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_training_example_resumes_from_its_checkpoint(mesh, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    import train_mlp

    train_mlp.train_on_mesh(mesh, steps=4, checkpoint_dir=str(tmp_path), save_every=2)
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-000002"
    losses, weights = train_mlp.train_on_mesh(
        mesh, steps=7, fetch_every=1, checkpoint_dir=str(tmp_path), resume=True
    )
    assert [s for s, _ in losses] == [4, 5, 6]  # resumed after step 3
    local_losses, local_weights = train_mlp.train_locally(steps=7, fetch_every=1)
    for (_, a), (_, b) in zip(losses, local_losses[4:]):
        assert abs(a - b) < 1e-5
    for a, b in zip(weights, local_weights):
        assert torch.allclose(a, b, atol=1e-5)


def _keep(n):
    import dask

    dask.config.set({"dask_monarch.checkpoint.keep": n})


def test_checkpoint_keep_removes_the_oldest_complete_ones(mesh2, client2, tmp_path):
    client2.run(_keep, 2)  # read on the ranks
    try:
        with mesh2.activate():
            x = torch.ones(2)
        for _ in range(4):
            dm.checkpoint.save({"x": x}, tmp_path)
    finally:
        client2.run(_keep, None)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["checkpoint-000003", "checkpoint-000004", "latest"]


def test_a_load_into_values_the_client_knows_reads_the_loaded_ones(mesh2, tmp_path):
    """``torch.zeros(3)`` and a step count made on the client are mirrored there
    (client_values); a load changes them on the ranks, so the client forgets its copies
    and Python reads what was loaded (the load's propagation marks every target changed)."""
    with mesh2.activate():
        dm.checkpoint.save({"v": torch.full((3,), 5.0), "step": torch.tensor(7.0)}, tmp_path)
        back = {"v": torch.zeros(3), "step": torch.tensor(0.0)}
        dm.checkpoint.load(back, tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dm.ImplicitFetchWarning)
            assert back["v"].tolist() == [5.0, 5.0, 5.0]
            assert back["step"].item() == 7.0
