"""Hosts made of Linux network namespaces: a bridge, one namespace per host, real dask processes.

Each "host" is a network namespace with its own loopback and one address on a
private test subnet (``10.213.X.0/24``, X free on this machine), joined to a
bridge in the root namespace by a veth pair (``eth0`` inside). The scheduler
runs in the root namespace, bound to the bridge's address; every worker is a
real ``dask worker`` started inside its host with ``ip netns exec``, with the
preload and settings docs/deployment.md gives, under the supervising loop that
page tells users to run (a worker cut off from its scheduler shuts down; the
loop starts a new one). The namespaces have no route anywhere else: nothing
leaves the test subnet.

Everything made here is named ``dmh<pid>...`` after the test process that made
it, so :func:`clean_leftovers` can remove what a crashed run left behind (its
pid is gone) without touching a concurrent run's. :meth:`Hosts.close` stops
processes by their process-group id, then deletes the namespaces and links.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREFIX = "dmh"

# what docs/deployment.md tells users to export where `dask worker` starts
WORKER_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "67108864",
    "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__TARGET": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__SPILL": "False",
    "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "False",
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    "MONARCH_TORCH_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_not() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the multi-host harness makes network namespaces, which needs root"
    if shutil.which("ip") is None:
        return "the multi-host harness needs the `ip` command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    m = re.match(rf"{PREFIX}(\d+)", name)
    return int(m.group(1)) if m else None


def clean_leftovers() -> list[str]:
    """Remove the namespaces, processes and links of earlier runs whose test process is gone."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        owner = _owner(folder.name)
        if owner is None or _alive(owner):
            continue
        pids = folder / "pids"
        for pid in pids.read_text().split() if pids.exists() else []:
            with contextlib.suppress(OSError):  # the process groups it started (the scheduler)
                if "dask" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                    os.killpg(int(pid), signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(str(folder))
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        owner = _owner(name)
        if owner is None or _alive(owner):
            continue
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", name, check=False)
        removed.append(name)
    for line in ip("-o", "link", "show").stdout.splitlines():
        m = re.match(r"\d+:\s+([^:@]+)", line)
        name = m.group(1) if m else ""
        owner = _owner(name)
        if owner is not None and not _alive(owner):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.213.X.0/24 that no interface of this machine has an address in."""
    used = ip("-o", "-4", "addr", "show").stdout
    start = os.getpid() % 250
    for i in range(250):
        net = ipaddress.ip_network(f"10.213.{(start + i) % 250 + 1}.0/24")
        if f" {net.network_address}"[:-1] not in used:  # "10.213.X." appears nowhere
            return net
    raise RuntimeError("no free 10.213.X.0/24 test subnet on this machine")


class Process:
    """A process group we started (the supervising loop and everything under it)."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.argv = argv
        with open(log, "ab") as out:
            self.popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.pid = self.popen.pid
        with open(log.parent / "pids", "a") as pids:  # for clean_leftovers after a crash
            pids.write(f"{self.pid}\n")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)  # whatever is left of the group (a worker under its nanny)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Hosts:
    """``n_hosts`` namespaces on a bridge, a scheduler, ``workers_per_host`` workers in each.

    Worker ``j`` of host ``i`` is named ``h<i>w<j>`` and gets rank resource
    ``monarch-rank<i * workers_per_host + j>``: ranks fill host 0 first.
    """

    def __init__(
        self,
        n_hosts: int = 2,
        workers_per_host: int = 1,
        tag: str = "",
        scheduler_env: dict[str, str] | None = None,
    ) -> None:
        self.n_hosts = n_hosts
        self.scheduler_env = scheduler_env or {}
        self.workers_per_host = workers_per_host
        self.id = f"{PREFIX}{os.getpid()}{tag}"
        if len(self.id) + 3 > 15:
            raise ValueError(f"harness id {self.id!r} too long for interface names")
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.id}-"))
        self.bridge = f"{self.id}br"
        self.namespaces: list[str] = []
        self.veths: list[str] = []
        self.processes: list[Process] = []
        self.workers: dict[str, Process] = {}  # worker name -> its supervising loop
        self.scheduler: Process | None = None
        self.scheduler_address = ""
        self.net = _free_subnet()
        hosts = list(self.net.hosts())
        self.bridge_ip = str(hosts[0])
        self.ips = [str(hosts[1 + i]) for i in range(n_hosts)]
        self.bin = Path(sys.executable).parent
        try:
            self._network()
        except BaseException:
            self.close()
            raise

    # -- the network --------------------------------------------------------------------------

    def _network(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.bridge_ip}/{self.net.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, addr in enumerate(self.ips):
            ns, veth, peer = f"{self.id}h{i}", f"{self.id}v{i}", f"{self.id}p{i}"
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            self.veths.append(veth)
            ip("link", "set", peer, "netns", ns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "link", "set", peer, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def partition(self, host: int) -> None:
        """Cut host ``host`` off the network (its processes keep running)."""
        ip("link", "set", self.veths[host], "down")

    def heal(self, host: int) -> None:
        ip("link", "set", self.veths[host], "up")

    def host_of(self, address: str) -> int | None:
        """Which host a worker address is on."""
        for i, addr in enumerate(self.ips):
            if f"//{addr}:" in address:
                return i
        return None

    # -- processes ----------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{self.bin}:{env.get('PATH', '')}"
        return env

    def start_scheduler(self) -> str:
        """``dask scheduler`` in the root namespace on the bridge's address (docs/deployment.md)."""
        sched_file = self.tmp / "sched.json"
        with contextlib.suppress(FileNotFoundError):
            sched_file.unlink()
        self.scheduler = Process(
            [
                str(self.bin / "dask"),
                "scheduler",
                "--host",
                self.bridge_ip,
                "--port",
                "0",
                "--dashboard-address",
                f"{self.bridge_ip}:0",
                "--scheduler-file",
                str(sched_file),
                "--preload",
                "dask_monarch.dashboard",
            ],
            self.tmp / "scheduler.log",
            {**self.env(), **self.scheduler_env},
        )
        self.processes.append(self.scheduler)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                self.scheduler_address = json.loads(sched_file.read_text())["address"]
                return self.scheduler_address
            if self.scheduler.popen.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the scheduler did not start:\n{self.scheduler.tail()}")

    def worker_command(self, name: str, rank: int) -> str:
        """The supervised `dask worker` of docs/deployment.md ("Keeping workers up")."""
        return (
            "while true; do "
            f'dask worker "$SCHED" --nthreads 1 --name {name} '
            f"--preload dask_monarch.preload --monarch-rank={rank}; "
            "sleep 1; done"
        )

    def start_workers(self) -> list[str]:
        names = []
        for i, ns in enumerate(self.namespaces):
            for j in range(self.workers_per_host):
                name, rank = f"h{i}w{j}", i * self.workers_per_host + j
                env = {**self.env(), **WORKER_ENV, "SCHED": self.scheduler_address}
                proc = Process(
                    ["ip", "netns", "exec", ns, "bash", "-c", self.worker_command(name, rank)],
                    self.tmp / f"{name}.log",
                    env,
                )
                self.processes.append(proc)
                self.workers[name] = proc
                names.append(name)
        return names

    def logs(self, n: int = 20) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.tail(n)}" for p in self.processes)

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        for ns in self.namespaces:
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", ns, check=False)
        for veth in self.veths:
            ip("link", "del", veth, check=False)
        ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)
