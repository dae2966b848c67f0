"""A cluster from the ``dask`` command line with dask_monarch's preloads, driven by a batch script.

Real processes: ``dask scheduler`` and two ``dask worker`` (one preloaded by
file path, one by module name), then ``dask-monarch run --scheduler-file``.
Every process starts in its own session and its whole group is killed at the end.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
from helpers.commands import console_script, logs, run_command, start, start_scheduler, stop
from helpers.commands import explain as explain_run

from dask_monarch.controller.placement import registered_workers

ROOT = Path(__file__).parents[2]
PLUGINS = ROOT / "plugins"

SCRIPT = """\
import json
import os
import urllib.request

import distributed
import torch

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.placement import registered_workers
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef

S0 = StreamRef(0)
client = distributed.default_client()
plugins = client.run(lambda dask_worker: "dask_monarch" in dask_worker.plugins)
gpus = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
names = {w["name"]: w for w in registered_workers(client).values()}
print("preloaded", sorted(plugins.values()), "gpus", sorted(map(str, gpus.values())))

with dm.Controller(client, world_size=2) as ctrl:
    print("resources", ctrl.resources)
    print("rank0 is", registered_workers(client)[ctrl.workers[0]]["name"])
    ctrl.send([0, 1], m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
    for rank in (0, 1):
        ctrl.send(rank, m.CallFunction(0, [Ref(1)], [], "torch.full",
                                       ArgsKwargs.from_python(([2], 10.0 * (rank + 1)), {}),
                                       S0, []))
    ctrl.send([0, 1], m.SendValue(1, None, [], "torch.ops.aten.sum.default",
                                  ArgsKwargs.from_python((Ref(1),), {}), S0))
    fetched = dict(sorted((msg.rank, msg.value.item()) for msg in ctrl.sync()))
    print("sums", fetched)
    assert fetched == {0: 20.0, 1: 40.0}, fetched
    page = client.dashboard_link.rsplit("/", 1)[0] + "/monarch/state.json"
    with urllib.request.urlopen(page, timeout=30) as response:
        state = json.loads(response.read())
print("dashboard lists the mesh", [c["mesh"] for c in state["controllers"]]
      == [ctrl.mesh_id])
"""


@pytest.mark.timeout(180)
def test_dask_cli_cluster_with_preloads_runs_a_batch_script(tmp_path):
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    dask = console_script("dask")
    processes = []
    try:
        scheduler_file, address = start_scheduler(
            tmp_path,
            "--dashboard-address",
            "127.0.0.1:0",
            "--preload",
            str(PLUGINS / "dask_monarch_scheduler.py"),
            env=env,
            processes=processes,
        )
        # The address goes first, positionally: with --scheduler-file and no address,
        # `dask worker` takes the first preload option for the address (docs/deployment.md).
        common = [
            dask,
            "worker",
            address,
            "--nthreads",
            "1",
            "--host",
            "127.0.0.1",
            "--no-dashboard",
        ]
        # names in the reverse of rank order: the rank resource decides, not the name
        processes.append(
            start(
                common
                + [
                    "--name",
                    "b",
                    "--preload",
                    str(PLUGINS / "dask_monarch_worker.py"),
                    "--monarch-rank=0",
                    "--monarch-gpu=0",
                ],
                tmp_path / "worker-b.log",
                env,
            )
        )
        processes.append(
            start(
                common + ["--name", "a", "--preload", "dask_monarch.preload", "--monarch-rank=1"],
                tmp_path / "worker-a.log",
                env,
            )
        )
        (tmp_path / "job.py").write_text(textwrap.dedent(SCRIPT))
        done = run_command(
            ["run", "--scheduler-file", str(scheduler_file), "--ranks", "2", "-q", "job.py"],
            tmp_path,
            env=env,
        )
        explain = f"{explain_run(done)}\n{logs(tmp_path)}"
        assert done.returncode == 0, explain
        assert "preloaded [True, True] gpus ['0', 'None']" in done.stdout, explain
        assert "resources ['monarch-rank0', 'monarch-rank1']" in done.stdout, explain
        assert "rank0 is b" in done.stdout, explain
        assert "sums {0: 20.0, 1: 40.0}" in done.stdout, explain
        assert "dashboard lists the mesh True" in done.stdout, explain
    finally:
        stop(processes)
    assert all(p.poll() is not None for p in processes)


@pytest.mark.timeout(180)
def test_dask_monarch_worker_starts_one_rank_worker_per_gpu(tmp_path):
    """``dask-monarch worker`` on a node: a worker per listed GPU, each seeing its own GPU first,
    with its rank resource and the plugin; a mesh runs on them; SIGTERM stops every worker.

    CPU torch ignores CUDA_VISIBLE_DEVICES, so the command runs here as on a GPU node."""
    from distributed import Client

    import dask_monarch as dm
    from dask_monarch.messages import ArgsKwargs, Ref, StreamRef

    env = {**os.environ}
    processes = []
    try:
        _, address = start_scheduler(tmp_path, "--no-dashboard", env=env, processes=processes)
        node = start(
            [
                console_script("dask-monarch"),
                "worker",
                address,
                "--gpus",
                "0,1",
                "--first-rank",
                "2",
                "--host",
                "127.0.0.1",
                "--name",
                "node",
                "--memory-limit",
                "2GB",
                "--batched-interval",
                "1ms",
            ],
            tmp_path / "node.log",
            env,
        )
        processes.append(node)
        with Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            info = registered_workers(client).values()
            assert sorted(w["name"] for w in info) == ["node-gpu0", "node-gpu1"], logs(tmp_path)
            resources = {w["name"]: sorted(w["resources"]) for w in info}
            assert resources == {"node-gpu0": ["monarch-rank2"], "node-gpu1": ["monarch-rank3"]}

            def describe(dask_worker):  # nested: sent by value
                from dask_monarch import dask_internals

                return (
                    dask_worker.name,
                    os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "dask_monarch" in dask_worker.plugins,
                    dask_worker.state.nthreads,
                    dask_internals.gap(dask_worker.batched_stream),  # --batched-interval
                )

            visible = client.run(describe)
            assert sorted(visible.values()) == [
                ("node-gpu0", "0,1", True, 1, 0.001),
                ("node-gpu1", "1,0", True, 1, 0.001),
            ]
            with dm.Controller(client, world_size=2) as ctrl:
                assert ctrl.resources == ["monarch-rank2", "monarch-rank3"]
                s0 = StreamRef(0)
                ctrl.send(
                    [0, 1],
                    dm.messages.CreateStream(s0, dm.messages.StreamCreationMode.UseDefaultStream),
                )
                ctrl.send(
                    [0, 1],
                    dm.messages.CallFunction(
                        0, [Ref(1)], [], "torch.ones", ArgsKwargs.from_python(([3],), {}), s0, []
                    ),
                )
                ctrl.sync(timeout=60)
                assert ctrl.get_ref(1, Ref(1), s0).tolist() == [1.0, 1.0, 1.0]
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=30)  # the command stops its workers and exits on a signal
    finally:
        stop(processes)


@pytest.mark.timeout(180)
def test_the_batched_interval_opt_in_lowers_the_stock_clusters_gaps(tmp_path):
    """``--monarch-batched-interval=1ms`` on the scheduler's preload and a worker's (here by its
    environment variable) gives them the embedded cluster's 1 ms gaps; a worker without it
    keeps Dask's own (docs/deployment.md, "As fast as the embedded cluster")."""
    from distributed import Client

    def worker_gap(dask_worker) -> float:  # nested: sent by value (tests/ is not on workers)
        from dask_monarch import dask_internals

        return dask_internals.gap(dask_worker.batched_stream)

    def scheduler_gaps(dask_scheduler) -> dict:
        from dask_monarch import dask_internals

        streams = dask_internals.scheduler_streams(dask_scheduler)
        return {address: dask_internals.gap(stream) for address, stream in streams.items()}

    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    dask = console_script("dask")
    processes = []
    try:
        _, address = start_scheduler(
            tmp_path,
            "--no-dashboard",
            "--preload",
            "dask_monarch.preload",
            "--monarch-batched-interval=1ms",
            env=env,
            processes=processes,
        )
        common = [dask, "worker", address, "--nthreads", "1", "--host", "127.0.0.1",
                  "--no-dashboard", "--preload", "dask_monarch.preload"]  # fmt: skip
        processes.append(
            start(
                [*common, "--name", "opted"],
                tmp_path / "worker-opted.log",
                {**env, "MONARCH_BATCHED_INTERVAL": "1ms"},
            )
        )
        processes.append(start([*common, "--name", "stock"], tmp_path / "worker-stock.log", env))
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(2, timeout=120)
            names = {a: w["name"] for a, w in registered_workers(client).items()}
            workers = {names[a]: gap for a, gap in client.run(worker_gap).items()}
            assert workers["opted"] == pytest.approx(0.001), logs(tmp_path)
            assert workers["stock"] > 0.001, workers  # Dask's default
            deadline = time.monotonic() + 30
            while True:  # the client's stream is lowered right after the scheduler makes it
                scheduler = client.run_on_scheduler(scheduler_gaps)
                if all(g == pytest.approx(0.001) for g in scheduler.values()):
                    break
                assert time.monotonic() < deadline, scheduler
                time.sleep(0.1)
            assert len(scheduler) == 3, scheduler  # both workers and this client
    finally:
        stop(processes)


@pytest.mark.timeout(180)
def test_the_scheduler_preload_file_is_the_preload_module(tmp_path):
    """``plugins/dask_monarch_scheduler.py`` is ``dask_monarch.preload`` as a file (its docstring,
    docs/deployment.md): it serves the page and takes ``--monarch-batched-interval``, which
    the file refused ("Unknown argument specified")."""
    import urllib.request

    from distributed import Client

    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    processes = []
    try:
        _, address = start_scheduler(
            tmp_path,
            "--dashboard-address",
            "127.0.0.1:0",
            "--preload",
            str(PLUGINS / "dask_monarch_scheduler.py"),
            "--monarch-batched-interval=1ms",
            env=env,
            processes=processes,
        )
        with Client(address, timeout="60s") as client:
            plugins = client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
            assert "dask_monarch-comm-gaps" in plugins, logs(tmp_path)
            page = client.dashboard_link.rsplit("/", 1)[0] + "/monarch/"
            with urllib.request.urlopen(page, timeout=30) as response:
                assert b"<title>dask_monarch</title>" in response.read()
    finally:
        stop(processes)
