"""The public names of api.md exist and no submodule shadows them."""

import importlib
import pkgutil

import dask_monarch as dm

API_NAMES = [
    "LocalMeshCluster",
    "Controller",
    "device_mesh",
    "DeviceMesh",
    "Tensor",
    "remote",
    "Stream",
    "get_active_stream",
    "reduce",
    "reduce_",
    "to_mesh",
    "slice_mesh",
    "coalescing",
    "compile",
    "create_pipe",
    "inspect",
    "fetch_shard",
    "RemoteException",
    "DeviceException",
    "LivenessWarning",
    "breakpoint",
    "debug",
    "random",
    "messages",
    "ndslice",
    "no_mesh",
    "OpaqueRef",
    "grad_generator",
    "ddp_hooks",
    "span",
    "MeshFuture",
    "checkpoint",
]


def test_every_public_name_survives_importing_every_submodule():
    for module in pkgutil.walk_packages(dm.__path__, "dask_monarch."):
        importlib.import_module(module.name)
    for name, module in dm._NAMES.items():
        expected = getattr(importlib.import_module(f"dask_monarch.{module}"), name)
        assert getattr(dm, name) is expected, f"dask_monarch.{name} is shadowed by a module"
    for name in API_NAMES:
        assert hasattr(dm, name), name
    assert callable(dm.device_mesh) and callable(dm.compile) and callable(dm.remote)
    for name in ("manual_seed", "get_state", "set_state", "new_state", "seed_stream"):
        assert callable(getattr(dm.random, name))
    assert callable(dm.checkpoint.save) and callable(dm.checkpoint.load)


def test_mesh_tensor_and_controller_methods():
    for name in (
        "activate",
        "dims",
        "sizes",
        "size",
        "ranks",
        "rename",
        "split",
        "flatten",
        "slice",
        "rank",
        "process_group",
        "spawn",
        "to_table",
        "_repr_html_",
        "exit",
    ):
        assert hasattr(dm.DeviceMesh, name), name
    for name in ("mesh", "stream", "reduce", "reduce_", "to_mesh", "slice_mesh", "drop"):
        assert hasattr(dm.Tensor, name), name
    for name in (
        "send",
        "flush",
        "sync",
        "get_ref",
        "spawn_actor",
        "close",
        "__enter__",
        "lanes",
        "waiting_for",
    ):
        assert hasattr(dm.Controller, name), name
    assert hasattr(dm.Stream, "borrow") and hasattr(dm.Stream, "activate")
    assert hasattr(dm.remote(lambda x: x), "call_on_shard_and_fetch")


def test_the_type_checking_block_names_exactly_the_lazy_names():
    """What IDEs and type checkers see (``if TYPE_CHECKING:`` in dask_monarch/__init__.py) is
    what ``dm.<name>`` gives at run time: the same names, from the same modules."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(dm.__file__).read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    seen = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        for alias in node.names:
            module = node.module or ""
            seen[alias.name] = alias.name if not module else module
    assert set(seen) == set(dm.__all__)
    for name, module in dm._NAMES.items():
        assert seen[name] == module, (name, seen[name], module)
    for name in dm._MODULES:
        assert seen[name] == name
