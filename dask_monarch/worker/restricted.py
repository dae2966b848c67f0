"""Restricted unpickling: plain data only, for workers that accept no pickled code.

With ``dask_monarch.functions.allow-pickled: false`` a worker must not run
code chosen by whoever sent a message, and unpickling runs code (any global a
pickle names is imported and may be called). Message batches, pickled
argument payloads and ``SetRefUnitTestsOnly`` values are then loaded by
:func:`loads`, whose unpickler finds only: builtin containers and scalars,
torch tensors, dtypes, devices and sizes (the globals torch's own
``weights_only`` loader trusts, plus those registered with
``torch.serialization.add_safe_globals``), and our message and value classes.
Anything else is :class:`RestrictedPickleError`, naming the global.
Security model: docs/security.md.

:func:`loads_ours` is stricter still (no user-registered safe globals): what
it loads runs only dask_monarch's and torch's code, so the worker's event
loop may load with it (worker/inline.py; DESIGN decision 17).
"""

from __future__ import annotations

import builtins
import io
import pickle
from typing import Any

import torch

from ..protocol import messages as m
from ..protocol import ndslice, tensor_bytes, wire

__all__ = ["RestrictedPickleError", "loads", "loads_ours", "allowed_globals"]


class RestrictedPickleError(pickle.UnpicklingError):
    """A pickle names a global outside the plain-data set."""


_BUILTINS = (
    "list",
    "dict",
    "tuple",
    "set",
    "frozenset",
    "bytearray",
    "bytes",
    "str",
    "int",
    "float",
    "complex",
    "bool",
    "slice",
    "range",
    "Ellipsis",
    "NotImplemented",
)
# ``getattr`` only for the reconstructors our checked types pickle with (``int.__new__``, ...)
_GETATTR_OK = {(int, "__new__"), (tuple, "__new__")}


def _safe_getattr(obj: Any, name: str) -> Any:
    if (obj, name) not in _GETATTR_OK:
        raise RestrictedPickleError(f"getattr({obj!r}, {name!r}) is not plain data")
    return getattr(obj, name)


def _load_storage(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` without its ``weights_only=False``."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _torch_globals(user: bool) -> dict[str, Any]:
    found: dict[str, Any] = {}
    try:  # what torch.load(weights_only=True) trusts
        from torch._weights_only_unpickler import _get_allowed_globals

        found.update(_get_allowed_globals())
    except (ImportError, AttributeError):  # an older or newer torch: the basics below
        found.update(
            {
                "torch.Size": torch.Size,
                "torch.device": torch.device,
                "torch._utils._rebuild_tensor_v2": torch._utils._rebuild_tensor_v2,
            }
        )
    for entry in torch.serialization.get_safe_globals() if user else ():  # user-registered
        obj = entry[0] if isinstance(entry, tuple) else entry
        name = entry[1] if isinstance(entry, tuple) else f"{obj.__module__}.{obj.__qualname__}"
        found[name] = obj
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            found[f"torch.{name}"] = value
    return found


def allowed_globals(user: bool = True) -> dict[str, Any]:
    """``"module.name"`` -> object, for every global a restricted load may name (``user``:
    with those registered by ``torch.serialization.add_safe_globals``)."""
    found = _torch_globals(user)
    found.update({f"builtins.{n}": getattr(builtins, n) for n in _BUILTINS})
    found["builtins.getattr"] = _safe_getattr
    found["collections.OrderedDict"] = __import__("collections").OrderedDict
    found["torch.storage._load_from_bytes"] = _load_storage
    for name in m.__all__:
        value = getattr(m, name)
        if isinstance(value, type):
            found[f"{m.__name__}.{name}"] = value
    found[f"{m.__name__}.memory_format"] = m.memory_format  # how batches name one
    for build in (tensor_bytes.storage, tensor_bytes.raw_tensor):  # tensors as their bytes
        found[f"{tensor_bytes.__name__}.{build.__name__}"] = build
    for step in wire.STEPS:
        found[f"{wire.__name__}.{step.__name__}"] = step
    found[f"{ndslice.__name__}.Slice"] = ndslice.Slice
    return found


_allowed: dict[bool, dict[str, Any]] = {}  # user globals or not -> allowed globals


class _Unpickler(pickle.Unpickler):
    user = True  # user-registered safe globals too

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed.get(self.user)
        if allowed is None:
            allowed = _allowed[self.user] = allowed_globals(self.user)
        try:
            return allowed[f"{module}.{name}"]
        except KeyError:
            raise RestrictedPickleError(
                f"{module}.{name} is not plain data, and this worker accepts no pickled code "
                "(dask_monarch.functions.allow-pickled is false): send tensors, numbers, "
                "strings and containers of them, and name functions by import path"
            ) from None


class _OursUnpickler(_Unpickler):
    user = False


def loads(data: bytes) -> Any:
    """``pickle.loads`` that builds plain data only (see the module docs)."""
    return _Unpickler(io.BytesIO(data)).load()


def loads_ours(data: bytes) -> Any:
    """:func:`loads` without user-registered globals: only our code and torch's runs."""
    return _OursUnpickler(io.BytesIO(data)).load()
