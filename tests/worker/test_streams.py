"""Streams run concurrently on every rank; borrows synchronise them (issue: streams)."""

from __future__ import annotations

import re
import time

import pytest
import torch
from helpers.raw import S0, S1, S2, S3, call, create_streams, failures, fetch, values
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import Ref
from dask_monarch.ndslice import Slice

BOTH = [0, 1]


def borrow(ctrl, ranks, bid, result, tensor, src, dst):
    ctrl.send(ranks, m.BorrowCreate(result, bid, tensor, src, dst))


def test_streams_of_a_rank_run_at_once(ctrl):
    """Two streams wait on one 2-party barrier: it completes only if both run together."""
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(
        BOTH, call(0, Ref(1), "helpers.remote_fns.barrier_wait", f"proof-{ctrl.token}", stream=S0)
    )
    ctrl.send(
        BOTH, call(1, Ref(2), "helpers.remote_fns.barrier_wait", f"proof-{ctrl.token}", stream=S1)
    )
    assert ctrl.sync(timeout=60) == []
    for rank in BOTH:
        assert torch.equal(ctrl.get_ref(rank, Ref(1), S0), torch.ones(1))
        assert torch.equal(ctrl.get_ref(rank, Ref(2), S1), torch.ones(1))


def test_each_stream_has_its_own_thread(ctrl):
    create_streams(ctrl, [0], S0, S1)
    ctrl.send(0, call(0, Ref(1), "helpers.remote_fns.thread_name", stream=S0))
    ctrl.send(0, call(1, Ref(2), "helpers.remote_fns.thread_name", stream=S1))
    ctrl.sync()
    names = {ctrl.get_ref(0, Ref(1), S0), ctrl.get_ref(0, Ref(2), S1)}
    assert len(names) == 2 and all(ctrl.token in name for name in names)


@pytest.mark.exercises("BorrowCreate", "BorrowFirstUse", "BorrowLastUse", "BorrowDrop")
def test_borrow_shares_storage_and_in_place_changes_come_back(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 4))
    borrow(ctrl, BOTH, 1, Ref(2), Ref(1), S0, S1)
    ctrl.send(BOTH, m.BorrowFirstUse(1))
    ctrl.send(
        BOTH,
        call(1, None, "torch.ops.aten.sub_.Tensor", Ref(2), Ref(2), mutates=[Ref(2)], stream=S1),
    )
    ctrl.send(BOTH, m.BorrowLastUse(1))
    ctrl.send(BOTH, m.BorrowDrop(1))
    ctrl.send(BOTH, fetch(2, Ref(1), stream=S0))
    got = values(ctrl.sync())
    assert torch.equal(got[(2, 0)], torch.zeros(4)) and torch.equal(got[(2, 1)], torch.zeros(4))
    assert ctrl.get_ref(0, Ref(2), S1) is None  # the borrower's binding is gone


def test_borrowing_an_errored_value_reports_once(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "helpers.remote_fns.boom", 1))
    borrow(ctrl, BOTH, 1, Ref(2), Ref(1), S0, S1)
    ctrl.send(BOTH, m.BorrowFirstUse(1))
    ctrl.send(BOTH, call(1, Ref(3), "torch.ops.aten.neg.default", Ref(2), stream=S1))
    ctrl.send(BOTH, m.BorrowLastUse(1))
    ctrl.send(BOTH, m.BorrowDrop(1))
    reports = failures(ctrl.sync())
    assert sorted((r.seq, r.rank) for r in reports) == [(0, 0), (0, 1)]
    with pytest.raises(dm.RemoteException, match="boom from a remote function"):
        ctrl.get_ref(1, Ref(3), S1)


def test_lender_may_delete_its_ref_while_lent(ctrl):
    create_streams(ctrl, [0], S0, S1)
    ctrl.send(0, call(0, Ref(1), "torch.full", [2], 5.0))
    borrow(ctrl, 0, 1, Ref(2), Ref(1), S0, S1)
    ctrl.send(0, m.DeleteRefs([Ref(1)]))  # the borrow keeps the object alive
    ctrl.send(0, m.BorrowFirstUse(1))
    ctrl.send(0, fetch(1, Ref(2), stream=S1))
    ctrl.send(0, m.BorrowLastUse(1))
    ctrl.send(0, m.DeleteRefs([Ref(2)]))  # after the last use: a no-op
    ctrl.send(0, m.BorrowDrop(1))
    got = values(ctrl.sync())
    assert torch.equal(got[(1, 0)], torch.full((2,), 5.0))
    assert ctrl.get_ref(0, Ref(1), S0) is None


def test_borrow_spanning_flushes(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
    borrow(ctrl, BOTH, 7, Ref(2), Ref(1), S0, S1)
    ctrl.flush()
    ctrl.send(BOTH, m.BorrowFirstUse(7))
    ctrl.send(
        BOTH, call(1, None, "torch.ops.aten.mul_.Scalar", Ref(2), 3, mutates=[Ref(2)], stream=S1)
    )
    ctrl.sync()
    ctrl.send(BOTH, m.BorrowLastUse(7))
    ctrl.flush()
    ctrl.send(BOTH, m.BorrowDrop(7))
    ctrl.send(BOTH, fetch(2, Ref(1)))
    got = values(ctrl.sync())
    assert torch.equal(got[(2, 1)], torch.full((2,), 3.0))


def test_wrong_stream_use_without_borrow_is_a_user_error(ctrl):
    create_streams(ctrl, [0], S0, S1)
    ctrl.send(0, call(0, Ref(1), "torch.ones", 2))
    ctrl.send(0, call(1, Ref(2), "torch.ops.aten.neg.default", Ref(1), stream=S1))
    reports = failures(ctrl.sync())
    assert len(reports) == 1 and "ref not found: r1" in reports[0].error


def test_four_streams_with_interleaved_borrows_do_not_deadlock(ctrl):
    """Every lane lends to the next and borrows from the previous, in a ring.

    Each lane's segment holds create, first use, slow work, last use and drop:
    a drop blocks its lane until the next lane passed its last use, so the ring
    finishes only if all four lanes run at once (a pool with fewer threads, or
    one shared thread, deadlocks here).
    """
    streams = [S0, S1, S2, S3]
    create_streams(ctrl, BOTH, *streams)
    for i, s in enumerate(streams):
        ctrl.send(BOTH, call(i, Ref(10 + i), "torch.full", [2], float(i), stream=s))
    for i, s in enumerate(streams):  # lane i lends its tensor to lane i+1
        borrow(ctrl, BOTH, 100 + i, Ref(20 + i), Ref(10 + i), s, streams[(i + 1) % 4])
    for i in range(4):
        ctrl.send(BOTH, m.BorrowFirstUse(100 + i))
    for i in range(4):  # lane i+1 copies slowly what lane i lent it
        ctrl.send(
            BOTH,
            call(
                10 + i,
                Ref(30 + i),
                "helpers.remote_fns.slow_copy",
                Ref(20 + i),
                0.2,
                stream=streams[(i + 1) % 4],
            ),
        )
    for i in range(4):
        ctrl.send(BOTH, m.BorrowLastUse(100 + i))
    for i in range(4):
        ctrl.send(BOTH, m.BorrowDrop(100 + i))
    ctrl.send(BOTH, m.RequestStatus(20))
    start = time.monotonic()
    reports = ctrl.sync(timeout=60)
    assert sorted((r.seq, r.rank) for r in reports) == [(21, 0), (21, 1)]
    assert time.monotonic() - start < 30
    for i in range(4):
        copied = ctrl.get_ref(1, Ref(30 + i), streams[(i + 1) % 4])
        assert torch.equal(copied, torch.full((2,), float(i)))


def test_request_status_waits_for_a_stream_blocked_at_first_use(ctrl):
    create_streams(ctrl, [0], S0, S1)
    ctrl.send(0, call(0, Ref(1), "torch.ones", 2))
    ctrl.send(0, call(1, Ref(2), "helpers.remote_fns.slow_copy", Ref(1), 1.0))  # the lender is busy
    borrow(ctrl, 0, 1, Ref(3), Ref(2), S0, S1)
    ctrl.send(0, m.BorrowFirstUse(1))  # S1 blocks here for about a second
    ctrl.send(0, fetch(2, Ref(3), stream=S1))
    ctrl.send(0, m.RequestStatus(2))
    start = time.monotonic()
    reports = ctrl.sync(timeout=60)
    assert time.monotonic() - start >= 0.9
    assert [type(r) for r in reports] == [m.FetchResult, m.Status]
    assert reports[1].seq == 3


def _only(token):
    """True on a worker whose only lane is the control lane of controller ``token``."""

    def check(dask_worker):
        plugin = dask_worker.plugins["dask_monarch"]
        return list(plugin.ranks) == [token] and plugin.extra_threads == 1

    return check


def test_lanes_raise_the_workers_thread_budget(ctrl, client2):
    deadline = time.monotonic() + 30  # lanes of earlier tests are retired once they return
    while not all(client2.run(_only(ctrl.token)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    before = client2.run(lambda dask_worker: dask_worker.state.nthreads)
    create_streams(ctrl, BOTH, S0, S1, S2)
    ctrl.sync()
    after = client2.run(lambda dask_worker: dask_worker.state.nthreads)
    assert all(after[a] == before[a] + 3 for a in ctrl.workers)
    ctrl.close()
    time.sleep(0.5)
    final = client2.run(lambda dask_worker: dask_worker.state.nthreads)
    assert all(final[a] == before[a] - 1 for a in ctrl.workers)  # minus the control lane


@pytest.mark.parametrize(
    "case, text",
    [
        ("unknown-borrow", "unknown borrow 9"),
        ("first-use-twice", "in state 'first-used' (expected 'created')"),
        ("drop-before-last-use", "in state 'first-used' (expected 'last-used')"),
        ("unknown-stream", "stream 5, which was never created"),
        ("missing-tensor", "stream 0: BorrowCreate 1: r42 is not on this stream"),
        ("last-use-of-deleted", "stream 1: BorrowLastUse 1: r2 is not on this stream"),
    ],
)
def test_borrow_misuse_is_fatal(client2, case, text):
    ctrl = dm.Controller(client2, world_size=2)
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
    if case == "unknown-borrow":
        ctrl.send(BOTH, m.BorrowFirstUse(9))
    elif case == "first-use-twice":
        borrow(ctrl, BOTH, 1, Ref(2), Ref(1), S0, S1)
        ctrl.send(BOTH, m.BorrowFirstUse(1))
        ctrl.send(BOTH, m.BorrowFirstUse(1))
    elif case == "drop-before-last-use":
        borrow(ctrl, BOTH, 1, Ref(2), Ref(1), S0, S1)
        ctrl.send(BOTH, m.BorrowFirstUse(1))
        ctrl.send(BOTH, m.BorrowDrop(1))
    elif case == "unknown-stream":
        borrow(ctrl, BOTH, 1, Ref(2), Ref(1), S0, m.StreamRef(5))
    elif case == "missing-tensor":
        borrow(ctrl, BOTH, 1, Ref(2), Ref(42), S0, S1)
    elif case == "last-use-of-deleted":
        borrow(ctrl, BOTH, 1, Ref(2), Ref(1), S0, S1)
        ctrl.send(BOTH, m.BorrowFirstUse(1))
        ctrl.send(BOTH, m.DeleteRefs([Ref(2)]))
        ctrl.send(BOTH, m.BorrowLastUse(1))
    with pytest.raises(dm.DeviceException, match=re.escape(text)):
        ctrl.sync(timeout=30)
    ctrl.close()


@pytest.mark.parametrize("case", ["borrowed-missing-tensor", "reduced-missing-tensor"])
def test_a_fatal_error_names_its_lane_once(client2, case):
    """The rank leads a segment's fatal error with the lane it ended; messages that named the
    lane themselves read twice ("stream 0: BorrowCreate 1: r42 is not on stream 0")."""
    ctrl = dm.Controller(client2, world_size=2)
    create_streams(ctrl, BOTH, S0, S1)
    if case == "borrowed-missing-tensor":
        borrow(ctrl, BOTH, 1, Ref(2), Ref(42), S0, S1)
    else:
        mesh = Ref(900)
        ctrl.send(BOTH, m.CreateDeviceMesh(mesh, ["gpu"], Slice(0, [2], [1])))
        ctrl.send(BOTH, m.BackendNetworkInit())
        ctrl.send(BOTH, m.SplitComm(["gpu"], mesh, S0))
        factory = m.Factory((2,), torch.float32, torch.strided, "cpu")
        total = m.ReduceOp.SUM
        reduce = m.Reduce(Ref(2), Ref(42), factory, mesh, S0, ["gpu"], total, False, False, None)
        ctrl.send(BOTH, reduce)
    with pytest.raises(dm.DeviceException) as raised:
        ctrl.sync(timeout=30)
    text = str(raised.value)
    assert text.count("stream 0") == 1 and "stream 0: " in text, text
    ctrl.close()


# -- dropped streams (Controller.drop_stream, what a garbage dm.Stream sends) ----------------


def _lanes_and_threads(token, dask_worker=None):
    import threading

    from dask_monarch.protocol.names import PLUGIN_NAME, executor_prefix

    plugin = dask_worker.plugins[PLUGIN_NAME]
    state = plugin.ranks[token]
    threads = sorted(
        t.name for t in threading.enumerate() if t.name.startswith(executor_prefix(token))
    )
    # every lane's thread is in the budget, and no released lane's is any more (an earlier
    # test's controller gives its lanes' threads back once their work returned)
    settled = plugin.extra_threads == sum(len(s.all_lanes()) for s in plugin.ranks.values())
    nthreads = dask_worker.state.nthreads if settled else None
    return sorted(map(str, state.lanes)), threads, nthreads


@pytest.mark.timeout(120)
def test_drop_stream_runs_after_the_streams_work_then_ends_its_lane(ctrl, client2, tmp_path):
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.sync()

    def settled(lanes_now: list[str]) -> dict | None:
        now = client2.run(_lanes_and_threads, ctrl.token)
        ok = all(lanes == lanes_now and n is not None for lanes, _, n in now.values())
        return now if ok else None

    before = wait_until(lambda: settled(["0", "1"]), 30, "the workers' thread budgets settled")
    ctrl.send(
        BOTH,
        call(0, Ref(1), "helpers.remote_fns.sleep_then", 0.5, str(tmp_path / "ran"), stream=S1),
    )
    ctrl.send(BOTH, fetch(1, Ref(1), stream=S1))
    ctrl.drop_stream(BOTH, S1)  # queued behind the sleep: it must not cut it short
    ctrl.send(BOTH, call(2, Ref(2), "torch.ones", 2))
    got = values(ctrl.sync(timeout=60))
    assert torch.equal(got[(1, 0)], torch.ones(1)) and torch.equal(got[(1, 1)], torch.ones(1))
    assert len((tmp_path / "ran").read_text().split()) == 2

    after = wait_until(lambda: settled(["0"]), 30, "lane 1 dropped on both ranks")
    for address, (lanes, threads, nthreads) in after.items():
        assert lanes == ["0"]
        assert not any(t.startswith(f"monarch-{ctrl.token}-1_") for t in threads)
        assert nthreads == before[address][2] - 1  # the dropped lane's thread went back
    assert torch.equal(ctrl.get_ref(0, Ref(2), S0), torch.ones(2))


@pytest.mark.timeout(120)
def test_a_dropped_stream_cannot_be_used_or_created_again(client2):
    for late in ("use", "create"):
        with dm.Controller(client2, world_size=2) as ctrl:
            create_streams(ctrl, BOTH, S0, S1)
            ctrl.drop_stream(BOTH, S1)
            if late == "use":
                ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2, stream=S1))
                text = "CallFunction names stream 1, which was dropped"
            else:
                ctrl.send(BOTH, m.CreateStream(S1, m.StreamCreationMode.CreateNewStream))
                text = "CreateStream of stream 1, which was dropped"
            with pytest.raises(dm.DeviceException, match=re.escape(text)):
                ctrl.sync(timeout=30)


@pytest.mark.timeout(120)
def test_a_stream_with_an_open_borrow_cannot_be_dropped(client2):
    """The borrow's last steps run on both its streams: dropping either first is refused by
    name, not left to break the mesh when Dask finds the lane gone."""
    for dropped in (S0, S1):
        with dm.Controller(client2, world_size=1) as ctrl:
            create_streams(ctrl, [0], S0, S1)
            ctrl.send(0, call(0, Ref(1), "torch.ones", 2))
            borrow(ctrl, 0, 1, Ref(2), Ref(1), S0, S1)
            ctrl.send(0, m.BorrowFirstUse(1))
            ctrl.drop_stream([0], dropped)
            ctrl.send(0, m.BorrowLastUse(1))
            ctrl.send(0, m.BorrowDrop(1))
            text = f"drop_stream of stream {dropped.id} while borrow 1 (from stream 0 to stream 1)"
            with pytest.raises(dm.DeviceException, match=re.escape(text)):
                ctrl.sync(timeout=30)


@pytest.mark.timeout(120)
def test_errors_and_the_dashboard_name_a_named_stream(client2):
    with dm.Controller(client2, world_size=2) as ctrl:
        ctrl.name_stream(S1, "comms")
        create_streams(ctrl, BOTH, S0, S1)
        ctrl.sync()
        snapshot = client2.run(
            lambda dask_worker: dask_worker.plugins["dask_monarch"].state_snapshot()
        )
        for entries in snapshot.values():
            (mine,) = [e for e in entries if e["token"] == ctrl.token]
            assert {lane["stream"]: lane["name"] for lane in mine["lanes"]} == {
                0: None,
                1: "comms",
                "control": None,
            }
        ctrl.send(BOTH, call(0, Ref(1), "__test_panic", stream=S1))
        with pytest.raises(dm.DeviceException, match=re.escape("stream 'comms' (1): ")):
            ctrl.sync(timeout=30)
