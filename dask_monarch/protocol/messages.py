"""The protocol: every worker message of Monarch's tensor engine, as plain data.

One frozen dataclass per ``WorkerMessage`` variant of ``seed/worker.rs`` (same
class and field names), the messages workers send back to the controller, and
the helper types they carry. Fields are checked and normalised at
construction (``TypeError``/``ValueError`` with the field named); messages
pickle by value through their constructor and compare by value. Behaviour
lives in :mod:`dask_monarch.worker`, routing in :mod:`dask_monarch.graph`.
"""

import enum
import pickle
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Union

import cloudpickle
import torch

from .ndslice import Slice

__all__ = [
    "Ref", "StreamRef", "FunctionPath", "Cloudpickle", "ResolvableFunction", "ArgsKwargs",
    "Factory", "ReduceOp", "Reduction", "StreamCreationMode", "ActorCallParams",
    "WorkerMessage", "WORKER_MESSAGES", "CONTROLLER_MESSAGES",
    "BackendNetworkInit", "BackendNetworkPointToPointInit", "CallFunction", "CommandGroup",
    "CreateStream", "CreateDeviceMesh", "CreateRemoteProcessGroup", "BorrowCreate",
    "BorrowFirstUse", "BorrowLastUse", "BorrowDrop", "DeleteRefs", "RequestStatus", "Reduce",
    "SplitComm", "SplitCommForProcessGroup", "SendTensor", "SendValue", "SendResultOfActorCall",
    "CallActorMethod", "PipeRecv", "CreatePipe", "Exit", "DefineRecording", "RecordingFormal",
    "RecordingResult", "CallRecording", "SetRefUnitTestsOnly", "GetRefUnitTestsOnly",
    "Status", "FetchResult", "RemoteFunctionFailed",
]


# Reconstructors that skip the checks: a batch of messages loads on the worker in C.
_tuple_new = tuple.__new__
_int_new = int.__new__

# --------------------------------------------------------------------------- ids


class _Id(int):
    """A 64-bit id allocated by the client; compares, orders and hashes by value.

    An ``int`` subclass so that batches of messages pickle and unpickle ids in
    C (no Python call per id): a batch of small messages is mostly ids.
    """

    __slots__ = ()

    def __init__(self, id: int):
        if type(id) is not int:
            if isinstance(id, (bool, _Id)) or not isinstance(id, int):
                raise TypeError(f"{type(self).__name__} id must be an int, got {id!r}")
        if not 0 <= id < 2**64:
            raise ValueError(f"{type(self).__name__} id must fit in 64 unsigned bits, got {id}")

    @property
    def id(self) -> int:
        return int(self)

    def __eq__(self, other):
        if isinstance(other, _Id) and type(other) is not type(self):
            return False
        return int.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = int.__hash__

    def __reduce_ex__(self, protocol):
        return (_int_new, (type(self), int(self)))

    def __repr__(self):
        return f"{type(self).__name__}({int(self)})"

    __str__ = __repr__


class Ref(_Id):
    """Anything a controller can name on a worker: a tensor, mesh, stream, group, pipe..."""

    __slots__ = ()

    @property
    def ref(self) -> int:
        return self.id

    def __str__(self):
        return f"r{int(self)}"


class StreamRef(_Id):
    """The id of a stream (a lane on every rank)."""

    __slots__ = ()


def as_ref(obj: Any) -> "Ref":
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

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise TypeError(f"FunctionPath.path must be a non-empty str, got {self.path!r}")

    def __reduce__(self):
        return (FunctionPath, (self.path,))

    def __repr__(self):
        return f"FunctionPath({self.path!r})"


@dataclass(frozen=True, slots=True)
class Cloudpickle:
    """A function (closure, ``__main__`` or test-module function) as cloudpickled bytes."""

    bytes: bytes

    def __post_init__(self):
        if not isinstance(self.bytes, (bytes, bytearray)):
            raise TypeError(f"Cloudpickle.bytes must be bytes, got {type(self.bytes).__name__}")

    def __reduce__(self):
        return (Cloudpickle, (self.bytes,))

    @classmethod
    def dumps(cls, obj: Any) -> "Cloudpickle":
        return cls(cloudpickle.dumps(obj))

    def __repr__(self):
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


# --------------------------------------------------------------------------- arguments

# Leaves that plain pickle handles and that cannot change after they are sent.
_IMMUTABLE_LEAVES = (
    type(None), bool, int, float, complex, str, bytes, Ref, StreamRef, torch.dtype,
    torch.device, torch.layout, torch.memory_format, torch.Size, range, slice, type(Ellipsis),
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

    def __init__(self, fields=()):
        if len(self) != 4 or type(self[0]) is not tuple or type(self[1]) is not dict:
            raise TypeError("make ArgsKwargs with ArgsKwargs.from_python(args, kwargs)")

    _args = property(itemgetter(0))
    _kwargs = property(itemgetter(1))
    _payload = property(itemgetter(2))
    flat = property(itemgetter(3))

    @classmethod
    def from_python(cls, args: Iterable[Any] = (),
                    kwargs: dict[str, Any] | None = None) -> "ArgsKwargs":
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
        return _tuple_new(cls, ((), {}, cloudpickle.dumps((new_args, new_kwargs)), False))

    def to_python(self) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with Refs in place of referenceable objects."""
        if self[2] is not None:
            return pickle.loads(self[2])
        return self[0], dict(self[1])

    def __eq__(self, other):
        if type(other) is not ArgsKwargs:
            return NotImplemented
        if self[2] is not None or other[2] is not None:
            return self[2] == other[2]
        try:
            return bool(self[0] == other[0] and self[1] == other[1])
        except Exception:  # leaves without a boolean ==, e.g. tensors
            return pickle.dumps(self.to_python()) == pickle.dumps(other.to_python())

    def __ne__(self, other):
        result = self.__eq__(other)
        return result if result is NotImplemented else not result

    __hash__ = None

    def __reduce_ex__(self, protocol):
        return (_tuple_new, (ArgsKwargs, tuple(self)))

    def __repr__(self):
        if self[2] is not None:
            return f"ArgsKwargs(<{len(self[2])} cloudpickled bytes>)"
        return f"ArgsKwargs({self[0]!r}, {self[1]!r})"


def _convert_refs(obj: Any, simple: list[bool]) -> Any:
    """Copy containers, turning ``__monarch_ref__`` objects into Refs; note non-simple leaves."""
    if isinstance(obj, _IMMUTABLE_LEAVES):
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
    return obj


# --------------------------------------------------------------------------- tensors and enums


@dataclass(frozen=True, slots=True)
class Factory:
    """How to make a tensor like another one: used to fabricate zeros or receive buffers."""

    size: tuple[int, ...]
    dtype: torch.dtype
    layout: torch.layout
    device: str

    def __post_init__(self):
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

    def __reduce__(self):
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

    def __repr__(self):
        return f"ReduceOp.{self.name}"


Reduction = Union[str, ReduceOp]  # "stack" or a ReduceOp


class StreamCreationMode(enum.Enum):
    UseDefaultStream = "UseDefaultStream"
    CreateNewStream = "CreateNewStream"

    def __repr__(self):
        return f"StreamCreationMode.{self.name}"


# --------------------------------------------------------------------------- field checks

_MESSAGE_TYPES: tuple[type, ...] = ()  # filled in below, for nested message lists


def _int(v, where):
    if type(v) is int and v >= 0:
        return v
    if isinstance(v, (bool, _Id)) or not isinstance(v, int):
        raise TypeError(f"{where} must be an int, got {v!r}")
    if v < 0:
        raise ValueError(f"{where} must be non-negative, got {v}")
    return int(v)


def _bool(v, where):
    if type(v) is not bool:
        raise TypeError(f"{where} must be a bool, got {v!r}")
    return v


def _str(v, where):
    if not isinstance(v, str):
        raise TypeError(f"{where} must be a str, got {v!r}")
    return v


def _ref(v, where):
    if type(v) is Ref:
        return v
    try:
        return as_ref(v)
    except TypeError:
        raise TypeError(f"{where} must be a Ref, got {v!r}") from None


def _stream(v, where):
    if type(v) is not StreamRef:
        raise TypeError(f"{where} must be a StreamRef, got {v!r}")
    return v


def _optional(check):
    def optional(v, where):
        return None if v is None else check(v, where)

    return optional


def _list(check, fast_types=()):
    """A list whose items pass ``check``; lists already of ``fast_types`` are kept as they are."""

    def checked_list(v, where):
        if type(v) is list and all(type(x) in fast_types for x in v):
            return v
        if isinstance(v, (str, bytes, dict)) or not isinstance(v, Iterable):
            raise TypeError(f"{where} must be a list, got {v!r}")
        return [check(x, f"{where}[{i}]") for i, x in enumerate(v)]

    return checked_list


def _instance(cls):
    def instance(v, where):
        if type(v) is not cls and not isinstance(v, cls):
            raise TypeError(f"{where} must be a {cls.__name__}, got {v!r}")
        return v

    return instance


def _function(v, where):
    if type(v) is FunctionPath or type(v) is Cloudpickle:
        return v
    try:
        return as_function(v)
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None


def _reduction(v, where):
    if isinstance(v, ReduceOp) or v == "stack":
        return v
    raise ValueError(f"{where} must be 'stack' or a ReduceOp, got {v!r}")


def _message(v, where):
    if not isinstance(v, _MESSAGE_TYPES):
        raise TypeError(f"{where} must be a worker message, got {v!r}")
    return v


def _broker_id(v, where):
    if not (isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str)):
        raise TypeError(f"{where} must be a (str, int) tuple, got {v!r}")
    return (v[0], _int(v[1], where))


def _exit_error(v, where):
    if v is None:
        return None
    if not (isinstance(v, tuple) and len(v) == 2 and (v[0] is None or isinstance(v[0], str))
            and isinstance(v[1], str)):
        raise TypeError(f"{where} must be None or a (source: str | None, message: str) tuple")
    return v


def _any(v, where):
    return v


_CHECKS: dict[Any, Callable] = {
    int: _int,
    bool: _bool,
    str: _str,
    Any: _any,
    Ref: _ref,
    StreamRef: _stream,
    Ref | None: _optional(_ref),
    str | None: _optional(_str),
    list[Ref]: _list(_ref, {Ref}),
    list[Ref | None]: _list(_optional(_ref), {Ref, type(None)}),
    list[str]: _list(_str, {str}),
    Slice: _instance(Slice),
    Factory: _instance(Factory),
    ArgsKwargs: _instance(ArgsKwargs),
    StreamCreationMode: _instance(StreamCreationMode),
    ResolvableFunction: _function,
    ResolvableFunction | None: _optional(_function),
    Reduction: _reduction,
    tuple[str, int]: _broker_id,
    tuple[str | None, str] | None: _exit_error,
    list["WorkerMessage"]: _list(_message),
}


def _register_check(cls):
    _CHECKS[cls] = _instance(cls)
    return cls


def _checked(cls):
    """Make ``cls`` a protocol message: a named tuple whose fields are checked by annotation.

    Construction checks and normalises every field; unpickling rebuilds the
    tuple directly (``tuple.__new__``), so a batch of messages loads on the
    worker without re-running the checks.
    """
    annotations = cls.__dict__.get("__annotations__", {})
    names = tuple(annotations)
    defaults = {n: cls.__dict__[n] for n in names if n in cls.__dict__}
    base = namedtuple(cls.__name__, names, defaults=[defaults[n] for n in names if n in defaults])
    namespace = {"_tnew": _tuple_new}
    params = []
    for name in names:
        namespace[f"_check_{name}"] = _CHECKS[annotations[name]]
        params.append(f"{name}={name}_default" if name in defaults else name)
        if name in defaults:
            namespace[f"{name}_default"] = defaults[name]
    body = "".join(f"    {n} = _check_{n}({n}, {cls.__name__ + '.' + n!r})\n" for n in names)
    source = (f"def __new__(cls, {', '.join(params)}):\n{body}"
              f"    return _tnew(cls, ({''.join(n + ', ' for n in names)}))\n")
    exec(source, namespace)
    namespace["__new__"].__qualname__ = f"{cls.__name__}.__new__"
    attrs = {k: v for k, v in cls.__dict__.items()
             if k not in ("__dict__", "__weakref__", "__annotations__") and k not in defaults}
    attrs.update(
        __slots__=(),
        __new__=namespace["__new__"],
        __reduce_ex__=_message_reduce,
        __repr__=_short_repr,
        __eq__=_message_eq,
        __ne__=_message_ne,
        __hash__=tuple.__hash__,
        __annotations__=annotations,
    )
    return type(cls.__name__, (base,), attrs)


def _message_reduce(self, protocol):
    return (_tuple_new, (type(self), tuple(self)))


def _message_eq(self, other):
    return type(other) is type(self) and tuple.__eq__(self, other)


def _message_ne(self, other):
    return not _message_eq(self, other)


def _short_repr(self) -> str:
    parts = []
    for name, value in zip(self._fields, self):
        text = repr(value)
        if len(text) > 60:
            text = text[:57] + "..."
        parts.append(f"{name}={text}")
    return f"{type(self).__name__}({', '.join(parts)})"


# --------------------------------------------------------------------------- params


@_register_check
@_checked
class ActorCallParams:
    """An actor method call fed with tensors from a stream's ref table."""

    seq: int
    broker_id: tuple[str, int]
    local_state: list[Ref]
    mutates: list[Ref]
    stream: StreamRef


# --------------------------------------------------------------------------- worker messages


@_checked
class BackendNetworkInit:
    """Create the world process group of the controller's ranks (``unique_id``: rendezvous key)."""

    unique_id: str | None = None


@_checked
class BackendNetworkPointToPointInit:
    """Create the point-to-point communicator for ``(from_stream, to_stream)``."""

    from_stream: StreamRef
    to_stream: StreamRef


@_checked
class CallFunction:
    """Call ``function`` on ``stream``, bind its flattened results, poison on failure."""

    seq: int
    results: list[Ref | None]
    mutates: list[Ref]
    function: ResolvableFunction
    args_kwargs: ArgsKwargs
    stream: StreamRef
    remote_process_groups: list[Ref]


@_checked
class CommandGroup:
    """Several messages handled in order; the first fatal error stops the rest."""

    messages: list["WorkerMessage"]


@_checked
class CreateStream:
    id: StreamRef
    stream_creation: StreamCreationMode


@_checked
class CreateDeviceMesh:
    result: Ref
    names: list[str]
    ranks: Slice


@_checked
class CreateRemoteProcessGroup:
    result: Ref
    device_mesh: Ref
    dims: list[str]


@_checked
class BorrowCreate:
    result: Ref
    borrow: int
    tensor: Ref
    from_stream: StreamRef
    to_stream: StreamRef


@_checked
class BorrowFirstUse:
    borrow: int


@_checked
class BorrowLastUse:
    borrow: int


@_checked
class BorrowDrop:
    borrow: int


@_checked
class DeleteRefs:
    refs: list[Ref]


@_checked
class RequestStatus:
    """Answer ``Status(seq + 1)`` once every stream has drained what was sent before."""

    seq: int
    controller: bool = False


@_checked
class Reduce:
    result: Ref
    tensor: Ref
    factory: Factory
    mesh: Ref
    stream: StreamRef
    dims: list[str]
    reduction: Reduction
    scatter: bool
    in_place: bool
    out: Ref | None


@_checked
class SplitComm:
    dims: list[str]
    device_mesh: Ref
    stream: StreamRef


@_checked
class SplitCommForProcessGroup:
    remote_process_group: Ref
    stream: StreamRef


@_checked
class SendTensor:
    result: Ref
    from_ranks: Slice
    to_ranks: Slice
    tensor: Ref
    factory: Factory
    from_stream: StreamRef
    to_stream: StreamRef


@_checked
class SendValue:
    """Compute a value on ``stream`` and send it to the controller (or into a pipe)."""

    seq: int
    destination: Ref | None
    mutates: list[Ref]
    function: ResolvableFunction | None
    args_kwargs: ArgsKwargs
    stream: StreamRef


@_checked
class SendResultOfActorCall:
    seq: int
    broker_id: tuple[str, int]
    local_state: list[Ref]
    mutates: list[Ref]
    stream: StreamRef


@_checked
class CallActorMethod:
    results: list[Ref | None]
    call: ActorCallParams


@_checked
class PipeRecv:
    seq: int
    results: list[Ref | None]
    pipe: Ref
    stream: StreamRef


@_checked
class CreatePipe:
    """Start a producer per rank: ``function(pipe, *args, **kwargs)`` feeding a bounded buffer."""

    result: Ref
    key: str
    function: ResolvableFunction
    max_messages: int
    mesh: Ref
    args_kwargs: ArgsKwargs


@_checked
class Exit:
    """Release everything the controller holds on the rank; ``error`` is raised to it."""

    error: tuple[str | None, str] | None = None


@_checked
class DefineRecording:
    result: Ref
    nresults: int
    nformals: int
    commands: list["WorkerMessage"]
    ntotal_messages: int
    index: int


@_checked
class RecordingFormal:
    result: Ref
    argument_index: int
    stream: StreamRef


@_checked
class RecordingResult:
    result: Ref
    output_index: int
    stream: StreamRef


@_checked
class CallRecording:
    seq: int
    recording: Ref
    results: list[Ref]
    actuals: list[Ref]


@_checked
class SetRefUnitTestsOnly:
    reference: Ref
    value: Any
    stream: StreamRef


@_checked
class GetRefUnitTestsOnly:
    """Read a ref (test hook); the reply goes to :meth:`Controller.get_ref`."""

    value: Ref
    stream: StreamRef


WORKER_MESSAGES: tuple[type, ...] = (
    BackendNetworkInit, BackendNetworkPointToPointInit, CallFunction, CommandGroup, CreateStream,
    CreateDeviceMesh, CreateRemoteProcessGroup, BorrowCreate, BorrowFirstUse, BorrowLastUse,
    BorrowDrop, DeleteRefs, RequestStatus, Reduce, SplitComm, SplitCommForProcessGroup,
    SendTensor, SendValue, SendResultOfActorCall, CallActorMethod, PipeRecv, CreatePipe, Exit,
    DefineRecording, RecordingFormal, RecordingResult, CallRecording, SetRefUnitTestsOnly,
    GetRefUnitTestsOnly,
)
WorkerMessage = Union[WORKER_MESSAGES]  # type: ignore[valid-type]
_MESSAGE_TYPES = WORKER_MESSAGES


# --------------------------------------------------------------------------- to the controller


@_checked
class Status:
    """Rank ``rank`` has completed every seq below ``seq``."""

    seq: int
    rank: int


@_checked
class FetchResult:
    """The value a ``SendValue``/``SendResultOfActorCall`` computed (tensors on CPU)."""

    seq: int
    rank: int
    value: Any


@_checked
class RemoteFunctionFailed:
    """A fresh failure of ``seq`` on ``rank``; ``error`` holds the remote traceback text."""

    seq: int
    rank: int
    error: str


CONTROLLER_MESSAGES: tuple[type, ...] = (Status, FetchResult, RemoteFunctionFailed)


def flatten_groups(commands: Iterable) -> Iterator[WorkerMessage]:
    """The messages of ``commands`` in order, with nested CommandGroups opened."""
    for c in commands:
        if type(c) is CommandGroup:
            yield from flatten_groups(c.messages)
        else:
            yield c
