"""The WorkerPlugin that owns dask_monarch's state on a Dask worker.

Installed once per worker (``LocalMeshCluster`` does it at start, the
``plugins/`` preloads do it for ``dask worker``, and a controller installs it
on workers that lack it). It holds one :class:`RankState` per controller that
claimed the worker, serves each controller's report stream, and runs the
tasks the compiler submits. Setup is cheap and never blocks the event loop:
no torch import, no rendezvous.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import cloudpickle
from distributed import WorkerPlugin, get_worker
from distributed.batched import BatchedSend
from distributed.comm.core import CommClosedError
from distributed.protocol.serialize import ToPickle

from .. import dask_internals as internals
from ..protocol.names import (
    HEARTBEAT_OP,
    PLUGIN_NAME,
    RELAY_HANDLER,
    REPORTS_HANDLER,
    RESOURCE_CAPACITY,
    RESOURCE_PREFIX,
    STATE_HANDLER,
    executor_prefix,
    mesh_id,
    worker_resource,
)
from ..protocol.wire import CONTROL, Payload
from .calls import InvalidRemoteFunction, pickled_code_allowed
from .debugger import install_breakpointhook
from .relay import Relay
from .signals import ignore_sigint

if TYPE_CHECKING:
    from distributed import Worker
    from distributed.comm import Comm

    from ..protocol.messages import StreamCreationMode
    from .lane import Lane
    from .rank import RankState

logger = logging.getLogger("dask_monarch.worker")

# Per-worker figures in every heartbeat: the Workers table of the dashboard shows them as
# columns and ``client.scheduler_info()`` lists them (worker "metrics").
METRICS = (
    "monarch_ranks",
    "monarch_lanes",
    "monarch_refs",
    "monarch_messages",
    "monarch_tensor_bytes",
)
MAX_RELEASED = 256  # released controllers remembered per worker (their late tasks drain)


class MonarchWorkerPlugin(WorkerPlugin):
    """Per-worker home of every controller's rank state (idempotent, named ``dask_monarch``)."""

    name = PLUGIN_NAME
    idempotent = True
    inline = False  # quick segments run on the event loop (set from the worker's config)

    def __init__(self, report_interval: str | None = None, batched_interval: float | None = None):
        self.report_interval = report_interval  # None: dask_monarch.comm.report-interval
        # The gap of the worker's own batched stream to the scheduler, lowered only on workers
        # dask_monarch started (LocalMeshCluster: deployment/comm_gaps.py); None leaves Dask's.
        if batched_interval is not None and batched_interval < 0:
            raise ValueError(f"batched_interval cannot be negative, got {batched_interval}")
        self.batched_interval = batched_interval

    async def setup(self, worker: Worker) -> None:
        from .. import config

        self.worker = worker
        self.loop_thread = threading.get_ident()  # setup runs on the event loop
        ignore_sigint(worker)
        install_breakpointhook()  # breakpoint() on a lane opens a remote pdb (worker/debugger.py)
        if self.batched_interval is not None:
            internals.lower_gap(worker.batched_stream, self.batched_interval)
        if self.report_interval is None:  # read here: the worker's config, not the client's
            self.report_interval = config.get("comm.report-interval", "0.5ms")
        self.inline = bool(config.get("worker.inline-segments", True))
        self.ranks: dict = {}  # controller token -> RankState
        self.released: OrderedDict[str, None] = OrderedDict()  # tokens released on purpose
        self.extra_threads = 0
        # Tasks a released controller had queued may still start: they find its lanes'
        # names pointing here, and return without running anything.
        self.drain = ThreadPoolExecutor(1, thread_name_prefix="monarch-drain")
        self.relay = Relay(self)  # relayed flushes (dask_monarch.flush.relay)
        worker.handlers[REPORTS_HANDLER] = self.serve_reports
        worker.handlers[STATE_HANDLER] = self.state_snapshot
        worker.handlers[RELAY_HANDLER] = self.relay.serve
        for name in METRICS:
            worker.metrics[name] = functools.partial(self.metric, name)

    async def teardown(self, worker: Worker) -> None:
        for state in list(self.ranks.values()):
            await asyncio.to_thread(state.release)  # frees user objects: never on the loop
        self.relay.close()
        for handler in (REPORTS_HANDLER, STATE_HANDLER, RELAY_HANDLER):
            worker.handlers.pop(handler, None)
        for name in METRICS:
            worker.metrics.pop(name, None)

    def metric(self, name: str, worker: Worker | None = None) -> int:
        """One of :data:`METRICS`, summed over the live ranks (read on heartbeats; no locks)."""
        ranks = [state for state in list(self.ranks.values()) if not state.released]
        lanes = [lane for state in ranks for lane in state.all_lanes()]
        if name == "monarch_ranks":
            return len(ranks)
        if name == "monarch_lanes":
            return len(lanes)
        if name == "monarch_refs":
            return sum(len(lane.env) for lane in lanes)
        if name == "monarch_messages":
            return sum(lane.steps for lane in lanes)
        storages: dict[int, int] = {}
        for lane in lanes:
            storages.update(lane.storages())
        return sum(storages.values())  # monarch_tensor_bytes

    # -- claiming -----------------------------------------------------------------------------

    async def ensure_resource(self) -> str:
        """The resource that pins this worker's rank tasks (``monarch-<name>``)."""
        for name in self.worker.state.total_resources:
            if name.startswith(RESOURCE_PREFIX):
                return name
        name = worker_resource(self.worker.name)
        await self.worker.set_resources(**{name: RESOURCE_CAPACITY})
        return name

    async def claim(self, token: str, rank: int, world_size: int, settings: dict) -> dict:
        """Create controller ``token``'s state for ``rank`` (torch is imported off the loop)."""
        if token in self.ranks:
            raise ValueError(f"controller {token} already claimed this worker")
        resource = await self.ensure_resource()
        from .. import config
        from .device import gpu_uuid, pick_device  # imports torch
        from .rank import RankState  # imports torch and the handlers

        device = await asyncio.to_thread(pick_device, settings.get("device", "auto"))

        config.freeze_gc()
        state = RankState(self, token, rank, world_size, device, settings)
        self.ranks[token] = state
        self._register(state.control)
        return {
            "resource": resource,
            "device": str(device or "cpu"),
            "pid": os.getpid(),
            "address": self.worker.address,
            "name": str(self.worker.name),
            "gpu": gpu_uuid(device.index) if device is not None else None,
        }

    def add_lanes(
        self, token: str, lanes: list[tuple[int, StreamCreationMode, str | None]]
    ) -> None:
        """Create lanes ``(stream id, creation mode, name)`` and their device streams before any
        task names their executor (DESIGN decision 2); the name is the dashboard's."""
        state = self.ranks[token]
        for stream_id, mode, name in lanes:
            lane = state.add_lane(stream_id, mode, name)
            if lane is not None:
                self._register(lane)

    def _register(self, lane) -> None:
        """Give the lane an executor and a thread of the worker's budget (on the loop)."""
        self.worker.executors[lane.executor_name] = lane.executor
        self.extra_threads += 1
        internals.add_execution_slot(self.worker)

    def remove_lane(self, state: RankState, lane: Lane) -> None:
        """A dropped stream's lane ran its last step: forget it, give its thread back (on the
        loop). No task names its executor any more; a released rank already gave it back."""
        if state.lanes.get(lane.label) is lane:
            del state.lanes[lane.label]
        if self.worker.executors.get(lane.executor_name) is lane.executor:
            self.worker.executors = {  # a new dict: Worker.close may iterate the old one
                k: v for k, v in self.worker.executors.items() if k != lane.executor_name
            }
            self.extra_threads -= 1
            internals.add_execution_slot(self.worker, -1)

    def forget(self, state: RankState) -> None:
        """Drop a released rank state; each lane's thread goes back once its work returned.

        Runs on the loop, where Dask picks a task's executor and hands it the
        task in one step: once a lane's name points at the drain, its own
        executor gets nothing new. What Dask handed it before still runs
        (returning at once, the rank being released) and is never cancelled:
        a cancelled executor future leaves its task "executing" forever, an
        execution slot lost (docs/dask.md §12). The lane's thread leaves the
        budget only after that work, so a broken controller never eats into
        the slots of the others.
        """
        if self.ranks.get(state.token) is state:
            del self.ranks[state.token]
        self.released[state.token] = None
        while len(self.released) > MAX_RELEASED:
            token, _ = self.released.popitem(last=False)
            prefix = executor_prefix(token)
            self.worker.executors = {  # a new dict: Worker.close may iterate the old one
                k: v for k, v in self.worker.executors.items() if not k.startswith(prefix)
            }
        executors = dict(self.worker.executors)
        for lane in state.all_lanes():
            if executors.get(lane.executor_name) is lane.executor:
                executors[lane.executor_name] = self.drain
                self._retire(lane.executor)
        self.worker.executors = executors

    def _retire(self, executor: ThreadPoolExecutor) -> None:
        """Shut a released lane's executor down after its queued work; then give its thread back."""
        try:
            last = executor.submit(_nothing)  # runs after everything queued before it
        except RuntimeError:  # a dropped stream's lane shut it down on its last step
            self._give_back()  # (remove_lane will not: the lane's name points at the drain)
            return
        executor.shutdown(wait=False)  # never cancel_futures: those tasks are Dask's
        loop = self.worker.loop
        last.add_done_callback(lambda _: loop.add_callback(self._give_back))

    def _give_back(self) -> None:
        self.extra_threads -= 1
        internals.add_execution_slot(self.worker, -1)

    def release(self, token: str) -> bool:
        state = self.ranks.get(token)
        if state is None:
            return False
        state.release()
        return True

    def rank_state(self, token: str, rank: int) -> RankState | None:
        """The state a task runs against (None: its controller left on purpose)."""
        state = self.ranks.get(token)
        if state is None and token in self.released:
            return None
        if state is None or state.rank != rank:
            from .errors import ReplayRefused

            raise ReplayRefused(
                f"rank {rank} of mesh {mesh_id(token)} is not on worker {self.worker.address} "
                "(the worker restarted or the controller left); refusing to run its messages"
            )
        return state

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """A segment task about to start whose steps are quick gets its coroutine twin, which
        Dask runs on the event loop instead of the lane's thread (worker/inline.py)."""
        if finish != "executing" or not self.inline or not self.ranks:
            return
        ts = internals.worker_task(self.worker, key)
        spec = internals.task_spec(ts)
        if getattr(spec, "func", None) is not run_segment:
            return
        token, rank, label, _, payload = spec.args[:5]
        state = self.ranks.get(token)
        if state is None or state.rank != rank or state.torch_device is not None:
            return  # a CUDA rank's fetch waits for its stream: never on the loop
        lane = state.control if label == CONTROL else state.lanes.get(label)
        if lane is None or state.failed is not None:
            return
        from .inline import inline_task, is_quick, small_steps

        steps = small_steps(payload.data)
        if steps is None:
            return
        payload.steps = steps  # unpickled once, wherever they run
        if is_quick(steps, lane.env):
            internals.set_task_spec(ts, inline_task(spec, state))
            lane.inlined += 1

    # -- comm handlers ------------------------------------------------------------------------

    async def serve_reports(self, comm: Comm, token: str) -> None:
        """Stream a controller's reports to it until it hangs up; then free its state.

        The controller opens this stream right after claiming the worker. Its
        end (``Controller.close``, or a notebook kernel that died) releases
        everything the controller held on this worker. The controller's
        heartbeats arrive on it too; each is answered here, on the event loop,
        with what every lane is doing (:meth:`RankState.heartbeat`), so a rank
        whose lanes are all blocked still answers.
        """
        state = self.ranks.get(token)
        if state is None:
            await comm.write({"error": f"controller {token} has no state on {self.worker.address}"})
            return
        stream = BatchedSend(interval=self.report_interval)
        # Its log of recent batches would keep the last 1000 (each under 1 MB), fetched values
        # included, long after they reached the controller (docs/dask.md §13): keep none.
        internals.keep_no_log(stream)
        stream.start(comm)
        state.attach(stream)
        try:
            while True:  # heartbeats, until the controller closes the stream
                msg = await comm.read()
                if type(msg) is not dict or msg.get("op") != HEARTBEAT_OP:
                    break
                stream.send(ToPickle(state.heartbeat(msg.get("beat", 0))))
        except (CommClosedError, OSError) as e:
            logger.debug("controller %s hung up its report stream: %r", token, e)
        finally:
            state._stream = None
            if not state.released:
                logger.info(
                    "mesh %s left without Exit; releasing rank %d", mesh_id(token), state.rank
                )
                await asyncio.to_thread(state.release)
            stream.abort()

    def state_snapshot(self) -> list[dict]:
        """Every rank this worker holds, for the dashboard."""
        return [state.snapshot() for state in list(self.ranks.values())]


def _nothing() -> None:
    pass


# -- functions run through Client.run (async: they never block the worker's event loop) ------


def _plugin(worker) -> MonarchWorkerPlugin:
    return worker.plugins[PLUGIN_NAME]


async def describe_worker(dask_worker: Worker | None = None) -> dict:
    """What a controller needs to choose ranks: GPUs, an existing rank resource."""
    gpus = await asyncio.to_thread(_gpu_count)
    resource = next(
        (r for r in dask_worker.state.total_resources if r.startswith(RESOURCE_PREFIX)), None
    )
    return {
        "gpus": gpus,
        "resource": resource,
        "name": str(dask_worker.name),
        "has_plugin": PLUGIN_NAME in dask_worker.plugins,
    }


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


async def claim_rank(
    token: str,
    ranks: dict[str, int],
    world_size: int,
    settings: dict,
    dask_worker: Worker | None = None,
) -> dict:
    """Make this worker rank ``ranks[address]`` of controller ``token`` (installs the plugin)."""
    if PLUGIN_NAME not in dask_worker.plugins:
        await dask_worker.plugin_add(MonarchWorkerPlugin(), name=PLUGIN_NAME)
    rank = ranks[dask_worker.address]
    return await _plugin(dask_worker).claim(token, rank, world_size, settings)


async def create_lanes(
    token: str,
    lanes: list[tuple[int, StreamCreationMode, str | None]],
    dask_worker: Worker | None = None,
) -> None:
    """Create controller ``token``'s lanes ``(stream id, creation mode, name)`` on this
    worker."""
    _plugin(dask_worker).add_lanes(token, lanes)


async def start_rendezvous(token: str, dask_worker: Worker | None = None) -> tuple[str, int]:
    """Start controller ``token``'s store on this worker (its rank 0)."""
    from .comm import start_rendezvous as start

    return await asyncio.to_thread(start, _plugin(dask_worker).ranks[token])


async def set_rendezvous(
    token: str, host: str, port: int, dask_worker: Worker | None = None
) -> None:
    """Tell this worker where controller ``token``'s store is (ranks other than 0)."""
    from .comm import set_rendezvous as set_

    set_(_plugin(dask_worker).ranks[token], host, port)


async def register_actor(
    token: str, broker_id: tuple, keys: dict[str, str], dask_worker: Worker | None = None
) -> None:
    """Let controller ``token`` call the Dask actor ``keys[address]`` as ``broker_id``."""
    from .actor import register_actor as register

    actor = dask_worker.state.actors[keys[dask_worker.address]]
    register(_plugin(dask_worker).ranks[token], broker_id, actor)


async def release_controller(token: str, dask_worker: Worker | None = None) -> bool:
    """Release controller ``token``'s rank on this worker (a claim the controller gave up)."""
    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return False
    state = plugin.ranks.get(token)
    if state is None:
        return False
    await asyncio.to_thread(state.release)
    return True


async def trace_start(token: str, limit: int, dask_worker: Worker | None = None) -> float:
    """Turn controller ``token``'s trace on for its rank here (``dm.trace``); this worker's
    clock."""
    from .tracing import start

    return start(_plugin(dask_worker).ranks[token], limit)


async def cancel_controller(
    token: str, grace: float, dask_worker: Worker | None = None
) -> list[dict]:
    """Release controller ``token``'s rank here and interrupt its running calls
    (``mesh.exit(cancel=True)``: worker/cancel.py); what each busy lane was doing."""
    from .cancel import cancel

    plugin = dask_worker.plugins.get(PLUGIN_NAME)
    state = None if plugin is None else plugin.ranks.get(token)
    if state is None:
        return []
    return await asyncio.to_thread(cancel, state, grace)


async def trace_collect(
    token: str, stop: bool = True, dask_worker: Worker | None = None
) -> dict | None:
    """Controller ``token``'s trace records on this worker (None: no rank of it here)."""
    from .tracing import collect

    state = _plugin(dask_worker).ranks.get(token)
    return None if state is None else collect(state, stop)


# -- the tasks the controller submits --------------------------------------------------------


def construct_actor(payload: bytes, token: str | None = None) -> Any:
    """Build an actor from ``cloudpickle.dumps((cls, args, kwargs))`` (a Dask actor task)
    for controller ``token``'s rank here: on the rank's device (``actor.build_actor``).

    The class travels pickled: refused where pickled code is (docs/security.md).
    """
    if not pickled_code_allowed():
        raise InvalidRemoteFunction(
            "actor classes travel pickled, and pickled code is disabled by "
            "dask_monarch.functions.allow-pickled on this worker"
        )
    cls, args, kwargs = cloudpickle.loads(payload)
    state = _plugin(get_worker()).ranks.get(token) if token is not None else None
    if state is None:
        return cls(*args, **kwargs)
    from .actor import build_actor  # imports torch

    return build_actor(state, cls, args, kwargs)


def run_segment(
    token: str, rank: int, lane: object, index: int, payload: Payload, *after: object
) -> int:
    """Run segment ``index`` of ``lane`` for controller ``token``'s ``rank``.

    ``after`` holds the results of the tasks this one must follow (the lane's
    previous segment, the rank's last control step); only their order matters.
    The payload's bytes are taken out of their holder: Dask keeps the task's
    arguments in its logs, the bytes need not stay with them.
    """
    steps, data = payload.take_steps(), payload.take()
    state = _plugin(get_worker()).rank_state(token, rank)
    if state is None:  # queued before its controller released the rank: nothing to do
        return 0
    return state.run_segment(lane, index, data, steps)
