"""What an op returns, worked out on the client without a round trip (docs/protocol.md §1.3).

Output shapes, strides and dtypes come from running the op on fake tensors;
aliasing (views, in-place ops, ``out=``) comes from the op's schema. Fake
propagation costs hundreds of microseconds, so its result is cached by the
op and the metadata of its inputs (shapes, strides, dtypes, devices, which
inputs share storage, and the non-tensor arguments): a training loop pays it
once per distinct op.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes

from .protocol import messages as m

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from .tensor import Tensor

_SCALARS = frozenset(
    {
        int,
        float,
        bool,
        str,
        type(None),
        complex,
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)
CACHE_SIZE = 8192


_propagating = threading.local()


class _QuietFakeErrors(logging.Filter):
    """An op whose shapes cannot work raises to the user; torch need not also log it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_propagating, "active", False)


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietFakeErrors())


class Uncacheable(Exception):
    """An argument the cache cannot key on: propagate every time."""


@dataclass(frozen=True)
class OpInfo:
    """What an op's schema says: its import path, what it writes, what its outputs alias."""

    function: m.FunctionPath
    names: tuple[str, ...]  # schema argument names, in order
    writes: tuple[int, ...]  # schema argument indexes the op mutates
    returns_alias: tuple[int | None, ...]  # per return: the argument it aliases, if any
    returns_write: tuple[bool, ...]  # per return: True if it is a mutated argument itself
    makes_tensors: bool  # some return is a tensor (else, with no tensor inputs, it runs here)
    seeded: bool = False  # it draws random numbers (torch.Tag.nondeterministic_seeded)
    # the overload to call with a ``generator=`` keyword (itself if it takes one), if any
    with_generator: m.FunctionPath | None = None


# id(op) -> (op, its OpInfo). Keyed by id: an OpOverload hashes in Python (a call per lookup,
# on every op dispatched), and torch keeps every overload it made alive, so ids are not reused.
_op_infos: dict[int, tuple[Any, OpInfo]] = {}


def op_info(func: OpOverload) -> OpInfo:
    entry = _op_infos.get(id(func))
    if entry is None or entry[0] is not func:
        entry = _op_infos[id(func)] = (func, _make_op_info(func))
    return entry[1]


def _make_op_info(func: OpOverload) -> OpInfo:
    schema = func._schema
    namespace, name = schema.name.split("::")
    path = f"torch.ops.{namespace}.{name}.{func._overloadname}"
    names = tuple(a.name for a in schema.arguments)
    sets = {}
    writes = []
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None:
            for s in info.before_set:
                sets[s] = i
            if info.is_write:
                writes.append(i)
    aliases, written = [], []
    for ret in schema.returns:
        info = ret.alias_info
        target = None
        if info is not None:
            target = next((sets[s] for s in info.before_set if s in sets), None)
        aliases.append(target)
        written.append(bool(info is not None and info.is_write and target is not None))
    makes_tensors = any("Tensor" in str(ret.type) for ret in schema.returns)
    seeded = torch.Tag.nondeterministic_seeded in func.tags
    return OpInfo(
        m.FunctionPath(path),
        names,
        tuple(writes),
        tuple(aliases),
        tuple(written),
        makes_tensors,
        seeded,
        _with_generator(func, names) if seeded else None,
    )


def _with_generator(func: OpOverload, names: tuple[str, ...]) -> m.FunctionPath | None:
    """The overload of ``func`` that takes a ``generator`` keyword with the same other
    arguments (``rand.default`` -> ``rand.generator``), for per-stream generators."""
    packet = func.overloadpacket
    ours = tuple(n for n in names if n != "generator")
    for overload in (func._overloadname, *packet.overloads()):
        schema = getattr(packet, overload)._schema
        theirs = tuple(a.name for a in schema.arguments)
        if "generator" in theirs and tuple(n for n in theirs if n != "generator") == ours:
            namespace, name = schema.name.split("::")
            return m.FunctionPath(f"torch.ops.{namespace}.{name}.{overload}")
    return None


# -- output plans ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Output:
    """One returned tensor: its metadata and, if it aliases an argument, which one."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    alias: int | None  # schema argument index it is a view of
    is_arg: bool  # it *is* that argument (in-place / out=): return the caller's handle


@dataclass(frozen=True)
class Plan:
    """What an op returns: ``kind`` is "tensor", "tuple", "list" or "none"."""

    kind: str
    outputs: tuple[Output | None, ...]


_warm = False


def warm_up() -> None:
    """Propagate one op on fake tensors, once per process.

    The first fake op imports torch's lazy stack (sympy, dynamo, ...): some
    800 modules and 120 000 objects. Done before the controller freezes the
    GC (:func:`dask_monarch.config.freeze_gc`), they are frozen with the rest
    of the imports; done later, each full collection walks them (110 ms on
    this machine, one or two per 5 000 ops: up to 40 us per op).
    """
    global _warm
    if not _warm:
        with _disable_current_modes(), FakeTensorMode():  # an active mesh must not see it
            torch.empty(1) + 1
        _warm = True


class Propagator:
    """Cached fake-tensor propagation of ops on mesh tensors (instances of ``tensor_type``)."""

    def __init__(self, tensor_type: type) -> None:
        self._tensor_type = tensor_type  # the mesh tensor class, which this module sits below
        self._cache: dict[tuple, Plan] = {}
        self._mode = FakeTensorMode(allow_non_fake_inputs=False)

    def plan(
        self, func: OpOverload, info: OpInfo, args: tuple, kwargs: dict, handles: list[Tensor]
    ) -> Plan:
        """The outputs of ``func(*args, **kwargs)``; ``handles`` are the mesh tensors in it."""
        try:  # by id of the op's OpInfo: one per op, kept for ever (see _op_infos)
            key = (id(info), _key(args, handles), _key_kwargs(kwargs, handles))
        except Uncacheable:
            return self._propagate(func, info, args, kwargs)
        plan = self._cache.get(key)
        if plan is None:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            plan = self._cache[key] = self._propagate(func, info, args, kwargs)
        return plan

    def _propagate(self, func: OpOverload, info: OpInfo, args: tuple, kwargs: dict) -> Plan:
        _propagating.active = True
        try:
            with _disable_current_modes():  # an active mesh's mode must not see the fakes
                return self._run_fake(func, info, args, kwargs)
        finally:
            _propagating.active = False

    def _run_fake(self, func: OpOverload, info: OpInfo, args: tuple, kwargs: dict) -> Plan:
        mesh_tensor = self._tensor_type
        with self._mode:
            bases: dict[int, torch.Tensor] = {}

            def fake(x: Any) -> Any:
                if isinstance(x, mesh_tensor):
                    return _fake_like(x, bases)
                if isinstance(x, (list, tuple)) and any(isinstance(v, mesh_tensor) for v in x):
                    return type(x)(fake(v) for v in x)
                return x

            result = func(*[fake(a) for a in args], **{k: fake(v) for k, v in kwargs.items()})
        return _plan_of(result, info)


def _extent(mkey: tuple) -> int:
    shape, stride, offset = mkey[:3]
    return offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0


def _fake_like(t: Tensor, bases: dict[int, torch.Tensor]) -> torch.Tensor:
    """A fake tensor with ``t``'s metadata; tensors sharing storage get one fake storage."""
    shape, stride, offset, dtype, device = t._mkey
    key = id(t._storage)
    base = bases.get(key)
    if base is None or base.dtype != dtype or base.numel() < _extent(t._mkey):
        size = max(_extent(h._mkey) for h in t._storage.handles)
        base = bases[key] = torch.empty(size, dtype=dtype, device=device)
    return base.as_strided(shape, stride, offset)


def _plan_of(result: Any, info: OpInfo) -> Plan:
    if result is None:
        return Plan("none", ())
    if isinstance(result, torch.Tensor):
        return Plan("tensor", (_output(result, info, 0),))
    if isinstance(result, (tuple, list)):
        outputs = []
        for i, r in enumerate(result):
            if r is None:
                outputs.append(None)
            elif isinstance(r, torch.Tensor):
                outputs.append(_output(r, info, i if len(info.returns_alias) > 1 else 0))
            else:
                raise ValueError(
                    f"{info.function.path} returns a {type(r).__name__}: a value "
                    "on the ranks, to be fetched with dask_monarch.inspect"
                )
        return Plan("list" if isinstance(result, list) else "tuple", tuple(outputs))
    raise ValueError(
        f"{info.function.path} returns a {type(result).__name__}, which lives on "
        "the ranks: fetch it with dask_monarch.inspect or fetch_shard"
    )


def _output(t: torch.Tensor, info: OpInfo, index: int) -> Output:
    alias = info.returns_alias[index] if index < len(info.returns_alias) else None
    is_arg = info.returns_write[index] if index < len(info.returns_write) else False
    return Output(
        tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device, alias, is_arg
    )


# -- cache keys ------------------------------------------------------------------------------


def _key(args: tuple, handles: list[Tensor]) -> tuple:
    return tuple([_key_of(a, handles) for a in args])


def _key_kwargs(kwargs: dict, handles: list[Tensor]) -> tuple:
    return tuple((k, _key_of(v, handles)) for k, v in kwargs.items()) if kwargs else ()


def _key_of(x: Any, handles: list[Tensor]) -> tuple:
    t = type(x)
    if t in _SCALARS:
        return (t, x)
    mkey = getattr(x, "_mkey", None)
    if mkey is not None:
        storage = x._storage
        for i, h in enumerate(handles):  # which earlier argument shares its storage
            if h._storage is storage:
                return (mkey, i)
        return (mkey, -1)
    if t is list or t is tuple or t is torch.Size:
        return (t, tuple(_key_of(v, handles) for v in x))
    raise Uncacheable(t)
