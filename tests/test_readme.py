"""The README's commands and code blocks, run exactly as printed.

Every fenced block is parsed from README.md; each command line (each part of
an ``a && b`` line) and each Python block runs in a real process, in a
directory where the README's relative paths (``examples/``, ``benchmarks/``,
``sched.json``) resolve. Only two kinds of command are not run, and the
test says so by name: installs (``pip install ...``: ``.ci/run`` runs them
from nothing) and the test suite itself (``python -m pytest``, which is
what runs this). A README line that is neither run nor named here fails
:func:`test_every_readme_command_is_run`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent

NOT_RUN = {  # a command -> why a test does not run it
    "pip install": "an install: .ci/run installs from nothing, exactly as the README says",
    "python -m pytest": "the test suite itself (it runs this test)",
}


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", README, flags=re.S)


def commands() -> list[str]:
    """Every command of the README's bash blocks, comments dropped, ``&&`` parts split."""
    found = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            found.extend(part.strip() for part in line.split("&&") if part.strip())
    return found


def skipped(command: str) -> str | None:
    return next((why for prefix, why in NOT_RUN.items() if command.startswith(prefix)), None)


def run(command: str, cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    environ = {
        **os.environ,
        "PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
        "DASK_MONARCH__CLI__WAIT_FOR_WORKERS": "240s",
        **env,
    }
    return subprocess.run(
        command,
        shell=True,
        executable="/bin/bash",
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def explain(done: subprocess.CompletedProcess) -> str:
    out, err = done.stdout[-3000:], done.stderr[-4000:]
    return f"exit {done.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory where the README's relative paths resolve (the repository's folders)."""
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


RUN = [c for c in commands() if skipped(c) is None]
CLUSTER_COMMANDS = [c for c in RUN if "sched.json" in c]
LOCAL_COMMANDS = [c for c in RUN if c not in CLUSTER_COMMANDS]


def test_every_readme_command_is_run():
    """The README's commands: run below, or named in NOT_RUN with the reason."""
    assert commands(), "no bash block found in README.md"
    assert blocks("python"), "no python block found in README.md"
    for command in commands():
        assert skipped(command) or command in RUN, command
    assert {"dask-monarch run --ranks 4 examples/train_mlp.py"} <= set(LOCAL_COMMANDS)
    assert len(CLUSTER_COMMANDS) == 2, CLUSTER_COMMANDS
    for command in RUN:  # every script a command names exists
        for word in shlex.split(command):
            if word.endswith(".py"):
                assert (ROOT / word).is_file(), f"{command}: no {word}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.splitlines()[0][:40])
def test_readme_python_block_runs(code, workdir):
    """As a notebook cell or an interactive session runs it (``python -c``: no script file
    for the cluster's spawned processes to re-run, as in a notebook)."""
    done = run(f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}", workdir, timeout=540)
    assert done.returncode == 0, explain(done)
    assert "tensor(" in done.stdout, explain(done)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("command", LOCAL_COMMANDS)
def test_readme_command_runs(command, workdir):
    done = run(command, workdir, timeout=1700)
    assert done.returncode == 0, explain(done)
    if "train_mlp.py" in command:
        assert "matches single-process training: losses True, weights True" in done.stdout


@pytest.mark.timeout(900)
def test_readme_commands_on_an_existing_cluster(workdir, client4):
    """``sched.json`` describes a running cluster (the shared 4-rank one)."""
    client4.write_scheduler_file(str(workdir / "sched.json"))
    for command in CLUSTER_COMMANDS:
        done = run(command, workdir, timeout=400)
        assert done.returncode == 0, f"{command}\n{explain(done)}"
        if command.startswith("dask-monarch info"):
            for rank in range(4):
                assert f"monarch-rank{rank}" in done.stdout, explain(done)
        else:
            assert "losses True, weights True" in done.stdout, explain(done)
