"""Long jobs lose a rank and finish with the weights of a run that lost none (issue 39 item 4).

tests/helpers/long_job.py trains data-parallel on two ranks with data keyed by step.
Each killing run starts its own embedded cluster (``dask-monarch run
--ranks 2``), whose nanny brings the SIGKILLed worker back; the uninterrupted
reference runs once on the shared cluster. The step a rank dies in is drawn at
random (the seed is printed; ``LONG_JOB_SEED`` replays it).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import dask
import pytest
import torch
from helpers.commands import TESTS, run_command

STEPS = 8
SAVE_EVERY = 2

pytestmark = pytest.mark.timeout(600)


def kill_step() -> int:
    """A step to kill a rank in, at random (but not the first: a save precedes it)."""
    seed = int(os.environ.get("LONG_JOB_SEED", random.randrange(1 << 30)))
    step = random.Random(seed).randrange(SAVE_EVERY, STEPS - 1)
    print(f"\nLONG_JOB_SEED={seed}: rank 1 dies in step {step}")
    return step


def run_job(tmp_path: Path, *args: str, timeout: float = 480) -> tuple[dict, str]:
    """``dask-monarch run [options] long_job.py OUT [job options]``: its results and stderr.

    ``args`` are the run's options, then ``--``, then the job's options.
    """
    split = args.index("--")
    out = tmp_path / "out.pt"
    done = run_command(
        ["run", *args[:split], str(TESTS / "helpers" / "long_job.py"), str(out)]
        + ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *args[split + 1 :]],
        tmp_path,
        timeout=timeout,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-6000:]}"
    return torch.load(out), done.stderr


@pytest.fixture(scope="module")
def reference(cluster2, client2, tmp_path_factory) -> dict:
    """The job run without a fault, on the shared cluster."""
    tmp = tmp_path_factory.mktemp("reference")
    result, _ = run_job(
        tmp, "--scheduler-address", cluster2.scheduler_address, "-q", "--",
        "--checkpoint-dir", str(tmp / "ckpt"),
    )  # fmt: skip
    assert result["run"] == 0 and sorted(result["losses"]) == list(range(STEPS))
    return result


def same_weights(result: dict, reference: dict) -> None:
    for got, want in zip(result["weights"], reference["weights"], strict=True):
        assert torch.equal(got, want)


def test_a_rank_killed_mid_step_restarts_from_the_checkpoint(tmp_path, reference):
    step = kill_step()
    ckpt = tmp_path / "ckpt"
    result, stderr = run_job(
        tmp_path, "--ranks", "2", "--device", "cpu", "--max-restarts", "2", "--",
        "--checkpoint-dir", str(ckpt), "--kill-at", str(step),
    )  # fmt: skip
    assert result["run"] == 1, stderr
    assert "restart 1 of 2" in stderr and "the mesh broke (rank " in stderr, stderr
    assert "the script ran 2 times (1 restarts)" in stderr
    # the second run's first step follows the latest complete save: the one before the
    # step, or the one before that if the kill came while it was being written (async)
    resumed = min(result["losses"])
    assert resumed in (step - step % SAVE_EVERY, step - step % SAVE_EVERY - SAVE_EVERY)
    same_weights(result, reference)
    for s in result["losses"]:
        assert result["losses"][s] == reference["losses"][s]


def test_a_rank_killed_mid_checkpoint_leaves_the_previous_one_to_resume_from(tmp_path, reference):
    step = kill_step() // SAVE_EVERY * SAVE_EVERY + SAVE_EVERY - 1  # a step that saves
    ckpt = tmp_path / "ckpt"
    result, stderr = run_job(
        tmp_path, "--ranks", "2", "--device", "cpu", "--max-restarts", "1", "--",
        "--checkpoint-dir", str(ckpt), "--kill-at", str(step), "--kill-in", "checkpoint",
    )  # fmt: skip
    assert result["run"] == 1, stderr
    killed_in = (ckpt / "killed-in").read_text()  # the save under way when rank 1 died
    torn_number = int(killed_in.split("-")[1].split(".")[0])
    assert torn_number == step // SAVE_EVERY + 1
    resumed = min(result["losses"])
    assert resumed == step - SAVE_EVERY + 1, (resumed, step)  # from the save before
    same_weights(result, reference)
    assert not list(ckpt.glob(".checkpoint-*"))  # the torn one was cleared by a later save


def test_a_remote_exception_is_not_restarted(tmp_path, cluster2):
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, sys, torch\n"
        "import dask_monarch as dm\n"
        "print('run', os.environ['DASK_MONARCH_RESTART'], file=sys.stderr)\n"
        "mesh = dm.device_mesh(dp=2)\n"
        "with mesh.activate():\n"
        "    x = dm.remote(lambda: 1 / 0, propagate=lambda: torch.empty(1))()\n"
        "    dm.inspect(x)\n"
    )
    done = run_command(
        ["run", "--scheduler-address", cluster2.scheduler_address]
        + ["--max-restarts", "3", str(script)],
        tmp_path,
        timeout=300,
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.count("run 0") == 1 and "run 1" not in done.stderr
    assert "restart" not in done.stderr and "ZeroDivisionError" in done.stderr


def test_a_rank_killed_mid_step_is_replaced_within_the_job(tmp_path, reference):
    step = kill_step()
    result, stderr = run_job(
        tmp_path, "--ranks", "2", "--device", "cpu", "--", "--recover", "--kill-at", str(step)
    )
    assert result["run"] == 0, stderr  # one run: the job's process carried on
    losses = result["losses"]
    assert losses.pop("recoveries") == 1
    assert f"run_steps: the mesh broke in step {step} (rank " in stderr, stderr
    # from the failed step, or the one before if its snapshot was not taken on rank 0 yet
    assert f"runs again from step {step}" in stderr or f"from step {step - 1}" in stderr
    same_weights(result, reference)
    assert losses == reference["losses"]


def test_waiting_for_the_ranks_leaves_the_clusters_own_view_of_its_workers(cluster2, client2):
    """A restart waits for its ranks by asking the scheduler. Client.wait_for_workers would
    hand the wait to the cluster, which replaces its worker list with a snapshot: the
    scheduler's news of the lost worker, arriving after it, then named a worker the list
    lacked (KeyError), which ended the cluster's watch of its workers (no rank was brought
    back after that) and made ``dask-monarch run`` fail at its close after the job
    succeeded."""
    from dask_monarch.deployment import restarts

    view = cluster2.scheduler_info
    said = []
    restarts.wait_for_ranks(client2, 2, said.append)
    assert cluster2.scheduler_info is view
    assert said and said[0].startswith("2 ranks are up after ")
    with pytest.raises(TimeoutError, match="waited 0.5s for 3 ranks to run again, 2 came back"):
        with dask.config.set({"dask_monarch.elastic.wait-for-ranks": "500ms"}):
            restarts.wait_for_ranks(client2, 3, said.append)
