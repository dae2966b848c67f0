"""The commands and code blocks of the README and docs/deployment.md, run exactly as printed.

README.md: every fenced block is parsed; each command line (each part of an
``a && b`` line) and each Python block runs in a real process, in a
directory where the README's relative paths (``examples/``, ``benchmarks/``,
``sched.json``) resolve. Only two kinds of command are not run, and the
test says so by name: installs (``pip install ...``: ``.ci/run`` runs them
from nothing) and the test suite itself (``python -m pytest``, which is
what runs this). A README line that is neither run nor named here fails
:func:`test_every_readme_command_is_run`.

docs/deployment.md: each bash block runs as one script, in order (a block
is a session: it may start a scheduler and workers in the background and
then use them), unless :data:`DOC_BLOCKS_NOT_RUN` names it with the reason
(GPUs, SLURM, Kubernetes, a fragment of a larger program). The one change
to what is printed: a ``dask`` on ``PATH`` that makes the servers the
blocks start listen on 127.0.0.1 and on ports the OS chooses (the project's
tests bind nothing else), then runs the real ``dask`` with the printed
arguments.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.commands import BIN

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
DEPLOYMENT = (ROOT / "docs" / "deployment.md").read_text()

NOT_RUN = {  # a command -> why a test does not run it
    "pip install": "an install: .ci/run installs from nothing, exactly as the README says",
    "python -m pytest": "the test suite itself (it runs this test)",
}


def blocks(kind: str, text: str = README) -> list[str]:
    """The fenced blocks of ``kind`` in ``text`` (an indented block, in a list, dedented)."""
    found = re.findall(rf"^( *)```{kind}\n(.*?)^ *```", text, flags=re.S | re.M)
    return [textwrap.dedent(body) if indent else body for indent, body in found]


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


@pytest.mark.timeout(600)
def test_readme_python_block_runs_as_a_script_under_the_main_guard(workdir):
    """What the README says to do with it in a ``.py`` file: the code under the guard."""
    assert 'if __name__ == "__main__":' in README
    lines = blocks("python")[0].splitlines()
    imports = [line for line in lines if line.startswith(("import ", "from "))]
    body = "\n".join(line for line in lines if line not in imports)
    script = "\n".join(imports) + '\n\nif __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    (workdir / "quickstart.py").write_text(script + "\n")
    done = run(f"{shlex.quote(sys.executable)} quickstart.py", workdir, timeout=540)
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
def test_readme_commands_on_an_existing_cluster(workdir, client2):
    """``sched.json`` describes a running cluster: two workers, as docs/deployment.md starts."""
    # what a scheduler's --scheduler-file holds, and Client(scheduler_file=) reads: not
    # client2.write_scheduler_file(), whose dump of every worker's identity raises once a
    # heartbeat carried Dask's fine performance metrics (tuple keys: JSON takes none)
    (workdir / "sched.json").write_text(
        json.dumps({"type": "Scheduler", "address": client2.scheduler.address})
    )
    for command in CLUSTER_COMMANDS:
        done = run(command, workdir, timeout=400)
        assert done.returncode == 0, f"{command}\n{explain(done)}"
        if command.startswith("dask-monarch info"):
            for rank in range(2):
                assert f"monarch-rank{rank}" in done.stdout, explain(done)
        else:
            assert "losses True, weights True" in done.stdout, explain(done)


# -- docs/deployment.md ------------------------------------------------------------------------

DOC_BLOCKS_NOT_RUN = {  # how a block of docs/deployment.md starts -> why a test does not run it
    'dask monarch worker "$SCHED" --first-rank 0': "needs GPU nodes; serves until stopped",
    "#!/bin/bash\n#SBATCH": "a SLURM batch script",
    "while true; do": "keeps a worker running for ever, by design",
    "from dask_jobqueue import SLURMCluster": "needs SLURM",
    "from dask_kubernetes.operator import KubeCluster": "needs Kubernetes",
    'mesh = dm.device_mesh(client, workers=["node0-gpu0"': "names the workers of GPU nodes",
    "from dask_monarch.logs import forward_worker_logs": "a fragment: uses a program's client",
}
DOC_BLOCKS = blocks("bash", DEPLOYMENT) + blocks("python", DEPLOYMENT)
DOC_RUN = [b for b in blocks("bash", DEPLOYMENT) if not any(map(b.startswith, DOC_BLOCKS_NOT_RUN))]

LOOPBACK_DASK = """#!/bin/bash
# the servers a docs block starts listen on loopback, on ports the OS chooses
case "$1" in
  scheduler) exec "$REAL_DASK" "$@" --host 127.0.0.1 --port 0 --dashboard-address 127.0.0.1:0 ;;
  worker) exec "$REAL_DASK" "$@" --host 127.0.0.1 --dashboard-address 127.0.0.1:0 ;;
  *) exec "$REAL_DASK" "$@" ;;
esac
"""


def test_every_deployment_block_is_run_or_named():
    assert DOC_RUN, "no bash block of docs/deployment.md is run"
    named = [b for b in DOC_BLOCKS if any(map(b.startswith, DOC_BLOCKS_NOT_RUN))]
    assert len(named) == len(DOC_BLOCKS_NOT_RUN), "a name of DOC_BLOCKS_NOT_RUN matches no block"
    assert len(DOC_RUN) + len(named) == len(DOC_BLOCKS)
    for block in DOC_RUN:  # every script a block names exists
        for word in shlex.split(block, comments=True):
            if word.endswith(".py"):
                assert (ROOT / word).is_file(), f"docs/deployment.md: no {word}"


def run_block(block: str, workdir: Path, timeout: float) -> tuple[int, str]:
    """Run ``block`` with bash -e in a session of its own; stop what it left in the background."""
    shim = workdir / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "dask").write_text(LOOPBACK_DASK)
    (shim / "dask").chmod(0o755)
    environ = {
        **os.environ,
        "PATH": os.pathsep.join([str(shim), str(BIN), os.environ.get("PATH", "")]),
        "REAL_DASK": str(BIN / "dask"),
        "DASK_MONARCH__CLI__WAIT_FOR_WORKERS": "240s",
    }
    log = workdir / "block.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["/bin/bash", "-e", "-c", block],
            cwd=workdir,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        code = process.wait(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGTERM)  # the servers it started with &
        except ProcessLookupError:
            pass
    return code, log.read_text()


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("block", DOC_RUN, ids=lambda b: b.splitlines()[0][:40])
def test_deployment_block_runs(block, workdir):
    code, output = run_block(block, workdir, timeout=1000)
    assert code == 0, f"exit {code}\n{output[-6000:]}"
    trainings = len(re.findall(r"^dask-monarch run .*train_mlp\.py", block, flags=re.M))
    assert output.count("losses True, weights True") == trainings, output[-6000:]
    if "dask-monarch info" in block:
        assert "monarch-rank0" in output and "monarch-rank1" in output, output[-6000:]
