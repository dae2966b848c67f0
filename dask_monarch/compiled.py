"""``compile``: trace a function once into a recording, replay it with one message.

Semantics: docs/protocol.md §1.9.

The first call with given argument metadata runs the function with stand-in
("formal") tensors while the session captures every message instead of
sending it; the capture becomes a ``DefineRecording`` per rank. Later calls
with the same metadata send a single ``CallRecording``. The cache is keyed by
the non-tensor arguments and, for tensors, their sizes, strides, dtype,
device, mesh, stream, ``requires_grad`` and which ones share storage.
``verify=True`` traces again on the first reuse and compares the messages.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils._pytree import tree_flatten, tree_unflatten

from .borrows import first_use
from .controller.session import Capture, Session
from .debug import recorded_breakpoints
from .protocol import messages as m
from .protocol.rules import refs_mutated, refs_used
from .tensor import Tensor, active_mesh, check_usable, mutated_refs

if TYPE_CHECKING:
    from torch.utils._pytree import TreeSpec

    from .mesh import DeviceMesh

CHUNK = 1000  # commands per DefineRecording message
TENSOR_SLOT = object()  # where an output tensor goes in a trace's output leaves


class _Trace:
    """One traced call: what to send to replay it, and what it returns."""

    def __init__(
        self,
        ref: m.Ref,
        ranks: list[int],
        formals: dict[int, Tensor],
        outputs: list[tuple],
        template: list[Any],
        out_spec: TreeSpec,
        captured: list[weakref.ref],
        mutated: list[tuple[int | None, int | None]],
        messages: list[tuple[tuple[int, ...], Any]],
    ) -> None:
        self.ref = ref
        self.ranks = ranks
        self.formals = formals  # argument index -> formal handle (for aliasing of outputs)
        self.outputs = outputs  # per output: (TensorMeta, stream, index of the formal it is,
        #                          or None)
        self.template = template  # the output leaves, TENSOR_SLOT where a tensor goes
        self.out_spec = out_spec
        self.captured = captured  # weakrefs to captured outside tensors
        self.mutated = mutated  # (formal index or None, outside ref id) changed in place
        self.messages = messages
        self.verified = False
        self.streams: list = []  # the Streams it runs on: their lanes must outlive the user's

    def alive(self) -> bool:
        return all(ref() is not None and ref()._dropped is None for ref in self.captured)


class Compiled:
    """A function traced once per argument signature and replayed with CallRecording."""

    def __init__(self, fn: Callable, verify: bool = False) -> None:
        self.fn = fn
        self.verify = verify
        self._traces: dict[Any, _Trace] = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec, spec_text = _flatten(args, kwargs)
        tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, Tensor)]
        mesh = tensors[0][1]._mesh if tensors else active_mesh()
        if mesh is None:
            raise RuntimeError("a compiled function needs mesh tensor arguments or an active mesh")
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
        trace = self._traces.get(key)
        if trace is not None and not trace.alive():
            trace = None
        if trace is None:
            trace = self._traces[key] = self._trace(mesh, leaves, spec, tensors)
        elif self.verify and not trace.verified:
            again = self._trace(mesh, leaves, spec, tensors, define=False)
            _compare(self.fn, trace.messages, again.messages)
            trace.verified = True
        return _call_recording(mesh, trace, [t for _, t in tensors])

    def _trace(
        self,
        mesh: DeviceMesh,
        leaves: list[Any],
        spec: TreeSpec,
        tensors: list[tuple[int, Tensor]],
        define: bool = True,
    ) -> _Trace:
        session = mesh._session
        with session.lock:
            if session.capture is not None:
                raise RuntimeError(
                    "compiled functions cannot run inside coalescing() or another compiled function"
                )
            capture = session.capture = Capture("recording", session.new_id())
            first_id = capture.first_id
            try:
                stand_ins = list(leaves)
                formals = {}
                storages: dict[int, Any] = {}
                for index, (position, t) in enumerate(tensors):
                    storage = storages.get(id(t._storage))
                    formal = Tensor(
                        t._mkey, session, t._mesh, t._stream, session.new_ref(), storage
                    )
                    storages.setdefault(id(t._storage), formal._storage)
                    capture.add(
                        t._mesh._ranks,
                        m.RecordingFormal(formal._ref, index, session.stream_ref(t._stream)),
                    )
                    stand_ins[position] = formals[index] = formal
                args, kwargs = tree_unflatten(stand_ins, spec)
                with recorded_breakpoints():  # breakpoint() in fn stops every replay
                    out = self.fn(*args, **kwargs)
                out_leaves, out_spec = tree_flatten(out)
                outputs = []
                for j, h in enumerate(x for x in out_leaves if isinstance(x, Tensor)):
                    if h.requires_grad:
                        raise ValueError("outputs of a compiled function may not require grad")
                    capture.add(
                        h._mesh._ranks, m.RecordingResult(h._ref, j, session.stream_ref(h._stream))
                    )
                    is_formal = next((i for i, f in formals.items() if f is h), None)
                    outputs.append((h._mkey, h._stream, is_formal))
                open_borrows = [b for b in capture.borrows if not b.dropped]
                if open_borrows:
                    raise RuntimeError(
                        "all borrows created within a compiled function must be "
                        f"dropped within it ({open_borrows})"
                    )
            except BaseException:
                _abandon(capture)
                raise
            finally:
                session.capture = None
            for h in capture.created:
                h._owns_ref = False  # internal to the recording: the replay deletes them
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
            captured = [weakref.ref(capture.captured[r]) for r in used if r in capture.captured]
            ranks = sorted({r for ranks, _ in capture.messages for r in ranks})
            ref = session.new_ref()
            if define:
                _define_recording(session, ref, ranks, capture.messages, len(outputs), len(formals))
            template = [TENSOR_SLOT if isinstance(x, Tensor) else x for x in out_leaves]
            trace = _Trace(
                ref,
                ranks,
                formals,
                outputs,
                template,
                out_spec,
                captured,
                list(mutated),
                capture.messages,
            )
            trace.streams = session.streams_named(capture.messages)
            return trace


def compile(
    fn: Callable | None = None, *, verify: bool = False
) -> Compiled | Callable[[Callable], Compiled]:
    """Trace ``fn`` once per argument signature into a recording and replay it (a decorator)."""
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


def _abandon(capture: Capture) -> None:
    """A trace failed: nothing it captured was sent, so its handles and borrows name
    nothing on the ranks and must not be deleted or dropped there."""
    for h in capture.created:
        h._owns_ref = False
    for borrow in capture.borrows:
        if not borrow.dropped:
            borrow.forget("the compiled function that borrowed it failed")


def _define_recording(
    session: Session, ref: m.Ref, ranks: list[int], messages: list, nresults: int, nformals: int
) -> None:
    """Send a traced recording to each of its ranks, in chunks (never captured)."""
    with session.lock:
        for rank in ranks:
            commands = [msg for msg_ranks, msg in messages if rank in msg_ranks]
            chunks = [commands[i : i + CHUNK] for i in range(0, len(commands), CHUNK)] or [[]]
            for index, chunk in enumerate(chunks):
                session.send_setup(
                    (rank,), m.DefineRecording(ref, nresults, nformals, chunk, len(chunks), index)
                )


def _call_recording(mesh: DeviceMesh, trace: _Trace, actuals: list[Tensor]) -> Any:
    """Replay a recording: one CallRecording to its ranks; returns its outputs."""
    session = mesh._session
    with session.lock:
        if session.capture is not None:
            raise RuntimeError(
                "a compiled function cannot be called while messages are being captured"
            )
        for t in actuals:
            check_usable(t)
        first_use(session, actuals)
        results, handles = [], []
        for meta, stream, is_formal in trace.outputs:
            ref = session.new_ref()
            storage = actuals[is_formal]._storage if is_formal is not None else None
            handles.append(Tensor(meta, session, mesh, stream, ref, storage))
            results.append(ref)
        captured = [ref() for ref in trace.captured]
        changed = [
            actuals[i]
            if i is not None
            else next((h for h in captured if h is not None and h._ref.id == ref), None)
            for i, ref in trace.mutated
        ]
        mutates = mutated_refs([h for h in changed if h is not None])
        seq = session.new_seq()
        uses = [a._ref.id for a in actuals] + [h._ref.id for h in captured if h is not None]
        session.invoke(seq, uses, [r.id for r in results] + mutates)
        session.send(
            tuple(trace.ranks), m.CallRecording(seq, trace.ref, results, [a._ref for a in actuals])
        )
    it = iter(handles)
    leaves = [next(it) if x is TENSOR_SLOT else x for x in trace.template]
    return tree_unflatten(leaves, trace.out_spec)


def _normalize(messages: list[tuple[tuple[int, ...], Any]]) -> list:
    """Messages with ids renumbered by first appearance and seqs dropped (for comparison)."""
    ids: dict[int, int] = {}

    def norm(x: Any) -> Any:
        if isinstance(x, (m.Ref, m.StreamRef)):
            return (type(x).__name__, ids.setdefault(int(x), len(ids)))
        if isinstance(x, m.ArgsKwargs):
            return norm(x.to_python())
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return tuple(norm(v) for v in x)
        if hasattr(x, "_fields"):
            return (type(x).__name__,) + tuple(norm(v) for f, v in zip(x._fields, x) if f != "seq")
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
