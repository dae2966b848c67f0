"""Relayed flushes (``dask_monarch.flush.relay``): a task per wave, fanned out worker to worker.

The scheduler sees one task per lane and flush whatever the mesh's size; each
rank's segment reaches its worker through the ranks before it in a tree of
the configured fan-out, and each rank keeps its own segments in order.
"""

from __future__ import annotations

import os
import signal
import time

import dask
import pytest
import torch
from distributed import get_task_stream
from helpers.raw import S0, call, create_streams, fetch, mixes_on_two_streams, values
from helpers.remote_fns import mix_
from helpers.task_stream import wait_until_recorded

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.compiler import Compiler
from dask_monarch.controller.intake import RelayTask
from dask_monarch.messages import Ref
from dask_monarch.worker.relay import narrowed, split

RANKS = [0, 1, 2, 3]


def relayed(client, fanout: int, world_size: int = 4, **settings) -> dm.Controller:
    with dask.config.set({"dask_monarch.flush.relay": fanout, **settings}):
        return dm.Controller(client, world_size=world_size)


def expected_mix(n: int, offset: int) -> int:
    x = torch.zeros(1, dtype=torch.int64)
    for i in range(n):
        mix_(x, i + offset)
    return int(x.item())


# -- the compiler's waves -----------------------------------------------------------------


def test_split_makes_at_most_fanout_runs_in_order():
    assert split([], 3) == []
    assert split([1, 2], 3) == [[1], [2]]
    assert split(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert sum(split(list(range(100)), 8), []) == list(range(100))


def test_a_relayed_flush_is_a_task_per_wave_with_each_ranks_edges_on_its_own_rank():
    addresses = [f"tcp://127.0.0.1:{9000 + r}" for r in RANKS]
    compiler = Compiler("tok", [f"r{r}" for r in RANKS], {}, relay=2, addresses=addresses)
    everyone = tuple(RANKS)
    buffer = [
        (everyone, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream)),
        (everyone, call(0, Ref(1), "torch.ones", 1)),
        (everyone, m.BackendNetworkInit()),  # a control step: later lane work follows it
        (everyone, call(1, Ref(2), "torch.ones", 1)),
        ((1, 2), call(2, Ref(3), "torch.ones", 2)),
    ]
    plan = compiler.compile(buffer)
    assert plan.error is None and plan.tails == {}
    assert all(type(t) is RelayTask for t in plan.tasks)
    first, control, second = plan.tasks  # a wave per lane segment, in message order
    assert (first.lane, control.lane, second.lane) == (S0.id, "control", S0.id)
    assert [t.key for t in plan.tasks] == plan.keys
    for wave in plan.tasks:
        assert wave.rank == 0 and wave.resource == "r0" and wave.after == []
        assert wave.wave["fanout"] == 2 and wave.wave["token"] == "tok"
        assert [e[0] for e in wave.wave["entries"]] == RANKS
        assert [e[4] for e in wave.wave["entries"]] == addresses
    # each rank's second lane segment follows its first one and its control step: edges
    # travel as (lane, index) of the rank's own segments
    assert [e[1] for e in second.wave["entries"]] == [1] * 4
    assert [e[3] for e in second.wave["entries"]] == [[(S0.id, 0), ("control", 0)]] * 4
    assert [e[3] for e in first.wave["entries"]] == [[]] * 4
    # the pickle of the messages every rank got travels once; ranks 1 and 2 share their rest
    assert len(second.wave["blobs"]) == 2
    assert [e[2] for e in second.wave["entries"]] == [[0], [0, 1], [0, 1], [0]]
    # every rank's segment is still what the controller tracks
    assert len(plan.segments) == 12
    assert {(s.rank, s.lane, s.index) for s in plan.segments} == {
        (r, lane, i) for r in RANKS for lane, i in ((S0.id, 0), ("control", 0), (S0.id, 1))
    }


def test_a_forwarded_run_carries_only_the_pickles_its_ranks_use():
    # a wave whose ranks each have a pickle of their own (a fetch's probe) besides the shared
    # one: forwarded whole, each of N ranks would get all N of them
    n = 64
    blobs = [b"shared"] + [b"own-%d" % r for r in range(n)]
    entries = [(r, 5, [0, r + 1], [("control", 2)], f"tcp://w{r}") for r in range(n)]
    wave = {"token": "tok", "lane": 1, "fanout": 4, "blobs": blobs, "entries": entries}
    runs = split(entries[1:], 4)
    for run in runs:
        sent = narrowed(wave, run)
        assert len(sent["blobs"]) == len(run) + 1
        for entry, kept in zip(run, sent["entries"]):
            assert kept[:2] == entry[:2] and kept[3:] == entry[3:]
            assert [sent["blobs"][i] for i in kept[2]] == [blobs[i] for i in entry[2]]
    # narrowed again at the next hop, as each run's first rank forwards the rest of its run
    first = narrowed(wave, runs[0])
    inner = narrowed(first, first["entries"][1:])
    assert inner["blobs"] == [b"shared"] + [b"own-%d" % r for r, *_ in runs[0][1:]]


def test_each_ranks_own_steps_are_pickled_once_and_the_same_rests_share_one_pickle():
    ranks = list(range(256))
    compiler = Compiler("tok", [f"r{r}" for r in ranks], {})
    everyone = tuple(ranks)
    create = (everyone, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
    own = [((r,), call(r, Ref(r + 1), "torch.ones", 1)) for r in ranks]
    plan = compiler.compile([create, *own])
    assert plan.error is None
    assert len({id(t.payload[0]) for t in plan.tasks}) == 1  # the shared prefix, once
    assert len({id(p) for t in plan.tasks for p in t.payload}) == 1 + len(ranks)
    # a message to ranks 0 and 1 only: their rests are the same objects, one pickle
    plan = compiler.compile([create, ((0, 1), call(1000, Ref(1000), "torch.ones", 1))])
    rests = [t.payload[1] for t in plan.tasks if len(t.payload) == 2]
    assert len(rests) == 2 and rests[0] is rests[1]


def test_without_addresses_or_with_one_rank_nothing_is_relayed():
    assert Compiler("tok", ["r0", "r1"], {}, relay=2).relay == 0
    assert Compiler("tok", ["r0"], {}, relay=2, addresses=["a"]).relay == 0


# -- on ranks ---------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fanout", [1, 3])
def test_relayed_flushes_keep_every_lanes_order_across_many_flushes(client4, fanout):
    """Fan-out 1 is a chain through all four ranks; 3 fans out from rank 0 at once."""
    ctrl = relayed(client4, fanout, **{"flush.size": 7, "flush.idle": "1ms"})
    try:
        mixes_on_two_streams(ctrl, RANKS, 120)
        with get_task_stream(client4) as stream:
            got = values(ctrl.sync(timeout=120))
            wait_until_recorded(client4, ctrl.token)
        for rank in RANKS:
            assert got[(1000, rank)].item() == expected_mix(120, 0)
            assert got[(1001, rank)].item() == expected_mix(120, 7)
        # the scheduler ran one task per wave: every key names the wave's first rank
        keys = [t["key"] for t in stream.data if t["key"][1:2] == (ctrl.token,)]
        assert keys and {key[2] for key in keys} == {0}
    finally:
        ctrl.close()


@pytest.mark.timeout(300)
def test_collectives_borrows_and_a_failure_on_one_rank_when_relayed(client4):
    with dask.config.set({"dask_monarch.flush.relay": 2}):
        mesh = dm.device_mesh(client4, host=2, gpu=2)
    try:
        with mesh.activate():
            x = torch.ones(3)
            for _ in range(5):
                x = x + 1
            total = x.reduce("gpu", reduction="sum")
            other = dm.Stream("other")
            borrowed, borrow = other.borrow(x)
            with other.activate():
                doubled = borrowed * 2
                assert (
                    dm.fetch_shard(doubled, {"host": 1, "gpu": 1}).result(timeout=60).tolist()
                    == [12.0] * 3
                )
            borrow.drop()
            bad = dm.remote("helpers.remote_fns.boom", propagate=lambda t: t)(x)
            after_bad = bad + 1
            fine = x * 3
            assert (
                dm.fetch_shard(total, {"host": 1, "gpu": 0}).result(timeout=60).tolist()
                == [12.0] * 3
            )
            with pytest.raises(dm.RemoteException, match="boom"):
                dm.fetch_shard(after_bad).result(timeout=60)
            assert (
                dm.fetch_shard(fine, {"host": 0, "gpu": 1}).result(timeout=60).tolist()
                == [18.0] * 3
            )
    finally:
        mesh.exit()


@pytest.mark.timeout(180)
def test_a_relay_stream_that_cannot_connect_fails_the_rank_that_relays_through_it(client2):
    ctrl = relayed(client2, 1, world_size=2)
    try:
        create_streams(ctrl, [0, 1], S0)
        ctrl.send([0, 1], call(0, Ref(1), "torch.ones", 1))
        assert ctrl.sync(timeout=60) == []
        token, first = ctrl.token, ctrl.workers[0]
        nowhere = "tcp://127.0.0.1:1"  # nothing listens there
        wave = {
            "token": token,
            "lane": S0.id,
            "fanout": 1,
            "blobs": [],
            "entries": [[99, 0, [], [], first], [1, 0, [], [], nowhere]],
        }
        client2.run(_deliver, wave, workers=[first])
        start, seq = time.monotonic(), 1
        with pytest.raises(
            dm.DeviceException, match="could not relay segments to worker tcp://127.0.0.1:1"
        ) as info:
            while time.monotonic() - start < 90:  # Dask's connect retries for its timeout
                ctrl.send([0, 1], call(seq, None, "torch.ones", 1))
                ctrl.sync(timeout=30)
                seq += 1
                time.sleep(0.05)
        assert info.value.rank == 0
    finally:
        ctrl.close()


async def _deliver(wave, dask_worker=None):
    dask_worker.plugins["dask_monarch"].relay.deliver(wave)


@pytest.mark.timeout(420)
def test_a_killed_worker_fails_a_relayed_mesh_quickly(throwaway_cluster):
    with throwaway_cluster(3) as (_, client):
        ctrl = relayed(client, 1, world_size=3)  # a chain: rank 0 relays to 1, 1 to 2
        create_streams(ctrl, [0, 1, 2], S0)
        ctrl.send([0, 1, 2], call(0, Ref(1), "torch.ones", 1))
        assert ctrl.sync(timeout=60) == []
        victim = ctrl.workers[1]
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(dm.DeviceException):
            ctrl.send([0, 1, 2], call(1, Ref(2), "torch.ones", 1))
            ctrl.send([0, 1, 2], fetch(2, Ref(2)))
            ctrl.sync(timeout=60)
        assert time.monotonic() - start < 30
        ctrl.close()
