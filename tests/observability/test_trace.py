"""``dm.trace``: a Chrome/Perfetto trace of a real run, collected from every rank.

A program with a borrow and a reduce on 2 ranks, traced; the JSON loads and
has a track per rank and stream, the messages and waits by name, monotone
timestamps per track, and flows for the borrow and for the collective; the
dashboard serves the latest trace. No trace: the ranks record nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict

import pytest
import torch

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.controller import clock_offset
from dask_monarch.worker import trace_collect

pytestmark = pytest.mark.timeout(300)


def program(mesh: dm.DeviceMesh) -> dm.Tensor:
    """A borrow onto a second stream, reduced there, dropped; then fetched."""
    comms = dm.Stream("comms")
    with mesh.activate():
        t = torch.ones(4) * (mesh.rank("gpu") + 1)
        borrowed, borrow = comms.borrow(t)
        with comms.activate():
            total = borrowed.reduce("gpu", "sum")
        borrow.drop()
    return total, comms


def traced_run(client, path) -> tuple:
    """One traced run of :func:`program` on a fresh 2-rank mesh: (trace object, its file's
    JSON, stream ids)."""
    mesh = dm.device_mesh(client, gpu=2)
    try:
        with dm.trace(path, mesh=mesh) as run:
            total, comms = program(mesh)
            with comms.activate():
                values = dm.inspect(total)
        assert values.tolist() == [3.0] * 4
        session = mesh._session
        streams = {
            "comms": session._streams[id(comms)].id,
            "main": session._streams[id(dm.get_active_stream())].id,
        }
    finally:
        mesh.exit()
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return run, data, streams


@pytest.fixture(scope="module")
def traced(client2, tmp_path_factory):
    return traced_run(client2, tmp_path_factory.mktemp("trace") / "run.json")


def test_the_trace_has_a_track_per_rank_and_stream(traced):
    run, data, streams = traced
    assert run.data == data and run.events
    events = data["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    threads = defaultdict(dict)
    for e in events:
        if e["name"] == "thread_name":
            threads[e["pid"]][e["tid"]] = e["args"]["name"]
    for rank in (0, 1):
        assert threads[rank][streams["comms"]] == f"stream 'comms' ({streams['comms']})"
        assert streams["main"] in threads[rank]
        assert "control steps" in threads[rank].values()
    slices = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        for tid in (streams["comms"], streams["main"]):
            assert any(e["pid"] == rank and e["tid"] == tid for e in slices), (rank, tid)


def test_the_trace_names_messages_segments_and_waits(traced):
    _, data, streams = traced
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    names = {(e["cat"], e["name"].split(" ")[0]) for e in slices}
    for expected in [
        ("segment", "segment"),
        ("message", "CallFunction"),
        ("message", "BorrowCreate"),
        ("message", "BorrowFirstUse"),
        ("message", "BorrowLastUse"),
        ("message", "BorrowDrop"),
        ("message", "Reduce"),
        ("message", "SendValue"),
        ("message", "SplitComm"),
    ]:
        assert expected in names, expected
    waits = [e for e in slices if e["cat"] == "wait"]
    # every rank waited on the collective's peer (an all-reduce blocks until both arrive)
    reduce_waits = [e for e in waits if e["name"].startswith("wait: all-reduce")]
    assert {e["pid"] for e in reduce_waits} == {0, 1}
    for e in reduce_waits:
        assert e["tid"] == streams["comms"]
        assert e["args"]["peers"] == [[1 - e["pid"], streams["comms"]]]
    reduces = [e for e in slices if e["name"] == "Reduce"]
    assert all(e["args"]["reduction"] == "sum" and e["args"]["shape"] == [4] for e in reduces)


def test_timestamps_are_monotone_and_nested_per_track(traced):
    _, data, _ = traced
    tracks = defaultdict(list)
    for e in data["traceEvents"]:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    for events in tracks.values():
        starts = [e["ts"] for e in events]
        assert starts == sorted(starts)
        assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in events)
    # a message lies inside a segment of its track
    for events in tracks.values():
        segments = [e for e in events if e["cat"] == "segment"]
        for e in events:
            if e["cat"] == "message":
                assert any(
                    s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1
                    for s in segments
                ), e


def test_flows_link_the_borrow_and_the_collective(traced):
    _, data, streams = traced
    events = data["traceEvents"]
    flows = defaultdict(dict)
    for e in events:
        if e["ph"] in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    assert all(set(f) == {"s", "f"} for f in flows.values())
    by_cat = defaultdict(list)
    for f in flows.values():
        by_cat[f["s"]["cat"]].append(f)
    lent = [f for f in by_cat["borrow"] if f["s"]["name"].endswith("lent")]
    assert {f["s"]["pid"] for f in lent} == {0, 1}  # one per rank
    for f in lent:  # from the lender's stream to the borrower's, on one rank
        assert f["s"]["pid"] == f["f"]["pid"]
        assert (f["s"]["tid"], f["f"]["tid"]) == (streams["main"], streams["comms"])
    (collective,) = by_cat["collective"]  # 2 members: one arrow between them
    assert {collective["s"]["pid"], collective["f"]["pid"]} == {0, 1}
    assert collective["s"]["tid"] == collective["f"]["tid"] == streams["comms"]
    for f in flows.values():  # forward in time
        assert f["s"]["ts"] <= f["f"]["ts"]
    slices = [e for e in events if e["ph"] == "X" and e["cat"] == "message"]
    for f in [*lent, collective]:  # each end lies inside a message of its track
        for end in f.values():
            assert any(
                e["pid"] == end["pid"]
                and e["tid"] == end["tid"]
                and e["ts"] <= end["ts"] <= e["ts"] + e["dur"]
                for e in slices
            )


def test_the_dashboard_serves_the_latest_trace(client2, tmp_path):
    run, data, _ = traced_run(client2, tmp_path / "latest.json")  # any test may trace before
    base = client2.dashboard_link.rsplit("/", 1)[0]
    with urllib.request.urlopen(f"{base}/monarch/trace.json", timeout=30) as response:
        served = json.loads(response.read().decode())
    assert served == data
    with urllib.request.urlopen(f"{base}/monarch/state.json", timeout=30) as response:
        state = json.loads(response.read().decode())
    assert state["trace"]["url"] == "trace.json"
    assert state["trace"]["events"] == len(data["traceEvents"])
    with urllib.request.urlopen(f"{base}/monarch/", timeout=30) as response:
        assert 'id="trace"' in response.read().decode()


def test_without_a_trace_the_ranks_record_nothing(client2):
    mesh = dm.device_mesh(client2, gpu=2)
    try:
        total, comms = program(mesh)
        with comms.activate():
            dm.inspect(total)
        token = mesh._session.controller.token
        replies = client2.run(trace_collect, token, False)
        assert [r["records"] for r in replies.values()] == [[], []]
    finally:
        mesh.exit()


CHECK_NO_MESH = """
import sys, dask_monarch as dm
try:
    with dm.trace(sys.argv[1]):
        pass
except RuntimeError as e:
    assert "no mesh is running" in str(e), e
else:
    raise SystemExit("dm.trace without a mesh did not raise")
"""


def test_a_trace_needs_a_mesh(tmp_path):
    """In a process of its own: this one has the suite's shared meshes open."""
    done = subprocess.run(
        [sys.executable, "-c", CHECK_NO_MESH, str(tmp_path / "t.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_sends_flow_from_each_sender_to_its_receiver():
    """Built from records alone: rank 0 sends r9 to rank 1 and rank 1 to rank 0 (a swap)."""
    from dask_monarch.observability.chrome_trace import chrome_trace

    def rank(r: int, peer: int) -> dict:
        send = {"result": 9, "shape": [2], "to": peer, "from": peer}
        return {
            "rank": r,
            "lanes": {1: "stream 1", "control": "control steps"},
            "dropped": 0,
            "records": [
                (1, "segment", "segment 0", 10.0, 10.5, {"steps": 1}),
                (1, "message", "SendTensor", 10.1 + r / 10, 10.4, send),
            ],
        }

    data = chrome_trace([[rank(0, 1), rank(1, 0)]], origin=10.0)
    flows = defaultdict(dict)
    for e in data["traceEvents"]:
        if e["ph"] in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    pairs = sorted((f["s"]["pid"], f["f"]["pid"]) for f in flows.values())
    assert pairs == [(0, 1), (1, 0)]
    assert all(f["s"]["cat"] == "send" for f in flows.values())
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in data["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert threads[(0, 1)] == "stream 1" and threads[(0, 0)] == "control steps"
    (segment,) = [e for e in data["traceEvents"] if e["pid"] == 0 and e.get("cat") == "segment"]
    assert (segment["ts"], segment["dur"]) == (0.0, 500000.0)


def test_a_collective_arrow_points_forward_when_the_late_member_ends_early():
    """Rank 0 enters the all-reduce first and its slice runs on (its thread was descheduled);
    rank 1 comes late and is done before rank 0's middle: the arrow still points forward."""
    from dask_monarch.observability.chrome_trace import chrome_trace

    def rank(r: int, start: float, end: float) -> dict:
        return {
            "rank": r,
            "lanes": {7: "comms"},
            "dropped": 0,
            "records": [
                (7, "segment", "segment 0", 10.0, 11.0, {"steps": 1}),
                (7, "message", "Reduce", start, end, {"result": 5}),
            ],
        }

    data = chrome_trace([[rank(0, 10.1, 10.9), rank(1, 10.2, 10.3)]], origin=10.0)
    flows = defaultdict(dict)
    for e in data["traceEvents"]:
        if e["ph"] in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    (flow,) = flows.values()
    assert (flow["s"]["pid"], flow["f"]["pid"]) == (0, 1)
    assert 100000.0 <= flow["s"]["ts"] <= flow["f"]["ts"] <= 300000.0


def test_a_clock_offset_is_the_one_nearest_zero_that_the_round_trip_allows():
    """The worker read its clock somewhere between our ``sent`` and ``back``."""
    assert clock_offset(100.4, 100.0, 101.0) == 0.0  # a worker on this host
    assert clock_offset(150.0, 100.0, 101.0) == 49.0  # 49 to 50 s ahead: the nearer bound
    assert clock_offset(60.0, 100.0, 101.0) == -40.0  # 40 to 41 s behind
    assert clock_offset(101.0, 100.0, 101.0) == 0.0  # at the edge


def test_the_records_of_workers_on_this_host_lie_where_they_ran(ctrl):
    """No record is shifted by a guess: each lies between the client's clock readings
    around the work it records."""
    from helpers.raw import S0, create_streams, fetch, values

    from dask_monarch.messages import Ref

    create_streams(ctrl, [0, 1], S0)
    ctrl.send([0, 1], m.SetRefUnitTestsOnly(Ref(1), 7, S0))
    ctrl.sync(timeout=60)
    ctrl.start_trace()
    before = time.time()
    ctrl.send([0, 1], fetch(0, Ref(1)))
    assert values(ctrl.sync(timeout=60)) == {(0, 0): 7, (0, 1): 7}
    after = time.time()
    ranks = ctrl.collect_trace()
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        spans = [(start, end) for _, _, _, start, end, _ in r["records"]]
        assert spans, r
        assert all(before <= start <= end <= after for start, end in spans), (before, spans, after)


def test_a_raw_controllers_reports_outlive_the_trace(ctrl, tmp_path):
    """The trace waits for the traced work without taking the reports a raw user syncs for."""
    from helpers.raw import S0, create_streams, fetch, values

    from dask_monarch.messages import Ref

    create_streams(ctrl, [0, 1], S0)
    ctrl.send([0, 1], m.SetRefUnitTestsOnly(Ref(1), 41, S0))
    with dm.trace(tmp_path / "raw.json", mesh=None) as run:
        ctrl.send([0, 1], fetch(0, Ref(1)))
    assert values(ctrl.sync()) == {(0, 0): 41, (0, 1): 41}
    assert "SendValue" in {e["name"] for e in run.events if e["ph"] == "X"}


def test_a_trace_of_every_mesh_leaves_out_a_broken_one_left_open(client2, tmp_path):
    """A mesh that broke and was never closed runs nothing more: ``dm.trace()`` traces the
    others instead of raising that mesh's old failure."""
    from helpers.raw import S0, call, create_streams

    broken = dm.Controller(client2, world_size=1)
    mesh = None
    try:
        create_streams(broken, [0], S0)
        broken.send([0], call(0, None, "__test_panic"))
        with pytest.raises(dm.DeviceException, match="__test_panic"):
            broken.sync(timeout=60)
        mesh = dm.device_mesh(client2, gpu=1)  # the other worker
        with mesh.activate():
            x = torch.ones(3)
            with dm.trace(tmp_path / "t.json") as run:
                assert dm.inspect(x + 1).tolist() == [2.0] * 3
        assert "SendValue" in {e["name"] for e in run.events if e["ph"] == "X"}
    finally:
        if mesh is not None:
            mesh.exit()
        broken.close()
