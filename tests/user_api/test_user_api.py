"""The user API through dask_monarch's public names: meshes, tensors, remote functions, errors."""

from __future__ import annotations

import contextlib
import gc

import dask
import pytest
import torch

import dask_monarch as dm

# -------------------------------------------------------------------------------- meshes


def test_mesh_shape_and_views(mesh):
    assert mesh.dims == ("host", "gpu")
    assert mesh.sizes == {"host": 2, "gpu": 2}
    assert mesh.size() == 4 and mesh.size("gpu") == 2 and mesh.size(["host", "gpu"]) == 4
    assert mesh.ranks == [0, 1, 2, 3]
    assert mesh.rename(gpu="tp").dims == ("host", "tp")
    host1 = mesh.slice(host=1)
    assert host1.dims == ("gpu",) and host1.ranks == [2, 3]
    column = mesh.slice(gpu=1)
    assert column.ranks == [1, 3]
    assert mesh.slice(host=slice(0, 2), gpu=slice(1, 2)).sizes == {"host": 2, "gpu": 1}
    flat = mesh.flatten("all")
    assert flat.dims == ("all",) and flat.ranks == [0, 1, 2, 3]
    split = flat.split(all=("dp", "pp"), pp=2)
    assert split.sizes == {"dp": 2, "pp": 2} and split.ranks == [0, 1, 2, 3]
    assert mesh.slice(host=0)._is_subset_of(mesh)
    assert "host" in mesh.to_table() and "<table>" in mesh._repr_html_()
    assert repr(mesh) == "DeviceMesh(host=2, gpu=2)"


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda m: m.flatten("all").split(all=("a", "b", "c")), ValueError, "Cannot infer size"),
        (
            lambda m: m.flatten("all").split(all=("a", "b"), c=2),
            ValueError,
            "unused size constraints",
        ),
        (lambda m: m.rename(gpu="host"), ValueError, "Duplicate dimension name"),
        (lambda m: m.flatten("all").split(all=("a", "b"), a=3), ValueError, "evenly divided"),
        (
            lambda m: m._view(("a", "b"), dm.ndslice.Slice(0, [2, 2], [1, 2])).flatten("c"),
            ValueError,
            "cannot flatten sparse mesh",
        ),
        (lambda m: m.slice(rack=0), KeyError, "rack"),
        (lambda m: m.size("rack"), KeyError, "rack"),
    ],
)
def test_mesh_validation(mesh, make, error, text):
    with pytest.raises(error, match=text):
        make(mesh)


def test_too_few_workers_speaks_of_the_mesh_and_its_ranks(client2):
    with pytest.raises(ValueError, match="a mesh of 4 ranks needs 4 workers") as info:
        dm.device_mesh(client2, host=2, gpu=2)
    text = str(info.value)
    assert "world_size" not in text and "Controller" not in text, text
    assert "dask-monarch run --ranks 4" in text and "fewer ranks" in text, text


def test_two_meshes_on_one_client_are_isolated(client2):
    a, b = dm.device_mesh(client2, gpu=2), dm.device_mesh(client2, gpu=2)
    try:
        with a.activate():
            x = torch.full((2,), 1.0)
        with b.activate():
            y = torch.full((2,), 2.0)
        assert x._ref == y._ref  # the same ids, different controllers
        assert dm.inspect(x).tolist() == [1.0, 1.0] and dm.inspect(y).tolist() == [2.0, 2.0]
    finally:
        a.exit()
        b.exit()


def test_mesh_rank_coordinates(mesh):
    for host in range(2):
        for gpu in range(2):
            assert dm.inspect(mesh.rank("gpu"), host=host, gpu=gpu).item() == gpu
            assert (
                dm.inspect(mesh.rank(("host", "gpu")), host=host, gpu=gpu).item() == 2 * host + gpu
            )


# -------------------------------------------------------------------------------- tensors


def test_ops_run_on_every_rank_with_client_side_shapes(mesh):
    with mesh.activate():
        dm.random.manual_seed(0)
        x = torch.rand(3, 4)
        y = (x @ x.T).relu()
        assert isinstance(y, dm.Tensor) and y.shape == (3, 3) and y.dtype == torch.float32
        assert y.mesh is mesh and y.stream is dm.get_active_stream()
        z = y.to(torch.float64)[0]
        assert z.shape == (3,) and z.dtype == torch.float64
        parts = torch.split(x, 2, dim=1)
        assert [p.shape for p in parts] == [(3, 2), (3, 2)]
        values, indices = x.max(dim=1)
        assert values.shape == (3,) and indices.dtype == torch.int64
        with pytest.raises(RuntimeError, match="must have same reduction dim|size mismatch"):
            x @ x  # refused on the client: nothing is sent
        local_x = dm.inspect(x)
        got = [dm.inspect(y, host=host, gpu=1) for host in range(2)]
    expected = (local_x @ local_x.T).relu()
    for value in got:  # the same seed on every rank: the same values
        assert torch.allclose(value, expected)
    assert isinstance(local_x, torch.Tensor) and not isinstance(local_x, dm.Tensor)
    assert local_x.device.type == "cpu"


def test_views_and_in_place_ops_share_storage(mesh2):
    with mesh2.activate():
        x = torch.zeros(2, 3)
        row = x[1]
        row.add_(5)  # through a view
        x.mul_(2)
        assert row._storage is x._storage
        got_x, got_row = dm.inspect((x, row))
    assert got_x.tolist() == [[0, 0, 0], [10, 10, 10]] and got_row.tolist() == [10, 10, 10]


def _add_one_(t):
    t.add_(1)  # propagation sees the mutation: the call mutates its argument


@dm.remote(propagate=_add_one_)
def _mutating_failure(t):
    t.add_(1)
    raise RuntimeError("half way")


def test_failing_in_place_op_poisons_every_alias(mesh2):
    with mesh2.activate():
        x = torch.zeros(4)
        view = x[:2]
        other = torch.ones(2)
        _mutating_failure(view)
        with pytest.raises(dm.RemoteException, match="half way"):
            dm.inspect(x)  # the base of the mutated view
        assert dm.inspect(other).tolist() == [1.0, 1.0]


def test_client_side_checks(mesh, client2):
    other = dm.device_mesh(client2, gpu=2)
    try:
        with mesh.activate():
            x = torch.ones(2)
        local = torch.ones(2)  # made outside the mesh: small, so placed on the mesh by itself
        big = torch.ones(64)
        with mesh.activate(), dask.config.set({"dask_monarch.local-tensors.max-bytes": 128}):
            assert dm.inspect(torch.add(x, local)).tolist() == [2.0, 2.0]
            assert dm.inspect(x + local).tolist() == [2.0, 2.0]
            with pytest.raises(TypeError, match="LOCAL_TENSOR") as info:
                x.sum() + big
            assert "256 bytes" in str(info.value) and "dask_monarch.put" in str(info.value)
            ranks_only = (x.unsqueeze(0).expand(2, 2)).mean(0)  # a value the client lacks
            with pytest.raises(TypeError, match="LOCAL_TENSOR.*write into a local tensor"):
                local.add_(ranks_only)
            local.add_(x)  # a value the client knows: computed here, as torch would
            assert local.tolist() == [2.0, 2.0]
        with other.activate():
            y = torch.ones(2)
        with mesh.activate():
            with pytest.raises(TypeError, match="WRONG_MESH"):
                x + y
            side = dm.Stream("side")
            with side.activate():
                with pytest.raises(TypeError, match="WRONG_STREAM"):
                    x * 2
                with pytest.raises(TypeError, match="WRONG_STREAM"):
                    dm.inspect(x)  # a fetch runs on the active stream: refused on the client
            x.drop()
            with pytest.raises(TypeError, match="DROPPED"):
                x + 1
            t = torch.ones(2)
            t2, borrow = side.borrow(t, mutable=True)
            with pytest.raises(TypeError, match="BORROWED"):
                t + 1
            borrow.drop()
            t + 1
            t3, borrow = side.borrow(t)
            with pytest.raises(TypeError, match="MUTATING_BORROW"):
                t.add_(1)
            with side.activate():
                with pytest.raises(TypeError, match="MUTATING_BORROW"):
                    t3.add_(1)
            borrow.drop()
    finally:
        other.exit()


def _ref_count(client, controller) -> int:
    def count(dask_worker, token=controller.token):
        state = dask_worker.plugins["dask_monarch"].ranks.get(token)
        return sum(len(lane.env) for lane in state.lanes.values()) if state else 0

    return sum(client.run(count).values())


def test_unused_handles_free_their_refs(mesh2, client2):
    controller = mesh2._session.controller
    with mesh2.activate():
        keep = torch.ones(2)
        dm.inspect(keep)
        before = _ref_count(client2, controller)
        for _ in range(50):
            tmp = torch.ones(100)
            tmp = tmp + 1
        del tmp
        gc.collect()
        dm.inspect(keep)  # sends the batched DeleteRefs first
        after = _ref_count(client2, controller)
    assert after <= before + 2  # every temporary is gone on both ranks


def test_dropped_bytes_send_deletes_before_the_batch_fills(mesh2, monkeypatch):
    """Garbage is bounded in bytes too: big dropped tensors are deleted without a fetch."""
    import dask_monarch.controller.session as session_module

    monkeypatch.setattr(session_module, "DELETE_BYTES", 3 * 100 * 100 * 4)
    session = mesh2._session
    with mesh2.activate():
        for _ in range(10):  # without the bound, 10 deletes would wait for a fetch
            torch.ones(100, 100).drop()  # 40 KB each; the next message sends 3 pending
            assert len(session._pending_deletes) <= 3


def test_autograd_runs_backward_on_the_ranks(mesh):
    with mesh.activate():
        dm.random.manual_seed(3)
        w = torch.rand(4, 3, requires_grad=True)
        x = torch.rand(5, 4)
        loss = torch.nn.functional.softplus(x @ w).sum()
        loss.backward()
        assert isinstance(w.grad, dm.Tensor) and w.grad.shape == (4, 3)
        grad, w_local, x_local = dm.inspect((w.grad, w, x))
    w_local.requires_grad_(True)
    torch.nn.functional.softplus(x_local @ w_local).sum().backward()
    assert torch.allclose(grad, w_local.grad, atol=1e-6)


def test_random_state(mesh2):
    with mesh2.activate():
        dm.random.manual_seed(5)
        a = torch.rand(3)
        state = dm.random.get_state()
        b = torch.rand(3)
        dm.random.set_state(state)
        c = torch.rand(3)
        got_a0, got_a1 = dm.inspect(a, gpu=0), dm.inspect(a, gpu=1)
        got_b, got_c = dm.inspect((b, c))
    assert torch.equal(got_a0, got_a1)  # the same seed on every rank
    assert torch.equal(got_b, got_c) and not torch.equal(got_a0, got_b)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(3), got_a0)


def test_random_state_holds_the_cpu_then_the_cuda_generator(mesh2):
    with mesh2.activate():
        state = dm.random.get_state()
        got = dm.inspect(state, gpu=0)
    cpu = torch.get_rng_state().numel()
    assert state.shape == got.shape == (cpu + 1 + dm.random.CUDA_STATE_BYTES,)
    assert got[cpu] == 0  # a CPU rank: no CUDA generator to restore


# -------------------------------------------------------------------------------- remote functions


def _local_double(x):
    return x * 2


def test_a_remote_functions_changes_to_its_inputs_are_read_from_the_ranks(mesh2):
    """The client kept its copy of a small value a remote function changed in place:
    t.tolist() read the value from before the call (rank 0 saw the change in its fake run,
    and "inspect" says nothing of what the function changes)."""

    def bump_(t):
        t.add_(1)
        return t.sum()

    learned = dm.remote(bump_)  # rank 0 runs it on fakes: their versions say what changed
    silent = dm.remote(bump_, propagate="inspect")
    with mesh2.activate():
        t = torch.tensor([1.0, 2.0, 3.0])
        untouched = torch.tensor([5.0])
        learned(t)
        assert t.tolist() == [2.0, 3.0, 4.0] and (t * 2).tolist() == [4.0, 6.0, 8.0]
        silent(t)
        assert t.tolist() == [3.0, 4.0, 5.0]
        learned(untouched + 0)
        assert untouched.tolist() == [5.0]


def test_a_remote_functions_outputs_say_they_have_no_gradient(mesh2):
    double = dm.remote(lambda x: x * 2, propagate=lambda x: x.clone())
    with mesh2.activate():
        model = torch.nn.Linear(4, 4)
        out = double(model(torch.ones(2, 4)))
        assert out.requires_grad
        with pytest.raises(RuntimeError, match="a remote function.*has no gradient"):
            out.sum().backward()
        detached = double(model(torch.ones(2, 4)).detach())
        assert not detached.requires_grad
        with torch.no_grad():
            assert not double(model(torch.ones(2, 4))).requires_grad


def test_remote_functions_by_callable_path_and_propagation(mesh2):
    doubled = dm.remote(_local_double, propagate=lambda x: x.clone())
    by_path = dm.remote("torch.nn.functional.relu", propagate=lambda x: x.clone())
    cached = dm.remote(lambda x, k: (x * k, x.sum()))  # rank 0 tells the shapes, once
    logged = dm.remote("builtins.print", propagate="inspect")
    with mesh2.activate():
        x = torch.arange(4.0) - 2
        assert dm.inspect(doubled(x)).tolist() == [-4.0, -2.0, 0.0, 2.0]
        assert dm.inspect(by_path(x)).tolist() == [0.0, 0.0, 0.0, 1.0]
        scaled, total = cached(x, 3)
        assert scaled.shape == (4,) and total.shape == ()
        assert dm.inspect(scaled).tolist() == [-6.0, -3.0, 0.0, 3.0]
        assert len(cached._cache) == 1
        cached(x, 3)
        assert len(cached._cache) == 1
        assert logged(x) is None
    with pytest.raises(TypeError):
        dm.remote(42)


def _gc_tracked(dask_worker=None) -> tuple[int, bool]:
    import sys

    return len(gc.get_objects()), "torch._dynamo" in sys.modules


def test_a_propagation_on_rank_0_leaves_its_imports_frozen(mesh2, client2):
    """Learning a remote function's output shapes on rank 0 runs it on fake tensors, which
    imports dynamo into that worker (117 000 objects): they are frozen out of the GC's
    reach with the rest of the imports, so full collections there stay cheap."""
    shapes = dm.remote(lambda x: x @ x.t())  # no propagate: rank 0 runs it on fakes
    with mesh2.activate():
        y = shapes(torch.ones(3, 2))
        assert dm.inspect(y).tolist() == [[2.0] * 3] * 3
    rank0 = mesh2._session.controller.workers[0]
    tracked, dynamo = client2.run(_gc_tracked, workers=[rank0])[rank0]
    assert dynamo
    assert tracked < 60_000, tracked


def test_call_on_shard_and_fetch(mesh):
    @dm.remote(propagate="inspect")
    def describe(x, label):
        return {"label": label, "sum": float(x.sum())}

    with mesh.activate():
        x = torch.ones(3) * (mesh.rank(("host", "gpu")) + 1)
        got = describe.call_on_shard_and_fetch(x, "hello", shard={"host": 1, "gpu": 0})
    assert got == {"label": "hello", "sum": 9.0}


def test_fetch_shard_coordinates_and_validation(mesh):
    with mesh.activate():
        x = mesh.rank(("host", "gpu")).float()
        future = dm.fetch_shard(x, {"host": 1, "gpu": 1})
        assert future.result(timeout=60).item() == 3.0
        assert dm.fetch_shard(x, host=0, gpu=1).result().item() == 1.0
        assert dm.inspect(x).item() == 0.0
        tree = dm.inspect({"a": x, "b": [x, 7]}, host=1, gpu=0)
        assert tree["a"].item() == 2.0 and tree["b"][0].item() == 2.0 and tree["b"][1] == 7
        with pytest.raises(ValueError, match="Missing key"):
            dm.fetch_shard(x, {"host": 0})
        with pytest.raises(KeyError):
            dm.fetch_shard(x, {"host": 0, "gpu": 0, "rack": 1})
        with pytest.raises(ValueError, match=r"shard gpu=2 is outside DeviceMesh\(host=2, gpu=2\)"):
            dm.fetch_shard(x, host=0, gpu=2)


def test_dependent_fetch_raises_with_traceback_and_independent_values_stay(mesh2):
    @dm.remote(propagate=lambda x: x.clone())
    def explode(x):
        raise ValueError("the model diverged")

    with mesh2.activate():
        x = torch.ones(2)
        bad = explode(x)
        worse = bad * 2 + 1
        fine = x + 1
        with pytest.raises(dm.RemoteException) as info:
            dm.inspect(worse)
        assert "the model diverged" in str(info.value) and "explode" in info.value.traceback
        assert info.value.rank in (0, 1)
        assert "test_user_api.py" in info.value.controller_traceback
        assert dm.inspect(fine).tolist() == [2.0, 2.0]


def test_unfetched_failure_is_raised_by_exit(client2):
    mesh = dm.device_mesh(client2, gpu=2)
    with mesh.activate():
        x = torch.ones(2)
        _explode(x)  # nobody fetches anything that depends on it
    with pytest.raises(dm.RemoteException, match="nobody looked"):
        mesh.exit()


def test_an_exited_mesh_says_so(client2):
    mesh = dm.device_mesh(client2, gpu=2)
    with mesh.activate():
        x = torch.ones(2)
    mesh.exit()
    for use in (lambda: x + 1, lambda: dm.inspect(x), lambda: mesh.activate().__enter__()):
        with pytest.raises(RuntimeError, match=r"DeviceMesh\(gpu=2\) has exited"):
            use()
    mesh.exit()  # a second exit does nothing


@dm.remote(propagate=lambda x: x.clone())
def _explode(x):
    raise RuntimeError("nobody looked at this failure")


def test_lost_worker_is_a_device_exception(throwaway_cluster):
    import os
    import signal

    with throwaway_cluster(2) as (_, client):
        mesh = dm.device_mesh(client, gpu=2)
        with mesh.activate():
            x = torch.ones(2)
            dm.inspect(x)
            victim = mesh._session.controller.workers[1]
            pid = client.run(os.getpid, workers=[victim])[victim]
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(dm.DeviceException, match="rank 1"):
                for _ in range(200):
                    dm.inspect(x + 1)
        with contextlib.suppress(dm.DeviceException):
            mesh.exit()
