"""The raw controller: drives Monarch's worker protocol on the workers of a Dask client.

A :class:`Controller` claims ``world_size`` workers as ranks, buffers the
messages it is given, compiles each flush into one Dask graph
(:mod:`dask_monarch.graph`) and reads every rank's reports from a stream the
rank's worker serves (:mod:`dask_monarch.worker.plugin`). Reports come back
on that stream rather than through task results: a fetch costs no extra
gather, and a lost worker shows up at once as a closed stream.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import cloudpickle
from distributed import Client, wait
from distributed.comm import connect
from distributed.comm.core import CommClosedError

from .. import config
from ..exceptions import DeviceException, RemoteException
from ..protocol.messages import (
    WORKER_MESSAGES,
    ArgsKwargs,
    FetchResult,
    GetRefUnitTestsOnly,
    Ref,
    RemoteFunctionFailed,
    Status,
    StreamRef,
)
from ..protocol.ndslice import Slice
from ..protocol.wire import ActorCall, Exited, Fatal, Fetched, LaneDone, ReadRef, RefValue
from ..worker.actor import construct_actor
from ..worker.plugin import (
    claim_rank,
    create_lanes,
    describe_worker,
    register_actor,
    set_rendezvous,
    start_rendezvous,
)
from .compiler import Compiler, InternalStep

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
                 workers: list[str] | None = None):
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
        self._expected: dict[tuple[int, Any], int] = {}  # (rank, lane) -> newest segment
        self._done: dict[tuple[int, Any], int] = {}  # (rank, lane) -> last finished segment
        self._tails: dict[tuple[int, Any], Any] = {}  # (rank, lane) -> future of newest segment
        self._inbox: list = []
        self._replies: dict[int, RefValue] = {}
        self._listeners: list[Callable[[Any], None]] = []
        self._probes = itertools.count(1)
        self._broken: DeviceException | None = None
        self._closed = False
        self._comms: dict[int, Any] = {}
        self._rendezvous: tuple[str, int] | None = None
        self._actor_ids = itertools.count()
        self._actors: list = []  # Dask actor futures: they live as long as the controller
        self.exited: set[int] = set()

        config.freeze_gc()
        self.workers = self._choose_workers(world_size, device, workers)
        self._claim(device)
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

    # -- placement ----------------------------------------------------------------------------

    def _choose_workers(self, world_size: int, device: str, workers: list[str] | None) -> list[str]:
        info = self._client.run(describe_worker, workers=workers)
        if device == "cuda":
            info = {a: i for a, i in info.items() if i["gpus"]}
        if len(info) < world_size:
            kind = "GPU workers" if device == "cuda" else "workers"
            raise ValueError(
                f"Controller needs {world_size} {kind} but the cluster has {len(info)}; "
                "start more workers or ask for a smaller world_size"
            )
        # GPU workers first, then by rank resource / name in natural order (rank2 < rank10)
        def order(addr):
            i = info[addr]
            return (not i["gpus"], _natural(i["resource"] or ""), _natural(i["name"]), addr)

        return sorted(info, key=order)[:world_size]

    def _claim(self, device: str) -> None:
        backend = config.get("backend", "auto")
        if backend not in ("auto", "gloo"):
            raise ValueError(f"dask_monarch.backend must be 'auto' or 'gloo', got {backend!r}")
        settings = {"device": device, "collective_timeout": config.seconds("timeouts.collective"),
                    "backend": backend}
        ranks = {address: rank for rank, address in enumerate(self.workers)}
        replies = self._client.run(claim_rank, self.token, ranks, self.world_size, settings,
                                   workers=self.workers)
        self.resources = [replies[a]["resource"] for a in self.workers]
        self.devices = [replies[a]["device"] for a in self.workers]
        self._client.sync(self._subscribe_all, callback_timeout=config.seconds("timeouts.claim"))
        self._tune_batched_comms()

    async def _subscribe_all(self) -> None:
        comms = await asyncio.gather(*(self._subscribe(a) for a in self.workers))
        for rank, comm in enumerate(comms):
            self._comms[rank] = comm
            asyncio.ensure_future(self._read_reports(rank, comm))

    async def _subscribe(self, address: str):
        comm = await connect(address, **self._client.connection_args)
        comm.name = f"dask_monarch reports {self.token}"
        await comm.write({"op": "dask_monarch_reports", "token": self.token, "reply": False})
        return comm

    def _tune_batched_comms(self) -> None:
        interval = config.seconds("comm.batched-interval")
        if interval is None:
            return
        client = self._client
        if client.scheduler_comm is not None:
            client.scheduler_comm.interval = min(client.scheduler_comm.interval, interval)
        client.run_on_scheduler(_tune_scheduler, interval, list(self.workers), client.id)
        client.run(_tune_worker, interval, workers=list(self.workers))

    # -- sending ------------------------------------------------------------------------------

    def send(self, ranks: Ranks, message: Any) -> None:
        """Buffer ``message`` for ``ranks`` (an int, ints or a Slice of global ranks)."""
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
        if full or (age >= self._min_age and (age >= self._max_age or self._ranks_idle())):
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
        except TypeError:  # a list: not hashable, not cached
            pass
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
            self._start_rendezvous()
        if plan.new_lanes:
            self._client.run(
                _create_lanes_by_address, self.token,
                {self.workers[r]: ids for r, ids in plan.new_lanes.items()},
                workers=[self.workers[r] for r in plan.new_lanes],
            )
        self.messages_sent += plan.messages
        self.flushes += 1
        if plan.graph is not None:
            futures = self._client.get(plan.graph, plan.keys, sync=False)
            by_key = dict(zip(plan.keys, futures))
            with self._progress:
                self._expected.update(plan.counts)
            for lane, key in plan.tails.items():
                self._tails[lane] = by_key[key]
        if plan.error is not None:
            self._break(DeviceException(plan.error.cause, rank=plan.error.rank))

    def _start_rendezvous(self) -> None:
        """Start the store collectives rendezvous through, on rank 0's worker (never here)."""
        first = self.workers[0]
        host, port = self._client.run(start_rendezvous, self.token, workers=[first])[first]
        self._client.run(set_rendezvous, self.token, host, port, workers=self.workers)
        self._rendezvous = (host, port)

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
                    except Exception:  # kept as the controller's failure; raised on the next call
                        pass
                    break
                time.sleep(wait)

    # -- waiting ------------------------------------------------------------------------------

    def sync(self, timeout: float = 60) -> list:
        """Flush, wait until every rank ran everything sent so far, return what they reported.

        The controller messages (Status, FetchResult, RemoteFunctionFailed)
        caused by what was sent since the last sync, in seq order.
        """
        self.flush()
        self._wait(self._caught_up, timeout, self._pending_description)
        with self._progress:
            messages, self._inbox = self._inbox, []
        return sorted(messages, key=lambda msg: msg.seq)

    def _ranks_idle(self) -> bool:
        """Every segment sent so far has run: a flush now keeps the ranks busy.

        While they are busy, more messages join the next flush instead (up to
        ``flush.max-age`` and ``flush.size``): fewer, larger segments cost Dask
        far less per message than many small ones.
        """
        with self._progress:
            return self._caught_up()

    def _caught_up(self) -> bool:
        done = self._done
        return all(done.get(lane, -1) >= index for lane, index in self._expected.items())

    def _pending_description(self) -> str:
        pending = [
            f"rank {rank} {'control steps' if lane == 'control' else f'stream {lane}'} "
            f"(ran {self._done.get((rank, lane), -1) + 1} of {index + 1} segments)"
            for (rank, lane), index in sorted(self._expected.items(), key=str)
            if self._done.get((rank, lane), -1) < index
        ]
        return ", ".join(pending)

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
        self._wait(lambda: probe in self._replies, timeout,
                   lambda: f"rank {rank} stream {stream.id} to reach the read of {ref}")
        with self._progress:
            reply = self._replies.pop(probe)
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
        self._listeners.append(listener)

    async def _read_reports(self, rank: int, comm) -> None:
        try:
            while True:
                batch = await comm.read()
                self._on_reports(rank, batch)
        except (CommClosedError, OSError, asyncio.CancelledError):
            pass
        except Exception as e:  # a report we cannot read: the mesh cannot be trusted
            logger.exception("bad report from rank %d", rank)
            self._break(DeviceException(f"unreadable report from its worker: {e!r}", rank=rank))
            return
        if not self._closed:
            self._break(DeviceException(
                f"lost connection to its worker {self.workers[rank]} "
                "(the worker died, restarted or was removed)", rank=rank))

    def _on_reports(self, rank: int, batch: list) -> None:
        delivered = []
        with self._progress:
            for item in batch:
                t = type(item)
                if t is LaneDone:
                    key = (item.rank, item.lane)
                    if item.index > self._done.get(key, -1):
                        self._done[key] = item.index
                elif t is Fetched:
                    delivered.append(_fetch_result(item))
                elif t is Status or t is RemoteFunctionFailed:
                    delivered.append(item)
                elif t is RefValue:
                    if item.probe > 0:
                        self._replies[item.probe] = item
                elif t is Fatal:
                    self._break_locked(DeviceException(item.cause, rank=item.rank))
                elif t is Exited:
                    self.exited.add(item.rank)
                    if item.error is not None:
                        source, text = item.error
                        self._break_locked(DeviceException(
                            f"Exit with an error from {source or 'an unknown source'}: {text}",
                            rank=item.rank))
            self._inbox.extend(delivered)
            self._progress.notify_all()
        for msg in delivered:
            for listener in self._listeners:
                listener(msg)

    # -- failure and shutdown -----------------------------------------------------------------

    def progress(self) -> dict:
        """Segments submitted and finished so far, and messages sent (cheap; any thread)."""
        with self._progress:
            expected = sum(index + 1 for index in self._expected.values())
            done = sum(min(self._done.get(lane, -1), index) + 1
                       for lane, index in self._expected.items())
        return {"token": self.token, "messages": self.messages_sent, "flushes": self.flushes,
                "segments": expected, "segments_done": done,
                "state": "broken" if self._broken else "closed" if self._closed else "running"}

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
        """Cancel queued work and hang up every report stream (workers then free our state)."""
        futures = list(self._tails.values())
        self._tails.clear()
        if futures:
            try:
                await self._client._cancel(futures)
            except Exception:
                pass
        self._actors.clear()
        comms = list(self._comms.values())
        self._comms.clear()
        for comm in comms:
            comm.abort()

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
        except Exception:
            pass

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "broken" if self._broken else "closed" if self._closed else "running"
        return f"<Controller {self.token}: {self.world_size} ranks, {state}>"


def _fetch_result(item: Fetched) -> FetchResult | RemoteFunctionFailed:
    try:
        return FetchResult(item.seq, item.rank, pickle.loads(item.payload))
    except Exception as e:
        return RemoteFunctionFailed(item.seq, item.rank,
                                    f"the fetched value cannot be unpickled on the client: {e!r}")


def _natural(text: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


async def _create_lanes_by_address(token: str, by_address: dict[str, list[int]],
                                   dask_worker=None) -> None:
    await create_lanes(token, by_address[dask_worker.address], dask_worker=dask_worker)


def _tune_scheduler(interval: float, workers: list[str], client_id: str,
                    dask_scheduler=None) -> None:
    for address in workers:
        comm = dask_scheduler.stream_comms.get(address)
        if comm is not None:
            comm.interval = min(comm.interval, interval)
    comm = dask_scheduler.client_comms.get(client_id)
    if comm is not None:
        comm.interval = min(comm.interval, interval)


def _tune_worker(interval: float, dask_worker=None) -> None:
    comm = dask_worker.batched_stream
    comm.interval = min(comm.interval, interval)

