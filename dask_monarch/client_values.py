"""Values the client knows: small tensors it made, mirrored so that Python reads them for free.

``torch.tensor(0.0)`` under ``mesh.activate()`` (an optimizer's step count), a
small factory such as ``torch.zeros(3)``, and what bit-exact ops (copies,
views, indexing, comparisons, ``+ - * /``, min and max, integer arithmetic,
and their ``_foreach_`` forms over lists: ``OpInfo.exact``) make of them hold
values the client can compute itself,
identical to the ranks'. The client keeps a local CPU copy of each
(``Tensor._known``), computed alongside the message that makes it on the
ranks, so ``step.item()`` or ``bool((mask == causal).all())`` needs no round
trip. Any other op, a value the ranks change on their own (a collective, a
remote function, a replayed recording: ``StorageInfo.forget_known``), or more
than :data:`MAX_ELEMENTS` elements leaves the value unknown to the client, and
Python asking for it is an implicit fetch (:mod:`.implicit_fetch`).
DESIGN decision 16; docs/user_guide.md, "Bringing existing model code".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from .propagation import OpInfo, Plan

MAX_ELEMENTS = 4096  # the client mirrors outputs of at most this many elements in all
ALL_KNOWN = 1  # every input's value is known: the client runs the op on its copies
VALUE_FREE = 2  # the op reads no input value (zeros_like, fill_): the client runs it on stand-ins
_CPU = torch.device("cpu")
_no_python_dispatch = torch._C._DisableTorchDispatch
_SCALE = frozenset({"add", "sub", "rsub"})  # exact only without a scale (alpha) that may be fused
_UNINITIALIZED = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resize",
        "resize_as",
    }
)


def kind(info: OpInfo, args: tuple, kwargs: dict, handles: list, plan: Plan) -> int:
    """Whether (and how) the client can know the values ``info``'s op makes: 0 when not."""
    if not info.value_free:  # the common answer first: an input whose value is unknown
        for h in handles:
            if h._known is None:
                return 0
    if info.seeded or not (info.exact or info.value_free or _integral(info, handles, plan)):
        return 0
    if info.exact and (kwargs or len(args) > 2) and not _exact_here(info, args, kwargs):
        return 0
    if sum(math.prod(o.meta.shape) for o in plan.outputs if o is not None) > MAX_ELEMENTS:
        return 0
    for h in handles:
        if h._known is None:
            return VALUE_FREE if info.value_free else 0
    return ALL_KNOWN


def _exact_here(info: OpInfo, args: tuple, kwargs: dict) -> bool:
    """Whether an exact op is exact with these arguments: no scale that a device may fuse
    (``add(x, y, alpha=2)``), and an ``index_put`` that writes through masks and does not
    sum (``x[mask] = v``; integer indices may repeat, and which write wins then differs by
    device)."""
    base = _base(info)
    if base in _SCALE:
        return kwargs.get("alpha", 1) == 1
    if base == "index_put":
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        masks = all(i is None or i.dtype == torch.bool for i in args[1])
        return not accumulate and masks
    return True


def _base(info: OpInfo) -> str:
    """An ATen op's name without its in-place and ``_foreach_`` marks ("" for another op)."""
    parts = info.function.path.split(".")
    if len(parts) < 5 or parts[:3] != ["torch", "ops", "aten"]:
        return ""
    return parts[3].rstrip("_").removeprefix("_foreach_")


def _integral(info: OpInfo, handles: list, plan: Plan) -> bool:
    """Integer and boolean arithmetic is exact everywhere: an op with only such inputs and
    outputs (and at least one tensor input) may be mirrored whatever it is, but for one whose
    output is uninitialized memory (``empty_like``, a growing ``resize_``)."""
    if not handles or _base(info) in _UNINITIALIZED:
        return False
    for h in handles:
        if h.dtype.is_floating_point or h.dtype.is_complex:
            return False
    for o in plan.outputs:
        if o is not None and (o.meta.dtype.is_floating_point or o.meta.dtype.is_complex):
            return False
    return True


def run(func: OpOverload, args: tuple, kwargs: dict, stand_ins: bool = False) -> Any:
    """``func`` run locally on the client's copies of its mesh tensors (or, ``stand_ins``, on
    fresh local tensors of their metadata): what the ranks compute, as local tensors."""
    local_kwargs = {k: _local(v, stand_ins) for k, v in kwargs.items()} if kwargs else {}
    if "device" in local_kwargs:
        local_kwargs["device"] = _CPU
    local_args = [_local(a, stand_ins) for a in args]
    with _no_python_dispatch():  # an active mesh must not see the local copies (1 us, where
        return func(*local_args, **local_kwargs)  # popping the mode stack takes 8)


def _local(x: Any, stand_ins: bool) -> Any:
    """``x`` as :func:`run` passes it to the op (a module-level function: a nested one that
    calls itself is a reference cycle, garbage for the collector on every op). A mesh tensor
    whose value the client no longer knows, where its value is read, is an error: the op
    is not mirrored (an empty stand-in made garbage the client then took for the value)."""
    known = getattr(x, "_known", None)
    if known is not None and not stand_ins:
        return known
    if known is not None or hasattr(x, "_known"):
        if not stand_ins:
            raise LookupError(f"the client no longer knows the value of {x._describe()}")
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
    if type(x) is list or type(x) is tuple:
        return type(x)(_local(v, stand_ins) for v in x)
    if isinstance(x, torch.device):
        return _CPU
    return x


def mirror(func: OpOverload, args: tuple, kwargs: dict, outputs: list, how: int) -> None:
    """Give ``outputs`` (the op's result handles, in its return order; arguments it
    changed in place among them) the values the ranks compute for them."""
    try:
        result = run(func, args, kwargs, stand_ins=how == VALUE_FREE)
    except Exception:  # the ranks will say what is wrong; the client just does not know
        result = None
        for a in (*args, *kwargs.values()):  # an in-place op may have run partway
            for h in a if type(a) is list or type(a) is tuple else (a,):
                if getattr(h, "_known", None) is not None:
                    h._storage.forget_known()
    values = result if isinstance(result, (list, tuple)) else [result]
    for handle, value in zip(outputs, values):
        if handle is None:
            continue
        if (
            isinstance(value, torch.Tensor)
            and value.shape == handle.shape
            and value.dtype == handle.dtype
        ):
            if handle._known is not value:
                handle._storage.learn(handle, value)
        elif handle._known is not None:
            handle._storage.forget_known()
