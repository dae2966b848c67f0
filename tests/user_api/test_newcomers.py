"""What a newcomer from Dask or PyTorch meets first: the messages, the futures, the notebook views.

Each message says what happened and what to do, and names the mesh (with an
id that tells two meshes apart) and the tensor's shape; ``MeshFuture`` works
with ``await`` and ``concurrent.futures``, and Dask's own future helpers and
task arguments refuse it with a TypeError that says what to call instead;
``dm.gather`` gives its value (with Dask futures' beside it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import subprocess
import sys

import dask
import distributed
import numpy as np
import pytest
import torch
from distributed import Client

import dask_monarch as dm
from dask_monarch import implicit_fetch

pytestmark = pytest.mark.timeout(300)


# -------------------------------------------------------------------------------- messages


def test_wrong_mesh_names_both_meshes_with_ids_and_the_shape(client2, mesh2):
    other = dm.device_mesh(client2, gpu=2)
    try:
        with mesh2.activate():
            x = torch.ones(3, 4)
        with other.activate():
            y = torch.ones(3, 4)
        with mesh2.activate(), pytest.raises(TypeError, match="WRONG_MESH") as info:
            x + y
        text = str(info.value)
        ours, theirs = mesh2._session.controller.mesh_id, other._session.controller.mesh_id
        assert ours in text and theirs in text, text  # two DeviceMesh(gpu=2) told apart
        assert "shape [3, 4]" in text and "to_mesh" in text, text
    finally:
        other.exit()


def test_one_id_names_a_mesh_in_reprs_the_cli_and_the_dashboard(client2, mesh2):
    """(Errors: test_wrong_mesh_names_both_meshes_with_ids_and_the_shape; logs:
    tests/observability/test_logs.py; the debugger: tests/user_api/test_debugger.py.)"""
    import json
    import urllib.request

    from dask_monarch.deployment.cluster_info import describe_cluster

    controller = mesh2._session.controller
    mesh_id = controller.mesh_id
    assert mesh_id != controller.token  # the token names tasks; it is not what users read
    with mesh2.activate():
        x = torch.ones(2)
    assert f"(mesh {mesh_id})" in mesh2._label() and mesh_id in repr(controller)
    assert mesh_id in x._repr_html_()
    report = describe_cluster(client2.scheduler.address, None)  # dask-monarch info
    assert all(f"{mesh_id} (rank {i})" in w["meshes"] for i, w in enumerate(report["workers"]))
    base = client2.dashboard_link.rsplit("/", 1)[0]
    with urllib.request.urlopen(f"{base}/monarch/state.json", timeout=30) as response:
        page = json.loads(response.read())
    assert mesh_id in [c["mesh"] for c in page["controllers"]]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(2, device="cuda"),
        lambda: torch.ones(2).cuda(),
        lambda: torch.ones(2).to("cuda"),
    ],
    ids=["device=cuda", ".cuda()", ".to(cuda)"],
)
def test_cuda_on_a_mesh_of_cpu_ranks_names_them_and_says_what_to_do(mesh2, make):
    from dask_monarch.tensor import cpu_ranks

    assert cpu_ranks(mesh2) == [0, 1]  # the shared cluster's ranks are CPU ranks
    with mesh2.activate(), pytest.raises(RuntimeError) as info:
        make()
    text = str(info.value)
    assert "ranks 0, 1 have no GPU" in text and mesh2._session.controller.mesh_id in text, text
    assert "device='cpu'" in text and "LocalMeshCluster(device='cuda')" in text, text
    with mesh2.activate():
        assert dm.inspect(torch.ones(2) + 1).tolist() == [2.0, 2.0]  # the mesh is fine


def test_an_ops_cuda_device_reaches_the_ranks_without_the_clients_index():
    """``x.cuda()`` and ``device=x.device`` carry the client's index (torch fills in its
    current device, a mesh tensor says cuda:0); a rank's GPU may have another index in its
    process (workers that see every GPU): the op is sent with ``cuda``, each rank's own.
    On GPUs: tests/gpu/test_nccl.py, the worker that sees every GPU."""
    from dask_monarch.tensor import _scan

    handles: list = []
    sent = [_scan(a, handles) for a in (torch.device("cuda", 3), torch.device("cpu"), 2)]
    assert [str(a) for a in sent] == ["cuda", "cpu", "2"] and handles == []


@pytest.mark.parametrize(
    "call, instead",
    [
        (lambda dist, t: dist.all_reduce(t), "t.reduce_"),
        (lambda dist, t: dist.all_reduce(t, op=dist.ReduceOp.SUM), "t.reduce_"),
        (lambda dist, t: dist.all_gather([t, t], t), '"stack"'),
        (lambda dist, t: dist.broadcast(t, src=0), "slice_mesh"),
        (lambda dist, t: dist.reduce_scatter_tensor(t, t), "scatter=True"),
        (lambda dist, t: dist.reduce_scatter_single(t, t), "scatter=True"),
        (lambda dist, t: dist.all_gather_single(t, t), '"stack"'),
    ],
    ids=[
        "all_reduce",
        "all_reduce-op",
        "all_gather",
        "broadcast",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_gather_single",
    ],
)
def test_torch_distributed_on_a_mesh_tensor_points_to_the_mesh_way(mesh2, call, instead):
    import torch.distributed as dist

    with mesh2.activate():
        t = torch.ones(2)
        with pytest.raises(TypeError, match="torch.distributed") as info:
            call(dist, t)
    text = str(info.value)
    assert instead in text and "shape [2]" in text and "process group" in text, text
    with pytest.raises(ValueError, match="Default process group"):  # local tensors: torch's own
        dist.all_reduce(torch.ones(2))


def test_a_bad_integer_setting_names_the_key_before_any_worker_is_claimed(client2):
    with dask.config.set({"dask_monarch.flush.size": "lots"}):
        with pytest.raises(ValueError) as info:
            dm.device_mesh(client2, gpu=2)
    text = str(info.value)
    assert "dask_monarch.flush.size" in text and "DASK_MONARCH__FLUSH__SIZE" in text, text
    assert "'lots'" in text and "whole number" in text and "int()" not in text, text
    mesh = dm.device_mesh(client2, gpu=2)  # the workers were not left claimed
    mesh.exit()


def test_inspect_inside_coalescing_says_to_fetch_after_the_block(mesh2):
    with mesh2.activate():
        x = torch.ones(2)
        with pytest.raises(RuntimeError, match=r"inside a coalescing\(\) block") as info:
            with dm.coalescing():
                dm.inspect(x + 1)
        assert "after the block" in str(info.value) and "NYI" not in str(info.value)
        assert dm.inspect(x).tolist() == [1.0, 1.0]


def test_device_mesh_on_a_closed_client_says_make_a_new_one(cluster2):
    client = Client(cluster2, set_as_default=False)
    client.close()
    with pytest.raises(ValueError, match="Client is closed") as info:
        dm.device_mesh(client, gpu=2)
    assert "make a new Client" in str(info.value)


def test_slices_print_their_ranks(mesh):
    assert repr(mesh) == "DeviceMesh(host=2, gpu=2)"
    assert repr(mesh.slice(host=0)) == "DeviceMesh(gpu=2, ranks=[0, 1])"
    assert repr(mesh.slice(host=1)) == "DeviceMesh(gpu=2, ranks=[2, 3])"
    assert repr(mesh.slice(host=0, gpu=0)) == "DeviceMesh(ranks=[0])"
    assert repr(mesh.rename(host="dp")) == "DeviceMesh(dp=2, gpu=2)"  # the whole mesh
    assert mesh._session.controller.mesh_id in mesh.slice(host=0)._repr_html_()


@pytest.mark.parametrize(
    "convert", [np.asarray, lambda t: t.numpy(), lambda t: t.tolist(), np.array]
)
def test_local_conversions_fetch_visibly_or_point_to_inspect(mesh2, convert, monkeypatch):
    monkeypatch.setattr(implicit_fetch, "_warned", set())  # each call site warns once
    with mesh2.activate():
        # a mean is not bit-exact across devices: the client does not keep its value
        x = torch.ones(3, 4).mean(0, keepdim=True).expand(3, 4) * 2
    with dask.config.set({"dask_monarch.implicit-fetch": "error"}):
        with pytest.raises(RuntimeError, match=r"dask_monarch\.inspect") as info:
            convert(x)
    assert "shape [3, 4]" in str(info.value) and "subclass" not in str(info.value)
    with pytest.warns(dm.ImplicitFetchWarning, match="shape \\[3, 4\\]"):
        value = convert(x)
    assert np.asarray(value).tolist() == [[2.0] * 4] * 3
    assert dm.inspect(x).numpy().shape == (3, 4)  # the explicit way


def test_after_client_close_inspect_and_new_work_raise_clearly(cluster2):
    client = Client(cluster2, set_as_default=False)
    mesh = dm.device_mesh(client, gpu=2)
    with mesh.activate():
        y = torch.ones(2) * 3
    client.close()

    def new_work() -> None:
        with mesh.activate():
            torch.zeros(2) + 1

    for attempt in (lambda: dm.inspect(y), new_work, lambda: y + 1):
        with pytest.raises(dm.DeviceException, match="Client was closed") as info:
            attempt()
        assert "mesh.exit()" in str(info.value) and "new mesh" in str(info.value)
    with pytest.raises((dm.DeviceException, RuntimeError)):
        mesh.exit()


def test_device_mesh_without_a_client_says_how_to_make_one():
    code = (
        "import dask_monarch as dm\n"
        "try:\n"
        "    dm.device_mesh(host=2, gpu=2)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = _python(code)
    assert "default client" in out and "LocalMeshCluster" in out and "dask-monarch run" in out


def test_a_bad_config_value_names_the_key_and_the_value():
    out = _python(
        "import dask_monarch.config as c\nc.seconds('flush.idle')\n",
        DASK_MONARCH__FLUSH__IDLE="banana",
        check=False,
    )
    assert "dask_monarch.flush.idle" in out and "'banana'" in out, out
    assert "DASK_MONARCH__FLUSH__IDLE" in out and "KeyError" not in out, out


def test_an_async_client_gets_a_clear_error(cluster2):
    async def make() -> str:
        async with Client(
            cluster2.scheduler_address, asynchronous=True, set_as_default=False
        ) as client:
            try:
                dm.device_mesh(client, gpu=2)
            except TypeError as e:
                return str(e)
        return "accepted"

    text = asyncio.run(make())
    assert "asynchronous" in text and "Client(" in text, text


def _python(code: str, check: bool = True, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


# -------------------------------------------------------------------------------- futures


def test_mesh_future_is_awaitable(mesh2):
    with mesh2.activate():
        x = torch.arange(4.0) * 2

    async def fetch() -> torch.Tensor:
        return await dm.fetch_shard(x, gpu=1)

    assert asyncio.run(fetch()).tolist() == [0.0, 2.0, 4.0, 6.0]


def test_mesh_future_awaits_a_remote_failure(mesh2):
    with mesh2.activate():
        bad = dm.remote("tests.helpers.remote_fns.boom", propagate=lambda t: t)(torch.ones(2))

    async def fetch() -> None:
        await dm.fetch_shard(bad)

    with pytest.raises(dm.RemoteException):
        asyncio.run(fetch())


def test_mesh_future_with_concurrent_futures(mesh2):
    with mesh2.activate():
        x = torch.ones(2)
        futures = [dm.fetch_shard(x * i, gpu=i % 2) for i in range(4)]
    done, not_done = concurrent.futures.wait(futures, timeout=120)
    assert len(done) == 4 and not not_done
    got = sorted(f.result()[0].item() for f in concurrent.futures.as_completed(futures))
    assert got == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "dask_helper",
    [
        distributed.wait,
        lambda f: distributed.progress(f),
        lambda f: list(distributed.as_completed([f])),
    ],
)
def test_dask_future_helpers_refuse_a_mesh_future(client2, mesh2, dask_helper):
    with mesh2.activate():
        future = dm.fetch_shard(torch.ones(2))
    with pytest.raises(TypeError, match=r"concurrent\.futures"):
        dask_helper(future)
    assert future.result().tolist() == [1.0, 1.0]


def _identity(x):
    return x


# What a MeshFuture passed where Dask expects a value or a task argument does: each must raise a
# TypeError naming f.result() (before: "Could not serialize object of type LLGExpr", a
# TokenizationError or "cannot pickle '_thread.RLock' object"), and never reach the scheduler.
_AS_AN_ARGUMENT = {
    "submit": lambda client, f: client.submit(_identity, f),
    "submit_impure": lambda client, f: client.submit(_identity, f, pure=False),
    "submit_keyword": lambda client, f: client.submit(_identity, x=f, pure=False),
    "map": lambda client, f: client.map(_identity, [f, f]),
    "scatter": lambda client, f: client.scatter(f),
    "scatter_list": lambda client, f: client.scatter([f]),
    "pickle": lambda client, f: pickle.dumps(f),
    "dask_compute": lambda client, f: dask.compute(f),
    "client_compute": lambda client, f: client.compute(f),
    "delayed": lambda client, f: dask.delayed(_identity)(f).compute(),
}


@pytest.mark.parametrize("use", _AS_AN_ARGUMENT.values(), ids=list(_AS_AN_ARGUMENT))
def test_dask_refuses_a_mesh_future_as_a_value_saying_what_to_call(client2, mesh2, use):
    with mesh2.activate():
        future = dm.fetch_shard(torch.ones(2))
    with pytest.raises(TypeError, match=r"MeshFuture seq \d+") as info:
        use(client2, future)
    text = str(info.value)
    assert "f.result()" in text and "[f.result() for f in futures]" in text, text
    assert "dask_monarch.gather(f)" in text, text
    assert not [k for k in client2.futures if "_identity" in str(k)]  # no task was made
    assert future.result().tolist() == [1.0, 1.0]


def test_a_mesh_future_as_a_remote_function_argument_is_refused(mesh2):
    first_plus = dm.remote("tests.helpers.remote_fns.first_plus", propagate=lambda x, big: x)
    with mesh2.activate():
        x = torch.ones(2)
        future = dm.fetch_shard(x)
        with pytest.raises(TypeError, match=r"MeshFuture seq \d+.*f\.result\(\)"):
            first_plus(x, future)
        y = first_plus(x, future.result())  # what the message says to do
    assert dm.inspect(y).tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    "wrap",
    [lambda f: f, lambda f: [f, f], lambda f: {"loss": f, "more": (f, [f])}],
    ids=["one", "list", "nested"],
)
def test_dm_gather_gives_the_values_of_mesh_futures_and_dask_futures(client2, mesh2, wrap):
    """``dm.gather`` resolves MeshFutures and Dask futures in one call (controller/gather.py);
    the user's client is not patched: its own gather hands a MeshFuture back as it is."""
    with mesh2.activate():
        future = dm.fetch_shard(torch.ones(2))
    dask_future = client2.submit(_identity, 7, pure=False)
    got = dm.gather([wrap(future), dask_future])
    value = future.result()
    assert str(got) == str([wrap(value), 7])
    assert torch.equal(dm.gather(future), value)
    assert "gather" not in vars(client2)  # nothing of the Client was replaced
    assert client2.gather(future) is future


def test_dm_gather_of_a_failed_mesh_future_raises_or_skips(client2, mesh2):
    boom = dm.remote("tests.helpers.remote_fns.boom", propagate=lambda x: x)
    with mesh2.activate():
        x = torch.ones(2)
        bad = dm.fetch_shard(boom(x))
        good = dm.fetch_shard(x)
    with pytest.raises(dm.RemoteException):
        dm.gather([good, bad])
    skipped = dm.gather([good, bad], errors="skip")  # as Dask's gather skips: None
    assert torch.equal(skipped[0], good.result()) and skipped[1] is None


# -------------------------------------------------------------------------------- notebooks


def test_html_reprs_of_tensor_and_future(mesh2):
    with mesh2.activate():
        x = torch.ones(3, 4)
    html = x._repr_html_()
    assert "dask_monarch.Tensor" in html and "[3, 4]" in html
    assert mesh2._session.controller.mesh_id in html and "inspect" in html
    future = dm.fetch_shard(x)
    future.result()
    html = future._repr_html_()
    assert "MeshFuture" in html and "resolved" in html
