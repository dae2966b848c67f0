"""The /monarch/ dashboard page: JSON from the rank workers, rendered by headless Chromium.

The browser test saves a screenshot to tests/artifacts/dashboard.png.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.raw import S0, S1, call, create_streams, fetch
from helpers.waiting import wait_until

from dask_monarch import messages as m
from dask_monarch.controller.placement import registered_workers
from dask_monarch.messages import Ref
from dask_monarch.observability.dashboard import HIDDEN, all_loopback, show_details
from dask_monarch.protocol.names import mesh_id

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parents[1] / "artifacts"
BOTH = [0, 1]


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def state(base: str) -> dict:
    return json.loads(get(f"{base}/monarch/state.json"))


def mesh(base: str, token: str) -> dict:
    (found,) = [c for c in state(base)["controllers"] if c["mesh"] == mesh_id(token)]
    return found


def lane(entry: dict, rank: int, stream) -> dict:
    (r,) = [r for r in entry["ranks"] if r["rank"] == rank]
    (found,) = [x for x in r["lanes"] if x["stream"] == stream]
    return found


@pytest.fixture(scope="module")
def dashboard(client2) -> str:
    """The scheduler's dashboard root (the LocalMeshCluster preloads the page)."""
    return client2.dashboard_link.rsplit("/", 1)[0]


def test_state_json_has_ranks_last_completed_seq_and_rates(ctrl, dashboard):
    create_streams(ctrl, BOTH, S0, S1)
    for seq in range(20):
        ctrl.send(BOTH, call(seq, Ref(seq + 1), "torch.ones", 256, stream=S0 if seq % 2 else S1))
    assert ctrl.sync() == []
    first = mesh(dashboard, ctrl.token)
    assert first["world_size"] == 2 and first["state"] == "running"
    assert [r["rank"] for r in first["ranks"]] == [0, 1]
    assert first["last_done_seq"] == 19
    rank0 = first["ranks"][0]
    assert rank0["worker"] == ctrl.workers[0] and rank0["refs"] == 20
    assert rank0["tensor_bytes"] == 20 * 256 * 4
    assert lane(first, 0, 0)["done_seq"] == 19 and lane(first, 0, 1)["done_seq"] == 18
    time.sleep(0.2)
    for seq in range(20, 60):
        ctrl.send(BOTH, call(seq, Ref(seq + 1), "torch.ones", 1))
    ctrl.sync()
    second = mesh(dashboard, ctrl.token)
    assert second["last_done_seq"] == 59
    assert second["messages"] >= first["messages"] + 80
    assert second["rate"] is not None and second["rate"] > 0
    assert all(r["rate"] > 0 for r in second["ranks"])


def test_worker_metrics_reach_the_scheduler(ctrl, client2):
    """Per-worker figures ride on heartbeats: the dashboard's Workers table shows them."""
    create_streams(ctrl, BOTH, S0)
    for seq in range(10):
        ctrl.send(BOTH, call(seq, Ref(seq + 1), "torch.ones", 256))
    assert ctrl.sync() == []
    address = ctrl.workers[0]

    def metrics() -> dict:
        return registered_workers(client2)[address]["metrics"]

    wait_until(lambda: metrics().get("monarch_refs", 0) >= 10, what="a heartbeat with refs")
    figures = metrics()
    assert figures["monarch_ranks"] >= 1 and figures["monarch_lanes"] >= 2  # stream + control
    assert figures["monarch_messages"] >= 10
    assert figures["monarch_tensor_bytes"] >= 10 * 256 * 4


def test_failures_and_fatal_errors_are_reported_with_tracebacks(ctrl, dashboard):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(1, call(0, Ref(1), "helpers.remote_fns.boom", 1))
    ctrl.sync()
    (rank1,) = [r for r in mesh(dashboard, ctrl.token)["ranks"] if r["rank"] == 1]
    (error,) = rank1["errors"]
    assert error["seq"] == 0 and "Traceback" in error["error"]
    assert "boom from a remote function" in error["error"]


@pytest.mark.timeout(240)
def test_a_waiting_lane_shows_what_a_liveness_warning_says(ctrl, dashboard, tmp_path):
    """The page's "running / waiting on" text is the controller's: seq, what, and for how long."""
    gate = tmp_path / "gate"
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 4))
    ctrl.sync()
    try:
        ctrl.send(0, call(1, None, "helpers.gates.wait_for_file", str(gate), 120))
        ctrl.send(0, m.BorrowCreate(Ref(2), 1, Ref(1), S0, S1))
        ctrl.send(0, m.BorrowFirstUse(1))
        ctrl.send(0, fetch(2, Ref(2), stream=S1))
        ctrl.send(0, m.BorrowLastUse(1))
        ctrl.send(0, m.BorrowDrop(1))
        ctrl.flush()
        wait_until(
            lambda: lane(mesh(dashboard, ctrl.token), 0, 1)["state"] == "waiting",
            what="stream 1 of rank 0 to wait at the borrow",
        )
        wait_until(
            lambda: "wait_for_file" in lane(mesh(dashboard, ctrl.token), 0, 0)["status"],
            what="the lender's call to be located",
        )
        entry = mesh(dashboard, ctrl.token)
        borrower, lender = lane(entry, 0, 1), lane(entry, 0, 0)
        assert borrower["next_seq"] == 2 and borrower["for_s"] > 0
        assert borrower["status"].startswith("before seq 2: waiting ")
        assert borrower["status"].endswith("s on borrow 1 (the lender's BorrowCreate)")
        assert lender["status"].startswith("seq 1: running for ")
        assert "in wait_for_file (" in lender["status"]
        assert lane(entry, 1, 1)["status"] == ""  # idle lanes say nothing
    finally:
        gate.touch()
    assert [type(r) for r in ctrl.sync(timeout=60)] == [m.FetchResult]


@pytest.fixture
def scheduler_setting(client2):
    """Set a dask_monarch setting in the scheduler's process (it reads them per request)."""
    import dask.config

    def put(key, value):
        dask.config.set({key: value})

    changed = []

    def setting(key, value):
        changed.append((key, client2.run_on_scheduler(dask.config.get, key, None)))
        client2.run_on_scheduler(put, key, value)

    yield setting
    for key, value in reversed(changed):
        client2.run_on_scheduler(put, key, value)


@pytest.mark.timeout(120)
def test_state_json_names_meshes_by_id_and_shows_messages_on_loopback(ctrl, dashboard):
    """A LocalMeshCluster's dashboard listens on 127.0.0.1 only: messages are shown."""
    create_streams(ctrl, BOTH, S0)
    ctrl.send(1, call(0, Ref(1), "builtins.int", "secret-value-1234"))
    ctrl.sync()
    got = state(dashboard)
    text = json.dumps(got)
    assert ctrl.token not in text and ctrl.mesh_id in text  # the id every message says
    assert got["details_hidden"] is False
    (rank1,) = [r for r in mesh(dashboard, ctrl.token)["ranks"] if r["rank"] == 1]
    (error,) = rank1["errors"]
    assert "Traceback" in error["error"] and "secret-value-1234" in error["error"]


@pytest.mark.timeout(120)
def test_hidden_messages_say_how_to_show_them(ctrl, dashboard, scheduler_setting):
    scheduler_setting("dask_monarch.dashboard.show-details", False)
    create_streams(ctrl, BOTH, S0)
    ctrl.send(1, call(0, Ref(1), "builtins.int", "secret-value-1234"))
    ctrl.sync()
    got = state(dashboard)
    assert "secret-value-1234" not in json.dumps(got) and got["details_hidden"] is True
    (rank1,) = [r for r in mesh(dashboard, ctrl.token)["ranks"] if r["rank"] == 1]
    (error,) = rank1["errors"]
    assert "Traceback" in error["error"] and f"ValueError: {HIDDEN}" in error["error"]
    assert "DASK_MONARCH__DASHBOARD__SHOW_DETAILS=true" in HIDDEN
    page = get(f"{dashboard}/monarch/")
    assert "show-details: true" in page and "details_hidden" in page  # the page's note


def test_a_show_details_value_that_is_not_a_boolean_is_refused(client2, scheduler_setting):
    """A misspelt ``show-details`` ("ture") read as false and hid every message without a
    word; it is refused, naming the setting and the values it takes. The usual spellings of
    a boolean (an environment variable's 1, yes, on) still read as they did."""

    def details(dask_scheduler=None):
        return show_details(dask_scheduler)

    for value in ("ture", "y", 2, "enabled"):
        scheduler_setting("dask_monarch.dashboard.show-details", value)
        with pytest.raises(ValueError, match="show-details") as info:
            client2.run_on_scheduler(details)
        assert "true, false (yes/no, on/off, 1/0), or auto" in str(info.value)
        assert "DASK_MONARCH__DASHBOARD__SHOW_DETAILS" in str(info.value)
    for value, shown in (
        ("True", True),
        (" false", False),
        (True, True),
        (False, False),
        ("yes", True),
        ("Off", False),
        (1, True),
        (0, False),
    ):
        scheduler_setting("dask_monarch.dashboard.show-details", value)
        assert client2.run_on_scheduler(details) is shown
    for value in ("auto", None):  # a LocalMeshCluster's dashboard is on loopback only
        scheduler_setting("dask_monarch.dashboard.show-details", value)
        assert client2.run_on_scheduler(details) is True


def test_only_loopback_listening_addresses_count_as_this_host_only():
    assert all_loopback(["127.0.0.1"]) and all_loopback(["127.0.0.1", "::1"])
    for hosts in (["0.0.0.0"], ["::"], ["10.0.0.7"], ["127.0.0.1", "0.0.0.0"], [], ["myhost"]):
        assert not all_loopback(hosts), hosts


def test_page_routes_and_more_menu(dashboard):
    page = get(f"{dashboard}/monarch/")
    assert "<title>dask_monarch</title>" in page and "__INTERVAL_MS__" not in page
    assert "http://" not in page and "https://" not in page  # nothing from the network
    assert get(f"{dashboard}/monarch") == page  # redirected
    assert "monarch/state.json" in get(f"{dashboard}/individual-monarch")
    plots = json.loads(get(f"{dashboard}/individual-plots.json"))
    assert "/individual-monarch" in plots.values()
    assert "individual-monarch" in get(f"{dashboard}/status")  # the "More..." menu


def chromium(tmp_path: Path, *args: str, timeout: float = 90) -> str:
    """Run headless Chromium once (no network but loopback; a throw-away profile)."""
    profile = tmp_path / "chromium-profile"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--mute-audio",
        f"--user-data-dir={profile}",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def mesh_dom(tmp_path: Path, url: str, token: str) -> str:
    """The rendered DOM of one mesh's section of the page."""
    dom = chromium(tmp_path, "--virtual-time-budget=4000", "--dump-dom", url)
    start = dom.find(f'<section class="mesh" id="mesh-{mesh_id(token)}"')
    assert start >= 0, f"mesh {token} is not on the page:\n{dom[-3000:]}"
    return dom[start : dom.index("</section>", start)]


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM) or shutil.which(CHROMIUM) is None,
    reason=f"headless browser test needs {CHROMIUM} (apt-get install chromium)",
)
@pytest.mark.timeout(240)
def test_page_in_headless_chromium_shows_a_stream_waiting_at_a_borrow(ctrl, dashboard, tmp_path):
    gate = tmp_path / "gate"
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 1000))
    ctrl.send(1, call(1, Ref(2), "helpers.remote_fns.boom", Ref(1)))
    ctrl.sync()
    try:
        # rank 0: the lender is held busy, so the borrower stream waits at its first use
        ctrl.send(0, call(2, None, "helpers.gates.wait_for_file", str(gate), 120))
        ctrl.send(0, m.BorrowCreate(Ref(3), 1, Ref(1), S0, S1))
        ctrl.send(0, m.BorrowFirstUse(1))
        ctrl.send(0, fetch(3, Ref(3), stream=S1))
        ctrl.send(0, m.BorrowLastUse(1))
        ctrl.send(0, m.BorrowDrop(1))
        ctrl.flush()
        wait_until(
            lambda: lane(mesh(dashboard, ctrl.token), 0, 1)["state"] == "waiting",
            what="stream 1 of rank 0 to wait at the borrow",
        )
        url = f"{dashboard}/monarch/"
        dom = mesh_dom(tmp_path, url, ctrl.token)
        assert '<span class="last-done-seq">1</span>' in dom  # rank 1 finished seq 1
        waiting = (
            f'data-mesh="{mesh_id(ctrl.token)}" data-rank="0" data-stream="1" data-state="waiting"'
        )
        assert waiting in dom
        assert "borrow 1 (the lender's BorrowCreate)" in dom
        assert 'data-stream="0" data-state="running"' in dom
        assert 'raise RuntimeError("boom from a remote function")' in dom  # the traceback
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        chromium(
            tmp_path,
            "--window-size=1400,1000",
            "--virtual-time-budget=4000",
            f"--screenshot={shot}",
            url,
        )
        assert shot.stat().st_size > 10_000
        print(f"dashboard screenshot: {shot}")
    finally:
        gate.touch()
    reports = ctrl.sync(timeout=60)
    assert [type(r) for r in reports] == [m.FetchResult]
    dom = mesh_dom(tmp_path, url, ctrl.token)
    assert waiting not in dom
    assert (
        f'data-mesh="{mesh_id(ctrl.token)}" data-rank="0" data-stream="1" data-state="idle"'
    ) in dom
    assert '<span class="last-done-seq">3</span>' in dom


@pytest.mark.timeout(120)
def test_workers_table_shows_tensor_bytes_as_bytes():
    """distributed's Workers table formats only its own metrics; ours get a bytes format."""
    import asyncio

    from bokeh.models import DataTable, NumberFormatter
    from distributed import Scheduler, Worker
    from distributed.dashboard.components.scheduler import WorkerTable

    import dask_monarch.dashboard  # noqa: F401  (the scheduler preload)

    async def build() -> dict:
        async with (
            Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as scheduler,
            Worker(
                scheduler.address,
                nthreads=1,
                metrics={"monarch_tensor_bytes": lambda worker: 3 << 20},
            ) as worker,
        ):
            await worker.heartbeat()
            table = WorkerTable(scheduler)
            table.update()
            columns = {
                c.field: c for t in table.root.select({"type": DataTable}) for c in t.columns
            }
            return {"column": columns.get("monarch_tensor_bytes"), "data": table.source.data}

    built = asyncio.run(build())
    formatter = built["column"].formatter
    assert isinstance(formatter, NumberFormatter) and formatter.format == "0.0 b", formatter
    assert 3 << 20 in built["data"]["monarch_tensor_bytes"]  # the figure stays a number


def _routes_config(module: str) -> dict:
    """The Dask config that serves ``module``'s routes on the scheduler, as documented."""
    import dask

    routes = dask.config.get("distributed.scheduler.http.routes")
    return {"distributed.scheduler.http.routes": [*routes, module]}


@pytest.mark.timeout(300)
def test_a_rank_worker_without_the_plugin_is_shown_not_a_failed_page(throwaway_cluster):
    """A worker that advertises a rank resource by hand (``--resources monarch-rank0=1``) has
    no plugin until a controller claims it: its row says so, and the page still answers
    (it was a 500 for the whole cluster)."""
    with throwaway_cluster(
        1,
        plain=True,
        dashboard_address="127.0.0.1:0",
        resources={"monarch-rank0": 1},
        config=_routes_config("dask_monarch.observability.dashboard"),
    ) as (cluster, client):
        base = client.dashboard_link.rsplit("/", 1)[0]
        found = state(base)
        assert found["workers"], found
        for worker in found["workers"]:
            assert worker["ranks"] == 0 and "no dask_monarch plugin" in worker["error"], worker
        assert found["controllers"] == []


@pytest.mark.timeout(300)
def test_the_public_module_listed_in_the_route_config_serves_the_page(throwaway_cluster):
    """``dask_monarch.dashboard`` in ``distributed.scheduler.http.routes`` (as the dashboard
    module says) serves the page; it failed the scheduler's start (no ``routes``)."""
    with throwaway_cluster(
        1,
        plain=True,
        dashboard_address="127.0.0.1:0",
        config=_routes_config("dask_monarch.dashboard"),
    ) as (cluster, client):
        base = client.dashboard_link.rsplit("/", 1)[0]
        assert "<title>dask_monarch</title>" in get(f"{base}/monarch/")
        assert state(base)["controllers"] == []
