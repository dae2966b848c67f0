"""Streams, borrows, collectives, moves, process groups, pipes and actors through the user API."""

from __future__ import annotations

import warnings

import pytest
import torch

import dask_monarch as dm

# also run with dask_monarch.comm.emulate-nccl (tests/conftest.py)
pytestmark = pytest.mark.nccl_rules


def values_on(mesh, t):
    """``t`` on every rank, in rank order."""
    return [dm.inspect(t, dict(zip(mesh.dims, mesh.slice_.coordinates(r)))) for r in mesh.ranks]


def test_streams_and_mutable_borrow_give_changes_back(mesh):
    comms = dm.Stream("comms")
    with mesh.activate():
        grad = mesh.rank(("host", "gpu")).float() + torch.zeros(3)
        borrowed, borrow = comms.borrow(grad, mutable=True)
        assert borrowed.stream is comms and borrowed.shape == grad.shape
        with comms.activate():
            borrowed.reduce_(("host", "gpu"), "sum")
        borrow.drop()
        got = values_on(mesh, grad)
    assert all(v.tolist() == [6.0, 6.0, 6.0] for v in got)


def test_immutable_borrow_as_a_context_manager(mesh):
    side = dm.Stream("side")
    with mesh.activate():
        x = torch.full((2,), 4.0)
        seen, borrow = side.borrow(x)
        with borrow:
            with side.activate():
                y = seen * 2
            z = x + 1  # the lender may still read
        with side.activate():
            got_y = dm.inspect(y)
        got_z = dm.inspect(z)
        with pytest.raises(TypeError, match="DROPPED"):
            with side.activate():
                seen + 1
    assert got_y.tolist() == [8.0, 8.0] and got_z.tolist() == [5.0, 5.0]


def test_failure_on_a_borrowing_stream_poisons_the_lender(mesh):
    side = dm.Stream("side")
    with mesh.activate():
        x = torch.zeros(2)
        b, borrow = side.borrow(x, mutable=True)
        with side.activate():
            _spoil(b)
        borrow.drop()
        with pytest.raises(dm.RemoteException, match="spoiled while borrowed"):
            dm.inspect(x)


def _mutate_prop(t):
    t.add_(1)


@dm.remote(propagate=_mutate_prop)
def _spoil(t):
    t.add_(1)
    raise RuntimeError("spoiled while borrowed")


def test_borrow_garbage_collected_without_drop_warns(mesh):
    side = dm.Stream("side")
    with mesh.activate():
        x = torch.ones(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, borrow = side.borrow(x)
            del borrow, _
            import gc

            gc.collect()
        assert any("without drop" in str(w.message) for w in caught)
        assert dm.inspect(x + 1).tolist() == [2.0, 2.0]


REDUCTIONS = [
    ("sum", lambda xs: sum(xs)),
    ("avg", lambda xs: sum(xs) / len(xs)),
    ("max", lambda xs: torch.stack(xs).max(0).values),
    ("min", lambda xs: torch.stack(xs).min(0).values),
    ("product", lambda xs: torch.stack(xs).prod(0)),
]


@pytest.mark.parametrize("name, local", REDUCTIONS)
def test_reduce_over_one_dim_and_all_dims(mesh, name, local):
    with mesh.activate():
        x = torch.arange(2.0) + mesh.rank(("host", "gpu")).float() + 1
        per_host = x.reduce("gpu", name)
        everywhere = dm.reduce(x, (), name)
        got_host = values_on(mesh, per_host)
        got_all = values_on(mesh, everywhere)
    xs = [torch.arange(2.0) + r + 1 for r in range(4)]
    for r in range(4):
        host = r // 2
        assert torch.allclose(got_host[r], local(xs[2 * host : 2 * host + 2]))
        assert torch.allclose(got_all[r], local(xs))


def test_stack_scatter_out_and_in_place(mesh):
    with mesh.activate():
        x = (torch.arange(4.0) + 10 * mesh.rank("gpu").float()).view(2, 2)
        stacked = x.reduce("gpu", "stack")
        scattered = x.reduce("gpu", "sum", scatter=True)
        exchanged = x.reduce("gpu", "stack", scatter=True)
        out = torch.zeros(2, 2)
        result = x.reduce("gpu", "max", out=out)
        assert result is out
        y = x.clone()
        assert y.reduce_("gpu", "sum") is y
        assert stacked.shape == (2, 2, 2) and scattered.shape == (2,)
        got = [dm.inspect(t, host=0, gpu=1) for t in (stacked, scattered, exchanged, out, y)]
    a, b = torch.arange(4.0).view(2, 2), (torch.arange(4.0) + 10).view(2, 2)
    assert torch.equal(got[0], torch.stack([a, b]))
    assert torch.equal(got[1], (a + b)[1])
    assert torch.equal(got[2], torch.stack([a[1], b[1]]))
    assert torch.equal(got[3], torch.maximum(a, b))
    assert torch.equal(got[4], a + b)


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda x: x.reduce("rack", "sum"), KeyError, "rack"),
        (lambda x: x.reduce(("gpu", "gpu"), "sum"), ValueError, "repeated"),
        (lambda x: x.reduce(("host", "gpu"), "stack"), ValueError, "multiple dimensions"),
        (lambda x: x.reduce(("host", "gpu"), "sum", scatter=True), ValueError, "multiple dim"),
        (lambda x: x.reduce("gpu", "median"), ValueError, "reduction must be one of"),
        (lambda x: x.reduce("gpu", "sum", scatter=True), TypeError, "When scattering"),
        (
            lambda x: x.reduce("gpu", "sum", out=torch.zeros(5)),
            ValueError,
            r"Reduce expects the shape to be torch.Size\(\[3\]\)",
        ),
        (lambda x: x.reduce_("gpu", "sum", scatter=True), ValueError, "in-place"),
        (lambda x: x.reduce("gpu", "sum", mesh=object()), NotImplementedError, "mesh="),
    ],
)
def test_reduce_validation(mesh, call, error, text):
    with mesh.activate():
        x = torch.ones(3)
        with pytest.raises(error, match=text):
            call(x)


def test_reduce_of_a_failed_value_still_completes_on_every_rank(mesh):
    with mesh.activate():
        x = torch.ones(2)
        bad = _fails_on_rank_one(x, mesh.rank(("host", "gpu")))
        total = bad.reduce(("host", "gpu"), "sum")
        fine = x.reduce(("host", "gpu"), "sum")  # the collective after it still runs
        assert dm.inspect(fine).tolist() == [4.0, 4.0]
        with pytest.raises(dm.RemoteException, match="rank one refuses"):
            dm.inspect(total)


@dm.remote(propagate=lambda x, r: x.clone())
def _fails_on_rank_one(x, rank):
    if int(rank) == 1:
        raise RuntimeError("rank one refuses")
    return x.clone()


def test_pipeline_stages_with_to_mesh(mesh):
    stage0, stage1 = mesh.slice(host=0), mesh.slice(host=1)
    with stage0.activate():
        activations = torch.arange(3.0) + 1 + stage0.rank("gpu").float() * 10
    moved = activations.to_mesh(stage1)
    assert moved.mesh == stage1
    with stage1.activate():
        out = moved * 2
        got = [dm.inspect(out, gpu=g) for g in range(2)]
    assert got[0].tolist() == [2.0, 4.0, 6.0] and got[1].tolist() == [22.0, 24.0, 26.0]


def test_backward_crosses_a_pipeline_boundary_and_refuses_a_collective(mesh):
    """A move is differentiable (its gradient moves back); a collective has no gradient, and
    says so when backward reaches it: before, both results simply did not require grad, and
    the layers before a tensor-parallel sum were silently never trained."""
    stage0, stage1 = mesh.slice(host=0), mesh.slice(host=1)
    with stage0.activate():
        w0 = torch.ones(3, requires_grad=True)
        h = w0 * (stage0.rank("gpu").float() + 2)
    moved = h.to_mesh(stage1)
    with stage1.activate():
        w1 = torch.full((3,), 3.0, requires_grad=True)
        (moved * w1).sum().backward()
        assert [dm.inspect(w1.grad, gpu=g).tolist() for g in range(2)] == [[2.0] * 3, [3.0] * 3]
    with stage0.activate():
        assert dm.inspect(w0.grad, gpu=1).tolist() == [9.0] * 3
    with mesh.activate():
        w = torch.ones(3, requires_grad=True)
        y = (w * 2).reduce("gpu", "sum")
        assert y.requires_grad and dm.inspect(y, host=0, gpu=0).tolist() == [4.0] * 3
        with pytest.raises(RuntimeError, match=r"reduce\('gpu', 'sum'\) has no gradient"):
            y.sum().backward()
        s = torch.sigmoid(w)
        s.reduce_("gpu", "avg")  # in place, as any in-place op: backward refuses the old value
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            s.sum().backward()
        loss = (w * 3).sum()
        loss.reduce_("gpu", "avg")  # a loss averaged for the log: its backward is untouched
        loss.backward()
        assert dm.inspect(w.grad, host=0, gpu=0).tolist() == [3.0] * 3


class _CopyToTP(torch.autograd.Function):  # docs/user_guide.md, "Collectives and autograd"
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.reduce("gpu", "sum")


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.detach().reduce("gpu", "sum")

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_the_user_guides_tensor_parallel_pair_gives_local_gradients(mesh):
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(2, 4), torch.randn(4, 6), torch.randn(6, 4)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    (torch.relu(leaves[0] @ leaves[1]) @ leaves[2]).sum().backward()
    with mesh.activate():
        r = mesh.rank("gpu").reshape(1)
        mx = dm.put(x).requires_grad_()
        m1 = torch.stack(w1.chunk(2, 1)).index_select(0, r).squeeze(0).requires_grad_()
        m2 = torch.stack(w2.chunk(2, 0)).index_select(0, r).squeeze(0).requires_grad_()
        y = _ReduceFromTP.apply(torch.relu(_CopyToTP.apply(mx) @ m1) @ m2)
        y.sum().backward()
        grads = [dm.inspect((mx.grad, m1.grad, m2.grad), host=1, gpu=g) for g in range(2)]
    for g, (gx, g1, g2) in enumerate(grads):
        assert torch.allclose(gx, leaves[0].grad, atol=1e-6)
        assert torch.allclose(g1, leaves[1].grad.chunk(2, 1)[g], atol=1e-6)
        assert torch.allclose(g2, leaves[2].grad.chunk(2, 0)[g], atol=1e-6)


def test_a_compiled_pipeline_step_returns_its_loss_on_the_last_stage(mesh):
    """A compiled function's outputs were all given its arguments' mesh: a loss computed on
    the last stage was fetched from the first, whose ranks do not hold it (RefNotFound)."""
    stage0, stage1 = mesh.slice(host=0), mesh.slice(host=1)

    @dm.compile
    def step(x):
        y = (x * 2).to_mesh(stage1)
        with stage1.activate():
            return (y + 1).sum(), x + 1

    with stage0.activate():
        x = torch.ones(3)
    for _ in range(3):  # traced, then replayed
        loss, same = step(x)
        assert loss.mesh == stage1 and same.mesh == stage0
        with stage1.activate():
            assert dm.inspect(loss, gpu=1).item() == 9.0
        with stage0.activate():
            assert dm.inspect(same, gpu=0).tolist() == [2.0] * 3


def test_to_mesh_copies_and_broadcasts(mesh):
    with mesh.activate():
        t = torch.zeros(2) + mesh.rank(("host", "gpu")).float()
        copy = t.to_mesh(mesh)
        t.add_(100)
        assert values_on(mesh, copy)[3].tolist() == [3.0, 3.0]  # later changes do not leak
        with pytest.warns(UserWarning, match="broadcast"):
            spread = dm.to_mesh(t.slice_mesh(host=1), mesh)  # host=1 shards to both hosts
        got = values_on(mesh, spread)
    assert [g[0].item() for g in got] == [102.0, 103.0, 102.0, 103.0]
    with mesh.activate():
        with pytest.raises(ValueError, match="destination mesh does not have dimensions"):
            t.to_mesh(mesh.slice(host=0))


def test_process_group_in_a_remote_function(mesh):
    @dm.remote(propagate=lambda x, pg: x.clone())
    def all_reduce(x, pg):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=pg)
        return x

    with mesh.activate():
        pg = mesh.process_group("gpu")
        x = torch.ones(2) * (mesh.rank(("host", "gpu")).float() + 1)
        got = values_on(mesh, all_reduce(x, pg))
    assert [g[0].item() for g in got] == [3.0, 3.0, 7.0, 7.0]


def test_loader_pipe_feeds_the_mesh(mesh):
    with mesh.activate():
        pipe = dm.create_pipe("helpers.remote_fns.loader", 3, max_messages=2)
        batches = [pipe.recv() for _ in range(3)]
        got = [dm.inspect(b[0], host=1, gpu=0) for b in batches]
    assert [g.tolist() for g in got] == [[100.0, 100.0], [101.0, 101.0], [102.0, 102.0]]


def test_pipe_with_propagate_and_send(mesh):
    with mesh.activate():
        pipe = dm.create_pipe(
            "helpers.remote_fns.echo_loader",
            max_messages=1,
            propagate=lambda: (torch.empty(2), 0, 0),
        )
        pipe.send(torch.ones(2) * 3)
        doubled, _, _ = pipe.recv()
        assert dm.inspect(doubled).tolist() == [6.0, 6.0]


def test_a_value_sent_into_a_pipe_is_what_it_was_when_sent(mesh):
    """A later in-place change on the stream does not reach the producer: the pipe takes a
    copy (a process producer's queue pickles the value later, on a thread of its own, and
    a thread producer would share it)."""
    with mesh.activate():
        pipe = dm.create_pipe(
            "helpers.remote_fns.late_echo", max_messages=1, propagate=lambda: torch.empty(2)
        )
        for _ in range(3):
            t = torch.ones(2)
            pipe.send(t)
            t.add_(1)
            assert dm.inspect(pipe.recv()).tolist() == [1.0, 1.0]
            assert dm.inspect(t).tolist() == [2.0, 2.0]


def test_actor_mesh_calls(mesh):
    from helpers import remote_fns

    with mesh.activate():
        actors = mesh.spawn("acc", remote_fns.Accumulator, 1.0)
        x = torch.ones(2) * (mesh.rank(("host", "gpu")).float() + 1)
        totals = actors.call("add", x, label="first").result(timeout=60)
        assert [float(t) for t in totals] == [3.0, 5.0, 7.0, 9.0]  # 1 + the rank's sum
        scaled = actors.call_tensor("scale_", x, 10.0, propagate=lambda t, f: t.clone())
        assert dm.inspect(scaled, host=1, gpu=1).tolist() == [40.0, 40.0]
        assert actors.call("history").result(timeout=60)[0] == ["first"]
