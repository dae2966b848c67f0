"""coalescing() and compile(), and the end-to-end training example."""

from __future__ import annotations

import contextlib
import gc
import pathlib
import sys
import warnings

import pytest
import torch

import dask_monarch as dm
from dask_monarch import messages as m


@pytest.fixture
def mesh(mesh2):
    return mesh2


@contextlib.contextmanager
def sent_messages(mesh):
    """Record what the mesh's controller is given (observing, not replacing, send)."""
    controller = mesh._session.controller
    log, original = [], controller.send

    def send(ranks, message):
        log.append((tuple(ranks) if not isinstance(ranks, int) else (ranks,), message))
        original(ranks, message)

    controller.send = send
    try:
        yield log
    finally:
        del controller.send


def test_coalescing_sends_one_command_group_per_rank(mesh):
    with mesh.activate():
        acc = torch.zeros(3)
        dm.inspect(acc)
        with sent_messages(mesh) as log:
            with dm.coalescing():
                for _ in range(20):
                    acc = acc + 1
        assert [type(msg) for _, msg in log] == [m.CommandGroup, m.CommandGroup]
        assert sorted(ranks for ranks, _ in log) == [(0,), (1,)]
        assert len(log[0][1].messages) == 20
        assert dm.inspect(acc).tolist() == [20.0] * 3


def test_no_fetch_inside_coalescing(mesh):
    with mesh.activate():
        x = torch.ones(2)
        with pytest.raises(RuntimeError, match=r"inside a coalescing\(\) block"):
            with dm.coalescing():
                dm.inspect(x + 1)
        assert dm.inspect(x).tolist() == [1.0, 1.0]


def test_compile_traces_once_and_replays_with_one_message(mesh):
    calls = []

    @dm.compile
    def step(a, b, scale):
        calls.append(1)
        return a * scale + b, (a - b).sum()

    with mesh.activate():
        a, b = torch.ones(3), torch.full((3,), 2.0)
        out, total = step(a, b, 3.0)
        assert out.shape == (3,) and total.shape == ()
        with sent_messages(mesh) as log:
            out2, _ = step(out, b, 3.0)
        assert [type(msg) for _, msg in log] == [m.CallRecording]
        assert len(calls) == 1  # traced once
        step(a, b, 4.0)  # another non-tensor argument: traced again
        step(torch.ones(4), torch.ones(4), 3.0)  # other shapes: traced again
        assert len(calls) == 3
        got = dm.inspect((out, total, out2))
    assert got[0].tolist() == [5.0] * 3 and got[1].item() == -3.0 and got[2].tolist() == [17.0] * 3


def test_a_compiled_step_given_local_batches_replays_them(mesh):
    """A DataLoader's batches are new local tensors every call. A local tensor argument was
    keyed by identity: every call a new trace, none replayed, each kept with its recording
    (found by a probe of training-loop features). Now each is placed on the mesh and is an
    input of the recording, keyed by its metadata."""
    calls = []

    @dm.compile
    def step(w, x):
        calls.append(1)
        return w * x.sum() + x.mean()

    batches = [torch.arange(6.0).reshape(2, 3) * (i + 1) for i in range(5)]
    with mesh.activate():
        w = torch.ones(3)
        got = [step(w, x) for x in batches]
        with sent_messages(mesh) as log:
            step(w, batches[0])
        assert len(calls) == 1  # traced once, replayed for every batch
        assert [type(msg) for _, msg in log] == [m.CallFunction, m.CallRecording]  # placed
        assert len(step._traces) == 1
        values = dm.inspect(got)
    assert all(torch.equal(v, x.sum() + x.mean() * torch.ones(3)) for v, x in zip(values, batches))


def test_a_compiled_function_keeps_at_most_so_many_signatures(mesh):
    """A Python number that changes every call (a step index) is a new signature each
    time: past SIGNATURES traces, new signatures run eagerly, with one CompileWarning."""
    from dask_monarch.compiled import SIGNATURES

    @dm.compile
    def scaled(x, factor):
        return x * factor

    with mesh.activate(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.ones(2)
        outs = [scaled(x, float(i)) for i in range(SIGNATURES + 3)]
        assert len(scaled._traces) == SIGNATURES
        values = dm.inspect(outs)
    warned = [w for w in caught if issubclass(w.category, dm.CompileWarning)]
    assert len(warned) == 1 and "passed as a tensor" in str(warned[0].message)
    assert [v.tolist() for v in values] == [[float(i)] * 2 for i in range(SIGNATURES + 3)]


def test_compiled_function_mutating_a_captured_tensor(mesh):
    with mesh.activate():
        counter = torch.zeros(1)

        @dm.compile
        def tick(x):
            counter.add_(1)
            return x + counter

        x = torch.zeros(1)
        for _ in range(3):
            x = tick(x)
        assert dm.inspect(counter).item() == 3.0
        assert dm.inspect(x).item() == 1.0 + 2.0 + 3.0


def test_compile_verify_detects_divergence(mesh):
    state = {"n": 0}

    @dm.compile(verify=True)
    def unstable(x):
        state["n"] += 1
        return x + 1 if state["n"] == 1 else x * 2

    with mesh.activate():
        x = torch.ones(2)
        unstable(x)
        with pytest.raises(RuntimeError, match="diverges at operation"):
            unstable(x)


def test_compile_verify_a_trace_that_keeps_what_it_returns_replays_right(mesh):
    """The verification trace sends the same messages but keeps its output (it did not the
    first time): it needs a recording of its own, and the values are those of eager calls."""

    def step(x, state):
        y = x * 2 + 1
        if state["calls"]:  # from the second call on, the output is kept as state
            state["last"] = y
        state["calls"] += 1
        return y

    compiled_state, eager_state = {"calls": 0}, {"calls": 0}
    compiled = dm.compile(verify=True)(lambda x: step(x, compiled_state))
    with mesh.activate():
        for i in range(4):
            x = torch.full((2,), float(i))
            y, e = compiled(x), step(x, eager_state)
            assert dm.inspect(y).tolist() == dm.inspect(e).tolist() == [2.0 * i + 1] * 2
            if i:
                last, expected = compiled_state["last"], eager_state["last"]
                assert dm.inspect(last).tolist() == dm.inspect(expected).tolist()


def test_a_replay_may_be_passed_the_state_it_rebinds(mesh):
    """``x = step(x)`` where step keeps its output as state: the next replay's argument is the
    handle it rebinds, and it must read the argument's value of before the call."""

    def step(x, state):
        state["last"] = x * 2 + 1
        return state["last"]

    compiled_state, eager_state = {}, {}
    compiled = dm.compile(lambda x: step(x, compiled_state))
    with mesh.activate():
        x, e = torch.ones(2), torch.ones(2)
        for _ in range(4):
            x, e = compiled(x), step(e, eager_state)
            assert dm.inspect(x).tolist() == dm.inspect(e).tolist()
            assert dm.inspect(compiled_state["last"]).tolist() == dm.inspect(e).tolist()
        assert dm.inspect(x).tolist() == [31.0, 31.0]


def test_a_failed_trace_leaves_no_borrow_behind(mesh):
    """Nothing of a failed trace was sent: its borrow is undone here, never dropped there."""
    with mesh.activate():
        x, outside = torch.ones(2), torch.zeros(2)
        side = dm.Stream("side")

        @dm.compile
        def borrows_and_fails(t):
            side.borrow(outside, mutable=True)
            raise ValueError("the traced function failed")

        with pytest.raises(ValueError, match="the traced function failed"):
            borrows_and_fails(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.collect()  # a dangling borrow would warn, then break the mesh with its drop
        assert not [w for w in caught if "without drop" in str(w.message)]
        assert dm.inspect(outside + 1).tolist() == [1.0, 1.0]  # no longer lent
        assert dm.inspect(x + 1).tolist() == [2.0, 2.0]  # and the mesh is fine


def test_compile_rules(mesh):
    with mesh.activate():
        x = torch.ones(2)

        @dm.compile
        def fetches(t):
            return dm.inspect(t)

        with pytest.raises(RuntimeError, match="inside a dm.compile function"):
            fetches(x)

        side = dm.Stream("side")

        @dm.compile
        def leaks_a_borrow(t):
            seen, _borrow = side.borrow(t)
            return t + 1

        with pytest.raises(RuntimeError, match="borrows created within a compiled function"):
            leaks_a_borrow(x)

        y, borrow = side.borrow(torch.ones(2))

        @dm.compile
        def drops_outside_borrow(t):
            borrow.drop()
            return t + 1

        with pytest.raises(ValueError, match="borrowed outside of it"):
            drops_outside_borrow(x)
        borrow.drop()

        w = torch.ones(2, requires_grad=True)
        with pytest.raises(ValueError, match="may not require grad"):
            dm.compile(lambda t: t * 2)(w)


def test_failure_inside_a_compiled_function(mesh):
    @dm.compile
    def broken(a, b):
        return a + b

    with mesh.activate():
        good = broken(torch.ones(3), torch.ones(3))
        bad = broken(torch.ones(3), _spoiled(torch.ones(3)))
        assert dm.inspect(good).tolist() == [2.0] * 3
        with pytest.raises(dm.RemoteException, match="spoiled input"):
            dm.inspect(bad)


@dm.remote(propagate=lambda x: x.clone())
def _spoiled(x):
    raise RuntimeError("spoiled input")


def test_training_example_matches_single_process_training(client4):
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
    import train_mlp

    mesh = dm.device_mesh(client4, host=2, gpu=2)
    try:
        losses, weights = train_mlp.train_on_mesh(mesh, steps=8, fetch_every=3)
    finally:
        mesh.exit()
    local_losses, local_weights = train_mlp.train_locally(steps=8, fetch_every=3)
    assert [s for s, _ in losses] == [s for s, _ in local_losses] == [0, 3, 6, 7]
    for (_, a), (_, b) in zip(losses, local_losses):
        assert abs(a - b) < 1e-5
    for a, b in zip(weights, local_weights):
        assert torch.allclose(a, b, atol=1e-5)
