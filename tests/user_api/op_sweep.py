"""Op coverage: PyTorch's own OpInfo samples run on a mesh and compared with local torch.

The instrument behind issue 34's coverage figures, shared by
benchmarks/op_coverage.py (every op of ``op_db``) and
tests/user_api/test_op_coverage.py (a representative subset in CI).

For each OpInfo that supports float32 on CPU, the first few samples of
``op.sample_inputs("cpu", torch.float32)`` run in up to three phases:

* ``forward``: the op's function variant, locally and on the mesh with every
  tensor of the sample placed on it (:func:`place`), under ``mesh.activate()``;
* ``inplace``: the in-place variant (``x.squeeze_()``), where there is one;
  the returned handle *and* the mutated input are compared (an in-place view
  changes the input's own shape);
* ``backward``: where the OpInfo supports autograd, a fixed weighted sum of
  the floating outputs, then ``torch.autograd.grad`` of it with respect to
  every input that requires grad.

Each mesh output handle is checked three ways: its client-side metadata
against the local result's (shape, dtype, conjugate bit; strides too where
the placed inputs have the local inputs' layout), against the value fetched
from the ranks (shape, dtype, strides, offset, conjugate and negative bits),
and the fetched value against the local one (``torch.testing.assert_close``,
``equal_nan``, the OpInfo's own float32 tolerances where it has any). Random
ops (an aten op tagged ``nondeterministic_seeded`` ran) and ops whose values
are uninitialized (``empty*``, ``resize_``) compare metadata only.

A sample ends as ``pass``; ``mismatch`` (something differs and nothing was
raised: the worst outcome); ``mesh error`` (grouped by :func:`category`);
or ``local error`` (local torch fails too: skipped, not counted; so is a
backward sample with nothing to differentiate, ``no gradient``). A failure
never stops the sweep: a RemoteException poisons only its own values, and a
broken mesh (DeviceException) or a fetch that times out is replaced by a new
mesh, counted in ``Sweep.new_meshes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from distributed import Client
from torch.testing._internal.common_device_type import toleranceOverride
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import OpInfo, SampleInput
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import dask_monarch as dm

PHASES = ("forward", "inplace", "backward")
PASS, MISMATCH, MESH_ERROR, LOCAL_ERROR = "pass", "mismatch", "mesh error", "local error"
NO_GRADIENT = "no gradient"  # backward: no floating output requires grad (not counted)
FETCH_TIMEOUT = 60.0  # seconds; a fetch that takes longer counts as a hang and gets a new mesh

# Ops whose outputs hold uninitialized memory: only their metadata can be compared.
UNINITIALIZED = re.compile(r"(^|\.|_)empty|^resize_|^resize_as_")

# A mesh error's category: the first pattern found in the exception's type and first
# line, else the type and the first line with numbers and shapes blanked.
DATA_DEPENDENT = "data-dependent output shape"
LOCAL_TENSOR = "LOCAL_TENSOR (a local tensor used with mesh tensors)"
NEEDS_VALUE = "needs the value of a mesh tensor"
CANNOT_FETCH = "cannot be fetched"
STALE_AT_FETCH = "rank's value differs from the client's metadata"
FETCH_REFUSED = "implicit fetch refused"
BROKEN = "mesh broken (DeviceException)"
TIMED_OUT = "timed out"
CATEGORIES = (
    (
        DATA_DEPENDENT,
        re.compile(
            r"DynamicOutputShape|DataDependentOutput|data-dependent|GuardOnDataDependent", re.I
        ),
    ),
    (LOCAL_TENSOR, re.compile(r"LOCAL_TENSOR")),
    (NEEDS_VALUE, re.compile(r"needs the value of a mesh tensor")),
    (CANNOT_FETCH, re.compile(r"cannot be fetched|could not be fetched|unpickl", re.I)),
    (STALE_AT_FETCH, re.compile(r"the client believes")),
    (FETCH_REFUSED, re.compile(r"implicit.fetch", re.I)),
)


# -- placing a sample on the mesh --------------------------------------------------------------


PLACEMENTS = ("put", "ranks")


def place(t: torch.Tensor, mesh: dm.DeviceMesh, placement: str = "put") -> torch.Tensor:
    """``t``'s value on every rank of ``mesh``: a leaf handle, requiring grad if ``t`` does.

    ``put``: with ``dm.put``, so the client keeps small values and computes bit-exact ops
    on them itself (and answers Python's value requests itself); ``ranks``: with
    :func:`send_by_value`, so every value comes from the ranks (implicit fetches, data-
    dependent shapes through the ranks).
    """
    with dm.no_mesh.activate():
        local = t.detach()
        handle = dm.put(local, mesh=mesh) if placement == "put" else send_by_value(local, mesh)
    if t.requires_grad:
        handle.requires_grad_(True)
    return handle


def send_by_value(t: torch.Tensor, mesh: dm.DeviceMesh) -> torch.Tensor:
    """A copy of ``t`` with its whole storage, strides and offset, as a remote function's
    argument; the ranks keep it as it arrives (``torch.Tensor.detach``).

    The layout matters: ``as_strided`` reads the storage around a view, and the
    outputs' strides can be compared with local torch's only for inputs laid out alike.
    """
    copy = same_layout_copy(t)  # the message may be pickled after the local run changed t
    shape, stride, offset, dtype = tuple(t.shape), t.stride(), t.storage_offset(), t.dtype
    elements = t.untyped_storage().nbytes() // t.element_size()

    def propagate(_: torch.Tensor) -> torch.Tensor:
        return torch.empty(elements, dtype=dtype).as_strided(shape, stride, offset)

    with mesh.activate():
        return dm.remote("torch.Tensor.detach", propagate=propagate)(copy)


def place_tree(tree: Any, mesh: dm.DeviceMesh, placement: str = "put") -> Any:
    return tree_map(lambda x: place(x, mesh, placement) if isinstance(x, torch.Tensor) else x, tree)


def same_layouts(local: Any, placed: Any) -> bool:
    """Every placed tensor has its local tensor's strides and offset (so outputs' may agree)."""
    pairs = zip(tree_flatten(local)[0], tree_flatten(placed)[0])
    return all(
        not isinstance(a, torch.Tensor)
        or (a.stride() == b.stride() and a.storage_offset() == b.storage_offset())
        for a, b in pairs
    )


# -- outcomes ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """How one sample of one op ended in one phase."""

    op: str  # the OpInfo's full name (name.variant)
    phase: str
    sample: int
    status: str
    category: str = ""  # mesh errors: see category()
    detail: str = ""  # what differed, or the exception's type and first line
    implicit_fetches: int = 0  # dm.ImplicitFetchWarning raised while it ran


class Mismatch(Exception):
    """A difference between the mesh and local torch (raised internally, never to the user)."""


def first_line(exc: BaseException) -> str:
    """The exception's first non-empty line; for a RemoteException, the remote one's too."""
    text = str(exc.args[0]) if exc.args else str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0] if lines else ""
    remote = getattr(exc, "traceback", "")
    if remote:
        tail = [ln.strip() for ln in remote.splitlines() if ln.strip()]
        if tail and tail[-1] not in head:
            head = f"{head} [remote: {tail[-1]}]"
    return head[:300]


def category(exc: BaseException) -> str:
    """A normalised name for a mesh error, to group failures by cause."""
    if isinstance(exc, dm.DeviceException):
        return BROKEN
    if isinstance(exc, TimeoutError):
        return TIMED_OUT
    text = f"{type(exc).__name__}: {first_line(exc)}"
    for name, pattern in CATEGORIES:
        if pattern.search(text):
            return name
    line = first_line(exc)
    line = re.sub(r"\[[\d, ]*\]|\([\d, ]*\)|torch\.Size\(\[[\d, ]*\]\)", "<shape>", line)
    line = re.sub(r"\b0x[0-9a-f]+\b|\b\d+(\.\d+)?\b", "N", line)
    line = re.sub(r"\(seq N, rank N\)", "", line)
    return f"{type(exc).__name__}: {line[:120]}"


# -- comparing -----------------------------------------------------------------------------------


def tolerances(op: OpInfo) -> dict[str, float]:
    """The OpInfo's own float32 CPU tolerance overrides (the loosest), else torch's defaults;
    an override only loosens."""
    atol, rtol = 1e-5, 1.3e-6  # assert_close's defaults for float32
    overridden = False
    for decorate in op.decorators:
        if getattr(decorate, "device_type", None) not in (None, "cpu"):
            continue
        dtypes = getattr(decorate, "dtypes", None)
        if dtypes is not None and torch.float32 not in dtypes:
            continue
        for d in getattr(decorate, "decorators", [decorate]):
            if isinstance(d, toleranceOverride) and torch.float32 in d.d:
                overridden = True
                atol, rtol = max(atol, d.d[torch.float32].atol), max(rtol, d.d[torch.float32].rtol)
    return {"atol": atol, "rtol": rtol} if overridden else {}


def _meta(t: torch.Tensor) -> dict[str, Any]:
    return {
        "shape": tuple(t.shape),
        "dtype": t.dtype,
        "stride": t.stride(),
        "offset": t.storage_offset(),
        "conj": t.is_conj(),
        "neg": t.is_neg(),
    }


def _differs(what: str, a: dict, b: dict, keys: Iterable[str], names: tuple[str, str]) -> None:
    for k in keys:
        if a[k] != b[k]:
            raise Mismatch(f"{what}: {k} {names[0]} {a[k]}, {names[1]} {b[k]}")


def check_metadata(where: str, local: Any, mesh: Any, strides: bool) -> list[tuple]:
    """Structure and client-side metadata of the mesh outputs against the local ones.

    Returns the (where, local, handle) pairs whose values are still to be fetched.
    """
    local_leaves, local_spec = tree_flatten(local)
    mesh_leaves, mesh_spec = tree_flatten(mesh)
    if len(local_leaves) != len(mesh_leaves):
        raise Mismatch(f"{where}: {len(mesh_leaves)} outputs on the mesh, {len(local_leaves)} here")
    pending = []
    for i, (a, b) in enumerate(zip(local_leaves, mesh_leaves)):
        here = f"{where}[{i}]" if len(local_leaves) > 1 else where
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            raise Mismatch(f"{here}: {type(b).__name__} on the mesh, {type(a).__name__} here")
        if isinstance(b, torch.Tensor) and not isinstance(b, dm.Tensor):
            raise Mismatch(f"{here}: a local tensor where a mesh tensor was expected")
        if not isinstance(a, torch.Tensor):
            if not _same_python_value(a, b):
                raise Mismatch(f"{here}: {b!r} on the mesh, {a!r} here")
            continue
        keys = ["shape", "dtype", "conj"] + (["stride"] if strides else [])
        _differs(here, _meta(b), _meta(a), keys, ("client", "local"))
        pending.append((here, a, b))
    return pending


def _same_python_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def check_values(pending: list[tuple], values_too: bool, tol: dict, timeout: float) -> None:
    """Fetch every handle of ``pending`` in one go; check metadata and values."""
    handles = [h for _, _, h in pending if isinstance(h, dm.Tensor)]
    fetched = iter(dm.inspect(handles, timeout=timeout) if handles else [])
    for here, local, handle in pending:
        value = handle
        if isinstance(handle, dm.Tensor):
            value = next(fetched)
            keys = ("shape", "dtype", "stride", "offset", "conj", "neg")
            _differs(here, _meta(handle), _meta(value), keys, ("client", "rank"))
        if not values_too:
            continue
        try:
            torch.testing.assert_close(
                value, local.detach(), equal_nan=True, check_stride=False, **tol
            )
        except AssertionError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            raise Mismatch(f"{here}: values differ: {'; '.join(lines[:3])}") from None


# -- running samples -----------------------------------------------------------------------------


class _Record(TorchDispatchMode):
    """Notes the tags of every aten op a local run calls (to know random ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.seeded = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seeded = True
        return func(*args, **(kwargs or {}))


def _call(fn: Callable, sample: SampleInput) -> Any:
    return fn(sample.input, *sample.args, **sample.kwargs)


def _as_sample(tree: tuple, like: SampleInput) -> SampleInput:
    inp, args, kwargs = tree
    return SampleInput(
        inp, args=tuple(args), kwargs=kwargs, output_process_fn_grad=like.output_process_fn_grad
    )


def _clone(tree: Any) -> Any:
    """A copy of every tensor with its whole storage, strides and offset (an in-place
    ``as_strided_`` reads around the view, as on the ranks)."""
    return tree_map(lambda x: same_layout_copy(x) if isinstance(x, torch.Tensor) else x, tree)


def same_layout_copy(t: torch.Tensor) -> torch.Tensor:
    if t.layout != torch.strided:
        return t.clone()
    return torch.empty(0, dtype=t.dtype).set_(
        t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride()
    )


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _weights(t: torch.Tensor) -> torch.Tensor:
    """Fixed, unequal local weights for ``t``'s elements (a plain sum would hide a permutation);
    a complex ``t``'s are for its ``view_as_real``."""
    shape = (*t.shape, 2) if t.is_complex() else tuple(t.shape)
    with dm.no_mesh.activate():
        return (torch.arange(math.prod(shape), dtype=torch.float32) % 7 / 7 + 0.5).reshape(shape)


def _weighted_sum(leaves: list[torch.Tensor], weights: list[torch.Tensor]) -> torch.Tensor:
    terms = [
        ((torch.view_as_real(t.resolve_conj()) if t.is_complex() else t) * w).sum()
        for t, w in zip(leaves, weights)
    ]
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


class Sweep:
    """Runs OpInfo samples on one mesh (made anew when it breaks) and keeps the outcomes."""

    def __init__(
        self,
        client: Any,
        samples: int = 3,
        timeout: float = FETCH_TIMEOUT,
        log: Callable[[str], None] | None = None,
        placement: str = "put",
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"placement is one of {PLACEMENTS}, got {placement!r}")
        self.client = client
        self.placement = placement
        self.samples = samples
        self.timeout = timeout
        self.log = log or (lambda _: None)
        self.outcomes: list[Outcome] = []
        self.new_meshes = 0
        self.unsupported: list[str] = []
        self.mesh = dm.device_mesh(client, gpu=2)

    def close(self) -> None:
        with contextlib.suppress(dm.RemoteException, dm.DeviceException):
            self.mesh.exit()

    def renew_mesh(self) -> None:
        """The mesh broke (or a fetch hung): go on with a new one."""
        self.close()
        self.new_meshes += 1
        self.mesh = dm.device_mesh(self.client, gpu=2)

    def run(self, ops: Iterable[OpInfo]) -> list[Outcome]:
        for op in ops:
            if not op.supports_dtype(torch.float32, "cpu"):
                self.unsupported.append(op.full_name)
                continue
            start = len(self.outcomes)
            self.run_op(op)
            bad = [o for o in self.outcomes[start:] if o.status in (MISMATCH, MESH_ERROR)]
            self.log(f"{op.full_name}: {len(self.outcomes) - start} runs, {len(bad)} failing")
        return self.outcomes

    def run_op(self, op: OpInfo) -> None:
        tol = tolerances(op)
        values_too = not UNINITIALIZED.search(op.name)
        seed = zlib.crc32(op.full_name.encode())
        phases: list[tuple[str, Callable | None, bool]] = [
            ("forward", op.op, False),
            ("inplace", op.inplace_variant, False),
            ("backward", op.op if op.supports_autograd else None, True),
        ]
        for phase, fn, grad in phases:
            if fn is None:
                continue
            torch.manual_seed(seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecations and betas of the ops themselves
                made = op.sample_inputs("cpu", torch.float32, requires_grad=grad)
                samples, error = _take(made, self.samples)
            for index, sample in enumerate(samples):
                self.run_sample(op, phase, fn, index, sample, tol, values_too)
            if error is not None:  # the OpInfo cannot make its next sample here
                self._note(op, phase, len(samples), LOCAL_ERROR, "", _describe(error))

    def run_sample(
        self,
        op: OpInfo,
        phase: str,
        fn: Callable,
        index: int,
        sample: SampleInput,
        tol: dict,
        values_too: bool,
    ) -> None:
        tree = (sample.input, sample.args, sample.kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                placed = _as_sample(place_tree(tree, self.mesh, self.placement), sample)
            except (dm.DeviceException, TimeoutError) as e:
                self.renew_mesh()
                return self._note(op, phase, index, MESH_ERROR, category(e), _describe(e))
            except Exception as e:  # a tensor dask_monarch cannot hold (a sparse one)
                detail = _describe(e)
                return self._note(op, phase, index, MESH_ERROR, f"placing: {detail}", detail)
            strides = same_layouts(tree, (placed.input, placed.args, placed.kwargs))
            if not strides and op.name.startswith("as_strided"):
                values_too = False  # it reads the storage around the view, laid out otherwise
            try:
                local, seeded = self._local(phase, fn, sample)
            except Exception as e:
                return self._note(op, phase, index, LOCAL_ERROR, "", _describe(e))
            if phase == "backward" and local is None:
                return self._note(op, phase, index, NO_GRADIENT)
            try:
                self._on_mesh(phase, fn, placed, local, strides, values_too and not seeded, tol)
                status, cat, detail = PASS, "", ""
            except Mismatch as e:
                status, cat, detail = MISMATCH, "", str(e)
            except (dm.DeviceException, TimeoutError) as e:
                self.renew_mesh()
                status, cat, detail = MESH_ERROR, category(e), _describe(e)
            except Exception as e:
                status, cat, detail = MESH_ERROR, category(e), _describe(e)
        implicit = getattr(dm, "ImplicitFetchWarning", None)
        fetches = sum(1 for w in caught if implicit and issubclass(w.category, implicit))
        self._note(op, phase, index, status, cat, detail, fetches)

    def _local(self, phase: str, fn: Callable, sample: SampleInput) -> tuple[Any, bool]:
        """The local result (what the mesh result is checked against), and whether it drew
        random numbers."""
        record = _Record()
        if phase == "inplace":  # on a copy: the sample itself stays as it was placed
            sample = _as_sample((_clone(sample.input), sample.args, sample.kwargs), sample)
        with record:
            out = _call(fn, sample)
            if phase == "inplace":
                out = (out, sample.input)
            elif phase == "backward":
                out = self._grads(sample, out, _weights)
        return out, record.seeded

    def _grads(self, sample: SampleInput, out: Any, weights: Callable) -> Any:
        """The gradients of a fixed weighted sum of the floating outputs wrt the inputs."""
        out = sample.output_process_fn_grad(out)
        leaves = [t for t in tree_flatten(out)[0] if _is_float(t) and t.requires_grad]
        inputs = [
            t
            for t in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not leaves or not inputs:
            return None  # nothing to differentiate: both sides say so
        loss = _weighted_sum(leaves, [weights(t) for t in leaves])
        return torch.autograd.grad(loss, inputs, allow_unused=True)

    def _on_mesh(
        self,
        phase: str,
        fn: Callable,
        placed: SampleInput,
        local: Any,
        strides: bool,
        values_too: bool,
        tol: dict,
    ) -> None:
        mesh = self.mesh
        with mesh.activate():
            out = _call(fn, placed)
            if phase == "inplace":
                out = (out, placed.input)
            elif phase == "backward":
                out = self._grads(placed, out, lambda t: place(_weights(t), mesh, self.placement))
        if phase == "backward" and isinstance(local, tuple):
            local, out = _none_for_zeros(local, out)
        pending = check_metadata(phase, local, out, strides)
        check_values(pending, values_too, tol, self.timeout)

    def _note(self, op: OpInfo, phase: str, index: int, *outcome: Any) -> None:
        self.outcomes.append(Outcome(op.full_name, phase, index, *outcome))


def _none_for_zeros(local: tuple, mesh: tuple) -> tuple[tuple, tuple]:
    """A gradient that is None on one side and zeros on the other is the same gradient."""
    a_out, b_out = [], []
    for a, b in zip(local, mesh):
        if a is None and b is not None:
            a = torch.zeros(b.shape, dtype=b.dtype)  # the mesh's must then be zeros
        elif a is not None and b is None and not a.any():
            a = None
        a_out.append(a)
        b_out.append(b)
    return tuple(a_out), tuple(b_out)


def _take(samples: Iterable[SampleInput], n: int) -> tuple[list[SampleInput], Exception | None]:
    """Up to ``n`` samples, and the exception that stopped making them early, if one did."""
    taken: list[SampleInput] = []
    try:
        for sample in samples:
            if len(taken) == n:
                break
            taken.append(sample)
    except Exception as e:
        return taken, e
    return taken, None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(exc)}"


# -- selecting and summarising -------------------------------------------------------------------


def failures(
    outcomes: Iterable[Outcome], status: str, key: Callable[[Outcome], str] = lambda o: o.op
) -> dict[str, list[Outcome]]:
    """The outcomes of ``status``, by ``key`` (an op, a module without its mode)."""
    failing: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if o.status == status:
            failing.setdefault(key(o), []).append(o)
    return failing


def lines(outcomes: Iterable[Outcome]) -> str:
    """Outcomes one per line, for an assertion's message."""
    return "\n".join(f"  {o.op} [{o.phase} sample {o.sample}]: {o.detail}" for o in outcomes)


def add_arguments(parser: Any, unit: str, select_help: str, samples_help: str, placed: str) -> None:
    """The options benchmarks/op_coverage.py and module_coverage.py share: ``unit`` is what
    one selects ("op", "module"; ``--ops``, ``--modules``), ``placed`` what a placement puts
    on the mesh."""
    parser.add_argument(f"--{unit}s", help=select_help)
    parser.add_argument("--limit", type=int, help=f"only the first N {unit}s (after --{unit}s)")
    parser.add_argument("--samples", type=int, default=3, help=samples_help)
    parser.add_argument("--scheduler", help="address of an existing cluster's scheduler")
    parser.add_argument("--json", type=Path, help="write every outcome and the summary here")
    parser.add_argument("--timeout", type=float, default=FETCH_TIMEOUT)
    parser.add_argument("--verbose", action="store_true", help="every failing sample")
    parser.add_argument("--progress", action="store_true", help=f"a line per {unit} as it ends")
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="put",
        help=f"put: {placed} placed with dm.put (the client keeps small values); ranks: sent "
        "through a remote function (every value comes from the ranks)",
    )


def run_sweep(sweep_class: type, items: list, args: Any) -> tuple[Any, list[Outcome], float]:
    """``items`` swept by a ``sweep_class`` (:class:`Sweep` or a subclass) as ``args`` (of
    :func:`add_arguments`) say, on the cluster at ``--scheduler`` or a local one of 2 CPU
    ranks: the sweep, its outcomes and the seconds they took."""
    with contextlib.ExitStack() as stack:
        if args.scheduler:
            client = stack.enter_context(Client(args.scheduler))
        else:
            cluster = stack.enter_context(dm.LocalMeshCluster(n_ranks=2, device="cpu"))
            client = stack.enter_context(Client(cluster))
        client.wait_for_workers(2)
        start = time.perf_counter()
        log = (lambda line: print(line, flush=True)) if args.progress else None
        sweep = sweep_class(
            client, samples=args.samples, timeout=args.timeout, log=log, placement=args.placement
        )
        try:
            outcomes = sweep.run(items)
        finally:
            sweep.close()
        return sweep, outcomes, time.perf_counter() - start


def select_ops(pattern: str | None = None, names: Iterable[str] | None = None) -> list[OpInfo]:
    """OpInfos whose full name matches ``pattern`` (a regex, searched) or is in ``names``."""
    return select(op_db, "op_db", lambda op: op.full_name, pattern, names)


def select(
    db: Iterable[Any],
    db_name: str,
    name_of: Callable[[Any], str],
    pattern: str | None = None,
    names: Iterable[str] | None = None,
) -> list:
    """The entries of a test database (op_db, module_db) whose name matches ``pattern`` (a
    regex, searched) or is in ``names`` (each must be there)."""
    items = list(db)
    if names is not None:
        wanted = set(names)
        items = [item for item in items if name_of(item) in wanted]
        missing = wanted - {name_of(item) for item in items}
        if missing:
            raise KeyError(f"not in {db_name}: {sorted(missing)}")
    if pattern:
        regex = re.compile(pattern)
        items = [item for item in items if regex.search(name_of(item))]
    return items


@dataclasses.dataclass
class Summary:
    """Counts per phase: ops fully passing / ops tried, samples passing / samples tried."""

    ops_passing: dict[str, int]
    ops_tried: dict[str, int]
    samples_passing: dict[str, int]
    samples_tried: dict[str, int]
    mismatches: list[Outcome]
    categories: dict[str, list[Outcome]]  # mesh errors by category, most frequent first
    local_errors: int
    failing_ops: dict[str, set[str]]  # per phase, and "all"
    implicit: list[Outcome]  # samples during which a value was fetched implicitly


def summarise(outcomes: list[Outcome]) -> Summary:
    by_op: dict[tuple[str, str], list[str]] = defaultdict(list)
    tried = [o for o in outcomes if o.status not in (LOCAL_ERROR, NO_GRADIENT)]
    for o in tried:
        by_op[(o.phase, o.op)].append(o.status)
        by_op[("all", o.op)].append(o.status)
    keys = (*PHASES, "all")
    ops_tried = {p: sum(1 for (ph, _) in by_op if ph == p) for p in keys}
    failing = {p: set() for p in keys}
    for (phase, op), statuses in by_op.items():
        if set(statuses) - {PASS}:
            failing[phase].add(op)
    categories: dict[str, list[Outcome]] = defaultdict(list)
    for o in tried:
        if o.status == MESH_ERROR:
            categories[o.category].append(o)
    return Summary(
        ops_passing={p: ops_tried[p] - len(failing[p]) for p in keys},
        ops_tried=ops_tried,
        samples_passing={
            p: sum(1 for o in tried if o.status == PASS and p in (o.phase, "all")) for p in keys
        },
        samples_tried={p: sum(1 for o in tried if p in (o.phase, "all")) for p in keys},
        mismatches=[o for o in tried if o.status == MISMATCH],
        categories=dict(sorted(categories.items(), key=lambda kv: -len(kv[1]))),
        local_errors=sum(1 for o in outcomes if o.status == LOCAL_ERROR),
        failing_ops=failing,
        implicit=[o for o in tried if o.implicit_fetches],
    )


def failures_by_op(outcomes: list[Outcome]) -> dict[str, set[str]]:
    """For each op with a mesh error or mismatch: the set of its categories (``mismatch``
    for a mismatch)."""
    out: dict[str, set[str]] = defaultdict(set)
    for o in outcomes:
        if o.status == MESH_ERROR:
            out[o.op].add(o.category)
        elif o.status == MISMATCH:
            out[o.op].add(MISMATCH)
    return dict(out)


def report(summary: Summary, verbose: bool = False) -> str:
    """The human-readable summary (benchmarks/op_coverage.py prints it)."""
    lines = []
    for p in (*PHASES, "all"):
        lines.append(
            f"{p:>8}: ops fully passing {summary.ops_passing[p]} / {summary.ops_tried[p]}, "
            f"samples passing {summary.samples_passing[p]} / {summary.samples_tried[p]}"
        )
    lines.append(f"local errors (samples skipped: local torch fails too): {summary.local_errors}")
    if summary.implicit:
        ops = sorted({o.op for o in summary.implicit})
        lines.append(f"samples that fetched a value implicitly: {len(summary.implicit)}")
        lines.append(f"         {', '.join(ops)}")
    lines.append(f"\nMISMATCHES: {len(summary.mismatches)}")
    for o in summary.mismatches:
        lines.append(f"  {o.op} [{o.phase} sample {o.sample}]: {o.detail}")
    lines.append("\nmesh errors by category:")
    for cat, items in summary.categories.items():
        ops = sorted({o.op for o in items})
        lines.append(f"  {len(items):4d} samples, {len(ops):3d} ops  {cat}")
        if verbose:
            for o in items:
                lines.append(f"         {o.op} [{o.phase} sample {o.sample}]: {o.detail}")
        else:
            lines.append(f"         {', '.join(ops)}")
    return "\n".join(lines)
