"""Order holds by construction: per (rank, stream) execution order is message order."""

from __future__ import annotations

import os
import time

import dask
import pytest
import torch
from distributed.utils import key_split
from helpers.raw import S0, S1, call, create_streams, fetch, mixes_on_two_streams, values
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.compiler import Compiler, ProtocolError
from dask_monarch.messages import Ref
from dask_monarch.ndslice import Slice


def expected(n: int, offset: int) -> int:
    x = 0
    for i in range(n):
        x = (3 * x + i + offset) % 1_000_003
    return x


def test_500_dependent_in_place_ops_on_two_streams_and_two_ranks(client2):
    # tiny flushes: many segments per lane, chained across flushes
    with dask.config.set({"dask_monarch.flush.size": 7, "dask_monarch.flush.idle": "1ms"}):
        ctrl = dm.Controller(client2, world_size=2)
    try:
        mixes_on_two_streams(ctrl, [0, 1], 500)
        got = values(ctrl.sync(timeout=120))
        for rank in (0, 1):
            assert got[(1000, rank)].item() == expected(500, 0)
            assert got[(1001, rank)].item() == expected(500, 7)
    finally:
        ctrl.close()


def _wait_for_file(path) -> None:
    wait_until(lambda: os.path.exists(path), 60, f"the file {path}", every=0.02)


def test_idle_timer_flushes_without_an_explicit_flush(client2, tmp_path):
    with dask.config.set({"dask_monarch.flush.idle": "20ms"}):
        with dm.Controller(client2, world_size=2) as ctrl:
            create_streams(ctrl, [0], S0)
            ctrl.send(0, call(0, Ref(1), "helpers.remote_fns.touch", str(tmp_path / "idle")))
            _wait_for_file(tmp_path / "idle")


def test_size_trigger_and_explicit_flush(client2, tmp_path):
    with dask.config.set(
        {
            "dask_monarch.flush.idle": "60s",
            "dask_monarch.flush.max-age": "60s",
            "dask_monarch.flush.size": 3,
        }
    ):
        with dm.Controller(client2, world_size=2) as ctrl:
            create_streams(ctrl, [0], S0)  # 1 message buffered
            ctrl.send(0, call(0, Ref(1), "torch.ones", 1))
            ctrl.send(0, call(1, Ref(2), "helpers.remote_fns.touch", str(tmp_path / "size")))  # 3rd
            _wait_for_file(tmp_path / "size")
            ctrl.send(0, call(2, Ref(3), "helpers.remote_fns.touch", str(tmp_path / "explicit")))
            time.sleep(0.5)
            assert not os.path.exists(tmp_path / "explicit")  # buffered until the flush
            ctrl.flush()
            _wait_for_file(tmp_path / "explicit")


# ---------------------------------------------------------------- the compiler, without a cluster


def compile_(messages, world=2, compiler=None):
    compiler = compiler or Compiler("tok", [f"monarch-rank{i}" for i in range(world)])
    plan = compiler.compile([(tuple(range(world)), msg) for msg in messages])
    return compiler, plan


def _task_deps(plan, key):
    graph = dict(plan.graph)
    return {dep for dep in graph[key].dependencies}


def test_segment_keys_name_their_work():
    create = m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)
    _, plan = compile_([create, call(0, Ref(1), "torch.ones", 1), m.DeleteRefs([Ref(1)])])
    assert {key_split(k) for k in plan.keys} == {"monarch_ops"}
    c, plan = compile_([create, fetch(0, Ref(1))])
    assert {key_split(k) for k in plan.keys} == {"monarch_fetch"}
    _, plan = compile_([create, m.BorrowCreate(Ref(2), 1, Ref(1), S0, S0)])
    assert {key_split(k) for k in plan.keys} == {"monarch_borrow"}
    _, plan = compile_([create, call(0, Ref(1), "torch.ones", 1), fetch(1, Ref(1))])
    assert {key_split(k) for k in plan.keys} == {"monarch_ops"}  # ops dominate a fetch
    _, plan = compile_([m.CreateDeviceMesh(Ref(9), ["x"], Slice.row_major([2]))])
    assert {key_split(k) for k in plan.keys} == {"monarch_mesh"}
    _, plan = compile_([m.RequestStatus(0)])
    assert {key_split(k) for k in plan.keys} == {"monarch_status"}


def test_mixed_segments_are_named_after_what_dominates():
    create = m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)
    mesh = m.CreateDeviceMesh(Ref(9), ["x"], Slice.row_major([2]))
    factory = m.Factory((1,), torch.float32, torch.strided, "cpu")
    c, _ = compile_([create, mesh, m.BackendNetworkInit(), m.SplitComm(["x"], Ref(9), S0)])
    both = (0, 1)
    plan = c.compile(
        [
            (both, call(4, Ref(4), "torch.ones", 1)),
            (
                both,
                m.Reduce(
                    Ref(5), Ref(4), factory, Ref(9), S0, ["x"], m.ReduceOp.SUM, False, False, None
                ),
            ),
            (both, fetch(6, Ref(5))),
        ]
    )
    assert {key_split(k) for k in plan.keys} == {"monarch_reduce"}, plan.error  # comm first
    group = m.CommandGroup([call(7, Ref(7), "torch.ones", 1), call(8, Ref(8), "torch.ones", 1)])
    plan = c.compile([(both, group)])
    assert {key_split(k) for k in plan.keys} == {"monarch_ops"}  # named after what is inside
    c.span_label = "-forward-1a2b3c4d"
    plan = c.compile([(both, call(9, Ref(10), "torch.ones", 1))])
    assert {key_split(k) for k in plan.keys} == {"monarch_ops-forward"}  # the colour
    assert {k[0] for k in plan.keys} == {"monarch_ops-forward-1a2b3c4d"}  # the task group


def test_segments_are_pinned_and_chained():
    create = m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)
    compiler, first = compile_([create, call(0, Ref(1), "torch.ones", 1)])
    default = m.StreamCreationMode.UseDefaultStream  # lanes come with their stream's mode
    assert first.new_lanes == {0: [(0, default)], 1: [(0, default)]}
    annotations = {key: layer.annotations for layer in first.graph.layers.values() for key in layer}
    for key, ann in annotations.items():
        assert ann["resources"] == {f"monarch-rank{key[2]}": 1}
        assert ann["executor"] == "monarch-tok-0"
    _, second = compile_([call(1, Ref(2), "torch.ones", 1)], compiler=compiler)
    assert second.new_lanes == {}
    for key in second.keys:
        (dep,) = _task_deps(second, key)
        assert dep[2] == key[2] and dep[4] == key[4] - 1  # same rank, previous segment


def test_lane_work_after_a_control_step_follows_it():
    create = m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)
    mesh = m.CreateDeviceMesh(Ref(9), ["x"], Slice.row_major([2]))
    _, plan = compile_(
        [create, call(0, Ref(1), "torch.ones", 1), mesh, call(1, Ref(2), "torch.ones", 1)]
    )
    keys = [k for k in plan.keys if k[2] == 0]
    assert [(k[3], k[4]) for k in keys] == [(0, 0), ("control", 0), (0, 1)]
    assert _task_deps(plan, keys[2]) == {keys[0], keys[1]}
    assert _task_deps(plan, keys[1]) == set()


def test_exit_drains_every_lane():
    create = [m.CreateStream(s, m.StreamCreationMode.UseDefaultStream) for s in (S0, S1)]
    _, plan = compile_([*create, call(0, Ref(1), "torch.ones", 1, stream=S1), m.Exit()])
    exit_key = next(k for k in plan.keys if k[3] == "control" and k[2] == 0)
    assert {(d[3], d[4]) for d in _task_deps(plan, exit_key)} == {(0, 0), (1, 0)}


def test_status_and_deletes_fan_out_to_every_lane():
    create = [m.CreateStream(s, m.StreamCreationMode.UseDefaultStream) for s in (S0, S1)]
    _, plan = compile_([*create, m.DeleteRefs([Ref(1)]), m.RequestStatus(3)], world=1)
    assert sorted(k[3] for k in plan.keys) == [0, 1]


def test_steps_every_rank_shares_are_pickled_once():
    """A status request becomes one probe that every rank with as many lanes shares, so a
    segment with a status in its middle is still pickled once for all ranks; what differs
    per rank (a delete of one rank's refs) is pickled per rank, after the shared steps."""
    import pickle

    create = m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)
    calls = [call(i, Ref(10 + i), "torch.ones", 1) for i in range(50)]
    later = [call(60 + i, Ref(70 + i), "torch.ones", 1) for i in range(20)]
    _, plan = compile_([create, *calls, m.RequestStatus(55), *later], world=3)
    payloads = [task.payload for task in plan.tasks]
    assert len(payloads) == 3 and all(len(p) == 1 for p in payloads)
    assert payloads[0][0] is payloads[1][0] is payloads[2][0]  # one pickle of 72 steps
    steps = pickle.loads(payloads[0][0])
    assert steps[:51] == [create, *calls] and steps[52:] == later
    assert type(steps[51]).__name__ == "StatusProbe" and steps[51].seq == 55
    every = (0, 1, 2)
    plan = Compiler("tok", [f"monarch-rank{i}" for i in range(3)]).compile(
        [(every, create), *((every, c) for c in calls)]
        + [((0,), m.DeleteRefs([Ref(10)])), ((1,), m.DeleteRefs([Ref(11)]))]
    )
    payloads = [task.payload for task in plan.tasks]
    assert payloads[0][0] is payloads[1][0] is payloads[2][0]  # the 51 shared steps
    assert [len(p) for p in payloads] == [2, 2, 1]  # then each rank's own delete


def test_ranks_with_other_lanes_get_probes_of_their_own():
    """A probe counts the lanes it must pass on its rank: ranks with more streams get
    another probe (with another number) for the same status request."""
    create = [m.CreateStream(s, m.StreamCreationMode.UseDefaultStream) for s in (S0, S1)]
    routers = Compiler("tok", ["monarch-rank0", "monarch-rank1"]).routers
    for router in routers:
        list(router.route(create[0]))
    list(routers[1].route(create[1]))
    status = m.RequestStatus(3)
    zero, one = [[step for _, step, _ in router.route(status)] for router in routers]
    assert len(zero) == 1 and len(one) == 2 and one[0] is one[1]
    assert (zero[0].lanes, one[0].lanes) == (1, 2) and zero[0].probe != one[0].probe


@pytest.mark.parametrize(
    "messages, text",
    [
        ([call(0, Ref(1), "torch.ones", 1)], "stream 0, which was never created"),
        ([m.BorrowFirstUse(4)], "unknown borrow 4"),
        (
            [
                m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream),
                m.BorrowCreate(Ref(2), 4, Ref(1), S0, S0),
                m.BorrowLastUse(4),
            ],
            "in state 'created' (expected 'first-used')",
        ),
        ([m.Exit(), m.RequestStatus(1)], "after Exit"),
        ([m.CallRecording(1, Ref(5), [], [])], "not a completely defined recording"),
        ([m.DefineRecording(Ref(5), 0, 0, [], 2, 1)], "starts at chunk 1"),
        (
            [m.DefineRecording(Ref(5), 0, 0, [], 2, 0), m.RequestStatus(1)],
            "RequestStatus while recording r5 is being defined",
        ),
        (
            [m.DefineRecording(Ref(5), 0, 0, [], 2, 0), m.DefineRecording(Ref(6), 0, 0, [], 1, 0)],
            "while r5 is being defined",
        ),
    ],
)
def test_protocol_errors_found_while_routing(messages, text):
    _, plan = compile_(messages)
    assert isinstance(plan.error, ProtocolError)
    assert text in plan.error.cause and plan.error.rank == 0


def test_nothing_of_a_flush_with_a_protocol_error_is_submitted():
    """A refused flush runs nothing, so nothing of it can be left waiting (issue 13)."""
    create = m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)
    compiler, plan = compile_([create, call(0, Ref(1), "torch.ones", 1), m.BorrowDrop(3)])
    assert plan.messages == 0 and plan.graph is None and plan.keys == []
    assert plan.error is not None and compiler.refused is plan.error


def test_no_edge_to_a_segment_that_already_ran():
    """An edge to a segment its rank reported done would keep it, and every segment before it,
    on the scheduler for as long as the controller lives (docs/dask.md §13)."""
    done: dict = {}
    compiler = Compiler("tok", ["monarch-rank0", "monarch-rank1"], done)
    create = m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)
    mesh = m.CreateDeviceMesh(Ref(9), ["x"], Slice.row_major([2]))
    compile_([create, call(0, Ref(1), "torch.ones", 1), mesh], compiler=compiler)
    done[(0, 0)] = 0  # rank 0 ran its lane's segment 0 (not its control step); rank 1 nothing
    _, plan = compile_([call(1, Ref(2), "torch.ones", 1)], compiler=compiler)
    rank0, rank1 = sorted(plan.keys, key=lambda k: k[2])
    assert {(d[3], d[4]) for d in _task_deps(plan, rank0)} == {("control", 0)}
    assert {(d[3], d[4]) for d in _task_deps(plan, rank1)} == {(0, 0), ("control", 0)}
    done[(0, "control")] = 0
    done[(0, 0)] = 1
    _, plan = compile_([call(2, Ref(3), "torch.ones", 1), m.Exit()], compiler=compiler)
    lane, exit_ = sorted((k for k in plan.keys if k[2] == 0), key=lambda k: str(k[3]))
    assert _task_deps(plan, lane) == set()  # everything before it ran: no edge
    assert _task_deps(plan, exit_) == {lane}  # Exit drains what did not
    assert all(_task_deps(plan, k) for k in plan.keys if k[2] == 1)


def test_every_step_a_worker_handles_names_its_segment():
    """A step without a family would name its segment ``monarch_segment`` in the task stream."""
    from dask_monarch.protocol.rules import FAMILY
    from dask_monarch.worker.dispatch import HANDLERS

    assert [t.__name__ for t in HANDLERS if t not in FAMILY] == []
