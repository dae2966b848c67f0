"""The multi-host harness as fixtures: one set of namespace hosts per test module.

Every test here is marked ``multihost`` (select with ``-m multihost``, skip
with ``-m "not multihost"``); the default run includes them. Without root
(or without network namespaces) they skip, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import cloudpickle
import netns
import probes
import pytest
from distributed import Client

import dask_monarch as dm
from dask_monarch.controller.placement import registered_workers

_why_not = netns.why_not()
cloudpickle.register_pickle_by_value(probes)  # the workers cannot import tests/


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/multihost/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.multihost)
            if _why_not is not None:
                item.add_marker(pytest.mark.skip(reason=_why_not))


def make_hosts(
    n_hosts: int,
    workers_per_host: int = 1,
    tag: str = "",
    scheduler_env: dict[str, str] | None = None,
):
    """Start the hosts, the scheduler and the workers; yield ``(hosts, client)``; clean up."""
    if _why_not is not None:
        pytest.skip(_why_not)
    netns.clean_leftovers()
    hosts = netns.Hosts(n_hosts, workers_per_host, tag=tag, scheduler_env=scheduler_env)
    try:
        hosts.start_scheduler()
        hosts.start_workers()
        n = n_hosts * workers_per_host
        with Client(hosts.scheduler_address, timeout="60s") as client:
            try:
                client.wait_for_workers(n, timeout=240)
            except Exception as e:
                raise RuntimeError(f"{n} workers did not register:\n{hosts.logs()}") from e
            yield hosts, client
    finally:
        hosts.close()


def wait_for_host(client: Client, hosts: netns.Hosts, host: int, timeout: float = 180) -> str:
    """The address of a worker on ``host`` that answers (after a partition heals)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for address in registered_workers(client):
            if hosts.host_of(address) == host:
                if answers(client, address):
                    return address
        time.sleep(1)
    raise TimeoutError(f"no worker of host {host} answered within {timeout}s:\n{hosts.logs()}")


def answers(client: Client, address: str, timeout: float = 3.0) -> bool:
    """Whether the worker at ``address`` runs a function for us within ``timeout``."""

    async def probe():
        return await asyncio.wait_for(client._run(probes.pid, workers=[address]), timeout)

    try:
        client.sync(probe)
    except Exception:
        return False
    return True


def exit_quietly(mesh) -> None:
    with contextlib.suppress(dm.RemoteException, dm.DeviceException):
        mesh.exit()
