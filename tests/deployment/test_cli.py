"""The ``dask-monarch`` command in real processes: scripts drive a raw Controller.

Most runs use the shared cluster (``--scheduler-address``) to stay fast; one
starts the embedded LocalMeshCluster.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers.commands import child_environ, console_script, explain, run_command
from helpers.terminal import run_on_a_terminal, terminal_lines

PRELUDE = """\
import sys
import distributed
import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.placement import registered_workers
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef

S0 = StreamRef(0)


def call(seq, result, fn, *args):
    return m.CallFunction(seq, [result], [], fn, ArgsKwargs.from_python(args, {}), S0, [])


client = distributed.default_client()  # made by dask-monarch run
ctrl = dm.Controller(client, world_size=2)
ctrl.send([0, 1], m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
"""


def run_cli(
    args: list[str],
    tmp_path: Path,
    *,
    script: str | None = None,
    env: dict | None = None,
    timeout: float = 150,
    name: str = "dask-monarch",
) -> subprocess.CompletedProcess:
    """Run the command (with ``script`` written to tmp_path/script.py as its SCRIPT)."""
    if script is not None:
        (tmp_path / "script.py").write_text(PRELUDE + textwrap.dedent(script))
    return run_command(args, tmp_path, env=env, timeout=timeout, name=name)


@pytest.fixture(scope="module")
def address(cluster2, client2) -> str:
    return cluster2.scheduler_address


def test_run_on_an_embedded_cluster_prints_a_fetched_value(tmp_path):
    done = run_cli(
        ["run", "--ranks", "2", "--device", "cpu", "script.py", "first", "--flag=2"],
        tmp_path,
        script="""
        ctrl.send([0, 1], call(0, Ref(1), "torch.ones", 3))
        ctrl.send([0, 1], call(1, Ref(2), "torch.ops.aten.mul.Tensor", Ref(1), 7))
        ctrl.send(1, m.SendValue(2, None, [], "torch.ops.aten.sum.default",
                                 ArgsKwargs.from_python((Ref(2),), {}), S0))
        (fetched,) = ctrl.sync()
        print("fetched", fetched.rank, fetched.value.item())
        print("argv", sys.argv, __name__)
        print("cluster", type(client.cluster).__name__, len(registered_workers(client)))
    """,
    )
    assert done.returncode == 0, explain(done)
    assert "fetched 1 21.0" in done.stdout
    assert "argv ['script.py', 'first', '--flag=2'] __main__" in done.stdout
    assert "cluster LocalMeshCluster 2" in done.stdout
    assert "2 cpu ranks on an embedded cluster" in done.stderr  # the information line
    assert "/monarch/" in done.stderr  # with a link to the dashboard page


def test_remote_exception_exits_3_with_the_remote_traceback(tmp_path, address):
    done = run_cli(
        ["run", "--scheduler-address", address, "-q", "script.py"],
        tmp_path,
        script="""
        ctrl.send(1, call(0, Ref(1), "helpers.remote_fns.boom", 1))
        ctrl.sync()
        ctrl.get_ref(1, Ref(1), S0)  # raises dm.RemoteException
    """,
    )
    assert done.returncode == 3, explain(done)
    err = done.stderr
    assert 'File "' in err and "script.py" in err and "ctrl.get_ref(1, Ref(1), S0)" in err
    assert 'raise RuntimeError("boom from a remote function")' in err  # the remote traceback
    assert "RemoteException" in err and "a remote function failed (rank 1)" in err
    assert "dask_monarch/deployment/" not in err  # our own frames are left out


def test_device_exception_exits_4(tmp_path, address):
    done = run_cli(
        ["run", "--scheduler-address", address, "-q", "script.py"],
        tmp_path,
        script="""
        ctrl.send(0, call(0, None, "__test_panic"))
        ctrl.sync(timeout=60)
    """,
    )
    assert done.returncode == 4, explain(done)
    assert "DeviceException" in done.stderr and "the mesh broke: rank 0" in done.stderr


def test_exit_codes_of_plain_errors_and_sys_exit(tmp_path, address):
    done = run_cli(
        ["run", "--scheduler-address", address, "-q", "script.py"],
        tmp_path,
        script="""
        ctrl.close()
        sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else "a message")
    """,
    )
    assert done.returncode == 1 and "a message" in done.stderr, explain(done)
    (tmp_path / "fails.py").write_text("raise ValueError('not a mesh problem')\n")
    done = run_cli(["run", "--scheduler-address", address, "-q", "fails.py"], tmp_path)
    assert done.returncode == 1, explain(done)
    assert done.stderr.startswith("Traceback") and "ValueError: not a mesh problem" in done.stderr
    done = run_cli(["run", "--scheduler-address", address, "-q", "script.py", "7"], tmp_path)
    assert done.returncode == 7, explain(done)


@pytest.mark.parametrize("delay", ["0s", "null"])
def test_progress_line_on_stderr(tmp_path, address, delay):
    """A null progress-delay is no delay: it crashed the line's thread (a TypeError)."""
    done = run_cli(
        ["run", "--scheduler-address", address, "--progress", "-q", "script.py"],
        tmp_path,
        env={
            "DASK_MONARCH__CLI__PROGRESS_DELAY": delay,
            "DASK_MONARCH__CLI__PROGRESS_INTERVAL": "100ms",
        },
        script="""
        import time
        for seq in range(30):
            ctrl.send([0, 1], call(seq, Ref(seq + 1), "torch.ones", 1))
            ctrl.sync()
            time.sleep(0.05)
        time.sleep(0.5)
    """,
    )
    assert done.returncode == 0, explain(done)
    lines = [x for x in done.stderr.splitlines() if x.startswith("dask-monarch: 1 mesh, ")]
    assert lines, explain(done)
    assert "messages" in lines[-1] and "tasks done" in lines[-1] and "elapsed" in lines[-1]
    assert "Traceback" not in done.stderr, explain(done)


def test_info_lists_the_ranks(tmp_path, address):
    done = run_cli(["info", "--scheduler-address", address, "--json"], tmp_path)
    assert done.returncode == 0, explain(done)
    workers = json.loads(done.stdout)["workers"]
    assert [w["resource"] for w in workers] == ["monarch-rank0", "monarch-rank1"]
    assert all(w["plugin"] and w["gpus"] == 0 for w in workers)
    done = run_cli(["info", "--scheduler-address", address], tmp_path)
    assert done.returncode == 0 and "monarch-rank1" in done.stdout, explain(done)


def test_dask_monarch_is_a_dask_subcommand(tmp_path):
    done = run_cli(["monarch", "run", "--help"], tmp_path, name="dask")
    assert done.returncode == 0, explain(done)
    assert "distributed.default_client()" in done.stdout
    assert "--scheduler-file" in done.stdout and "--ranks" in done.stdout


def test_usage_errors(tmp_path):
    done = run_cli(["run", "no_such_script.py"], tmp_path)
    assert done.returncode == 2 and "no such script: no_such_script.py" in done.stderr
    done = run_cli(
        ["run", "--scheduler-address", "tcp://x:1", "--scheduler-file", "f", "x.py"], tmp_path
    )
    assert done.returncode == 2 and "not both" in done.stderr


def test_run_a_module_with_m(tmp_path, address):
    (tmp_path / "job_module.py").write_text(
        textwrap.dedent("""\
        import sys
        import distributed
        print("module", __name__, sys.argv[1:], len(distributed.default_client().ncores()))
    """)
    )
    done = run_cli(["run", "--scheduler-address", address, "-q", "-m", "job_module", "x"], tmp_path)
    assert done.returncode == 0, explain(done)
    assert "module __main__ ['x'] 2" in done.stdout


# -------------------------------------------------------------------------------- issue 17


@pytest.mark.timeout(300)
def test_more_ranks_than_workers_says_fewer_than_ranks(tmp_path, address):
    (tmp_path / "noop.py").write_text("print('never runs')\n")
    done = run_cli(
        ["run", "--scheduler-address", address, "--ranks", "6", "noop.py"],
        tmp_path,
        env={"DASK_MONARCH__CLI__WAIT_FOR_WORKERS": "2s"},
    )
    assert done.returncode == 1, explain(done)
    assert "the cluster has 2 workers, fewer than --ranks 6" in done.stderr, explain(done)
    assert "Traceback" not in done.stderr and "IOLoop is closed" not in done.stderr


@pytest.mark.timeout(300)
def test_info_on_an_unreachable_scheduler_is_a_short_clear_error(tmp_path):
    done = run_cli(
        ["info", "--scheduler-address", "tcp://127.0.0.1:1"],
        tmp_path,
        env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"},
    )
    assert done.returncode == 1, explain(done)
    assert "cannot reach the scheduler at tcp://127.0.0.1:1" in done.stderr, explain(done)
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) <= 3, explain(done)


@pytest.mark.timeout(300)
def test_a_remote_failure_nobody_fetched_fails_the_run(tmp_path, address):
    (tmp_path / "unfetched.py").write_text(
        textwrap.dedent("""\
        import torch
        import dask_monarch as dm

        mesh = dm.device_mesh(gpu=2)
        with mesh.activate():
            dm.remote("helpers.remote_fns.boom", propagate=lambda t: t)(torch.ones(2))
        print("script done")
        """)
    )
    done = run_cli(["run", "--scheduler-address", address, "-q", "unfetched.py"], tmp_path)
    assert "script done" in done.stdout, explain(done)
    assert done.returncode == 3, explain(done)
    assert "failure nobody fetched" in done.stderr, explain(done)
    assert "boom from a remote function" in done.stderr, explain(done)


@pytest.mark.timeout(300)
def test_progress_line_never_garbles_the_script_output(tmp_path, address):
    """On a terminal the line is erased before the script writes and drawn again after;
    its first figures are real ones."""
    (tmp_path / "script.py").write_text(
        PRELUDE
        + textwrap.dedent("""\
        import time
        for step in range(12):
            ctrl.send([0, 1], call(step, Ref(step + 1), "torch.ones", 1))
            ctrl.sync()
            print(f"step {step:3d}  loss {1 / (step + 1):.5f}")
            print("partial", end="", flush=True)
            time.sleep(0.1)
            print(" line", file=sys.stderr)
            time.sleep(0.1)
        """)
    )
    environ = child_environ(
        {"DASK_MONARCH__CLI__PROGRESS_DELAY": "0s", "DASK_MONARCH__CLI__PROGRESS_INTERVAL": "20ms"}
    )
    code, raw = run_on_a_terminal(
        [console_script(), "run", "--scheduler-address", address, "-q", "script.py"],
        tmp_path,
        environ,
    )
    assert code == 0, raw
    shown = terminal_lines(raw)
    steps = [x for x in shown if "step" in x]
    assert steps == [f"step {s:3d}  loss {1 / (s + 1):.5f}" for s in range(12)], shown
    assert shown.count("partial line") == 12, shown
    drawn = [x for x in raw.replace("\n", "\r").split("\r") if x.startswith("dask-monarch: ")]
    assert drawn, raw  # the line was shown while the script ran ...
    assert all(x.startswith("dask-monarch: 1 mesh, ") for x in drawn), drawn  # ... real figures
    assert not any(x.startswith("dask-monarch: 0 ") or " 0 messages" in x for x in drawn)


@pytest.mark.timeout(300)
def test_debug_on_an_unreachable_scheduler_is_a_short_clear_error(tmp_path):
    done = run_cli(
        ["debug", "--scheduler-address", "tcp://127.0.0.1:1"],
        tmp_path,
        env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"},
    )
    assert done.returncode == 1, explain(done)
    assert "cannot reach the scheduler at tcp://127.0.0.1:1" in done.stderr, explain(done)
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) <= 3, explain(done)


def test_bad_durations_and_sizes_are_usage_errors_naming_the_option(tmp_path):
    """Not a KeyError/ValueError traceback from dask's parsers, and never a worker started."""
    for option, value, words in [
        ("--batched-interval", "1xs", "is not a duration"),
        ("--batched-interval", "-1ms", "is not a duration"),
        ("--memory-limit", "16QQ", "is not a size"),
    ]:
        done = run_cli(
            ["worker", "tcp://127.0.0.1:1", "--gpus", "0", f"{option}={value}"], tmp_path
        )
        assert done.returncode == 2, explain(done)
        assert option in done.stderr and words in done.stderr, explain(done)
        assert "Traceback" not in done.stderr, explain(done)


def test_preload_options_are_checked_by_their_parser():
    """A preload's failure is only logged by Dask, which starts the server without it: the
    message must name the option and say what it takes."""
    import click

    from dask_monarch.deployment import comm_gaps, preload

    for command, option in [
        (preload.dask_setup, "--monarch-batched-interval"),
        (comm_gaps.dask_setup, "--batched-interval"),
    ]:
        with pytest.raises(click.BadParameter, match="is not a duration") as raised:
            command.make_context("dask_setup", [f"{option}=abc"])
        assert option in raised.value.format_message() or option in str(raised.value.param.opts)
        context = command.make_context("dask_setup", [f"{option}=1ms"])
        assert context.params[option.lstrip("-").replace("-", "_")] == 0.001


@pytest.mark.timeout(300)
def test_no_monarch_page_link_where_the_scheduler_serves_none(tmp_path, throwaway_cluster):
    """A scheduler started without the dashboard preload has no /monarch/ page: the commands
    must not print a link to it (it answered 404), but say how to get it."""
    with throwaway_cluster(1, plain=True, dashboard_address="127.0.0.1:0") as (cluster, client):
        at = cluster.scheduler_address
        done = run_cli(["info", "--scheduler-address", at], tmp_path)
        assert done.returncode == 0, explain(done)
        assert not re.search(r"http\S*/monarch/", done.stdout), explain(done)
        assert "--preload dask_monarch.dashboard" in done.stdout, explain(done)
        done = run_cli(["info", "--scheduler-address", at, "--json"], tmp_path)
        assert json.loads(done.stdout)["monarch_page"] is None, explain(done)
        (tmp_path / "noop.py").write_text("print('ran')\n")
        done = run_cli(["run", "--scheduler-address", at, "noop.py"], tmp_path)
        assert done.returncode == 0 and "ran" in done.stdout, explain(done)
        assert not re.search(r"http\S*/monarch/", done.stderr), explain(done)


@pytest.mark.timeout(300)
def test_run_without_a_dashboard_prints_no_dashboard_link(tmp_path):
    """--dashboard-address '' (none): Dask's scheduler still listens for HTTP on 8787, without
    its pages or ours, so a link would lead nowhere."""
    (tmp_path / "noop.py").write_text("print('ran')\n")
    done = run_cli(["run", "--ranks", "1", "--dashboard-address", "", "noop.py"], tmp_path)
    assert done.returncode == 0 and "ran" in done.stdout, explain(done)
    assert "embedded cluster at" in done.stderr and "dashboard" not in done.stderr, explain(done)


def test_info_names_the_monarch_page_of_a_cluster_that_serves_it(tmp_path, address, client2):
    done = run_cli(["info", "--scheduler-address", address, "--json"], tmp_path)
    page = json.loads(done.stdout)["monarch_page"]
    assert page == client2.dashboard_link.rsplit("/", 1)[0] + "/monarch/", explain(done)


@pytest.mark.parametrize(
    "setting, options",
    [
        ("CLI__WAIT_FOR_WORKERS", ["--ranks", "2"]),
        ("CLI__PROGRESS_INTERVAL", ["--progress"]),
        ("ELASTIC__WAIT_FOR_RANKS", ["--max-restarts", "1"]),
    ],
)
def test_a_bad_setting_of_run_is_one_line_before_the_script(tmp_path, address, setting, options):
    """Not a traceback (wait-for-ranks: only once a mesh broke, after the script had run)."""
    (tmp_path / "noop.py").write_text("print('ran')\n")
    done = run_cli(
        ["run", "--scheduler-address", address, *options, "noop.py"],
        tmp_path,
        env={f"DASK_MONARCH__{setting}": "abc"},
    )
    key = setting.lower().replace("__", ".").replace("_", "-")
    assert done.returncode == 1, explain(done)
    assert f"Error: the setting dask_monarch.{key}" in done.stderr, explain(done)
    assert "is 'abc', which is not a duration" in done.stderr, explain(done)
    assert "Traceback" not in done.stderr and "ran" not in done.stdout, explain(done)
