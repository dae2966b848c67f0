"""What runs as local torch under an active mesh: the data pipeline, and tensors rebuilt from
local storage.

Under ``mesh.activate()`` a factory makes a mesh tensor. That is right for a model's
code, and wrong for torch's own plumbing that makes local tensors from local data:

* **A DataLoader** draws its seeds and shuffles with local torch
  (``torch.empty((), dtype=torch.int64).random_().item()``), runs the dataset's
  ``__getitem__`` and collates with ``torch.stack``. Under a mesh those factories became
  mesh tensors drawn by each rank's own generator, and the first ``.item()`` raised "the
  ranks disagree". Iterating one now runs as inside ``dask_monarch.no_mesh.activate()``:
  its batches are local tensors, as in one process, which an op places on the mesh (up to
  ``local-tensors.max-bytes``) or ``dm.put`` does; its worker processes and pin-memory
  thread start outside the mesh; the client's generator, which ``torch.manual_seed`` seeds
  under a mesh too, shuffles.
* **Unpickling a tensor** (``torch.load`` of a checkpoint, ``pickle.loads``) and
  **``copy.deepcopy`` of a local tensor** (``Optimizer.load_state_dict`` deep-copies its
  param groups, a tensor learning rate among them) point an empty tensor at a storage
  they hold (``torch.empty(0).set_(storage, ...)``). The empty one was a mesh tensor, and
  torch refused ("Attempted to set the storage of a tensor on device 'meta'"). They are
  local tensors now, as in one process: ``model.load_state_dict`` copies them onto the
  mesh.
* **A lazy module's placeholders** (``nn.LazyLinear``'s ``UninitializedParameter``) are
  made of an empty tensor, which torch cannot make a parameter subclass of when it is a mesh
  tensor: building one under a mesh failed with torch's own error. They are local and
  empty, and the module's first call on mesh inputs says to give it its sizes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch._utils
from torch.utils.data import dataloader

# what runs as local torch: making a DataLoader's iterator (seeds, sampler, workers) and
# each batch; rebuilding an unpickled tensor; deep-copying a local one (a mesh tensor's own
# __deepcopy__ clones it on the ranks)
_LOCAL_FUNCTIONS = (
    (dataloader.DataLoader, "__iter__"),
    (dataloader._BaseDataLoaderIter, "__next__"),
    (torch._utils, "_rebuild_tensor"),
    (torch._utils, "_rebuild_tensor_v3"),
    (torch._utils, "_rebuild_parameter"),
    (torch._utils, "_rebuild_parameter_with_state"),
    (torch.Tensor, "__deepcopy__"),
    (torch.nn.Parameter, "__deepcopy__"),
    # a lazy module's placeholders: local and empty (its first call on mesh inputs says
    # what to do instead: give the module its sizes)
    (torch.nn.parameter.UninitializedParameter, "__new__"),
    (torch.nn.parameter.UninitializedBuffer, "__new__"),
)


def install(local: Callable[[], AbstractContextManager]) -> None:
    """Run each of ``_LOCAL_FUNCTIONS`` inside ``local()`` (``no_mesh.activate``), once per
    process; passed in so this module imports none of the user API's modules."""
    for owner, name in _LOCAL_FUNCTIONS:
        function = owner.__dict__[name]
        static = isinstance(function, staticmethod)  # __new__
        function = function.__func__ if static else function
        if not getattr(function, "__dask_monarch_local__", False):
            wrapper = _locally(function, local)
            setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def _locally(function: Callable, local: Callable[[], AbstractContextManager]) -> Callable:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with local():
            return function(*args, **kwargs)

    wrapper.__dask_monarch_local__ = True  # type: ignore[attr-defined]
    return wrapper
