"""Per-rank routing: which lane of a rank runs each message, in Monarch's mailbox order.

A :class:`RankRouter` knows every stream, borrow and recording of its rank,
because routing needs them (a ``BorrowFirstUse`` names only its borrow), and
applies the protocol rules of :mod:`dask_monarch.protocol.rules`. A message it
cannot route (unknown stream, borrow out of order, recording misuse, anything
after ``Exit``) is a :class:`ProtocolError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..protocol import messages as m
from ..protocol.rules import LANES, Borrows, Lanes, RecordingChunks, stream_of, streams_named
from ..protocol.wire import CONTROL, DropLane, StatusProbe


class ProtocolError(Exception):
    """A message that breaks Monarch's protocol on ``rank`` (fatal for the controller)."""

    def __init__(self, rank: int, cause: str):
        super().__init__(f"rank {rank}: {cause}")
        self.rank = rank
        self.cause = cause


class InternalStep:
    """A compiler-made step for one lane of one rank (e.g. a ref read for ``get_ref``)."""

    __slots__ = ("stream", "step")

    def __init__(self, stream: int, step: Any):
        self.stream = stream
        self.step = step


class Probes:
    """The status probe of each ``RequestStatus``, one per lane count, shared by every rank it
    reaches: their segments then hold the same steps, which the compiler pickles once for
    all of them (``compiler._Payloads``). A probe's number need only be new on each rank."""

    def __init__(self) -> None:
        self._request: Any = None  # the RequestStatus routed last (a message goes to its
        self._made: dict[int, StatusProbe] = {}  # ranks one after the other), its probes

    def probe(self, request: m.RequestStatus, lanes: int) -> StatusProbe:
        if request is not self._request:
            self._request, self._made = request, {}
        probe = self._made.get(lanes)
        if probe is None:
            probe = self._made[lanes] = StatusProbe(request.seq, _next_probe(), lanes)
        return probe


class RankRouter:
    """Monarch's worker mailbox order for one rank: which lane runs each message."""

    def __init__(self, rank: int, probes: Probes | None = None):
        self.rank = rank
        self.probes = probes or Probes()  # shared by a controller's ranks
        # the rank's streams in creation order, with the mode each was created in
        self.streams: dict[int, m.StreamCreationMode] = {}
        self.dropped: set[int] = set()  # streams ended by drop_stream: their ids stay unused
        self.borrows = Borrows(self.error)
        self.recordings: dict[int, tuple[int, ...]] = {}  # complete recording -> its streams
        self.chunks = RecordingChunks(self.error)
        self.exited = False

    def error(self, cause: str) -> ProtocolError:
        return ProtocolError(self.rank, cause)

    def stream(self, ref: m.StreamRef, what: str) -> int:
        if ref.id not in self.streams:
            if ref.id in self.dropped:
                raise self.error(f"{what} names stream {ref.id}, which was dropped")
            raise self.error(f"{what} names stream {ref.id}, which was never created on this rank")
        return ref.id

    def route(self, msg: Any) -> Iterator[tuple[Any, Any, bool]]:
        """Yield ``(lane, step, drains)`` for one message; ``lane`` is a stream id or CONTROL."""
        if self.exited:
            raise self.error(f"{type(msg).__name__} sent after Exit")
        t = type(msg)
        if t is m.RequestStatus and self.chunks.ref is not None:
            raise self.error(f"RequestStatus while recording r{self.chunks.ref} is being defined")
        lanes = LANES.get(t)
        if lanes is Lanes.NAMED_STREAM or lanes is Lanes.CALL_STREAM:
            yield self.stream(stream_of(msg), t.__name__), msg, False
        elif lanes is Lanes.EVERY_STREAM:
            step = msg
            if t is m.DeleteRefs and self.recordings:
                self.forget(msg)
            if t is m.RequestStatus:  # as a probe: the last stream to pass it answers
                step = self.probes.probe(msg, max(len(self.streams), 1))
                if not self.streams:
                    yield CONTROL, step, False
            for stream in self.streams:
                yield stream, step, False
        elif lanes is Lanes.BORROW:
            yield self.route_borrow(msg), msg, False
        elif lanes is Lanes.SEND:
            yield from self.route_send(msg)
        elif lanes is Lanes.RECORDING:
            streams = self.recordings.get(msg.recording.id)
            if streams is None:
                raise self.error(
                    f"CallRecording of r{msg.recording.id}, which is not a "
                    "completely defined recording"
                )
            for stream in streams:
                if stream in self.dropped:  # its lane is gone: refused here, by name
                    raise self.error(
                        f"CallRecording of r{msg.recording.id} runs on stream {stream}, "
                        "which was dropped"
                    )
                yield stream, msg, False
        elif lanes is Lanes.GROUP:
            for inner in msg.messages:
                yield from self.route(inner)
        elif lanes is Lanes.NEW_STREAM:
            if msg.id.id in self.dropped:
                raise self.error(
                    f"CreateStream of stream {msg.id.id}, which was dropped "
                    "(a new stream needs a new id)"
                )
            self.streams[msg.id.id] = msg.stream_creation
            yield msg.id.id, msg, False
        elif lanes is Lanes.CONTROL:
            if t is m.DefineRecording:
                self.define(msg)
            yield CONTROL, msg, False
        elif lanes is Lanes.DRAIN:
            self.exited = True
            yield CONTROL, msg, True
        elif t is InternalStep:
            stream = self.stream(m.StreamRef(msg.stream), type(msg.step).__name__)
            if type(msg.step) is DropLane:  # the lane's last step: nothing may follow it
                self.check_unborrowed(stream)
                del self.streams[stream]
                self.dropped.add(stream)
            yield stream, msg.step, False
        else:
            raise self.error(f"{t.__name__} is not a worker message")

    def check_unborrowed(self, stream: int) -> None:
        """A stream is dropped only once no borrow is open on it: the borrow's later steps
        run on both its streams (the lane would be gone when they come)."""
        for borrow_id, borrow in self.borrows.borrows.items():
            if stream in (borrow.from_stream, borrow.to_stream):
                raise self.error(
                    f"drop_stream of stream {stream} while borrow {borrow_id} (from stream "
                    f"{borrow.from_stream} to stream {borrow.to_stream}) is open: its "
                    "BorrowLastUse and BorrowDrop run on both streams; drop the borrow first"
                )

    def route_borrow(self, msg: Any) -> int:
        """The stream a borrow step runs on, once the borrow's state allows the step."""
        if type(msg) is not m.BorrowCreate:
            return self.borrows.step(msg)
        borrow = self.borrows.create(msg.borrow)
        borrow.from_stream = self.stream(msg.from_stream, "BorrowCreate")
        borrow.to_stream = self.stream(msg.to_stream, "BorrowCreate")
        return borrow.from_stream

    def route_send(self, msg: m.SendTensor) -> Iterator[tuple[int, m.SendTensor, bool]]:
        sender = self.rank in msg.from_ranks
        receiver = self.rank in msg.to_ranks
        if not sender and not receiver:
            raise self.error("SendTensor sent to a rank that neither sends nor receives")
        src = self.stream(msg.from_stream, "SendTensor") if sender else None
        dst = self.stream(msg.to_stream, "SendTensor") if receiver else None
        if src is not None:
            yield src, msg, False
        if dst is not None and dst != src:
            yield dst, msg, False

    def define(self, msg: m.DefineRecording) -> None:
        """Take a chunk; with the last one, note the streams the recording runs on."""
        commands = self.chunks.add(msg, self.recordings)
        if commands is None:
            return
        ref = msg.result.id
        streams: dict[int, None] = {}
        for command in m.flatten_groups(commands):
            for stream in streams_named(command):
                streams[self.stream(stream, f"recording r{ref}")] = None
        self.recordings[ref] = tuple(streams)

    def forget(self, msg: m.DeleteRefs) -> None:
        """The recordings ``msg`` deletes: a later CallRecording of one is refused here."""
        for ref in msg.refs:
            self.recordings.pop(int(ref), None)


_probe_counter = iter(range(1, 2**63))


def _next_probe() -> int:
    return next(_probe_counter)
