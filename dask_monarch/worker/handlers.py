"""Handlers of the core messages: calls, fetches, refs, streams, meshes, status, exit.

Borrows, collectives, recordings, pipes and actors have their handlers in
their own modules; :mod:`.dispatch` maps each message type to its handler.
Semantics: docs/protocol.md §3; error model §4.1. A call that takes process
groups starts and ends with an exchange among each group's members
(:func:`call_with_groups`), so that a member that cannot start, or whose
function raises partway, does not leave its peers in a collective until the
timeout (a ``recv`` from a member that raised before sending still does).
"""

from __future__ import annotations

import torch

from ..protocol.messages import (
    CallFunction,
    CreateDeviceMesh,
    CreateStream,
    DeleteRefs,
    Exit,
    GetRefUnitTestsOnly,
    SendValue,
    SetRefUnitTestsOnly,
    Status,
)
from ..protocol.wire import DropLane, Exited, ExpectResults, Fetched, ReadRef, RefValue, StatusProbe
from . import calls
from .comm import process_groups_for
from .errors import DependentError, FatalError, SeqError
from .failures import call_failed, dependent_failure, fail_call
from .lane import Lane
from .mesh import DeviceMesh
from .nccl_watch import check_device
from .pipe import pipe_for
from .user_groups import CollectiveMismatch, MemberFailure, agree_to_start, checked, end_call


def call_function(lane: Lane, msg: CallFunction) -> None:
    """Call a function on the stream and bind its results (docs/protocol.md §3.3).

    Fresh failures (bad path, missing ref, the function raising, a result
    count mismatch) are reported once and poison results and mutates; an
    errored input poisons them with the same root, unreported. A duplicate
    result id and ``__test_panic`` are fatal. Every plain call runs through
    here, one per message: keep it free of per-call work it does not need.
    """
    seq, results, mutates, function, args_kwargs, _, group_refs = msg  # a named tuple
    calls.check_panic(function)
    lane.last_seq = seq
    if group_refs:
        call_with_groups(lane, msg)
    else:
        try:
            fn = calls.resolve_function(function)
            args, kwargs = calls.resolve_args(lane, args_kwargs)
            value = fn(*args, **kwargs) if kwargs else fn(*args)
            calls.bind_results(lane.env, results, value)
        except FatalError:
            raise
        except BaseException as e:  # SystemExit, KeyboardInterrupt...: user code cannot kill
            call_failed(lane, seq, results, mutates, e)
    expected = lane.expected
    if expected is not None:  # a remote function whose propagation said what it returns
        lane.expected = None
        if expected.seq == seq:
            check_results(lane, msg, expected)


def call_with_groups(lane: Lane, msg: CallFunction, failed: SeqError | None = None) -> None:
    """A call that takes process groups: its members first agree that each can start it,
    and tell each other how it ended.

    A member whose input failed (``failed``: a replay already failed), or
    whose function or arguments cannot be resolved, skips the call, as any
    call does; its peers would wait for it in their first collective until
    the collective timeout, which breaks the group for good. So every member
    first tells the others whether it can start (:func:`.user_groups.agree_to_start`):
    if one cannot, no member runs the function, and the others' results and
    mutated inputs hold that member's error, naming its rank, unreported (the
    controller has the root: a fetch raises it).

    A function that raises partway would leave its peers waiting in their next
    collective in the same way; so each member ends the call with one more
    exchange (:func:`.user_groups.end_call`), which a peer still inside its
    function meets in its next collective's check and fails with that member's
    error, and a peer whose function returned meets there and poisons its results
    with it (unreported). Members that called different numbers of collectives
    all fail with ``CollectiveMismatch``. A ``recv`` from a member that raised
    before sending still waits until the collective timeout.
    """
    seq, results, mutates, function, args_kwargs, _, group_refs = msg
    groups = checked(process_groups_for(lane, group_refs), lane.rank.user_groups)
    root = failed
    if root is None:
        try:
            fn = calls.resolve_function(function)
            args, kwargs = calls.resolve_args(lane, args_kwargs, groups)
        except FatalError:
            raise
        except DependentError as e:
            root = e.root
            dependent_failure(lane, results, mutates, root)
        except BaseException as e:  # user code cannot kill a rank (SystemExit...)
            root = fail_call(lane, seq, results, mutates, e)
    else:
        dependent_failure(lane, results, mutates, root)
    mine = None if root is None else MemberFailure(lane.rank.rank, root.seq, root.error)
    peer = agree_to_start(groups.values(), mine)
    if root is not None:
        return
    if peer is not None:
        error = SeqError(
            peer.seq,
            f"{peer.error}\n(rank {peer.rank}, a member of the process group this call takes, "
            "could not start it, so no member ran it)",
        )
        dependent_failure(lane, results, mutates, error)
        return
    try:
        value = fn(*args, **kwargs) if kwargs else fn(*args)
        calls.bind_results(lane.env, results, value)
    except FatalError:
        raise
    except BaseException as e:  # user code cannot kill a rank (SystemExit...)
        if isinstance(e, DependentError):  # a peer's failure (MemberFailed), not this one's
            root = e.root
            dependent_failure(lane, results, mutates, root)
        else:
            root = fail_call(lane, seq, results, mutates, e)
    mine = None if root is None else MemberFailure(lane.rank.rank, root.seq, root.error)
    ended = end_call(groups.values(), mine)
    if root is not None or ended is None:
        return
    if isinstance(ended, SeqError):
        dependent_failure(lane, results, mutates, ended)
    else:
        fail_call(lane, seq, results, mutates, CollectiveMismatch(ended))


class ResultMismatch(Exception):
    """A remote function returned something else than its propagation said."""


def expect_results(lane: Lane, step: ExpectResults) -> None:
    """Note what the next call returns (it follows at once on this stream)."""
    lane.expected = step


def check_results(lane: Lane, msg: CallFunction, expected: ExpectResults) -> None:
    """Fail each result that is not what the client was told: its shape and dtype, and a
    dense (strided) tensor on the device it declared (``cuda``: the rank's GPU; a CPU
    tensor on a GPU rank is fine where the propagation said CPU).

    The client and every later message use the declared metadata (a send, a
    collective, a fetch): a value that is something else (a ``meta`` or sparse
    tensor where a dense one was declared, say) fails here, once, naming the
    function, the rank and both metadata; what depends on it is poisoned as for
    any failed call (docs/protocol.md §4.1).
    """
    env = lane.env
    gpu = lane.rank.torch_device or _CPU
    bad, lines = [], []
    for i, (ref, declared) in enumerate(zip(msg.results, expected.results)):
        if ref is None or declared is None:
            continue
        value = env.get(ref.id)
        if type(value) is SeqError:  # the call itself failed
            return
        shape, dtype, kind = declared
        device = gpu if kind == "cuda" else _CPU
        if isinstance(value, torch.Tensor):
            where = _placed(value, device)
            if value.dtype is dtype and tuple(value.shape) == shape and not where:
                continue
            actual = f"shape {tuple(value.shape)} dtype {value.dtype}{where}"
        else:
            actual = f"a {type(value).__name__}, not a tensor"
        bad.append(ref)
        lines.append(
            f"result {i} (r{ref.id}) is {actual}, but its propagation said shape {shape} "
            f"dtype {dtype} (a dense tensor on {device})"
        )
    if bad:
        fail_call(
            lane,
            msg.seq,
            bad,
            (),
            ResultMismatch(
                f"remote function {expected.function} on rank {lane.rank.rank}: "
                + "; ".join(lines)
                + ": fix its propagate, or what it returns"
            ),
        )


_CPU = torch.device("cpu")


def _placed(value: torch.Tensor, device: torch.device) -> str:
    """What is wrong with where ``value`` lives for a rank on ``device`` ("" if nothing)."""
    wrong = ""
    if value.layout is not torch.strided:
        wrong += f" layout {value.layout}"
    here = value.device
    if here.type != device.type or (device.index is not None and here.index != device.index):
        wrong += f" on device {here}"
    return wrong


def send_value(lane: Lane, msg: SendValue) -> None:
    """Compute a value and send it to the controller, or into a pipe (docs/protocol.md §3.20).

    Without a function the single positional argument is the value. The
    value is pickled here, so later changes on the stream cannot leak into
    it. A fresh failure is reported (no FetchResult) and poisons ``mutates``;
    a dependent one poisons them with the root and reports nothing.
    """
    calls.check_panic(msg.function)
    lane.last_seq = msg.seq
    try:
        args, kwargs = calls.resolve_args(lane, msg.args_kwargs)
        if msg.function is None:
            if len(args) != 1 or kwargs:
                raise ValueError(
                    "expected only a single arg (and no kwargs) when no function is given: "
                    f"{args!r}, {kwargs!r}"
                )
            value = args[0]
        else:
            value = calls.resolve_function(msg.function)(*args, **kwargs)
        if msg.destination is not None:
            pipe_for(lane, msg.destination).send(value, lane)
        else:
            data = calls.pickle_value(value)
            check_device(lane.rank)  # no value computed from a failed NCCL op leaves the rank
            lane.rank.report(Fetched(msg.seq, lane.rank.rank, data))
    except FatalError:
        raise
    except DependentError as e:
        dependent_failure(lane, (), msg.mutates, e.root)
    except BaseException as e:  # user code cannot kill a rank (SystemExit...)
        fail_call(lane, msg.seq, (), msg.mutates, e)


def delete_refs(lane: Lane, msg: DeleteRefs) -> None:
    """Forget refs on this stream (fanned out to every stream; unknown ids are ignored).

    On the event loop (a quick segment) the values are dropped on the lane's thread: freeing
    a user's object runs its ``__del__`` (:meth:`Lane.discard`). A ref that names a
    recording is freed by worker/recording.py's ``delete_refs``, which calls this one."""
    pop = lane.env.pop
    if lane.rank.on_loop():
        lane.discard([pop(int(ref), None) for ref in msg.refs])
        return
    for ref_id in map(int, msg.refs):  # int(): a plain key, no Python-level Ref.id per ref
        pop(ref_id, None)


def create_stream(lane: Lane, msg: CreateStream) -> None:
    """Start (or restart, with an empty table) the stream; its lane already exists."""
    lane.create(msg.stream_creation)


def drop_lane(lane: Lane, step: DropLane) -> None:
    """The last step of a dropped stream (Controller.drop_stream): the compiler chains it
    after everything the stream ran, so its refs, communicators and thread can go now."""
    lane.rank.drop_lane(lane)


def status_probe(lane: Lane, probe: StatusProbe) -> None:
    """This stream drained everything before a ``RequestStatus``; the last one answers.

    Semantics: docs/protocol.md §3.6.
    """
    if lane.rank.arrive(probe.probe, probe.lanes):
        lane.rank.report(Status(probe.seq + 1, lane.rank.rank))


def set_ref(lane: Lane, msg: SetRefUnitTestsOnly) -> None:
    """Bind a plain value on the stream (test hook)."""
    lane.env[msg.reference.id] = msg.value


def read_ref(lane: Lane, msg: ReadRef | GetRefUnitTestsOnly) -> None:
    """Reply with a ref's value (tensors on CPU), its error text, or its absence; a value
    that cannot be pickled is an error of the read (Monarch answers "unsupported type")."""
    if type(msg) is ReadRef:
        probe, ref = msg.probe, msg.message.value
    else:  # no reply port: the reply is dropped by the controller
        probe, ref = -1, msg.value
    value = lane.env.get(ref.id, _ABSENT)
    if value is _ABSENT:
        reply = RefValue(probe, lane.rank.rank, "absent", None)
    elif type(value) is SeqError:
        reply = RefValue(probe, lane.rank.rank, "error", value.error)
    else:
        try:
            data = calls.pickle_value(value)
        except Exception as e:  # no pickler takes it: the read fails, not the rank
            reply = RefValue(
                probe,
                lane.rank.rank,
                "error",
                f"rank {lane.rank.rank}, {lane.title}: r{ref.id} holds a "
                f"{type(value).__name__}, which cannot be read back: {type(e).__name__}: {e}",
            )
        else:
            reply = RefValue(probe, lane.rank.rank, "ok", data)
            check_device(lane.rank)
    lane.rank.report(reply)


_ABSENT = object()


def create_device_mesh(lane: Lane, msg: CreateDeviceMesh) -> None:
    """Store the worker-side mesh (docs/protocol.md §3.2); fatal if this rank is not in it."""
    state = lane.rank
    try:
        state.meshes[msg.result.id] = DeviceMesh(msg.names, msg.ranks, state.rank)
    except ValueError as e:
        raise FatalError(f"CreateDeviceMesh r{msg.result.id}: {e}") from None


def exit_(lane: Lane, msg: Exit) -> None:
    """Everything sent before has run: release the controller's state on this rank.

    Semantics: docs/protocol.md §3.22.

    The Dask worker keeps running; an error passed to Exit goes back to the
    controller, which raises it.
    """
    lane.rank.report(Exited(lane.rank.rank, msg.error))
    lane.rank.release()
