"""The hot path of a call: resolve the function, resolve arguments, bind results.

Semantics: docs/protocol.md §1.4 (paths), §2.2 (arguments), §2.3 (results).
Functions are cached per path (and per pickled payload); arguments that are
leaves, or lists and tuples of leaves, skip the pytree walk (docs/dask.md §12:
the walk costs several times a small op).
"""

from __future__ import annotations

import importlib
import pickle
import threading
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import cloudpickle
import dask.config
import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from ..protocol.messages import ArgsKwargs, Cloudpickle, FunctionPath, Ref, RefView
from ..protocol.messages.values import IMMUTABLE_LEAVES, dumps_value
from ..protocol.names import RANK_FUNCTION_MARK
from .errors import DependentError, FatalError, RefNotFound, SeqError
from .restricted import RestrictedPickleError
from .restricted import loads as restricted_loads

if TYPE_CHECKING:
    from .lane import Lane

TEST_PANIC = "__test_panic"

_by_path: dict[str, Callable] = {}
_by_pickle: dict[bytes, Callable] = {}
_PICKLE_CACHE_SIZE = 256
# Every lane's thread resolves through these caches: evicting the oldest pickle is two steps
# (find it, pop it), which two lanes must not interleave (both would pop the same key).
_evicting = threading.Lock()


class InvalidRemoteFunction(Exception):
    pass


def resolve_function(function: FunctionPath | Cloudpickle) -> Callable:
    """The callable a message names (fresh user error if it cannot be found or is not allowed)."""
    if type(function) is FunctionPath:
        fn = _by_path.get(function.path)
        if fn is None:
            fn = _by_path[function.path] = _resolve_path(function.path)
        return fn
    fn = _by_pickle.get(function.bytes)
    if fn is None:
        if not pickled_code_allowed():
            raise InvalidRemoteFunction(
                "invalid remote function: pickled functions are disabled by "
                "dask_monarch.functions.allow-pickled"
            )
        fn = cloudpickle.loads(function.bytes)
        with _evicting:
            if len(_by_pickle) >= _PICKLE_CACHE_SIZE:
                _by_pickle.pop(next(iter(_by_pickle)))
            _by_pickle[function.bytes] = fn
    return fn


def pickled_code_allowed() -> bool:
    """``dask_monarch.functions.allow-pickled``: may pickles sent to this worker hold code?"""
    return bool(dask.config.get("dask_monarch.functions.allow-pickled", True))


def load_arguments(payload: bytes) -> tuple[tuple, dict]:
    """A pickled ``(args, kwargs)`` payload; plain data only unless pickled code is allowed."""
    if pickled_code_allowed():
        return pickle.loads(payload)
    try:
        return restricted_loads(payload)
    except RestrictedPickleError as e:
        raise InvalidRemoteFunction(f"invalid remote function arguments: {e}") from None


def check_panic(function: FunctionPath | Cloudpickle | None) -> None:
    """The ``__test_panic`` path is a fatal error, for testing the fatal-error plumbing."""
    if type(function) is FunctionPath and function.path == TEST_PANIC:
        raise FatalError("__test_panic called")


def _resolve_path(path: str) -> Callable:
    allow = dask.config.get("dask_monarch.functions.allow", None)
    if allow is not None and not _allowed(path, allow):
        if path.startswith("dask_monarch."):  # one the user API sends for itself?
            fn = _walk(path)
            if getattr(fn, RANK_FUNCTION_MARK, False):
                return fn
        raise InvalidRemoteFunction(
            f"invalid remote function: {path} is not in the allow-list "
            f"dask_monarch.functions.allow={list(allow)}"
        )
    fn = _walk(path)
    if allow is not None:  # the path may walk out of an allowed module (torch.os.getpid)
        home = _home_module(fn)
        if home is None or not _allowed(home, allow):
            raise InvalidRemoteFunction(
                f"invalid remote function: {path} resolves to {fn!r} from module {home}, "
                f"which is not in the allow-list dask_monarch.functions.allow={list(allow)}; "
                "name the function by its own module's path and allow that module"
            )
    return fn


def _allowed(name: str, allow: list[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in allow)


def _home_module(obj: Any) -> str | None:
    """The module that defines ``obj`` (what the allow-list checks), or None if unknown."""
    module = getattr(obj, "__module__", None)
    if module is None:  # a method descriptor (torch.Tensor.add) or a bound builtin
        owner = getattr(obj, "__objclass__", None) or getattr(obj, "__self__", None)
        if isinstance(owner, type):
            module = owner.__module__
        elif owner is not None:
            module = getattr(owner, "__name__", None) or type(owner).__module__
    if module is None:
        module = type(obj).__module__
    return module if isinstance(module, str) else None


def _walk(path: str) -> Callable:
    if "." not in path:
        raise InvalidRemoteFunction(
            f"invalid remote function: invalid function path {path}: paths must be fully qualified"
        )
    try:
        first, rest = path.split(".", 1)
        if first == "torch":
            obj: Any = torch
            walked = first
            for part in rest.split("."):
                walked += "." + part
                try:
                    obj = getattr(obj, part)
                except AttributeError:  # a submodule torch does not import by itself
                    if not isinstance(obj, types.ModuleType):
                        raise
                    obj = importlib.import_module(walked)
            # OpOverload.__call__ only forwards to its C++ callable: calling that directly
            # saves a Python frame per op (about 1 us of the 8 an add of 100x100 costs)
            return obj._op if type(obj) is torch._ops.OpOverload else obj
        module_name, name = path.rsplit(".", 1)
        obj = getattr(importlib.import_module(module_name), name)
        return getattr(obj, "_remote_impl", obj)
    except Exception as e:
        if path.startswith("torch.ops.") and path.count(".") >= 3:
            namespace, op = path.split(".")[2:4]
            raise InvalidRemoteFunction(
                f"invalid remote function: the op {namespace}::{op} is not registered on this "
                "worker (a torch.library op defined in __main__, a notebook or a module the "
                "workers cannot import): import the module that defines it on every worker "
                "(client.run(importlib.import_module, 'module'), or a worker --preload)"
            ) from e
        raise InvalidRemoteFunction(
            f"invalid remote function: failed to resolve function {path}: {type(e).__name__}: {e}"
        ) from e


def resolve_args(
    lane: Lane, args_kwargs: ArgsKwargs, groups: dict[int, Any] | None = None
) -> tuple[tuple, dict]:
    """Arguments with every Ref replaced: mesh, then listed process group, then stream value.

    Arguments whose containers are lists or tuples of plain leaves (a shape,
    a list of dims, a list of tensors to ``cat``) skip the pytree walk too:
    a quarter of a training step's calls look like ``view(x, [16, 32])``.
    """
    args, kwargs, payload, flat = args_kwargs  # a plain tuple underneath: no property calls
    value_of = lane.value_of
    if payload is not None:
        args, kwargs = load_arguments(payload)
    elif groups is None:
        if flat:
            args = tuple([value_of(int(a)) if type(a) is Ref else a for a in args])
            if kwargs:
                kwargs = {k: value_of(int(v)) if type(v) is Ref else v for k, v in kwargs.items()}
            return args, kwargs
        shallow = _shallow_args(args, kwargs, value_of)
        if shallow is not None:
            return shallow
    leaves, spec = tree_flatten((args, kwargs))
    for i, leaf in enumerate(leaves):
        if type(leaf) is Ref:
            if groups is not None and leaf.id in groups:
                leaves[i] = groups[leaf.id]
            else:
                leaves[i] = value_of(leaf.id)
        elif type(leaf) is RefView:
            leaves[i] = resolve_view(leaf, value_of)
    return tree_unflatten(leaves, spec)


def resolve_view(view: RefView, value_of: Callable[[int], Any]) -> Any:
    """The value a :class:`RefView` names: its op applied to its base, here and now (a
    view costs the op itself, ~1-2 us, where a message of its own cost the rank ~10)."""
    base, function, args, kwargs = view
    base = value_of(int(base)) if type(base) is Ref else resolve_view(base, value_of)
    return resolve_function(function)(base, *args, **kwargs)


# Types torch's pytree treats as leaves that messages carry in their arguments: the protocol's
# immutable leaves but torch.Size (a tuple to the pytree).
_LEAVES = frozenset(IMMUTABLE_LEAVES) - {torch.Size}
_CONSTANT_LEAVES = _LEAVES - {Ref, RefView}


def constant(value: Any) -> bool:
    """Whether ``value`` names no ref and nothing in it can change: an immutable leaf, or a
    tuple of such values at any depth (``bucket_views``' layout of 28 ``(shape, stride,
    offset)``). One copy serves every call and replay as is, with no walk to resolve it."""
    t = type(value)
    if t is tuple:
        for v in value:
            if not constant(v):
                return False
        return True
    return t in _CONSTANT_LEAVES


def _shallow_args(
    args: tuple, kwargs: dict, value_of: Callable[[int], Any]
) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` resolved without the pytree walk, or None if a container holds
    more than leaves: each argument is a leaf, a :func:`constant` tuple, or a list or tuple
    of leaves and constant tuples.

    The same result as the walk, in the same order (so the same first error):
    containers are rebuilt (a function may change its list), Refs replaced.
    """
    out = []
    for a in (*args, *kwargs.values()):
        t = type(a)
        if t is Ref:
            a = value_of(int(a))
        elif t is RefView:
            a = resolve_view(a, value_of)
        elif t is list or t is tuple:
            if t is tuple and constant(a):
                out.append(a)
                continue
            items = []
            for x in a:
                tx = type(x)
                if tx is Ref:
                    x = value_of(int(x))
                elif tx is RefView:
                    x = resolve_view(x, value_of)
                elif tx not in _LEAVES and not (tx is tuple and constant(x)):
                    return None
                items.append(x)
            a = items if t is list else tuple(items)
        elif t not in _LEAVES:
            return None
        out.append(a)
    n = len(args)
    return tuple(out[:n]), dict(zip(kwargs, out[n:])) if kwargs else {}


def bind_results(env: dict, results: list[Ref | None], value: Any) -> None:
    """Bind the flattened ``value`` to ``results`` (None is a leaf; counts must agree)."""
    if len(results) == 1 and not isinstance(value, (list, tuple, dict)):  # one call in most
        ref = results[0]
        if ref is not None:
            _bind(env, int(ref), value)
        return
    t = type(value)
    if (t is tuple or t is list) and all(type(v) is torch.Tensor or v is None for v in value):
        leaves = value  # an operator's several results: the pytree walk would find them so
    else:
        leaves = tree_leaves(value)
    if len(leaves) != len(results):
        raise ValueError(
            f"unexpected number of returns from op, expected {len(results)}, got {len(leaves)}"
        )
    for ref, leaf in zip(results, leaves):
        if ref is not None:
            _bind(env, ref.id, leaf)


def _bind(env: dict, ref_id: int, value: Any) -> None:
    if ref_id in env:
        raise FatalError(f"Duplicate write to reference r{ref_id}")
    env[ref_id] = value


def poison(env: dict, results: list[Ref | None], mutates: list[Ref], error: SeqError) -> None:
    """Results and mutated inputs of a failed call all hold the same root error."""
    for ref in results:
        if ref is not None:
            env[ref.id] = error
    for ref in mutates:
        env[ref.id] = error


def lookup(env: dict, ref_id: int) -> Any:
    """A stream value for a call: RefNotFound if absent, DependentError if poisoned."""
    try:
        value = env[ref_id]
    except KeyError:
        raise RefNotFound(ref_id) from None
    if type(value) is SeqError:
        raise DependentError(value)
    return value


def to_cpu(value: Any) -> Any:
    """A copy-free view of ``value`` with every tensor on the CPU and detached."""

    def move(x):
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if x._is_zerotensor():  # autograd's lazy zeros (a gradient): not picklable
                return torch.zeros(x.shape, dtype=x.dtype)
            return x if x.device.type == "cpu" else x.cpu()
        return x

    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, (list, tuple, dict)):
        from torch.utils._pytree import tree_map

        return tree_map(move, value)
    return value


def pickle_value(value: Any) -> bytes:
    """A snapshot of a fetched value (tensors on CPU), taken on the lane when it is computed."""
    value = to_cpu(value)
    try:
        return dumps_value(value)
    except Exception:
        return dumps_value(value, cloud=True)
