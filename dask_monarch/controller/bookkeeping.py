"""What distributed keeps of a controller's segments once they ran: bounded, and no payload.

``distributed`` drops a task group from ``Scheduler.task_groups`` when its
last task is forgotten, but its spans extension keeps every group it ever saw
for the scheduler's lifetime, and a new default span starts whenever the
previous one is done (docs/dask.md §13). A live controller lets each segment
be forgotten once it ran, so at each flush after its lanes went idle the
scheduler made a new ``monarch_*`` group, and a new default span: one more of
each per flush, for ever. And the logs of recent batches of each
``BatchedSend`` (the client's to the scheduler, the scheduler's to each
worker) keep the last 1000 batches under 1 MB: a thousand flushes' graphs
and payloads, over 100 MB for flushes of a thousand small ops. Hence:

* every segment outside a ``dask_monarch.span`` belongs to its controller's
  own span (:func:`controller_span`), not to a new default span each time;
* :class:`SegmentGroups`, a scheduler plugin each controller registers
  (:func:`install`), folds a ``monarch_*`` group that dies into the first
  dead group of its name in its span (the span's figures, task states,
  durations, bytes, start and stop, stay the sum over all its segments; its
  groups stay one per name), and empties the payload of each segment that
  ran (the scheduler's log to the worker holds the same task; one cancelled
  before it ran keeps its payload, as Dask may still send it);
* :func:`drop_sent_graphs` takes the controller's flushes (the intake's
  messages, or ``update-graph``'s graphs) out of the client's log once its
  segments ran.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from .. import dask_internals as internals
from ..protocol.wire import Payload
from .intake import OP as INTAKE_OP

logger = logging.getLogger("dask_monarch.controller")

PLUGIN_NAME = "dask_monarch-segment-groups"
SPAN_NAME = "dask_monarch"  # the span of a controller's segments outside any dask_monarch.span
GROUP_PREFIX = "monarch_"  # every segment's task group (protocol.names.task_name)
SENT = "dask_monarch: dropped from the log once sent"  # stands for a graph in the client's log


def controller_span(token: str) -> dict:
    """The ``distributed`` span annotation of controller ``token``'s segments outside any
    ``dask_monarch.span``: one span per controller, named ``("dask_monarch",)``."""
    return {"name": (SPAN_NAME,), "ids": (f"{SPAN_NAME}-{token}",)}


class SegmentGroups(SchedulerPlugin):
    """Empties each segment's payload once it ran, and folds each dying ``monarch_*`` task group
    into the one that stands for its name in its span (``kept``), so a span holds one group
    per name however many segments it saw."""

    name = PLUGIN_NAME
    idempotent = True  # one per scheduler, however many controllers register it

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.kept: dict[tuple[str, str], Any] = {}  # (span id, group name) -> the kept group
        self.folded = 0  # groups folded away so far
        self.enabled = False

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.enabled = internals.groups_foldable()
        if not self.enabled:
            logger.warning(
                "this distributed's TaskGroup lacks fields dask_monarch adds up: the "
                "scheduler keeps a task group per flush of a live controller"
            )

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        # Called before the scheduler drops an emptied group (Scheduler._transition).
        ran = start == "processing" and finish in ("memory", "erred")
        if not (ran or finish == "forgotten") or type(key) is not tuple:
            return
        name = key[0] if key else None
        if type(name) is not str or not name.startswith(GROUP_PREFIX):
            return
        ts = self.scheduler.tasks.get(key)
        if ts is None:
            return
        # emptied only once it ran: a task released while it waited may be sent again, and a
        # forgotten one's compute-task may still wait in the batched send to its worker
        if ran:
            spec = internals.task_spec(ts)
            for arg in getattr(spec, "args", ()):  # run_segment(..., payload, *after)
                if type(arg) is Payload:
                    arg.data = None
            return
        if ts.state != "forgotten":
            return
        tg = ts.group
        if self.scheduler.task_groups.get(tg.name) is not tg or any(
            count and state != "forgotten" for state, count in tg.states.items()
        ):
            return  # other tasks of the group live on
        if self.enabled:
            self._fold(tg)

    def _fold(self, tg: Any) -> None:
        tg.dependencies.clear()  # the groups it followed: dead ones would live on through it
        tg.last_worker = None
        span = internals.span_of(self.scheduler, tg)
        if span is None:
            return
        where = (span.id, tg.name)
        kept = self.kept.get(where)
        if kept is None or kept not in span.groups:
            self.kept[where] = tg  # stays in the span, and stands for every later group
            return
        internals.fold_group(kept, tg)
        span.groups.discard(tg)
        self.folded += 1


def install(client: Any) -> None:
    """Register :class:`SegmentGroups` on ``client``'s scheduler (idempotent)."""
    try:
        client.register_plugin(SegmentGroups(), name=PLUGIN_NAME)
    except Exception as e:  # nothing breaks without it: the scheduler only keeps more
        logger.warning(
            "the scheduler did not take dask_monarch's task-group plugin (%s: %s): it keeps "
            "a task group per flush of a live controller",
            type(e).__name__,
            e,
        )


def drop_sent_graphs(comm: Any, token: str) -> None:
    """Take the flushes of controller ``token`` out of ``comm``'s log of batches it sent (the
    client's ``scheduler_comm``): the intake's messages and ``update-graph``'s graphs. The
    log is for debugging only, and a message in it was sent already. Reads the log from its
    newest batch back to the newest flush dropped before (any thread: reads a copy)."""
    for batch in reversed(internals.sent_log(comm)):
        if type(batch) is not list:  # "large-message"
            continue
        for msg in batch:
            if type(msg) is not dict:
                continue
            op = msg.get("op")
            if op == INTAKE_OP and msg.get("token") == token:
                field = "segments"
            elif op == "update-graph" and _ours(msg, token):
                field = "expr_ser"
            else:
                continue
            if msg.get(field) is SENT:
                return
            msg[field] = SENT


def _ours(msg: dict, token: str) -> bool:
    key = next(iter(msg.get("keys") or ()), None)  # every key of a flush is the controller's
    return type(key) is tuple and len(key) > 1 and key[1] == token
