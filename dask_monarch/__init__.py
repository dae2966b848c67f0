"""dask_monarch: Monarch's single-controller tensor engine on dask.distributed.

One Python program drives PyTorch on many ranks as if they were one: torch
calls on mesh tensors become worker messages, compiled into Dask tasks pinned
to rank workers.

Names are imported on first use (PEP 562): ``import dask_monarch`` stays
cheap for the processes that only need part of it (the ``dask`` command line
loads every ``dask_cli`` entry point, schedulers unpickle task functions), and
torch is imported with the first name that needs it.
"""

from importlib import import_module
from typing import Any

from . import config  # noqa: F401  (loads the defaults into dask.config)

__version__ = "0.1.0"

_NAMES = {
    "Controller": "controller",
    "LocalMeshCluster": "deployment.cluster",
    "MonarchWorkerPlugin": "worker",
    "DeviceException": "exceptions",
    "RemoteException": "exceptions",
    "LivenessWarning": "exceptions",
    "DeviceMesh": "mesh",
    "RemoteProcessGroup": "mesh",
    "device_mesh": "mesh",
    "Tensor": "tensor",
    "no_mesh": "tensor",
    "Stream": "stream",
    "Borrow": "borrows",
    "get_active_stream": "stream",
    "Remote": "remote_function",
    "remote": "remote_function",
    "fetch_shard": "fetch",
    "inspect": "fetch",
    "MeshFuture": "controller.session",
    "reduce": "collectives",
    "reduce_": "collectives",
    "MeshSliceTensor": "transfer",
    "slice_mesh": "transfer",
    "to_mesh": "transfer",
    "coalescing": "coalesce",
    "compile": "compiled",
    "Pipe": "pipe",
    "create_pipe": "pipe",
    "span": "spans",
    "trace": "tracing",
    "dry_run": "dry",
    "breakpoint": "debug",
    "OpaqueRef": "opaque_ref",
    "grad_generator": "gradients",
    "ddp_hooks": "gradients",
    "elastic": "recovery",
    "run_steps": "replicas",
    "StepRun": "replicas",
    "DDPHooks": "gradients",
}
_MODULES = ("messages", "ndslice", "random", "debug", "checkpoint")

__all__ = sorted([*_NAMES, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        value = getattr(import_module(f".{_NAMES[name]}", __name__), name)
    elif name in _MODULES:
        value = import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'dask_monarch' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
