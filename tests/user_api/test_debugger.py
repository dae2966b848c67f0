"""Remote debugging: breakpoint() on a rank opens a pdb that the controller's user drives.

The tests drive pdb through ``dm.debug`` (the API ``dask-monarch debug``
uses too) and through the command itself, with stdin piped. They run on a
throw-away 2-rank cluster: a test that fails while a rank is paused must not
leave a lane of the shared clusters blocked.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time

import dask.config
import pytest
import torch
from helpers.debug_fns import stop_and_double, stop_where_positive, stop_with_dm
from helpers.waiting import wait_until

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))
FNS = os.path.join(os.path.dirname(HERE), "helpers", "debug_fns.py")
NO_ATTACH = {"dask_monarch.debug.attach": False}  # a wait never reads the test's stdin
SHORT = {  # heartbeats every 200 ms; a stalled lane warns after 2 s
    "dask_monarch.timeouts.heartbeat": "200ms",
    "dask_monarch.timeouts.liveness": "2s",
}


@pytest.fixture(scope="module")
def dbg_client(throwaway_cluster):
    with throwaway_cluster(2) as (_, client):
        yield client


@contextlib.contextmanager
def mesh_of(client, **config):
    with dask.config.set({**NO_ATTACH, **config}):
        mesh = dm.device_mesh(client, gpu=2)
    try:
        with mesh.activate():
            yield mesh
    finally:
        with contextlib.suppress(Exception):
            dm.debug.continue_all(mesh)
        with contextlib.suppress(dm.RemoteException, dm.DeviceException):
            mesh.exit()


def wait_paused(mesh, n: int, timeout: float = 120.0) -> list:
    def paused() -> list | None:
        found = dm.debug.paused(mesh)
        return found if len(found) >= n else None

    return wait_until(paused, timeout, f"{n} ranks paused in the debugger", every=0.1)


def test_pdb_commands_on_a_paused_rank_and_the_notice(dbg_client, capfd):
    with mesh_of(dbg_client) as mesh:
        x = torch.ones(3)
        y = dm.remote(stop_and_double)(x)  # rank 0 also runs it on fakes: that never stops
        found = wait_paused(mesh, 2)
        assert sorted(p.rank for p in found) == [0, 1]
        assert all(p.where.startswith(f"{FNS}:10 in stop_and_double") for p in found)
        text = dm.debug.attach(0, ["p x", "p y", "n", "p z", "c"], echo=False)
        assert "breakpoint() at" in text and "debug_fns.py(11)stop_and_double()" in text
        assert "(Pdb rank 0) p x\ntensor([1., 1., 1.])" in text
        assert "(Pdb rank 0) p y\ntensor([2., 2., 2.])" in text
        assert "-> return z" in text  # `n` stepped one line
        assert "(Pdb rank 0) p z\ntensor([3., 3., 3.])" in text
        assert [p.rank for p in dm.debug.paused(mesh)] == [1]  # rank 1 kept its pause
        dm.debug.attach(1, ["c"], echo=False)
        assert dm.inspect(y).tolist() == [3.0, 3.0, 3.0]
        assert dm.debug.paused(mesh) == []
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert f"rank {rank}, stream 1, seq" in err
    assert f"paused in the debugger at {FNS}:10 in stop_and_double" in err
    assert "dm.debug.attach(1)" in err and "dask-monarch debug --scheduler-address" in err


def test_quit_fails_the_call_and_the_rank_lives_on(dbg_client):
    with mesh_of(dbg_client) as mesh:
        y = dm.remote(stop_with_dm)(torch.zeros(2))
        wait_paused(mesh, 2)
        text = dm.debug.attach(0, ["p w", "q"], echo=False)
        assert "tensor([10., 10.])" in text
        assert "quitting: the call fails with bdb.BdbQuit on rank 0" in text
        dm.debug.attach(1, ["c"], echo=False)
        with pytest.raises(dm.RemoteException, match="BdbQuit"):
            dm.inspect(y)
        assert dm.inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]


def test_dm_breakpoint_from_the_controller_and_in_a_compiled_function(dbg_client):
    with mesh_of(dbg_client) as mesh:
        x = torch.arange(4.0) + 1
        dm.breakpoint(x)
        wait_paused(mesh, 2)
        text = dm.debug.attach(1, ["p values[0]", "c"], echo=False)
        assert "dm.breakpoint() at" in text and "test_debugger.py:" in text
        assert "(on the controller)" in text
        assert "tensor([1., 2., 3., 4.])" in text
        assert len(dm.debug.continue_all(mesh)) == 1  # rank 0

        @dm.compile
        def step(t):
            u = t * 3
            breakpoint()  # recorded: every replay stops here, on every rank
            return u + 1

        for _ in range(2):  # the trace, then a replay
            out = step(x)
            for p in wait_paused(mesh, 2):
                assert "test_debugger.py:" in p.where and "(on the controller)" in p.where
            dm.debug.continue_all(mesh)
            assert dm.inspect(out).tolist() == [4.0, 7.0, 10.0, 13.0]


@pytest.mark.filterwarnings("ignore::dask_monarch.LivenessWarning")
def test_a_collective_waits_for_the_paused_rank_and_the_warning_says_why(dbg_client):
    with mesh_of(dbg_client, **SHORT) as mesh:
        controller = mesh._session.controller
        r = mesh.rank("gpu")  # 0 on rank 0, 1 on rank 1
        y = dm.remote(stop_where_positive, propagate=lambda x: x.clone())(r.float())
        total = y.reduce("gpu")  # rank 0 waits in the all-reduce for rank 1
        wait_paused(mesh, 1)

        def about_the_debugger() -> list[str]:  # a loaded machine may warn of a slow start first
            issued = [str(w) for w in controller._liveness.issued]
            return [w for w in issued if "the debugger" in w]

        (warning, *_) = wait_until(about_the_debugger, 120, "a warning about the debugger")
        assert "on the debugger: rank 1 paused at" in warning
        assert f"{FNS}:23 in stop_where_positive" in warning and "dm.debug.attach(1)" in warning
        assert "all-reduce" in warning or "allreduce" in warning  # rank 0's wait names rank 1
        text = dm.debug.attach(1, ["p x", "c"], echo=False)
        assert "tensor(1.)" in text
        assert dm.inspect(total).item() == 1.0


def test_a_blocking_fetch_attaches_an_interactive_user(dbg_client, monkeypatch, capsys):
    with mesh_of(dbg_client, **{"dask_monarch.debug.attach": True}) as mesh:
        y = dm.remote(stop_and_double)(torch.ones(2))
        wait_paused(mesh, 2)
        monkeypatch.setattr(sys, "stdin", io.StringIO("p y\nc\nc\n"))
        assert dm.inspect(y).tolist() == [3.0, 3.0]
    out = capsys.readouterr().out
    assert "(Pdb rank 0) tensor([2., 2.])" in out  # input() echoes nothing: no command
    assert "(Pdb rank 1) " in out


def debug_command(client, commands: str) -> subprocess.CompletedProcess:
    """``dask-monarch debug`` against ``client``'s scheduler, ``commands`` on its stdin."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-m", "dask_monarch.deployment.cli", "debug"]
        + ["--scheduler-address", client.scheduler.address],
        input=commands,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


def test_the_dask_monarch_debug_command(dbg_client):
    with mesh_of(dbg_client) as mesh:
        y = dm.remote(stop_and_double)(torch.ones(3) * 2)
        wait_paused(mesh, 2)
        commands = "list\nattach 0\np x\nn\ndetach\nlist\nattach 0\nc\ncontinue\nquit\n"
        done = debug_command(dbg_client, commands)
        assert done.returncode == 0, done.stderr
        out = done.stdout
        assert out.count("rank 0   stream 'main' (1)") == 2  # listed twice
        assert f"mesh {mesh._session.controller.mesh_id}  {FNS}:10" in out
        assert "tensor([2., 2., 2.])" in out  # p x
        assert "-> return z" in out  # n, then detached: still paused, listed again
        assert "resumed 1 paused lanes" in out  # continue: rank 1
        assert dm.inspect(y).tolist() == [5.0, 5.0, 5.0]


def test_a_collective_timing_out_on_a_paused_rank_says_so(dbg_client):
    with mesh_of(dbg_client, **{"dask_monarch.timeouts.collective": "3s"}) as mesh:
        r = mesh.rank("gpu")
        y = dm.remote(stop_where_positive, propagate=lambda x: x.clone())(r.float())
        total = y.reduce("gpu")
        wait_paused(mesh, 1)
        with pytest.raises(dm.DeviceException) as failed:
            dm.inspect(total)
        text = str(failed.value)
        assert "meanwhile paused in the debugger: rank 1 at" in text
        assert "dask_monarch.timeouts.collective" in text
        wait_until(  # the broken controller's pause ends on its own
            lambda: dm.debug.paused(client=dbg_client) == [], 60, "the pause to end"
        )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_line_gives_the_terminal_to_a_paused_rank(dbg_client):
    from dask_monarch.observability.progress import ProgressLine

    with mesh_of(dbg_client) as mesh:
        y = dm.remote(stop_and_double)(torch.ones(1))
        wait_paused(mesh, 2)
        log, terminal = io.StringIO(), _Terminal()
        lines = [ProgressLine(s, interval=0.05, delay=0) for s in (log, terminal)]
        for line in lines:
            line.start()
        time.sleep(1.0)
        while_paused = terminal.getvalue()
        dm.debug.continue_all(mesh)
        assert dm.inspect(y).tolist() == [3.0]
        try:
            wait_until(lambda: "dask-monarch:" in terminal.getvalue(), 30, "the line again")
        finally:
            for line in lines:
                line.stop()
    assert while_paused == ""  # not drawn over the pdb prompt
    assert "dask-monarch:" in terminal.getvalue()  # drawn again once resumed
    assert "2 paused in the debugger" in log.getvalue()


def test_a_second_attach_shows_the_header_and_the_prompt_again(dbg_client):
    """The first driver took pdb's pending output; whoever attaches next sees the pause's
    header and the last prompt again (a command typed blind still worked)."""
    with mesh_of(dbg_client) as mesh:
        y = dm.remote(stop_and_double)(torch.ones(3) * 2)
        wait_paused(mesh, 2)
        commands = "attach 1\ndetach\nattach 1\np x\ndetach\nattach 1\nc\ncontinue\nquit\n"
        done = debug_command(dbg_client, commands)
        assert done.returncode == 0, done.stderr
        out = done.stdout
        assert out.count("rank 1, stream 'main' (1), seq") == 3, out  # the header, each attach
        assert out.count("(Pdb rank 1) ") >= 4, out  # and its prompt (one more after p x)
        assert "tensor([2., 2., 2.])" in out  # p x
        assert dm.inspect(y).tolist() == [5.0, 5.0, 5.0]

        # the same after a scripted attach that ended without c or q
        y = dm.remote(stop_and_double)(torch.ones(3))
        wait_paused(mesh, 2)
        first = dm.debug.attach(0, ["p x"], echo=False)
        second = dm.debug.attach(0, ["c"], echo=False)
        for text in (first, second):
            assert "rank 0, stream 'main' (1), seq" in text and "(Pdb rank 0) " in text, text
        dm.debug.attach(1, ["c"], echo=False)
        assert dm.inspect(y).tolist() == [3.0, 3.0, 3.0]
