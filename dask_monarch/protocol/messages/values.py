"""The values messages carry: refs, functions, arguments, tensor factories, enums.

Each type pickles by value and compares by value. The checks for fields of
these types are registered here, so messages can annotate fields with them.
"""

import copyreg
import enum
import functools
import importlib
import io
import logging
import pickle
from collections import ChainMap
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import is_not, itemgetter
from typing import Any, Union

import cloudpickle
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_unflatten

from .. import source, tensor_bytes
from ..ndslice import Slice
from .checked import CheckedId, check_int, checked, instance_of, list_of, optional, register_checks

_tuple_new = tuple.__new__  # rebuilds an ArgsKwargs without checks
_logger = logging.getLogger("dask_monarch.remote_function")

# --------------------------------------------------------------------------- ids


class Ref(CheckedId):
    """Anything a controller can name on a worker: a tensor, mesh, stream, group, pipe..."""

    __slots__ = ()

    @property
    def ref(self) -> int:
        return self.id

    def __str__(self) -> str:
        return f"r{int(self)}"


class StreamRef(CheckedId):
    """The id of a stream (a lane on every rank)."""

    __slots__ = ()


def as_ref(obj: Any) -> Ref:
    """``obj`` as a Ref: a Ref, or anything with ``__monarch_ref__()`` (Ref or int)."""
    if type(obj) is Ref:
        return obj
    method = getattr(type(obj), "__monarch_ref__", None)
    if method is None:
        raise TypeError(f"expected a Ref, got {obj!r}")
    value = method(obj)
    return value if type(value) is Ref else Ref(value)


# --------------------------------------------------------------------------- functions


@dataclass(frozen=True, slots=True)
class FunctionPath:
    """A function named by import path, e.g. ``torch.ops.aten.add.Tensor``."""

    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise TypeError(f"FunctionPath.path must be a non-empty str, got {self.path!r}")

    def __reduce__(self) -> tuple:
        return (FunctionPath, (self.path,))

    def __repr__(self) -> str:
        return f"FunctionPath({self.path!r})"


@dataclass(frozen=True, slots=True)
class Cloudpickle:
    """A function (closure, ``__main__`` or test-module function) as cloudpickled bytes."""

    bytes: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.bytes, (bytes, bytearray)):
            raise TypeError(f"Cloudpickle.bytes must be bytes, got {type(self.bytes).__name__}")

    def __reduce__(self) -> tuple:
        return (Cloudpickle, (self.bytes,))

    @classmethod
    def dumps(cls, obj: Any) -> "Cloudpickle":
        """``obj`` pickled by value, its code keeping its file name and source lines."""
        return cls(source.dumps(obj))

    def __repr__(self) -> str:
        return f"Cloudpickle(<{len(self.bytes)} bytes>)"


ResolvableFunction = Union[FunctionPath, Cloudpickle]


def as_function(value: Any) -> ResolvableFunction:
    """A ResolvableFunction from a FunctionPath, Cloudpickle, import path or callable."""
    if isinstance(value, (FunctionPath, Cloudpickle)):
        return value
    if isinstance(value, str):
        return FunctionPath(value)
    if callable(value):
        return Cloudpickle.dumps(value)
    raise TypeError(f"expected a FunctionPath, Cloudpickle, import path or callable, got {value!r}")


def resolvable(fn: Callable | str) -> FunctionPath | Cloudpickle:
    """An import path when the function can be found by one, else its cloudpickle."""
    if isinstance(fn, str):
        return FunctionPath(fn)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname and "." not in qualname:
        try:
            if getattr(importlib.import_module(module), qualname, None) is fn:
                return FunctionPath(f"{module}.{qualname}")
        except ImportError as e:  # a module that only exists here: send the function itself
            _logger.debug("%s.%s is not importable by path (%r); pickling it", module, qualname, e)
    return Cloudpickle.dumps(fn)


# --------------------------------------------------------------------------- views


class RefView(tuple):
    """A view of a ref, named in a call's arguments instead of a ref of its own.

    ``RefView(base, function, args, kwargs)`` stands for ``function(base, *args,
    **kwargs)``, computed on the lane that reads it when the call runs (``base``:
    a Ref or another RefView). A controller sends a metadata-only op (``view``,
    ``t``, ``detach``, ``transpose``...) this way instead of a ``CallFunction``
    that defines a ref: a training step is half views (docs/protocol.md §1.3, §2.2);
    and an integer input of a pointwise op as a cast to the client's default dtype.
    A plain tuple underneath, so batches pickle it in C.
    """

    __slots__ = ()

    def __new__(
        cls, base: Any, function: "FunctionPath", args: tuple = (), kwargs: dict | None = None
    ) -> "RefView":
        if type(base) not in (Ref, RefView):
            raise TypeError(f"RefView.base must be a Ref or a RefView, got {base!r}")
        if type(function) is not FunctionPath:
            raise TypeError(f"RefView.function must be a FunctionPath, got {function!r}")
        if type(args) is not tuple:
            raise TypeError(f"RefView.args must be a tuple, got {args!r}")
        kwargs = {} if kwargs is None else kwargs
        if type(kwargs) is not dict or not all(type(k) is str for k in kwargs):
            raise TypeError(f"RefView.kwargs must be a dict with str keys, got {kwargs!r}")
        return _tuple_new(cls, (base, function, args, kwargs))

    base = property(itemgetter(0))
    function = property(itemgetter(1))

    def root(self) -> "Ref":
        """The ref the chain of views starts from."""
        base = self[0]
        while type(base) is RefView:
            base = base[0]
        return base

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_tuple_new, (RefView, tuple(self)))

    def __repr__(self) -> str:
        return f"RefView({self[0]!r}, {self[1].path}, {self[2]!r}, {self[3]!r})"


# --------------------------------------------------------------------------- arguments

# Leaves that plain pickle handles and that cannot change after they are sent.
IMMUTABLE_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    Ref,
    RefView,
    StreamRef,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.Size,
    range,
    slice,
    type(Ellipsis),
)


_FLAT_LEAVES = frozenset(
    {type(None), bool, int, float, str, Ref, StreamRef, torch.dtype, torch.device, torch.layout}
)


class ArgsKwargs(tuple):
    """Arguments of a remote call; make them with :meth:`from_python`.

    Objects with ``__monarch_ref__`` become their :class:`Ref`; containers are
    copied. Arguments made only of immutable leaves travel inside the message
    batch (plain pickle, no per-message cloudpickle); anything else (local
    tensors, closures, user objects) is cloudpickled at once, so later changes
    on the client do not leak into the call. ``flat`` says no argument is a
    container, which lets the worker skip the pytree walk. A plain tuple
    underneath ``(args, kwargs, payload, flat)``, so batches pickle it in C.
    """

    __slots__ = ()

    def __init__(self, fields: Iterable[Any] = ()) -> None:
        if len(self) != 4 or type(self[0]) is not tuple or type(self[1]) is not dict:
            raise TypeError("make ArgsKwargs with ArgsKwargs.from_python(args, kwargs)")

    _args = property(itemgetter(0))
    _kwargs = property(itemgetter(1))
    _payload = property(itemgetter(2))
    flat = property(itemgetter(3))

    @classmethod
    def from_python(
        cls, args: Iterable[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> "ArgsKwargs":
        if not kwargs and type(args) is tuple and all(type(a) in _FLAT_LEAVES for a in args):
            return _tuple_new(cls, (args, {}, None, True))
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise TypeError(f"kwargs must be a dict with str keys, got {kwargs!r}")
        args = tuple(args)
        simple = [True]
        flat = all(not isinstance(a, (list, tuple, dict)) or type(a) is torch.Size for a in args)
        flat = flat and all(
            not isinstance(v, (list, tuple, dict)) or type(v) is torch.Size for v in kwargs.values()
        )
        new_args = tuple(_convert_refs(a, simple) for a in args)
        new_kwargs = {k: _convert_refs(v, simple) for k, v in kwargs.items()}
        if simple[0]:
            return _tuple_new(cls, (new_args, new_kwargs, None, flat))
        return _tuple_new(cls, ((), {}, source.dumps((new_args, new_kwargs)), False))

    def to_python(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with Refs in place of referenceable objects. A pickled payload
        is loaded as local values: no dispatch mode of the caller (an active mesh) sees the
        tensors it rebuilds."""
        if self[2] is not None:
            with _disable_current_modes():
                return pickle.loads(self[2])
        return self[0], dict(self[1])

    def __eq__(self, other: object) -> bool:
        if type(other) is not ArgsKwargs:
            return NotImplemented
        if self[2] is not None or other[2] is not None:
            return self[2] == other[2]
        try:
            return bool(self[0] == other[0] and self[1] == other[1])
        except Exception:  # leaves without a boolean ==, e.g. tensors
            return pickle.dumps(self.to_python()) == pickle.dumps(other.to_python())

    def __ne__(self, other: object) -> bool:
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = None

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_tuple_new, (ArgsKwargs, tuple(self)))

    def __repr__(self) -> str:
        if self[2] is not None:
            return f"ArgsKwargs(<{len(self[2])} cloudpickled bytes>)"
        return f"ArgsKwargs({self[0]!r}, {self[1]!r})"


def _convert_refs(obj: Any, simple: list[bool]) -> Any:
    """Copy containers, turning ``__monarch_ref__`` objects into Refs; note non-simple leaves."""
    if isinstance(obj, IMMUTABLE_LEAVES):
        return obj
    if getattr(type(obj), "__monarch_ref__", None) is not None:
        return as_ref(obj)
    cls = type(obj)
    if cls is list:
        return [_convert_refs(x, simple) for x in obj]
    if cls is tuple:
        return tuple(_convert_refs(x, simple) for x in obj)
    if cls is dict:
        return {k: _convert_refs(v, simple) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return cls(*(_convert_refs(x, simple) for x in obj))
    simple[0] = False
    # any other container torch's pytree knows (a state_dict()'s OrderedDict, defaultdict,
    # torch.topk's structseq, transformers' ModelOutput): its children, one level down.
    # (tree_flatten's own helper is a cycle: it keeps what it is given until a collection,
    # so a leaf is not given to it, and no function of ours is)
    if tree_is_leaf(obj):
        return obj
    children, spec = tree_flatten(obj, is_leaf=functools.partial(is_not, obj))
    return tree_unflatten([_convert_refs(c, simple) for c in children], spec)


# --------------------------------------------------------------------------- tensors and enums


@dataclass(frozen=True, slots=True)
class Factory:
    """How to make a tensor like another one: used to fabricate zeros or receive buffers."""

    size: tuple[int, ...]
    dtype: torch.dtype
    layout: torch.layout
    device: str

    def __post_init__(self) -> None:
        if isinstance(self.size, (str, bytes)) or not isinstance(self.size, Iterable):
            raise TypeError(f"Factory.size must be a sequence of ints, got {self.size!r}")
        size = tuple(self.size)
        if not all(type(s) is int and s >= 0 for s in size):
            raise ValueError(f"Factory.size must hold non-negative ints, got {self.size!r}")
        object.__setattr__(self, "size", size)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"Factory.dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.layout, torch.layout):
            raise TypeError(f"Factory.layout must be a torch.layout, got {self.layout!r}")
        if not isinstance(self.device, (str, torch.device)):
            raise TypeError(f"Factory.device must be a str or torch.device, got {self.device!r}")
        object.__setattr__(self, "device", str(torch.device(self.device)))

    def __reduce__(self) -> tuple:
        return (Factory, (self.size, self.dtype, self.layout, self.device))

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Factory":
        return cls(tuple(t.shape), t.dtype, t.layout, str(t.device))

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=self.dtype, layout=self.layout, device=self.device)

    def empty(self, size: Iterable[int] | None = None) -> torch.Tensor:
        size = self.size if size is None else tuple(size)
        return torch.empty(size, dtype=self.dtype, layout=self.layout, device=self.device)


class ReduceOp(enum.Enum):
    """Reduction operators, named as in ``torch.distributed.ReduceOp``."""

    SUM = "sum"
    PRODUCT = "product"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


Reduction = Union[str, ReduceOp]  # "stack" or a ReduceOp


class StreamCreationMode(enum.Enum):
    """Whether a stream runs on the device's default stream or on a new one."""

    UseDefaultStream = "UseDefaultStream"
    CreateNewStream = "CreateNewStream"

    def __repr__(self) -> str:
        return f"StreamCreationMode.{self.name}"


# --------------------------------------------------------------------------- pickling


def memory_format(name: str) -> torch.memory_format:
    """``torch.<name>``, a memory format: how :func:`dumps` pickles one."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.memory_format):
        raise ValueError(f"torch.{name} is not a memory format")
    return value


def _reduce_memory_format(value: torch.memory_format) -> tuple:
    return memory_format, (str(value).removeprefix("torch."),)


def dumps(obj: Any) -> bytes:
    """``pickle.dumps(obj, protocol=5)`` for message batches, with memory formats by name and
    CPU storages as raw bytes.

    A memory format pickles as the global ``torch.contiguous_format``, and as
    its instances have no ``__module__``, pickle searches every loaded module
    for it: 60 µs each, where a whole message takes 2 (``ones_like`` and
    ``empty_like`` carry one in every call). Tensors in messages (a client
    value placed on the mesh, a generator's state) travel as
    :func:`dumps_value` sends fetched ones: their bytes, not ``torch.save``'s
    archive (40-50 µs less to dump, 40-50 µs less to load on every rank).
    """
    return _dump(obj, _BATCH_REDUCERS)


def dumps_value(value: Any, cloud: bool = False) -> bytes:
    """``pickle.dumps(value, protocol=5)`` for a fetched value, with storages as raw bytes on
    the CPU (``cloud``: cloudpickle's, for what pickle cannot: a lambda, a local class).

    torch pickles a tensor as its storage, offset, sizes and strides (kept
    here), and the storage through ``torch.save`` into a buffer: 60 µs to
    dump and 80-290 µs to load for a 4-element tensor, on the path of every
    fetch. As the bytes themselves (:mod:`..tensor_bytes`): 5 and 20 µs. A
    GPU tensor anywhere in the value comes to the client on the CPU.
    """
    return _dump(value, _VALUE_REDUCERS, cloud)


_VALUE_REDUCERS = tensor_bytes.FETCHED_REDUCERS  # dumps_value
_BATCH_REDUCERS = {torch.memory_format: _reduce_memory_format, **tensor_bytes.REDUCERS}  # dumps
_tables: dict[tuple, dict] = {}  # (our reducers, size of copyreg's table) -> the merged table


def _dump(obj: Any, reducers: dict, cloud: bool = False) -> bytes:
    buffer = io.BytesIO()
    if cloud:  # ours over cloudpickle's own table (which ends in copyreg's)
        pickler = cloudpickle.CloudPickler(buffer, protocol=5)
        pickler.dispatch_table = ChainMap(reducers, cloudpickle.CloudPickler.dispatch_table)
    else:
        pickler = pickle.Pickler(buffer, protocol=5)
        # copyreg's table as it is now (torch registers reducers as it loads), plus ours
        key = (id(reducers), len(copyreg.dispatch_table))
        table = _tables.get(key)
        if table is None:
            table = _tables[key] = {**copyreg.dispatch_table, **reducers}
        pickler.dispatch_table = table
    pickler.dump(obj)
    return buffer.getvalue()


# --------------------------------------------------------------------------- field checks


def _ref(v: Any, where: str) -> Ref:
    if type(v) is Ref:
        return v
    try:
        return as_ref(v)
    except TypeError:
        raise TypeError(f"{where} must be a Ref, got {v!r}") from None


def _stream(v: Any, where: str) -> StreamRef:
    if type(v) is not StreamRef:
        raise TypeError(f"{where} must be a StreamRef, got {v!r}")
    return v


def _function(v: Any, where: str) -> ResolvableFunction:
    if type(v) is FunctionPath or type(v) is Cloudpickle:
        return v
    try:
        return as_function(v)
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None


def _reduction(v: Any, where: str) -> Reduction:
    if isinstance(v, ReduceOp) or v == "stack":
        return v
    raise ValueError(f"{where} must be 'stack' or a ReduceOp, got {v!r}")


def _broker_id(v: Any, where: str) -> tuple[str, int]:
    if not (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)):
        raise TypeError(f"{where} must be a (str, int) tuple, got {v!r}")
    return (v[0], check_int(v[1], where))


register_checks(
    {
        Ref: _ref,
        StreamRef: _stream,
        Ref | None: optional(_ref),
        list[Ref]: list_of(_ref, {Ref}),
        list[Ref | None]: list_of(optional(_ref), {Ref, type(None)}),
        Slice: instance_of(Slice),
        Factory: instance_of(Factory),
        ArgsKwargs: instance_of(ArgsKwargs),
        StreamCreationMode: instance_of(StreamCreationMode),
        ResolvableFunction: _function,
        ResolvableFunction | None: optional(_function),
        Reduction: _reduction,
        tuple[str, int]: _broker_id,
    }
)


# --------------------------------------------------------------------------- params


@checked
class ActorCallParams:
    """An actor method call fed with tensors from a stream's ref table."""

    seq: int
    broker_id: tuple[str, int]
    local_state: list[Ref]
    mutates: list[Ref]
    stream: StreamRef


register_checks({ActorCallParams: instance_of(ActorCallParams)})
