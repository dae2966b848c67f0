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

Messages on one comm are handled in order, so a flush cannot overtake the
client's earlier messages (``client-releases-keys`` of older tails among
them). A scheduler that cannot take the plugin (plugins not allowed, not
importable there, or a distributed whose scheduler internals the intake
calls are not what it expects: :func:`missing_on`) leaves the controller on
``Client.get``; so does ``dask_monarch.flush.intake: false``.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from dask._task_spec import Task, TaskRef
from distributed import Future
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.serialize import ToPickle
from distributed.spans import SpanMetadata

from ..protocol.wire import Payload
from ..worker import run_segment

if TYPE_CHECKING:
    from distributed import Client, Scheduler

logger = logging.getLogger("dask_monarch.controller")

OP = "dask_monarch-flush"  # the stream op; a scheduler without the plugin has no handler for it
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


def make_task(token: str, segment: SegmentTask) -> Task:
    """The Dask task that runs ``segment`` (the same on either path)."""
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
        scheduler.stream_handlers[OP] = self.intake

    async def close(self) -> None:
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.stream_handlers.pop(OP, None)

    def intake(
        self, client: str, token: str, segments: list, span: dict | None = None, **_: Any
    ) -> None:
        """Make the tasks of one flush of controller ``token`` for ``client``, as update-graph
        would (its checks and error reports included), without leaving the event loop."""
        scheduler = self.scheduler
        start = time.time()
        stimulus_id = f"dask_monarch-flush-{start}"
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
            if scheduler._find_lost_dependencies(dsk, keys):
                scheduler.report(
                    {"op": "cancelled-keys", "keys": keys, "reason": "lost dependencies"},
                    client=client,
                )
                scheduler.client_releases_keys(keys=keys, client=client, stimulus_id=stimulus_id)
                return
            scheduler._create_taskstate_from_graph(
                start=start,
                dsk=dsk,
                keys=keys,
                ordered=ordered,
                client=client,
                annotations_by_type=annotations,
                global_annotations=None,
                stimulus_id=stimulus_id,
                submitting_task=None,
                span_metadata=SpanMetadata(collections=[{"type": "low-level-graph"}]),
                fifo_timeout=FIFO_TIMEOUT_S,
            )
        except Exception as e:  # as update-graph: every key of the flush errs for its client
            from distributed.core import error_message

            logger.exception("dask_monarch flush of controller %s refused: %s", token, e)
            err = error_message(e)
            for key in keys:
                scheduler.report(
                    {
                        "op": "task-erred",
                        "key": key,
                        "exception": err["exception"],
                        "traceback": err["traceback"],
                    },
                    client=client,
                )


# What the intake calls on the scheduler: private to distributed (2026.8), so checked first.
_CREATE_PARAMETERS = frozenset(
    {
        "start",
        "dsk",
        "keys",
        "ordered",
        "client",
        "annotations_by_type",
        "global_annotations",
        "stimulus_id",
        "submitting_task",
        "span_metadata",
        "fifo_timeout",
    }
)


def missing_on(scheduler: Any) -> list[str]:
    """What of the scheduler's internals the intake uses that ``scheduler`` lacks."""
    missing = [
        name
        for name in ("_find_lost_dependencies", "client_releases_keys", "report")
        if not callable(getattr(scheduler, name, None))
    ]
    create = getattr(scheduler, "_create_taskstate_from_graph", None)
    if not callable(create):
        return [*missing, "_create_taskstate_from_graph"]
    parameters = set(inspect.signature(create).parameters)
    missing.extend(
        f"_create_taskstate_from_graph({name}=)" for name in sorted(_CREATE_PARAMETERS - parameters)
    )
    return missing


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


def futures(client: Client, segments: list[SegmentTask]) -> list[Future]:
    """A future per segment, in order, made before the flush is sent (as ``Client.get`` does)."""
    with client._refcount_lock:
        return [Future(segment.key, client) for segment in segments]


def send(client: Client, token: str, segments: list[SegmentTask], span: dict | None = None) -> None:
    """Hand one flush of controller ``token`` to the scheduler's intake (from any thread: it
    is sent from the client's event loop, in the order of everything queued there)."""
    message = {"op": OP, "token": token, "segments": ToPickle(segments), "span": span}
    client.loop.add_callback(client._send_to_scheduler_safe, message)
