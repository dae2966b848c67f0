"""dm.elastic: a function whose mesh broke runs again once the ranks are back (issue 39 item 2).

Kill-a-worker tests: a throw-away cluster of their own.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import long_job

import dask_monarch as dm

pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def client(throwaway_cluster):
    with throwaway_cluster(2) as (_, client):
        yield client


def test_a_lost_rank_runs_the_function_again(client, capsys):
    runs = []

    @dm.elastic(max_restarts=2, client=client)
    def job(scale):
        runs.append(os.environ["DASK_MONARCH_RESTART"])
        mesh = dm.device_mesh(client, dp=2)
        with mesh.activate():
            x = torch.ones(2) * scale
            if len(runs) == 1:
                long_job.kill_rank_1(mesh)  # SIGKILL: its nanny starts it again
            total = dm.inspect(x.reduce("dp", "sum"))
        mesh.exit()
        return total

    assert job(3).tolist() == [6.0, 6.0]
    assert runs == ["0", "1"]
    err = capsys.readouterr().err
    assert "dask_monarch.elastic: the mesh broke (rank " in err and "restart 1 of 2" in err


def test_the_functions_own_failure_is_raised_at_once(client):
    runs = []

    def job():
        runs.append(1)
        mesh = dm.device_mesh(client, dp=2)
        try:
            with mesh.activate():
                y = dm.remote(lambda: 1 / 0, propagate=lambda: torch.empty(1))()
                dm.inspect(y)
        finally:
            mesh.exit(cancel=True)

    with pytest.raises(dm.RemoteException, match="ZeroDivisionError"):
        dm.elastic(job, max_restarts=3, client=client)()
    assert runs == [1]
    with pytest.raises(ValueError, match="max_restarts"):
        dm.elastic(job, max_restarts=-1)


def _job(mesh):
    with mesh.activate():
        dm.random.manual_seed(0)
        w = torch.randn(4)
        mine = mesh.rank("dp").float().reshape(1)  # differs across the ranks
    return {"mesh": mesh, "w": w, "mine": mine}


def _step(job, i):
    with job["mesh"].activate():
        job["w"].add_(torch.ones(4) * i)


def test_run_steps_without_faults_drops_its_snapshots(client):
    from dask_monarch.worker import snapshots

    run = dm.run_steps(
        _step,
        4,
        mesh=lambda: dm.device_mesh(client, dp=2),
        setup=_job,
        state=lambda job: {"w": job["w"]},
    )
    assert run.recoveries == []
    expected = dm.inspect(_job(run.mesh)["w"]) + 6
    assert torch.equal(dm.inspect(run.job["w"]), expected)
    assert all(not held for held in client.run(snapshots.held).values())
    run.mesh.exit()


def test_run_steps_refuses_state_that_is_not_replicated_before_it_is_needed(client):
    with pytest.raises(ValueError, match=r"the state is not replicated: \['state.mine'\]"):
        dm.run_steps(
            _step,
            4,
            mesh=lambda: dm.device_mesh(client, dp=2),
            setup=_job,
            state=lambda job: {"w": job["w"], "mine": job["mine"]},
        )


def test_run_steps_leaves_out_generators_that_differ_with_a_warning(client):
    def setup(mesh):
        with mesh.activate():  # each rank seeds its generator with its own number
            dm.remote(lambda r: torch.manual_seed(int(r)), propagate="inspect")(mesh.rank("dp"))
            return {"mesh": mesh, "w": torch.zeros(4)}

    with pytest.warns(RuntimeWarning, match="random generators differ"):
        run = dm.run_steps(
            _step,
            2,
            mesh=lambda: dm.device_mesh(client, dp=2),
            setup=setup,
            state=lambda job: {"w": job["w"]},
        )
    assert dm.inspect(run.job["w"]).tolist() == [1.0] * 4
    run.mesh.exit()
