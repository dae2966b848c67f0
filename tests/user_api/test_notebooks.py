"""The notebooks in notebooks/ run from a clean kernel without errors, and leave no process behind.

Each notebook is executed from a copy in a temporary directory (the saved outputs in the repository
are not touched) by a fresh ``python3`` kernel. jupyter_client starts that kernel with this test's
own interpreter (``sys.executable``), so it imports the dask_monarch of this environment. Every
notebook starts and closes its own ``LocalMeshCluster``; a last cell, added to the copy only, checks
inside the kernel that none of the processes the notebook started is still running.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))

# Run in the kernel after the notebook's own cells: its child processes (scheduler, nannies,
# workers) must be gone once the notebook has closed its cluster. multiprocessing's resource
# tracker is not the notebook's: it lives as long as the kernel.
NO_LEFTOVER_PROCESSES = """
import sys as _sys, time as _time
import psutil as _psutil

def _leftovers():
    alive = []
    for p in _psutil.Process().children(recursive=True):
        try:
            command = " ".join(p.cmdline())
            if p.status() != _psutil.STATUS_ZOMBIE and "resource_tracker" not in command:
                alive.append(f"{p.pid}: {command[:200]}")
        except _psutil.NoSuchProcess:
            pass
    return alive

_deadline = _time.monotonic() + 20
while _leftovers() and _time.monotonic() < _deadline:
    _time.sleep(0.5)
assert not _leftovers(), "processes left running:\\n" + "\\n".join(_leftovers())
assert _sys.executable == EXECUTABLE, _sys.executable
"""


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_saved_notebook_has_outputs(path):
    """The notebooks are committed executed (they are read on GitHub), in order, without errors."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        f"{path.name} is not saved executed from a clean kernel"
    )
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} is saved with an error output: {errors[0].get('ename')}"


def test_the_trace_plot_has_a_title_and_a_legend():
    """Notebook 05's matplotlib drawing of a trace says what it shows and what its colours are."""
    nb = nbformat.read(NOTEBOOKS[0].parent / "05_debugging_and_tracing.ipynb", as_version=4)
    (plot,) = [c for c in nb.cells if c.cell_type == "code" and "broken_barh" in c.source]
    assert "ax.set_title(" in plot.source and "ax.legend(" in plot.source
    assert any(o.output_type == "display_data" for o in plot.outputs)  # saved drawn


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    nb.cells.append(
        nbformat.v4.new_code_cell(NO_LEFTOVER_PROCESSES.replace("EXECUTABLE", repr(sys.executable)))
    )
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    try:
        client.execute()  # raises CellExecutionError at the first failing cell
    finally:
        nbformat.write(nb, copy)  # left in tmp_path to look at after a failure
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
