"""Recordings: define once per rank, replay per stream with one CallRecording."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.raw import S0, S1, call, create_streams, failures, fetch, values

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Factory, ReduceOp, Ref
from dask_monarch.ndslice import Slice

# also run with dask_monarch.comm.emulate-nccl (tests/conftest.py)
pytestmark = pytest.mark.nccl_rules

BOTH = [0, 1]
REC = Ref(500)


def define(ctrl, ranks, commands, ref=REC, nresults=0, nformals=0, chunks=1):
    size = -(-len(commands) // chunks)
    for i in range(chunks):
        ctrl.send(
            ranks,
            m.DefineRecording(
                ref, nresults, nformals, commands[i * size : (i + 1) * size], chunks, i
            ),
        )


@pytest.mark.exercises("DefineRecording", "RecordingFormal", "RecordingResult", "CallRecording")
def test_swap_recording(ctrl):
    create_streams(ctrl, BOTH, S0)
    fx, fy = Ref(10), Ref(11)
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            m.RecordingFormal(fy, 1, S0),
            m.RecordingResult(fy, 0, S0),
            m.RecordingResult(fx, 1, S0),
        ],
        nresults=2,
        nformals=2,
    )
    ctrl.send(BOTH, call(0, Ref(1), "torch.zeros", 2))
    ctrl.send(BOTH, call(1, Ref(2), "torch.ones", 2))
    ctrl.send(BOTH, m.CallRecording(2, REC, [Ref(3), Ref(4)], [Ref(1), Ref(2)]))
    assert ctrl.sync() == []
    for rank in BOTH:
        assert torch.equal(ctrl.get_ref(rank, Ref(3), S0), torch.ones(2))
        assert torch.equal(ctrl.get_ref(rank, Ref(4), S0), torch.zeros(2))
        assert ctrl.get_ref(rank, fx, S0) is None and ctrl.get_ref(rank, fy, S0) is None


def _captured_recording(ctrl, ranks):
    """w = x + y; z.add_(1); return w + z   (z is captured, x and y are formals)."""
    fx, fy, w, out, z = Ref(10), Ref(11), Ref(12), Ref(13), Ref(3)
    define(
        ctrl,
        ranks,
        [
            m.RecordingFormal(fx, 0, S0),
            m.RecordingFormal(fy, 1, S0),
            call(0, w, "torch.ops.aten.add.Tensor", fx, fy),
            call(0, None, "torch.ops.aten.add_.Scalar", z, 1, mutates=[z]),
            call(0, out, "torch.ops.aten.add.Tensor", w, z),
            m.RecordingResult(out, 0, S0),
        ],
        nresults=1,
        nformals=2,
    )


def test_recording_with_a_captured_tensor_mutated_in_place(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.tensor", [1.0, 2.0, 3.0]))
    ctrl.send(BOTH, call(1, Ref(2), "torch.tensor", [4.0, 5.0, 6.0]))
    ctrl.send(BOTH, call(2, Ref(3), "torch.tensor", [7.0, 8.0, 9.0]))
    _captured_recording(ctrl, BOTH)
    ctrl.send(BOTH, m.CallRecording(3, REC, [Ref(4)], [Ref(1), Ref(2)]))
    assert ctrl.sync() == []
    assert torch.equal(ctrl.get_ref(1, Ref(4), S0), torch.tensor([13.0, 16.0, 19.0]))
    assert torch.equal(ctrl.get_ref(1, Ref(3), S0), torch.tensor([8.0, 9.0, 10.0]))
    ctrl.send(BOTH, m.CallRecording(4, REC, [Ref(5)], [Ref(1), Ref(2)]))  # replays again
    ctrl.sync()
    assert torch.equal(ctrl.get_ref(0, Ref(5), S0), torch.tensor([14.0, 17.0, 20.0]))
    assert ctrl.get_ref(0, Ref(12), S0) is None  # intermediates are deleted


@pytest.mark.parametrize(
    "head, last",
    [
        ([call(0, Ref(11 + i), "torch.ops.aten.add.Tensor", Ref(10 + i), 1) for i in range(2)], 50),
        (  # arguments that travel pickled: an operator's captured constant, a function's
            [
                call(0, Ref(11), "torch.ops.aten.add.Tensor", Ref(10), torch.ones(3)),
                call(0, Ref(12), "torch.add", Ref(11), torch.zeros(1)),
            ],
            49,
        ),
    ],
    ids=["adds", "captured constants"],
)
def test_replay_frees_each_intermediate_after_its_last_use(ctrl, head, last):
    """A chain of 50 adds holds one intermediate at a time, as if sent op by op. Pickled
    arguments name refs the plan sees only by loading them: it does, once, so a chain
    with captured constants too (before: every intermediate kept until the replay ended)."""
    create_streams(ctrl, [0], S0)
    chain = [m.RecordingFormal(Ref(10), 0, S0), *head]
    chain += [call(0, Ref(13 + i), "torch.ops.aten.add.Tensor", Ref(12 + i), 1) for i in range(48)]
    chain += [
        call(0, Ref(100), "helpers.remote_fns.tensors_held", Ref(60)),
        m.RecordingResult(Ref(100), 0, S0),
        m.RecordingResult(Ref(60), 1, S0),
    ]
    define(ctrl, [0], chain, nresults=2, nformals=1)
    ctrl.send(0, call(0, Ref(1), "torch.zeros", 3))
    ctrl.send(0, call(1, Ref(2), "helpers.remote_fns.tensors_held"))
    ctrl.send(0, m.CallRecording(2, REC, [Ref(3), Ref(4)], [Ref(1)]))
    assert ctrl.sync() == []
    held_before = int(ctrl.get_ref(0, Ref(2), S0))  # Ref(1)
    assert int(ctrl.get_ref(0, Ref(3), S0)) == held_before + 2  # Ref(2), the chain's last value
    assert torch.equal(ctrl.get_ref(0, Ref(4), S0), torch.full((3,), float(last)))
    assert all(ctrl.get_ref(0, Ref(r), S0) is None for r in (10, 11, 59, 60, 100))


def test_failing_recording_reports_once_and_poisons_capture_and_result(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.tensor", [1.0, 2.0, 3.0]))
    ctrl.send(BOTH, call(1, Ref(2), "torch.tensor", [4.0, 5.0, 6.0]))
    ctrl.send(BOTH, call(2, Ref(3), "torch.tensor", [7.0, 8.0]))  # a bad shape
    _captured_recording(ctrl, BOTH)
    ctrl.send(BOTH, m.CallRecording(3, REC, [Ref(4)], [Ref(1), Ref(2)]))
    reports = failures(ctrl.sync())
    assert sorted((r.seq, r.rank) for r in reports) == [(3, 0), (3, 1)]
    assert all(r.error.startswith("recording failed") for r in reports)
    assert "The size of tensor" in reports[0].error
    for ref in (Ref(4), Ref(3)):
        with pytest.raises(dm.RemoteException, match="recording failed"):
            ctrl.get_ref(0, ref, S0)
    ctrl.send(BOTH, m.CallRecording(4, REC, [Ref(5)], [Ref(1), Ref(2)]))  # z still errored
    assert failures(ctrl.sync()) == []
    with pytest.raises(dm.RemoteException):
        ctrl.get_ref(1, Ref(5), S0)


def test_later_calls_are_skipped_after_a_failure(ctrl, tmp_path):
    create_streams(ctrl, [0], S0)
    marker = str(tmp_path / "ran")
    define(
        ctrl,
        [0],
        [
            call(0, Ref(10), "helpers.remote_fns.boom", 1),
            call(0, Ref(11), "helpers.remote_fns.touch", marker),
            m.RecordingResult(Ref(11), 0, S0),
        ],
        nresults=1,
    )
    ctrl.send(0, m.CallRecording(1, REC, [Ref(1)], []))
    assert len(failures(ctrl.sync())) == 1
    assert not (tmp_path / "ran").exists()


def _generated(dask_worker, token, recording, stream):
    state = dask_worker.plugins["dask_monarch"].ranks[token]
    return state.recordings[recording].streams[stream].generated is not None


def _generate_after(replays):
    """Set ``recordings.generate-after`` in this process; returns what it was."""
    import dask.config

    before = dask.config.get("dask_monarch.recordings.generate-after")
    dask.config.set({"dask_monarch.recordings.generate-after": replays})
    return before


@pytest.fixture
def generate_at_once(client2):
    """Recordings defined meanwhile run as generated code from their second replay."""
    before = client2.run(_generate_after, 1)
    yield
    for address, replays in before.items():
        client2.run(_generate_after, replays, workers=[address])


def test_settled_plans_replay_as_generated_code_with_the_same_errors(
    ctrl, client2, tmp_path, generate_at_once
):
    """A plan replayed ``recordings.generate-after`` times runs as generated code
    (worker/plan.py): a fresh failure there still reports once, skips the later calls
    and poisons the results; an errored input fails the replay silently; a good input
    afterwards runs as before."""
    create_streams(ctrl, BOTH, S0)
    ran = tmp_path / "ran"
    fx, a, b, c = Ref(10), Ref(11), Ref(12), Ref(13)
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            call(0, a, "torch.ops.aten.add.Tensor", fx, 1),
            call(0, b, "helpers.remote_fns.positive", a),
            call(0, c, "helpers.remote_fns.touch", str(ran), b),
            m.RecordingResult(b, 0, S0),
            m.RecordingResult(c, 1, S0),
        ],
        nresults=2,
        nformals=1,
    )
    ctrl.send(BOTH, call(0, Ref(1), "torch.tensor", [1.0, 2.0]))
    ctrl.send(BOTH, call(1, Ref(2), "torch.tensor", [-5.0, 2.0]))
    ctrl.send(BOTH, m.CallRecording(3, REC, [Ref(20), Ref(21)], [Ref(1)]))
    assert ctrl.sync() == []
    assert set(
        client2.run(_generated, token=ctrl.token, recording=REC.id, stream=S0.id).values()
    ) == {True}
    ctrl.send(BOTH, m.CallRecording(4, REC, [Ref(30), Ref(31)], [Ref(2)]))
    reports = failures(ctrl.sync())
    assert sorted((r.seq, r.rank) for r in reports) == [(4, 0), (4, 1)]
    assert all(
        r.error.startswith("recording failed") and "a negative input" in r.error for r in reports
    )
    assert len(ran.read_text().split()) == 2  # the touch after the failure was skipped
    for rank in BOTH:
        for ref in (Ref(30), Ref(31)):
            with pytest.raises(dm.RemoteException, match="a negative input"):
                ctrl.get_ref(rank, ref, S0)
    ctrl.send(BOTH, m.CallRecording(5, REC, [Ref(40), Ref(41)], [Ref(30)]))  # an errored input
    assert failures(ctrl.sync()) == []
    with pytest.raises(dm.RemoteException, match="a negative input"):
        ctrl.get_ref(0, Ref(40), S0)
    ctrl.send(BOTH, m.CallRecording(6, REC, [Ref(50), Ref(51)], [Ref(1)]))
    assert ctrl.sync() == []
    for rank in BOTH:
        assert torch.equal(ctrl.get_ref(rank, Ref(50), S0), torch.tensor([2.0, 3.0]))
        assert all(ctrl.get_ref(rank, r, S0) is None for r in (fx, a, b, c))
    assert len(ran.read_text().split()) == 4


def test_recording_with_a_borrow_and_a_reduce(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    mesh = Ref(900)
    ctrl.send(BOTH, m.CreateDeviceMesh(mesh, ["gpu"], Slice.row_major([2])))
    ctrl.send(BOTH, m.BackendNetworkInit())
    ctrl.send(BOTH, m.SplitComm(["gpu"], mesh, S1))
    fx, borrowed, reduced, out = Ref(10), Ref(11), Ref(12), Ref(13)
    factory = Factory((3,), torch.float32, torch.strided, "cpu")
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            m.BorrowCreate(borrowed, 7, fx, S0, S1),
            m.BorrowFirstUse(7),
            m.Reduce(
                reduced, borrowed, factory, mesh, S1, ["gpu"], ReduceOp.SUM, False, False, None
            ),
            m.BorrowLastUse(7),
            m.BorrowDrop(7),
            call(0, out, "torch.ops.aten.mul.Tensor", reduced, 2, stream=S1),
            m.RecordingResult(out, 0, S1),
        ],
        nresults=1,
        nformals=1,
    )
    ctrl.send(BOTH, call(0, Ref(1), "helpers.remote_fns.per_rank", mesh, 3))
    for seq in (1, 2):  # borrows inside are new on every replay
        ctrl.send(BOTH, m.CallRecording(seq, REC, [Ref(10 + 10 * seq)], [Ref(1)]))
    ctrl.send(BOTH, fetch(3, Ref(20), stream=S1))
    ctrl.send(BOTH, fetch(4, Ref(30), stream=S1))
    got = values(ctrl.sync(timeout=60))
    expected = 2 * ((torch.arange(3.0) + 10) + (torch.arange(3.0) + 20))
    for seq in (3, 4):
        for rank in BOTH:
            assert torch.equal(got[(seq, rank)], expected)


def _plan_kinds(dask_worker, token, recording, stream):
    from dask_monarch.worker.plan import FastCall

    state = dask_worker.plugins["dask_monarch"].ranks[token]
    return [type(c) is FastCall for c in state.recordings[recording].streams[stream].plan]


def test_constant_lists_of_torch_operators_are_compiled_once(ctrl, client2):
    """A shape or dims list is a constant of the recording: the operator is resolved once
    (a FastCall), while a function that may change its list argument gets a fresh one on
    every replay, as outside a recording."""
    create_streams(ctrl, BOTH, S0)
    fx, v, s, g = Ref(10), Ref(11), Ref(12), Ref(13)
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            call(0, v, "torch.ops.aten.view.default", fx, [3, 2]),
            call(0, s, "torch.ops.aten.sum.dim_IntList", v, [0]),
            call(0, g, "helpers.remote_fns.grow", s, [7]),
            m.RecordingResult(g, 0, S0),
        ],
        nresults=1,
        nformals=1,
    )
    ctrl.send(BOTH, call(0, Ref(1), "torch.arange", 6.0))
    for seq in (1, 2):
        ctrl.send(BOTH, m.CallRecording(seq, REC, [Ref(10 + 10 * seq)], [Ref(1)]))
    assert ctrl.sync() == []
    for rank in BOTH:
        for out in (Ref(20), Ref(30)):
            assert torch.equal(ctrl.get_ref(rank, out, S0), torch.tensor([8.0, 11.0]))
    kinds = client2.run(_plan_kinds, token=ctrl.token, recording=REC.id, stream=S0.id)
    for plan in kinds.values():
        assert plan == [False, True, True, False, False]  # formal, view, sum, grow, result


def test_immutable_arguments_of_any_function_are_compiled_once(ctrl, client2):
    """A function that is not an ATen operator compiles too (a FastCall) when nothing it
    gets can be changed and kept for the next replay: a tuple of tuples (``ddp_hooks``'
    bucket layout, which the pytree walk cost a rank ~0.3 ms per step to resolve), or a
    list naming refs, which every replay builds afresh (``grow`` appends to it: the same
    value on every replay)."""
    create_streams(ctrl, BOTH, S0)
    fx, first, second, grown = Ref(10), Ref(11), Ref(12), Ref(13)
    layout = (((2,), (1,), 0), ((2, 2), (2, 1), 2))
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            call(0, [first, second], "dask_monarch.gradients.bucket_views", fx, layout),
            call(0, grown, "helpers.remote_fns.grow", first, [second, 7]),
            m.RecordingResult(second, 0, S0),
            m.RecordingResult(grown, 1, S0),
        ],
        nresults=2,
        nformals=1,
    )
    ctrl.send(BOTH, call(0, Ref(1), "torch.arange", 6.0))
    for seq in (1, 2, 3):
        ctrl.send(
            BOTH, m.CallRecording(seq, REC, [Ref(10 * seq + 10), Ref(10 * seq + 11)], [Ref(1)])
        )
    assert ctrl.sync() == []
    for rank in BOTH:
        for seq in (1, 2, 3):
            got = ctrl.get_ref(rank, Ref(10 * seq + 10), S0)
            assert torch.equal(got, torch.arange(2.0, 6.0).view(2, 2))
            grew = ctrl.get_ref(rank, Ref(10 * seq + 11), S0)
            assert torch.equal(grew, torch.arange(2.0) + 3)  # [second, 7] and one more
    kinds = client2.run(_plan_kinds, token=ctrl.token, recording=REC.id, stream=S0.id)
    for plan in kinds.values():
        assert plan == [False, True, True, False, False]  # formal, views, grow, results


def test_lists_of_refs_several_results_and_captured_constants_are_compiled(
    ctrl, client2, generate_at_once
):
    """What a real training step is full of also compiles once (a FastCall) and then runs
    as generated code: ``cat`` of a list of refs, an operator with several results, an
    in-place step over lists (``_foreach_add_``), and a tensor of the caller's captured
    as a constant (its pickle loaded once, for an operator that neither changes nor
    returns its arguments). An operator that changes a captured constant still gets a
    fresh copy of it on every replay; an errored ref in a list fails the call as a
    dependent, as outside a recording."""
    create_streams(ctrl, BOTH, S0)
    fx, const, s, cat, out, mean, rstd, bumped = (Ref(i) for i in range(10, 18))
    constant = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            call(0, const, "torch.ops.aten.clone.default", constant),
            call(0, s, "torch.ops.aten.add.Tensor", fx, const),
            call(0, cat, "torch.ops.aten.cat.default", [s, fx, const], 0),
            call(
                0,
                [out, mean, rstd],
                "torch.ops.aten.native_layer_norm.default",
                cat,
                [2],
                None,
                None,
                1e-5,
            ),
            call(
                0, None, "torch.ops.aten._foreach_add_.Scalar", (out, cat), 1.0, mutates=[out, cat]
            ),
            call(0, bumped, "torch.ops.aten.add_.Scalar", torch.zeros(2), 1.0),
            m.RecordingResult(out, 0, S0),
            m.RecordingResult(cat, 1, S0),
            m.RecordingResult(rstd, 2, S0),
            m.RecordingResult(bumped, 3, S0),
        ],
        nresults=4,
        nformals=1,
    )
    x = torch.arange(6.0).view(3, 2)
    ctrl.send(BOTH, call(0, Ref(1), "torch.arange", 6.0))
    ctrl.send(BOTH, call(1, Ref(2), "torch.ops.aten.view.default", Ref(1), [3, 2]))
    for seq in (2, 3, 4):  # the second and third replays run generated code
        ctrl.send(BOTH, m.CallRecording(seq, REC, [Ref(10 * seq + i) for i in range(4)], [Ref(2)]))
    assert ctrl.sync() == []
    cat_want = torch.cat([x + constant, x, constant])
    out_want, _, rstd_want = torch.native_layer_norm(cat_want, [2], None, None, 1e-5)
    for rank in BOTH:
        for seq in (2, 3, 4):
            got = [ctrl.get_ref(rank, Ref(10 * seq + i), S0) for i in range(4)]
            torch.testing.assert_close(got[0], out_want + 1)
            torch.testing.assert_close(got[1], cat_want + 1)
            torch.testing.assert_close(got[2], rstd_want)
            assert torch.equal(got[3], torch.ones(2))  # not 2, 3: a fresh constant each time
    kinds = client2.run(_plan_kinds, token=ctrl.token, recording=REC.id, stream=S0.id)
    assert set(
        client2.run(_generated, token=ctrl.token, recording=REC.id, stream=S0.id).values()
    ) == {True}
    for plan in kinds.values():  # formal, clone, add, cat, layer norm, foreach, add_, results
        assert plan == [False, True, True, True, True, True, False, False, False, False, False]
    ctrl.send(BOTH, call(5, Ref(3), "helpers.remote_fns.positive", torch.tensor([-1.0])))
    ctrl.send(BOTH, m.CallRecording(6, REC, [Ref(60 + i) for i in range(4)], [Ref(3)]))
    reports = failures(ctrl.sync())
    assert [r.seq for r in reports] == [5, 5]  # the replay fails as a dependent: unreported
    for rank in BOTH:
        with pytest.raises(dm.RemoteException, match="a negative input"):
            ctrl.get_ref(rank, Ref(60), S0)


def _plan_bindings(dask_worker, token, recording, stream):
    """Per command: does the replay call torch's Python binding of its ATen overload?"""
    from dask_monarch.worker.plan import FastCall

    state = dask_worker.plugins["dask_monarch"].ranks[token]
    plan = state.recordings[recording].streams[stream].plan
    functions = torch._C._VariableFunctions
    return [
        type(c) is FastCall and c[0] is getattr(functions, c[5].function.path.split(".")[3], 0)
        for c in plan
    ]


def test_replays_call_torch_bindings_that_reach_the_recorded_overload(ctrl, client2):
    """After its first replay a command calls torch's Python binding instead of the boxed
    overload where the binding reaches exactly that overload (checked on meta tensors):
    not for ``add.Scalar`` (the binding's ``add(t, 1)`` reaches ``add.Tensor``), nor an op
    the binding does not name (``view``), nor a random one; the values are the same."""
    create_streams(ctrl, BOTH, S0)
    fx, fy, a, b, v, r, c = (Ref(i) for i in range(10, 17))
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            m.RecordingFormal(fy, 1, S0),
            call(0, a, "torch.ops.aten.add.Tensor", fx, fy),
            call(0, b, "torch.ops.aten.add.Scalar", a, 1),
            call(0, v, "torch.ops.aten.view.default", b, [4]),
            call(0, r, "torch.ops.aten.rand_like.default", v),
            call(0, c, "torch.ops.aten.mul.Tensor", v, v),
            m.RecordingResult(c, 0, S0),
        ],
        nresults=1,
        nformals=2,
    )
    ctrl.send(BOTH, call(0, Ref(1), "torch.arange", 4.0))
    ctrl.send(BOTH, call(1, Ref(2), "torch.ones", 2, 2))
    ctrl.send(BOTH, call(2, Ref(3), "torch.ops.aten.view.default", Ref(1), [2, 2]))
    for seq in (3, 4, 5):
        ctrl.send(BOTH, m.CallRecording(seq, REC, [Ref(10 * seq - 10)], [Ref(3), Ref(2)]))
    assert ctrl.sync() == []
    want = ((torch.arange(4.0) + 2) ** 2).view(4)
    for rank in BOTH:
        for out in (Ref(20), Ref(30), Ref(40)):
            assert torch.equal(ctrl.get_ref(rank, out, S0), want)
    plans = client2.run(_plan_bindings, token=ctrl.token, recording=REC.id, stream=S0.id)
    for plan in plans.values():
        # formals, add.Tensor, add.Scalar, view, rand_like, mul.Tensor, result
        assert plan == [False, False, True, False, False, False, True, False]


def test_chunked_definition(ctrl):
    create_streams(ctrl, [0], S0)
    commands = [m.RecordingFormal(Ref(10), 0, S0)]
    for i in range(6):
        commands.append(call(0, Ref(11 + i), "torch.ops.aten.add.Scalar", Ref(10 + i), 1))
    commands.append(m.RecordingResult(Ref(16), 0, S0))
    define(ctrl, [0], commands, nresults=1, nformals=1, chunks=3)
    ctrl.send(0, call(0, Ref(1), "torch.zeros", 1))
    ctrl.send(0, m.CallRecording(1, REC, [Ref(2)], [Ref(1)]))
    ctrl.sync()
    assert ctrl.get_ref(0, Ref(2), S0).item() == 6.0


@pytest.mark.parametrize(
    "case, text",
    [
        ("second-while-defining", "while r500 is being defined"),
        ("gap-in-chunks", "chunk 2 arrived when 1 was expected"),
        ("formal-outside", "recording_formal called outside of recording"),
        ("too-few-arguments", "too few arguments"),
        ("borrow-not-dropped", "all borrows created within recording must be dropped"),
        ("status-between-chunks", "RequestStatus while recording r500 is being defined"),
        ("status-inside", "request_status not allowed in recording"),
        ("call-undefined", "not a completely defined recording"),
    ],
)
def test_recording_misuse_is_fatal(client2, case, text):
    ctrl = dm.Controller(client2, world_size=2)
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 1))
    formal = m.RecordingFormal(Ref(10), 0, S0)
    if case == "second-while-defining":
        ctrl.send(BOTH, m.DefineRecording(REC, 0, 1, [formal], 2, 0))
        ctrl.send(BOTH, m.DefineRecording(Ref(501), 0, 0, [], 1, 0))
    elif case == "gap-in-chunks":
        ctrl.send(BOTH, m.DefineRecording(REC, 0, 1, [formal], 3, 0))
        ctrl.send(BOTH, m.DefineRecording(REC, 0, 1, [], 3, 2))
    elif case == "formal-outside":
        ctrl.send(BOTH, formal)
    elif case == "too-few-arguments":
        define(ctrl, BOTH, [formal, m.RecordingFormal(Ref(11), 1, S0)], nformals=2)
        ctrl.send(BOTH, m.CallRecording(1, REC, [], [Ref(1)]))
    elif case == "borrow-not-dropped":
        define(ctrl, BOTH, [formal, m.BorrowCreate(Ref(11), 3, Ref(10), S0, S1)], nformals=1)
    elif case == "status-between-chunks":
        ctrl.send(BOTH, m.DefineRecording(REC, 0, 1, [formal], 2, 0))
        ctrl.send(BOTH, m.RequestStatus(1))
    elif case == "status-inside":
        define(ctrl, BOTH, [formal, m.RequestStatus(1)], nformals=1)
    elif case == "call-undefined":
        ctrl.send(BOTH, m.CallRecording(1, REC, [], []))
    with pytest.raises(dm.DeviceException, match=text):
        ctrl.sync(timeout=30)
    ctrl.close()


def test_calling_a_recording_whose_stream_was_dropped_is_refused_by_name(client2):
    with dm.Controller(client2, world_size=1) as ctrl:
        create_streams(ctrl, [0], S0, S1)
        fx, out = Ref(10), Ref(11)
        define(
            ctrl,
            [0],
            [
                m.RecordingFormal(fx, 0, S1),
                call(0, out, "torch.ops.aten.neg.default", fx, stream=S1),
                m.RecordingResult(out, 0, S1),
            ],
            nresults=1,
            nformals=1,
        )
        ctrl.send(0, call(1, Ref(1), "torch.ones", 2, stream=S1))
        ctrl.drop_stream([0], S1)
        ctrl.send(0, m.CallRecording(2, REC, [Ref(2)], [Ref(1)]))
        text = f"CallRecording of r{REC.id} runs on stream 1, which was dropped"
        with pytest.raises(dm.DeviceException, match=re.escape(text)):
            ctrl.sync(timeout=30)


def test_a_replay_leaves_its_lane_at_the_call_recordings_seq(ctrl, client2):
    """The commands inside carry the seqs of their trace, older than the CallRecording's: the
    dashboard and liveness warnings must show the lane at the CallRecording, not back there."""
    create_streams(ctrl, BOTH, S0)
    fx, out = Ref(10), Ref(11)
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            call(0, out, "torch.neg", input=fx),  # a ref in kwargs: run by its handler
            m.RecordingResult(out, 0, S0),
        ],
        nresults=1,
        nformals=1,
    )
    ctrl.send(BOTH, call(1, Ref(1), "torch.ones", 2))
    ctrl.send(BOTH, m.CallRecording(7, REC, [Ref(2)], [Ref(1)]))
    assert ctrl.sync() == []

    def lane_0(token, dask_worker=None):
        (mine,) = [
            e for e in dask_worker.plugins["dask_monarch"].state_snapshot() if e["token"] == token
        ]
        (lane,) = [lane for lane in mine["lanes"] if lane["stream"] == 0]
        return lane["last_seq"], lane["done_seq"]

    assert set(client2.run(lane_0, ctrl.token).values()) == {(7, 7)}


def _recording_ids(token, dask_worker=None):
    return sorted(dask_worker.plugins["dask_monarch"].ranks[token].recordings)


@pytest.mark.exercises("DeleteRefs", "CallRecording")
def test_deleting_a_recording_frees_it_after_its_replays_and_refuses_later_calls(client2):
    """``DeleteRefs`` of a recording's ref (a compiled function the client collected) runs on
    each stream after the replays sent before it: every rank frees the recording once
    each of its streams passed the delete, and a later call of it is refused by name."""
    ctrl = dm.Controller(client2, world_size=2)
    create_streams(ctrl, BOTH, S0, S1)
    fx, out, side = Ref(10), Ref(11), Ref(12)
    define(
        ctrl,
        BOTH,
        [
            m.RecordingFormal(fx, 0, S0),
            call(0, out, "torch.ops.aten.neg.default", fx),
            call(0, side, "torch.ones", 2, stream=S1),  # a part on stream 1 too
            m.RecordingResult(out, 0, S0),
        ],
        nresults=1,
        nformals=1,
    )
    ctrl.send(BOTH, call(1, Ref(1), "torch.ones", 2))
    ctrl.send(BOTH, m.CallRecording(2, REC, [Ref(2)], [Ref(1)]))
    assert ctrl.sync() == []
    assert set(map(tuple, client2.run(_recording_ids, ctrl.token).values())) == {(REC.id,)}
    ctrl.send(BOTH, m.CallRecording(3, REC, [Ref(3)], [Ref(2)]))
    ctrl.send(BOTH, m.DeleteRefs([REC]))
    assert ctrl.sync() == []
    for rank in BOTH:
        assert torch.equal(ctrl.get_ref(rank, Ref(3), S0), torch.ones(2))
    assert set(map(tuple, client2.run(_recording_ids, ctrl.token).values())) == {()}
    ctrl.send(BOTH, m.CallRecording(4, REC, [Ref(4)], [Ref(3)]))
    with pytest.raises(dm.DeviceException, match="not a completely defined recording"):
        ctrl.sync(timeout=30)
    ctrl.close()
