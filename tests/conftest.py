"""Shared real clusters: starting one costs seconds, so tests share them per session.

Tests that kill workers make their own throw-away cluster.
"""

from __future__ import annotations

import contextlib

import dask
import pytest
import torch
from distributed import Client

import dask_monarch as dm

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cluster2():
    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def client2(cluster2):
    with Client(cluster2) as client:
        client.wait_for_workers(2)
        yield client


@pytest.fixture(scope="session")
def cluster4():
    with dm.LocalMeshCluster(n_ranks=4, device="cpu") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def client4(cluster4):
    with Client(cluster4) as client:
        client.wait_for_workers(4)
        yield client


@pytest.fixture
def ctrl(client2):
    """A fresh raw controller on the 2-rank cluster (closed after the test)."""
    controller = dm.Controller(client2, world_size=2)
    yield controller
    controller.close()


@pytest.fixture
def ctrl4(client4):
    controller = dm.Controller(client4, world_size=4)
    yield controller
    controller.close()


def _user_mesh(client, **dims):
    mesh = dm.device_mesh(client, **dims)
    yield mesh
    with contextlib.suppress(dm.RemoteException, dm.DeviceException):
        mesh.exit()  # a test may leave a failure unfetched, or break the mesh on purpose


@pytest.fixture
def mesh(client4):
    """A 2x2 user-API mesh (host, gpu) on the 4-rank cluster, exited after the test."""
    yield from _user_mesh(client4, host=2, gpu=2)


@pytest.fixture
def mesh2(client2):
    """A user-API mesh (gpu=2) on the 2-rank cluster, exited after the test."""
    yield from _user_mesh(client2, gpu=2)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "exercises(*messages): worker messages whose effect the test checks"
    )
    config.addinivalue_line(
        "markers",
        "nccl_rules: the module's tests on ranks run twice, the second time with "
        "dask_monarch.comm.emulate-nccl (NCCL's rules checked on the gloo ranks)",
    )


# A test of a module marked nccl_rules that runs on ranks (through these fixtures) runs as
# [gloo] and as [emulate-nccl]: every rank then checks that each communicator sees the same
# operations in the same order on all its members (worker/nccl_rules.py), as NCCL needs.
_ON_RANKS = {"client2", "client4", "fuzz_client"}


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("nccl_rules") and _ON_RANKS & set(
        metafunc.fixturenames
    ):
        metafunc.parametrize("comm_rules", ["gloo", "emulate-nccl"], indirect=True)


@pytest.fixture(autouse=True)
def comm_rules(request):
    """The communicator rules controllers made in the test check (see pytest_generate_tests)."""
    mode = getattr(request, "param", "gloo")
    if mode != "emulate-nccl":
        yield mode
        return
    with dask.config.set({"dask_monarch.comm.emulate-nccl": True}):
        yield mode
