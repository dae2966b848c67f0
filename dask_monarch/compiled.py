"""``compile``: trace a function once into a recording, replay it with one message.

Semantics: docs/protocol.md §1.9.

The first call with given argument metadata runs the function with stand-in
("formal") tensors while the session captures every message instead of
sending it; the capture becomes a ``DefineRecording`` per rank. Later calls
with the same metadata send a single ``CallRecording``. The cache is keyed by
the non-tensor arguments and, for tensors, their sizes, strides, dtype,
device, mesh, stream, ``requires_grad`` and which ones share storage.

A replay does what running the function again would do, or does not happen
(DESIGN decision 16):

* Tensors the function made that outlive the call (an optimizer's state,
  ``p.grad``, ``self.cache = x``) are results of the recording: each replay
  rebinds those handles to its new values. A trace that made such state is
  *provisional*, because state made on a first call (an optimizer's
  ``_init_group``) is found, not made, on the next: the function is traced
  once more, and a recording is kept for replays only once two traces agree.
* The function is traced again instead of replayed when something the trace
  read on the client changed: the outside values behind a value Python read
  (``step.item()``), the hyperparameters of an optimizer stepped inside (an LR
  schedule), a local tensor used inside, or a tensor it uses that was dropped
  or rebound.
* A function traced again on most calls (one that reads a value it changes
  itself, as torch.optim's default Adam reads its step count) runs eagerly from
  then on, with one :class:`~dask_monarch.CompileWarning`: as fast as without
  ``compile``, and right.
* A value only the ranks know cannot be read inside: that implicit fetch is an
  error (:mod:`.implicit_fetch`).

``verify=True`` traces again on the first reuse and compares the messages; a
trace with the same messages but other outputs or state gets its own recording.

A recording lives on the ranks while a trace can replay it: once the compiled
function is garbage-collected or a trace replaced, a batched ``DeleteRefs``
of its ref frees it there, after the replays already sent (:class:`_Recording`).

Inside a ``dm.dry_run`` a compiled function keeps traces of the dry run's own
(:meth:`Compiled._traces_for`): a recording on the ranks names streams the
dry run's stand-in never created, so the function is traced there once per
signature, and checked and counted like the eager code; after the block it
replays its recordings of before, and the dry run's die with its stand-in.
"""

from __future__ import annotations

import functools
import gc
import warnings
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from .borrows import StorageInfo, first_use
from .controller.session import Capture, Session
from .debug import recorded_breakpoints
from .exceptions import CompileWarning
from .implicit_fetch import same_value, where
from .protocol import messages as m
from .protocol.rules import refs_mutated, refs_used
from .stream import get_active_stream
from .tensor import Tensor, active_mesh, check_usable, from_client, local_limit, mutated_refs

if TYPE_CHECKING:
    from torch.utils._pytree import TreeSpec

    from .mesh import DeviceMesh

CHUNK = 1000  # commands per DefineRecording message
TENSOR_SLOT = object()  # where an output tensor goes in a trace's output leaves
RETRACES = 3  # traces in a row, none replayed, after which a signature runs eagerly
SIGNATURES = 8  # traces kept per function (torch.compile's limit): new signatures run eagerly

Guard = tuple[str, Callable[[list[Tensor]], bool]]  # (what it watches, still the same?)


class _Trace:
    """One traced call: what to send to replay it, what it returns, and what must hold."""

    def __init__(
        self,
        ranks: list[int],
        outputs: list[tuple],
        escaped: list[weakref.ref],
        first_extra: int,
        template: list[Any],
        out_spec: TreeSpec,
        captured: list[tuple[weakref.ref, int]],
        mutated: list[tuple[int | None, int | None]],
        messages: list[tuple[tuple[int, ...], Any]],
        guards: list[Guard],
    ) -> None:
        self.recording: _Recording | None = None  # on the ranks, once defined
        self.ranks = ranks
        # per output: (TensorMeta, stream, its mesh if not the arguments' or None, index of
        # the formal it is or None, index of the escaped handle it is or None)
        self.outputs = outputs
        self.escaped = escaped  # handles made inside that outlive the call: those returned
        self.first_extra = first_extra  # (by slot) first, then the others, results after them
        self.template = template  # the output leaves, TENSOR_SLOT where a tensor goes
        self.out_spec = out_spec
        self.captured = captured  # (weakref to an outside tensor, the ref id it had)
        self.mutated = mutated  # (formal index or None, outside ref id) changed in place
        self.messages = messages
        self.guards = guards
        self.provisional = bool(escaped)  # made state: confirm with a second trace
        self.verified = False
        self.streams: list = []  # the Streams it runs on: their lanes must outlive the user's

    @property
    def ref(self) -> m.Ref | None:
        """The recording's ref on the ranks (None: not defined)."""
        return None if self.recording is None else self.recording.ref

    def stale(self, actuals: list[Tensor]) -> str | None:
        """Why this recording cannot replay for ``actuals`` now (None: it can)."""
        for ref, ref_id in self.captured:
            h = ref()
            if h is None or h._dropped is not None:
                return "a tensor it uses was dropped"
            if h._ref.id != ref_id:
                return "a tensor it uses holds another value now"
        for ref in self.escaped:
            h = ref()
            if h is None or h._dropped is not None:
                return "a tensor it made on its last call is gone"
        for what, holds in self.guards:
            if not holds(actuals):
                return f"{what} changed"
        return None

    def adopt(self, other: _Trace) -> None:
        """Replay ``other``'s recording, which sends the same messages as this trace."""
        self.recording, self.streams = other.recording, other.streams
        self.provisional = False


class _Recording:
    """A recording defined on ``ranks``, owned by the traces that replay it (``adopt`` shares
    it). Once the last of them is gone (the compiled function collected, or the trace
    replaced), its ref is deleted on the ranks like a dropped tensor's, in the next batched
    ``DeleteRefs``: the ranks then free its commands and what only they hold (captured
    constants, generated code). Replays already sent run first, as the delete follows them
    on every lane (docs/protocol.md §3.5)."""

    __slots__ = ("ranks", "ref", "session", "stand_in")

    def __init__(self, session: Session, ranks: tuple[int, ...], ref: m.Ref) -> None:
        self.session = session
        self.ranks = ranks
        self.ref = ref
        stand_in = session.stand_in  # defined in a dry run: only its stand-in knows it
        self.stand_in = None if stand_in is None else weakref.ref(stand_in)

    def __del__(self) -> None:
        if self.stand_in is None or self.stand_in() is self.session.controller:
            self.session.drop_ref(self.ranks, self.ref)


class Compiled:
    """A function traced once per argument signature and replayed with CallRecording."""

    def __init__(self, fn: Callable, verify: bool = False) -> None:
        self.fn = fn
        self.verify = verify
        self._traces: dict[Any, _Trace] = {}
        # a dry run's stand-in -> its own traces (``_traces_for``)
        self._dry_traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._retraces: dict[Any, int] = {}  # traces in a row with none replayed
        self._eager: set[Any] = set()  # signatures that gave up on their recording
        self._full = False  # SIGNATURES traces kept: new signatures run eagerly (warned)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec, spec_text = _flatten(args, kwargs)
        tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        mesh = tensors[0][1]._mesh if tensors else active_mesh()
        if mesh is None:
            raise RuntimeError("a compiled function needs mesh tensor arguments or an active mesh")
        if len(tensors) < len(leaves) and _place_local_arguments(leaves, mesh):
            args, kwargs = tree_unflatten(leaves, spec)
            tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        for _, t in tensors:
            check_usable(t)
            if t.requires_grad:
                raise ValueError("inputs of a compiled function may not require grad")
            if t._mesh != mesh:
                raise TypeError(
                    f"WRONG_MESH: the compiled function got {t._describe()}, but its other "
                    f"arguments are on {mesh._label()}; move it with t.to_mesh(mesh)"
                )
        key = _signature(leaves, spec_text)
        if key in self._eager:
            return self.fn(*args, **kwargs)
        actuals = [t for _, t in tensors]
        traces = self._traces_for(mesh._session)
        trace = traces.get(key)
        if trace is None and len(traces) >= SIGNATURES:
            self._too_many_signatures(len(traces))
            return self.fn(*args, **kwargs)
        why = "it was never called with such arguments" if trace is None else trace.stale(actuals)
        if why is None and not trace.provisional and (trace.verified or not self.verify):
            self._retraces[key] = 0
            return _call_recording(mesh, trace, actuals, traced=False)
        new = self._trace(mesh, leaves, spec, tensors)
        if why is None and _same_messages(trace, new):  # a second trace agrees: replay it
            new.adopt(trace)
            new.verified = True
        else:
            if why is None and not trace.provisional:  # verify=True, first reuse
                _compare(self.fn, trace.messages, new.messages)
                # the same messages, but it returns or keeps other handles (or metadata):
                # the old recording's results do not describe this trace's, so it gets its own
                why = "what it returns or keeps changed"
            _define_recording(mesh._session, new)
            if trace is not None:
                self._retrace(key, why)
        traces[key] = new
        return _call_recording(mesh, new, actuals, traced=True)

    def _traces_for(self, session: Session) -> dict[Any, _Trace]:
        """The traces whose recordings the session's controller knows. A dry run's stand-in
        knows none of the ranks' (theirs name streams it never created), so it gets traces of
        its own, which die with it: the function's recordings of before are left as they
        were."""
        stand_in = session.stand_in
        if stand_in is None:
            return self._traces
        traces = self._dry_traces.get(stand_in)
        if traces is None:
            traces = self._dry_traces[stand_in] = {}
        return traces

    def _retrace(self, key: Any, why: str) -> None:
        """Count a trace that replaced one never replayed; past RETRACES, run eagerly."""
        count = self._retraces[key] = self._retraces.get(key, 0) + 1
        if count >= RETRACES:
            self._eager.add(key)
            self._traces.pop(key, None)
            for traces in self._dry_traces.values():
                traces.pop(key, None)
            name = getattr(self.fn, "__qualname__", repr(self.fn))
            warnings.warn(
                f"dask_monarch.compile: {name} was traced {count + 1} times in a row without "
                f"a replay (last because {why}); it runs eagerly from now on, as fast as "
                "without compile and as right. A function that reads a value it changes "
                "itself cannot replay: torch.optim's Adam, AdamW and others read their step "
                "count on every step unless created with fused=True (capturable=True on "
                "CUDA), and a learning rate that changes every step is best a tensor "
                "(lr=torch.tensor(...)) with fused=True",
                CompileWarning,
                stacklevel=3,
            )

    def _too_many_signatures(self, count: int) -> None:
        """Warn, once, that calls with new argument signatures run eagerly: each would be a
        trace and a recording on the ranks, kept while the function lives."""
        if self._full:
            return
        self._full = True
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        warnings.warn(
            f"dask_monarch.compile: {name} was traced for {count} argument signatures; calls "
            "with a new one run eagerly from now on, as right and as fast as without compile. "
            "Every non-tensor argument is part of a signature: a Python number that changes "
            "every call (a step index, a decaying factor) is best passed as a tensor",
            CompileWarning,
            stacklevel=3,
        )

    def _trace(
        self, mesh: DeviceMesh, leaves: list[Any], spec: TreeSpec, tensors: list[tuple[int, Tensor]]
    ) -> _Trace:
        session = mesh._session
        with session.lock:
            if session.capture is not None:
                raise RuntimeError(
                    "compiled functions cannot run inside coalescing() or another compiled function"
                )
            session.send_views()
            capture = session.capture = Capture("recording", session.new_id())
            stepped: list = []
            token = _stepped.set(stepped)
            _watch_optimizers()
            try:
                stand_ins = list(leaves)
                formals: dict[int, Tensor] = {}
                formal_values: dict[int, torch.Tensor] = {}
                storages: dict[int, Any] = {}
                for index, (position, t) in enumerate(tensors):
                    # aliases as the arguments are, over storages that hold nothing new on
                    # the ranks (a dry run counts no bytes for them: the arguments' are)
                    storage = storages.setdefault(id(t._storage), StorageInfo())
                    known = t._known.clone() if t._known is not None else None
                    formal = Tensor(
                        t._mkey,
                        session,
                        t._mesh,
                        t._stream,
                        session.new_ref(),
                        storage,
                        known=known,
                    )
                    if known is not None:
                        formal_values[index] = known.clone()
                        capture.formal(formal, index)
                    capture.add(
                        t._mesh._ranks,
                        m.RecordingFormal(formal._ref, index, session.stream_ref(t._stream)),
                    )
                    stand_ins[position] = formals[index] = formal
                args, kwargs = tree_unflatten(stand_ins, spec)
                del stand_ins
                with recorded_breakpoints():  # breakpoint() in fn stops every replay
                    out = self.fn(*args, **kwargs)
                del args, kwargs
                out_leaves, out_spec = tree_flatten(out)
                del out
                if any(isinstance(x, Tensor) and x.requires_grad for x in out_leaves):
                    raise ValueError("outputs of a compiled function may not require grad")
                open_borrows = [b for b in capture.borrows if not b.dropped]
                if open_borrows:
                    raise RuntimeError(
                        "all borrows created within a compiled function must be "
                        f"dropped within it ({open_borrows})"
                    )
            except BaseException:
                _abandon(session, capture)
                raise
            finally:
                session.capture = None
                _stepped.reset(token)
            template = [TENSOR_SLOT if isinstance(x, Tensor) else x for x in out_leaves]
            returned = _returned(out_leaves, formals)
            del out_leaves  # from here on, what holds a handle the trace made is not ours
            held = _escaped(session, capture)
            outputs, escaped = [], []
            for j, (handle, ref, meta, stream, mesh_of, is_formal) in enumerate(returned):
                capture.add(mesh_of._ranks, m.RecordingResult(ref, j, session.stream_ref(stream)))
                h, slot = handle(), None
                if h is not None and any(h is x for x in held):  # also held elsewhere
                    slot = next((i for i, x in enumerate(escaped) if x is h), len(escaped))
                    if slot == len(escaped):
                        escaped.append(h)
                elsewhere = None if mesh_of == mesh else mesh_of
                outputs.append((meta, stream, elsewhere, is_formal, slot))
            first_extra = len(escaped)
            for h in held:  # results after the outputs: each replay rebinds them
                if not any(h is x for x in escaped):
                    index = len(outputs) + len(escaped) - first_extra
                    capture.add(
                        h._mesh._ranks,
                        m.RecordingResult(h._ref, index, session.stream_ref(h._stream)),
                    )
                    escaped.append(h)
            trace = _Trace(
                sorted({r for ranks, _ in capture.messages for r in ranks}),
                outputs,
                [weakref.ref(h) for h in escaped],
                first_extra,
                template,
                out_spec,
                *_uses(capture, formals),
                capture.messages,
                _guards(capture, formal_values, stepped),
            )
            trace.streams = session.streams_named(capture.messages)
            return trace


def compile(
    fn: Callable | None = None, *, verify: bool = False
) -> Compiled | Callable[[Callable], Compiled]:
    """Trace ``fn`` once per argument signature into a recording and replay it (a decorator).

    Parameters
    ----------
    fn
        The function: mesh tensors (that do not require grad) and plain values
        in, mesh tensors and plain values out. Usable as ``@dm.compile`` and
        ``@dm.compile(verify=True)``.
    verify
        Trace again on the first reuse and compare message by message: a
        function whose messages depend on something the signature does not
        capture raises ``RuntimeError`` ("... diverges at ...").

    Returns
    -------
    Compiled
        Called like ``fn``; a call replays the recording, or traces again when
        what the trace read changed (see the module's docstring).
    """
    if fn is None:
        return lambda f: Compiled(f, verify)
    return Compiled(fn, verify)


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], TreeSpec, str]:
    """``tree_flatten((args, kwargs))`` and the spec as text (part of a trace's key). The
    usual call, tensors and scalars passed by position, skips the pytree walk and the
    spec's text (~20 µs a call)."""
    if not kwargs and all(type(a) in _SCALARS or isinstance(a, Tensor) for a in args):
        known = _FLAT_SPECS.get(len(args))
        if known is None:
            spec = tree_flatten((args, kwargs))[1]
            known = _FLAT_SPECS[len(args)] = (spec, str(spec))
        return list(args), *known
    leaves, spec = tree_flatten((args, kwargs))
    return leaves, spec, str(spec)


_SCALARS = frozenset({int, float, bool, complex, str, type(None)})
_FLAT_SPECS: dict[int, tuple[TreeSpec, str]] = {}  # number of arguments -> their spec


def _place_local_arguments(leaves: list[Any], mesh: DeviceMesh) -> bool:
    """Place each small local tensor among ``leaves`` on ``mesh`` (in place), as its first op
    with a mesh tensor would: it is then an input of the recording, keyed by its metadata (a
    batch from a DataLoader, a new tensor every call). A local tensor is keyed by identity, so
    each new one was a new trace that never replayed, each kept with its recording. True if
    one was placed; larger ones, or ones that require grad, are left to the function's ops."""
    limit, placed = local_limit(), False
    for i, x in enumerate(leaves):
        if (
            isinstance(x, torch.Tensor)
            and not isinstance(x, Tensor)
            and x.layout == torch.strided
            and not x.requires_grad
            and x.numel() * x.element_size() <= limit
        ):
            leaves[i], placed = from_client(x, mesh, get_active_stream()), True
    return placed


def _signature(leaves: list[Any], spec_text: str) -> Any:
    parts = []
    storages: dict[int, int] = {}
    for x in leaves:
        if isinstance(x, Tensor):
            group = storages.setdefault(id(x._storage), len(storages))
            parts.append(
                (
                    x._mkey,
                    id(x._mesh._session),
                    x._mesh.dims,
                    x._mesh.slice_,
                    x._stream,
                    x.requires_grad,
                    group,
                )
            )
        else:
            try:
                hash(x)
                parts.append((type(x), x))
            except TypeError:
                parts.append((type(x), id(x)))
    return (spec_text, tuple(parts))


def _returned(leaves: list[Any], formals: dict[int, Tensor]) -> list[tuple]:
    """Per output tensor: a weakref to it, its ref, metadata, stream and mesh (a pipeline's
    loss is on its last stage's, not its arguments'), and the index of the formal it is (None
    if none)."""
    return [
        (
            weakref.ref(h),
            h._ref,
            h._mkey,
            h._stream,
            h._mesh,
            next((i for i, f in formals.items() if f is h), None),
        )
        for h in leaves
        if isinstance(h, Tensor)
    ]


def _escaped(session: Session, capture: Capture) -> list[Tensor]:
    """The handles the trace made that something outside holds after it returned; each
    stops owning its trace-internal ref. The refs of the others are gone with the trace
    (a dry run stops counting them); those of these go when a replay rebinds them."""
    made = _disown(capture)
    found = _alive(made)
    if found:  # what only a reference cycle keeps alive is not held by anyone
        del found
        gc.collect()
        found = _alive(made)
    held = {id(h) for h in found}  # a dead handle's id(None) is none of them
    session.forget_traced([ref for handle, ref in made if id(handle()) not in held])
    return found


def _disown(capture: Capture) -> list[tuple[weakref.ref, int]]:
    """Weak references to the handles the trace made, with their ref ids, none of which owns
    its ref any more (internal to the recording: the replay deletes them)."""
    internal, capture.created = capture.created, []
    for h in internal:
        h.disown()
    return [(weakref.ref(h), h._ref.id) for h in internal]


def _alive(made: list[tuple[weakref.ref, int]]) -> list[Tensor]:
    return [h for h in (ref() for ref, _ in made) if h is not None and h._dropped is None]


def _uses(
    capture: Capture, formals: dict[int, Tensor]
) -> tuple[list[tuple[weakref.ref, int]], list[tuple[int | None, int | None]]]:
    """The outside tensors the trace's messages read, and those (or formals) they change."""
    first_id = capture.first_id
    formal_ids = {f._ref.id: i for i, f in formals.items()}
    used, mutated = {}, {}
    for _, msg in capture.messages:
        for ref in refs_used(msg):
            if ref < first_id and ref not in formal_ids:
                used[ref] = None
        for ref in refs_mutated(msg):
            if ref in formal_ids:
                mutated[(formal_ids[ref], None)] = None
            elif ref < first_id:
                mutated[(None, ref)] = None
    captured = [(weakref.ref(capture.captured[r]), r) for r in used if r in capture.captured]
    return captured, list(mutated)


def _guards(capture: Capture, formal_values: dict[int, torch.Tensor], stepped: list) -> list[Guard]:
    """What a replay must find as the trace left it (see the module's docstring)."""
    guards: list[Guard] = []
    if capture.reads:  # Python read values: what they were computed from must hold
        what = f"the value read at {where(capture.reads[0])}"
        for root in capture.read_roots:
            if type(root) is tuple:  # ("formal", index): an argument
                check = functools.partial(_same_argument, root[1], formal_values[root[1]])
            else:
                handle, value = capture.known[root]
                check = functools.partial(_same_known, weakref.ref(handle), value)
            guards.append((what, check))
    for optimizer, hyper in stepped:
        what = f"a hyperparameter of the {type(optimizer).__name__} stepped inside (lr?)"
        guards.append((what, functools.partial(_same_hyper, weakref.ref(optimizer), hyper)))
    for local, version in capture.locals:
        what = "a local tensor used inside"
        guards.append((what, functools.partial(_same_local, weakref.ref(local), version)))
    return guards


def _same_known(ref: weakref.ref, value: torch.Tensor, actuals: list[Tensor]) -> bool:
    h = ref()
    return h is not None and h._known is not None and same_value(h._known, value)


def _same_argument(index: int, value: torch.Tensor, actuals: list[Tensor]) -> bool:
    known = actuals[index]._known
    return known is not None and same_value(known, value)


def _same_hyper(ref: weakref.ref, hyper: list, actuals: list[Tensor]) -> bool:
    optimizer = ref()
    return optimizer is not None and same_value(_hyperparameters(optimizer), hyper)


def _same_local(ref: weakref.ref, version: int, actuals: list[Tensor]) -> bool:
    local = ref()
    return local is not None and local._version == version


# Optimizers stepped while a trace runs (a global step pre-hook, registered at the first trace)
_stepped: ContextVar[list | None] = ContextVar("dask_monarch_stepped_optimizers", default=None)
_watching = False


def _watch_optimizers() -> None:
    global _watching
    if not _watching:
        register_optimizer_step_pre_hook(_optimizer_stepped)
        _watching = True


def _optimizer_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    stepped = _stepped.get()
    if stepped is not None and all(o is not optimizer for o, _ in stepped):
        stepped.append((optimizer, _hyperparameters(optimizer)))


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """What an optimizer's step reads besides its parameters and state (lr, betas, ...)."""
    return [
        {k: _frozen(v) for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


def _frozen(value: Any) -> Any:
    if isinstance(value, Tensor):  # a replay reads its current value on the ranks
        return ("mesh tensor", id(value))
    if isinstance(value, torch.Tensor):  # a local value is copied into the recording
        return value.detach().clone()
    return value


def _abandon(session: Session, capture: Capture) -> None:
    """A trace failed: nothing it captured was sent, so its handles and borrows name
    nothing on the ranks and must not be deleted or dropped there."""
    for h in capture.created:
        h.disown()
    session.forget_traced([h._ref.id for h in capture.created])
    for borrow in capture.borrows:
        if not borrow.dropped:
            borrow.forget("the compiled function that borrowed it failed")


def _define_recording(session: Session, trace: _Trace) -> None:
    """Send a traced recording to each of its ranks, in chunks (never captured)."""
    with session.lock:
        ref = session.new_ref()
        trace.recording = _Recording(session, tuple(trace.ranks), ref)
        nresults = sum(1 for _, msg in trace.messages if type(msg) is m.RecordingResult)
        nformals = sum(1 for _, msg in trace.messages if type(msg) is m.RecordingFormal)
        for rank in trace.ranks:
            commands = [msg for msg_ranks, msg in trace.messages if rank in msg_ranks]
            chunks = [commands[i : i + CHUNK] for i in range(0, len(commands), CHUNK)] or [[]]
            for index, chunk in enumerate(chunks):
                session.send_setup(
                    (rank,), m.DefineRecording(ref, nresults, nformals, chunk, len(chunks), index)
                )


def _call_recording(mesh: DeviceMesh, trace: _Trace, actuals: list[Tensor], traced: bool) -> Any:
    """Replay a recording: one CallRecording to its ranks; returns its outputs. ``traced``:
    the function was just traced for this call, so the client already holds the values it
    knows of what the replay changes (the trace computed them)."""
    session = mesh._session
    with session.lock:
        if session.capture is not None:
            raise RuntimeError(
                "a compiled function cannot be called while messages are being captured"
            )
        for t in actuals:
            check_usable(t)
        # read now (a lazy view passed in is sent before the recording's seq), before any
        # handle is rebound below: an argument may be one (``x = step(x)`` with state kept)
        args = [t._ref for t in actuals]
        first_use(session, actuals)
        held = [ref() for ref in trace.escaped]
        results, handles, rebinds = [], [], []
        for meta, stream, elsewhere, is_formal, slot in trace.outputs:
            ref = session.new_ref()
            if slot is not None:  # also held elsewhere: the same object, rebound
                handles.append(held[slot])
                rebinds.append((held[slot], ref))
            else:
                storage = actuals[is_formal]._storage if is_formal is not None else None
                made_on = mesh if elsewhere is None else elsewhere
                handles.append(Tensor(meta, session, made_on, stream, ref, storage))
            results.append(ref)
        for h in held[trace.first_extra :]:
            results.append(session.new_ref())
            rebinds.append((h, results[-1]))
        captured = [ref() for ref, _ in trace.captured]
        by_id = {h._ref.id: h for h in reversed(captured) if h is not None}  # the first wins
        changed = [actuals[i] if i is not None else by_id.get(ref) for i, ref in trace.mutated]
        mutates = mutated_refs([h for h in changed if h is not None], keep_known=traced)
        seq = session.new_seq()
        uses = [a.id for a in args] + [h._ref.id for h in captured if h is not None]
        session.invoke(seq, uses, [r.id for r in results] + mutates)
        session.send(tuple(trace.ranks), m.CallRecording(seq, trace.ref, results, args))
        for h, ref in rebinds:  # after the send: the deletes of their old values follow it
            _rebind(h, ref, traced)
    it = iter(handles)
    leaves = [next(it) if x is TENSOR_SLOT else x for x in trace.template]
    return tree_unflatten(leaves, trace.out_spec)


def _rebind(h: Tensor, ref: m.Ref, traced: bool) -> None:
    """Point handle ``h``, made by a traced call and held since, at a replay's new value."""
    internal = None if h._owns_ref else h._ref.id  # the trace's own: no delete frees it
    h.rebind(ref)
    if internal is not None:
        h._session.forget_traced([internal])
    if not traced:
        h._storage.forget_known()


def _same_messages(old: _Trace | None, new: _Trace) -> bool:
    """Two traces of one signature send the same messages (up to ids) and hand back the same
    outputs and state: the first's recording replays the second."""
    return (
        old is not None
        and old.ref is not None
        and len(old.escaped) == len(new.escaped)
        and [o[0] for o in old.outputs] == [o[0] for o in new.outputs]
        and _normalize(old.messages) == _normalize(new.messages)
    )


def _normalize(messages: list[tuple[tuple[int, ...], Any]]) -> list:
    """Messages with ids (refs, streams, borrows) renumbered by first appearance, and seqs
    dropped (for comparison)."""
    ids: dict[Any, int] = {}

    def norm(x: Any) -> Any:
        if isinstance(x, (m.Ref, m.StreamRef)):
            return (type(x).__name__, ids.setdefault(int(x), len(ids)))
        if isinstance(x, m.ArgsKwargs):
            return norm(x.to_python())
        if isinstance(x, dict):
            return tuple((k, norm(v)) for k, v in x.items())
        if hasattr(x, "_fields"):
            return (type(x).__name__,) + tuple(
                ("borrow", ids.setdefault(("borrow", v), len(ids))) if f == "borrow" else norm(v)
                for f, v in zip(x._fields, x)
                if f != "seq"
            )
        if isinstance(x, (list, tuple)):
            return tuple(norm(v) for v in x)
        if isinstance(x, torch.Tensor):
            return ("tensor", x.dtype, tuple(x.shape), x.flatten().tolist())
        return x

    return [(ranks, norm(msg)) for ranks, msg in messages]


def _compare(
    fn: Callable,
    first: list[tuple[tuple[int, ...], Any]],
    second: list[tuple[tuple[int, ...], Any]],
) -> None:
    a, b = _normalize(first), _normalize(second)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            raise RuntimeError(
                f"compiled function {getattr(fn, '__qualname__', fn)} diverges at "
                f"operation {i}: traced {x!r}, now {y!r}"
            )
    if len(a) != len(b):
        raise RuntimeError(
            f"compiled function {getattr(fn, '__qualname__', fn)} diverges at "
            f"operation {min(len(a), len(b))}: traced {len(a)} operations, now "
            f"{len(b)}"
        )
