"""dask_monarch: Monarch's single-controller tensor engine on dask.distributed.

One Python program drives PyTorch on many ranks as if they were one: torch
calls on mesh tensors become worker messages, compiled into Dask tasks pinned
to rank workers.
"""

from . import (
    config,  # noqa: F401  (loads the defaults into dask.config)
    messages,
    ndslice,
)
from . import random as random
from .cluster import LocalMeshCluster
from .coalesce import coalescing
from .collectives import reduce, reduce_
from .compiled import compile
from .controller import Controller
from .device_mesh import DeviceMesh, RemoteProcessGroup, device_mesh
from .exceptions import DeviceException, RemoteException
from .fetch import fetch_shard, inspect
from .mesh_client import MeshFuture
from .pipe import Pipe, create_pipe
from .remote_function import Remote, remote
from .stream import Borrow, Stream, get_active_stream
from .tensor import Tensor, no_mesh
from .transfer import MeshSliceTensor, slice_mesh, to_mesh
from .worker import MonarchWorkerPlugin

__version__ = "0.1.0"

__all__ = [
    "Borrow", "Controller", "DeviceException", "DeviceMesh", "LocalMeshCluster", "MeshFuture",
    "MeshSliceTensor", "MonarchWorkerPlugin", "Pipe", "Remote", "RemoteException",
    "RemoteProcessGroup", "Stream", "Tensor", "coalescing", "compile", "create_pipe",
    "device_mesh", "fetch_shard", "get_active_stream", "inspect", "messages", "ndslice",
    "no_mesh", "random", "reduce", "reduce_", "remote", "slice_mesh", "to_mesh",
]
