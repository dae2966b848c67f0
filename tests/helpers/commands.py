"""Running this environment's commands (``dask-monarch``, ``dask``) from tests, as a user's
shell would: one place for where they are, the environment a child gets, and the process
groups a test starts and must stop."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent  # this environment's console scripts
TESTS = Path(__file__).parents[1]


def console_script(name: str = "dask-monarch") -> str:
    """The path of console script ``name`` of this environment (or what the PATH finds)."""
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name) or name


def child_environ(env: dict | None = None) -> dict:
    """The environment of a child process: this one and ``env``, with the test helpers on
    PYTHONPATH (an embedded cluster's workers import them by path, as pytest's do)."""
    environ = {**os.environ, **(env or {})}
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS), environ.get("PYTHONPATH", "")) if p
    )
    return environ


def run_command(
    args: list[str],
    cwd: Path,
    *,
    env: dict | None = None,
    timeout: float = 150,
    name: str = "dask-monarch",
) -> subprocess.CompletedProcess:
    """Run ``name args`` in ``cwd`` to its end, with no stdin; its output captured as text."""
    return subprocess.run(
        [console_script(name), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=child_environ(env),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def explain(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-4000:]}"


# -- servers that run while the test does -----------------------------------------------------


def start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    """Start ``args`` in a session of its own (its whole group is stopped), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )


def stop(processes: list[subprocess.Popen]) -> None:
    """Terminate each process group, then kill what is left."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the group: nannies' workers too
        except ProcessLookupError:
            pass
        process.wait(timeout=10)


def logs(folder: Path) -> str:
    """The end of every ``*.log`` in ``folder`` (what :func:`start` wrote), for a failure."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("*.log")))


def wait_for_address(scheduler_file: Path, folder: Path, timeout: float = 60) -> str:
    """The address in ``scheduler_file`` once the scheduler has written it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return json.loads(scheduler_file.read_text())["address"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    raise TimeoutError(f"no scheduler file after {timeout}s\n{logs(folder)}")


def start_scheduler(
    folder: Path, *options: str, env: dict, processes: list[subprocess.Popen]
) -> tuple[Path, str]:
    """``dask scheduler`` on 127.0.0.1 with ``options``, logging to ``folder``/scheduler.log and
    appended to ``processes`` (for :func:`stop`): its scheduler file and address."""
    scheduler_file = folder / "scheduler.json"
    processes.append(
        start(
            [console_script("dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
             "--scheduler-file", str(scheduler_file), *options],
            folder / "scheduler.log",
            env,
        )
    )  # fmt: skip
    return scheduler_file, wait_for_address(scheduler_file, folder)
