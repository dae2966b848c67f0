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
"""

from __future__ import annotations

import builtins
import io
import pickle
from typing import Any

import torch

from ..protocol import messages as m
from ..protocol import wire

__all__ = ["RestrictedPickleError", "loads", "allowed_globals"]


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


def _torch_globals() -> dict[str, Any]:
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
    for entry in torch.serialization.get_safe_globals():  # user-registered ones
        obj = entry[0] if isinstance(entry, tuple) else entry
        name = entry[1] if isinstance(entry, tuple) else f"{obj.__module__}.{obj.__qualname__}"
        found[name] = obj
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            found[f"torch.{name}"] = value
    return found


def allowed_globals() -> dict[str, Any]:
    """``"module.name"`` -> object, for every global a restricted load may name."""
    found = _torch_globals()
    found.update({f"builtins.{n}": getattr(builtins, n) for n in _BUILTINS})
    found["builtins.getattr"] = _safe_getattr
    found["collections.OrderedDict"] = __import__("collections").OrderedDict
    found["torch.storage._load_from_bytes"] = _load_storage
    for name in m.__all__:
        value = getattr(m, name)
        if isinstance(value, type):
            found[f"{m.__name__}.{name}"] = value
    found[f"{m.__name__}.memory_format"] = m.memory_format  # how batches name one
    for name in ("StatusProbe", "ReadRef", "ActorCall"):
        found[f"{wire.__name__}.{name}"] = getattr(wire, name)
    return found


_allowed: dict[str, Any] | None = None


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        global _allowed
        if _allowed is None:
            _allowed = allowed_globals()
        try:
            return _allowed[f"{module}.{name}"]
        except KeyError:
            raise RestrictedPickleError(
                f"{module}.{name} is not plain data, and this worker accepts no pickled code "
                "(dask_monarch.functions.allow-pickled is false): send tensors, numbers, "
                "strings and containers of them, and name functions by import path"
            ) from None


def loads(data: bytes) -> Any:
    """``pickle.loads`` that builds plain data only (see the module docs)."""
    return _Unpickler(io.BytesIO(data)).load()
