"""The protocol and the user API across hosts: same results as on one host, no loopback anywhere.

Two namespace hosts with two rank workers each (ranks 0, 1 on host 0; 2, 3 on
host 1): a ``host=2, gpu=2`` mesh has its "host" dim across the network and
its "gpu" dim between two workers of one host, which still talk over the
host's own address (never 127.0.0.1).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import probes
import pytest
import torch
from conftest import exit_quietly, make_hosts
from helpers.commands import console_script
from helpers.raw import S0, call, create_streams, fetch, values

import dask_monarch as dm
from dask_monarch.controller.placement import registered_workers
from dask_monarch.messages import Ref

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hosts_client():
    yield from make_hosts(2, 2, tag="a")


@pytest.fixture
def mesh(hosts_client):
    _, client = hosts_client
    mesh = dm.device_mesh(client, host=2, gpu=2)
    yield mesh
    exit_quietly(mesh)


def _per_rank(mesh):
    """A (3,) tensor per rank: rank r holds [r, r + 1, r + 2] as floats (r row-major)."""
    return mesh.rank(("host", "gpu")).float() + torch.arange(3.0)


def _local(r):
    return float(r) + torch.arange(3.0)


@pytest.mark.timeout(300)
def test_ranks_are_on_their_hosts_and_the_store_on_rank_0s_address(hosts_client, mesh):
    hosts, _ = hosts_client
    controller = mesh._session.controller
    assert [hosts.host_of(a) for a in controller.workers] == [0, 0, 1, 1]
    with mesh.activate():
        dm.inspect(_per_rank(mesh).reduce("host", "sum"))  # opens the rendezvous
    host, _port = controller._rendezvous
    assert host == hosts.ips[0], controller._rendezvous  # rank 0's address, not loopback


@pytest.mark.timeout(300)
def test_raw_protocol(hosts_client):
    hosts, client = hosts_client
    with dm.Controller(client, world_size=4) as ctrl:
        create_streams(ctrl, range(4), S0)
        for rank in range(4):
            ctrl.send(rank, call(1, Ref(1), "torch.full", (2,), float(rank)))
        ctrl.send(range(4), call(2, Ref(2), "torch.mul", Ref(1), 10.0))
        ctrl.send(range(4), fetch(3, Ref(2)))
        got = values(ctrl.sync(timeout=120))
        assert {k: v.tolist() for k, v in got.items()} == {
            (3, r): [10.0 * r, 10.0 * r] for r in range(4)
        }


@pytest.mark.timeout(300)
def test_ops_fetch_and_reduce_over_every_dim(mesh):
    expected = torch.stack([_local(r) for r in range(4)]).view(2, 2, 3)
    ops = ("sum", "avg", "max", "min")
    with mesh.activate():
        x = _per_rank(mesh)
        y = (x * 2).relu() - 1
        computed = dm.inspect(y, host=1, gpu=0)
        fetched = dm.fetch_shard(x, {"host": 1, "gpu": 1}).result(60)
        reduced = {
            (dims, op): dm.inspect(x.reduce(dims, op), host=1, gpu=1)
            for dims in ("host", "gpu", ("host", "gpu"))
            for op in ops
        }
        stacked = dm.inspect(x.reduce("host", "stack"), host=0, gpu=1)
    assert torch.equal(computed, _local(2) * 2 - 1)
    assert torch.equal(fetched, _local(3))
    for dims, over, pick in (("host", 0, -1), ("gpu", 1, -1), (("host", "gpu"), (0, 1), ...)):
        want = {
            "sum": expected.sum(over),
            "avg": expected.mean(over),
            "max": expected.amax(over),
            "min": expected.amin(over),
        }
        for op in ops:
            assert torch.allclose(reduced[dims, op], want[op][pick]), (dims, op)
    assert torch.equal(stacked, torch.stack([_local(1), _local(3)]))


@pytest.mark.timeout(300)
def test_to_mesh_between_hosts(mesh):
    on_host0, on_host1 = mesh.slice(host=0), mesh.slice(host=1)
    with on_host0.activate():
        mine = on_host0.rank("gpu").float() * 100 + torch.arange(3.0)
    moved = mine.to_mesh(on_host1)
    with on_host1.activate():
        got = [dm.inspect(moved + 1, gpu=g) for g in range(2)]
    assert got[0].tolist() == [1.0, 2.0, 3.0] and got[1].tolist() == [101.0, 102.0, 103.0]


@pytest.mark.timeout(300)
def test_remote_process_groups(mesh):
    @dm.remote(propagate=lambda x, pg: (x.clone(), torch.stack([x, x])))
    def across(x, pg):
        import torch.distributed as dist

        total = x.clone()
        dist.all_reduce(total, group=pg)
        gathered = [torch.empty_like(x) for _ in range(pg.size())]
        dist.all_gather(gathered, x, group=pg)
        return total, torch.stack(gathered)

    with mesh.activate():
        x = _per_rank(mesh)
        total, gathered = across(x, mesh.process_group("host"))
        got_total = dm.inspect(total, host=1, gpu=0)
        got_gathered = dm.inspect(gathered, host=0, gpu=1)
    assert torch.equal(got_total, _local(0) + _local(2))
    assert torch.equal(got_gathered, torch.stack([_local(1), _local(3)]))


@pytest.mark.timeout(600)
def test_training_example_through_dask_monarch_run(hosts_client):
    hosts, _ = hosts_client
    result = subprocess.run(
        [
            console_script(),
            "run",
            "--scheduler-address",
            hosts.scheduler_address,
            "--ranks",
            "4",
            str(ROOT / "examples" / "train_mlp.py"),
            "--steps",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "matches single-process training: losses True, weights True" in out, out


@pytest.mark.timeout(300)
def test_notebook_style_session(hosts_client):
    """Cells a user runs one after another from the root namespace, meshes made and dropped."""
    hosts, client = hosts_client
    mesh = dm.device_mesh(client, host=2, gpu=2)  # cell 1
    with mesh.activate():  # cell 2
        dm.random.manual_seed(0)
        w = torch.rand(3, 3)
    with mesh.activate():  # cell 3
        y = dm.inspect((w @ w.T).relu().reduce("gpu", "avg"), host=1, gpu=0)
    torch.manual_seed(0)
    local_w = torch.rand(3, 3)
    assert torch.allclose(y, (local_w @ local_w.T).relu())
    print(mesh.to_table())  # cell 4
    mesh.exit()  # cell 5, then a mesh on one host only
    one_host = dm.device_mesh(client, workers=["h1w0", "h1w1"], gpu=2)
    try:
        assert [hosts.host_of(a) for a in one_host._session.controller.workers] == [1, 1]
        with one_host.activate():
            total = dm.inspect(torch.ones(2).reduce("gpu", "sum"))
        assert total.tolist() == [2.0, 2.0]
    finally:
        exit_quietly(one_host)


# -- choosing where a mesh runs ---------------------------------------------------------------


@pytest.mark.timeout(300)
def test_workers_by_name_and_address_in_that_order(hosts_client):
    hosts, client = hosts_client
    by_name = {str(i["name"]): a for a, i in registered_workers(client).items()}
    order = ["h1w1", by_name["h0w0"], "h1w0"]  # a name, an address, a name
    mesh = dm.device_mesh(client, workers=order, gpu=3)
    try:
        assert mesh._session.controller.workers == [
            by_name[w] if w in by_name else w for w in order
        ]
        with mesh.activate():
            coordinate = dm.inspect(mesh.rank("gpu").float() * 1, gpu=2).item()
            total = dm.inspect(torch.ones(1).reduce("gpu", "sum")).item()
        assert (coordinate, total) == (2.0, 3.0)
    finally:
        exit_quietly(mesh)
    with dm.Controller(client, 2, workers=["h1w0", "h0w1"]) as ctrl:
        assert ctrl.workers == [by_name["h1w0"], by_name["h0w1"]]


@pytest.mark.timeout(300)
def test_distinct_hosts(hosts_client):
    hosts, client = hosts_client
    mesh = dm.device_mesh(client, distinct_hosts=True, host=2)
    try:
        assert [hosts.host_of(a) for a in mesh._session.controller.workers] == [0, 1]
        with mesh.activate():
            total = dm.inspect(torch.ones(1).reduce("host", "sum"))
        assert total.item() == 2.0
    finally:
        exit_quietly(mesh)
    with pytest.raises(ValueError, match="distinct hosts"):
        dm.device_mesh(client, distinct_hosts=True, host=3)
    with pytest.raises(ValueError, match="several ranks on"):
        dm.device_mesh(client, workers=["h0w0", "h0w1"], distinct_hosts=True, gpu=2)


@pytest.mark.timeout(120)
def test_workers_mistakes_are_clear(hosts_client):
    _, client = hosts_client
    with pytest.raises(ValueError, match="no worker 'h9w9'"):
        dm.device_mesh(client, workers=["h0w0", "h9w9"], gpu=2)
    with pytest.raises(ValueError, match="one per rank"):
        dm.device_mesh(client, workers=["h0w0"], gpu=2)
    with pytest.raises(ValueError, match="named twice"):
        dm.device_mesh(client, workers=["h0w0", "h0w0"], gpu=2)
    with pytest.raises(TypeError, match="dimension cannot be called 'workers'"):
        dm.device_mesh(client, workers=2)


@pytest.mark.timeout(300)
def test_network_interface_setting(hosts_client):
    """``comm.interface`` picks the address stores and gloo use; a wrong one is named."""
    hosts, client = hosts_client
    key = "dask_monarch.comm.interface"
    try:
        client.run(probes.set_config, key, "eth0")  # the namespace hosts' interface
        mesh = dm.device_mesh(client, host=2, gpu=2)
        try:
            with mesh.activate():
                total = dm.inspect(torch.ones(2).reduce(("host", "gpu"), "sum"))
            assert total.tolist() == [4.0, 4.0]
            assert mesh._session.controller._rendezvous[0] == hosts.ips[0]
        finally:
            exit_quietly(mesh)
        client.run(probes.set_config, key, "nosuch0")
        mesh = dm.device_mesh(client, host=2, gpu=2)
        try:
            with pytest.raises(Exception, match="'nosuch0' but this host .* has no such interface"):
                with mesh.activate():
                    dm.inspect(torch.ones(2).reduce("host", "sum"))
        finally:
            exit_quietly(mesh)
    finally:
        client.run(probes.set_config, key, None)
