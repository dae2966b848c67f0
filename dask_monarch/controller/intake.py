"""The scheduler's intake of a flush: one compact message becomes the flush's ordinary Dask tasks.

``Client.get`` takes any graph, so a two-task flush pays the generic path:
the client builds, tokenizes and pickles a ``HighLevelGraph`` expression and
walks its own stack for the dashboard's code view; the scheduler unpickles
it, materialises it and orders it, each in a thread of its own
(``distributed.utils.offload``), before it makes the tasks. On a loaded
machine those two thread hand-offs alone cost milliseconds (docs/dask.md
§11). A flush is simpler: a list of segments, each one task with one
function, its rank's resource and its lane's executor. :class:`FlushIntake`,
a scheduler plugin every controller registers (idempotent), takes that list
on the client's own stream to the scheduler and makes the same tasks
synchronously, through the scheduler's own ``_create_taskstate_from_graph``
(what ``update-graph`` calls): the same keys, annotations, priorities in
message order, the client's wish for every key, plugins' ``update_graph``
hooks, task-stream entries. Nothing about how they run changes.

The scheduler holds a flush's tasks for its controller under a client name
of its own (:func:`holder`, the way Dask's publish and queues hold keys), not
for the client that sent it: the client makes no future per segment and gets
no ``key-in-memory`` message per segment that finished (a scheduler write, a
client read and its handling on every round trip: 0.3-0.5 ms of a fetch's
3.5 on a 2-core machine, docs/dask.md §11). The controller lets go of its
tails by key (:func:`release`, in batches: controller/release.py); a tail let
go of before it finished is kept until it has (released while ``processing``,
the scheduler would cancel it). A task Dask fails is announced on the
controller's event topic (:func:`failures_topic`), which the controller
watches. When the controller goes (``release`` of everything), or its client
leaves the scheduler, the holder goes, and with it every task it held.

Messages on one comm are handled in order, so a flush cannot overtake the
client's earlier messages (releases of older tails among them). A scheduler
that cannot take the plugin (plugins not allowed, not importable there, or a
distributed whose scheduler internals the intake calls are not what it
expects: :func:`missing_on`) leaves the controller on ``Client.get``; so does
``dask_monarch.flush.intake: false``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.serialize import ToPickle

from .. import dask_internals as internals
from ..dask_internals import SpanMetadata, Task, TaskRef
from ..protocol.wire import Payload
from ..worker import run_relay, run_segment

if TYPE_CHECKING:
    from distributed import Client, Scheduler

logger = logging.getLogger("dask_monarch.controller")

OP = "dask_monarch-flush"  # the stream op; a scheduler without the plugin has no handler for it
RELEASE_OP = "dask_monarch-release"  # let go of tails by key (all of them: the controller went)
PLUGIN_NAME = "dask_monarch-flush-intake"
FIFO_TIMEOUT_S = 60.0  # what Client.get gives update-graph (its fifo_timeout="60s")


class SegmentTask(NamedTuple):
    """One segment's task, as the compiler plans it and the intake receives it."""

    key: tuple
    rank: int
    lane: Any
    index: int
    payload: tuple[bytes, ...]  # pickled lists of steps, in order (see Compiler's _Payloads)
    after: list  # keys of the tasks it follows
    resource: str  # its rank's resource
    executor: str  # its lane's executor


class RelayTask(NamedTuple):
    """One wave of a relayed flush: a lane's segments on every rank, as one task that the
    wave's first rank fans out to the others (worker/relay.py)."""

    key: tuple  # the key its first rank's segment would have
    rank: int  # the wave's first rank: its worker runs the task
    lane: Any
    index: int
    wave: dict  # what worker/relay.py delivers: every rank's segment, its edges, its worker
    after: list  # always empty: each rank orders its own segments
    resource: str  # the first rank's resource
    executor: str  # the first rank's lane executor (the task itself runs on the event loop)


def holder(token: str) -> str:
    """The client name under which the scheduler holds controller ``token``'s segments."""
    return f"dask_monarch-{token}"


def failures_topic(token: str) -> str:
    """The scheduler's event topic on which the intake announces a segment task Dask failed."""
    return f"dask_monarch-failed-{token}"


def make_task(token: str, segment: SegmentTask | RelayTask) -> Task:
    """The Dask task that runs ``segment`` (the same on either path)."""
    if type(segment) is RelayTask:
        return Task(segment.key, run_relay, token, segment.wave)
    key, rank, lane, index, payload, after = segment[:6]
    return Task(key, run_segment, token, rank, lane, index, Payload(payload), *map(TaskRef, after))


class FlushIntake(SchedulerPlugin):
    """Serves ``dask_monarch-flush`` on the scheduler: a flush's segments become its tasks."""

    name = PLUGIN_NAME
    idempotent = True  # one per scheduler, however many controllers register it

    async def start(self, scheduler: Scheduler) -> None:
        missing = missing_on(scheduler)
        if missing:  # refused: the controller stays on Client.get (see install)
            raise RuntimeError(
                f"this scheduler's distributed has no {', '.join(missing)}, which the "
                "dask_monarch flush intake calls"
            )
        self.scheduler = scheduler
        self.owners: dict[str, str] = {}  # holder -> the client whose controller it holds for
        self.finishing: dict[Any, str] = {}  # tail let go of before it finished -> its holder
        scheduler.stream_handlers[OP] = self.intake
        scheduler.stream_handlers[RELEASE_OP] = self.release

    async def close(self) -> None:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.stream_handlers.pop(OP, None)
            scheduler.stream_handlers.pop(RELEASE_OP, None)

    def intake(
        self, client: str, token: str, segments: list, span: dict | None = None, **_: Any
    ) -> None:
        """Make the tasks of one flush of controller ``token`` for ``client``, as update-graph
        would (its checks and error reports included), without leaving the event loop."""
        scheduler = self.scheduler
        start = time.time()
        stimulus_id = f"dask_monarch-flush-{start}"
        held = holder(token)
        self.owners[held] = client
        dsk, resources, executors, ordered = {}, {}, {}, {}
        for i, segment in enumerate(segments):
            key = segment.key
            dsk[key] = make_task(token, segment)
            resources[key] = {segment.resource: 1}
            executors[key] = segment.executor
            ordered[key] = i
        keys = set(dsk)
        annotations = {"resources": resources, "executor": executors}
        if span is not None:  # dask_monarch.span: as dask.annotate(span=...) would set it
            annotations["span"] = dict.fromkeys(keys, span)
        try:
            if internals.lost_dependencies(scheduler, dsk, keys):
                self._failed(token, keys, "a segment it follows was lost")
                return
            internals.create_tasks(
                scheduler,
                start=start,
                dsk=dsk,
                keys=keys,
                ordered=ordered,
                client=held,
                annotations_by_type=annotations,
                global_annotations=None,
                stimulus_id=stimulus_id,
                submitting_task=None,
                span_metadata=SpanMetadata(collections=[{"type": "low-level-graph"}]),
                fifo_timeout=FIFO_TIMEOUT_S,
            )
        except Exception as e:  # as update-graph would fail the flush's keys: the controller
            logger.exception("dask_monarch flush of controller %s refused: %s", token, e)
            scheduler.client_releases_keys(keys=keys, client=held, stimulus_id=stimulus_id)
            self._failed(token, keys, f"the scheduler refused it: {type(e).__name__}: {e}")

    def release(self, client: str, token: str, keys: list | None = None, **_: Any) -> None:
        """Let go of controller ``token``'s tails ``keys`` (None: of all it holds, and of the
        holder); a task not finished yet is let go of once it has (see :meth:`transition`)."""
        held = holder(token)
        if keys is None:
            self._drop(held)
            return
        scheduler = self.scheduler
        ready = []
        for key in keys:
            ts = scheduler.tasks.get(key)
            if ts is None:
                continue
            if ts.state in ("memory", "erred"):
                ready.append(key)
            else:  # released while processing, the scheduler would cancel it
                self.finishing[key] = held
        if ready:
            self._let_go(held, ready)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """A tail let go of finished: let go of it (after this transition; the scheduler's
        transitions do not nest). A segment Dask failed, or that a client cancelled (with
        ``force=True``: it is not theirs) before it ran: tell its controller."""
        if finish in ("memory", "erred"):
            held = self.finishing.pop(key, None)
            if held is not None:
                self.scheduler.loop.add_callback(self._let_go, held, [key])
        elif finish == "forgotten":
            self.finishing.pop(key, None)
            return
        elif finish != "released":
            return
        if finish == "memory" or type(key) is not tuple or len(key) != 5:
            return
        token = key[1]
        if holder(token) not in self.owners:
            return
        if finish == "erred":
            text = kwargs.get("exception_text") or "unknown error"
            self._failed(token, [key], f"Dask failed its task: {text}")
        elif start != "memory" and str(kwargs.get("stimulus_id", "")).startswith("cancel-key"):
            self._failed(token, [key], "the scheduler cancelled its work")

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        """A client left the scheduler: its controllers' tasks go with it, as its own do."""
        for held in [h for h, owner in self.owners.items() if owner == client]:
            self._drop(held)

    def _let_go(self, held: str, keys: list) -> None:
        if held in self.scheduler.clients:
            self.scheduler.client_releases_keys(
                keys=keys, client=held, stimulus_id=f"dask_monarch-release-{time.time()}"
            )

    def _drop(self, held: str) -> None:
        """The controller went: every task held for it goes (the holder too)."""
        self.owners.pop(held, None)
        self.finishing = {k: h for k, h in self.finishing.items() if h != held}
        if held in self.scheduler.clients:
            self.scheduler.remove_client(held, stimulus_id=f"dask_monarch-drop-{time.time()}")

    def _failed(self, token: str, keys: Any, why: str) -> None:
        """Tell controller ``token`` that Dask will not run ``keys`` (its event topic)."""
        event = {"keys": [list(k) if type(k) is tuple else k for k in keys], "why": why}
        self.scheduler.loop.add_callback(self.scheduler.log_event, failures_topic(token), event)


def missing_on(scheduler: Any) -> list[str]:
    """What of the scheduler's methods the intake calls ``scheduler`` lacks (its private
    ones: dask_internals.scheduler_gaps)."""
    public = ("client_releases_keys", "remove_client", "log_event")
    gaps = [name for name in public if not callable(getattr(scheduler, name, None))]
    return gaps + internals.scheduler_gaps(scheduler)


def install(client: Client) -> bool:
    """Register the intake on ``client``'s scheduler; False (and ``Client.get`` is used) where
    the scheduler cannot take it."""
    try:
        client.register_plugin(FlushIntake(), name=PLUGIN_NAME)
    except Exception as e:  # plugins refused, dask_monarch not importable there, ...
        logger.info(
            "dask_monarch: the scheduler did not take the flush intake (%s: %s); flushes go "
            "through Client.get",
            type(e).__name__,
            e,
        )
        return False
    return True


def send(client: Client, token: str, segments: list[SegmentTask], span: dict | None = None) -> None:
    """Hand one flush of controller ``token`` to the scheduler's intake (from any thread: it
    is sent from the client's event loop, in the order of everything queued there)."""
    message = {"op": OP, "token": token, "segments": ToPickle(segments), "span": span}
    client.loop.add_callback(internals.send_to_scheduler, client, message)


def release(client: Client, token: str, keys: list | None) -> list:
    """Let go of controller ``token``'s tails ``keys`` (None: of everything it holds) on the
    client's event loop; returns what :class:`~.release.DeferredRelease` keeps: nothing."""
    internals.send_to_scheduler(client, {"op": RELEASE_OP, "token": token, "keys": keys})
    return []
