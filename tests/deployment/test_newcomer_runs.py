"""``dask-monarch run`` as a newcomer first meets it: on a CPU host, from a terminal.

The embedded cluster's size follows the hardware (never ``CUDA_VISIBLE_DEVICES``
alone), and the command says what it is doing while the cluster starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.commands import console_script, run_command
from helpers.terminal import run_on_a_terminal

from dask_monarch.deployment.workers import visible_gpus

pytestmark = pytest.mark.timeout(300)


def python(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python SCRIPT`` as a user runs it, in ``cwd``."""
    return subprocess.run(
        [sys.executable, script],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=200,
        stdin=subprocess.DEVNULL,
    )


def test_visible_gpus_are_what_the_hardware_has_not_what_the_environment_says(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    found = visible_gpus()
    assert len(found) == min(2, torch.cuda.device_count()), found
    assert found == ["0", "1"][: len(found)]


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="a host without a GPU")
def test_run_on_a_cpu_host_with_cuda_visible_devices_starts_cpu_ranks(tmp_path):
    (tmp_path / "hello.py").write_text(
        "import torch\nimport dask_monarch as dm\n"
        "mesh = dm.device_mesh(gpu=2)\n"
        "with mesh.activate():\n"
        "    print('value', dm.inspect(torch.ones(2) * 3).tolist())\n"
        "mesh.exit()\n"
    )
    done = run_command(
        ["run", "hello.py"], tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert "2 cpu ranks on an embedded cluster" in done.stderr, done.stderr
    assert "value [3.0, 3.0]" in done.stdout


def test_a_script_without_the_main_guard_says_where_it_goes(tmp_path):
    (tmp_path / "unguarded.py").write_text(
        "from distributed import Client\nimport dask_monarch as dm\n"
        "cluster = dm.LocalMeshCluster(n_ranks=2, device='cpu')\n"
        "client = Client(cluster)\n"
    )
    done = python("unguarded.py", tmp_path)
    assert done.returncode != 0
    assert 'put the code that makes the cluster under `if __name__ == "__main__":`' in done.stderr
    assert "bootstrapping phase" not in done.stderr, done.stderr[-3000:]


def test_run_on_a_terminal_says_what_starts_and_shows_the_ranks_coming_up(tmp_path):
    """The embedded cluster takes seconds to start (every rank imports torch): a line says
    what starts, and on a terminal a progress line counts the worker processes and ranks."""
    (tmp_path / "hello.py").write_text("print('hello from the script')\n")
    code, raw = run_on_a_terminal(
        [console_script(), "run", "--ranks", "2", "--device", "cpu", "hello.py"], tmp_path
    )
    assert code == 0, raw
    first = raw.index("dask-monarch: starting an embedded cluster of 2 cpu ranks")
    assert first < raw.index("2 cpu ranks on an embedded cluster at"), raw
    frames = [f for f in raw.split("\r") if f.startswith("dask-monarch: starting 2 cpu ranks:")]
    assert frames and any("worker processes starting" in f for f in frames), raw[:3000]
    assert "hello from the script" in raw


def test_a_python_script_without_mesh_exit_reports_the_failure_nobody_fetched(tmp_path):
    (tmp_path / "forgot_exit.py").write_text(
        "import torch\nfrom distributed import Client\nimport dask_monarch as dm\n\n\n"
        "def normalise(x):\n    raise ValueError('a batch of zeros')\n\n\n"
        'if __name__ == "__main__":\n'
        "    client = Client(dm.LocalMeshCluster(n_ranks=2, device='cpu'))\n"
        "    mesh = dm.device_mesh(client, gpu=2)\n"
        "    with mesh.activate():\n"
        "        dm.remote(normalise, propagate=lambda x: x)(torch.ones(2))\n"
        "    print('script done')\n"
    )
    done = python("forgot_exit.py", tmp_path)
    assert "script done" in done.stdout, done.stderr
    assert "failure nobody fetched" in done.stderr, done.stderr
    assert "raise ValueError('a batch of zeros')" in done.stderr  # the remote traceback
    assert "mesh.exit()" in done.stderr
