"""``torch.utils.data`` under an active mesh: the data pipeline is the client's, local torch.

A DataLoader draws its seeds and shuffles with local torch
(``torch.empty((), dtype=torch.int64).random_().item()``), runs the dataset's
``__getitem__`` and collates with ``torch.stack``. Under ``mesh.activate()``
those factories became mesh tensors drawn by each rank's own generator, and
the first ``.item()`` raised "the ranks disagree": no DataLoader could be
iterated inside a mesh's block. Iterating one now runs as inside
``dask_monarch.no_mesh.activate()``: its batches are local tensors, as in one
process, which an op places on the mesh (up to ``local-tensors.max-bytes``) or
``dm.put`` does; its worker processes and pin-memory thread start outside the
mesh; the client's generator, which ``torch.manual_seed`` seeds under a mesh
too, shuffles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from torch.utils.data import dataloader

# what runs as local torch: making the iterator (seeds, sampler, workers) and each batch
_LOCAL_METHODS = ((dataloader.DataLoader, "__iter__"), (dataloader._BaseDataLoaderIter, "__next__"))


def install(local: Callable[[], AbstractContextManager]) -> None:
    """Run DataLoader iteration inside ``local()`` (``no_mesh.activate``), once per process;
    passed in so this module imports none of the user API's modules."""
    for cls, name in _LOCAL_METHODS:
        method = cls.__dict__[name]
        if not getattr(method, "__dask_monarch_local__", False):
            setattr(cls, name, _locally(method, local))


def _locally(method: Callable, local: Callable[[], AbstractContextManager]) -> Callable:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with local():
            return method(self, *args, **kwargs)

    wrapper.__dask_monarch_local__ = True  # type: ignore[attr-defined]
    return wrapper
