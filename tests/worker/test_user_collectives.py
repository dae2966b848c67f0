"""User code's collectives on ``mesh.process_group(...)`` cannot kill a shared worker (issue 35
item 4): a collective whose members disagree fails, the workers live on."""

from __future__ import annotations

import os

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def own_client(throwaway_cluster):
    """A cluster of this module's own: before the fix, these calls killed its workers."""
    with throwaway_cluster(2) as (_, client):
        yield client


@pytest.mark.parametrize(
    "how",
    ["size", "dtype", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"],
)
def test_a_mismatched_user_collective_leaves_the_workers_alive(own_client, how):
    pids = own_client.run(os.getpid)
    mesh = dm.device_mesh(own_client, gpu=2)
    try:
        reduce = dm.remote(
            "helpers.remote_fns.mismatched_collective", propagate=lambda x, pg, r, h: x[0]
        )
        with mesh.activate():
            pg = mesh.process_group("gpu")
            x = torch.ones(4)
            out = reduce(x, pg, mesh.rank("gpu"), how)
            with pytest.raises(dm.RemoteException) as info:
                dm.inspect(out)
        assert "CollectiveMismatch" in str(info.value) and "disagree" in str(info.value)
    finally:
        try:
            mesh.exit()
        except (dm.RemoteException, dm.DeviceException):
            pass
    assert own_client.run(os.getpid) == pids  # no worker died
    other = dm.device_mesh(own_client, gpu=2)  # and they serve the next mesh
    with other.activate():
        assert dm.inspect(torch.ones(2).reduce("gpu", "sum")).tolist() == [2.0, 2.0]
    other.exit()


def test_user_collectives_that_agree_run_as_before(own_client):
    mesh = dm.device_mesh(own_client, gpu=2)
    try:
        everything = dm.remote(
            "helpers.remote_fns.pg_collectives",
            propagate=lambda x, pg, mesh: (
                x.clone(),
                torch.stack([x, x]),
                x.clone(),
                x.clone(),
                0,
                0,
            ),
        )
        with mesh.activate():
            pg = mesh.process_group("gpu")
            x = torch.arange(2.0) + mesh.rank("gpu")
            total, gathered, first, received, rank, size = everything(x, pg, mesh)
            assert dm.inspect(total, gpu=1).tolist() == [1.0, 3.0]
            assert dm.inspect(gathered, gpu=0).tolist() == [[0.0, 1.0], [1.0, 2.0]]
            assert dm.inspect(first, gpu=1).tolist() == [0.0, 1.0]
            assert dm.inspect(received, gpu=0).tolist() == [1.0, 2.0]
    finally:
        mesh.exit()


def test_a_mismatched_user_receive_fails_the_call_not_the_worker(own_client):
    pids = own_client.run(os.getpid)
    mesh = dm.device_mesh(own_client, gpu=2)
    try:
        exchange = dm.remote("helpers.remote_fns.mismatched_send", propagate=lambda x, pg, r: x[0])
        with mesh.activate():
            out = exchange(torch.ones(4), mesh.process_group("gpu"), mesh.rank("gpu"))
            with pytest.raises(dm.RemoteException, match="the send carried 7 elements"):
                dm.inspect(out, gpu=1)
            assert dm.inspect(torch.ones(2).reduce("gpu", "sum")).tolist() == [2.0, 2.0]
    finally:
        mesh.exit()
    assert own_client.run(os.getpid) == pids


def test_flat_tensor_collectives_are_checked_and_run_as_before(own_client):
    """torch 2.13 reaches a group through ``all_gather_single``, ``reduce_scatter_single``,
    ``all_to_all_single`` and their coalesced forms, not the names older releases used:
    each is checked (the mismatch cases above) and, where the members agree, runs."""
    mesh = dm.device_mesh(own_client, gpu=2)
    try:
        flat = dm.remote(
            "helpers.remote_fns.pg_tensor_collectives",
            propagate=lambda x, pg: (
                torch.empty(8),
                torch.empty(2),
                torch.empty(4),
                torch.empty(2, 8),
            ),
        )
        with mesh.activate():
            pg = mesh.process_group("gpu")
            x = torch.arange(4.0) + 10 * mesh.rank("gpu")
            gathered, scattered, exchanged, coalesced = flat(x, pg)
            rank0, rank1 = [0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]
            assert dm.inspect(gathered, gpu=1).tolist() == rank0 + rank1
            assert dm.inspect(scattered, gpu=0).tolist() == [10.0, 12.0]
            assert dm.inspect(scattered, gpu=1).tolist() == [14.0, 16.0]
            assert dm.inspect(exchanged, gpu=0).tolist() == [0.0, 1.0, 10.0, 11.0]
            assert dm.inspect(exchanged, gpu=1).tolist() == [2.0, 3.0, 12.0, 13.0]
            assert dm.inspect(coalesced, gpu=0).tolist() == [
                rank0 + rank1,
                [10 * v for v in rank0 + rank1],
            ]
    finally:
        mesh.exit()
