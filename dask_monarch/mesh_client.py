"""The client state every view of one root mesh shares (Monarch's ``Client``).

A :class:`MeshClient` owns the :class:`~dask_monarch.controller.Controller`
and everything the user API needs on top of the raw protocol: ref and seq
allocation, the dependency :class:`~dask_monarch.history.History`, fetch
futures, lazily created streams, meshes and communicators, batched deletes,
and the capture used by ``coalescing`` and ``compile``. Reports arrive on the
client's event loop thread (a controller listener); everything else runs on
the user's thread; one lock keeps them apart.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import sys
import threading
import time
from collections import defaultdict
from typing import Any

from .controller.controller import Controller
from .controller.history import History
from .exceptions import DeviceException, RemoteException
from .propagation import Propagator, warm_up
from .protocol import messages as m
from .stream import DEFAULT, Borrow, Stream, get_active_stream
from .tensor import Tensor, argument, check_mutable, check_usable

_tuple_new = tuple.__new__
STATUS_EVERY = 10_000  # ask for progress at least this often, so the history can be pruned
DELETE_BATCH = 1024  # refs deleted in one DeleteRefs (earlier at fetches and exit) ...
# ... or earlier once the dropped handles name this many bytes: 1024 dropped activations of a
# real model are gigabytes the ranks (GPUs) would keep for nothing.
DELETE_BYTES = 64 << 20


class MeshFuture(concurrent.futures.Future):
    """The value of a fetch: resolves once every rank has passed it (``.result()``)."""

    def __init__(self, client: MeshClient, seq: int, ranks: int = 1):
        super().__init__()
        self._client = client
        self.seq = seq
        self.ranks = ranks  # values expected: one per rank, returned as a list when > 1

    def result(self, timeout: float | None = None) -> Any:
        self._client.controller.flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return super().result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                broken = self._client.controller.broken
                if broken is not None:
                    raise broken from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the fetch of seq {self.seq} did not resolve within "
                                       f"{timeout}s") from None

    def exception(self, timeout: float | None = None):
        try:
            self.result(timeout)
        except (RemoteException, DeviceException) as e:
            return e
        return None


class _Capture:
    """Messages held back instead of sent (coalescing, or a recording being traced)."""

    def __init__(self, kind: str, first_id: int = 0):
        self.kind = kind
        self.first_id = first_id  # refs below it existed before the capture
        self.messages: list[tuple[tuple[int, ...], Any]] = []
        self.created: list = []  # handles made while tracing: internal to the recording
        self.captured: dict[int, Any] = {}  # outside handles a traced op used, by ref id
        self.borrows: list = []  # borrows created while tracing

    @property
    def tracing(self) -> bool:
        return self.kind == "recording"

    def add(self, ranks: tuple[int, ...], message: Any) -> None:
        self.messages.append((ranks, message))

    def note(self, inputs, outputs=()) -> None:
        """Remember the outside tensors traced ops use and the handles they make."""
        first = self.first_id
        for h in inputs:
            if h is not None and h._ref.id < first:
                self.captured[h._ref.id] = h
        self.created.extend(h for h in outputs if h is not None)


class MeshClient:
    """Ids, history, futures and setup state shared by every view of one root mesh."""

    def __init__(self, client, world_size: int):
        warm_up()  # before the controller freezes the GC: see propagation.warm_up
        self.controller = Controller(client, world_size)
        self.world = tuple(range(world_size))
        self.lock = threading.RLock()
        self.history = History()
        self.propagator = Propagator()
        self._ids = itertools.count(1)
        self._seq = 0
        self._status_requested_at = 0
        self._streams: dict[Stream, m.StreamRef] = {}
        self._meshes: dict[tuple, m.Ref] = {}
        self._network = False
        self._comms: set = set()
        self._pending_deletes: list[tuple[tuple[int, ...], int]] = []
        self._pending_bytes = 0  # what the pending deletes' handles name (views overcount)
        self.capture: _Capture | None = None
        self._futures: dict[int, MeshFuture] = {}
        self._values: dict[int, dict[int, Any]] = defaultdict(dict)
        self._first_incomplete = [0] * world_size
        self._completion = threading.Condition(self.lock)
        self._unobserved: dict[int, RemoteException] = {}
        self.closed = False
        self.controller.add_listener(self._on_message)

    # -- ids ----------------------------------------------------------------------------------

    def new_ref(self) -> m.Ref:
        return m.Ref(next(self._ids))

    def new_id(self) -> int:
        return next(self._ids)

    def new_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    # -- sending ------------------------------------------------------------------------------

    def send(self, ranks: tuple[int, ...], message: Any) -> None:
        """Send (or capture) a message; pending deletes go out first."""
        if self.capture is not None:
            self.capture.add(ranks, message)
            return
        if len(self._pending_deletes) >= DELETE_BATCH or self._pending_bytes >= DELETE_BYTES:
            self._flush_deletes()
        self.controller.send(ranks, message)
        if self._seq - self._status_requested_at > STATUS_EVERY:
            self.request_status()

    def send_setup(self, ranks: tuple[int, ...], message: Any) -> None:
        """Setup messages (streams, meshes, communicators) are never captured."""
        self.controller.send(ranks, message)

    def drop_ref(self, mesh, ref: m.Ref, nbytes: int = 0) -> None:
        """Forget ``ref`` (a handle of ``nbytes``) on ``mesh``'s ranks (batched; safe from
        ``__del__`` on any thread)."""
        if not self.closed:
            self._pending_deletes.append((mesh._ranks, ref.id))
            self._pending_bytes += nbytes

    def _flush_deletes(self) -> None:
        pending, self._pending_deletes = self._pending_deletes, []
        self._pending_bytes = 0
        by_ranks: dict[tuple, list[m.Ref]] = defaultdict(list)
        for ranks, ref in pending:
            by_ranks[ranks].append(m.Ref(ref))
        with self.lock:
            for ranks, refs in by_ranks.items():
                self.controller.send(ranks, m.DeleteRefs(refs))
            self.history.drop(r.id for refs in by_ranks.values() for r in refs)

    def invoke(self, seq: int, uses, defs) -> BaseException | None:
        """Register an invocation in the history (not while tracing: nothing runs then)."""
        capture = self.capture
        if capture is not None and capture.tracing:
            return None
        failure = self.history.invoke(seq, uses, defs)
        self.history.invocations[seq].origin = _user_frame()
        return failure

    def request_status(self) -> None:
        """Ask every rank to report progress up to the last seq issued (deletes go first)."""
        if self._pending_deletes and self.capture is None:
            self._flush_deletes()
        self._status_requested_at = self._seq
        self.controller.send(self.world, m.RequestStatus(max(self._seq - 1, 0)))

    # -- lazily created state on the ranks ----------------------------------------------------

    def stream_ref(self, stream: Stream | None = None) -> m.StreamRef:
        stream = stream or get_active_stream()
        ref = self._streams.get(stream)
        if ref is None:
            ref = self._streams[stream] = m.StreamRef(self.new_id())
            self.send_setup(self.world, m.CreateStream(ref, stream.creation_mode))
        return ref

    def mesh_ref(self, mesh) -> m.Ref:
        key = (mesh._names, mesh._slice)
        ref = self._meshes.get(key)
        if ref is None:
            ref = self._meshes[key] = self.new_ref()
            self.send_setup(mesh._ranks, m.CreateDeviceMesh(ref, list(mesh._names), mesh._slice))
        return ref

    def ensure_network(self) -> None:
        if not self._network:
            self._network = True
            self.send_setup(self.world, m.BackendNetworkInit())

    def ensure_split(self, mesh, stream: m.StreamRef, dims: tuple[str, ...]) -> None:
        mesh_ref = self.mesh_ref(mesh)
        key = ("split", mesh_ref.id, stream.id, dims)
        if key not in self._comms:
            self.ensure_network()
            self._comms.add(key)
            self.send_setup(self.world, m.SplitComm(list(dims), mesh_ref, stream))

    def ensure_p2p(self, src: m.StreamRef, dst: m.StreamRef) -> None:
        key = ("p2p", src.id, dst.id)
        if key not in self._comms:
            self.ensure_network()
            self._comms.add(key)
            self.send_setup(self.world, m.BackendNetworkPointToPointInit(src, dst))

    def process_group(self, mesh, dims: tuple[str, ...]):
        from .mesh import RemoteProcessGroup

        with self.lock:
            ref = self.new_ref()
            self.send_setup(mesh._ranks, m.CreateRemoteProcessGroup(ref, self.mesh_ref(mesh),
                                                                    list(dims)))
            return RemoteProcessGroup(mesh, dims, ref)

    def ensure_group_split(self, group, stream: m.StreamRef) -> None:
        key = ("group", group.ref.id, stream.id)
        if key not in self._comms:
            self.ensure_network()
            self._comms.add(key)
            self.send_setup(group.mesh._ranks, m.SplitCommForProcessGroup(group.ref, stream))

    def first_use(self, handles) -> None:
        """Borrowed tensors tell their lender's stream on first use (lazily, §1.6)."""
        for h in handles:
            borrow = h._storage.borrow
            if borrow is not None and not borrow.first_used:
                borrow.first_used = True
                message = m.BorrowFirstUse(borrow.id)
                capture = self.capture
                if capture is not None and capture.tracing and borrow not in capture.borrows:
                    self.send_setup(h._mesh._ranks, message)  # borrowed outside: not recorded
                else:
                    self.send(h._mesh._ranks, message)

    # -- ops on mesh tensors ------------------------------------------------------------------

    def call_op(self, func, info, plan, mesh, stream, args, kwargs, ref_args, ref_kwargs,
                handles):
        """Send one op as a CallFunction and return handles for its outputs."""

        with self.lock:
            stream_ref = self.stream_ref(stream)
            if handles:
                self.first_use(handles)
            mutated = []
            for index in info.writes:
                value = argument(info, args, kwargs, index)
                if isinstance(value, Tensor):
                    mutated.append(value)
                elif isinstance(value, (list, tuple)):
                    mutated.extend(v for v in value if isinstance(v, Tensor))
            mutates = _mutated_refs(mutated)
            outputs, results = [], []
            for out in plan.outputs:
                if out is None:
                    outputs.append(None)
                    results.append(None)
                    continue
                if out.is_arg:
                    outputs.append(argument(info, args, kwargs, out.alias))
                    results.append(None)
                    continue
                storage = None
                if out.alias is not None:
                    base = argument(info, args, kwargs, out.alias)
                    if isinstance(base, (list, tuple)):
                        base = base[0] if base else None
                    storage = base._storage if isinstance(base, Tensor) else None
                ref = m.Ref(next(self._ids))
                outputs.append(Tensor(out.shape, out.stride, out.offset, out.dtype, out.device,
                                      self, mesh, stream, ref, storage))
                results.append(ref)
            if not results:
                results = [None]
            seq = self.new_seq()
            defs = [r.id for r in results if r is not None] + mutates
            self.invoke(seq, [h._ref.id for h in handles], defs)
            if self.capture is not None and self.capture.tracing:
                self.capture.note(handles, [o for o in outputs if isinstance(o, Tensor)])
            flat = not any(type(a) in (list, tuple) for a in ref_args)
            if ref_kwargs:
                flat = flat and not any(type(v) in (list, tuple) for v in ref_kwargs.values())
            self.send(mesh._ranks, m.CallFunction._make((
                seq, results, [m.Ref(r) for r in mutates], info.function,
                _tuple_new(m.ArgsKwargs, (ref_args, ref_kwargs, None, flat)), stream_ref, [])))
        if plan.kind == "tensor":
            return outputs[0]
        if plan.kind == "none":
            return None
        return outputs if plan.kind == "list" else tuple(outputs)

    def call_remote(self, function, mesh, stream, args, kwargs, handles, groups, spec, mutated):
        """Send a remote function call; ``spec`` is its propagated output (specs for tensors)."""
        message = lambda seq, results, mutates, stream_ref: m.CallFunction(  # noqa: E731
            seq, results, [m.Ref(r) for r in mutates], function,
            m.ArgsKwargs.from_python(args, kwargs), stream_ref, [g.ref for g in groups])
        return self._bind_outputs(spec, mesh, stream, handles, message, mutated, groups)

    def reduce(self, t, mesh, stream, dims: tuple[str, ...], reduction, scatter: bool,
               in_place: bool, out, shape: tuple[int, ...]):
        """Send a Reduce; returns the handle of its result."""

        with self.lock:
            stream_ref = self.stream_ref(stream)
            self.ensure_split(mesh, stream_ref, dims)
            inputs = [t] if out is None else [t, out]
            self.first_use(inputs)
            result = self.new_ref()
            target = t if in_place else out
            storage = target._storage if target is not None else None
            mutates = _mutated_refs([target]) if target is not None else []
            if target is not None and target is t:
                stride, offset = t.stride(), t.storage_offset()
            elif target is not None:
                stride, offset = out.stride(), out.storage_offset()
            else:
                stride, offset = _contiguous(shape), 0
            handle = Tensor(shape, tuple(stride), offset, t.dtype, t.device, self, mesh, stream,
                            result, storage)
            seq = self.new_seq()
            self.invoke(seq, [h._ref.id for h in inputs], [result.id] + mutates)
            if self.capture is not None and self.capture.tracing:
                self.capture.note(inputs, [handle])
            factory = m.Factory(tuple(t.shape), t.dtype, t.layout, str(t.device))
            self.send(mesh._ranks, m.Reduce(result, t._ref, factory, self.mesh_ref(mesh),
                                            stream_ref, list(dims), reduction, scatter, in_place,
                                            out._ref if out is not None else None))
        return handle

    def send_tensor(self, t, source, dest, stream, pairs):
        """SendTensor ``t`` from mesh ``source`` to ``dest``: one message per destination slice."""

        with self.lock:
            src_ref = self.stream_ref(t._stream)
            dst_ref = self.stream_ref(stream)
            self.ensure_p2p(src_ref, dst_ref)
            self.first_use([t])
            result = self.new_ref()
            factory = m.Factory(tuple(t.shape), t.dtype, t.layout, str(t.device))
            seq = self.new_seq()
            self.invoke(seq, [t._ref.id], [result.id])
            for from_ranks, to_ranks in pairs:
                ranks = tuple(sorted(set(from_ranks) | set(to_ranks)))
                self.send(ranks, m.SendTensor(result, from_ranks, to_ranks, t._ref, factory,
                                              src_ref, dst_ref))
            shape = tuple(t.shape)
            handle = Tensor(shape, _contiguous(shape), 0, t.dtype, t.device, self, dest, stream,
                            result)
            if self.capture is not None and self.capture.tracing:
                self.capture.note([t], [handle])
            return handle

    def define_recording(self, ref: m.Ref, ranks, messages, nresults: int, nformals: int):
        """Send a traced recording to each of its ranks, in chunks (never captured)."""
        from .compiled import CHUNK

        with self.lock:
            for rank in ranks:
                commands = [msg for msg_ranks, msg in messages if rank in msg_ranks]
                chunks = [commands[i:i + CHUNK] for i in range(0, len(commands), CHUNK)] or [[]]
                for index, chunk in enumerate(chunks):
                    self.send_setup((rank,), m.DefineRecording(ref, nresults, nformals, chunk,
                                                               len(chunks), index))

    def call_recording(self, trace, mesh, actuals):
        """Replay a recording: one CallRecording to its ranks; returns its outputs."""
        from torch.utils._pytree import tree_unflatten

        with self.lock:
            if self.capture is not None:
                raise RuntimeError("a compiled function cannot be called while messages are "
                                   "being captured")
            for t in actuals:
                check_usable(t)
            self.first_use(actuals)
            results, handles = [], []
            for shape, stride, offset, dtype, device, stream, is_formal in trace.outputs:
                ref = self.new_ref()
                storage = actuals[is_formal]._storage if is_formal is not None else None
                handles.append(Tensor(shape, stride, offset, dtype, device, self, mesh, stream,
                                      ref, storage))
                results.append(ref)
            captured = [ref() for ref in trace.captured]
            changed = [actuals[i] if i is not None else next(
                (h for h in captured if h is not None and h._ref.id == ref), None)
                for i, ref in trace.mutated]
            mutates = _mutated_refs([h for h in changed if h is not None])
            seq = self.new_seq()
            uses = [a._ref.id for a in actuals] + [h._ref.id for h in captured if h is not None]
            self.invoke(seq, uses, [r.id for r in results] + mutates)
            self.send(tuple(trace.ranks), m.CallRecording(seq, trace.ref, results,
                                                          [a._ref for a in actuals]))
        from .compiled import TENSOR_SLOT

        it = iter(handles)
        leaves = [next(it) if x is TENSOR_SLOT else x for x in trace.template]
        return tree_unflatten(leaves, trace.out_spec)

    def pipe_recv(self, pipe, mesh, stream, spec):
        """PipeRecv on every rank of the pipe's mesh; returns the received mesh tensors."""
        self.flush_pending()
        return self._bind_outputs(spec, mesh, stream, [], lambda seq, results, _, stream_ref: (
            m.PipeRecv(seq, results, pipe.ref, stream_ref)))

    def pipe_send(self, pipe, mesh, stream, value) -> None:

        with self.lock:
            stream_ref = self.stream_ref(stream)
            handles = [h for h in _tensors_in(value) if isinstance(h, Tensor)]
            self.first_use(handles)
            seq = self.new_seq()
            self.invoke(seq, [h._ref.id for h in handles], [])
            self.send(mesh._ranks, m.SendValue(seq, pipe.ref, [], None,
                                               m.ArgsKwargs.from_python((value,)), stream_ref))

    def actor_call(self, actors, method, handles, args, kwargs, spec):
        """An actor method on every rank: a future of per-rank values, or mesh tensors."""
        if self.capture is not None and self.capture.tracing:
            raise NotImplementedError("actor calls inside compiled functions are not supported")
        mesh = actors.mesh
        stream = get_active_stream()
        local_state = [h._ref for h in handles]

        def message(seq, results, _, stream_ref):
            self.controller.call_actor(mesh._ranks, actors.broker, seq, stream_ref, method,
                                       args, kwargs)
            params = m.ActorCallParams(seq, actors.broker, local_state, [], stream_ref)
            if results is None:
                return m.SendResultOfActorCall(seq, actors.broker, local_state, [], stream_ref)
            return m.CallActorMethod(results, params)

        if spec is None:
            if self.capture is not None:
                raise NotImplementedError("NYI: fetching results during a coalescing block")
            with self.lock:
                stream_ref = self.stream_ref(stream)
                self.first_use(handles)
                self.flush_pending()
                seq, future = self._expect_result(handles, len(mesh._ranks))
                self.send(mesh._ranks, message(seq, None, (), stream_ref))
                self.request_status()
            self.controller.flush()
            return future
        self.flush_pending()
        return self._bind_outputs(spec, mesh, stream, handles, message)

    def _bind_outputs(self, spec, mesh, stream, handles, make, mutated=(), groups=()):
        """Send ``make(seq, results, mutates, stream_ref)``, a call whose outputs are ``spec``'s
        tensors (or nothing when ``spec`` is None); returns handles in ``spec``'s shape."""
        from torch.utils._pytree import tree_flatten, tree_unflatten

        from .remote_function import _Spec

        with self.lock:
            stream_ref = self.stream_ref(stream)
            for group in groups:
                self.ensure_group_split(group, stream_ref)
            self.first_use(handles)
            mutates = _mutated_refs(mutated)
            leaves, treespec = tree_flatten(spec)
            results, out = [], []
            for leaf in leaves:
                if isinstance(leaf, _Spec):
                    shape, stride, offset, dtype, device, alias = leaf
                    ref = self.new_ref()
                    out.append(Tensor(shape, stride, offset, dtype, device, self, mesh, stream,
                                      ref, alias._storage if alias is not None else None))
                    results.append(ref)
                else:
                    out.append(leaf)
                    results.append(None)
            seq = self.new_seq()
            self.invoke(seq, [h._ref.id for h in handles],
                        [r.id for r in results if r is not None] + mutates)
            if self.capture is not None and self.capture.tracing:
                self.capture.note(handles, [o for o in out if isinstance(o, Tensor)])
            self.send(mesh._ranks, make(seq, results, mutates, stream_ref))
        return None if spec is None else tree_unflatten(out, treespec)

    def flush_pending(self) -> None:
        """Hand everything captured or buffered so far to the controller (internal steps that
        bypass the capture must not overtake it)."""
        if self._pending_deletes and self.capture is None:
            self._flush_deletes()

    # -- fetching -----------------------------------------------------------------------------

    def fetch(self, mesh, rank: int, value: Any, function: m.FunctionPath | m.Cloudpickle | None
              = None, args_kwargs: m.ArgsKwargs | None = None) -> MeshFuture:
        """Send ``value`` (or ``function(*args)``) from global ``rank`` back to the client."""
        if self.capture is not None:
            raise NotImplementedError("NYI: fetching results during a coalescing block")

        with self.lock:
            stream_ref = self.stream_ref()
            if args_kwargs is None:
                args_kwargs = m.ArgsKwargs.from_python((value,))
            handles = [h for h in _tensors_in(value) if isinstance(h, Tensor)]
            for h in handles:
                check_usable(h)
            self.first_use(handles)
            seq, future = self._expect_result(handles, 1)
            self.send((rank,), m.SendValue(seq, None, [], function, args_kwargs, stream_ref))
            self.request_status()
        self.controller.flush()
        return future

    def _expect_result(self, handles: list, ranks: int) -> tuple[int, MeshFuture]:
        """A seq whose value ``ranks`` ranks will send back, and the future that gets it
        (failed at once when ``handles`` depend on a failure already known)."""
        seq = self.new_seq()
        future = MeshFuture(self, seq, ranks=ranks)
        failure = self.invoke(seq, [h._ref.id for h in handles], [])
        if failure is not None:
            self._observe(failure)
            future.set_exception(failure)
        else:
            self._futures[seq] = future
        return seq, future

    def _observe(self, failure: BaseException) -> None:
        self._unobserved.pop(id(failure), None)

    def _on_message(self, msg) -> None:
        """A report from a rank (event loop thread): resolve futures, record failures."""
        t = type(msg)
        with self.lock:
            if t is m.FetchResult:
                if msg.seq in self._futures:
                    self._values[msg.seq][msg.rank] = msg.value
            elif t is m.RemoteFunctionFailed:
                self._failed(msg)
            elif t is m.Status:
                self._progress(msg)

    def _failed(self, msg: m.RemoteFunctionFailed) -> None:
        inv = self.history.invocations.get(msg.seq)
        origin = getattr(inv, "origin", None) if inv is not None else None
        lines = [line for line in msg.error.strip().splitlines() if line.strip()]
        summary = lines[-1] if lines else "remote function failed"
        where = f'  File "{origin[0]}", line {origin[1]}, in {origin[2]}' if origin else ""
        failure = RemoteException(summary, rank=msg.rank, seq=msg.seq, traceback=msg.error,
                                  controller_traceback=where)
        newly = self.history.fail(msg.seq, failure)
        if not newly:
            return
        self._unobserved[id(failure)] = failure
        for seq in newly:
            future = self._futures.pop(seq, None)
            if future is not None:
                self._values.pop(seq, None)
                self._observe(failure)
                future.set_exception(failure)

    def _progress(self, msg: m.Status) -> None:
        ranks = self._first_incomplete
        if msg.seq > ranks[msg.rank]:
            ranks[msg.rank] = msg.seq
        done = min(ranks)
        if done <= self.history.completed:
            return
        for seq in [s for s in self._futures if s < done]:
            future = self._futures.pop(seq)
            values = self._values.pop(seq, {})
            failure = self.history.failure(seq)
            if failure is not None:
                self._observe(failure)
                future.set_exception(failure)
            elif values and future.ranks > 1:
                future.set_result([values[r] for r in sorted(values)])
            elif values:
                future.set_result(next(iter(values.values())))
            else:
                future.set_exception(RemoteException(f"seq {seq} completed without a value",
                                                     seq=seq))
        self.history.complete(done)
        self._completion.notify_all()

    # -- borrows ------------------------------------------------------------------------------

    def borrow(self, t, stream: Stream, mutable: bool):

        with self.lock:
            check_usable(t)
            if stream is t._stream:
                raise ValueError(f"{t!r} already belongs to stream {stream.name!r}")
            if t._storage.borrow is not None:
                raise RuntimeError(f"{t!r} is itself borrowed; borrow the original tensor")
            if mutable and t._storage._lent:
                raise RuntimeError(f"cannot borrow {t!r} mutably: it is already borrowed "
                                   "immutably")
            src, dst = self.stream_ref(t._stream), self.stream_ref(stream)
            borrow_id, result = self.new_id(), self.new_ref()
            self.first_use([t])
            seq = self.new_seq()
            self.invoke(seq, [t._ref.id], [result.id])
            self.send(t._mesh._ranks, m.BorrowCreate(result, borrow_id, t._ref, src, dst))
            shape, stride, offset, dtype, device = t._mkey
            borrowed = Tensor(shape, stride, offset, dtype, device, self, t._mesh, stream, result)
            handle = Borrow(self, borrow_id, t, borrowed, mutable)
            borrowed._storage.borrow = handle
            if self.capture is not None and self.capture.tracing:
                self.capture.borrows.append(handle)
                self.capture.note([t], [borrowed])
            if mutable:
                t._storage.lent_mutably = handle
            else:
                t._storage.lent.add(handle)
            return borrowed, handle

    def drop_borrow(self, borrow: Borrow) -> None:
        with self.lock:
            capture = self.capture
            if capture is not None and capture.tracing and borrow not in capture.borrows:
                raise ValueError("cannot explicitly drop a tensor inside a compiled block that "
                                 "was borrowed outside of it")
            ranks = borrow.origin._mesh._ranks
            if not borrow.first_used:
                borrow.first_used = True
                self.send(ranks, m.BorrowFirstUse(borrow.id))
            storage = borrow.borrowed._storage
            views = [h for h in storage.handles if h is not borrow.borrowed and h._owns_ref]
            if views:
                self.send(ranks, m.DeleteRefs([h._ref for h in views]))
            for h in storage.handles:
                h._owns_ref = False
                h._dropped = h._dropped or f"the borrow {borrow.id} it came from was dropped"
            self.send(ranks, m.BorrowLastUse(borrow.id))
            self.send(ranks, m.BorrowDrop(borrow.id))
            seq = self.new_seq()
            origin = borrow.origin._storage
            if borrow.mutable:  # the lender's aliases now hold what the borrower made of them
                self.invoke(seq, [borrow.borrowed._ref.id], origin.refs())
                origin.lent_mutably = None
            else:
                self.invoke(seq, [], [])
                origin.lent.discard(borrow)
            borrow.dropped = True

    def forget_borrow(self, borrow: Borrow, why: str) -> None:
        """Undo a borrow that never reached the ranks (its trace failed), on the client only.

        Dropping it would send the ranks the steps of a borrow they never saw,
        which breaks the mesh; leaving it would keep its lender lent.
        """
        with self.lock:
            for h in borrow.borrowed._storage.handles:
                h._owns_ref = False
                h._dropped = h._dropped or why
            origin = borrow.origin._storage
            if borrow.mutable:
                origin.lent_mutably = None
            else:
                origin.lent.discard(borrow)
            borrow.dropped = True

    # -- shutdown -----------------------------------------------------------------------------

    def exit(self, timeout: float = 600) -> None:
        """Wait for everything sent, release the ranks, raise a failure nobody fetched."""
        if self.closed:
            return
        try:
            with self.lock:
                self.request_status()
                target = self._seq
            self.controller.flush()
            deadline = time.monotonic() + timeout
            with self._completion:
                while self.history.completed < target:
                    broken = self.controller.broken
                    if broken is not None:
                        raise broken
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"mesh.exit() waited {timeout}s for the ranks")
                    self._completion.wait(min(remaining, 0.1))
            unobserved = next(iter(self._unobserved.values()), None)
        finally:
            self.closed = True
            self.controller.close()
        if unobserved is not None:
            raise unobserved


def _mutated_refs(handles) -> list[int]:
    """Every live alias of every mutated storage (all of them are redefined by the op)."""

    if not handles:
        return []
    refs: dict[int, None] = {}
    for h in handles:
        check_mutable(h)
        for ref in h._storage.refs():
            refs[ref] = None
    return list(refs)


def _user_frame():
    """Where the user's code issued the current op (file, line, function), cheaply."""
    f = sys._getframe(2)
    internal = _internal_code
    while f is not None:
        code = f.f_code
        inside = internal.get(code)
        if inside is None:
            name = code.co_filename
            inside = internal[code] = (name.startswith(_INTERNAL) or "/torch/" in name
                                       or name.startswith("<frozen"))
        if not inside:
            return (code.co_filename, f.f_lineno, code.co_name)
        f = f.f_back
    return None


_INTERNAL = __file__.rsplit("/", 1)[0]
_internal_code: dict = {}  # code object -> is it dask_monarch's or torch's own


def _contiguous(shape) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _tensors_in(value) -> list:
    from torch.utils._pytree import tree_leaves

    return tree_leaves(value)


__all__ = ["MeshClient", "MeshFuture", "DEFAULT"]
