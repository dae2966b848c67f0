"""The messages a controller sends to its ranks: one class per Monarch ``WorkerMessage``.

Same class and field names as Monarch's tensor engine (plus ``CreatePipe``).
Each docstring says what the message does on a rank; the worker runs it
(:mod:`dask_monarch.worker`) and the compiler routes it
(:mod:`dask_monarch.controller.compiler`). Rules that hold for all of them:

* A *stream* message runs on the lane of the stream it names, in message order
  for that stream; streams run concurrently. A *control step* (meshes,
  communicators, pipes, recording definitions, Exit) runs on the rank's control
  lane, ordered with every stream's messages around it.
* A *fresh* failure of a message with a ``seq`` is reported once
  (``RemoteFunctionFailed``) and poisons its results and mutated refs; a
  *dependent* failure (an input already held an error) poisons them with the
  same root error and reports nothing. A protocol violation is *fatal*: the
  controller fails with ``DeviceException``.

The module is long only because it holds all 29 messages, each with its
meaning; it has no behaviour.
"""

from collections.abc import Iterable, Iterator
from typing import Any, Union

from ..ndslice import Slice
from .checked import checked, list_of, register_checks
from .values import (
    ActorCallParams,
    ArgsKwargs,
    Factory,
    Reduction,
    Ref,
    ResolvableFunction,
    StreamCreationMode,
    StreamRef,
)

_MESSAGE_TYPES: tuple[type, ...] = ()  # filled in below, for nested message lists


def _message(v: Any, where: str) -> "WorkerMessage":
    if not isinstance(v, _MESSAGE_TYPES):
        raise TypeError(f"{where} must be a worker message, got {v!r}")
    return v


def _exit_error(v: Any, where: str) -> tuple[str | None, str] | None:
    if v is None:
        return None
    if not (isinstance(v, tuple) and len(v) == 2 and (v[0] is None or isinstance(v[0], str))
            and isinstance(v[1], str)):
        raise TypeError(f"{where} must be None or a (source: str | None, message: str) tuple")
    return v


register_checks({
    list["WorkerMessage"]: list_of(_message),
    tuple[str | None, str] | None: _exit_error,
})


@checked
class BackendNetworkInit:
    """Join the world process group of the controller's ranks, the base of every collective.

    A control step that blocks until every rank has joined; a second one is a
    no-op. ``unique_id`` prefixes the group's rendezvous keys.
    """

    unique_id: str | None = None


@checked
class BackendNetworkPointToPointInit:
    """Create the communicator SendTensor uses from ``from_stream`` to ``to_stream``.

    A control step sent to every rank, once per pair; a no-op without a world
    group or when the pair already has one.
    """

    from_stream: StreamRef
    to_stream: StreamRef


@checked
class CallFunction:
    """Call ``function`` on ``stream`` and bind its flattened results (``None``: not kept).

    A fresh failure is reported under ``seq`` and poisons ``results`` and
    ``mutates``; an errored input poisons them unreported. The refs in
    ``remote_process_groups`` reach the function as this stream's torch groups.
    """

    seq: int
    results: list[Ref | None]
    mutates: list[Ref]
    function: ResolvableFunction
    args_kwargs: ArgsKwargs
    stream: StreamRef
    remote_process_groups: list[Ref]


@checked
class CommandGroup:
    """Several messages handled in order, as if sent one by one (``coalescing`` sends these).

    The first fatal error stops the rest.
    """

    messages: list["WorkerMessage"]


@checked
class CreateStream:
    """Start stream ``id`` on the rank with an empty ref table (again if it exists).

    Sent to every rank; ``stream_creation`` chooses the device's default
    stream or a new one on GPU.
    """

    id: StreamRef
    stream_creation: StreamCreationMode


@checked
class CreateDeviceMesh:
    """Define mesh ``result``: dims ``names`` over the global ranks of ``ranks``.

    A control step sent to the mesh's ranks; user functions get the rank's
    view of it. Fatal if this rank is outside ``ranks`` or the names do not
    match its dims; redefining replaces it, DeleteRefs does not remove it.
    """

    result: Ref
    names: list[str]
    ranks: Slice


@checked
class CreateRemoteProcessGroup:
    """Remember ``result`` as a process group over ``dims`` of ``device_mesh``.

    A control step; its communicator on a stream comes from
    SplitCommForProcessGroup. Fatal if the mesh is unknown or the id exists.
    """

    result: Ref
    device_mesh: Ref
    dims: list[str]


@checked
class BorrowCreate:
    """Lend ``tensor`` from ``from_stream`` to ``to_stream``, where it becomes ``result``.

    Runs on the lender's stream and never blocks. Fatal if the tensor is not on
    that stream; an errored value is lent as the same error.
    """

    result: Ref
    borrow: int
    tensor: Ref
    from_stream: StreamRef
    to_stream: StreamRef


@checked
class BorrowFirstUse:
    """Bind the lent object (the same object, no copy) as the borrow's result on the borrower.

    Blocks the borrower's stream until the lender has run BorrowCreate; fatal
    unless it follows BorrowCreate.
    """

    borrow: int


@checked
class BorrowLastUse:
    """Give the lent object back: unbind the borrow's result on the borrower's stream.

    Never blocks; fatal unless it follows BorrowFirstUse or if the result is
    already gone.
    """

    borrow: int


@checked
class BorrowDrop:
    """End the borrow on the lender's stream, which blocks until the borrower's BorrowLastUse.

    Fatal unless it follows BorrowLastUse. Errors raised on the borrower side
    are not written back to the lender.
    """

    borrow: int


@checked
class DeleteRefs:
    """Forget ``refs`` on every stream of the rank, after what each stream was sent before.

    Unknown ids are ignored.
    """

    refs: list[Ref]


@checked
class RequestStatus:
    """Answer ``Status(seq + 1)`` once every stream has drained what was sent before.

    Each stream passes a probe and the last one answers; ``controller`` is
    carried but changes nothing. Not allowed inside a recording.
    """

    seq: int
    controller: bool = False


@checked
class Reduce:
    """A collective over ``dims`` of ``mesh`` on ``stream``, bound to ``result``.

    ``reduction`` is ``"stack"`` or a ReduceOp; ``scatter``, ``in_place`` and
    ``out`` as in ``Tensor.reduce``. Every member takes part even with an
    errored input (zeros from ``factory``) and nothing is reported; a missing
    input or communicator (SplitComm) is fatal.
    """

    result: Ref
    tensor: Ref
    factory: Factory
    mesh: Ref
    stream: StreamRef
    dims: list[str]
    reduction: Reduction
    scatter: bool
    in_place: bool
    out: Ref | None


@checked
class SplitComm:
    """Create the communicator Reduce uses for ``device_mesh``, ``stream`` and sorted ``dims``.

    A control step sent to every rank; a no-op without a world group or on a
    rank outside the mesh. A second one for the same key is fatal.
    """

    dims: list[str]
    device_mesh: Ref
    stream: StreamRef


@checked
class SplitCommForProcessGroup:
    """Create the torch group user functions get for ``remote_process_group`` on ``stream``.

    A control step, once per group and stream (later ones are no-ops); fatal
    if the group is unknown.
    """

    remote_process_group: Ref
    stream: StreamRef


@checked
class SendTensor:
    """Copy ``tensor`` from each rank of ``from_ranks`` to ``result`` on the rank paired with it.

    Ranks pair in row-major order; senders run on ``from_stream``, receivers on
    ``to_stream``. An errored tensor is sent as zeros from ``factory``, a rank
    sending to itself binds a copy; nothing is reported.
    """

    result: Ref
    from_ranks: Slice
    to_ranks: Slice
    tensor: Ref
    factory: Factory
    from_stream: StreamRef
    to_stream: StreamRef


@checked
class SendValue:
    """Compute a value on ``stream`` and send it to the controller (or into a pipe).

    The value is ``function(*args, **kwargs)``, or the single argument without
    a function; it reaches the controller as ``FetchResult(seq)``. A failure is
    reported (fresh) or silent (dependent) instead, and poisons ``mutates``.
    """

    seq: int
    destination: Ref | None
    mutates: list[Ref]
    function: ResolvableFunction | None
    args_kwargs: ArgsKwargs
    stream: StreamRef


@checked
class SendResultOfActorCall:
    """Call an actor with values of ``local_state`` from ``stream``; send back what it returns.

    The reply reaches the controller as ``FetchResult(seq)``. An actor
    exception is reported and poisons ``mutates``; an errored input poisons
    them unreported.
    """

    seq: int
    broker_id: tuple[str, int]
    local_state: list[Ref]
    mutates: list[Ref]
    stream: StreamRef


@checked
class CallActorMethod:
    """Like SendResultOfActorCall, but bind what the actor returns to ``results`` on the stream."""

    results: list[Ref | None]
    call: ActorCallParams


@checked
class PipeRecv:
    """Bind the next value of ``pipe``'s producer to ``results`` on ``stream``.

    Blocks the stream until the producer gives a value; a producer that
    failed or ended is a fresh failure reported under ``seq``.
    """

    seq: int
    results: list[Ref | None]
    pipe: Ref
    stream: StreamRef


@checked
class CreatePipe:
    """Start a producer per rank: ``function(pipe, *args, **kwargs)`` feeding a bounded buffer.

    A control step on ``mesh``'s ranks; ``max_messages`` bounds the buffer and
    ``key`` names the pipe. Fatal if the mesh is unknown or the id exists.
    """

    result: Ref
    key: str
    function: ResolvableFunction
    max_messages: int
    mesh: Ref
    args_kwargs: ArgsKwargs


@checked
class Exit:
    """Release everything the controller holds on the rank, once every stream has drained.

    The Dask worker keeps running; ``error`` (source, message) goes back to
    the controller, which raises it. Nothing may follow it.
    """

    error: tuple[str | None, str] | None = None


@checked
class DefineRecording:
    """Chunk ``index`` of ``ntotal_messages`` of recording ``result``: this rank's commands.

    A control step; chunks must arrive in order. With the last one the
    commands are split by stream and checked, not run; misuse is fatal.
    """

    result: Ref
    nresults: int
    nformals: int
    commands: list["WorkerMessage"]
    ntotal_messages: int
    index: int


@checked
class RecordingFormal:
    """Inside a recording: at each call, ``result`` on ``stream`` is actual ``argument_index``.

    Fatal outside a recording.
    """

    result: Ref
    argument_index: int
    stream: StreamRef


@checked
class RecordingResult:
    """Inside a recording: at each call, result ``output_index`` is ``result`` on ``stream``.

    Fatal outside a recording.
    """

    result: Ref
    output_index: int
    stream: StreamRef


@checked
class CallRecording:
    """Replay ``recording`` with ``actuals`` for its formals, binding ``results``.

    Runs on every stream the recording uses. The first fresh failure is
    reported once under ``seq`` and poisons every result and mutated actual.
    """

    seq: int
    recording: Ref
    results: list[Ref]
    actuals: list[Ref]


@checked
class SetRefUnitTestsOnly:
    """Test hook: bind a plain ``value`` to ``reference`` on ``stream``."""

    reference: Ref
    value: Any
    stream: StreamRef


@checked
class GetRefUnitTestsOnly:
    """Test hook: read ``value`` on ``stream``; the reply goes to :meth:`Controller.get_ref`."""

    value: Ref
    stream: StreamRef


WORKER_MESSAGES: tuple[type, ...] = (
    BackendNetworkInit, BackendNetworkPointToPointInit, CallFunction, CommandGroup, CreateStream,
    CreateDeviceMesh, CreateRemoteProcessGroup, BorrowCreate, BorrowFirstUse, BorrowLastUse,
    BorrowDrop, DeleteRefs, RequestStatus, Reduce, SplitComm, SplitCommForProcessGroup,
    SendTensor, SendValue, SendResultOfActorCall, CallActorMethod, PipeRecv, CreatePipe, Exit,
    DefineRecording, RecordingFormal, RecordingResult, CallRecording, SetRefUnitTestsOnly,
    GetRefUnitTestsOnly,
)
WorkerMessage = Union[WORKER_MESSAGES]  # type: ignore[valid-type]
_MESSAGE_TYPES = WORKER_MESSAGES


def flatten_groups(commands: Iterable) -> Iterator[WorkerMessage]:
    """The messages of ``commands`` in order, with nested CommandGroups opened."""
    for c in commands:
        if type(c) is CommandGroup:
            yield from flatten_groups(c.messages)
        else:
            yield c
