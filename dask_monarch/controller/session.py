"""The state every view of one root mesh shares on the controller side (Monarch's ``Client``).

A :class:`Session` owns the :class:`~dask_monarch.controller.Controller` and
what the user API needs on top of the raw protocol: ref, id and seq
allocation, the dependency :class:`~dask_monarch.controller.history.History`,
batched deletes, the refs created lazily on the ranks (streams, meshes,
communicators), the :class:`Capture` used by ``coalescing`` and ``compile``,
fetch futures and the ranks' reports. It builds no message of a user-API
concept: each concept module (``tensor``, ``collectives``, ``compiled``, ...)
builds its own and sends it through :meth:`Session.send`. Reports arrive on
the client's event loop thread (a controller listener); everything else runs
on the user's thread; one lock keeps them apart.
What the lock protects stays in one class.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from distributed import Client

from .. import config
from ..exceptions import RemoteException
from ..protocol import messages as m
from ..protocol.ndslice import Slice
from ..protocol.rules import streams_named
from ..protocol.wire import ValueFailed
from .cancel import cancel_session
from .controller import Controller, fresh_copy
from .futures import MeshFuture, waiting_for
from .history import History
from .seam import ControllerSeam, Substitute

STATUS_EVERY = 10_000  # ask for progress at least this often, so the history can be pruned
DELETE_BATCH = 1024  # refs deleted in one DeleteRefs (earlier at fetches and exit) ...
# ... or earlier once the dropped handles name this many bytes: 1024 dropped activations of a
# real model are gigabytes the ranks (GPUs) would keep for nothing.
DELETE_BYTES = 64 << 20
REPORT_RETRY_S = 0.002  # a report that found the session's lock taken is applied after this


class Capture:
    """Messages held back instead of sent (coalescing, or a recording being traced)."""

    def __init__(self, kind: str, first_id: int = 0) -> None:
        self.kind = kind
        self.first_id = first_id  # refs below it existed before the capture
        self.messages: list[tuple[tuple[int, ...], Any]] = []
        self.created: list = []  # handles made while tracing: internal to the recording
        self.captured: dict[int, Any] = {}  # outside handles a traced op used, by ref id
        self.borrows: list = []  # borrows created while tracing
        # the Streams its messages run on, by ref id: one made inside a traced function lives
        # until the recording holds it (compiled.py), however soon its tensors are gone
        self.streams: dict[int, Any] = {}
        # what a replay must find unchanged (dask_monarch.compile's guards):
        self.known: dict[int, tuple[Any, Any]] = {}  # outside ref id -> (handle, known value
        #                                              before the trace first touched it)
        self.reads: list = []  # call sites where Python read a value the client knows
        self.read_roots: set = set()  # what those values came from (see roots())
        self.derived: dict[int, frozenset] = {}  # traced ref id -> the roots of its known value
        self.locals: list = []  # (local tensor, its version): placed on the mesh inside

    @property
    def tracing(self) -> bool:
        return self.kind == "recording"

    def no_fetch(self, what: str = "dm.inspect") -> RuntimeError:
        """Why ``what`` (a fetch) cannot run while messages are held back: nothing has run."""
        if self.tracing:
            return RuntimeError(
                f"{what} inside a dm.compile function: a recording replays on the ranks "
                "without the client, so it cannot hand values back; return the tensor and "
                "fetch it after the call (y = step(x); dask_monarch.inspect(y))"
            )
        return RuntimeError(
            f"{what} inside a coalescing() block: the block sends its messages when it ends, "
            "so nothing of it has run yet; fetch after the block (keep the handle: y = ... "
            "inside, dask_monarch.inspect(y) after it)"
        )

    def add(self, ranks: tuple[int, ...], message: m.WorkerMessage) -> None:
        self.messages.append((ranks, message))

    def note(self, inputs: Iterable[tuple[int, Any]], outputs: Iterable[Any] = ()) -> None:
        """Remember the outside handles traced work uses (``(ref id, handle)`` pairs), with
        the values the client knows of them, and the handles it makes."""
        first = self.first_id
        for ref, handle in inputs:
            if ref < first:
                self.captured[ref] = handle
                if handle._known is not None and ref not in self.known:
                    self.known[ref] = (handle, handle._known.clone())
        self.created.extend(o for o in outputs if hasattr(o, "_owns_ref"))  # handles only

    def roots(self, handle: Any) -> frozenset:
        """The outside values (ref ids) and arguments (``("formal", index)``) the value the
        client knows of ``handle`` was computed from."""
        ref = handle._ref.id
        if ref < self.first_id:
            return frozenset((ref,))
        return self.derived.get(ref, frozenset())

    def derive(self, outputs: Iterable[Any], inputs: Iterable[Any]) -> None:
        """The client computed the values of ``outputs`` from those of ``inputs``."""
        roots = frozenset().union(*(self.roots(h) for h in inputs))
        first, derived = self.first_id, self.derived
        for out in outputs:
            if out is not None and out._ref.id >= first:
                ref = out._ref.id
                derived[ref] = roots | derived.get(ref, frozenset())

    def formal(self, handle: Any, index: int) -> None:
        """The value the client knows of ``handle`` is the trace's argument ``index``."""
        self.derived[handle._ref.id] = frozenset((("formal", index),))

    def read_known(self, handles: Iterable[Any], site: Any) -> None:
        """Python read the value of ``handles``, which the client knows, at ``site``: the
        recording is only right while the values they came from stay the same."""
        handles = list(handles)
        self.reads.append(site)
        self.note([(h._ref.id, h) for h in handles])
        for h in handles:
            self.read_roots |= self.roots(h)


_new_id = int.__new__  # builds a Ref (an int subclass) without CheckedId's checks
_live: weakref.WeakSet = weakref.WeakSet()  # its controller's listener keeps a Session alive


def live_sessions() -> list[Session]:
    """The user-API meshes of this process not exited yet (``dask-monarch run`` exits them)."""
    return [s for s in list(_live) if not s.closed]


@atexit.register
def _exit_at_interpreter_exit() -> None:
    """A program that ends without ``mesh.exit()`` (``python train.py``): its meshes are
    exited here, their work drained for up to ``timeouts.close``, and a failure nobody
    fetched is written on stderr instead of lost. Registered after the controllers' own exit
    hook, so it runs before it (and before distributed's: the client still works). Under
    ``dask-monarch run`` the meshes were exited already, and the exit status says so."""
    open_ = live_sessions()
    if not open_:
        return
    timeout = config.seconds("timeouts.close") or 0.0
    logging.getLogger("dask_monarch.controller").warning(
        "dask_monarch: %s still open at interpreter exit (%s): exited here, its work waited "
        "for up to %gs (dask_monarch.timeouts.close); call mesh.exit() to end a mesh yourself",
        f"{len(open_)} meshes were" if len(open_) > 1 else "1 mesh was",
        ", ".join(f"mesh {s.controller.mesh_id}, {s.controller.world_size} ranks" for s in open_),
        timeout,
    )
    for session in open_:
        try:
            session.exit(timeout=timeout)
            continue
        except RemoteException as e:
            failure: RemoteException | None = e
        except Exception:  # broken or closed: a failure that arrived before still counts
            failure = next(iter(session._unobserved.values()), None)
        if failure is not None:
            sys.stderr.write(
                f"dask_monarch: the program ended with a failure nobody fetched, on mesh "
                f"{session.controller.mesh_id}, which no mesh.exit() ended:\n{failure}\n"
                "(fetch results with dask_monarch.inspect, or call mesh.exit() at the end, to "
                "see failures where they happen)\n"
            )
            sys.stderr.flush()


class Session:
    """Ids, history, futures and setup state shared by every view of one root mesh."""

    def __init__(
        self,
        client: Client,
        world_size: int,
        *,
        workers: list[str] | None = None,
        distinct_hosts: bool = False,
    ) -> None:
        ahead = config.get("flush.max-ahead")  # checked before any worker is claimed
        if ahead is not None and (type(ahead) is not int or ahead < 2):
            raise ValueError(
                f"dask_monarch.flush.max-ahead must be an int of at least 2 or null, got {ahead!r}"
            )
        self._max_ahead: int | None = ahead
        self.lazy_views = bool(config.get("lazy-views", True))  # tensor.py: views send nothing
        self.unsent_views: weakref.WeakSet = weakref.WeakSet()  # lazy views alive, maybe sent
        # statuses often enough that the ranks' progress is known well before the limit
        self._status_every = STATUS_EVERY if ahead is None else min(STATUS_EVERY, ahead // 4)
        self.controller = Controller(
            client, world_size, workers=workers, distinct_hosts=distinct_hosts
        )
        self.backend = self.controller.backend  # 'auto' (NCCL for CUDA tensors) or 'gloo'
        self.world = tuple(range(world_size))
        self.lock = threading.RLock()
        self.history = History()
        self._ids = itertools.count(1)
        self._seq = 0
        self._status_requested_at = 0
        self._streams: dict[int, m.StreamRef] = {}  # id(Stream) -> its ref, while it lives
        self._stream_objects: dict[int, weakref.ref] = {}  # stream ref id -> the Stream
        self._dead_streams: list[m.StreamRef] = []  # garbage Streams not yet dropped on the ranks
        self._orphans: list = []  # undropped Borrows a GC found while the lock was taken
        self._dropping_orphans = False
        self._meshes: dict[tuple, m.Ref] = {}
        self._network = False
        self._comms: set = set()
        self._pending_deletes: list[tuple[tuple[int, ...], int]] = []  # (ranks, Ref or id)
        self._pending_bytes = 0  # what the pending deletes' handles name (views overcount)
        self.capture: Capture | None = None
        self._futures: dict[int, MeshFuture] = {}
        self._values: dict[int, dict[int, Any]] = defaultdict(dict)
        self._first_incomplete = [0] * world_size
        self._completion = threading.Condition(self.lock)
        self._unobserved: dict[int, RemoteException] = {}
        self.implicit_fetches = 0  # values Python asked the ranks for (implicit_fetch)
        # while a controller stands in (substitute): told of every handle made, and what
        # mesh.exit() does instead
        self.watch: Callable[[int, Any, int, tuple[int, ...]], None] | None = None
        self._exit_instead: Callable[[], None] | None = None
        self.closed = False
        self._arrived: deque = deque()  # reports not applied yet: the lock was taken
        self._apply_armed = False  # a retry of them is due on the event loop
        self.controller.add_listener(self._on_message, consume=True)  # futures hold what they need
        controller = self.controller  # its own: a dry run's stand-in may take its place
        controller.on_shutdown = lambda: self._fail_pending(controller)
        _live.add(self)

    # -- ids ----------------------------------------------------------------------------------

    def new_ref(self) -> m.Ref:
        return _new_id(m.Ref, next(self._ids))  # unchecked: our own counter's ids are valid

    def new_id(self) -> int:
        return next(self._ids)

    def new_seq(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    @property
    def stand_in(self) -> ControllerSeam | None:
        """The controller standing in for this session's own (a dry run's), or None."""
        return self.controller if self._exit_instead is not None else None

    def send_views(self) -> None:
        """Send every lazy view (tensor.py) now: a compiled trace, coalescing or a dry run is
        about to start, and a view made before it must be a ref of its own on the ranks."""
        for h in list(self.unsent_views):
            if h._lazy is not None:
                h._ref  # noqa: B018 (naming the ref of a lazy view sends it)
        self.unsent_views = weakref.WeakSet()

    # -- sending ------------------------------------------------------------------------------

    def send(self, ranks: tuple[int, ...], message: m.WorkerMessage) -> None:
        """Send (or capture) a message; pending deletes go out first."""
        if self.capture is not None:
            self.capture.add(ranks, message)
            return
        if (
            len(self._pending_deletes) >= DELETE_BATCH or self._pending_bytes >= DELETE_BYTES
        ) and not (_gc_state.collecting or self._dropping_orphans):
            # a finalizer's message goes before the deletes (those of its own tensors too)
            self._flush_deletes()
        self.controller.send(ranks, message)
        if self._seq - self._status_requested_at > self._status_every:
            self.request_status()
        if self._max_ahead is not None and self._seq - self.history.completed > self._max_ahead:
            self._catch_up()

    def _catch_up(self) -> None:
        """The user issued ``flush.max-ahead`` messages past what every rank has run: wait
        until the ranks are half as far behind, as CUDA's launch queue makes a host thread
        wait, so that what the client, the scheduler and the workers keep for work in flight
        stays bounded in a long loop that never fetches.

        Everything issued is flushed first, so the ranks can always get there. Never waits on
        the client's event loop (the reports arrive there), in a garbage collection's
        finalizer, while a rank is paused in the debugger, or in a dry run.
        """
        controller = self.controller
        if _gc_state.collecting or not controller.can_wait_for_ranks():
            return
        target = self._seq - self._max_ahead // 2
        if self._status_requested_at < target:
            self.request_status()
        controller.flush()
        with self._completion:  # releases the session's lock while it waits: reports apply
            while self.history.completed < target:
                broken = controller.broken
                if broken is not None:
                    raise fresh_copy(broken)
                if controller.closed or controller.debugging:
                    return
                self._completion.wait(0.05)

    def send_setup(self, ranks: tuple[int, ...], message: m.WorkerMessage) -> None:
        """Setup messages (streams, meshes, communicators) are never captured."""
        self.controller.send(ranks, message)

    def drop_ref(self, ranks: tuple[int, ...], ref: int, nbytes: int = 0) -> None:
        """Forget ref ``ref`` (a Ref, or its id; a handle of ``nbytes``) on ``ranks`` (batched;
        safe from ``__del__`` on any thread)."""
        if not self.closed:
            self._pending_deletes.append((ranks, ref))
            self._pending_bytes += nbytes

    def _flush_deletes(self) -> None:
        """Send the pending deletes, then drop the streams that became garbage."""
        pending, self._pending_deletes = self._pending_deletes, []
        self._pending_bytes = 0
        by_ranks: dict[tuple, list[m.Ref]] = defaultdict(list)
        for ranks, ref in pending:
            by_ranks[ranks].append(ref if type(ref) is m.Ref else m.Ref(ref))
        with self.lock:
            for ranks, refs in by_ranks.items():
                self.controller.send(ranks, m.DeleteRefs(refs))
            self.history.drop(r.id for refs in by_ranks.values() for r in refs)
            if self._dead_streams:
                if _gc_state.collecting:
                    # Called by a finalizer of the collection that found the stream dead: an
                    # undropped Borrow's last steps (Borrow.__del__) name it and must go first.
                    self._pending_bytes = DELETE_BYTES  # the next send drops it
                else:
                    self._drop_dead_streams()

    def flush_pending(self) -> None:
        """Hand everything buffered so far to the controller (internal steps that bypass the
        capture must not overtake it)."""
        if (self._pending_deletes or self._dead_streams) and self.capture is None:
            self._flush_deletes()

    def issue(
        self, inputs: list, defs: list[int], outputs: Iterable[Any] = (), views: bool = False
    ) -> int:
        """The seq of a new message that reads handles ``inputs`` and defines ref ids
        ``defs``: registered in the history, and noted by a trace in progress with the handles
        it makes (``outputs``). ``views``: the message names lazy views among ``inputs`` as
        RefViews (tensor.py); else they are sent first, so that their seqs come before it."""
        # before the seq: naming a lazy view's _ref sends it (tensor.py)
        uses = [h._root_id() if views and h._lazy is not None else h._ref.id for h in inputs]
        seq = self._seq
        self._seq += 1
        capture = self.capture
        if capture is not None and capture.tracing:  # nothing runs while tracing
            capture.note([(h._ref.id, h) for h in inputs], outputs)
            return seq
        self.history.invoke(seq, uses, defs, user_frame(sys._getframe(1)))
        return seq

    def invoke(self, seq: int, uses: Iterable[int], defs: Iterable[int]) -> BaseException | None:
        """Register an invocation in the history (not while tracing: nothing runs then)."""
        capture = self.capture
        if capture is not None and capture.tracing:
            return None
        return self.history.invoke(seq, uses, defs, user_frame(sys._getframe(2)))

    def request_status(self) -> None:
        """Ask every rank to report progress up to the last seq issued (deletes go first)."""
        if (self._pending_deletes or self._dead_streams) and self.capture is None:
            self._flush_deletes()
        self._status_requested_at = self._seq
        self.controller.send(self.world, m.RequestStatus(max(self._seq - 1, 0)))

    # -- lazily created state on the ranks ----------------------------------------------------

    def stream_ref(self, stream: Any) -> m.StreamRef:
        """The ref of ``stream`` (a :class:`dask_monarch.Stream`), created on first use.

        The session holds streams weakly: once a Stream and every tensor on it
        are garbage, its lane is dropped on the ranks (:meth:`_stream_died`).
        """
        ref = self._streams.get(id(stream))
        if ref is None:
            ref = m.StreamRef(self.new_id())
            key = id(stream)
            self._stream_objects[ref.id] = weakref.ref(
                stream, functools.partial(self._stream_died, key, ref)
            )
            self._streams[key] = ref
            name = getattr(stream, "name", None)
            if isinstance(name, str):
                self.controller.name_stream(ref, name)
            self.send_setup(self.world, m.CreateStream(ref, stream.creation_mode))
        capture = self.capture
        if capture is not None:
            capture.streams[ref.id] = stream
        return ref

    def _stream_died(self, key: int, ref: m.StreamRef, _: weakref.ref) -> None:
        """A Stream became garbage (any thread, maybe inside a GC): drop its lane soon, after
        the deletes of its tensors (the next send does it)."""
        if self._streams.get(key) is ref:
            del self._streams[key]
        self._stream_objects.pop(ref.id, None)
        if not self.closed:
            self._dead_streams.append(ref)
            self._pending_bytes = DELETE_BYTES

    def adopt_orphan(self, borrow: Any) -> None:
        """An undropped Borrow a GC found on the event loop while another thread held the
        lock: dropped once the lock is free (the loop never waits for it), or by the lock's
        holder before it drops any dead stream (the borrow's last steps name its stream)."""
        self._orphans.append(borrow)
        asyncio.get_running_loop().call_later(REPORT_RETRY_S, self._drop_orphans_later)

    def _drop_orphans_later(self) -> None:
        if not self.lock.acquire(blocking=False):
            asyncio.get_running_loop().call_later(REPORT_RETRY_S, self._drop_orphans_later)
            return
        try:
            self._drop_orphans()
        finally:
            self.lock.release()

    def _drop_orphans(self) -> None:
        """Drop the adopted borrows (the caller holds the lock); no dead stream is dropped
        meanwhile: a borrow's steps may name one."""
        self._dropping_orphans = True
        try:
            while self._orphans:
                self._orphans.pop(0).drop_quietly()
        finally:
            self._dropping_orphans = False

    def _drop_dead_streams(self) -> None:
        if self._dropping_orphans:
            return  # after the orphans' steps (the next send)
        if self._orphans:
            self._drop_orphans()
        dead, self._dead_streams = self._dead_streams, []
        for ref in dead:
            self.controller.drop_stream(self.world, ref)
            # its communicators went with it on the ranks (stream ids are never reused)
            self._comms = {k for k in self._comms if ref.id not in k[1:3]}

    def streams_named(self, messages: Iterable[tuple[tuple[int, ...], Any]]) -> list[Any]:
        """The live Stream objects ``messages`` name (a recording holds them: it replays on
        their lanes, which must outlive the user's handles)."""
        ids = {
            s.id
            for _, msg in messages
            for one in m.flatten_groups([msg])
            for s in streams_named(one)
        }
        found = (self._stream_objects.get(i) for i in ids)
        return [stream for stream in (w() for w in found if w is not None) if stream is not None]

    def mesh_ref(self, names: tuple[str, ...], ranks: Slice) -> m.Ref:
        """The ref of the mesh ``names`` over ``ranks``, created on its ranks on first use."""
        key = (names, ranks)
        ref = self._meshes.get(key)
        if ref is None:
            ref = self._meshes[key] = self.new_ref()
            self.send_setup(tuple(ranks), m.CreateDeviceMesh(ref, list(names), ranks))
        return ref

    def ensure_network(self) -> None:
        if not self._network:
            self._network = True
            self.send_setup(self.world, m.BackendNetworkInit())

    def ensure_split(self, mesh: m.Ref, stream: m.StreamRef, dims: tuple[str, ...]) -> None:
        """The communicator of ``dims`` of ``mesh`` on ``stream`` (for collectives)."""
        key = ("split", mesh.id, stream.id, dims)
        if key not in self._comms:
            self.ensure_network()
            self._comms.add(key)
            self.send_setup(self.world, m.SplitComm(list(dims), mesh, stream))

    def ensure_p2p(self, src: m.StreamRef, dst: m.StreamRef) -> None:
        """The point-to-point communicator from stream ``src`` to ``dst`` (for sends)."""
        key = ("p2p", src.id, dst.id)
        if key not in self._comms:
            self.ensure_network()
            self._comms.add(key)
            self.send_setup(self.world, m.BackendNetworkPointToPointInit(src, dst))

    def ensure_group_split(self, ranks: tuple[int, ...], group: m.Ref, stream: m.StreamRef) -> None:
        """The communicator of process group ``group`` (on ``ranks``) on ``stream``."""
        key = ("group", group.id, stream.id)
        if key not in self._comms:
            self.ensure_network()
            self._comms.add(key)
            self.send_setup(ranks, m.SplitCommForProcessGroup(group, stream))

    # -- fetching -----------------------------------------------------------------------------

    def expect_result(self, uses: list[int], ranks: int) -> tuple[int, MeshFuture]:
        """A seq whose value ``ranks`` ranks will send back, and the future that gets it
        (failed at once when the ref ids ``uses`` depend on a failure already known)."""
        seq = self.new_seq()
        future = MeshFuture(self, seq, ranks=ranks)
        failure = self.invoke(seq, uses, [])
        if failure is not None:
            self._observe(failure)
            future.set_exception(failure)
        else:
            self._futures[seq] = future
        return seq, future

    def fetch(
        self,
        ranks: tuple[int, ...],
        stream: m.StreamRef,
        function: m.FunctionPath | m.Cloudpickle | None,
        args_kwargs: m.ArgsKwargs,
        uses: list[int],
    ) -> MeshFuture:
        """Send ``function(*args)`` (or the one argument) from each of ``ranks`` back on
        ``stream``: a future of the value (a list in rank order for several ranks), failed at
        once when the ref ids ``uses`` depend on a known failure. The caller holds the lock
        and has sent what must run first (a borrow's first use)."""
        if self.capture is not None:
            raise self.capture.no_fetch()
        seq, future = self.expect_result(uses, len(ranks))
        self.send(ranks, m.SendValue(seq, None, [], function, args_kwargs, stream))
        self.request_status()
        return future

    @property
    def pending_fetches(self) -> dict[int, MeshFuture]:
        """The futures of fetches not resolved yet, by seq (a stand-in fails them at once)."""
        return self._futures

    def _observe(self, failure: BaseException) -> None:
        self._unobserved.pop(id(failure), None)

    def _on_message(self, msg: m.FetchResult | m.RemoteFunctionFailed | m.Status) -> None:
        """A report from a rank (event loop thread): resolve futures, record failures.

        Applied under the session's lock, but the loop never waits for it: the user's thread
        may hold it while it waits for the loop (an op whose flush adds lanes or opens the
        rendezvous calls ``client.run``), and both would wait forever. A report that finds
        the lock taken waits in arrival order for a retry on the loop a moment later."""
        self._arrived.append(msg)
        self._apply_arrived()

    def _apply_arrived(self) -> None:
        """Apply the reports that arrived, in order, if the lock is free (event loop thread);
        else try again shortly."""
        if not self.lock.acquire(blocking=False):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on an event loop: no thread waits for this one
                self.lock.acquire()
            else:
                if not self._apply_armed:
                    self._apply_armed = True
                    loop.call_later(REPORT_RETRY_S, self._retry_arrived)
                return
        try:
            arrived = self._arrived
            while arrived:
                self._apply(arrived.popleft())
        finally:
            self.lock.release()

    def _retry_arrived(self) -> None:
        self._apply_armed = False
        self._apply_arrived()

    def _apply(self, msg: m.FetchResult | m.RemoteFunctionFailed | m.Status) -> None:
        t = type(msg)
        if t is m.FetchResult:
            if msg.seq in self._futures:
                self._values[msg.seq][msg.rank] = msg.value
        elif t is m.RemoteFunctionFailed:
            self._failed(msg)
        elif t is m.Status:
            self._progress(msg)
        elif t is ValueFailed:  # fails the seq that defined the value, and its users
            seq = self.history.definer.get(msg.ref)
            if seq is not None:
                self._failed(m.RemoteFunctionFailed(seq, msg.rank, msg.error))

    def _failed(self, msg: m.RemoteFunctionFailed) -> None:
        inv = self.history.invocations.get(msg.seq)
        origin = getattr(inv, "origin", None) if inv is not None else None
        lines = [line for line in msg.error.strip().splitlines() if line.strip()]
        summary = lines[-1] if lines else "remote function failed"
        where = f'  File "{origin[0]}", line {origin[1]}, in {origin[2]}' if origin else ""
        failure = RemoteException(
            summary, rank=msg.rank, seq=msg.seq, traceback=msg.error, controller_traceback=where
        )
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

    def _fail_pending(self, controller: Controller) -> None:
        """The controller broke or closed (on the client's loop): no report will resolve the
        fetches still pending, so fail them now. Only ``result()`` polled for this; a
        ``concurrent.futures.wait``/``as_completed`` or a done callback waited forever.
        Without the session's lock (the user's thread may hold it, waiting on this loop):
        a future resolves once, whoever comes first."""
        broken = controller.broken
        for seq, future in list(self._futures.items()):
            if future.done():
                continue
            error = broken or RuntimeError(
                f"the mesh was exited before the fetch of seq {seq} resolved"
            )
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(error)

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
                future.set_exception(
                    RemoteException(f"seq {seq} completed without a value", seq=seq)
                )
        self.history.complete(done)
        self._completion.notify_all()

    # -- a controller standing in -------------------------------------------------------------

    @contextlib.contextmanager
    def substitute(self, stand_in: Substitute, exit_instead: Callable[[], None]) -> Iterator[None]:
        """Run the block with ``stand_in`` in place of this session's controller
        (``dm.dry_run``). What came before goes to the ranks first; inside, the state created
        lazily on the ranks (streams, meshes, communicators) starts empty, every handle made
        is told to ``stand_in``, and ``mesh.exit()`` calls ``exit_instead``. Afterwards the
        session is as it was, but for what the real ranks must still learn (deletes and dead
        streams of before, meanwhile), and a later use of what the block made fails, saying
        why (nothing of it ran)."""
        with self.lock:
            if self._exit_instead is not None:
                raise RuntimeError("this mesh is already in a dry run")
            if self.capture is not None:
                raise RuntimeError("a dry run cannot start inside coalescing or a compiled trace")
            self.flush_pending()
            real = self.controller
            real.flush()  # what came before goes to the ranks as usual
            first_seq, first_id = self._seq, stand_in.first_id
            saved = {name: getattr(self, name) for name in _LAZY}
            definers = dict(self.history.definer)
            self.controller = stand_in
            self._streams, self._stream_objects, self._meshes = {}, {}, {}
            self._network, self._comms, self._dead_streams = False, set(), []
            self.watch, self._exit_instead = self._watching(stand_in), exit_instead
        try:
            yield
        finally:
            with self.lock:
                self.watch, self._exit_instead = None, None
                for storage in stand_in.storages():  # nothing on the ranks to delete
                    for handle in storage.handles:  # (a lazy view has no ref: naming it sends)
                        if handle._lazy is None and handle._ref.id >= first_id:
                            handle.disown(settle=False)
                self._restore(real, stand_in, saved, definers, first_seq, first_id)

    @staticmethod
    def _watching(stand_in: Substitute) -> Callable[[int, Any, int, tuple[int, ...]], None]:
        first = stand_in.first_id

        def watch(ref: int, storage: Any, nbytes: int, ranks: tuple[int, ...]) -> None:
            if ref >= first:
                stand_in.created(ref, storage, nbytes, ranks)

        return watch

    def forget_traced(self, refs: Iterable[int]) -> None:
        """Refs of handles a compiled trace made, gone without a delete: the ranks hold them
        only inside a replay, which frees them (compiled.py). A dry run stops counting them."""
        stand_in = self.stand_in
        if stand_in is not None:
            for ref in refs:
                stand_in.forgotten(ref)

    def _restore(
        self,
        real: ControllerSeam,
        stand_in: Substitute,
        saved: dict,
        definers: dict,
        first_seq: int,
        first_id: int,
    ) -> None:
        """Put the session back as it was before ``stand_in``; forget what it was sent."""
        dead = [ref for ref in self._dead_streams if ref.id < first_id]
        self.controller = real
        for name, value in saved.items():
            setattr(self, name, value)
        # streams and refs of the real run that died meanwhile: dropped on the ranks from now
        for ref in [*stand_in.real_drops, *dead]:
            for key, known in list(self._streams.items()):
                if known.id == ref.id:
                    del self._streams[key]
            self._stream_objects.pop(ref.id, None)
            if ref not in self._dead_streams:
                self._dead_streams.append(ref)
        self._pending_deletes.extend(stand_in.real_deletes)
        history = self.history
        for seq in [s for s in history.invocations if s >= first_seq]:
            del history.invocations[seq]
        # refs made before: defined as before (the block's in-place ops never ran), unless
        # their definer completed meanwhile; refs made inside: see below
        made = [ref for ref in history.definer if ref >= first_id]
        history.definer = {ref: seq for ref, seq in definers.items() if seq in history.invocations}
        for seq in [s for s in self._futures if s >= first_seq]:
            self._futures.pop(seq).set_exception(stand_in.nothing_ran())
        for seq in [s for s in self._values if s >= first_seq]:
            del self._values[seq]
        if made:  # a later use of what the block made fails, saying why
            seq = self.new_seq()
            history.invoke(seq, [], made)
            history.fail(seq, stand_in.nothing_ran())

    # -- shutdown -----------------------------------------------------------------------------

    def exit(self, timeout: float = 600, cancel: bool = False) -> None:
        """Wait for everything sent, release the ranks, raise a failure nobody fetched; with
        ``cancel``, release them now, interrupting what runs (controller/cancel.py)."""
        if self._exit_instead is not None:  # a stand-in's session outlives it
            self._exit_instead()
            return
        if self.closed:
            return
        if cancel:
            return cancel_session(self)
        drained = False  # else the wait failed (timeout, broken, Ctrl-C): release at once
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
                        raise fresh_copy(broken)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"mesh.exit() waited {timeout}s for the ranks: "
                            f"{waiting_for(self.controller)}"
                        )
                    self._completion.wait(min(remaining, 0.1))
            drained = True
            unobserved = next(iter(self._unobserved.values()), None)
        finally:
            self.closed = True
            # a wait that failed has had its time: Controller.close would drain once more
            # (timeouts.close), and exit(timeout=2) would take 12 s
            self.controller.close(timeout=None if drained else 0)
        if unobserved is not None:
            raise unobserved


# the session state a substitute replaces and puts back (refs created lazily on the ranks)
_LAZY = (
    "_streams",
    "_stream_objects",
    "_meshes",
    "_network",
    "_comms",
    "_dead_streams",
    "_status_requested_at",
)


_gc_state = config.GCState  # a cyclic collection running: its finalizers may send messages


def user_frame(f: Any = None) -> tuple[str, int, str] | None:
    """Where the user's code issued the current op (file, line, function), cheaply: the first
    frame from ``f`` (the caller's by default) outward that is not dask_monarch's or torch's."""
    if f is None:
        f = sys._getframe(1)
    internal = _internal_code
    while f is not None:
        code = f.f_code
        inside = internal.get(code)
        if inside is None:
            name = code.co_filename
            inside = internal[code] = (
                name.startswith(_INTERNAL) or "/torch/" in name or name.startswith("<frozen")
            )
        if not inside:
            line = f.f_lineno
            origin = _origins.get((code, line))
            if origin is None:
                origin = _origins[(code, line)] = (code.co_filename, line, code.co_name)
            return origin
        f = f.f_back
    return None


_INTERNAL = os.path.dirname(os.path.dirname(__file__))  # the dask_monarch folder
_internal_code: dict = {}  # code object -> is it dask_monarch's or torch's own
# (code, line) -> its origin, one tuple per site: the history keeps an origin per message in
# flight, and a tuple of its own for each was the garbage collector's to walk
_origins: dict = {}


__all__ = ["Capture", "MeshFuture", "Session"]  # MeshFuture: as before, from here too
