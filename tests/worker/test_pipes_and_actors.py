"""Pipes feed streams from per-rank producers; actors are called with a stream's tensors."""

from __future__ import annotations

import os
import time

import pytest
import torch
from helpers.raw import S0, S1, call, create_streams, failures, fetch, values
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ActorCallParams, ArgsKwargs, Ref
from dask_monarch.ndslice import Slice

BOTH = [0, 1]
MESH, PIPE = Ref(900), Ref(901)


def create_pipe(
    ctrl, ranks, fn, *args, max_messages=2, mesh=MESH, pipe=PIPE, names=("dp",), **kwargs
):
    ctrl.send(ranks, m.CreateDeviceMesh(mesh, list(names), Slice.row_major([len(ranks)])))
    ctrl.send(
        ranks,
        m.CreatePipe(pipe, "loader", fn, max_messages, mesh, ArgsKwargs.from_python(args, kwargs)),
    )


@pytest.mark.exercises("CreatePipe", "PipeRecv")
def test_loader_pipe_yields_batches_in_order(ctrl):
    create_streams(ctrl, BOTH, S0)
    create_pipe(ctrl, BOTH, "helpers.remote_fns.loader", 5)
    for i in range(5):  # seqs increase on a stream
        ctrl.send(BOTH, m.PipeRecv(2 * i, [Ref(10 + i), Ref(20 + i)], PIPE, S0))
        ctrl.send(BOTH, fetch(2 * i + 1, ((Ref(10 + i), Ref(20 + i)),)))
    ctrl.send(BOTH, m.PipeRecv(10, [Ref(30), Ref(31)], PIPE, S0))  # the loader has finished
    reports = ctrl.sync(timeout=120)
    got = values(reports, m.FetchResult)
    for i in range(5):
        for rank in BOTH:
            batch, index = got[(2 * i + 1, rank)]
            assert index == i and torch.equal(batch, torch.full((2,), float(i + 100 * rank)))
    assert [(f.seq, "has finished" in f.error) for f in failures(reports)] == [(10, True)] * 2


def test_back_pressure_with_max_messages_1(ctrl, tmp_path):
    create_streams(ctrl, [0], S0)
    path = str(tmp_path / "produced")
    create_pipe(ctrl, [0], "helpers.remote_fns.loader", 10, path=path, max_messages=1)
    ctrl.sync(timeout=60)

    def produced():
        if not os.path.exists(path):
            return 0
        with open(path) as f:
            return len(f.read().splitlines())

    # the producer process starts, then fills the buffer
    wait_until(lambda: produced() >= 2, 60, "two messages produced")
    time.sleep(1)
    assert produced() == 2  # one waiting in the buffer, one blocked in send
    ctrl.send(0, m.PipeRecv(0, [Ref(1), Ref(2)], PIPE, S0))
    ctrl.send(0, m.PipeRecv(1, [Ref(3), Ref(4)], PIPE, S0))
    ctrl.sync(timeout=60)
    wait_until(lambda: produced() >= 3, 10, "a third message produced")
    assert produced() <= 4


def test_crashing_producer_is_a_reported_user_error(ctrl):
    create_streams(ctrl, BOTH, S0)
    create_pipe(ctrl, BOTH, "helpers.remote_fns.crashing_loader")
    ctrl.send(BOTH, m.PipeRecv(0, [Ref(1)], PIPE, S0))
    ctrl.send(BOTH, m.PipeRecv(1, [Ref(2)], PIPE, S0))
    ctrl.send(BOTH, call(2, Ref(3), "torch.ones", 1))  # the worker carries on
    reports = ctrl.sync(timeout=120)
    assert sorted((f.seq, f.rank) for f in failures(reports)) == [(1, 0), (1, 1)]
    assert "the loader ran out of luck" in failures(reports)[0].error
    assert torch.equal(ctrl.get_ref(0, Ref(1), S0), torch.zeros(1))
    assert torch.equal(ctrl.get_ref(0, Ref(3), S0), torch.ones(1))
    with pytest.raises(dm.RemoteException, match="ran out of luck"):
        ctrl.get_ref(1, Ref(2), S0)


def test_send_value_into_a_pipe_and_rank_coordinates(ctrl):
    create_streams(ctrl, BOTH, S0)
    create_pipe(ctrl, BOTH, "helpers.remote_fns.echo_loader")
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
    ctrl.send(BOTH, m.SendValue(1, PIPE, [], None, ArgsKwargs.from_python((Ref(1),)), S0))
    ctrl.send(BOTH, m.PipeRecv(2, [Ref(2), Ref(3), Ref(4)], PIPE, S0))
    ctrl.send(BOTH, fetch(3, ((Ref(2), Ref(3), Ref(4)),)))
    got = values(ctrl.sync(timeout=120))
    for rank in BOTH:
        doubled, coordinate, size = got[(3, rank)]
        assert torch.equal(doubled, torch.full((2,), 2.0))
        assert (coordinate, size) == (rank, 2)


def test_pipe_producer_runs_in_its_own_process(ctrl, client2):
    create_streams(ctrl, [0], S0)
    create_pipe(ctrl, [0], "helpers.remote_fns.loader", 1)
    ctrl.sync(timeout=60)
    address = ctrl.workers[0]
    worker_pid = client2.run(os.getpid, workers=[address])[address]

    def producer_pids(dask_worker, token=ctrl.token):
        state = dask_worker.plugins["dask_monarch"].ranks[token]
        return [p.process.pid for p in state.pipes.values() if p.process is not None]

    pids = client2.run(producer_pids, workers=[address])[address]
    assert pids and worker_pid not in pids


# ------------------------------------------------------------------------------- actors


def actor_message(seq, broker, local_state, results=None, mutates=(), stream=S0):
    if results is None:
        return m.SendResultOfActorCall(seq, broker, list(local_state), list(mutates), stream)
    params = ActorCallParams(seq, broker, list(local_state), list(mutates), stream)
    return m.CallActorMethod(list(results), params)


@pytest.mark.exercises("SendResultOfActorCall", "CallActorMethod")
def test_actor_calls_with_tensors_in_order_with_tensor_work(ctrl):
    create_streams(ctrl, BOTH, S0)
    broker = ctrl.spawn_actor(BOTH, "acc", _accumulator())
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 3))
    ctrl.call_actor(BOTH, broker, 1, S0, "add", (Ref(1),), {"label": "first"})
    ctrl.send(BOTH, actor_message(1, broker, [Ref(1)], results=[Ref(2)]))
    ctrl.send(BOTH, call(2, None, "torch.ops.aten.mul_.Scalar", Ref(1), 10, mutates=[Ref(1)]))
    ctrl.call_actor(BOTH, broker, 3, S0, "add", (Ref(1),), {"label": "second"})
    ctrl.send(BOTH, actor_message(3, broker, [Ref(1)]))
    ctrl.call_actor(BOTH, broker, 4, S0, "history")
    ctrl.send(BOTH, actor_message(4, broker, []))
    ctrl.send(BOTH, actor_message(5, broker, [Ref(1), Ref(1)]))  # no method: __call__
    got = values(ctrl.sync(timeout=60))
    for rank in BOTH:
        assert got[(3, rank)].item() == 3.0 + 30.0
        assert got[(4, rank)] == ["first", "second"]
        assert got[(5, rank)] == 60.0
        assert ctrl.get_ref(rank, Ref(2), S0).item() == 3.0


def test_actor_failure_is_reported_and_poisons_mutates(ctrl):
    create_streams(ctrl, [0], S0, S1)
    broker = ctrl.spawn_actor([0], "acc", _accumulator())
    ctrl.send(0, call(0, Ref(1), "torch.ones", 2))
    ctrl.call_actor([0], broker, 1, S0, "fail", (Ref(1),))
    ctrl.send(0, actor_message(1, broker, [Ref(1)], results=[Ref(2)], mutates=[Ref(1)]))
    ctrl.call_actor([0], broker, 2, S0, "scale_", (Ref(1), 2.0))
    ctrl.send(0, actor_message(2, broker, [Ref(1)], results=[Ref(3)]))  # depends on the failure
    reports = ctrl.sync(timeout=60)
    assert [(f.seq, f.rank) for f in failures(reports)] == [(1, 0)]
    assert "the actor refused" in failures(reports)[0].error
    for ref in (Ref(1), Ref(2), Ref(3)):
        with pytest.raises(dm.RemoteException, match="the actor refused"):
            ctrl.get_ref(0, ref, S0)


def test_actor_mutating_a_stream_tensor(ctrl):
    create_streams(ctrl, [1], S0)
    broker = ctrl.spawn_actor([1], "acc", _accumulator())
    ctrl.send(1, call(0, Ref(1), "torch.ones", 2))
    ctrl.call_actor([1], broker, 1, S0, "scale_", (Ref(1), 3.0))
    ctrl.send(1, actor_message(1, broker, [Ref(1)], results=[Ref(2)], mutates=[Ref(1)]))
    ctrl.sync(timeout=60)
    assert torch.equal(ctrl.get_ref(1, Ref(1), S0), torch.full((2,), 3.0))


def test_an_actor_runs_one_call_at_a_time_whichever_streams_call_it(ctrl):
    """Actors take one message at a time (Monarch's, and Dask's on their one thread): calls
    from two streams, whose lanes run at once, must not run the actor's methods at once."""
    from helpers import remote_fns

    create_streams(ctrl, [0], S0, S1)
    broker = ctrl.spawn_actor([0], "visits", remote_fns.Visits)
    for seq, stream in ((0, S0), (1, S1)):
        ctrl.call_actor([0], broker, seq, stream, "visit", (0.5,))
        ctrl.send(0, actor_message(seq, broker, [], stream=stream))
    got = values(ctrl.sync(timeout=60))
    assert got[(0, 0)] == 1 and got[(1, 0)] == 1


def test_spawn_actor_errors_come_back(ctrl):
    class Broken:
        def __init__(self):
            raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        ctrl.spawn_actor([0], "broken", Broken)


def _accumulator():
    from helpers import remote_fns

    return remote_fns.Accumulator


def _pipe_threads(dask_worker=None) -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("monarch-pipe-")]


def test_producer_threads_end_when_their_controller_leaves(throwaway_cluster):
    """On a daemonic worker (a plain LocalCluster) producers are threads, which cannot be
    terminated: closing the controller ends one blocked in ``send`` (an endless loader,
    its buffer full) and one that finished and waits to be told it may exit."""
    with throwaway_cluster(1, plain=True) as (_, client):
        ctrl = dm.Controller(client, world_size=1)
        try:
            create_streams(ctrl, [0], S0)
            create_pipe(ctrl, [0], "helpers.remote_fns.loader", 10**9, max_messages=1)
            ctrl.send(
                0,
                m.CreatePipe(
                    Ref(902),
                    "done",
                    "helpers.remote_fns.loader",
                    1,
                    MESH,
                    ArgsKwargs.from_python((1,), {}),
                ),
            )
            ctrl.send(0, m.PipeRecv(0, [Ref(1), Ref(2)], PIPE, S0))
            ctrl.send(0, m.PipeRecv(1, [Ref(3), Ref(4)], Ref(902), S0))
            assert ctrl.sync(timeout=60) == []
            address = ctrl.workers[0]
            assert len(client.run(_pipe_threads, workers=[address])[address]) == 2
        finally:
            ctrl.close()
        wait_until(
            lambda: client.run(_pipe_threads, workers=[address])[address] == [],
            30,
            "the producer threads to end",
        )


def test_a_value_that_cannot_cross_the_process_boundary_fails_its_send(ctrl):
    """A producer process's queue pickles on a thread of its own, which drops what it cannot
    pickle: the batch must fail the producer, not vanish with the next one in its place;
    and a value sent into the pipe that cannot be pickled is the SendValue's error."""
    create_streams(ctrl, [0], S0)
    create_pipe(ctrl, [0], "helpers.remote_fns.unpicklable_loader", max_messages=4)
    for i in range(2):
        ctrl.send(0, m.PipeRecv(2 * i, [Ref(10 + i)], PIPE, S0))
        ctrl.send(0, fetch(2 * i + 1, Ref(10 + i)))
    reports = ctrl.sync(timeout=120)
    assert torch.equal(values(reports)[(1, 0)], torch.zeros(1))
    assert (3, 0) not in values(reports)
    (failed,) = failures(reports)
    assert failed.seq == 2 and "cannot pickle '_thread.lock'" in failed.error

    echo = Ref(903)
    ctrl.send(
        0,
        m.CreatePipe(
            echo, "echo", "helpers.remote_fns.echo_loader", 2, MESH, ArgsKwargs.from_python((), {})
        ),
    )
    lock = m.FunctionPath("threading.Lock")
    ctrl.send(0, m.SendValue(4, echo, [], lock, ArgsKwargs.from_python((), {}), S0))
    ctrl.send(0, call(5, Ref(20), "torch.ones", 2))
    ctrl.send(0, m.SendValue(6, echo, [], None, ArgsKwargs.from_python((Ref(20),)), S0))
    ctrl.send(0, m.PipeRecv(7, [Ref(21), Ref(22), Ref(23)], echo, S0))
    ctrl.send(0, fetch(8, ((Ref(21),),)))
    reports = ctrl.sync(timeout=120)
    (failed,) = failures(reports)
    assert failed.seq == 4 and "cannot pickle '_thread.lock'" in failed.error
    assert torch.equal(values(reports)[(8, 0)][0], torch.full((2,), 2.0))
