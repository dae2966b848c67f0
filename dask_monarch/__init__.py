"""dask_monarch: Monarch's single-controller tensor engine on dask.distributed."""

from . import (
    config,  # noqa: F401  (loads the defaults into dask.config)
    messages,
    ndslice,
)
from .cluster import LocalMeshCluster
from .controller import Controller
from .exceptions import DeviceException, RemoteException
from .worker import MonarchWorkerPlugin

__version__ = "0.1.0"

__all__ = [
    "Controller", "DeviceException", "LocalMeshCluster", "MonarchWorkerPlugin",
    "RemoteException", "messages", "ndslice",
]
