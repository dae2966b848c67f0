"""Protocol rules: where each worker message runs on a rank, how it waits, and its refs.

The compiler routes messages by these rules, the worker splits a recording's
commands by them and the tracer of compiled functions reads refs by them, so
the three cannot disagree; the compiler's pre-dispatch check models how each
message waits on other lanes and ranks by them (:class:`Sync`). The borrow
steps and the assembly of chunked ``DefineRecording`` messages live here too:
the compiler checks them on the client and the worker checks them again
inside recordings, with one implementation and one set of error texts.

Each check raises ``fail(cause)``: the caller chooses the exception (the
compiler's ``ProtocolError`` for a rank, the worker's ``FatalError``).
"""

from __future__ import annotations

from collections.abc import Callable, Container
from operator import attrgetter
from typing import Any, NamedTuple

from torch.utils._pytree import tree_flatten

from . import messages as m
from .wire import ActorCall, DropLane, ExpectResults, ReadRef, StatusProbe

Fail = Callable[[str], Exception]


# --------------------------------------------------------------------------- lanes


class Lanes:
    """Which lane(s) of a rank run a message (plain strings, compared by identity: a class
    attribute reads several times faster than an Enum member, and the compiler reads one
    per message)."""

    NAMED_STREAM = "the stream it names (``stream``)"
    CALL_STREAM = "the stream of its actor call (``call.stream``)"
    NEW_STREAM = "the stream it creates (``id``)"
    EVERY_STREAM = "each stream of the rank"
    BORROW = "the lender's stream (create, drop) or the borrower's (first and last use)"
    SEND = "the sending stream on senders, the receiving stream on receivers"
    RECORDING = "each stream the called recording runs on"
    CONTROL = "the rank's control lane (worker-level state)"
    DRAIN = "the control lane, once every stream ran everything sent before"
    GROUP = "each inner message, by its own rule"


class Sync:
    """How a message waits on other lanes or ranks (plain strings, compared by identity).

    The compiler's pre-dispatch check (:mod:`dask_monarch.controller.precheck`)
    models exactly these waits; a message with ``NONE`` never waits on
    another lane and costs the check nothing.
    """

    NONE = ""
    GROUP = "meets every member of its communicator's group (a collective)"
    PEER = "meets the rank it sends to or receives from (a point-to-point send)"
    WORLD = "meets every rank of the controller (building a communicator)"
    SIGNAL = "lets a wait on another lane of the rank go on (borrow create, last use)"
    WAIT = "waits for a signal from another lane of the rank (borrow first use, drop)"
    DRAIN = "waits until every lane of the rank ran what was sent before it"
    REPLAY = "replays a recording's commands, which may wait"
    INNER = "as each of its inner messages"


class Rule(NamedTuple):
    """What the protocol says about one message type.

    ``uses``, ``defines`` and ``mutates`` name the fields holding refs of
    stream values (a ``Ref``, a list of them, or the refs inside an
    ``ArgsKwargs``); the worker-level objects a message names (meshes,
    pipes, process groups) live on the rank, not on a stream, and are not
    listed. A ``Reduce`` with ``in_place`` also mutates its ``tensor``.
    """

    lanes: str  # one of Lanes
    family: str  # what its work is called: tasks are named ``monarch_<family>``
    recordable: bool  # may be a command of a recording
    user_code: bool = False  # runs a user's function: a failed replay skips it
    uses: tuple[str, ...] = ()
    defines: tuple[str, ...] = ()
    mutates: tuple[str, ...] = ()
    sync: str = Sync.NONE  # one of Sync


RULES: dict[type, Rule] = {
    m.CallFunction: Rule(
        Lanes.NAMED_STREAM, "call", True, True, ("args_kwargs",), ("results",), ("mutates",)
    ),
    m.SendValue: Rule(Lanes.NAMED_STREAM, "fetch", True, True, ("args_kwargs",), (), ("mutates",)),
    m.PipeRecv: Rule(Lanes.NAMED_STREAM, "pipe", True, True, (), ("results",)),
    m.SendResultOfActorCall: Rule(
        Lanes.NAMED_STREAM, "actor", True, True, ("local_state",), (), ("mutates",)
    ),
    m.CallActorMethod: Rule(
        Lanes.CALL_STREAM,
        "actor",
        True,
        True,
        ("call.local_state",),
        ("results",),
        ("call.mutates",),
    ),
    m.Reduce: Rule(
        Lanes.NAMED_STREAM,
        "reduce",
        True,
        False,
        ("tensor", "out"),
        ("result",),
        ("out",),
        sync=Sync.GROUP,
    ),
    m.SendTensor: Rule(Lanes.SEND, "send", True, False, ("tensor",), ("result",), sync=Sync.PEER),
    m.SetRefUnitTestsOnly: Rule(Lanes.NAMED_STREAM, "ref", True, defines=("reference",)),
    m.GetRefUnitTestsOnly: Rule(Lanes.NAMED_STREAM, "ref", True, uses=("value",)),
    m.RecordingFormal: Rule(Lanes.NAMED_STREAM, "recording", True, defines=("result",)),
    m.RecordingResult: Rule(Lanes.NAMED_STREAM, "recording", True, uses=("result",)),
    m.BorrowCreate: Rule(
        Lanes.BORROW, "borrow", True, uses=("tensor",), defines=("result",), sync=Sync.SIGNAL
    ),
    m.BorrowFirstUse: Rule(Lanes.BORROW, "borrow", True, sync=Sync.WAIT),
    m.BorrowLastUse: Rule(Lanes.BORROW, "borrow", True, sync=Sync.SIGNAL),
    m.BorrowDrop: Rule(Lanes.BORROW, "borrow", True, sync=Sync.WAIT),
    m.DeleteRefs: Rule(Lanes.EVERY_STREAM, "delete", True),
    # a recording checks each inner message of a group
    m.CommandGroup: Rule(Lanes.GROUP, "segment", True, sync=Sync.INNER),
    m.RequestStatus: Rule(Lanes.EVERY_STREAM, "status", False),  # as a StatusProbe per lane
    m.CreateStream: Rule(Lanes.NEW_STREAM, "stream", False),
    m.CallRecording: Rule(
        Lanes.RECORDING,
        "recording",
        False,
        uses=("actuals",),
        defines=("results",),
        sync=Sync.REPLAY,
    ),
    m.DefineRecording: Rule(Lanes.CONTROL, "recording", False),
    m.CreateDeviceMesh: Rule(Lanes.CONTROL, "mesh", False),
    m.CreateRemoteProcessGroup: Rule(Lanes.CONTROL, "comm", False),
    m.BackendNetworkInit: Rule(Lanes.CONTROL, "comm", False, sync=Sync.WORLD),
    m.BackendNetworkPointToPointInit: Rule(Lanes.CONTROL, "comm", False, sync=Sync.WORLD),
    m.SplitComm: Rule(Lanes.CONTROL, "comm", False, sync=Sync.GROUP),
    m.SplitCommForProcessGroup: Rule(Lanes.CONTROL, "comm", False, sync=Sync.GROUP),
    m.CreatePipe: Rule(Lanes.CONTROL, "pipe", False),
    m.Exit: Rule(Lanes.DRAIN, "exit", False, sync=Sync.DRAIN),
}

LANES: dict[type, str] = {t: rule.lanes for t, rule in RULES.items()}
SYNC: dict[type, str] = {t: rule.sync for t, rule in RULES.items() if rule.sync}
# Lane messages the pre-dispatch check looks at (control steps it sees all: they are rare).
CHECKED = frozenset(
    t
    for t, rule in RULES.items()
    if rule.sync and rule.lanes is not Lanes.CONTROL and rule.lanes is not Lanes.DRAIN
)
# The compiler's fast path: one lane per rank, the stream the message names, nothing to check.
ON_NAMED_STREAM = frozenset(
    t for t, lanes in LANES.items() if lanes is Lanes.NAMED_STREAM and t not in CHECKED
)
RUNS_USER_CODE = frozenset(t for t, rule in RULES.items() if rule.user_code)
# What a segment's work is called, also for the steps the compiler adds.
FAMILY: dict[type, str] = {
    **{t: rule.family for t, rule in RULES.items()},
    ReadRef: "ref",
    StatusProbe: "status",
    DropLane: "stream",
    ExpectResults: "call",  # sent just before the call whose results it describes
    ActorCall: "actor",
}


def stream_of(msg: Any) -> m.StreamRef:
    """The one stream a ``NAMED_STREAM`` or ``CALL_STREAM`` message runs on."""
    return msg.call.stream if type(msg) is m.CallActorMethod else msg.stream


_TWO_STREAMS = (m.BorrowCreate, m.SendTensor, m.BackendNetworkPointToPointInit)


def streams_named(msg: Any) -> list[m.StreamRef]:
    """Every stream a message names (a recording runs on those of its commands)."""
    t = type(msg)
    if t is m.CallActorMethod:
        return [msg.call.stream]
    if t in _TWO_STREAMS:
        return [msg.from_stream, msg.to_stream]
    stream = getattr(msg, "stream", None)
    return [stream] if isinstance(stream, m.StreamRef) else []


# --------------------------------------------------------------------------- refs

_FIELDS: dict[str, Callable[[Any], Any]] = {}


def _ids(msg: Any, fields: tuple[str, ...], out: list[int]) -> list[int]:
    for name in fields:
        get = _FIELDS.get(name)
        if get is None:
            get = _FIELDS[name] = attrgetter(name)
        value = get(msg)
        t = type(value)
        if t is m.Ref:
            out.append(value.id)
        elif t is m.ArgsKwargs:
            out.extend(x.id for x in tree_flatten(value.to_python())[0] if type(x) is m.Ref)
        elif value is not None:
            out.extend(r.id for r in value if r is not None)
    return out


def refs_used(msg: Any) -> list[int]:
    """The refs of stream values ``msg`` reads."""
    rule = RULES.get(type(msg))
    return _ids(msg, rule.uses, []) if rule is not None else []


def refs_defined(msg: Any) -> list[int]:
    """The refs ``msg`` binds to new values."""
    rule = RULES.get(type(msg))
    return _ids(msg, rule.defines, []) if rule is not None else []


def refs_mutated(msg: Any) -> list[int]:
    """The refs whose values ``msg`` changes in place."""
    t = type(msg)
    rule = RULES.get(t)
    if rule is None:
        return []
    return _ids(msg, rule.mutates, [msg.tensor.id] if t is m.Reduce and msg.in_place else [])


class Opaque(Exception):
    """A message whose refs cannot be listed without unpickling (its arguments travel pickled)."""


def named_refs(value: Any, out: set[int]) -> set[int]:
    """Every Ref id inside a message (its fields, argument containers, nested params).

    Raises :class:`Opaque` for arguments that travel pickled.
    """
    t = type(value)
    if t is m.Ref:
        out.add(int(value))
    elif t is m.ArgsKwargs and value[2] is not None:
        raise Opaque
    elif isinstance(value, (tuple, list)):
        for v in value:
            named_refs(v, out)
    elif isinstance(value, dict):  # OrderedDict, defaultdict too (in pickled arguments)
        for v in value.values():
            named_refs(v, out)
    return out


# --------------------------------------------------------------------------- borrows

CREATED, FIRST_USED, LAST_USED, DROPPED = "created", "first-used", "last-used", "dropped"
# step -> (the state it needs, the state it leaves, whether it runs on the borrower's stream)
_STEPS = {
    m.BorrowFirstUse: (CREATED, FIRST_USED, True),
    m.BorrowLastUse: (FIRST_USED, LAST_USED, True),
    m.BorrowDrop: (LAST_USED, DROPPED, False),
}


class BorrowProgress:
    """One borrow's two streams and how far it got."""

    __slots__ = ("from_stream", "to_stream", "state")

    def __init__(self, from_stream: Any, to_stream: Any):
        self.from_stream = from_stream
        self.to_stream = to_stream
        self.state = CREATED


class Borrows:
    """The borrows of one rank, or of one recording, and the step each may take next.

    A borrow goes CREATED -> FIRST_USED -> LAST_USED -> dropped, one step per
    message; the create and the drop run on the lender's stream, the two uses
    on the borrower's. A rank forgets a dropped borrow. Inside a recording
    (``recording`` is its ref) a borrow id names one borrow for the whole
    recording, every borrow must be dropped by its end, and errors name the
    recording.
    """

    def __init__(self, fail: Fail, recording: int | None = None):
        self.fail = fail
        self.recording = recording
        self.borrows: dict[int, BorrowProgress] = {}

    def create(
        self, borrow_id: int, from_stream: Any = None, to_stream: Any = None
    ) -> BorrowProgress:
        """A new borrow (its streams may be filled in after this check)."""
        if borrow_id in self.borrows:
            if self.recording is None:
                raise self.fail(f"BorrowCreate of borrow {borrow_id}, which already exists")
            raise self.fail(f"recording r{self.recording}: borrow {borrow_id} created twice")
        borrow = self.borrows[borrow_id] = BorrowProgress(from_stream, to_stream)
        return borrow

    def step(self, msg: Any) -> Any:
        """Take a BorrowFirstUse, BorrowLastUse or BorrowDrop; the stream it runs on."""
        t = type(msg)
        borrow = self.borrows.get(msg.borrow)
        if borrow is None:
            if self.recording is None:
                raise self.fail(f"{t.__name__} of unknown borrow {msg.borrow}")
            raise self.fail(
                f"recording r{self.recording}: {t.__name__} of borrow {msg.borrow}, "
                "which was not created within the recording"
            )
        expected, state, on_borrower = _STEPS[t]
        if borrow.state != expected:
            if self.recording is None:
                raise self.fail(
                    f"{t.__name__} of borrow {msg.borrow} in state '{borrow.state}' "
                    f"(expected '{expected}')"
                )
            raise self.fail(
                f"recording r{self.recording}: {t.__name__} of borrow {msg.borrow} "
                f"in state '{borrow.state}'"
            )
        if state == DROPPED and self.recording is None:
            del self.borrows[msg.borrow]
        else:
            borrow.state = state
        return borrow.to_stream if on_borrower else borrow.from_stream

    def check_all_dropped(self) -> None:
        """A recording ends with every borrow it created dropped."""
        still_open = [b for b, borrow in self.borrows.items() if borrow.state != DROPPED]
        if still_open:
            raise self.fail(
                f"recording r{self.recording}: all borrows created within recording "
                f"must be dropped within recording (open: {still_open})"
            )


# --------------------------------------------------------------------------- recordings


class RecordingChunks:
    """``DefineRecording`` chunks of one rank, assembled in order into whole recordings.

    A recording's chunks arrive one after the other, numbered from 0, each
    giving the same total; nothing else is defined meanwhile.
    """

    def __init__(self, fail: Fail):
        self.fail = fail
        self.ref: int | None = None  # the recording being defined
        self.total = 0
        self.next_index = 0
        self.commands: list = []

    def add(self, msg: m.DefineRecording, defined: Container[int]) -> list | None:
        """Take one chunk: the recording's commands once its last chunk arrived, else None."""
        if self.ref is None:
            if msg.index != 0:
                raise self.fail(f"DefineRecording r{msg.result.id} starts at chunk {msg.index}")
            if msg.result.id in defined:
                raise self.fail(f"DefineRecording r{msg.result.id}, which is already defined")
            self.ref, self.total, self.next_index = msg.result.id, msg.ntotal_messages, 0
        elif msg.result.id != self.ref:
            raise self.fail(f"DefineRecording r{msg.result.id} while r{self.ref} is being defined")
        if msg.index != self.next_index:
            raise self.fail(
                f"DefineRecording r{self.ref}: chunk {msg.index} arrived when "
                f"{self.next_index} was expected"
            )
        if msg.ntotal_messages != self.total:
            raise self.fail(
                f"DefineRecording r{self.ref}: chunk {msg.index} says "
                f"{msg.ntotal_messages} chunks, the first said {self.total}"
            )
        self.commands.extend(msg.commands)
        self.next_index += 1
        if self.next_index != self.total:
            return None
        commands, self.commands, self.ref = self.commands, [], None
        return commands
