"""The pre-dispatch check (DESIGN decision 14): what would hang or mismatch is refused first."""

from __future__ import annotations

import time

import pytest
import torch
from helpers.raw import S0, S1, call, create_streams, fetch, values

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.compiler import Compiler
from dask_monarch.messages import Factory, ReduceOp, Ref
from dask_monarch.ndslice import Slice

MESH = Ref(900)
BOTH = (0, 1)
FACTORY = Factory((3,), torch.float32, torch.strided, "cpu")
R0, R1 = Slice(0, [1], [1]), Slice(1, [1], [1])


def setup(world: int = 2, sizes=None, names=("gpu",), splits=(("gpu",),)) -> list:
    everyone = tuple(range(world))
    msgs = [
        (everyone, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)),
        (everyone, m.CreateStream(S1, m.StreamCreationMode.CreateNewStream)),
        (everyone, m.CreateDeviceMesh(MESH, list(names), Slice.row_major(sizes or [world]))),
        (everyone, m.BackendNetworkInit()),
    ]
    for dims in splits:
        msgs += [(everyone, m.SplitComm(list(dims), MESH, s)) for s in (S0, S1)]
    msgs += [
        (everyone, m.BackendNetworkPointToPointInit(S0, S0)),
        (everyone, m.BackendNetworkPointToPointInit(S0, S1)),
    ]
    return msgs


def reduce_msg(
    result,
    shape=(3,),
    dtype=torch.float32,
    op=ReduceOp.SUM,
    stream=S0,
    dims=("gpu",),
    tensor=Ref(1),
):
    return m.Reduce(
        Ref(result),
        tensor,
        Factory(shape, dtype, torch.strided, "cpu"),
        MESH,
        stream,
        list(dims),
        op,
        False,
        False,
        None,
    )


def send_msg(result, frm=R0, to=R1, src=S0, dst=S0):
    return m.SendTensor(Ref(result), frm, to, Ref(1), FACTORY, src, dst)


def compiler(world: int = 2, **kwargs) -> Compiler:
    c = Compiler("tok", [f"monarch-rank{i}" for i in range(world)])
    plan = c.compile(setup(world, **kwargs))
    assert plan.error is None, plan.error
    return c


def refused(c: Compiler, flushes: list[list], final: bool = False):
    """Compile each flush in turn; the error of the first refused one (None if none is)."""
    for i, flush in enumerate(flushes):
        plan = c.compile(flush, final=final and i == len(flushes) - 1)
        if plan.error is not None:
            assert plan.graph is None and plan.messages == 0  # nothing of it is submitted
            return plan.error
    return None


# ------------------------------------------------------------------ collectives and sends


def test_a_collective_may_span_flushes():
    c = compiler()
    assert (
        refused(
            c,
            [
                [((0,), reduce_msg(10))],
                [((0,), reduce_msg(11))],
                [((1,), reduce_msg(10)), ((1,), reduce_msg(11))],
            ],
        )
        is None
    )
    assert not c.check.busy  # every member passed both


def test_a_member_sent_another_collective_first_is_refused():
    c = compiler()
    error = refused(c, [[((0,), reduce_msg(10))], [(BOTH, reduce_msg(11))]])
    assert error.rank == 1
    assert "result r11" in error.cause and "result r10" in error.cause
    assert "same order" in error.cause


def test_members_receiving_collectives_in_another_order_are_refused():
    c = compiler()
    error = refused(
        c,
        [
            [
                ((0,), reduce_msg(10)),
                ((0,), reduce_msg(11)),
                ((1,), reduce_msg(11)),
                ((1,), reduce_msg(10)),
            ]
        ],
    )
    assert error is not None and "in another order" in error.cause


@pytest.mark.parametrize(
    "other, text",
    [
        (dict(shape=(4,)), "rank 1 has shape (4,) torch.float32 but rank 0 (3,) torch.float32"),
        (dict(dtype=torch.float64), "torch.float64 but rank 0 (3,) torch.float32"),
        (dict(op=ReduceOp.MAX), "rank 1 does max but rank 0 sum"),
    ],
)
def test_members_disagreeing_on_one_collective_are_refused(other, text):
    c = compiler()
    error = refused(c, [[((0,), reduce_msg(10))], [((1,), reduce_msg(10, **other))]])
    assert error.rank == 1 and text in error.cause


def test_groups_are_the_ranks_sharing_the_other_coordinates():
    """On a 2x2 mesh a Reduce over "gpu" is two groups: {0, 1} and {2, 3}."""
    c = compiler(4, sizes=[2, 2], names=("host", "gpu"), splits=(("gpu",), ("host",)))
    # host 0 reduces twice, host 1 not yet: legal
    assert refused(c, [[((0, 1), reduce_msg(10)), ((0, 1), reduce_msg(11))]]) is None
    assert refused(c, [[((2, 3), reduce_msg(10))]]) is None
    # over "host": {0, 2} and {1, 3}; rank 3 gets another one than rank 1
    error = refused(
        c, [[((0, 1, 2), reduce_msg(12, dims=("host",))), ((3,), reduce_msg(13, dims=("host",)))]]
    )
    assert error.rank == 3 and "ranks [1, 3])" in error.cause


def test_sends_between_a_pair_keep_one_order_per_stream_pair():
    c = compiler()
    assert refused(c, [[(BOTH, send_msg(20)), (BOTH, send_msg(21, src=S0, dst=S1))]]) is None
    error = refused(
        c,
        [[((0,), send_msg(22)), ((0,), send_msg(23)), ((1,), send_msg(23)), ((1,), send_msg(22))]],
    )
    assert error.rank == 1 and "SendTensor r23" in error.cause


def test_a_send_between_slices_of_different_sizes_is_refused_with_the_worker_text():
    c = compiler()
    error = refused(c, [[(BOTH, send_msg(20, frm=R0, to=Slice(0, [2], [1])))]])
    assert "both slices must have the same size" in error.cause


def test_without_a_communicator_it_is_refused_with_the_worker_text():
    c = compiler(splits=())
    error = refused(c, [[(BOTH, reduce_msg(10))]])
    assert "SplitComm was not sent" in error.cause
    c = compiler()
    error = refused(c, [[(BOTH, send_msg(20, src=S1, dst=S0))]])
    assert "BackendNetworkPointToPointInit was not sent" in error.cause


# ------------------------------------------------------------------ waits that never end


def test_a_collective_and_a_borrow_waiting_on_each_other_are_refused():
    """Rank 0's stream 0 waits at a first use whose create is queued behind a Reduce on
    stream 1, which waits for rank 1; rank 1 reaches that Reduce only after a send from rank
    0's stream 0, queued behind the first use."""
    c = compiler()
    flush = [
        ((0,), reduce_msg(30, stream=S1)),
        ((0,), m.BorrowCreate(Ref(5), 1, Ref(1), S1, S0)),
        ((0,), m.BorrowFirstUse(1)),
        (BOTH, m.SendTensor(Ref(31), R0, R1, Ref(1), FACTORY, S0, S1)),
        ((1,), reduce_msg(30, stream=S1)),
    ]
    error = refused(c, [flush])
    assert error is not None and "wait on each other forever" in error.cause
    assert "BorrowFirstUse 1" in error.cause and "result r30" in error.cause


def test_control_steps_building_communicators_in_another_order_are_refused():
    c = Compiler("tok", ["a", "b"])
    flush = [
        (BOTH, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)),
        (BOTH, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2]))),
        (BOTH, m.BackendNetworkInit()),
        ((0,), m.SplitComm(["gpu"], MESH, S0)),
        ((0,), m.BackendNetworkPointToPointInit(S0, S0)),
        ((1,), m.BackendNetworkPointToPointInit(S0, S0)),
        ((1,), m.SplitComm(["gpu"], MESH, S0)),
    ]
    error = refused(c, [flush])
    assert error is not None and "control lane waits at" in error.cause


def test_a_member_that_exited_without_its_part_is_refused():
    c = compiler()
    error = refused(c, [[((0,), reduce_msg(10))], [((1,), m.Exit())]])
    assert error.rank == 0 and "rank 1, which exited without it" in error.cause


def test_waiting_for_what_was_never_sent_is_refused_at_the_wait():
    c = compiler()
    assert refused(c, [[((0,), reduce_msg(10))]]) is None  # not sent yet is legal ...
    error = refused(c, [[]], final=True)  # ... until someone waits for it
    assert error.rank == 0 and "rank 1, which was not sent it" in error.cause
    c = compiler()
    assert (
        refused(
            c,
            [
                [(BOTH, m.BackendNetworkPointToPointInit(S1, S1))],
                [((0,), send_msg(40, src=S1, dst=S1))],
            ],
        )
        is None
    )
    read_rank_1 = c.compile([], final=(1, 0))
    assert read_rank_1.error is None  # rank 1's stream 0 waits for nothing
    read_rank_0 = c.compile([], final=(0, 1))
    assert "SendTensor r40" in read_rank_0.error.cause


def _borrow_steps(bid, lender=S0, borrower=S1):
    return [
        ((0,), m.BorrowCreate(Ref(5), bid, Ref(1), lender, borrower)),
        ((0,), m.BorrowFirstUse(bid)),
        ((0,), m.BorrowLastUse(bid)),
        ((0,), m.BorrowDrop(bid)),
    ]


@pytest.mark.parametrize("drop_ran", [False, True])
def test_a_borrow_id_comes_back_only_once_its_drop_is_known_to_have_run(drop_ran):
    done: dict = {}  # the controller's reports: (rank, lane) -> last segment finished
    c = Compiler("tok", ["a", "b"], done)
    assert c.compile(setup()).error is None
    plan = c.compile(_borrow_steps(1))
    assert plan.error is None
    if drop_ran:
        done[(0, 0)] = plan.counts[(0, 0)]  # the lender's segment with the drop finished
    error = refused(c, [_borrow_steps(1, lender=S1, borrower=S0)])
    if drop_ran:
        assert error is None
    else:
        assert error.rank == 0 and "use a new borrow id" in error.cause


class _CountingDone(dict):
    """The controller's reports, counting how often the compiler looks at them."""

    looks = 0

    def get(self, *args):
        self.looks += 1
        return super().get(*args)


def test_drops_a_far_behind_rank_has_not_run_are_not_rescanned_at_every_drop():
    """A client far ahead of its ranks keeps thousands of drops that have not run; looking
    for those that ran stays amortised O(1) per drop (it was a scan of them all per drop)."""
    done = _CountingDone()
    c = Compiler("tok", ["a", "b"], done)
    assert c.compile(setup()).error is None
    n = 5000
    for first in range(0, n, 500):
        steps = [step for bid in range(first, first + 500) for step in _borrow_steps(bid + 1)]
        assert c.compile(steps).error is None
    assert len(c.check.dropped[0]) == n  # none of them ran
    assert done.looks < 5 * n, done.looks


def test_recordings_bring_the_waits_of_their_commands():
    c = compiler()
    rec = Ref(70)
    commands = [
        m.RecordingFormal(Ref(71), 0, S0),
        reduce_msg(72, tensor=Ref(71)),
        m.RecordingResult(Ref(72), 0, S0),
    ]
    define = m.DefineRecording(rec, 1, 1, commands, 1, 0)
    assert (
        refused(c, [[(BOTH, define), (BOTH, m.CallRecording(1, rec, [Ref(73)], [Ref(1)]))]]) is None
    )
    assert not c.check.busy
    error = refused(
        c, [[((0,), m.CallRecording(2, rec, [Ref(74)], [Ref(1)])), (BOTH, reduce_msg(75))]]
    )
    assert error.rank == 1 and "result r75" in error.cause and "result r72" in error.cause


def test_the_fast_path_never_reaches_the_check():
    """Calls and fetches cost the check nothing; a Reduce does reach it."""
    c = compiler()

    class Refuse:
        busy = ()

        def lane(self, *args):
            raise AssertionError("checked a fast-path message")

        reduce = lane

        def control(self, *args):
            raise AssertionError("checked a fast-path message")

        def settle(self):
            pass

    real, c.check = c.check, Refuse()
    plan = c.compile(
        [(BOTH, call(i, Ref(100 + i), "torch.ones", 3)) for i in range(50)]
        + [(BOTH, fetch(60, Ref(100)))]
    )
    assert plan.error is None and plan.messages == 51
    with pytest.raises(AssertionError, match="checked"):
        c.compile([(BOTH, reduce_msg(10))])
    c.check = real


# ------------------------------------------------------------------ on a cluster


@pytest.mark.timeout(120)
def test_raw_controller_refuses_with_device_exception_and_runs_nothing(client2, tmp_path):
    ctrl = dm.Controller(client2, world_size=2)
    try:
        create_streams(ctrl, BOTH, S0)
        ctrl.send(BOTH, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2])))
        ctrl.send(BOTH, m.BackendNetworkInit())
        ctrl.send(BOTH, m.SplitComm(["gpu"], MESH, S0))
        ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
        ctrl.sync(timeout=60)
        marker = tmp_path / "ran"
        ctrl.send(BOTH, call(1, None, "helpers.remote_fns.touch", str(marker)))
        ctrl.send(0, reduce_msg(10))
        ctrl.send(1, reduce_msg(10, shape=(4,)))
        with pytest.raises(dm.DeviceException, match="rank 1 has shape") as info:
            ctrl.sync(timeout=60)
        assert info.value.rank == 1
        assert not marker.exists()  # nothing of the refused flush ran
    finally:
        ctrl.close()


@pytest.mark.timeout(120)
def test_sync_refuses_a_collective_a_member_was_never_sent(client2):
    ctrl = dm.Controller(client2, world_size=2)
    try:
        create_streams(ctrl, BOTH, S0)
        ctrl.send(BOTH, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2])))
        ctrl.send(BOTH, m.BackendNetworkInit())
        ctrl.send(BOTH, m.SplitComm(["gpu"], MESH, S0))
        ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
        ctrl.send(0, reduce_msg(10))
        ctrl.flush()  # legal so far: rank 1's part may come in a later flush
        ctrl.send(1, reduce_msg(10))
        ctrl.send(BOTH, fetch(1, Ref(10)))
        got = values(ctrl.sync(timeout=60))
        assert torch.equal(got[(1, 1)], torch.full((3,), 2.0))
        ctrl.send(0, reduce_msg(11))
        ctrl.flush()
        start = time.monotonic()
        with pytest.raises(dm.DeviceException, match="rank 1, which was not sent it") as info:
            ctrl.sync(timeout=60)  # at once, not after the collective timeout
        assert info.value.rank == 0
        assert time.monotonic() - start < 30  # a generous bound: not the collective timeout
    finally:
        ctrl.close()
