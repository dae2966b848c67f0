"""dask_monarch: Monarch's single-controller tensor engine on dask.distributed.

One Python program drives PyTorch on many ranks as if they were one: torch
calls on mesh tensors become worker messages, compiled into Dask tasks pinned
to rank workers.

Names are imported on first use (PEP 562): ``import dask_monarch`` stays
cheap for the processes that only need part of it (the ``dask`` command line
loads every ``dask_cli`` entry point, schedulers unpickle task functions), and
torch is imported with the first name that needs it.

The user API's modules, one concept each: ``mesh`` (``DeviceMesh``,
``device_mesh``); ``tensor`` (the mesh tensor and its dispatch), with
``handles`` (what a mesh tensor and an ``OpaqueRef`` share), ``propagation``
(outputs worked out on fake tensors), ``client_values`` (values the client
knows) and ``implicit_fetch`` (values Python asks for); ``stream`` and
``borrows``; ``collectives`` (``reduce``); ``transfer`` (``put``,
``to_mesh``); ``fetch`` (``inspect``, ``fetch_shard``); ``remote_function``
(``dm.remote``); ``opaque_ref``; ``actor_mesh`` (``mesh.spawn``); ``pipe``;
``coalesce`` and ``compiled`` (``coalescing``, ``compile``); ``gradients``
(``grad_generator``, ``ddp_hooks``); ``random``; ``spans``, ``tracing``,
``dry`` and ``debug`` (``span``, ``trace``, ``dry_run``, ``breakpoint``);
``checkpoint`` (``checkpoint.save``, ``checkpoint.load``) over ``state_tree``
(training state as paths); ``replicas`` (``run_steps``: in-job recovery) and
``recovery`` (``elastic``: restarts from a notebook); ``torch_collectives``
(``torch.distributed`` calls on mesh tensors, refused with the mesh's way);
``torch_compile`` (``torch.compile``d code called on mesh tensors); ``packed``
(``nn.utils.rnn``'s packed sequences of mesh tensors); ``local_torch``
(``torch.utils.data``, unpickled tensors and copies of local ones inside a mesh's
block: local torch).
Beside them: ``config`` (settings), ``exceptions``, ``dask_internals`` (the
private parts of distributed used, checked once), and the public paths
``messages``, ``ndslice``, ``logs``, ``dashboard`` and ``preload`` of modules
that live in the layers below (``protocol``, ``controller``, ``worker``,
``deployment``, ``observability``; docs/architecture.md).
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from . import config  # noqa: F401  (loads the defaults into dask.config)

__version__ = "0.1.0"

_NAMES = {
    "Controller": "controller",
    "LocalMeshCluster": "deployment.cluster",
    "MonarchWorkerPlugin": "worker",
    "DeviceException": "exceptions",
    "RemoteException": "exceptions",
    "LivenessWarning": "exceptions",
    "ImplicitFetchWarning": "exceptions",
    "CompileWarning": "exceptions",
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
    "MeshFuture": "controller.futures",
    "gather": "controller.gather",
    "reduce": "collectives",
    "reduce_": "collectives",
    "MeshSliceTensor": "transfer",
    "slice_mesh": "transfer",
    "to_mesh": "transfer",
    "put": "transfer",
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

if TYPE_CHECKING:  # what IDEs and type checkers see: the same names as _NAMES and _MODULES
    from . import checkpoint, debug, messages, ndslice, random
    from .borrows import Borrow
    from .coalesce import coalescing
    from .collectives import reduce, reduce_
    from .compiled import compile
    from .controller import Controller
    from .controller.futures import MeshFuture
    from .controller.gather import gather
    from .debug import breakpoint
    from .deployment.cluster import LocalMeshCluster
    from .dry import dry_run
    from .exceptions import (
        CompileWarning,
        DeviceException,
        ImplicitFetchWarning,
        LivenessWarning,
        RemoteException,
    )
    from .fetch import fetch_shard, inspect
    from .gradients import DDPHooks, ddp_hooks, grad_generator
    from .mesh import DeviceMesh, RemoteProcessGroup, device_mesh
    from .opaque_ref import OpaqueRef
    from .pipe import Pipe, create_pipe
    from .recovery import elastic
    from .remote_function import Remote, remote
    from .replicas import StepRun, run_steps
    from .spans import span
    from .stream import Stream, get_active_stream
    from .tensor import Tensor, no_mesh
    from .tracing import trace
    from .transfer import MeshSliceTensor, put, slice_mesh, to_mesh
    from .worker import MonarchWorkerPlugin


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
