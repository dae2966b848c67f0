"""The user's own lines, on the ranks: functions sent by value bring their file name and source.

A notebook cell's function (compiled, as IPython does, under a file name that
exists only in the kernel's ``linecache``) and a script's function (run by
``dask-monarch run`` from a file the ranks cannot read) fail and pause on a
rank; the remote traceback, the dashboard's error rows, the debugger's pause
notice and pdb's ``l``/``ll`` all show their lines.
"""

from __future__ import annotations

import json
import linecache
import os
import urllib.request

import pytest
import torch
from helpers.commands import run_command
from helpers.waiting import wait_until

import dask_monarch as dm
from dask_monarch.controller.session import live_sessions

pytestmark = pytest.mark.timeout(300)

CELL = """\
import torch


def scale_batch(x):
    y = x * 2
    if y.sum() > 0:
        raise ValueError("batch has a positive sum")
    return y


def inspect_batch(x):
    y = x + 1
    breakpoint()
    return y * 3
"""


def notebook_cell(source: str) -> dict:
    """Run ``source`` as IPython runs a cell: under a file name only this process's linecache
    knows (IPython registers its cells there), in a ``__main__`` namespace."""
    name = f"/tmp/ipykernel_{os.getpid()}/{abs(hash(source))}.py"
    assert not os.path.exists(name)
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)
    namespace = {"__name__": "__main__"}
    exec(compile(source, name, "exec"), namespace)
    return namespace


def test_a_notebook_function_failing_shows_its_lines(mesh2):
    cell = notebook_cell(CELL)
    name = cell["scale_batch"].__code__.co_filename
    with mesh2.activate():
        y = dm.remote(cell["scale_batch"], propagate=lambda x: x)(torch.ones(3))
    with pytest.raises(dm.RemoteException) as info:
        dm.inspect(y)
    text = info.value.traceback
    assert f'File "{name}", line 7, in scale_batch' in text, text
    assert 'raise ValueError("batch has a positive sum")' in text, text
    assert "<dynamic-code>" not in text, text


def test_the_dashboard_error_rows_show_the_lines(client2, mesh2):
    cell = notebook_cell(CELL.replace("positive sum", "positive sum!"))
    with mesh2.activate():
        y = dm.remote(cell["scale_batch"], propagate=lambda x: x)(torch.ones(3))
    with pytest.raises(dm.RemoteException):
        dm.inspect(y)
    base = client2.dashboard_link.rsplit("/", 1)[0]
    with urllib.request.urlopen(f"{base}/monarch/state.json", timeout=30) as response:
        state = json.loads(response.read())
    errors = [
        e["error"]
        for c in state["controllers"]
        for r in c["ranks"]
        for e in r["errors"]
        if "scale_batch" in e["error"]
    ]
    assert errors and all('raise ValueError("batch has a positive sum!")' in e for e in errors)


def test_pdb_lists_a_notebook_function_and_the_notice_shows_the_line(capfd, throwaway_cluster):
    cell = notebook_cell(CELL.replace("y * 3", "y * 3  # the last line"))
    name = cell["inspect_batch"].__code__.co_filename
    with throwaway_cluster(2, config={"dask_monarch.debug.attach": False}) as (_, client):
        mesh = dm.device_mesh(client, gpu=2)
        try:
            with mesh.activate():
                y = dm.remote(cell["inspect_batch"], propagate=lambda x: x)(torch.ones(2))
                found = wait_until(
                    lambda: paused if len(paused := dm.debug.paused(mesh)) >= 2 else None,
                    what="both ranks paused in the debugger",
                )
                assert found[0].where == f"{name}:13 in inspect_batch: breakpoint()", found[0]
                text = dm.debug.attach(0, ["l", "ll", "c"], echo=False)
                assert "(Pdb rank 0) l\n[EOF]" not in text, text  # the old answer
                assert "return y * 3  # the last line" in text, text  # `l` around line 14
                assert "def inspect_batch(x):" in text, text  # `ll`: the whole function
            # the notice's own words, after the `with` block: the only open mesh is meant
            if len(live_sessions()) == 1:
                dm.debug.attach(1, ["c"], echo=False)
            else:  # other tests of this process left meshes open: it cannot guess
                with pytest.raises(RuntimeError, match="are open: pass mesh="):
                    dm.debug.attach(1, ["c"], echo=False)
                dm.debug.attach(1, ["c"], echo=False, mesh=mesh)
            assert dm.inspect(y).tolist() == [6.0, 6.0]
        finally:
            dm.debug.continue_all(mesh)
            mesh.exit()
    err = capfd.readouterr().err
    assert f"paused in the debugger at {name}:13 in inspect_batch: breakpoint()" in err, err


SCRIPT = """\
import os
import torch
import dask_monarch as dm


def normalise(x):
    total = x.sum()
    raise RuntimeError(f"cannot normalise a batch summing to {total.item()}")


remote_normalise = dm.remote(normalise, propagate=lambda x: x)  # sent by value
os.remove(__file__)  # the ranks must not find the lines in a file of their own
mesh = dm.device_mesh(gpu=2)
with mesh.activate():
    y = remote_normalise(torch.ones(2))
    dm.inspect(y)
"""


def test_a_dask_monarch_run_script_function_shows_its_lines(tmp_path, cluster2, client2):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = run_command(
        ["run", "-q", "--scheduler-address", cluster2.scheduler_address, str(script)],
        tmp_path,
        timeout=200,
    )
    assert done.returncode == 3, done.stderr
    assert f'File "{script}", line 8, in normalise' in done.stderr, done.stderr
    expected = 'raise RuntimeError(f"cannot normalise a batch summing to {total.item()}")'
    assert expected in done.stderr, done.stderr
    assert "<dynamic-code>" not in done.stderr
