"""The raw controller: drives Monarch's worker protocol on the workers of a Dask client.

A :class:`Controller` claims ``world_size`` workers as ranks
(:mod:`~dask_monarch.controller.placement`), buffers the messages it is given,
compiles each flush into one Dask graph (:mod:`~dask_monarch.controller.compiler`)
and reads every rank's reports from a stream the rank's worker serves
(:mod:`~dask_monarch.controller.reports`); :mod:`~dask_monarch.controller.watch`
fails it when its client can no longer deliver its work.

A failure stays inside its controller (DESIGN decision 12): a broken or
closed controller never cancels anything through the scheduler. It drops its
futures and hangs up its report streams; the scheduler then releases its
tasks as unwanted, and whatever a worker already started returns at once on
a released rank. (``Client.cancel`` would also cancel the dependents of each
key, and one the controller no longer holds trips an assertion in the
scheduler that drops the whole shared client: docs/dask.md §12.)
"""

from __future__ import annotations

import itertools
import logging
import pickle
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import cloudpickle
from distributed import Client, wait

from .. import config
from ..exceptions import DeviceException, RemoteException
from ..protocol.messages import WORKER_MESSAGES, ArgsKwargs, GetRefUnitTestsOnly, Ref, StreamRef
from ..protocol.ndslice import Slice
from ..protocol.wire import ActorCall, ReadRef
from ..worker import construct_actor, register_actor
from .compiler import Compiler, InternalStep
from .placement import add_lanes, choose_workers, claim_ranks, open_rendezvous, tune_batched_comms
from .reports import Reports
from .watch import ClientWatch

if TYPE_CHECKING:
    from ..protocol.messages import WorkerMessage

logger = logging.getLogger("dask_monarch.controller")

_WORKER_MESSAGE_TYPES = frozenset(WORKER_MESSAGES)
_live: weakref.WeakSet = weakref.WeakSet()


def live_controllers() -> list[Controller]:
    """The controllers of this process that are not closed (for progress displays)."""
    return [c for c in list(_live) if not c._closed]

Ranks = int | Iterable[int] | Slice


class Controller:
    """Drive Monarch's worker protocol on ``world_size`` workers of ``client``.

    Workers are shared, not owned: several controllers (several notebooks)
    may use the same workers, each with its own lanes and refs.
    """

    def __init__(self, client: Client, world_size: int, *, device: str = "auto",
                 workers: list[str] | None = None) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"Controller needs a distributed.Client, got {client!r}")
        if client.asynchronous:
            raise TypeError("Controller needs a synchronous Client (asynchronous=False)")
        if type(world_size) is not int or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        self._client = client
        self.world_size = world_size
        self.token = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()  # the buffer
        self._wake = threading.Event()  # the buffer became non-empty (or the controller closed)
        self._rank_sets: dict = {}  # validated rank tuples, by what send() was given
        self._flush_lock = threading.Lock()  # graphs reach the scheduler in flush order
        self._progress = threading.Condition()  # reports, completion, failure
        self._buffer: list[tuple[tuple[int, ...], Any]] = []
        self._first_send = self._last_send = 0.0
        self._tails: dict[tuple[int, Any], Any] = {}  # (rank, lane) -> future of newest segment
        self._reports = Reports(self.token, self._progress, self._break_locked)
        self._probes = itertools.count(1)
        self._broken: DeviceException | None = None
        self._closed = False
        self._rendezvous: tuple[str, int] | None = None
        self._actor_ids = itertools.count()
        self._actors: list = []  # Dask actor futures: they live as long as the controller
        self.exited: set[int] = self._reports.exited  # ranks that reported their exit
        self._watch = ClientWatch(client, lambda: list(self._tails.values()), self._break)

        config.freeze_gc()
        self.workers = choose_workers(client, world_size, device, workers)
        self.resources, self.devices = claim_ranks(client, self.token, self.workers, device)
        client.sync(self._reports.subscribe, self.workers, client.connection_args,
                    callback_timeout=config.seconds("timeouts.claim"))
        tune_batched_comms(client, self.workers)
        self._watch.start()
        self._compiler = Compiler(self.token, self.resources)
        self._flush_size = int(config.get("flush.size"))
        self._idle = config.seconds("flush.idle")
        self._min_age = config.seconds("flush.min-age")
        self._max_age = config.seconds("flush.max-age")
        self._flusher = threading.Thread(target=self._flush_loop, daemon=True,
                                         name=f"dask_monarch-flush-{self.token}")
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
            raise self._broken
        if self._closed:
            raise RuntimeError("the controller is closed")
        if type(message) not in _WORKER_MESSAGE_TYPES:
            raise TypeError(f"expected a worker message, got {message!r}")
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
        if full or (age >= self._min_age and (age >= self._max_age
                                              or self._reports.ranks_idle())):
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
        with self._flush_lock:
            with self._lock:
                buffer, self._buffer = self._buffer, []
            if buffer and self._broken is None:
                self._submit(buffer)
        if self._broken is not None:
            raise self._broken

    def _submit(self, buffer: list) -> None:
        plan = self._compiler.compile(buffer)
        if plan.rendezvous and self._rendezvous is None:
            self._rendezvous = open_rendezvous(self._client, self.token, self.workers)
        if plan.new_lanes:
            add_lanes(self._client, self.token, self.workers, plan.new_lanes)
        self.messages_sent += plan.messages
        self.flushes += 1
        if plan.graph is not None:
            futures = self._client.get(plan.graph, plan.keys, sync=False)
            by_key = dict(zip(plan.keys, futures))
            self._reports.expect(plan.counts)
            for lane, key in plan.tails.items():
                self._tails[lane] = by_key[key]
            if self._broken is not None:  # broke meanwhile: _shutdown_async may have run
                self._tails.clear()
        if plan.error is not None:
            self._break(DeviceException(plan.error.cause, rank=plan.error.rank))

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
                        logger.debug("background flush of controller %s failed: %s",
                                     self.token, e)
                    break
                time.sleep(wait)

    # -- waiting ------------------------------------------------------------------------------

    def sync(self, timeout: float = 60) -> list:
        """Flush, wait until every rank ran everything sent so far, return what they reported.

        The controller messages (Status, FetchResult, RemoteFunctionFailed)
        caused by what was sent since the last sync, in seq order.
        """
        self.flush()
        self._wait(self._reports.caught_up, timeout, self._reports.pending)
        with self._progress:
            messages = self._reports.take_inbox()
        return sorted(messages, key=lambda msg: msg.seq)

    def _wait(self, ready: Callable[[], bool], timeout: float, pending: Callable[[], str]) -> None:
        deadline = time.monotonic() + timeout
        with self._progress:
            while True:
                if self._broken is not None:
                    raise self._broken
                if ready():
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"timed out after {timeout}s waiting for {pending()}")
                self._progress.wait(remaining)

    def get_ref(self, rank: int, ref: Ref, stream: StreamRef, timeout: float = 60) -> Any:
        """The value ``ref`` holds on ``rank``'s ``stream`` after everything sent before.

        Tensors come back on the CPU; ``None`` if the ref is absent;
        RemoteException if it holds an error.
        """
        (rank,) = self._ranks(rank)
        if type(ref) is not Ref or type(stream) is not StreamRef:
            raise TypeError("get_ref takes a rank, a Ref and a StreamRef")
        self.flush()
        if stream.id not in self._compiler.routers[rank].streams:
            raise ValueError(f"rank {rank} has no stream {stream.id}")
        probe = next(self._probes)
        self._send_internal((rank,), stream, ReadRef(probe, GetRefUnitTestsOnly(ref, stream)))
        self.flush()
        replies = self._reports.replies
        self._wait(lambda: probe in replies, timeout,
                   lambda: f"rank {rank} stream {stream.id} to reach the read of {ref}")
        with self._progress:
            reply = replies.pop(probe)
        if reply.state == "absent":
            return None
        if reply.state == "error":
            raise RemoteException(reply.value, rank=rank, traceback=reply.value)
        return pickle.loads(reply.value)

    # -- actors -------------------------------------------------------------------------------

    def spawn_actor(self, ranks: Ranks, name: str, cls: type, *args: Any,
                    **kwargs: Any) -> tuple[str, int]:
        """An instance of ``cls(*args, **kwargs)`` on each of ``ranks``; returns its broker id.

        The instances are Dask actors pinned to the ranks' workers; messages
        name them by the broker id (``ActorCallParams.broker_id``).
        """
        self._check_usable()
        ranks = self._ranks(ranks)
        broker = (name, next(self._actor_ids))
        # the class travels by value: only the workers need to import it
        payload = cloudpickle.dumps((cls, args, kwargs))
        futures = {
            rank: self._client.submit(
                construct_actor, payload, actor=True, pure=False,
                key=f"monarch_actor-{name}-{self.token}-{broker[1]}-{rank}",
                resources={self.resources[rank]: 1})
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

    def call_actor(self, ranks: Ranks, broker_id: tuple[str, int], seq: int, stream: StreamRef,
                   method: str, args: tuple = (), kwargs: dict | None = None) -> None:
        """Say which method the actor-call message ``seq`` on ``stream`` runs, and with what.

        Send it before the ``SendResultOfActorCall``/``CallActorMethod`` of
        ``seq``; Refs in ``args``/``kwargs`` stand for that message's
        ``local_state`` values.
        """
        step = ActorCall(tuple(broker_id), seq, method, ArgsKwargs.from_python(args, kwargs))
        self._send_internal(self._ranks(ranks), stream, step)

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
            raise self._broken
        if self._closed:
            raise RuntimeError("the controller is closed")

    # -- reports ------------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[Any], None]) -> None:
        """Call ``listener(message)`` for every controller message as it arrives.

        Listeners run on the client's event loop thread: they must be quick
        and must not block (the user API resolves its futures this way).
        """
        self._reports.listeners.append(listener)

    def progress(self) -> dict:
        """Segments submitted and finished so far, and messages sent (cheap; any thread)."""
        with self._progress:
            expected, done = self._reports.segments()
        return {"token": self.token, "messages": self.messages_sent, "flushes": self.flushes,
                "segments": expected, "segments_done": done,
                "state": "broken" if self._broken else "closed" if self._closed else "running"}

    # -- failure and shutdown -----------------------------------------------------------------

    @property
    def broken(self) -> DeviceException | None:
        """The DeviceException that broke this controller, if any."""
        return self._broken

    def _break(self, exc: DeviceException) -> None:
        with self._progress:
            self._break_locked(exc)

    def _break_locked(self, exc: DeviceException) -> None:
        if self._broken is not None or self._closed:
            return
        logger.warning("controller %s is broken: %s", self.token, exc)
        self._broken = exc
        self._progress.notify_all()
        self._client.loop.add_callback(self._shutdown_async)

    async def _shutdown_async(self) -> None:
        """Let go of our work and hang up every report stream (workers then free our state).

        Only our references go: no ``Client.cancel`` (see the module docs).
        """
        self._watch.stop()
        self._tails.clear()
        self._actors.clear()
        self._reports.hang_up()

    def close(self) -> None:
        """Wait briefly for outstanding work, then release everything on every rank."""
        if self._closed:
            return
        if self._broken is None:
            try:
                self.sync(timeout=config.seconds("timeouts.close"))
            except Exception as e:
                logger.info("closing controller %s without draining: %s", self.token, e)
        self._closed = True
        self._wake.set()
        with self._progress:
            self._progress.notify_all()
        try:
            self._client.sync(self._shutdown_async)
        except Exception as e:
            logger.debug("controller %s could not shut down cleanly: %s", self.token, e)

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "closed" if self._closed else "running"
        return f"<Controller {self.token}: {self.world_size} ranks, {state}>"
