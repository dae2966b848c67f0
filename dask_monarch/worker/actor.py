"""Actor calls: methods of per-rank actors fed with tensors from a stream.

Semantics: docs/protocol.md §3.23.

``Controller.spawn_actor`` creates one instance per rank with Dask's own
actors (``Client.submit(cls, actor=True)``, pinned to the rank's worker), so
the instances live, and show, where Dask keeps actors. Calls do not go
through Dask's actor channel, though: that channel runs methods on its own
executor, unordered with the stream's tensor work. Instead the actor-call
message runs on the stream's lane: it looks up the ``local_state`` tensors in
the stream's table, calls the method in-process and either sends the value
back (``SendResultOfActorCall``) or binds it like a call's results
(``CallActorMethod``). Actor calls and tensor-engine messages of a stream are
therefore ordered exactly as sent. An actor runs one call at a time, as
Monarch's actors and Dask's (one thread) do: a call from another stream,
whose lane runs at once, waits for the running one (:func:`_one_at_a_time`).

Which method runs is given by an :class:`~dask_monarch.wire.ActorCall` the
controller places before the message (``Controller.call_actor``); Refs in its
arguments stand for the ``local_state`` values. Without one, the actor
itself is called with the ``local_state`` values.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils._pytree import tree_map

from ..protocol.messages import ActorCallParams, CallActorMethod, Ref, SendResultOfActorCall
from ..protocol.wire import ActorCall, Fetched
from . import calls
from .errors import DependentError, FatalError
from .failures import dependent_failure, fail_call
from .lane import Lane
from .nccl_watch import check_device

if TYPE_CHECKING:
    from .rank import RankState

POLL_S = 0.05  # how often a call waiting for the actor looks whether its rank gave up


def actor_call_info(lane: Lane, info: ActorCall) -> None:
    """Remember which method the actor-call message of ``seq`` runs."""
    lane.rank.actor_calls[(tuple(info.broker_id), info.seq)] = info


def _run(lane: Lane, call: ActorCallParams) -> Any:
    state = lane.rank
    broker = tuple(call.broker_id)
    actor = state.actors.get(broker)
    if actor is None:
        raise FatalError(f"actor {broker} was not spawned on rank {state.rank}")
    info = state.actor_calls.pop((broker, call.seq), None)
    values = [calls.lookup(lane.env, ref.id) for ref in call.local_state]
    if info is None:
        with _one_at_a_time(lane, broker):
            return actor(*values)
    by_ref = {ref.id: value for ref, value in zip(call.local_state, values)}

    def substitute(leaf):
        if type(leaf) is Ref:
            if leaf.id not in by_ref:
                raise ValueError(
                    f"r{leaf.id} is an argument of {info.method} but not in the call's local_state"
                )
            return by_ref[leaf.id]
        return leaf

    args, kwargs = tree_map(substitute, info.args_kwargs.to_python())
    method = getattr(actor, info.method)
    with _one_at_a_time(lane, broker):
        return method(*args, **kwargs)


@contextlib.contextmanager
def _one_at_a_time(lane: Lane, broker: tuple) -> Iterator[None]:
    """Hold actor ``broker``'s lock while ``lane`` calls it; a lane that waits for it gives up
    when the controller fails or leaves, like any wait (``RankState.wait``)."""
    state = lane.rank
    lock = state.actor_locks.get(broker)
    if lock is None:  # released meanwhile
        raise FatalError(f"actor {broker} was not spawned on rank {state.rank}")
    if not lock.acquire(blocking=False):
        before = (lane.state, lane.doing)
        lane.set_waiting(f"actor {broker[0]!r} (a call from another stream)")
        try:
            while not lock.acquire(timeout=POLL_S):
                if state.abort.is_set():
                    raise FatalError(
                        f"stopped waiting for actor {broker[0]!r}: "
                        f"{state.failed or 'the rank was released'}"
                    )
        finally:
            lane.state, lane.doing = before
            if state.trace is not None:
                state.trace.wait_end(lane)
    try:
        yield
    finally:
        lock.release()


def _actor_call(lane: Lane, call: ActorCallParams, results: list[Ref | None] | None) -> None:
    lane.last_seq = call.seq
    try:
        value = _run(lane, call)
        if results is None:
            data = calls.pickle_value(value)
            check_device(lane.rank)
            lane.rank.report(Fetched(call.seq, lane.rank.rank, data))
        else:
            calls.bind_results(lane.env, results, value)
    except FatalError:
        raise
    except DependentError as e:
        dependent_failure(lane, results or (), call.mutates, e.root)
    except BaseException as e:  # user code cannot kill a rank (SystemExit...)
        fail_call(lane, call.seq, results or (), call.mutates, e)


def send_result_of_actor_call(lane: Lane, msg: SendResultOfActorCall) -> None:
    """Call the actor with the stream's tensors and send the value to the controller.

    An actor exception is a fresh error (reported, ``mutates`` poisoned); an
    errored local-state tensor poisons ``mutates`` with its root, unreported.
    """
    call = ActorCallParams(msg.seq, msg.broker_id, msg.local_state, msg.mutates, msg.stream)
    _actor_call(lane, call, None)


def call_actor_method(lane: Lane, msg: CallActorMethod) -> None:
    """Call the actor with the stream's tensors and bind what it returns to ``results``."""
    _actor_call(lane, msg.call, msg.results)


def register_actor(state: RankState, broker_id: tuple, actor: Any) -> None:
    state.actor_locks[tuple(broker_id)] = threading.Lock()
    state.actors[tuple(broker_id)] = actor


def build_actor(state: RankState, cls: type, args: tuple, kwargs: dict) -> Any:
    """``cls(*args, **kwargs)`` on the rank's device, in a stream of its own, finished before
    any lane uses what it made (its constructor hands its tensors to every lane).

    Built on a thread of its own: the thread enters the rank's device, stream and
    dispatch modes (``Device.thread``), none of which a Dask thread that runs other
    tasks should keep.
    """
    device = state.device
    built: list = []

    def build() -> None:
        try:
            with device.thread("actor") as stream:
                built.append(cls(*args, **kwargs))
                device.synchronize(stream)
        except BaseException as e:  # noqa: B036 - re-raised on the Dask thread
            built.append(e)

    thread = threading.Thread(target=build, name=f"monarch-actor-{state.rank}", daemon=True)
    thread.start()
    thread.join()
    if isinstance(built[0], BaseException):
        raise built[0]
    return built[0]
