"""The trust boundary: TLS end to end, the allow-list, plain-data-only unpickling, clean failures.

One module-scoped TLS cluster whose workers allow only ``torch`` and
``helpers.remote_fns`` functions and no pickled code (docs/security.md).
"""

from __future__ import annotations

import fractions
import os
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from distributed import Security
from helpers.commands import run_command
from helpers.raw import S0, call, create_streams, failures, values

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.placement import registered_workers
from dask_monarch.messages import Ref

pytestmark = pytest.mark.timeout(300)
BOTH = [0, 1]


def make_certs(directory: Path) -> tuple[str, str]:
    """A self-signed certificate and its key (openssl: no extra Python package needed)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=dask-internal",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


def tls_security(cert: str, key: str) -> Security:
    return Security(
        tls_ca_file=cert,
        tls_client_cert=cert,
        tls_client_key=key,
        tls_scheduler_cert=cert,
        tls_scheduler_key=key,
        tls_worker_cert=cert,
        tls_worker_key=key,
        require_encryption=True,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[str, str]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_client(certs, throwaway_cluster):
    restricted = {  # the nannies hand this config to their workers
        "dask_monarch.functions.allow": ["torch", "helpers.remote_fns"],
        "dask_monarch.functions.allow-pickled": False,
    }
    with throwaway_cluster(2, config=restricted, security=tls_security(*certs)) as (_, client):
        yield client


@pytest.fixture
def tctrl(tls_client):
    controller = dm.Controller(tls_client, world_size=2)
    yield controller
    controller.close()


def test_everything_runs_over_tls(tls_client):
    assert tls_client.cluster.scheduler_address.startswith("tls://")
    assert tls_client.scheduler.address.startswith("tls://")
    workers = registered_workers(tls_client)
    assert len(workers) == 2 and all(a.startswith("tls://") for a in workers)
    mesh = dm.device_mesh(tls_client, gpu=2)
    try:
        with mesh.activate():
            x = torch.ones(3) * 2 + 1  # a mesh op; the fetch comes back on the report comms
            assert dm.inspect(x).tolist() == [3.0, 3.0, 3.0]
    finally:
        mesh.exit()


def test_allow_list_checks_what_a_path_resolves_to(tctrl):
    create_streams(tctrl, BOTH, S0)
    tctrl.send(0, call(0, Ref(1), "torch.os.getpid"))  # torch's own 'os' attribute
    tctrl.send(0, call(1, Ref(2), "os.getpid"))
    tctrl.send(0, call(2, Ref(3), "torch.ones", 2))
    errors = {f.seq: f.error for f in failures(tctrl.sync(timeout=120))}
    assert "resolves to" in errors[0] and "posix" in errors[0]
    assert "not in the allow-list" in errors[1]
    assert 2 not in errors
    assert torch.equal(tctrl.get_ref(0, Ref(3), S0, timeout=60), torch.ones(2))


def test_pickled_functions_and_argument_payloads_are_refused(tctrl):
    create_streams(tctrl, BOTH, S0)
    tctrl.send(0, call(0, Ref(1), lambda: os.getpid()))  # a pickled function
    # an argument that is not plain data: unpickling it would call a function
    tctrl.send(0, call(1, Ref(2), "torch.ones", fractions.Fraction(1, 2)))
    # tensors as arguments are plain data: they still travel
    tctrl.send(0, call(2, Ref(3), "torch.ops.aten.add.Tensor", torch.ones(2), torch.ones(2)))
    errors = {f.seq: f.error for f in failures(tctrl.sync(timeout=120))}
    assert "pickled functions are disabled" in errors[0]
    assert "fractions.Fraction is not plain data" in errors[1]
    assert 2 not in errors
    assert torch.equal(tctrl.get_ref(0, Ref(3), S0, timeout=60), torch.full((2,), 2.0))


def test_plain_set_ref_values_load_and_others_are_refused(tctrl):
    create_streams(tctrl, BOTH, S0)
    plain = {"a": [1, (2.5, "x")], "t": torch.arange(3), "dt": torch.float16}
    tctrl.send(BOTH, m.SetRefUnitTestsOnly(Ref(1), plain, S0))
    tctrl.send(BOTH, m.SendValue(0, None, [], None, m.ArgsKwargs.from_python((Ref(1),)), S0))
    got = values(tctrl.sync(timeout=120))
    assert got[(0, 0)]["a"] == [1, (2.5, "x")] and torch.equal(got[(0, 1)]["t"], torch.arange(3))
    tctrl.send(1, m.SetRefUnitTestsOnly(Ref(2), fractions.Fraction(1, 3), S0))
    with pytest.raises(dm.DeviceException, match="fractions.Fraction is not plain data"):
        tctrl.sync(timeout=120)


def _children() -> set[int]:
    """Our child processes, but for multiprocessing's long-lived helpers."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "resource_tracker" not in line and "forkserver" not in line:
            found.add(child.pid)
    return found


def _gone(pids: set[int]) -> set[int]:
    psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=20)
    return {
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    }


def test_encryption_without_certificates_is_refused_before_anything_starts():
    before = _children()
    with pytest.raises(ValueError, match="Security.temporary"):
        dm.LocalMeshCluster(
            1, "cpu", security=Security(require_encryption=True), dashboard_address=None
        )
    assert _gone(_children() - before) == set()


def test_a_failed_start_leaves_no_process_behind(certs, tmp_path):
    """The client refuses the scheduler's certificate: the scheduler process must not outlive it."""
    cert, key = certs
    other_cert, _ = make_certs(tmp_path)  # a CA that signed nothing of ours
    security = tls_security(cert, key)
    security.tls_ca_file = other_cert
    before = _children()
    with pytest.raises((RuntimeError, OSError)):
        dm.LocalMeshCluster(1, "cpu", security=security, dashboard_address=None)
    assert _gone(_children() - before) == set()


def test_cli_run_over_tls(tmp_path, certs):
    cert, key = certs
    (tmp_path / "script.py").write_text(
        "import distributed, torch\n"
        "import dask_monarch as dm\n"
        "client = distributed.default_client()\n"
        "print('scheduler', client.scheduler.address)\n"
        "mesh = dm.device_mesh(client, gpu=2)\n"
        "with mesh.activate():\n"
        "    print('value', dm.inspect(torch.ones(2) * 5).tolist())\n"
        "mesh.exit()\n"
    )
    done = run_command(
        ["run", "--ranks", "2", "--device", "cpu", "--dashboard-address", ""]
        + ["--tls-ca-file", cert, "--tls-cert", cert, "--tls-key", key, "script.py"],
        tmp_path,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "scheduler tls://" in done.stdout and "value [5.0, 5.0]" in done.stdout


def test_only_dask_monarchs_marked_rank_functions_pass_the_allow_list_unlisted(tctrl):
    create_streams(tctrl, BOTH, S0)
    tctrl.send(0, call(0, Ref(1), "dask_monarch.random._seeded_states", 3))  # a rank function
    tctrl.send(0, call(1, Ref(2), "dask_monarch.worker.calls.to_cpu", 1))  # an internal helper
    errors = {f.seq: f.error for f in failures(tctrl.sync(timeout=120))}
    assert 0 not in errors
    assert "dask_monarch.worker.calls.to_cpu is not in the allow-list" in errors[1]
