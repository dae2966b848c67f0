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
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import _disable_current_modes

from .protocol import messages as m

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from .borrows import StorageInfo
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


# Ops whose fake (meta) kernel refuses inputs their CPU kernel takes: ``_grouped_mm``'s accepts
# only bfloat16 (a CUDA rule; transformers' MoE layers call it in float32 on the CPU). Their
# plans are learned from the ranks instead, once per input metadata (tensor.dispatch).
FAKE_STRICTER = frozenset({torch.ops.aten._grouped_mm.default})


def _one_dim_unreduced(args: tuple, kwargs: dict) -> bool:
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    return args[0].dim() == 1 and reduction == 0


# Ops whose fake kernel says other metadata than their CPU kernel for some inputs (torch's bugs;
# a predicate of the arguments says which): their plans are learned from the ranks as
# FAKE_STRICTER's are. multilabel_margin_loss's decomposition keeps a dim of size 1 for a 1-D
# input unreduced, where the CPU kernel returns a 0-d loss (nn.MultiLabelMarginLoss, ModuleInfo).
FAKE_DIFFERS = {torch.ops.aten.multilabel_margin_loss_forward.default: _one_dim_unreduced}


class FakeDiffers(Exception):
    """The fake kernel's answer for these arguments is known to be wrong: ask the ranks."""


Value = Callable[[Any], "torch.Tensor | None"]  # the client's copy of a tensor's value, or None
RunFake = Callable[[Any, tuple, dict], Any]  # Propagator.run_fake


def _ctc_loss_outputs(args: tuple, value: Value, run_fake: RunFake) -> Plan | None:
    """``_ctc_loss``'s outputs: the loss per sample, and ``log_alpha`` [batch, time,
    2 * max(target_lengths) + 1], as torch's CPU and CUDA kernels make them; None unless the
    client knows the target lengths (it does when they came as a list, or as a tensor it made)."""
    log_probs, lengths = args[0], value(args[3])
    if lengths is None:
        return None
    time, batch = log_probs.shape[:2]
    width = 2 * int(lengths.max()) + 1 if lengths.numel() else 1
    loss = TensorMeta((batch,), (1,), 0, log_probs.dtype, log_probs.device)
    alpha = loss._replace(shape=(batch, time, width), stride=(time * width, width, 1))
    return Plan("tuple", (Output(loss, None, False), Output(alpha, None, False)))


def _index_outputs(args: tuple, value: Value, run_fake: RunFake) -> Plan | None:
    """``x[mask]`` (``aten.index``): each boolean index the client knows stands for the
    integer indices of its true elements, which the fake kernel plans with; None unless it
    knows one (an integer index needs no value). ``prune.global_unstructured`` and masks
    made with ``torch.ones`` index this way."""
    indices, masks = [], False
    for index in args[1]:
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            known = value(index)
            if known is None:
                return None
            indices += known.nonzero().unbind(1)  # a k-dim mask: k integer indices
            masks = True
        else:
            indices.append(index)
    if not masks:
        return None
    index = torch.ops.aten.index.Tensor
    return plan_of(run_fake(index, (args[0], indices), {}), op_info(index))


def _masked_select_outputs(args: tuple, value: Value, run_fake: RunFake) -> Plan | None:
    """``masked_select``: as many elements as the mask, broadcast, holds true ones."""
    source, mask = args[0], value(args[1])
    if mask is None:
        return None
    count = int(mask.expand(torch.broadcast_shapes(source.shape, mask.shape)).sum())
    meta = TensorMeta((count,), (1,), 0, source.dtype, source.device)
    return Plan("tensor", (Output(meta, None, False),))


# Ops whose outputs' shapes depend on the values of inputs that the client usually knows (a
# data-dependent op for fake tensors): op -> planner(args, value, run_fake), ``value(t)`` the
# client's copy of ``t``'s value or None; the planner returns None when it does not know
# enough, and the shapes are fetched from the ranks. nn.CTCLoss sizes ``log_alpha`` by the
# longest target; a mask picks as many elements as it holds true ones.
PLANNED_BY_VALUES: dict[Any, Callable[[tuple, Value, RunFake], Plan | None]] = {
    torch.ops.aten._ctc_loss.Tensor: _ctc_loss_outputs,
    torch.ops.aten.index.Tensor: _index_outputs,
    torch.ops.aten.masked_select.default: _masked_select_outputs,
}


# An op whose outputs' shapes depend on the values of its inputs (nonzero, unique, x[mask]), or
# that needs an input's value to run at all: fake tensors cannot say what it returns.
DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)

CONJ, NEG = 1, 2  # TensorMeta.bits: torch's lazy conjugate and negative views


class TensorMeta(NamedTuple):
    """What the client knows of a tensor on the ranks: everything but its value.

    The same tuple is a handle's metadata, a plan's output and a propagation
    cache key, so a handle always says what the op that made it says.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    bits: int = 0  # CONJ | NEG


def meta_of(t: torch.Tensor) -> TensorMeta:
    """The metadata of a real or fake tensor."""
    bits = (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)
    return TensorMeta(
        tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device, bits
    )


def describe(*tensors: torch.Tensor) -> list[TensorMeta]:
    """On a rank: the metadata of what an op whose output shapes depend on data returned
    (the client fetches it from every rank: tensor.dispatch)."""
    return [meta_of(t) for t in tensors]


def set_bits(t: torch.Tensor, bits: int) -> None:
    """Give ``t`` the conjugate and negative bits ``bits`` names (both start unset)."""
    if bits & CONJ:
        torch._C._set_conj(t, True)
    if bits & NEG:
        torch._C._set_neg(t, True)


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
    exact: bool = False  # its results are bit-identical on every device (client_values)
    value_free: bool = False  # its results depend on no input's value (zeros_like, fill_)
    answers: bool = False  # it returns Python values only (item, equal, allclose)
    view: bool = False  # its one output is a view of its first argument, and it writes nothing
    # its outputs' metadata depends on a float argument's type, never on its value: a
    # pointwise op or a ``_foreach_`` one (a learning rate, a bias correction that changes
    # every step keys one plan, not one per value)
    float_free: bool = False


# id(op) -> (op, its OpInfo). Keyed by id: an OpOverload hashes in Python (a call per lookup,
# on every op dispatched), and torch keeps every overload it made alive, so ids are not reused.
_op_infos: dict[int, tuple[Any, OpInfo]] = {}


# Ops that write into arguments their schema does not mark (``Tensor(a!)``): argument
# positions by op. Batch norm in training updates its running statistics in place; unmarked,
# the client kept a stale copy of their values (``bn.running_mean.tolist()``: zeros) and
# ordered nothing after the write.
UNDECLARED_WRITES = {
    name: (3, 4)
    for name in ("aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm")
}


def op_info(func: OpOverload) -> OpInfo:
    entry = _op_infos.get(id(func))
    if entry is None or entry[0] is not func:
        entry = _op_infos[id(func)] = (func, _make_op_info(func))
    return entry[1]


def _make_op_info(func: OpOverload) -> OpInfo:
    schema = func._schema
    namespace, name = schema.name.split("::")
    path = (
        _custom_op_path(schema.name, func) or f"torch.ops.{namespace}.{name}.{func._overloadname}"
    )
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
    writes += UNDECLARED_WRITES.get(schema.name, ())
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
    base = name.split(".")[0]
    base = base[:-1] if base.endswith("_") and not base.endswith("__") else base
    return OpInfo(
        m.FunctionPath(path),
        names,
        tuple(writes),
        tuple(aliases),
        tuple(written),
        makes_tensors,
        seeded,
        _with_generator(func, names) if seeded else None,
        namespace == "aten" and base.removeprefix("_foreach_") in _EXACT,
        namespace == "aten" and (base, func._overloadname) in _VALUE_FREE,
        bool(schema.returns) and not makes_tensors,
        namespace == "aten"
        and aliases == [0]
        and not writes
        and not seeded
        and str(schema.returns[0].type) == "Tensor",
        namespace == "aten" and (torch.Tag.pointwise in func.tags or base.startswith("_foreach_")),
    )


# Ops whose results are bit-identical wherever they run (copies, views, indexing, comparisons,
# correctly rounded IEEE arithmetic, min and max): the client may compute them itself from
# values it knows (client_values). Reductions and transcendental functions are not here: their
# results depend on the device's summation order and math library. Their ``_foreach_`` forms
# (the same op on each tensor of a list) are exact too: an optimizer's ``_foreach_add_`` of
# its step counts, which it then reads with ``.item()``.
_EXACT = frozenset(
    """
    alias view _unsafe_view reshape _reshape_alias as_strided expand expand_as permute t
    transpose swapaxes swapdims squeeze unsqueeze select slice narrow unfold diagonal split
    split_with_sizes unsafe_split chunk unbind view_as flatten unflatten movedim detach
    lift_fresh lift_fresh_copy lift clone contiguous _to_copy to copy resolve_conj resolve_neg
    index index_select gather take masked_fill where cat stack flip roll repeat tile triu tril
    diag diag_embed fill zero zeros ones full scalar_tensor arange eye zeros_like ones_like
    full_like new_zeros new_ones new_full add sub rsub mul div neg abs floor ceil round trunc
    frac sign sgn remainder fmod floor_divide clamp clamp_min clamp_max minimum maximum fmin
    fmax eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and
    bitwise_or bitwise_xor bitwise_not isnan isinf isfinite isposinf isneginf signbit any all
    max min amax amin argmax argmin aminmax nonzero argwhere masked_select isin count_nonzero
    index_put constant_pad_nd
    """.split()
)
# (op, overload) pairs whose results do not depend on any input's value, only on its metadata
_VALUE_FREE = frozenset(
    {
        ("zeros_like", "default"),
        ("ones_like", "default"),
        ("full_like", "default"),
        ("new_zeros", "default"),
        ("new_ones", "default"),
        ("new_full", "default"),
        ("fill", "Scalar"),
        ("zero", "default"),
    }
)


def _custom_op_path(qualname: str, func: OpOverload) -> str | None:
    """The import path of the Python function that defines ``func`` (a ``torch.library``
    custom op, ``torch_nn::...`` say): a rank that never imported its module finds it there,
    where ``torch.ops.<namespace>`` would not know it yet."""
    if func._overloadname != "default" or qualname.startswith("aten::"):
        return None
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # another torch: the torch.ops path
        return None
    opdef = OPDEFS.get(qualname)
    fn = getattr(opdef, "_init_fn", None)
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is None or getattr(module, getattr(fn, "__name__", ""), None) is not opdef:
        return None
    return f"{fn.__module__}.{fn.__name__}"


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

    meta: TensorMeta
    alias: int | None  # schema argument index it is a view of
    is_arg: bool  # it *is* that argument (in-place / out=): return the caller's handle


@dataclass(frozen=True)
class Plan:
    """What an op returns: ``kind`` is "tensor", "tuple", "list" or "none"."""

    kind: str
    outputs: tuple[Output | None, ...]
    cuda: bool = False  # an output is a CUDA tensor: a mesh with CPU ranks refuses the op
    fresh: bool = False  # one tensor, a new value: no view, no argument returned
    promote: torch.dtype | None = None  # the client's default dtype decided it (_promoting)

    def __post_init__(self) -> None:
        cuda = any(o is not None and o.meta[4].type == "cuda" for o in self.outputs)
        object.__setattr__(self, "cuda", cuda)
        only = self.outputs[0] if self.kind == "tensor" else None
        object.__setattr__(self, "fresh", only is not None and only.alias is None)


_warm = False
_default_dtype = torch.get_default_dtype


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


_COMPLEX_OF = {torch.float64: torch.complex128, torch.float16: torch.complex32}


def _promoting(func: OpOverload, args: tuple, kwargs: dict, plan: Plan) -> torch.dtype | None:
    """The client's default dtype when it, not an input, decides a pointwise op's result: its
    tensor inputs integers or booleans, its result floating (``int_tensor / 2``,
    ``int_tensor * 1.5``, ``torch.sqrt(int_tensor)``) while ``torch.set_default_dtype`` says
    other than float32. The ranks keep torch's default (one worker serves several meshes, and
    the default is the process's), so the call sends those inputs cast to it: what torch's
    pointwise kernels compute in, the same values (tensor.dispatch)."""
    default = _default_dtype()
    if default is torch.float32 or plan.kind != "tensor" or not plan.fresh:
        return None
    made = plan.outputs[0].meta.dtype  # the default, or its complex one (int_tensor * 1j)
    if made is not default and made is not _COMPLEX_OF.get(default):
        return None
    if torch.Tag.pointwise not in func.tags:
        return None
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors or any(t.is_floating_point() or t.is_complex() for t in tensors):
        return None
    return default


class Propagator:
    """Cached fake-tensor propagation of ops on mesh tensors (instances of ``tensor_type``)."""

    def __init__(self, tensor_type: type) -> None:
        self._tensor_type = tensor_type  # the mesh tensor class, which this module sits below
        self._cache: dict[tuple, Plan] = {}
        self._dtype = _default_dtype()  # what the cached plans assumed (factories, promotions)
        self._modes = threading.local()  # a fake mode per thread: torch's is not thread-safe

    def plan(
        self, func: OpOverload, info: OpInfo, args: tuple, kwargs: dict, handles: list[Tensor]
    ) -> Plan:
        """The outputs of ``func(*args, **kwargs)``; ``handles`` are the mesh tensors in it."""
        try:  # by id of the op's OpInfo: one per op, kept for ever (see _op_infos)
            key = _key(info, args, kwargs, handles)
        except Uncacheable:
            return self._propagate(func, info, args, kwargs)
        if _default_dtype() is not self._dtype:
            self._renew()
        plan = self._cache.get(key)
        if plan is None:
            if len(self._cache) >= CACHE_SIZE:
                self._cache.clear()
            plan = self._cache[key] = self._propagate(func, info, args, kwargs)
        return plan

    def cached(self, info: OpInfo, args: tuple, handles: list[Tensor]) -> Plan | None:
        """The plan :meth:`plan` made for these positional ``args`` before, or None (no
        propagation: the fast path of Python operators, which then takes the general one)."""
        if _default_dtype() is not self._dtype:
            return None
        return self._cache.get(_key(info, args, {}, handles))

    def learn(
        self, info: OpInfo, args: tuple, kwargs: dict, handles: list[Tensor], outputs: list
    ) -> None:
        """Keep the plan of an op the ranks ran (``outputs``: the handles it made, with the
        metadata the ranks reported), for the next call with inputs of the same metadata."""
        key = _key(info, args, kwargs, handles)
        kind = "tensor" if len(outputs) == 1 else "tuple"
        self._cache[key] = Plan(
            kind,
            tuple(
                Output(out._mkey, info.returns_alias[i], info.returns_write[i])
                for i, out in enumerate(outputs)
            ),
        )

    def _renew(self) -> None:
        """``torch.set_default_dtype`` changed what factories and promotions of Python numbers
        make: the plans made before say the old dtype."""
        self._cache.clear()
        self._dtype = _default_dtype()

    def _propagate(self, func: OpOverload, info: OpInfo, args: tuple, kwargs: dict) -> Plan:
        if info.makes_tensors and func._schema.name.startswith("aten::_nested"):
            raise NotImplementedError(_nested_text(func))
        if kwargs.get("dtype") in _QUANTIZED or _quantizes(func._schema.name):
            raise NotImplementedError(_quantized_text(func))
        differs = FAKE_DIFFERS.get(func)
        if differs is not None and differs(args, kwargs):
            raise FakeDiffers(func)
        plan = plan_of(self.run_fake(func, args, kwargs), info)
        if func.is_view:
            plan = _view_layout_as_kernels_make_it(func, args, kwargs, plan)
        elif _POINTWISE in func.tags and any(
            getattr(a, "dtype", None) in _REDUCED_FLOATS for a in (*args, *kwargs.values())
        ):
            try:
                upcast = plan_of(self.run_fake(func, args, kwargs, upcast=True), info)
            except Exception:  # an op that takes no float32 where it took bfloat16
                upcast = plan
            if upcast.kind == plan.kind:
                plan = _with_layout_of(plan, [o.meta if o else None for o in upcast.outputs])
        promote = _promoting(func, args, kwargs, plan)
        return plan if promote is None else replace(plan, promote=promote)

    def run_fake(self, func: OpOverload, args: tuple, kwargs: dict, upcast: bool = False) -> Any:
        """What ``func`` returns run on fake tensors with the mesh tensors' metadata (raises
        one of DATA_DEPENDENT when that needs their values); ``upcast``: bfloat16 and float16
        tensors as float32 ones of the same layout."""
        _propagating.active = True
        try:
            with _disable_current_modes():  # an active mesh's mode must not see the fakes
                return self._run_fake(func, args, kwargs, upcast)
        finally:
            _propagating.active = False

    def _run_fake(self, func: OpOverload, args: tuple, kwargs: dict, upcast: bool) -> Any:
        mesh_tensor = self._tensor_type
        mode = getattr(self._modes, "mode", None)
        if mode is None:
            mode = self._modes.mode = FakeTensorMode(allow_non_fake_inputs=False)
        bases: dict[int, torch.Tensor] = {}

        def fake(x: Any) -> Any:
            if isinstance(x, mesh_tensor):
                if upcast and x.dtype in _REDUCED_FLOATS:
                    return _fake_like(x, bases, mode, torch.float32)
                return _fake_like(x, bases, mode)
            if type(x) is torch.Tensor:  # a value of the client's (PLANNED_BY_VALUES)
                return mode.from_tensor(x)
            if isinstance(x, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in x):
                return type(x)(fake(v) for v in x)
            return x

        fake_args = [fake(a) for a in args]  # outside the mode: their meta tensors are real
        fake_kwargs = {k: fake(v) for k, v in kwargs.items()}
        with mode:
            return func(*fake_args, **fake_kwargs)


def _view_layout_as_kernels_make_it(
    func: OpOverload, args: tuple, kwargs: dict, plan: Plan
) -> Plan:
    """``plan`` with the strides and offsets the view kernels give, from a run on meta tensors.

    torch's fake ``view`` gives a dimension of size 1 another stride than its CPU, CUDA and
    meta kernels do (a ``(1, 64, 16)`` tensor transposed and viewed as ``(1, 16, 8, 8)``:
    1024 where they give 16). Such a stride addresses nothing, but ops decide by it:
    ``group_norm`` takes the fake's for channels-last and copies nothing, and the rank's
    kernel then refuses its input (diffusers' attention blocks at batch size 1).
    """
    try:
        with _disable_current_modes():
            made = func(*[_as_meta(a) for a in args], **{k: _as_meta(v) for k, v in kwargs.items()})
    except Exception:  # no meta kernel, or a value it needs: the fake's word stands
        return plan
    made = made if isinstance(made, (list, tuple)) else (made,)
    return _with_layout_of(
        plan, [meta_of(t) if isinstance(t, torch.Tensor) else None for t in made]
    )


_POINTWISE = torch.Tag.pointwise
_REDUCED_FLOATS = frozenset({torch.bfloat16, torch.float16})


def _with_layout_of(plan: Plan, layouts: list[TensorMeta | None]) -> Plan:
    """``plan`` with the strides and offsets of ``layouts`` (one per output, None to keep it):
    a view's from its kernel run on meta tensors, a reduced-precision pointwise op's from
    the same op planned in float32. Where they disagree in length or shape, the plan stands.

    torch's fake pointwise kernels in reduced precision compute in float32 and convert back,
    and the conversion makes a contiguous tensor: a fully expanded input times a
    channels-last one (the gradient of ``.pow(2).sum()`` in a bfloat16 CNN's backward) is
    contiguous on the client and channels-last on the ranks, whose kernels lay it out as
    in float32. A later ``view`` then failed on the ranks, and ``as_strided`` read the wrong
    elements, silently.
    """
    if len(layouts) != len(plan.outputs):
        return plan
    outputs = []
    for out, layout in zip(plan.outputs, layouts):
        if out is not None and layout is not None and layout.shape == out.meta.shape:
            meta = out.meta._replace(stride=layout.stride, offset=layout.offset)
            out = replace(out, meta=meta)
        outputs.append(out)
    return replace(plan, outputs=tuple(outputs))


def _as_meta(x: Any) -> Any:
    """A mesh tensor as a meta tensor of its metadata (a view of a storage that spans it)."""
    mkey = getattr(x, "_mkey", None)
    if mkey is None:
        if isinstance(x, torch.Tensor):
            raise TypeError("a local tensor: no meta run")
        if isinstance(x, (list, tuple)):
            return type(x)(_as_meta(v) for v in x)
        return x
    shape, stride, offset, dtype = mkey[:4]
    base = torch.empty(extent(mkey), dtype=dtype, device="meta")
    return base.as_strided(shape, stride, offset)


def _nested_text(func: OpOverload) -> str:
    """Why an op that makes a nested tensor is refused, and how code gets around it (torch's
    own error there is an internal one: "NestedTensorImpl doesn't support sizes")."""
    return (
        f"{func} makes a nested tensor, which a mesh tensor cannot be (mesh tensors are dense, "
        "strided). nn.TransformerEncoder makes one in eval mode given a src_key_padding_mask "
        "(its fast path packs the unpadded rows): build it with enable_nested_tensor=False "
        "(or set encoder.use_nested_tensor = False); its padded positions then hold "
        "computed values rather than zeros, as in training mode"
    )


_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})


def _quantizes(name: str) -> bool:
    """Whether an op makes or takes quantized tensors (``quantize_per_tensor``, ``dequantize``,
    ``quantized_max_pool2d``); the fake quantization of QAT is float to float, and runs."""
    return "quantize" in name and "fake_quant" not in name


def _quantized_text(func: OpOverload) -> str:
    """Why an op of quantized tensors is refused (torch's own error is its dispatcher's list
    of backends, as fake tensors have no quantized kernels)."""
    return (
        f"{func} makes or takes a quantized tensor (torch.ao.quantization), which a mesh "
        "tensor cannot be: quantize and run the model locally (under "
        "dask_monarch.no_mesh.activate(), on dask_monarch.inspect of its input), or keep it "
        "in float and use torch.autocast on the mesh"
    )


def _layout_text(op: str, layout: torch.layout) -> str:
    """Why an op that makes a sparse (or other non-strided) tensor is refused, before the
    ranks fail on it, and what code does instead."""
    return (
        f"{op} makes a {layout} tensor, which a mesh tensor cannot be (mesh tensors are "
        "dense, torch.strided). nn.Embedding and nn.EmbeddingBag with sparse=True make sparse "
        "gradients: build them with sparse=False on a mesh (the gradient is then dense, and "
        "optimizers other than SparseAdam take it); for a value of your own, keep it dense"
    )


def extent(meta: TensorMeta) -> int:
    """The number of elements of storage a tensor of ``meta`` spans (from element 0)."""
    shape, stride, offset = meta[:3]
    return offset + sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0


def _fake_like(
    t: Tensor, bases: dict[int, torch.Tensor], mode: FakeTensorMode, as_dtype: Any = None
) -> torch.Tensor:
    """A fake tensor with ``t``'s metadata (``as_dtype``: but that dtype); tensors sharing
    storage get one fake storage."""
    shape, stride, offset, dtype, device, bits = t._mkey
    dtype = as_dtype or dtype
    key = id(t._storage)
    base = bases.get(key)
    if base is None or base.dtype != dtype or base.numel() < extent(t._mkey):
        size = max(extent(h._mkey) for h in t._storage.handles)
        base = bases[key] = torch.empty(size, dtype=dtype, device="meta")
    return fake_from_meta(mode, base.as_strided(shape, stride, offset), device, bits)


def fake_from_meta(
    mode: FakeTensorMode, meta: torch.Tensor, device: torch.device, bits: int
) -> torch.Tensor:
    """``meta`` (a meta tensor) as a fake tensor of ``mode`` on ``device``, with conjugate and
    negative ``bits``: it shares ``meta``'s storage. ~30 us, where making the same tensor
    with ops under the fake mode takes 140-250 (two thirds of a first propagation; a
    checkpoint's remote function fakes thousands)."""
    fake = mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)
    if bits:
        with mode:
            set_bits(fake, bits)
    return fake


def plan_of(result: Any, info: OpInfo) -> Plan:
    """The plan of what ``info``'s op returned (fake or real tensors)."""
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
    if t.layout is not torch.strided:  # a fake sparse tensor has strides of 0: refuse it here
        raise NotImplementedError(_layout_text(info.function.path, t.layout))
    alias = info.returns_alias[index] if index < len(info.returns_alias) else None
    is_arg = info.returns_write[index] if index < len(info.returns_write) else False
    return Output(meta_of(t), alias, is_arg)


# -- cache keys ------------------------------------------------------------------------------


def _key(info: OpInfo, args: tuple, kwargs: dict, handles: list[Tensor]) -> tuple:
    """A call's plan key: its op, its arguments' keys, its keywords' keys."""
    where = _storages(handles)
    floats = _FLOAT_TYPE if info.float_free else None
    keywords = tuple((k, _key_of(v, where, floats)) for k, v in kwargs.items()) if kwargs else ()
    return (id(info), tuple([_key_of(a, where, floats) for a in args]), keywords)


_FLOAT_TYPE = (float,)  # the key of any float argument of an OpInfo.float_free op


_SCANNED = 8  # up to this many tensors in a call, a tensor's storage is looked for by a scan


def _storages(handles: list[Tensor]) -> list[Tensor] | dict[StorageInfo, int]:
    """Where :func:`_key_of` finds the first of ``handles`` sharing a tensor's storage: the
    handles themselves when they are few (a scan is cheapest), else each storage's first
    index. A fused optimizer step names 5 tensors per parameter: a scan per tensor made its
    key quadratic in the parameters (0.53 s of client time per step at 800)."""
    if len(handles) <= _SCANNED:
        return handles
    first: dict[StorageInfo, int] = {}
    for i, h in enumerate(handles):
        first.setdefault(h._storage, i)
    return first


def _key_of(
    x: Any, where: list[Tensor] | dict[StorageInfo, int], floats: tuple | None = None
) -> tuple:
    t = type(x)
    if t in _SCALARS:
        return floats if t is float and floats is not None else (t, x)
    mkey = getattr(x, "_mkey", None)
    if mkey is not None:
        storage = x._storage
        if type(where) is dict:
            return (mkey, where.get(storage, -1))
        for i, h in enumerate(where):  # which argument is the first to share its storage
            if h._storage is storage:
                return (mkey, i)
        return (mkey, -1)
    if t is torch.Generator:  # its state changes the values an op draws, never their layout
        return (t, x.device)
    if t is list or t is tuple or t is torch.Size:
        for v in x:
            if type(v) is not int:
                return (t, tuple([_key_of(v, where, floats) for v in x]))
        return (t, tuple(x))  # a shape or dims, the usual list: its ints are their own keys
    raise Uncacheable(t)
