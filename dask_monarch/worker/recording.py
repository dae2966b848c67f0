"""Recordings: a trace defined once per rank, replayed per stream with one message.

Semantics: docs/protocol.md §3.16-§3.18.

``DefineRecording`` chunks arrive in order on the rank's control lane; with
the last one the commands are split by stream and checked (borrows created
inside must be dropped inside, no worker-level messages inside). Each
``CallRecording`` is fanned out to the lanes of the recording's streams, and
each lane replays its commands on objects it already holds: formals alias
the actual arguments, results are bound at the end, and every ref defined
inside is deleted once the last command naming it has run (at the latest
when the call ends). A ``DeleteRefs`` naming the recording frees it: each
lane drops its part after the replays sent to it before (:func:`forget`).
Replay costs a type dispatch and the handler of each
command: no unpickling, no graph, no scheduler; a plan replayed
``recordings.generate-after`` times runs as generated code (worker/plan.py).

Errors: the first fresh failure inside a replay is reported once, as
``RemoteFunctionFailed`` for the ``CallRecording`` seq with a text starting
``recording failed:``; from then on function calls are skipped (their slots
poisoned) while borrows, collectives and sends still run, since peers and
other streams wait on them. A dependent failure (an input already held an
error) marks the replay failed silently. A failed replay poisons all its
results and every ref it mutated. Misuse is fatal.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import config
from ..protocol import messages as m
from ..protocol.rules import (
    RULES,
    RUNS_USER_CODE,
    Borrows,
    Lanes,
    Opaque,
    refs_defined,
    refs_mutated,
    stream_of,
)
from . import handlers
from .calls import poison
from .errors import DependentError, FatalError, RefNotFound, SeqError, format_exception
from .failures import call_failed
from .lane import Lane
from .plan import FastCall, Generated, compile_command, generate, refs_named, settle, store

if TYPE_CHECKING:
    from .rank import RankState


@dataclass
class StreamRecording:
    """What one stream replays: its commands, and the refs they define and mutate.

    ``plan`` is ``commands`` with simple calls (refs as arguments or items of
    list arguments, a function that resolves: worker/plan.py's
    ``compile_command``) compiled into :class:`FastCall` tuples: the function
    resolved and the argument positions of refs worked out once;
    ``generated`` is the plan as Python code, written once it has replayed
    ``generate_after`` times and its calls have settled (worker/plan.py).
    ``frees[i]`` are the refs defined inside that command ``i`` is the last to
    name: a replay deletes them right after it, so a recording holds no more
    intermediates than the same ops sent one by one (a chain of 100 adds holds
    two tensors, not 100).
    """

    commands: list = field(default_factory=list)
    plan: list = field(default_factory=list)
    frees: list = field(default_factory=list)
    formals: dict[int, int] = field(default_factory=dict)  # formal ref -> argument index
    internal: set[int] = field(default_factory=set)  # refs defined inside (see frees)
    mutated: list[int] = field(default_factory=list)  # formal or captured refs changed in place
    results: list[tuple[int, int]] = field(default_factory=list)  # (output index, inner ref)
    generated: Generated | None = None
    generate_after: int | None = None  # replays (recordings.generate-after; None: never)
    replays: int = 0


@dataclass
class Recording:
    """A rank's recording: each stream's part, until a ``DeleteRefs`` of ``ref`` passed that
    stream's lane (see :func:`forget`); ``lanes`` is how many streams replay it."""

    ref: int
    streams: dict[int, StreamRecording]
    lanes: int = field(init=False)

    def __post_init__(self) -> None:
        self.lanes = len(self.streams)


class ReplayState:
    """One CallRecording on one rank, shared by the lanes that replay it."""

    def __init__(self, seq: int, lanes: int):
        self.seq = seq
        self.error: SeqError | None = None
        self.lanes_left = lanes
        self.lock = threading.Lock()

    def fresh_error(self, rank_state: RankState, exc: BaseException) -> SeqError:
        """A command failed: the first failure becomes the replay's error, reported once."""
        with self.lock:
            if self.error is not None:
                return self.error
            self.error = SeqError(self.seq, f"recording failed: {format_exception(exc)}")
        rank_state.record_error(self.error)
        rank_state.report(m.RemoteFunctionFailed(self.seq, rank_state.rank, self.error.error))
        return self.error

    def dependent(self, root: SeqError) -> None:
        """An input already held an error: the replay fails with it, silently."""
        with self.lock:
            if self.error is None:
                self.error = root


# -- definition ------------------------------------------------------------------------------


def define_recording(lane: Lane, msg: m.DefineRecording) -> None:
    """Collect a chunk; with the last one, split the commands by stream and check them."""
    state = lane.rank
    commands = state.chunks.add(msg, state.recordings)
    if commands is not None:
        state.recordings[msg.result.id] = _build(state, msg.result.id, commands)


def _build(state: RankState, ref: int, commands: list) -> Recording:
    streams: dict[int, StreamRecording] = {}
    borrows = Borrows(FatalError, recording=ref)
    borrowed: set[int] = set()  # borrowers' refs: BorrowLastUse removes them, unnamed

    def on(stream_id: int) -> StreamRecording:
        if stream_id not in state.lanes:
            raise FatalError(f"recording r{ref} uses stream {stream_id}, which does not exist")
        return streams.setdefault(stream_id, StreamRecording())

    for cmd in m.flatten_groups(commands):
        t = type(cmd)
        rule = RULES.get(t)
        lanes = rule.lanes if rule is not None else None
        if rule is not None and not rule.recordable:
            raise FatalError(
                f"recording r{ref}: {t.__name__} is not allowed in a recording"
                + (" (request_status not allowed in recording)" if t is m.RequestStatus else "")
            )
        if t is m.RecordingFormal:
            s = on(cmd.stream.id)
            s.formals[cmd.result.id] = cmd.argument_index
            s.internal.add(cmd.result.id)
            s.commands.append(cmd)
        elif t is m.RecordingResult:
            s = on(cmd.stream.id)
            s.results.append((cmd.output_index, cmd.result.id))
            s.commands.append(cmd)
        elif t is m.BorrowCreate:
            borrows.create(cmd.borrow, cmd.from_stream.id, cmd.to_stream.id)
            on(cmd.to_stream.id).internal.add(cmd.result.id)
            borrowed.add(cmd.result.id)
            on(cmd.from_stream.id).commands.append(cmd)
        elif lanes is Lanes.BORROW:
            on(borrows.step(cmd)).commands.append(cmd)
        elif lanes is Lanes.EVERY_STREAM:
            for s in streams.values():
                s.commands.append(cmd)
        elif lanes is Lanes.SEND:
            me = state.rank
            sending, receiving = me in cmd.from_ranks, me in cmd.to_ranks
            if sending:
                on(cmd.from_stream.id).commands.append(cmd)
            if receiving:
                s = on(cmd.to_stream.id)
                s.internal.add(cmd.result.id)
                if not sending or cmd.to_stream.id != cmd.from_stream.id:
                    s.commands.append(cmd)
        else:
            s = on(stream_of(cmd).id)
            s.commands.append(cmd)
            s.internal.update(refs_defined(cmd))
            s.mutated.extend(refs_mutated(cmd))
    borrows.check_all_dropped()
    generate_after = config.get("recordings.generate-after")
    for s in streams.values():
        s.generate_after = None if generate_after is None else int(generate_after)
        s.mutated = [r for r in dict.fromkeys(s.mutated) if r not in s.internal or r in s.formals]
        s.plan = [compile_command(state, cmd) for cmd in s.commands]
        s.frees = _last_uses(s.plan, s.internal - borrowed)
    return Recording(ref, streams)


def _last_uses(plan: list, internal: set[int]) -> list[tuple[int, ...]]:
    """Per command, the ``internal`` refs no later command names (see StreamRecording)."""
    last: dict[int, int] = {}
    try:
        for index, cmd in enumerate(plan):
            for ref in refs_named(cmd):
                if ref in internal:
                    last[ref] = index
    except Opaque:  # keep everything to the end of the call
        return [()] * len(plan)
    frees: list[list[int]] = [[] for _ in plan]
    for ref, index in last.items():
        frees[index].append(ref)
    return [tuple(f) for f in frees]


def delete_refs(lane: Lane, msg: m.DeleteRefs) -> None:
    """``DeleteRefs``: the recordings it names (:func:`forget`), then the values."""
    if lane.rank.recordings:
        forget(lane, msg.refs)
    handlers.delete_refs(lane, msg)


def forget(lane: Lane, refs: list) -> None:
    """A ``DeleteRefs`` reached ``lane`` (it reaches every stream): drop the lane's part of
    each recording it names, and the recording with its last part.

    Each lane runs the delete after the replays sent before it, so a part goes only once
    its lane replayed them; the other parts stay for their own lanes, which may still have
    those replays to run (the client sends no replay after the delete). A dropped stream
    leaves the same way (:func:`forget_lane`)."""
    state = lane.rank
    recordings = state.recordings
    with state.lock:
        for ref in refs:
            recording = recordings.get(int(ref))
            if recording is not None:
                _leave(state, recording, lane.label)


def forget_lane(state: RankState, label: int) -> None:
    """A stream is dropped: its lane replays no part of any recording again."""
    with state.lock:
        for recording in list(state.recordings.values()):
            _leave(state, recording, label)


def _leave(state: RankState, recording: Recording, label: int) -> None:
    recording.streams.pop(label, None)
    if not recording.streams:
        del state.recordings[recording.ref]


def outside_recording(lane: Lane, msg: m.RecordingFormal | m.RecordingResult) -> None:
    """Formals and results only exist inside a recording."""
    name = "recording_formal" if type(msg) is m.RecordingFormal else "recording_result"
    raise FatalError(f"{name} called outside of recording")


# -- replay ----------------------------------------------------------------------------------


def call_recording(lane: Lane, msg: m.CallRecording) -> None:
    """Replay this stream's part of a recording with ``actuals``; bind ``results``."""
    state = lane.rank
    recording = state.recordings.get(msg.recording.id)
    if recording is None:
        raise FatalError(f"CallRecording of r{msg.recording.id}, which is not a defined recording")
    part = recording.streams.get(lane.label)
    if part is None:
        return
    with state.lock:
        replay = state.replays.get(msg.seq)
        if replay is None:
            replay = state.replays[msg.seq] = ReplayState(msg.seq, recording.lanes)
    env = lane.env
    lane.recording = replay
    lane.last_seq = msg.seq
    try:
        plan, frees = part.plan, part.frees
        start = 0 if part.generated is None else part.generated(lane, env, replay, msg)
        for index in range(start, len(plan)):
            step(lane, replay, plan, index, msg)
            for ref in frees[index]:
                env.pop(ref, None)
        part.replays += 1
        if (
            part.generated is None
            and part.generate_after is not None
            and part.replays >= part.generate_after
        ):
            part.generated = generate(plan, frees, step)
            if part.generated is None:  # a call never ran: look again after as many replays
                part.generate_after = 2 * part.replays
    finally:
        lane.recording = None
        # the commands' handlers noted the seqs of the trace, older than this one: the lane
        # is at the CallRecording (the dashboard, liveness warnings and next_seq read it)
        lane.last_seq = msg.seq
    for ref in part.internal:  # what a fatal error left, and borrowers' refs
        env.pop(ref, None)
    error = replay.error
    if error is not None:
        for index, _ in part.results:
            env[msg.results[index].id] = error
        for ref in part.mutated:
            index = part.formals.get(ref)
            env[msg.actuals[index].id if index is not None else ref] = error
    with state.lock:
        replay.lanes_left -= 1
        if replay.lanes_left <= 0:
            state.replays.pop(msg.seq, None)


def step(lane: Lane, replay: ReplayState, plan: list, index: int, msg: m.CallRecording) -> None:
    """Replay command ``index`` of ``plan`` (the interpreter; see worker/plan.py)."""
    cmd = plan[index]
    t = type(cmd)
    env = lane.env
    if t is FastCall and replay.error is not None:
        _skip(lane, cmd[5], replay.error)
    elif t is FastCall:
        fn, template, slots, kwargs, result, message, binding = cmd
        try:
            args, lists = template.copy(), None
            for position, ref in slots:
                value = env.get(ref, _MISSING)
                if type(value) is SeqError:
                    raise DependentError(value)
                if value is _MISSING:
                    raise RefNotFound(ref)
                if type(position) is int:
                    args[position] = value
                else:  # item j of list or tuple argument i
                    i, j = position
                    lists = {} if lists is None else lists
                    items = lists.get(i)
                    if items is None:
                        items = lists[i] = list(template[i])
                    items[j] = value
            if lists is not None:
                for i, items in lists.items():
                    args[i] = items if type(template[i]) is list else tuple(items)
            value = fn(*args, **kwargs) if kwargs else fn(*args)
            if binding is not None:  # the first replay: may the binding call it?
                plan[index] = settle(cmd, args, kwargs)
            store(env, message, result, value)
        except FatalError:
            raise
        except BaseException as e:  # user code cannot kill a rank (SystemExit...)
            call_failed(lane, message.seq, message.results, message.mutates, e)
    elif t is m.RecordingFormal:
        if cmd.argument_index >= len(msg.actuals):
            raise FatalError(
                f"CallRecording r{msg.recording.id}: too few arguments "
                f"({len(msg.actuals)}) for formal {cmd.argument_index}"
            )
        env[cmd.result.id] = _value_or_error(lane, replay, msg.actuals[cmd.argument_index].id)
    elif t is m.RecordingResult:
        if cmd.output_index >= len(msg.results):
            raise FatalError(
                f"CallRecording r{msg.recording.id}: too few results "
                f"({len(msg.results)}) for output {cmd.output_index}"
            )
        env[msg.results[cmd.output_index].id] = _value_or_error(lane, replay, cmd.result.id)
    elif replay.error is not None and t in RUNS_USER_CODE:
        if t is m.CallFunction and cmd.remote_process_groups:  # its peers are about to ask
            handlers.call_with_groups(lane, cmd, replay.error)
        else:
            _skip(lane, cmd, replay.error)
    else:
        lane.rank.handlers[t](lane, cmd)


def _value_or_error(lane: Lane, replay: ReplayState, ref_id: int) -> Any:
    value = lane.env.get(ref_id, _MISSING)
    if value is _MISSING:
        return replay.fresh_error(lane.rank, RefNotFound(ref_id))
    if type(value) is SeqError:
        replay.dependent(value)
    return value


def _skip(lane: Lane, cmd: Any, error: SeqError) -> None:
    if type(cmd) is m.CallActorMethod:
        poison(lane.env, cmd.results, cmd.call.mutates, error)
    else:
        poison(lane.env, getattr(cmd, "results", ()), getattr(cmd, "mutates", ()), error)


_MISSING = object()
