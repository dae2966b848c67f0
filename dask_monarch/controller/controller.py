"""The raw controller: drives Monarch's worker protocol on the workers of a Dask client.

A :class:`Controller` claims ``world_size`` workers as ranks
(:mod:`~dask_monarch.controller.placement`), buffers the messages it is given,
compiles each flush into one Dask graph (:mod:`~dask_monarch.controller.compiler`)
and reads every rank's reports from a stream the rank's worker serves
(:mod:`~dask_monarch.controller.reports`), on which its own heartbeat also
asks what every lane is doing (:mod:`~dask_monarch.controller.liveness`);
:mod:`~dask_monarch.controller.watch` fails it when its client can no longer
deliver its work.

A failure stays inside its controller (DESIGN decision 12): a broken or
closed controller never cancels anything through the scheduler. It lets go
of its tails (all of them, with the name the scheduler held them under:
controller/intake.py) and hangs up its report streams; the scheduler then
releases its tasks as unwanted, and whatever a worker already started
returns at once on a released rank. (``Client.cancel`` would also cancel the dependents of each
key, and one the controller no longer holds trips an assertion in the
scheduler that drops the whole shared client: docs/dask.md §12.)

The module is long because :class:`Controller` is one object under one lock:
buffering, flushing, syncing and failing all read and change the same state,
and splitting them would spread that lock's invariants over several files.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import functools
import itertools
import logging
import pickle
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import cloudpickle
import dask
from distributed import Client, wait

from .. import config
from .. import dask_internals as internals
from ..exceptions import DeviceException, RemoteException
from ..protocol import source
from ..protocol.messages import (
    WORKER_MESSAGES,
    ArgsKwargs,
    CommandGroup,
    DefineRecording,
    GetRefUnitTestsOnly,
    Ref,
    SetRefUnitTestsOnly,
    StreamRef,
)
from ..protocol.names import mesh_id
from ..protocol.ndslice import Slice
from ..protocol.wire import ActorCall, DropLane, ExpectResults, ReadRef
from ..worker import (
    cancel_controller,
    construct_actor,
    register_actor,
    trace_collect,
    trace_start,
)
from . import bookkeeping, intake
from .compiler import Compiler, InternalStep, PayloadError
from .liveness import Liveness
from .placement import add_lanes, choose_workers, claim_ranks, lower_client_gap, open_rendezvous
from .release import DeferredRelease
from .reports import Reports
from .watch import INTERVAL_MS, ClientWatch, rank_of

if TYPE_CHECKING:
    from ..protocol.messages import WorkerMessage

WATCH_INTERVAL_S = INTERVAL_MS / 1000  # a failure Dask announces waits this long for a report
logger = logging.getLogger("dask_monarch.controller")

SHUTDOWN_TIMEOUT = 2.0  # seconds a closing controller waits for the client's loop to let go
CLIENT_CHECK_S = 0.5  # a wait looks at the client this often (closed? scheduler lost?)
TAIL_RETRY_S = 0.05  # a pass over the tails a report missed (a flush held the lock) after this

_WORKER_MESSAGE_TYPES = frozenset(WORKER_MESSAGES)
# Messages whose fields may hold any Python value: checked at send (the others hold plain data
# or arguments that ArgsKwargs already serialised when it was made).
_ANY_VALUE = frozenset({SetRefUnitTestsOnly, CommandGroup, DefineRecording})
_PLAIN = (type(None), bool, int, float, str, bytes)
_live: weakref.WeakSet = weakref.WeakSet()


def live_controllers() -> list[Controller]:
    """The controllers of this process that are not closed (for progress displays)."""
    return [c for c in list(_live) if not c._closed]


def working_controllers() -> list[Controller]:
    """The open controllers that are not broken: those that can still run work."""
    return [c for c in live_controllers() if c._broken is None]


def client_problem(client: Client, comm: Any = None) -> str | None:
    """Why ``client`` cannot carry a controller's work any more, or None (cheap: no I/O).

    A client that lost its scheduler reconnects on its own, but the scheduler
    forgot the client's tasks (and the tasks it held for the client's
    controllers), so a mesh's work is gone either way: ``comm``, the client's
    ``scheduler_comm`` when the mesh began, tells a reconnected client.
    """
    status = client.status
    if status in ("closing", "closed"):
        return (
            "its distributed.Client was closed, so the mesh can run nothing more: make a "
            "new Client and a new mesh (dask_monarch.device_mesh), and exit meshes "
            "(mesh.exit(), Controller.close()) before closing their client"
        )
    now = client.scheduler_comm
    if (
        status == "connecting"
        or now is None
        or now.comm is None
        or now.comm.closed()
        or (comm is not None and now is not comm)
    ):
        address = getattr(client.scheduler, "address", None) or "its scheduler"
        return (
            f"lost the connection to the scheduler at {address} (the scheduler died or "
            "the network failed): the mesh's work is gone; start a new mesh once the "
            "scheduler is back"
        )
    return None


@atexit.register
def _close_at_exit() -> None:
    """Interpreter exit with controllers still open: release their ranks while the client can.

    Runs before distributed's own exit hooks (registered earlier), so the
    client still works; nothing is drained (call ``mesh.exit()`` for that).
    """
    open_ = working_controllers()
    if not open_:
        return
    logger.warning(
        "dask_monarch: %d mesh%s still open at interpreter exit (%s): released "
        "without waiting for %s work; call mesh.exit() to wait for it",
        len(open_),
        "es were" if len(open_) > 1 else " was",
        ", ".join(f"mesh {c.mesh_id}, {c.world_size} ranks" for c in open_),
        "their" if len(open_) > 1 else "its",
    )
    for controller in open_:
        try:
            controller.close(timeout=0)
        except Exception as e:  # exiting anyway
            logger.debug("closing %r at exit: %r", controller, e)


Ranks = int | Iterable[int] | Slice


class Controller:
    """Drive Monarch's worker protocol on ``world_size`` workers of ``client``.

    Workers are shared, not owned: several controllers (several notebooks)
    may use the same workers, each with its own lanes and refs. ``workers``
    (addresses or worker names) become ranks 0..n-1 in that order; without
    it ranks are chosen in a stable order among the workers that answer.
    ``distinct_hosts=True`` puts no two ranks on one host.

    Parameters
    ----------
    client
        A synchronous :class:`distributed.Client` of the cluster whose workers
        become ranks (asynchronous clients are refused with the way to go).
    world_size
        How many ranks; the cluster needs at least that many workers.
    device
        ``"cuda"``: every rank a GPU worker; ``"cpu"``: CPU ranks (gloo);
        ``"auto"``: what the chosen workers have.
    workers
        Addresses or worker names, rank 0 first; None: a stable choice.
    distinct_hosts
        No two ranks on one host.
    """

    def __init__(
        self,
        client: Client,
        world_size: int,
        *,
        device: str = "auto",
        workers: list[str] | None = None,
        distinct_hosts: bool = False,
    ) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"Controller needs a distributed.Client, got {client!r}")
        if client.asynchronous:
            raise TypeError(
                "dask_monarch drives a mesh with a synchronous distributed.Client, and this "
                "one is asynchronous (Client(asynchronous=True)): create a plain Client(...) "
                "for the mesh (in a notebook too: it runs its own event loop thread); in "
                "async code, await the fetches (await dask_monarch.fetch_shard(t)) or run "
                "the mesh code with asyncio.to_thread"
            )
        if client.status in ("closing", "closed"):
            raise ValueError(
                "this distributed.Client is closed, so no mesh can run on it: make a new "
                "Client (Client(cluster), Client(address)) and the mesh on it; close a client "
                "only after mesh.exit()"
            )
        if type(world_size) is not int or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        internals.require()  # distributed's internals without a fallback, named if missing
        self._client = client
        self.world_size = world_size
        self.token = uuid.uuid4().hex[:12]  # names its tasks, lanes and state on the ranks
        self.mesh_id = mesh_id(self.token)  # what the user reads (names.mesh_id)
        self._lock = threading.Lock()  # the buffer
        self._wake = threading.Event()  # the buffer became non-empty (or the controller closed)
        self._rank_sets: dict = {}  # validated rank tuples, by what send() was given
        self._flush_lock = threading.Lock()  # graphs reach the scheduler in flush order
        self._progress = threading.Condition()  # reports, completion, failure
        self._buffer: list[tuple[tuple[int, ...], Any]] = []
        self._first_send = self._last_send = 0.0
        # (rank, lane) -> its newest segment (its key where the scheduler's intake holds it, its
        # future where Client.get submitted it) and that segment's index, while it has not run
        self._tails: dict[tuple[int, Any], Any] = {}
        self._tail_index: dict[tuple[int, Any], int] = {}
        self._ran: deque = deque()  # lanes reported done since the last pass over them
        self._released = DeferredRelease(client.loop)  # tails let go of, dropped in batches
        self._intake = False  # whether flushes go to the scheduler's intake (set once claimed)
        self._scheduler_comm = client.scheduler_comm  # replaced if the client reconnects
        self._dropping: dict[tuple[int, Any], int] = {}  # dropped lane -> its last segment
        self._reports = Reports(
            self.token,
            self._progress,
            self._break_locked,
            self._client_problem,
            client.scheduler,
        )
        self._reports.on_debugger = self._on_debugger
        self._attach = config.get("debug.attach", "auto")  # may a wait attach to a paused rank
        self._probes = itertools.count(1)
        self._broken: DeviceException | None = None
        # called on the client's loop once broken or closed (the user API fails its futures)
        self.on_shutdown: Callable[[], None] | None = None
        # (distributed.span annotation, task-name label) of the dask_monarch.span open now
        self.span: tuple[dict, str] | None = None
        # outside any dask_monarch.span: one span of its own, not a new default span per flush
        self._own_span = (bookkeeping.controller_span(self.token), "")
        self._closed = False
        self._rendezvous: tuple[str, int] | None = None
        self._actor_ids = itertools.count()
        self._actors: list = []  # Dask actor futures: they live as long as the controller
        self.exited: set[int] = self._reports.exited  # ranks that reported their exit
        self._clock_offsets: dict[int, float] = {}  # rank -> its worker's clock minus ours
        self._watch = ClientWatch(client, self._client_problem, self._tail_futures, self._break)

        # settings first: a bad value fails here, before any worker is claimed
        self._flush_size = config.integer("flush.size", minimum=1)
        config.integer("limits.lanes", minimum=1)  # read by the compiler, made after the claim
        self._idle = config.seconds("flush.idle")
        self._min_age = config.seconds("flush.min-age")
        self._max_age = config.seconds("flush.max-age")
        config.freeze_gc()
        self.workers = choose_workers(
            client, world_size, device, workers, distinct_hosts=distinct_hosts
        )
        # 'auto': NCCL for CUDA tensors, gloo for CPU ones; 'gloo': gloo for both
        self.backend = config.get("backend", "auto")
        self.resources, self.devices = claim_ranks(
            client, self.token, self.workers, device, self.backend
        )
        bookkeeping.install(client)  # the scheduler's record of ran segments stays bounded
        self._liveness = Liveness(
            self.mesh_id,
            self.workers,
            self._reports,
            self._progress,
            self._break_locked,
            interval=config.seconds("timeouts.heartbeat") or 0.0,
            unresponsive=config.seconds("timeouts.unresponsive") or float("inf"),
            liveness=config.seconds("timeouts.liveness") or float("inf"),
        )
        client.sync(
            self._reports.subscribe,
            self.workers,
            client.connection_args,
            callback_timeout=config.seconds("timeouts.claim"),
        )
        client.loop.add_callback(self._liveness.start)
        self._restore_gap = lower_client_gap(client)
        self._watch.start()
        self._reports.on_done = self._release_ran_now
        self._retry_armed = False  # a pass over the tails that ran is due
        # flushes go to the scheduler's intake, or through Client.get where it is off or refused
        self._intake = bool(config.get("flush.intake", True)) and intake.install(client)
        # relayed flushes (a task per wave, fanned out worker to worker) need the intake
        relay = config.integer("flush.relay", minimum=0) if self._intake else 0
        self._compiler = Compiler(
            self.token, self.resources, self._reports.done, relay, list(self.workers)
        )
        if self._intake:  # the scheduler holds our tasks: tails go by key, failures by event
            self._released = DeferredRelease(
                client.loop, functools.partial(intake.release, client, self.token)
            )
            client.subscribe_topic(intake.failures_topic(self.token), self._on_task_failed)
        self._flusher = threading.Thread(
            target=self._flush_loop, daemon=True, name=f"dask_monarch-flush-{self.token}"
        )
        self._flusher.start()
        self.messages_sent = 0  # messages handed to Dask (each counted once)
        self.flushes = 0
        _live.add(self)

    # -- sending ------------------------------------------------------------------------------

    def send(self, ranks: Ranks, message: WorkerMessage) -> None:
        """Buffer ``message`` for ``ranks`` (an int, ints or a Slice of global ranks).

        A buffer older than ``flush.min-age`` is flushed only once the ranks
        are idle: while they are busy, more messages join the next flush
        (up to ``flush.max-age`` and ``flush.size``), and fewer, larger
        segments cost Dask far less per message than many small ones.
        """
        if self._broken is not None:
            raise fresh_copy(self._broken)
        if self._closed:
            raise RuntimeError("the controller is closed")
        if type(message) not in _WORKER_MESSAGE_TYPES:
            raise TypeError(f"expected a worker message, got {message!r}")
        if type(message) in _ANY_VALUE:
            _check_serialisable(message)
        try:
            ranks = self._rank_sets[ranks]
        except (KeyError, TypeError):
            ranks = self._ranks(ranks)
        now = time.monotonic()
        with self._lock:
            buffer = self._buffer
            buffer.append((ranks, message))
            self._last_send = now
            if len(buffer) == 1:
                self._first_send = now
                self._wake.set()
            full = len(buffer) >= self._flush_size
            age = now - self._first_send
        if full or (age >= self._min_age and (age >= self._max_age or self._reports.ranks_idle())):
            self.flush()

    def _ranks(self, ranks: Ranks) -> tuple[int, ...]:
        if type(ranks) is int:
            out: tuple[int, ...] = (ranks,)
        else:
            out = tuple(ranks)
        for r in out:
            if type(r) is not int or not 0 <= r < self.world_size:
                raise ValueError(f"rank {r!r} is outside this controller's {self.world_size} ranks")
        try:
            if len(self._rank_sets) < 1024:
                self._rank_sets[ranks] = out
        except TypeError as e:  # a list: not hashable, not cached
            logger.debug("rank set not cached: %s", e)
        return out

    def flush(self) -> None:
        """Hand buffered messages to Dask now."""
        self._flush(False)

    def ranks_idle(self) -> bool:
        """Every segment flushed so far has run: a flush now would start work at once
        (while they are busy, a later flush costs them nothing and Dask less)."""
        return self._reports.ranks_idle()

    def _flush(self, final: bool | tuple[int, int]) -> None:
        """Flush; ``final`` before a wait: what would wait forever for more is refused (a wait
        on every lane, ``True``, or on one ``(rank, stream)``; see ``Compiler.compile``)."""
        with self._flush_lock:
            with self._lock:
                buffer, self._buffer = self._buffer, []
            if (buffer or final) and self._broken is None:
                try:
                    self._submit(buffer, final)
                except PayloadError as e:
                    self._break(DeviceException(e.cause, rank=e.rank))
                except Exception as e:  # the flush may be partly submitted: never run on
                    self._break(
                        DeviceException(
                            f"a flush of {len(buffer)} messages could not be submitted "
                            f"({type(e).__name__}: {e}); create a new controller"
                        )
                    )
        if self._broken is not None:
            raise fresh_copy(self._broken)

    def _submit(self, buffer: list, final: bool | tuple[int, int] = False) -> None:
        """Compile ``buffer`` and hand it to Dask; whatever stops that half way breaks the
        controller (the compiler already counts the flush as sent)."""
        try:
            self._hand_over(buffer, final)
        except BaseException as e:
            problem, log = self._client_problem(), False  # the caller raises it
            if problem is None and isinstance(e, KeyboardInterrupt):
                problem = (
                    "interrupted (KeyboardInterrupt) while handing a flush to Dask: the "
                    "ranks' state is unknown; start a new mesh"
                )
            elif problem is None:
                problem = f"handing a flush to Dask failed: {type(e).__name__}: {e}"
                log = True  # the background flusher keeps it for the next call: say it now
            self._break(DeviceException(problem), log=log)
            if not isinstance(e, Exception):
                raise

    def _hand_over(self, buffer: list, final: bool | tuple[int, int]) -> None:
        # set by dask_monarch.span, which flushes as it enters and leaves; else our own span
        span = self.span or self._own_span
        self._compiler.span_label = span[1]
        plan = self._compiler.compile(buffer, final)
        if plan.rendezvous and self._rendezvous is None:
            self._rendezvous = open_rendezvous(self._client, self.token, self.workers)
        if plan.new_lanes:
            add_lanes(self._client, self.token, self.workers, plan.new_lanes, self._reports.names)
        self.messages_sent += plan.messages
        self.flushes += 1
        if plan.tasks:
            if self._intake:
                problem = self._client_problem()  # Client.get would raise: so do we
                if problem is not None:
                    raise RuntimeError(problem)
                by_key = {key: key for key in plan.keys}  # held for us by the scheduler
            else:  # from any thread (the background flusher too): the span's annotation
                with dask.annotate(span=span[0]):
                    futures = self._client.get(plan.graph, plan.keys, sync=False)
                by_key = dict(zip(plan.keys, futures))
            self._reports.expect(plan.counts, plan.segments)
            tails, replaced = self._tails, []
            for lane, key in plan.tails.items():
                old = tails.get(lane)
                if old is not None:
                    replaced.append(old)
                tails[lane] = by_key[key]
                self._tail_index[lane] = plan.counts[lane]
            if self._intake:
                intake.send(self._client, self.token, plan.tasks, span[0])
            if not plan.tails:  # relayed: nothing follows a wave's task, let go of it now
                self._released.add(plan.keys)
            # let go of the previous tails behind the flush that may follow them
            self._released.add(replaced)
            if self._broken is not None:  # broke meanwhile: _shutdown_async may have run
                self._tails.clear()
        self._release_ran()
        if plan.dropped:
            self._dropping.update(plan.dropped)
        if self._dropping:
            self._retire_dropped()
        if plan.error is not None:
            self._break(DeviceException(plan.error.cause, rank=plan.error.rank))

    def _release_ran(self) -> None:
        """Let go of the tail futures of segments their rank reported done (the caller holds
        ``_flush_lock``, so no flush is compiling an edge to them): the compiler no longer
        chains to them, and Dask forgets each task, and its payload, once nobody holds it
        (in the next batch of :class:`DeferredRelease`, once Dask has finished it too)."""
        done, tail_index, reported, ran = self._reports.done, self._tail_index, self._ran, []
        while reported:  # only the lanes that reported: a pass per report over every lane
            lane = reported.popleft()  # was quadratic in the ranks (256: 65 000 per round)
            index = tail_index.get(lane)
            if index is not None and done.get(lane, -1) >= index:
                del tail_index[lane]
                ran.append(lane)
        self._released.add([self._tails.pop(lane, None) for lane in ran])

    def _client_problem(self) -> str | None:
        return client_problem(self._client, self._scheduler_comm)

    def _tail_futures(self) -> list:
        """The tails that are futures (flushes through Client.get), for the client watch."""
        return [] if self._intake else list(self._tails.values())

    def _on_task_failed(self, event: tuple) -> None:
        """The intake says Dask will not run a segment (on the client's loop): fail the
        controller a watch interval later, so that a rank's own report of it wins."""
        _, failure = event
        key = tuple(failure["keys"][0])
        cause = DeviceException(
            f"Dask will not run segment {key!r}: {failure['why']}; the rest of the "
            "mesh's work is lost: create a new mesh",
            rank=rank_of(key),
        )
        self._client.loop.call_later(WATCH_INTERVAL_S, self._break, cause)

    def _arm_retry(self) -> None:
        """Another pass over the tails in a moment, unless one is due (any thread)."""
        if not self._retry_armed and not self._closed:
            loop = self._client.loop  # a timer on the client's loop: no thread, nothing at exit
            if loop is not None:
                self._retry_armed = True
                loop.add_callback(loop.call_later, TAIL_RETRY_S, self._retry_release)

    def _retry_release(self) -> None:
        """Another pass over the tails that ran (on the client's loop)."""
        self._retry_armed = False
        if not self._closed:
            self._release_ran_now(())

    def _release_ran_now(self, lanes: Iterable[tuple[int, Any]]) -> None:
        """``lanes`` finished segments (on the client's loop): let go of the tails that ran
        unless a flush is under way (it lets go itself when it ends; a pass follows). A chain of
        segments built while a lane was busy is forgotten as soon as the lane catches up, flush
        or no flush."""
        self._ran.extend(lanes)
        if self._flush_lock.acquire(blocking=False):
            try:
                self._release_ran()
            finally:
                self._flush_lock.release()
        else:  # a flush may end without a pass
            self._arm_retry()
        bookkeeping.drop_sent_graphs(self._client.scheduler_comm, self.token)  # out of its log

    def _retire_dropped(self) -> None:
        """Let go of dropped lanes whose last segment ran: their tail futures, progress entries
        and names (the caller holds ``_flush_lock``)."""
        with self._progress:
            gone = self._reports.retire(self._dropping)
        for lane in gone:
            del self._dropping[lane]
            self._released.add([self._tails.pop(lane, None)])
            self._tail_index.pop(lane, None)
            self._compiler.forget_dropped(lane)
        streams = {stream for _, stream in self._dropping}
        for _, stream in gone:
            if stream not in streams:
                self._reports.names.pop(stream, None)

    def _flush_loop(self) -> None:
        """Flush once the buffer has been idle for a moment (a busy sender flushes itself)."""
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            while not self._closed:
                with self._lock:
                    if not self._buffer:
                        break
                    wait = self._idle - (time.monotonic() - self._last_send)
                if wait <= 0:
                    try:
                        self.flush()
                    except Exception as e:  # kept as the failure; raised on the next call
                        logger.debug("background flush of mesh %s failed: %s", self.mesh_id, e)
                    break
                time.sleep(wait)

    # -- waiting ------------------------------------------------------------------------------

    def sync(self, timeout: float = 60) -> list:
        """Flush, wait until every rank ran everything sent so far, return what they reported.

        The controller messages (Status, FetchResult, RemoteFunctionFailed)
        caused by what was sent since the last sync, in seq order. What would
        wait forever (a collective some member was never sent) breaks the
        controller at once instead (DESIGN decision 14).
        """
        config.timeout(timeout, "Controller.sync")
        self.drain(timeout)
        with self._progress:
            messages = self._reports.take_inbox()
        return sorted(messages, key=lambda msg: msg.seq)

    def drain(self, timeout: float = 60) -> None:
        """:meth:`sync` without taking the reports: they stay for the next ``sync``
        (``dm.trace`` waits this way for the work it traced)."""
        config.timeout(timeout, "Controller.drain")
        self._flush(True)
        self._wait(self._reports.caught_up, timeout, self._liveness.pending)
        with self._flush_lock:
            self._release_ran()
            if self._dropping:
                self._retire_dropped()

    def _wait(self, ready: Callable[[], bool], timeout: float, pending: Callable[[], str]) -> None:
        deadline = time.monotonic() + timeout
        with self._progress:
            while True:
                if self._broken is not None:
                    raise fresh_copy(self._broken)
                if ready():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"timed out after {timeout}s waiting for {pending()}")
                if self._closed:
                    raise RuntimeError(f"the controller was closed while waiting for {pending()}")
                if not self._progress.wait(min(remaining, CLIENT_CHECK_S)):
                    problem = self._client_problem()  # no report can say this
                    if problem is not None:
                        self._break_locked(DeviceException(problem), log=False)

    def get_ref(self, rank: int, ref: Ref, stream: StreamRef, timeout: float = 60) -> Any:
        """The value ``ref`` holds on ``rank``'s ``stream`` after everything sent before.

        Tensors come back on the CPU; ``None`` if the ref is absent;
        RemoteException if it holds an error.
        """
        (rank,) = self._ranks(rank)
        if type(ref) is not Ref or type(stream) is not StreamRef:
            raise TypeError("get_ref takes a rank, a Ref and a StreamRef")
        config.timeout(timeout, "Controller.get_ref")
        self.flush()
        if stream.id not in self._compiler.routers[rank].streams:
            raise ValueError(f"rank {rank} has no stream {stream.id}")
        probe = next(self._probes)
        self._send_internal((rank,), stream, ReadRef(probe, GetRefUnitTestsOnly(ref, stream)))
        self._flush((rank, stream.id))
        replies = self._reports.replies
        self._wait(
            lambda: probe in replies,
            timeout,
            lambda: (
                f"rank {rank}, stream {stream.id} to reach the read of {ref} "
                f"({self._liveness.lane_status(rank, stream.id)})"
            ),
        )
        with self._progress:
            reply = replies.pop(probe)
        if reply.state == "absent":
            return None
        if reply.state == "error":
            raise RemoteException(reply.value, rank=rank, traceback=reply.value)
        return pickle.loads(reply.value)

    # -- actors -------------------------------------------------------------------------------

    def spawn_actor(
        self, ranks: Ranks, name: str, cls: type, *args: Any, **kwargs: Any
    ) -> tuple[str, int]:
        """An instance of ``cls(*args, **kwargs)`` on each of ``ranks``; returns its broker id.

        The instances are Dask actors pinned to the ranks' workers; messages
        name them by the broker id (``ActorCallParams.broker_id``).
        """
        self._check_usable()
        ranks = self._ranks(ranks)
        broker = (name, next(self._actor_ids))
        # the class travels by value: only the workers need to import it
        payload = source.dumps((cls, args, kwargs))  # tracebacks show its lines
        futures = {
            rank: self._client.submit(
                construct_actor,
                payload,
                self.token,
                actor=True,
                pure=False,
                key=f"monarch_actor-{name}-{self.token}-{broker[1]}-{rank}",
                resources={self.resources[rank]: 1},
            )
            for rank in ranks
        }
        wait(list(futures.values()), timeout=config.seconds("timeouts.claim"))
        for future in futures.values():
            if future.status == "error":
                raise future.exception()
        keys = {self.workers[rank]: future.key for rank, future in futures.items()}
        self._client.run(register_actor, self.token, broker, keys, workers=list(keys))
        self._actors.extend(futures.values())
        return broker

    def call_actor(
        self,
        ranks: Ranks,
        broker_id: tuple[str, int],
        seq: int,
        stream: StreamRef,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> None:
        """Say which method the actor-call message ``seq`` on ``stream`` runs, and with what.

        Send it before the ``SendResultOfActorCall``/``CallActorMethod`` of
        ``seq``; Refs in ``args``/``kwargs`` stand for that message's
        ``local_state`` values.
        """
        step = ActorCall(tuple(broker_id), seq, method, ArgsKwargs.from_python(args, kwargs))
        self._send_internal(self._ranks(ranks), stream, step)

    def expect_results(
        self, ranks: Ranks, seq: int, stream: StreamRef, function: str, results: list
    ) -> None:
        """Say what the ``CallFunction`` of ``seq`` on ``stream`` returns; send it just before.

        ``results`` has one entry per result ref of the call: ``(shape, dtype,
        device type)`` of a tensor, or None. Each rank checks the real results as it
        binds them: one that is something else fails (``RemoteFunctionFailed``
        naming ``function``, the rank and both metadata) and poisons what
        depends on it, instead of reaching a send or a collective that
        trusts the declared metadata.
        """
        step = ExpectResults(seq, function, tuple(results))
        self._send_internal(self._ranks(ranks), stream, step)

    # -- streams ------------------------------------------------------------------------------

    def name_stream(self, stream: StreamRef, name: str) -> None:
        """Show ``stream`` as ``name`` on the dashboard and in errors (before it is created)."""
        if type(stream) is not StreamRef or not isinstance(name, str):
            raise TypeError("name_stream takes a StreamRef and a str")
        self._reports.names[stream.id] = name

    def drop_stream(self, ranks: Ranks, stream: StreamRef) -> None:
        """End ``stream`` on ``ranks`` once everything sent to it so far has run there.

        Its lane's refs, communicators and thread are freed on each rank.
        Monarch's protocol has no such message (its streams live as long as
        the mesh); the user API drops a :class:`dask_monarch.Stream` once it
        and every tensor on it are garbage. A later message naming ``stream``
        is a protocol error, and its id is not reused; so is dropping it while a
        borrow from or to it is open (its last steps run on the stream).
        """
        if type(stream) is not StreamRef:
            raise TypeError(f"drop_stream takes a StreamRef, got {stream!r}")
        self._send_internal(self._ranks(ranks), stream, DropLane())

    def _send_internal(self, ranks: tuple[int, ...], stream: StreamRef, step: Any) -> None:
        self._check_usable()
        with self._lock:
            self._buffer.append((ranks, InternalStep(stream.id, step)))
            self._last_send = time.monotonic()
            if len(self._buffer) == 1:
                self._first_send = self._last_send
                self._wake.set()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise fresh_copy(self._broken)
        if self._closed:
            raise RuntimeError("the controller is closed")

    # -- reports ------------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[Any], None], *, consume: bool = False) -> None:
        """Call ``listener(message)`` for every controller message as it arrives.

        Listeners run on the client's event loop thread: they must be quick
        and must not block (the user API resolves its futures this way).
        ``consume=True``: the listener takes the messages, and :meth:`sync`
        no longer keeps them (it returns only what came before), so a long
        session holds no fetched value or Status it already handled.
        """
        with self._progress:
            self._reports.listeners.append(listener)
            if consume:
                self._reports.keep_inbox = False

    def waiting_for(self) -> str:
        """The lanes that have not run everything sent to them, and what each is doing.

        The words of a LivenessWarning ("" when every lane has caught up); what
        a blocking call that times out says.
        """
        with self._progress:
            return self._liveness.pending()

    def lanes(self) -> list[dict]:
        """Every lane of every rank: what its latest heartbeat answer and the reports show.

        Per lane: ``rank``, ``lane`` (stream id or ``"control"``) and the
        fields of :class:`~dask_monarch.protocol.wire.LaneProgress` (``state``,
        ``doing``, ``seq``, ``next_seq``, ``last_seq``, ``done_seq``, ``for_s``,
        ``peers``, ``where``), ``segments_sent``/``segments_done``,
        ``stalled_for`` (seconds without a completed message while work is
        outstanding) and ``status`` (in words, as a LivenessWarning says it).
        """
        return self._liveness.lanes()

    def progress(self) -> dict:
        """Segments submitted and finished so far, and messages sent (cheap; any thread)."""
        with self._progress:
            expected, done = self._reports.segments()
        return {
            "token": self.token,
            "messages": self.messages_sent,
            "flushes": self.flushes,
            "segments": expected,
            "segments_done": done,
            "state": "broken" if self._broken else "closed" if self._closed else "running",
            "paused": len(self._reports.debugging),  # lanes stopped in pdb
        }

    # -- cancelling ---------------------------------------------------------------------------

    def cancel_running(self, grace: float) -> list[dict]:
        """Release every rank now and interrupt the calls still running there (where Python
        code runs: ``worker/cancel.py``); what each busy lane was doing, per rank and lane,
        with ``stopped`` False for a call still in C code after ``grace`` seconds."""
        try:
            replies = self._client.run(
                cancel_controller, self.token, grace, workers=list(self.workers)
            )
        except Exception as e:  # a lost worker or scheduler: close() releases what is left
            logger.info("controller %s could not cancel on its ranks: %r", self.token, e)
            return []
        lanes = [
            {**lane, "worker": address}
            for address in self.workers
            for lane in replies.get(address, ())
        ]
        return sorted(lanes, key=lambda lane: (lane["rank"], lane["lane"]))

    # -- tracing ------------------------------------------------------------------------------

    def start_trace(self, limit: int | None = None) -> None:
        """Record, on every rank, what each lane runs and waits on from now (``dm.trace``).

        Free while off: a rank checks once per segment. Each rank keeps at most
        ``limit`` records (``dask_monarch.trace.max-events``).
        """
        self._check_usable()
        if limit is None:
            limit = config.integer("trace.max-events", minimum=0)
        sent = time.time()
        clocks = self._client.run(trace_start, self.token, limit, workers=list(self.workers))
        back = time.time()
        self._clock_offsets = {  # the workers' records are shifted by these
            rank: clock_offset(clocks[address], sent, back)
            for rank, address in enumerate(self.workers)
            if address in clocks
        }

    def collect_trace(self, stop: bool = True) -> list[dict]:
        """Every rank's records since :meth:`start_trace` (``stop``: and end the trace).

        Per rank: ``rank``, ``records`` (``(lane, kind, name, start, end, args)``,
        times in this client's wall clock), ``lanes`` (lane -> its name),
        ``dropped`` (records over the limit). Waits for nothing: sync first.
        """
        replies = self._client.run(trace_collect, self.token, stop, workers=list(self.workers))
        offsets = self._clock_offsets
        out = []
        for rank, address in enumerate(self.workers):
            reply = replies.get(address)
            if reply is None:
                continue
            shift = offsets.get(rank, 0.0)
            if shift:
                reply["records"] = [
                    (lane, kind, name, start - shift, end - shift, args)
                    for lane, kind, name, start, end, args in reply["records"]
                ]
            out.append(reply)
        return out

    # -- the debugger -------------------------------------------------------------------------

    @property
    def debugging(self) -> dict:
        """Session id -> ``DebuggerPaused`` of every lane of this controller paused in pdb."""
        return self._reports.debugging

    def _on_debugger(self, item: Any) -> None:
        """A rank stopped in pdb or left it (on the event loop): tell the user where and how to
        attach (controller/debugging.py)."""
        if not item.paused:
            logger.debug("rank %d left the debugger (session %s)", item.rank, item.session)
            return
        from .debugging import announce

        announce(item, self.mesh_id, self._client.scheduler.address, from_loop=True)

    def attend_debugger(self) -> bool:
        """In a blocking wait: attach an interactive user to the paused ranks (see
        controller/debugging.py); False if nobody can be asked."""
        from .debugging import attend

        return attend(self._client, self.mesh_id, self._reports.debugging, self._attach)

    def can_wait_for_ranks(self) -> bool:
        """Whether this thread may block until the ranks progress: not on the client's event
        loop, which applies their reports (an asynchronous client's user code runs there)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return True
        return running is not getattr(self._client.loop, "asyncio_loop", None)

    # -- failure and shutdown -----------------------------------------------------------------

    @property
    def client(self) -> Client:
        """The Dask client this controller drives its ranks through."""
        return self._client

    @property
    def broken(self) -> DeviceException | None:
        """The DeviceException that broke this controller, if any (waiting loops poll it: a
        client that lost its scheduler, or was closed, breaks the controller here)."""
        if self._broken is None and not self._closed:
            self._check_client()
        return self._broken

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (nothing sent after it runs)."""
        return self._closed

    def _check_client(self) -> None:
        """Fail at once when the client was closed or lost its scheduler: the work handed to
        Dask is gone, and no report would ever say so (DESIGN decision 12)."""
        problem = self._client_problem()
        if problem is not None:  # the caller raises it at once
            self._break(DeviceException(problem), log=False)

    def _break(self, exc: DeviceException, log: bool = True) -> None:
        with self._progress:
            self._break_locked(exc, log)

    def _break_locked(self, exc: DeviceException, log: bool = True) -> None:
        if self._broken is not None or self._closed:
            return
        if log:
            logger.warning("mesh %s is broken: %s", self.mesh_id, exc)
        self._broken = exc
        self._progress.notify_all()
        self._restore_gap()
        try:
            self._client.loop.add_callback(self._shutdown_async)
        except RuntimeError:  # the client's event loop is gone (a closed client)
            self._reports.hang_up()

    async def _shutdown_async(self) -> None:
        """Let go of our work and hang up every report stream (workers then free our state).

        Only our references go: no ``Client.cancel`` (see the module docs).
        """
        self._liveness.stop()
        self._watch.stop()
        self._tails.clear()
        self._released.close()
        if self._intake:  # every task the scheduler held for us goes, and the holder
            try:
                intake.release(self._client, self.token, None)
                self._client.unsubscribe_topic(intake.failures_topic(self.token))
            except Exception as e:  # the client is closed: the scheduler dropped its holders
                logger.debug("mesh %s: no release through its client: %r", self.mesh_id, e)
        self._actors.clear()
        self._reports.hang_up()
        if self.on_shutdown is not None:  # after the hang-up: no report resolves them now
            try:
                self.on_shutdown()
            except Exception as e:  # a listener's bug must not stop the shutdown
                logger.warning("mesh %s: on_shutdown failed: %r", self.mesh_id, e)

    def close(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds for outstanding work, then release every rank.

        ``timeout`` defaults to ``dask_monarch.timeouts.close``; 0 releases at
        once (after Ctrl-C, or at interpreter exit). Ends within about
        ``timeout`` + 5 s whatever state the client is in.
        """
        if self._closed:
            return
        if timeout is None:
            timeout = config.seconds("timeouts.close")
        if self._broken is None and timeout > 0:
            try:
                self.sync(timeout=timeout)
            except Exception as e:
                logger.info("closing mesh %s without draining: %s", self.mesh_id, e)
        self._closed = True
        self._wake.set()
        with self._progress:
            self._progress.notify_all()
        self._restore_gap()
        try:
            self._client.sync(self._shutdown_async, callback_timeout=2 * SHUTDOWN_TIMEOUT)
        except Exception as e:  # a closed client: its loop may be gone, hang up from here
            logger.debug("mesh %s could not shut down on the client's loop: %r", self.mesh_id, e)
            self._reports.hang_up()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "closed" if self._closed else "running"
        return f"<Controller of mesh {self.mesh_id}: {self.world_size} ranks, {state}>"


def fresh_copy(error: Exception) -> Exception:
    """A copy of ``error`` to raise: the one DeviceException of a broken controller (or the
    one RemoteException a failure poisons its dependents with) is raised by every later
    call, and raising the same object again adds each call's frames to the traceback of
    every earlier one (another thread's included), keeping their locals alive."""
    try:
        return copy.copy(error)
    except Exception:  # an exception type that cannot be rebuilt from its args
        return error


def clock_offset(worker_clock: float, sent: float, back: float) -> float:
    """A worker's clock minus ours, from its reading ``worker_clock`` taken between our
    ``sent`` and ``back``: the offset nearest zero that the round trip allows.

    The true offset lies in ``[worker_clock - back, worker_clock - sent]``. Zero
    when that holds it (a worker on this host, or clocks kept in step by NTP), so
    that no record moves by a guess of up to half the round trip; else the nearer
    bound.
    """
    return min(max(0.0, worker_clock - back), worker_clock - sent)


def _check_serialisable(message: Any) -> None:
    """Refuse a message that a flush could not pickle, before it joins the buffer.

    Checked here, where the sender sees the error; a value changed after
    ``send`` so that it no longer pickles fails the whole flush instead
    (DeviceException naming the message).
    """
    if type(message) is SetRefUnitTestsOnly:
        value = message.value
        if type(value) in _PLAIN:
            return
        try:
            cloudpickle.dumps(value, protocol=5)
        except Exception as e:
            raise TypeError(
                f"SetRefUnitTestsOnly.value cannot be serialised for {message.reference}: "
                f"{type(e).__name__}: {e}; send plain data, tensors or picklable objects"
            ) from e
    else:  # a group or recording: check what it carries
        for inner in getattr(message, "messages", None) or getattr(message, "commands", ()):
            if type(inner) in _ANY_VALUE:
                _check_serialisable(inner)
