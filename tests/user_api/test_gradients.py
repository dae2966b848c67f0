"""Gradients as backward produces them: ``dm.grad_generator`` and ``dm.ddp_hooks`` on 2 ranks
(docs/user_guide.md, gradients as they become ready)."""

from __future__ import annotations

import time

import pytest
import torch
from distributed import get_task_stream
from helpers.task_stream import wait_until_recorded
from torch import nn

import dask_monarch as dm

# also run with dask_monarch.comm.emulate-nccl (tests/conftest.py)
pytestmark = [pytest.mark.timeout(240), pytest.mark.nccl_rules]


def _model(seed_fn) -> nn.Module:
    seed_fn(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _loss(model: nn.Module, mesh) -> torch.Tensor:
    x = torch.randn(5, 6) * (mesh.rank("gpu") + 1)  # different data on each rank
    return (model(x) ** 2).mean()


def test_grad_generator_yields_autograd_s_gradients_in_backward_order(mesh2):
    with mesh2.activate():
        model = _model(dm.random.manual_seed)
        params = list(model.parameters())
        loss = _loss(model, mesh2)
        expected = torch.autograd.grad(loss, params, retain_graph=True)
        pairs = list(dm.grad_generator(loss, params))
        got = [dm.inspect(g, gpu=r) for _, g in pairs for r in range(2)]
        want = {id(p): [dm.inspect(e, gpu=r) for r in range(2)] for p, e in zip(params, expected)}
    assert sorted(id(p) for p, _ in pairs) == sorted(id(p) for p in params)
    for i, (p, _) in enumerate(pairs):
        for r in range(2):
            assert torch.allclose(got[2 * i + r], want[id(p)][r])
    assert not torch.allclose(want[id(params[0])][0], want[id(params[0])][1])  # ranks differ
    # the order backward produces them: the last layer's first, as local autograd does
    local = _model(torch.manual_seed)
    order = []
    for i, p in enumerate(local.parameters()):
        p.register_hook(lambda g, i=i: order.append(i))
    torch.autograd.grad((local(torch.randn(5, 6)) ** 2).mean(), list(local.parameters()))
    ids = [id(p) for p in params]
    assert [ids.index(id(p)) for p, _ in pairs] == order
    assert all(p.grad is None for p in params)  # .grad untouched


def test_work_issued_in_the_loop_runs_between_backward_steps(mesh2):
    comms = dm.Stream("gradgen_comms")
    with mesh2.activate():
        model = _model(dm.random.manual_seed)
        params = list(model.parameters())
        loss = _loss(model, mesh2)
        expected = torch.autograd.grad(loss, params, retain_graph=True)
        averaged = {}
        for p, g in dm.grad_generator(loss, params):
            lent, borrow = comms.borrow(g)
            with comms.activate():
                averaged[p] = lent.reduce("gpu", "avg")
            borrow.drop()
        with comms.activate():
            got = dm.inspect([averaged[p] for p in params], gpu=1)
        locals_ = [[dm.inspect(e, gpu=r) for r in range(2)] for e in expected]
    for g, (e0, e1) in zip(got, locals_):
        assert torch.allclose(g, (e0 + e1) / 2, atol=1e-6)


def test_grad_generator_closed_early_and_errors(mesh2):
    with mesh2.activate():
        model = _model(dm.random.manual_seed)
        params = list(model.parameters())
        gen = dm.grad_generator(_loss(model, mesh2), params)
        first_param, _ = next(gen)
        gen.close()  # backward finishes without pausing; the thread is gone
        assert first_param is params[-1]
        unused = torch.zeros(3, requires_grad=True)
        with pytest.raises(RuntimeError, match="not have been used"):
            list(dm.grad_generator(_loss(model, mesh2), [*params, unused]))
        with pytest.raises(TypeError, match="require grad"):
            dm.grad_generator(_loss(model, mesh2), [torch.zeros(2)])


def _train_step(mesh, model, hooks=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    _loss(model, mesh).backward()
    optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_ddp_hooks_average_gradients_like_a_reduce_after_backward(mesh2):
    with mesh2.activate():
        hooked = _model(dm.random.manual_seed)
        with dm.ddp_hooks(hooked, "gpu", bucket_bytes=200) as hooks:
            assert len(hooks.buckets) > 1
            dm.random.manual_seed(1)
            after_hooks = _train_step(mesh2, hooked)
        plain = _model(dm.random.manual_seed)
        dm.random.manual_seed(1)
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        _loss(plain, mesh2).backward()
        for p in plain.parameters():
            p.grad.reduce_("gpu", "avg")
        optimizer.step()
        got = [[dm.inspect(w, gpu=r) for r in range(2)] for w in after_hooks]
        want = [dm.inspect(p.detach(), gpu=0) for p in plain.parameters()]
    for (w0, w1), w in zip(got, want):
        assert torch.allclose(w0, w, atol=1e-6) and torch.equal(w0, w1)  # replicas agree


def test_ddp_hooks_reduce_on_the_comms_lane_while_backward_runs_on_main(client2, mesh2):
    """On the ranks' timeline (Dask's task stream: one task per (rank, lane) segment), a
    reduce segment of the comms lane runs while a segment of backward runs on main (in
    one flush or in two: the lanes are separate tasks either way; the last of backward's
    ops may share a segment with the loss's fetch, and take its name). Main's segment is
    held open until the comms lane started (an event): on a loaded machine the client's
    flushes could otherwise fall so that main ran all its work before comms got any."""
    comms = dm.Stream("ddp_overlap")
    big = 512
    busy = dm.remote("helpers.remote_fns.until_lane_busy", propagate=lambda *a: None)
    with mesh2.activate():
        dm.random.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(big, big) for _ in range(6)])
        hooks = dm.ddp_hooks(model, "gpu", stream=comms, bucket_bytes=big * big * 4)
        session = mesh2._session
        main_lane = session.stream_ref(dm.get_active_stream()).id
        comms_lane = session.stream_ref(comms).id  # the comms lane exists before the step
        x = torch.randn(256, big)
        dm.inspect(x.sum())  # everything before the step has run ...
        deadline = time.monotonic() + 60
        while not session.controller.ranks_idle() and time.monotonic() < deadline:
            time.sleep(0.01)  # ... and is reported: the first bucket's hook flushes at once
        with get_task_stream(client2) as ts:
            # an event, not a timing: main's segment holding the step cannot end before the
            # comms lane started a segment, and that one (a bucket's borrow and reduce) waits
            # for main to lend the bucket: they overlap however the flushes fall
            busy(comms_lane)
            loss = (model(x) ** 2).mean()
            loss.backward()
            dm.inspect(loss)
            wait_until_recorded(client2, session.controller.token)
        hooks.remove()
    segments = {}  # (rank, lane) -> [(index, start, stop, name)]
    for task in ts.data:
        key = task["key"]
        if not (isinstance(key, tuple) and len(key) == 5 and key[1] == session.controller.token):
            continue
        name, _, rank, lane, index = key
        compute = [s for s in task["startstops"] if s["action"] == "compute"]
        if compute:
            entry = (index, compute[0]["start"], compute[-1]["stop"], name)
            segments.setdefault((rank, lane), []).append(entry)
    for rank in range(2):
        ops = segments[rank, main_lane]  # backward's ops (the last ones with the fetch)
        reduces = [s for s in segments[rank, comms_lane] if s[3] == "monarch_reduce"]
        assert ops and reduces, segments
        # some reduce ran while a segment of forward/backward ops was running on main
        overlap = [(r, o) for r in reduces for o in ops if r[1] < o[2] and o[1] < r[2]]
        assert overlap, (reduces, ops)


def test_ddp_hooks_no_sync_accumulates_then_reduces_the_sum_once(mesh2):
    with mesh2.activate():
        hooked = _model(dm.random.manual_seed)
        plain = _model(dm.random.manual_seed)
        with dm.ddp_hooks(hooked, "gpu", bucket_bytes=200) as hooks:
            dm.random.manual_seed(2)
            with hooks.no_sync():
                _loss(hooked, mesh2).backward()
            _loss(hooked, mesh2).backward()
        dm.random.manual_seed(2)
        _loss(plain, mesh2).backward()
        _loss(plain, mesh2).backward()
        for p in plain.parameters():
            p.grad.reduce_("gpu", "avg")
        got = [[dm.inspect(p.grad, gpu=r) for r in range(2)] for p in hooked.parameters()]
        want = [dm.inspect(p.grad, gpu=1) for p in plain.parameters()]
    for (g0, g1), w in zip(got, want):
        assert torch.allclose(g1, w, atol=1e-6) and torch.equal(g0, g1)


_hold = dm.remote("helpers.gates.wait_for_file", propagate=lambda path, timeout: None)


def test_ddp_hooks_leave_buckets_to_the_next_flush_while_the_ranks_are_busy(mesh2, tmp_path):
    """A flush per bucket costs Dask far more than the messages in it: while the ranks are
    still busy, a ready bucket waits for the next flush instead of forcing one."""
    gate = tmp_path / "gate"
    with mesh2.activate():
        dm.random.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
        hooks = dm.ddp_hooks(model, "gpu", bucket_bytes=1)  # one bucket per parameter
        assert len(hooks.buckets) == 16
        loss = (model(torch.randn(3, 4)) ** 2).mean()
        controller = mesh2._session.controller
        _hold(str(gate), 120.0)  # the main lanes wait for the gate
        controller.flush()
        before = controller.flushes
        loss.backward()
        during = controller.flushes - before
        gate.touch()
        grads = [dm.inspect(p.grad, gpu=0) for p in model.parameters()]
        hooks.remove()
    assert all(torch.isfinite(g).all() for g in grads)
    assert during < 8, f"{during} flushes for 16 buckets while the ranks were busy"


def test_a_compiled_step_holds_forward_backward_hooks_and_optimizer(mesh2):
    """``dm.compile`` traces a whole training step (the hooks' borrows and reduces too):
    replays give the weights of the same steps dispatched op by op."""
    comms = dm.Stream("compiled_ddp")
    weights = []
    with mesh2.activate():
        for compiled in (False, True):
            model = _model(dm.random.manual_seed)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            hooks = dm.ddp_hooks(model, "gpu", stream=comms, bucket_bytes=200)
            dm.random.manual_seed(3)

            def step(model=model, optimizer=optimizer):
                loss = _loss(model, mesh2)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()  # .grad is internal to the recording
                return loss.detach()

            if compiled:
                step = dm.compile(step)
            losses = [step() for _ in range(3)]
            weights.append(
                [[dm.inspect(p.detach(), gpu=r) for r in range(2)] for p in model.parameters()]
            )
            weights[-1].append([dm.inspect(loss, gpu=0) for loss in losses])
            hooks.remove()
    plain, replayed = weights
    for (a0, a1), (b0, b1) in zip(plain[:-1], replayed[:-1]):
        assert torch.equal(a0, a1) and torch.equal(b0, b1)  # replicas agree
        assert torch.allclose(a0, b0, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain[-1], replayed[-1]))


def test_a_compiled_ddp_step_replays_across_garbage_collections(mesh2):
    """The trace's dropped borrows let go of the lenders' handles: before, the bucket each
    borrow lent stayed alive until the next collection, so the trace counted it as held
    outside, and a replay after any collection found it gone, traced again, and after four
    such calls ran eagerly (with a CompileWarning that blamed the function)."""
    import gc
    import warnings

    with mesh2.activate():
        model = _model(dm.random.manual_seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        hooks = dm.ddp_hooks(model, "gpu", bucket_bytes=200)  # flat and single buckets

        @dm.compile
        def step():
            loss = _loss(model, mesh2)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        traces = []
        with warnings.catch_warnings():
            warnings.simplefilter("error", dm.CompileWarning)
            for _ in range(8):
                step()
                traces.append(next(iter(step._traces.values())))
                gc.collect()
        dm.inspect(model[0].weight)
        hooks.remove()
    assert not step._eager and len({t.ref for t in traces}) == 1  # one recording
    assert all(t is traces[-1] for t in traces[2:])  # traced (and confirmed), then replayed


def test_ddp_hooks_lend_one_flat_copy_per_bucket(mesh2):
    """Each borrow costs every rank two hand-offs between its lane threads: a bucket of
    several gradients is lent as one flat copy, not gradient by gradient."""
    from dask_monarch.protocol import messages as m

    with mesh2.activate():
        model = _model(dm.random.manual_seed)
        hooks = dm.ddp_hooks(model, "gpu")  # one bucket of all six parameters

        @dm.compile
        def backward():
            _loss(model, mesh2).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            return grads

        dm.random.manual_seed(5)
        grads = backward()
        (trace,) = backward._traces.values()
        got = [dm.inspect(g, gpu=0) for g in grads]
        hooks.remove()
        dm.random.manual_seed(5)
        want = [dm.inspect(g.reduce("gpu", "avg"), gpu=0) for g in backward.fn()]
    borrows = [msg for ranks, msg in trace.messages if isinstance(msg, m.BorrowCreate)]
    assert len(hooks.buckets) == 1 and len(borrows) == 1
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))
    # the gradients become views of the averaged bucket in one message, not one each
    calls = [msg for _, msg in trace.messages if isinstance(msg, m.CallFunction)]
    paths = [getattr(msg.function, "path", "") for msg in calls]
    assert paths.count("dask_monarch.gradients.bucket_views") == 1
    assert not [path for path in paths if "as_strided" in path]


def test_ddp_hooks_gradients_are_views_of_their_bucket(mesh2):
    """After backward each gradient is a view of its bucket's average (DDP's
    ``gradient_as_bucket_view``): they share its storage, in order, with their own shapes."""
    with mesh2.activate():
        model = _model(dm.random.manual_seed)
        with dm.ddp_hooks(model, "gpu") as hooks:
            _loss(model, mesh2).backward()
        (bucket,) = hooks.buckets
        grads = [p.grad for p in bucket]
        assert len({id(g._storage) for g in grads}) == 1
        end = 0  # one after the other, in the order they were accumulated
        for g in sorted(grads, key=lambda g: g._mkey.offset):
            assert g._mkey.offset == end
            end += g.numel()
        for p, g in zip(bucket, grads):
            assert g.shape == p.shape and g.is_contiguous()
        values = [dm.inspect(g, gpu=0) for g in grads]
        p0 = bucket[0]
        p0.grad.mul_(2)  # a change through one view is a change of the bucket
        assert torch.equal(dm.inspect(p0.grad, gpu=0), values[0] * 2)


def test_ddp_hooks_buckets_hold_one_dtype_and_flatten_any_gradient(mesh2):
    """A bucket is one flat tensor, so it holds one dtype; 0-d and empty gradients are
    flattened too (``_chunk_cat``, the one-message copy, refuses them)."""
    from dask_monarch.gradients import _buckets

    with mesh2.activate():
        params = [
            torch.ones(3, requires_grad=True),
            torch.ones((), requires_grad=True),  # 0-d
            torch.ones(0, 2, requires_grad=True),  # empty
            torch.ones(2, dtype=torch.float64, requires_grad=True),
        ]
        buckets = _buckets(params, 1 << 20)
        assert [[p.dtype for p in b] for b in buckets] == [[torch.float64], [torch.float32] * 3]
        with dm.ddp_hooks(params, "gpu"):
            loss = sum((p.double() * (i + 1)).sum() for i, p in enumerate(params))
            loss.backward()
        grads = [dm.inspect(p.grad, gpu=1) for p in params]
    want = [torch.full((3,), 1.0), torch.tensor(2.0), torch.ones(0, 2)]
    want.append(torch.full((2,), 4.0, dtype=torch.float64))
    for got, w in zip(grads, want):
        assert got.dtype == w.dtype and got.shape == w.shape and torch.equal(got, w)
