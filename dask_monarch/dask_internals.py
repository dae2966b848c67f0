"""The private parts of dask and distributed that dask_monarch uses: in one place, checked once.

distributed has no public hook for what dask_monarch needs in a few places
(dask-cuda's ``_compat.py`` is the model of this module): making a flush's
tasks on the scheduler without the generic graph path, giving a lane's
thread to a worker's execution budget, running a quick segment as a
coroutine, folding the task groups of finished segments, Dask's batched-send
gaps and logs, sending to the scheduler on a client's own stream. Each use
is a named function here; no other module touches a private name of dask or
distributed (``tests/test_dask_internals.py`` checks each function against the
installed distributed, and that the grep finds them nowhere else).

:func:`missing` lists every piece the installed versions lack. Where a piece
has a fallback the caller takes it (the flush intake falls back to
``Client.get``, an unfoldable task group is left as Dask keeps it); where none
exists, :func:`require` refuses with the versions named (a controller checks
at its start). ``setup.cfg`` bounds distributed at the newest release CI
passed with.
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import TYPE_CHECKING, Any

import dask
import distributed
from dask._task_spec import Task, TaskRef
from distributed.spans import SpanMetadata

if TYPE_CHECKING:
    from distributed import Client, Scheduler, Worker
    from distributed.batched import BatchedSend

__all__ = ["SpanMetadata", "Task", "TaskRef", "missing", "require"]


# -- the scheduler --------------------------------------------------------------------------

# what ``create_tasks`` passes to Scheduler._create_taskstate_from_graph (distributed 2026.8)
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


def create_tasks(scheduler: Scheduler, **kwargs: Any) -> None:
    """Make the tasks of a graph as ``update-graph`` does (its checks, priorities, plugins'
    hooks), synchronously on the event loop: ``Scheduler._create_taskstate_from_graph``."""
    scheduler._create_taskstate_from_graph(**kwargs)


def scheduler_gaps(scheduler: Any) -> list[str]:
    """What of the two above ``scheduler`` (a scheduler, or its class) lacks."""
    gaps = []
    if not callable(getattr(scheduler, "_find_lost_dependencies", None)):
        gaps.append("_find_lost_dependencies")
    create = getattr(scheduler, "_create_taskstate_from_graph", None)
    if not callable(create):
        return [*gaps, "_create_taskstate_from_graph"]
    absent = _CREATE_PARAMETERS - set(inspect.signature(create).parameters)
    return gaps + [f"_create_taskstate_from_graph({p}=)" for p in sorted(absent)]


def lost_dependencies(scheduler: Scheduler, dsk: dict, keys: set) -> bool:
    """Whether a task of ``dsk`` depends on a key the scheduler lost (``update-graph``'s own
    check: ``Scheduler._find_lost_dependencies``)."""
    return bool(scheduler._find_lost_dependencies(dsk, keys))


# TaskGroup fields a fold adds up (distributed 2026.8's TaskCollection and TaskGroup)
_GROUP_FIELDS = ("states", "_size", "nbytes_total", "_duration_us", "_all_durations_us", "_types")


def groups_foldable() -> bool:
    """Whether this distributed's TaskGroup has every field :func:`fold_group` adds up."""
    from distributed.scheduler import TaskGroup, TaskPrefix

    probe = TaskGroup("probe", TaskPrefix("probe"))
    return all(hasattr(probe, f) for f in (*_GROUP_FIELDS, "start", "stop", "span_id"))


def fold_group(kept: Any, group: Any) -> None:
    """Add dead task group ``group``'s figures to ``kept`` (both dead: no prefix counts them
    any more), so ``kept`` stands for both in its span."""
    for state, count in group.states.items():
        kept.states[state] = kept.states.get(state, 0) + count
    kept._size += group._size
    kept.nbytes_total += group.nbytes_total
    kept._duration_us += group._duration_us
    for action, us in group._all_durations_us.items():
        kept._all_durations_us[action] += us
    for typename, count in group._types.items():
        kept._types[typename] += count
    if group.start and (not kept.start or group.start < kept.start):
        kept.start = group.start
    kept.stop = max(kept.stop, group.stop)


def span_of(scheduler: Scheduler, group: Any) -> Any:
    """The span (of the scheduler's spans extension) task group ``group`` belongs to, or None."""
    spans = scheduler.extensions.get("spans")
    return spans.spans.get(group.span_id) if spans is not None and group.span_id else None


def task_spec(ts: Any) -> Any:
    """What a task (the scheduler's or a worker's TaskState) runs: its ``run_spec``."""
    return getattr(ts, "run_spec", None)


def set_task_spec(ts: Any, spec: Task) -> None:
    """Have a worker's task about to start run ``spec`` instead (a segment's coroutine twin)."""
    ts.run_spec = spec


def scheduler_streams(scheduler: Scheduler) -> dict[str, BatchedSend]:
    """The scheduler's batched streams, by the address (or client id) at their other end."""
    return {**scheduler.stream_comms, **scheduler.client_comms}


def lower_scheduler_gaps(scheduler: Scheduler, interval: float, address: str = "") -> None:
    """Lower the gap of the scheduler's batched streams to ``interval`` seconds: to the worker
    or client at ``address``, or (``""``) to every one it has."""
    for key, comm in scheduler_streams(scheduler).items():
        if not address or key == address:
            lower_gap(comm, interval)


# -- the worker -----------------------------------------------------------------------------


def add_execution_slot(worker: Worker, n: int = 1) -> None:
    """Give ``n`` more threads to the worker's execution budget (a lane's; ``n < 0`` gives them
    back): a worker runs at most ``WorkerState.nthreads`` tasks across all its executors."""
    worker.state.nthreads += n


def worker_task(worker: Worker, key: Any) -> Any:
    """The worker's TaskState of ``key``, or None."""
    return worker.state.tasks.get(key)


# -- batched sends and clients --------------------------------------------------------------


def gap(stream: BatchedSend) -> float:
    """A ``BatchedSend``'s gap between batches, in seconds."""
    return stream.interval


def set_gap(stream: BatchedSend, interval: float) -> None:
    """Set a ``BatchedSend``'s gap between batches to ``interval`` seconds."""
    stream.interval = interval


def lower_gap(stream: BatchedSend | None, interval: float) -> None:
    """Lower a ``BatchedSend``'s gap between batches to ``interval`` seconds (never raise it)."""
    if stream is not None:
        set_gap(stream, min(gap(stream), interval))


def keep_no_log(stream: BatchedSend) -> None:
    """Keep none of the batches ``stream`` sends (its log keeps the last thousand, for
    debugging: fetched values, long after they arrived)."""
    stream.recent_message_log = deque(maxlen=0)


def sent_log(stream: Any) -> list:
    """The batches a ``BatchedSend`` sent lately (a copy: its owner may append meanwhile)."""
    return list(getattr(stream, "recent_message_log", None) or ())


def send_to_scheduler(client: Client, message: dict) -> None:
    """Send ``message`` on the client's own stream to the scheduler, in order with everything
    the client sends there (from the client's event loop)."""
    client._send_to_scheduler_safe(message)


async def run_on(client: Client, function: Any, workers: list[str]) -> dict:
    """``client.run(function, workers=workers)``, awaited on the client's event loop."""
    return await client._run(function, workers=workers)


# -- the check ------------------------------------------------------------------------------


def missing() -> list[str]:
    """What of the above the installed dask and distributed lack (empty: all there)."""
    from distributed import Client, Scheduler
    from distributed.batched import BatchedSend
    from distributed.worker_state_machine import WorkerState

    gaps = [f"Scheduler.{gap}" for gap in scheduler_gaps(Scheduler)]
    for owner, name in ((Client, "_send_to_scheduler_safe"), (Client, "_run")):
        if not callable(getattr(owner, name, None)):
            gaps.append(f"{owner.__name__}.{name}")
    if "nthreads" not in inspect.signature(WorkerState).parameters:
        gaps.append("WorkerState.nthreads")
    if "interval" not in inspect.signature(BatchedSend).parameters:
        gaps.append("BatchedSend.interval")
    if not groups_foldable():
        gaps.append(f"TaskGroup.{{{', '.join(_GROUP_FIELDS)}}}")
    return gaps


# Pieces without which dask_monarch cannot run (the others have fallbacks: see the callers).
_REQUIRED = ("Client._", "WorkerState.nthreads", "BatchedSend.interval")


def require() -> None:
    """Refuse, naming the versions, where a piece dask_monarch cannot do without is missing."""
    gone = [g for g in missing() if g.startswith(_REQUIRED)]
    if gone:
        raise RuntimeError(
            f"dask_monarch needs distributed internals that distributed "
            f"{distributed.__version__} (dask {dask.__version__}) lacks: {', '.join(gone)}; "
            "install a distributed that setup.cfg's range admits"
        )
