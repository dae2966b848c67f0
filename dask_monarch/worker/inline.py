"""Quick segments run on the worker's event loop instead of their lane's thread.

A fetch's segment is often a few small steps: ``x + 1``, the fetch of the
value, the status probe. Handing it to its lane's thread costs a thread
wake-up and a GIL hand-off, about 0.4 ms of a 3 ms round trip on a loaded
2-core machine (``benchmarks/latency.py``, docs/dask.md §11). A segment that
can neither wait nor run long runs on the event loop instead, the way Dask
runs a coroutine task there: when such a task becomes ``executing``, the
worker plugin gives it a coroutine twin of its function (:func:`inline_task`),
with the same key, arguments and dependencies, so the scheduler, the task
stream and the segment's order see the same task.

Quick means every step is one of :data:`QUICK_OPS` (ATen ops whose output is
no bigger than the product of their inputs) on CPU tensors, a fetch of such a
value, a status probe or a delete, at most :data:`QUICK_STEPS` of them, with
no tensor over :data:`QUICK_NUMEL` elements (a result made in the segment
counts as the product of its inputs). Anything else keeps its lane's thread:
user functions, collectives, sends, borrows, pipes, recordings, anything
that could block, and every segment of a CUDA rank (a copy to the host waits
for the stream). ``dask_monarch.worker.inline-segments: false`` turns it off.

No user code runs on the loop (DESIGN decision 17): the steps are judged
after a load that builds only our classes and torch's
(:func:`~dask_monarch.worker.restricted.loads_ours`; a user value in them
keeps the segment on its lane, whose thread unpickles it), the tensors a
quick step touches are plain ``torch.Tensor`` (a subclass may run Python on
every op), and what a delete frees goes to the lane's thread to be dropped
(an object's ``__del__`` is user code: :meth:`~dask_monarch.worker.lane.Lane.discard`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from ..dask_internals import Task
from ..protocol.messages import CallFunction, DeleteRefs, Ref, SendValue
from ..protocol.wire import Payload, StatusProbe
from .errors import SeqError
from .lane import _current
from .restricted import loads_ours

if TYPE_CHECKING:
    from .rank import RankState

QUICK_STEPS = 8  # steps of a segment run on the event loop, at most
QUICK_NUMEL = 1 << 16  # the product of a quick step's tensors' elements, at most
QUICK_BYTES = 4096  # pickled steps unpickled on the event loop to judge them, at most
ATEN = "torch.ops.aten."
# ATen packets whose output has at most as many elements as the product of their tensor
# inputs' (elementwise, broadcasting, reductions, views without a size argument, products),
# and their in-place forms (a trailing ``_``).
QUICK_OPS = frozenset(
    """abs add addcmul addcdiv addmm alias amax amin argmax argmin bmm ceil clamp clamp_max
    clamp_min clone copy cos detach div dot eq exp expm1 floor ge gelu gt le lerp lift_fresh
    log log1p log_softmax logical_and logical_not logical_or lt masked_fill matmul max
    maximum mean min minimum mm mul mv ne neg norm pow prod reciprocal relu remainder round
    rsqrt rsub sigmoid sign sin softmax sqrt square squeeze std sub sum t tanh transpose
    trunc unsqueeze var where _local_scalar_dense _softmax _log_softmax _to_copy fill zero
    ones_like zeros_like full_like empty_like rand_like randn_like""".split()
)
# Plain arguments a quick op may take (no str: a device may be named by one).
_SCALARS = frozenset({type(None), bool, int, float, torch.dtype, torch.layout})
# Tensors a quick op may touch: a subclass may run Python on every op (__torch_function__)
_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


def small_steps(payload: tuple[bytes, ...] | None) -> list | None:
    """The steps of a payload small enough to unpickle on the event loop and judge, or None:
    too big, unloadable (the lane's thread raises the error, as for any segment), or holding
    a value of the user's, whose unpickling is user code."""
    if not payload or sum(map(len, payload)) > QUICK_BYTES:
        return None
    try:
        steps = loads_ours(payload[0])
        for more in payload[1:]:
            steps += loads_ours(more)
    except Exception:
        return None
    return steps


def is_quick(steps: list, env: dict) -> bool:
    """Whether ``steps``, run against the stream values ``env``, can neither wait nor run
    long (the rules in this module's docstring)."""
    if len(steps) > QUICK_STEPS:
        return False
    made: dict[int, int] = {}  # ref id -> at most this many elements (made in this segment)
    return all(_quick(step, env, made) for step in steps)


def _quick(step: Any, env: dict, made: dict[int, int]) -> bool:
    t = type(step)
    if t is StatusProbe or t is DeleteRefs:
        return True
    if t is CallFunction:
        path = getattr(step.function, "path", "")
        if not path.startswith(ATEN) or step.remote_process_groups:
            return False
        if path[len(ATEN) :].split(".", 1)[0].rstrip("_") not in QUICK_OPS:
            return False
        numel = _numel(step.args_kwargs, env, made)
        if numel is None:
            return False
        for ref in step.results:
            if ref is not None:
                made[ref.id] = numel
        return True
    if t is SendValue:
        return (
            step.function is None
            and step.destination is None
            and _numel(step.args_kwargs, env, made) is not None
        )
    return False


def _numel(args_kwargs: Any, env: dict, made: dict[int, int]) -> int | None:
    """The product of the elements of the tensors among flat arguments (each a Ref to a CPU
    tensor or an error), or None if an argument is anything else or the product is too big."""
    args, kwargs, pickled, flat = args_kwargs
    if pickled is not None or not flat:
        return None
    product = 1
    for value in (*args, *kwargs.values()):
        if type(value) is not Ref:
            if type(value) not in _SCALARS:
                return None
            continue
        n = made.get(value.id)
        if n is None:
            held = env.get(value.id)
            if type(held) is SeqError:  # the step only passes the failure on
                continue
            if type(held) not in _PLAIN_TENSORS or held.device.type != "cpu":
                return None
            n = held.numel()
        product *= max(n, 1)
        if product > QUICK_NUMEL:
            return None
    return product


def inline_task(spec: Task, state: RankState) -> Task:
    """``spec`` (a ``run_segment`` task of ``state``'s rank, its steps unpickled into its
    payload) as a coroutine task, which Dask runs on the event loop."""
    return Task(spec.key, functools.partial(run_inline, state), *spec.args, **spec.kwargs)


async def run_inline(
    state: RankState, token: str, rank: int, lane: Any, index: int, payload: Payload, *after: Any
) -> int:
    """Run a quick segment on the worker's event loop (Dask awaits this task)."""
    steps, _ = payload.take_steps(), payload.take()  # the bytes need not stay in Dask's logs
    try:
        return state.run_segment(lane, index, (), steps)  # nothing, if it was released since
    finally:
        _current.lane = None  # the loop is no lane's thread
