"""Worker-resident objects: ``dm.OpaqueRef`` on a 2-rank mesh (docs/user_guide.md, OpaqueRef)."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(180)

bump = dm.remote("helpers.remote_fns.resident_bump", propagate=lambda obj, by=1.0: torch.empty(()))
fail = dm.remote("helpers.remote_fns.resident_fail", propagate=lambda obj: torch.empty(()))
alive = dm.remote("helpers.remote_fns.residents_alive", propagate="inspect")


def test_an_object_per_rank_keeps_its_state_between_calls(mesh2):
    with mesh2.activate():
        obj = dm.OpaqueRef("helpers.remote_fns.Resident", 1.0, rank=mesh2.rank("gpu"))
        first = bump(obj, 2.0)
        second = bump(obj, by=3.0)
        on0, on1 = dm.inspect((first, second), gpu=0), dm.inspect((first, second), gpu=1)
    assert [v.item() for v in on0] == [3.0, 6.0]
    assert [v.item() for v in on1] == [103.0, 106.0]
    assert obj.mesh is mesh2 and obj.stream is dm.get_active_stream()
    # a remote function with only an OpaqueRef argument runs on its mesh: no active mesh needed
    assert dm.inspect(bump(obj, 1.0), gpu=1).item() == 107.0
    assert "Resident" in repr(obj)


def test_the_object_is_deleted_on_the_ranks_when_the_handle_dies(mesh2):
    with mesh2.activate():
        before = alive.call_on_shard_and_fetch(shard={"gpu": 1})
        kept = dm.OpaqueRef("helpers.remote_fns.Resident", 0.0)
        dropped = dm.OpaqueRef("helpers.remote_fns.Resident", 0.0)
        collected = dm.OpaqueRef("helpers.remote_fns.Resident", 0.0)
        during = alive.call_on_shard_and_fetch(shard={"gpu": 1})
        dropped.drop()
        del collected
        gc.collect()
        with pytest.raises(TypeError, match="DROPPED"):
            bump(dropped)
        assert dm.inspect(bump(kept)).item() == 1.0  # deletes go out (batched) with a fetch
        after = alive.call_on_shard_and_fetch(shard={"gpu": 1})
    assert during == before + 3 and after == before + 1


def test_a_failing_factory_poisons_only_what_uses_the_object(mesh2):
    with mesh2.activate():
        broken = dm.OpaqueRef(
            "helpers.remote_fns.Resident", 0.0, rank=mesh2.rank("gpu"), fail_rank=1
        )
        used = bump(broken)
        independent = torch.ones(2) * 3
        with pytest.raises(dm.RemoteException, match="refused to start on rank 1") as info:
            dm.inspect(used, gpu=0)  # rank 0 built it, but the value depends on rank 1's failure
        assert info.value.rank == 1
        assert dm.inspect(independent, gpu=1).tolist() == [3.0, 3.0]
        # the workers live: a new object on the same ranks works
        fine = dm.OpaqueRef("helpers.remote_fns.Resident", 5.0)
        assert dm.inspect(bump(fine), gpu=1).item() == 6.0


def test_a_failing_use_poisons_its_results_not_the_object(mesh2):
    with mesh2.activate():
        obj = dm.OpaqueRef("helpers.remote_fns.Resident", 0.0)
        bad = fail(obj)
        with pytest.raises(dm.RemoteException, match="this use of a Resident at 0.0 failed"):
            dm.inspect(bad)
        assert dm.inspect(bump(obj, 2.0)).item() == 2.0


def test_objects_are_checked_on_the_client(mesh2):
    comms = dm.Stream("opaque_other")
    guess = dm.remote("helpers.remote_fns.resident_bump")  # propagate=None would run it on rank 0
    with mesh2.activate():
        obj = dm.OpaqueRef("helpers.remote_fns.Resident", 0.0)
        with pytest.raises(ValueError, match="propagate="):
            guess(obj)
        with comms.activate(), pytest.raises(TypeError, match="WRONG_STREAM"):
            bump(obj)
        with pytest.raises(TypeError, match="cannot be pickled"):
            dm.remote(lambda: obj, propagate="inspect")()
        with pytest.raises(TypeError, match="callable or an import path"):
            dm.OpaqueRef(3)


def test_an_object_made_from_a_closure_and_passed_in_a_container(mesh2):
    offset = 7.0

    def make(rank):
        return {"offset": offset + float(rank)}

    @dm.remote(propagate=lambda objs, x: x.clone())
    def shift(objs, x):
        return x + sum(o["offset"] for o in objs)

    with mesh2.activate():
        obj = dm.OpaqueRef(make, mesh2.rank("gpu"))
        x = torch.zeros(2)
        assert dm.inspect(shift([obj, obj], x), gpu=1).tolist() == [16.0, 16.0]


def test_an_object_given_parameters_warns_that_they_have_no_grad_there(mesh2):
    """An optimizer built on the ranks over mesh parameters stepped on nothing: the ranks'
    values have no .grad (gradients are the client's autograd's)."""
    with mesh2.activate():
        model = torch.nn.Linear(2, 1)
        with pytest.warns(UserWarning, match="require grad.*steps on nothing"):
            dm.OpaqueRef(torch.optim.SGD, list(model.parameters()), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dm.OpaqueRef("helpers.remote_fns.Resident", 1.0)
