"""Shared real clusters: starting one costs seconds, so tests share them per session.

Tests that kill workers, freeze them, or need workers started with other settings make
their own throw-away cluster with the ``throwaway_cluster`` fixture. What else the tests
share lives in the ``helpers`` package (``tests/helpers/``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import dask
import pytest
import torch
from distributed import Client, LocalCluster

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


@contextlib.contextmanager
def _throwaway_cluster(
    n_ranks: int = 2, *, config: dict | None = None, plain: bool = False, **options
) -> Iterator[tuple[dm.LocalMeshCluster | LocalCluster, Client]]:
    """A cluster of ``n_ranks`` workers on 127.0.0.1 and a client of it, once every worker
    has registered; both closed on the way out, also when the start or the test fails.

    ``config`` (dask config) holds from before the start to the close: the nannies hand it
    to the workers they start, and the test's controllers read it. The workers are rank
    workers of a ``LocalMeshCluster`` (CPU ranks, no dashboard unless ``options`` say
    otherwise: ``device``, ``worker_options``, ``memory_limit``, ...), or with ``plain``
    the plain workers of distributed's own ``LocalCluster`` (one thread each unless
    ``options`` say otherwise), as a user's shared cluster has.
    """
    with dask.config.set(config or {}):
        if plain:
            options = {"threads_per_worker": 1, "dashboard_address": None, **options}
            cluster = LocalCluster(n_ranks, host="127.0.0.1", processes=True, **options)
        else:
            options = {"device": "cpu", "dashboard_address": None, **options}
            cluster = dm.LocalMeshCluster(n_ranks, **options)
        with cluster, Client(cluster) as client:
            client.wait_for_workers(n_ranks, timeout=240)
            yield cluster, client


@pytest.fixture(scope="session")
def throwaway_cluster():
    """Start a cluster of a test's own: ``with throwaway_cluster(n_ranks, config=...,
    **options) as (cluster, client): ...``, in the test or in a fixture of the scope the
    cluster should live for (a module's tests share one; a test that kills a worker gets
    one of its own). distributed's ``gen_cluster`` is the model."""
    return _throwaway_cluster


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
