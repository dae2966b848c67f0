"""The pre-dispatch check: a flush whose messages would hang or disagree across ranks is refused.

DESIGN decision 14. The compiler sees every rank's messages before they run,
so it can tell what the ranks would wait on. This module keeps a model of
every lane of every rank that holds only what waits or lets others go on
(:class:`~dask_monarch.protocol.rules.Sync`): collectives and the building of
communicators (every member of the group meets), point-to-point sends (sender
and receiver meet), borrows and same-rank copies (a wait on one lane for a
signal from another), ``Exit`` (waits for every lane of its rank) and the
control steps lane work follows (a graph edge). ``CallRecording`` brings the
waits of the recording's commands. Everything else never waits and is not
in the model: the compiler's fast path (calls, fetches) costs it nothing.

The model runs ahead of the ranks: after each flush it lets every event go
that could, and what is left waits. It refuses, before anything of the flush
runs (:class:`~.routing.ProtocolError`, which breaks the controller):

* a collective (``Reduce``, a ``SplitComm``...) or a send whose members are
  sent different ones at the same place of one communicator: another
  collective, another reduction, another shape or dtype (``factory``); per
  communicator, since each (mesh, stream, dims) group, each (from stream, to
  stream) pair of ranks and each communicator being built has its own order;
* waits that can never end: lanes whose next events wait on each other in a
  cycle (across lanes and ranks; borrows included), or on a rank that exited;
* what is certain to fail on the rank anyway: a ``Reduce`` or send without
  its communicator, a second ``SplitComm`` of one key, unknown dims;
* a rank that both sends and receives over the point-to-point communicator of
  two different streams (in one message, as Monarch refuses, or in two): its
  two lanes would issue the communicator's operations in an order that differs
  between ranks, which NCCL, running them in issue order, deadlocks on;
* a borrow id used again before the controller knows that the earlier
  borrow's ``BorrowDrop`` ran: a rank keys borrows by id, so the new borrow's
  steps could meet the old one's and wait forever.

Collectives may span flushes: a member sent its part in one flush waits for
the others, and only a real mismatch is refused, not "not sent yet". A wait
for what was never sent is a hang only once nothing more will come: ``sync``
and ``get_ref`` ask :meth:`Precheck.waiting` before they wait (DESIGN
decision 14; docs/protocol.md §3, "Check before dispatch").

The model is conservative about one thing only: a send waits until its
receiver takes it (NCCL does; gloo may send small tensors eagerly).

It is one long module on purpose: :class:`Precheck` is one state machine over
every waiting message kind, and its rules read against each other (what a
collective, a send and a borrow wait for, and what lets them go).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from itertools import product
from typing import Any

import torch

from ..protocol import messages as m
from ..protocol.ndslice import Slice
from ..protocol.rules import SYNC, Sync
from ..protocol.wire import CONTROL
from .routing import ProtocolError

# event kinds
_SIGNAL, _WAIT, _MEET, _DRAIN = "signal", "wait", "meet", "drain"
_NEVER = "never"  # what a wait needs when nothing can ever satisfy it
DROPS_KEPT = 1024  # a rank's borrow drops are looked at again, to forget those that ran, past this


_DEVICE_TYPES = ("cpu", "cuda")  # where a rank keeps its tensors


def _makeable(rank: int, factory: m.Factory, what: str) -> None:
    """Refuse a factory no rank can make a buffer from (a ``meta`` device, a sparse layout):
    a collective or send would receive into it and fail, or wait, on every member."""
    device = str(factory.device).split(":", 1)[0]
    if factory.layout is not torch.strided or device not in _DEVICE_TYPES:
        raise ProtocolError(
            rank,
            f"{what}: its factory (shape {tuple(factory.size)}, {factory.dtype}, "
            f"{factory.layout}, device {factory.device}) cannot be made on a rank: a rank's "
            f"tensors are dense (torch.strided) on {' or '.join(_DEVICE_TYPES)}",
        )


class _Lane:
    """One lane of one rank in the model: the events it has not passed yet."""

    __slots__ = ("rank", "label", "queue", "enqueued")

    def __init__(self, rank: int, label: Any):
        self.rank = rank
        self.label = label
        self.queue: deque[_Event] = deque()
        self.enqueued = 0  # events ever queued here (positions for Exit's drain)

    def done(self) -> int:
        """Events passed so far (on the control lane: control steps passed)."""
        return self.queue[0].pos if self.queue else self.enqueued

    def name(self) -> str:
        where = "control lane" if self.label == CONTROL else f"stream {self.label}"
        return f"rank {self.rank} {where}"


class _Event:
    """Something a lane waits on or lets go; :attr:`what` says it for errors.

    ``text`` is the description, or ``(function, *args)`` that makes it: the
    description is only needed for an error, so it is not formatted before.
    """

    __slots__ = ("lane", "pos", "after", "kind", "key", "slots", "left", "started", "text")

    def __init__(self, kind: str, key: Any = None, text: Any = None):
        self.kind = kind
        self.key = key  # signal/wait: the channel; drain: {lane: events to pass}
        self.text = text
        self.slots: tuple[_Slot, ...] = ()
        self.left = 0  # meet: slots not complete yet
        self.started = False  # meet: arrived at its slots
        self.lane: _Lane | None = None
        self.pos = 0
        self.after = 0  # lane events: control steps of the rank that must have run first

    @property
    def what(self) -> str:
        text = self.text
        if text is None:
            return " and ".join(slot.what for slot in self.slots)
        return text if type(text) is str else text[0](*text[1:])


class _Slot:
    """The ``index``-th operation of a communicator (``key``): every rank in ``need`` arrives.

    ``key[0]`` is the communicator: ``("reduce", mesh, stream, dims, group)``,
    ``("send", from stream, to stream, from rank, to rank)``, or one being
    built (its description in ``text``).
    """

    __slots__ = ("key", "sig", "need", "events", "arrived", "text")

    def __init__(self, key: tuple, sig: Any, need: tuple[int, ...], text: str | None):
        self.key = key
        self.sig = sig
        self.need = need
        self.events: dict[int, _Event] = {}
        self.arrived = 0
        self.text = text

    def label(self, rank: int) -> Any:
        """The lane ``rank``'s part runs on."""
        comm = self.key[0]
        if comm[0] == "reduce":
            return comm[2]
        if comm[0] == "send":
            return comm[1] if rank == comm[3] else comm[2]
        return CONTROL

    @property
    def what(self) -> str:
        comm = self.key[0]
        if comm[0] == "reduce":
            _, mesh, stream, dims, group = comm
            return (
                f"Reduce over {list(dims)} of mesh r{mesh} on stream {stream} (result "
                f"r{self.sig[1]}, ranks {list(group)})"
            )
        if comm[0] == "send":
            _, src_stream, dst_stream, src, dst = comm
            return (
                f"SendTensor r{self.sig[1]} from rank {src} stream {src_stream} to rank {dst} "
                f"stream {dst_stream}"
            )
        return self.text


class Precheck:
    """The model of one controller's ranks (see module docs); one per :class:`Compiler`."""

    def __init__(self, world_size: int, done: dict | None = None):
        self.world = tuple(range(world_size))
        self.done = {} if done is None else done  # (rank, lane) -> last segment it finished
        self.lanes: dict[tuple[int, Any], _Lane] = {}
        self.control_steps = [0] * world_size  # control steps routed per rank
        self.passed_control = [0] * world_size  # ... and passed in the model
        self.slots: dict[tuple, _Slot] = {}  # incomplete meets
        self.counts: dict[tuple, int] = {}  # (rank, communicator) -> operations queued
        self.signals: dict[Any, int] = {}  # signals given and not yet taken
        self.signal_at: dict[Any, _Lane] = {}  # queued signals: where they are
        self.waiters: dict[Any, _Lane] = {}  # a started wait, by its channel
        self.after_control: list[set[_Lane]] = [set() for _ in self.world]
        self.draining: dict[int, _Lane] = {}  # rank -> its control lane, waiting in Exit
        self.work: list[_Lane] = []  # lanes whose head may go on
        self.busy: set[_Lane] = set()  # lanes with events left
        # what the ranks hold, as far as waits depend on it
        self.networked: set[int] = set()  # ranks that joined the world group
        self.exited: set[int] = set()
        self.meshes: list[dict[int, tuple[list[str], Slice]]] = [{} for _ in self.world]
        self.splits: list[dict[tuple, tuple[int, ...]]] = [{} for _ in self.world]
        self.split_groups: dict[tuple, dict[int, tuple[int, ...]]] = {}
        self.p2p: list[set[tuple[int, int]]] = [set() for _ in self.world]
        # (rank, from stream, to stream) of two streams -> (lane, SendTensor ref) that first
        # used the communicator on the rank: the one lane that may (docs/architecture.md)
        self.p2p_lanes: dict[tuple[int, int, int], tuple[int, int]] = {}
        self.groups: list[dict[int, tuple[int, tuple[str, ...]]]] = [{} for _ in self.world]
        self.group_comms: list[set[tuple[int, int]]] = [set() for _ in self.world]
        self.borrows: list[dict[int, int]] = [{} for _ in self.world]  # live borrow -> instance
        # dropped borrow -> (lane, segment) of its BorrowDrop, until that segment is known done
        self.dropped: list[dict[int, tuple[int, int]]] = [{} for _ in self.world]
        # a rank's drops are pruned once they are this many (raised while they have not run:
        # a client far ahead of its ranks would otherwise scan them all at every drop)
        self._prune_at = [DROPS_KEPT for _ in self.world]
        self.recordings: list[dict[int, dict[int, list]]] = [{} for _ in self.world]
        self.chunks: list[list] = [[] for _ in self.world]
        self.handoff: list[Any] = [None for _ in self.world]
        self._ids = itertools.count()
        self._msg: Any = None  # the last Reduce seen, and its (sorted dims, signature):
        self._facts: Any = None  # one message goes to many ranks

    # -- messages -----------------------------------------------------------------------------

    def lane(self, rank: int, label: int, msg: Any, segment: int) -> None:
        """A routed lane step of a checked type (a group's inner steps may be of any type),
        in segment ``segment`` of its lane."""
        t = type(msg)
        sync = SYNC.get(t)
        if sync is None:
            return
        if t is m.Reduce:
            self.reduce(rank, label, msg)
        elif t is m.SendTensor:
            self._send(rank, label, msg, None)
        elif sync is Sync.SIGNAL or sync is Sync.WAIT:
            self._borrow(rank, label, msg, segment)
        elif t is m.CallRecording:
            self._replay(rank, label, msg)

    def control(self, rank: int, step: Any) -> None:
        """Every step routed to a rank's control lane (lane work after it follows it)."""
        t = type(step)
        if t is m.BackendNetworkInit:
            if rank not in self.networked:
                self.networked.add(rank)
                self._meet_control(
                    rank,
                    ("world",),
                    self.world,
                    "BackendNetworkInit (every rank joins the world group)",
                )
        elif t is m.BackendNetworkPointToPointInit:
            key = (step.from_stream.id, step.to_stream.id)
            if rank in self.networked and key not in self.p2p[rank]:
                self.p2p[rank].add(key)
                self._meet_control(
                    rank,
                    ("p2p-init", *key),
                    self.world,
                    f"BackendNetworkPointToPointInit from stream {key[0]} to "
                    f"{key[1]} (every rank joins)",
                )
        elif t is m.SplitComm:
            self._split(rank, step)
        elif t is m.CreateDeviceMesh:
            self._mesh(rank, step)
        elif t is m.CreateRemoteProcessGroup:
            if step.device_mesh.id in self.meshes[rank]:
                self.groups[rank][step.result.id] = (step.device_mesh.id, tuple(sorted(step.dims)))
        elif t is m.SplitCommForProcessGroup:
            self._group_split(rank, step)
        elif t is m.DefineRecording:
            self._define(rank, step)
        elif t is m.Exit:
            snapshot = {
                lane: lane.enqueued
                for (r, label), lane in self.lanes.items()
                if r == rank and label != CONTROL
            }
            self.exited.add(rank)
            self._queue(
                rank, CONTROL, _Event(_DRAIN, snapshot, "Exit (waits for every stream of the rank)")
            )
        self.control_steps[rank] += 1
        control = self.lanes.get((rank, CONTROL))
        if control is None or not control.queue:
            self.passed_control[rank] = self.control_steps[rank]

    # -- collectives and sends ----------------------------------------------------------------

    def reduce(self, rank: int, label: int, msg: m.Reduce) -> None:
        """A Reduce on ``rank``'s stream ``label`` (the compiler calls it directly: no routing
        generator for the commonest checked message)."""
        if msg is not self._msg:
            factory = msg.factory
            _makeable(rank, factory, f"Reduce of r{msg.result.id}")
            if msg.reduction is m.ReduceOp.AVG and not (
                factory.dtype.is_floating_point or factory.dtype.is_complex
            ):
                raise ProtocolError(
                    rank,
                    f"Reduce of r{msg.result.id}: avg of {factory.dtype} (an average of "
                    "integers is not an integer: reduce a sum, or a floating dtype)",
                )
            self._facts = (
                tuple(sorted(msg.dims)),
                (
                    "Reduce",
                    msg.result.id,
                    msg.reduction,
                    bool(msg.scatter),
                    factory.size,
                    factory.dtype,
                ),
            )
            self._msg = msg
        dims, sig = self._facts
        group = self.splits[rank].get((msg.mesh.id, label, dims))
        if group is None:
            mesh = self.meshes[rank].get(msg.mesh.id)
            unknown = [d for d in dims if mesh is not None and d not in mesh[0]]
            if mesh is None or unknown:
                raise ProtocolError(
                    rank,
                    f"Reduce of r{msg.result.id}: "
                    + (
                        f"mesh r{msg.mesh.id} was never created on rank {rank}"
                        if mesh is None
                        else f"mesh r{msg.mesh.id} (dims {mesh[0]}) has no dims {unknown}"
                    ),
                )
            raise ProtocolError(
                rank,
                f"Reduce over {list(dims)} of mesh r{msg.mesh.id}: stream "
                f"{label} has no communicator for them (SplitComm was not "
                "sent)",
            )
        event = _Event(_MEET)
        self._part(rank, event, ("reduce", msg.mesh.id, label, dims, group), group, sig)
        self._queue(rank, label, event)

    def _send(self, rank: int, label: int, msg: m.SendTensor, replay: int | None) -> None:
        """One lane's part of a SendTensor on ``rank`` (as the worker's send_tensor does it)."""
        src_stream, dst_stream = msg.from_stream.id, msg.to_stream.id
        sending = label == src_stream and rank in msg.from_ranks
        receiving = label == dst_stream and rank in msg.to_ranks
        if not (sending or receiving):
            return
        if len(msg.from_ranks) != len(msg.to_ranks):  # as the rank would say it
            raise ProtocolError(
                rank,
                f"SendTensor of r{msg.tensor.id}: from_ranks has "
                f"{len(msg.from_ranks)} ranks but to_ranks has "
                f"{len(msg.to_ranks)}; ranks pair one to one, so both "
                "slices must have the same size",
            )
        to_rank = msg.to_ranks.get(msg.from_ranks.index(rank)) if sending else None
        from_rank = msg.from_ranks.get(msg.to_ranks.index(rank)) if receiving else None
        ref = msg.result.id
        if to_rank == rank or from_rank == rank:  # a copy that stays on the rank
            if sending and receiving:
                return  # on one lane: nothing waits
            if replay is not None:
                key = ("copy", rank, replay, ref)
            elif sending:  # the receiving lane comes next in the same route() call
                key = self.handoff[rank] = ("copy", rank, next(self._ids))
            else:
                key, self.handoff[rank] = self.handoff[rank], None
            if sending:
                self._queue(rank, label, _Event(_SIGNAL, key, (_copy, ref, None)))
            else:
                self._queue(rank, label, _Event(_WAIT, key, (_copy, ref, src_stream)))
            return
        _makeable(rank, msg.factory, f"SendTensor of r{msg.tensor.id}")
        if (src_stream, dst_stream) not in self.p2p[rank]:
            raise ProtocolError(
                rank,
                f"SendTensor from stream {src_stream} to {dst_stream}: no "
                "communicator (BackendNetworkPointToPointInit was not sent)",
            )
        if src_stream != dst_stream:
            self._one_lane(rank, label, src_stream, dst_stream, ref)
        sig = ("SendTensor", ref, msg.factory.size, msg.factory.dtype)
        event = _Event(_MEET)
        if sending:
            self._part(
                rank, event, ("send", src_stream, dst_stream, rank, to_rank), (rank, to_rank), sig
            )
        if receiving:
            self._part(
                rank,
                event,
                ("send", src_stream, dst_stream, from_rank, rank),
                (from_rank, rank),
                sig,
            )
        self._queue(rank, label, event)

    def _one_lane(self, rank: int, label: int, src_stream: int, dst_stream: int, ref: int) -> None:
        """Only one lane of ``rank`` issues on the communicator of two different streams."""
        first = self.p2p_lanes.setdefault((rank, src_stream, dst_stream), (label, ref))
        if first[0] == label:
            return
        role = {src_stream: "send", dst_stream: "receive"}
        earlier = "in the same message" if first[1] == ref else f"in SendTensor r{first[1]}"
        raise ProtocolError(
            rank,
            f"SendTensor r{ref}: rank {rank} would {role[label]} on stream {label} over the "
            f"point-to-point communicator of streams {src_stream} -> {dst_stream}, and it "
            f"{role[first[0]]}s on stream {first[0]} over it {earlier}. NCCL runs a "
            "communicator's operations in the order a rank issues them, and two streams of "
            "a rank would issue them in an order that differs between ranks (a deadlock): "
            "over a pair of different streams a rank only sends or only receives (Monarch "
            "refuses a rank that does both in one message). Move between overlapping "
            "slices on one stream, or send back over the reverse pair of streams",
        )

    def _part(
        self,
        rank: int,
        event: _Event,
        comm: tuple,
        need: tuple[int, ...],
        sig: Any,
        text: str | None = None,
    ) -> None:
        """``event`` is ``rank``'s next operation on ``comm``; its members must agree on it."""
        counted = (rank, comm)
        index = self.counts.get(counted, 0)
        self.counts[counted] = index + 1
        key = (comm, index)
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = _Slot(key, sig, need, text)
        elif slot.sig != sig:
            other = next(iter(slot.events))
            mine = _Slot(key, sig, need, text)
            raise ProtocolError(
                rank, _mismatch(rank, other, index, mine.what, slot.what, sig, slot.sig)
            )
        slot.events[rank] = event
        event.slots += (slot,)
        event.left += 1

    def _meet_control(self, rank: int, comm: tuple, need: Iterable[int], what: str) -> None:
        event = _Event(_MEET)
        self._part(rank, event, comm, tuple(need), ("build",), what)
        self._queue(rank, CONTROL, event)

    # -- communicators and meshes -------------------------------------------------------------

    def _mesh(self, rank: int, msg: m.CreateDeviceMesh) -> None:
        outside = [r for r in msg.ranks if r >= len(self.world)]
        if outside:
            raise ProtocolError(
                rank,
                f"CreateDeviceMesh r{msg.result.id}: {msg.ranks!r} holds ranks {outside}, but "
                f"this controller has {len(self.world)} ranks (0 to {len(self.world) - 1})",
            )
        if rank not in msg.ranks or len(msg.names) != msg.ranks.ndim:
            raise ProtocolError(
                rank,
                f"CreateDeviceMesh r{msg.result.id}: rank {rank} is not in "
                f"{msg.ranks!r} or the names {msg.names} do not match its "
                "dims",
            )
        self.meshes[rank][msg.result.id] = (list(msg.names), msg.ranks)

    def _split(self, rank: int, msg: m.SplitComm) -> None:
        mesh = self.meshes[rank].get(msg.device_mesh.id)
        if rank not in self.networked or mesh is None:
            return  # a no-op on the rank
        dims = tuple(sorted(msg.dims))
        key = (msg.device_mesh.id, msg.stream.id, dims)
        if key in self.splits[rank]:
            raise ProtocolError(
                rank,
                f"SplitComm: stream {msg.stream.id} already has a "
                f"communicator for dims {list(dims)} of mesh "
                f"r{msg.device_mesh.id}",
            )
        unknown = [d for d in dims if d not in mesh[0]]
        if unknown:
            raise ProtocolError(
                rank, f"SplitComm: mesh r{msg.device_mesh.id} has no dims {unknown}"
            )
        group = _group(mesh, rank, dims)
        members = self.split_groups.setdefault(key, {})
        for peer in group:
            theirs = members.get(peer)
            if theirs is not None and theirs != group:
                raise ProtocolError(
                    rank,
                    f"SplitComm for dims {list(dims)} of mesh "
                    f"r{msg.device_mesh.id}: rank {rank} builds it over "
                    f"ranks {list(group)}, rank {peer} over {list(theirs)} "
                    "(the ranks were sent different CreateDeviceMesh "
                    f"r{msg.device_mesh.id})",
                )
        members[rank] = group
        self.splits[rank][key] = group
        self._meet_control(
            rank,
            ("split", *key, group),
            group,
            f"SplitComm for dims {list(dims)} of mesh r{msg.device_mesh.id} on "
            f"stream {msg.stream.id} (ranks {list(group)} build it together)",
        )

    def _group_split(self, rank: int, msg: m.SplitCommForProcessGroup) -> None:
        definition = self.groups[rank].get(msg.remote_process_group.id)
        key = (msg.remote_process_group.id, msg.stream.id)
        if rank not in self.networked or definition is None or key in self.group_comms[rank]:
            return  # a no-op, or fatal on the rank (an unknown group)
        mesh = self.meshes[rank].get(definition[0])
        if mesh is None or any(d not in mesh[0] for d in definition[1]):
            return
        self.group_comms[rank].add(key)
        group = _group(mesh, rank, definition[1])
        self._meet_control(
            rank,
            ("group", *key, group),
            group,
            f"SplitCommForProcessGroup r{key[0]} on stream {key[1]} (ranks "
            f"{list(group)} build it together)",
        )

    # -- borrows and recordings ---------------------------------------------------------------

    def _borrow(self, rank: int, label: int, msg: Any, segment: int) -> None:
        t = type(msg)
        live = self.borrows[rank]
        if t is m.BorrowCreate:
            self._reuse(rank, msg.borrow)
            instance = live[msg.borrow] = next(self._ids)
        else:
            instance = live.get(msg.borrow)
            if t is m.BorrowDrop:
                live.pop(msg.borrow, None)
                dropped = self.dropped[rank]
                dropped[msg.borrow] = (label, segment)
                if len(dropped) > self._prune_at[rank]:  # forget the drops that ran
                    done = self.done
                    for borrow, (lane, index) in list(dropped.items()):
                        if done.get((rank, lane), -1) >= index:
                            del dropped[borrow]
                    self._prune_at[rank] = max(DROPS_KEPT, 2 * len(dropped))
        self._borrow_step(rank, label, t, msg.borrow, (rank, instance))

    def _reuse(self, rank: int, borrow: int) -> None:
        """A borrow id may come back once the earlier borrow's drop is known to have run."""
        drop = self.dropped[rank].get(borrow)
        if drop is None:
            return
        if self.done.get((rank, drop[0]), -1) < drop[1]:
            raise ProtocolError(
                rank,
                f"BorrowCreate of borrow {borrow}, whose earlier BorrowDrop "
                f"on stream {drop[0]} may not have run yet: the rank would "
                "mix the two borrows and wait forever; use a new borrow "
                "id (or reuse it after a sync)",
            )
        del self.dropped[rank][borrow]

    def _borrow_step(self, rank: int, label: int, t: type, borrow: int, instance: Any) -> None:
        text = (_borrow_step, t, borrow)
        if t is m.BorrowCreate:
            event = _Event(_SIGNAL, ("created", instance), text)
        elif t is m.BorrowFirstUse:
            event = _Event(_WAIT, ("created", instance), text)
        elif t is m.BorrowLastUse:
            event = _Event(_SIGNAL, ("returned", instance), text)
        else:
            event = _Event(_WAIT, ("returned", instance), text)
        self._queue(rank, label, event)

    def _define(self, rank: int, msg: m.DefineRecording) -> None:
        """Assemble a recording's chunks (the router checked their order); keep its waits."""
        chunks = self.chunks[rank]
        chunks.extend(msg.commands)
        if msg.index + 1 < msg.ntotal_messages:
            return
        self.chunks[rank] = []
        streams: dict[int, list] = {}
        lenders: dict[int, tuple[int, int]] = {}
        for cmd in m.flatten_groups(chunks):
            t = type(cmd)
            sync = SYNC.get(t)
            if sync is None:
                continue
            if t is m.Reduce:
                streams.setdefault(cmd.stream.id, []).append(cmd)
            elif t is m.SendTensor:
                sending, receiving = rank in cmd.from_ranks, rank in cmd.to_ranks
                if sending:
                    streams.setdefault(cmd.from_stream.id, []).append(cmd)
                if receiving and (not sending or cmd.to_stream.id != cmd.from_stream.id):
                    streams.setdefault(cmd.to_stream.id, []).append(cmd)
            elif t is m.BorrowCreate:
                lenders[cmd.borrow] = (cmd.from_stream.id, cmd.to_stream.id)
                streams.setdefault(cmd.from_stream.id, []).append(cmd)
            elif sync is Sync.SIGNAL or sync is Sync.WAIT:
                ends = lenders.get(cmd.borrow)
                if ends is None:
                    return  # misuse: the rank refuses the recording
                on_borrower = t is not m.BorrowDrop
                streams.setdefault(ends[1] if on_borrower else ends[0], []).append(cmd)
        if streams:
            self.recordings[rank][msg.result.id] = streams
        else:
            self.recordings[rank].pop(msg.result.id, None)

    def delete(self, rank: int, msg: m.DeleteRefs) -> None:
        """Forget the waits of the recordings ``msg`` deletes (their replays are modelled)."""
        recordings = self.recordings[rank]
        if recordings:
            for ref in msg.refs:
                recordings.pop(int(ref), None)

    def _replay(self, rank: int, label: int, msg: m.CallRecording) -> None:
        streams = self.recordings[rank].get(msg.recording.id)
        if streams is None:
            return
        for cmd in streams.get(label, ()):
            t = type(cmd)
            if t is m.Reduce:
                self.reduce(rank, label, cmd)
            elif t is m.SendTensor:
                self._send(rank, label, cmd, msg.seq)
            else:
                self._borrow_step(rank, label, t, cmd.borrow, (rank, "replay", msg.seq, cmd.borrow))

    # -- the model ----------------------------------------------------------------------------

    def _queue(self, rank: int, label: Any, event: _Event) -> None:
        lane = self.lanes.get((rank, label))
        if lane is None:
            lane = self.lanes[(rank, label)] = _Lane(rank, label)
        event.lane = lane
        event.pos = self.control_steps[rank] if label == CONTROL else lane.enqueued
        event.after = self.control_steps[rank]
        lane.enqueued += 1
        if event.kind is _SIGNAL:
            self.signal_at[event.key] = lane
        if not lane.queue:
            self.work.append(lane)
            self.busy.add(lane)
            if label == CONTROL:
                self.passed_control[rank] = event.pos
        lane.queue.append(event)

    def settle(self) -> None:
        """Let go every event that can; raise a ProtocolError for waits that never end."""
        work = self.work
        while work:
            lane = work.pop()
            queue = lane.queue
            while queue and self._go(lane, queue[0]):
                self._passed(lane, queue.popleft())
            if not queue:
                self.busy.discard(lane)
        if self.busy:
            stuck = self._stuck()
            if stuck:
                raise ProtocolError(stuck[0].rank, self._cycle(stuck))

    def _go(self, lane: _Lane, event: _Event) -> bool:
        """Whether ``event`` (the head of ``lane``) is passed now."""
        rank = lane.rank
        if event.after > self.passed_control[rank] and lane.label != CONTROL:
            self.after_control[rank].add(lane)
            return False
        kind = event.kind
        if kind is _MEET:
            if not event.started:
                event.started = True
                for slot in event.slots:
                    slot.arrived += 1
                    if slot.arrived == len(slot.need):
                        del self.slots[slot.key]
                        for other in slot.events.values():
                            other.left -= 1
                            if other is not event and other.left == 0:
                                self.work.append(other.lane)
                        slot.events.clear()  # complete: no event and slot hold each other
            return event.left == 0
        if kind is _SIGNAL:
            self.signals[event.key] = self.signals.get(event.key, 0) + 1
            self.signal_at.pop(event.key, None)
            waiter = self.waiters.pop(event.key, None)
            if waiter is not None:
                self.work.append(waiter)
            return True
        if kind is _WAIT:
            given = self.signals.get(event.key, 0)
            if given:
                if given == 1:
                    del self.signals[event.key]
                else:
                    self.signals[event.key] = given - 1
                return True
            self.waiters[event.key] = lane
            return False
        for other, needed in event.key.items():  # drain
            if other.done() < needed:
                self.draining[rank] = lane
                return False
        self.draining.pop(rank, None)
        return True

    def _passed(self, lane: _Lane, event: _Event) -> None:
        rank = lane.rank
        if lane.label == CONTROL:
            self.passed_control[rank] = (
                lane.queue[0].pos if lane.queue else self.control_steps[rank]
            )
            waiting = self.after_control[rank]
            if waiting:
                self.work.extend(waiting)
                waiting.clear()
        else:
            drain = self.draining.get(rank)
            if drain is not None:
                self.work.append(drain)

    def _control_done(self, rank: int) -> int:
        return self.passed_control[rank]

    # -- what waits, and on what --------------------------------------------------------------

    def _needs(self, lane: _Lane, explain: bool = False) -> tuple[list[Any], list[str]]:
        """The lanes whose head must pass before ``lane``'s head can (``_NEVER``: nothing can
        let it go), and, to ``explain``, why."""
        event = lane.queue[0]
        rank = lane.rank
        if lane.label != CONTROL and self._control_done(rank) < event.after:
            control = self.lanes[(rank, CONTROL)]
            return [control], (
                [f"the control step before it ({control.queue[0].what})"] if explain else []
            )
        if event.kind is _WAIT:
            other = self.signal_at.get(event.key)
            if other is None:
                return [_NEVER], ["a signal that was never sent"]
            return [other], (
                [f"{other.name()} to reach {_queued(other, event.key)}"] if explain else []
            )
        if event.kind is _DRAIN:
            behind = [other for other, needed in event.key.items() if other.done() < needed]
            return behind, [f"{other.name()} to finish" for other in behind] if explain else []
        needs: list[Any] = []
        why: list[str] = []
        for slot in event.slots:
            if slot.key not in self.slots:
                continue  # complete
            for peer in slot.need:
                theirs = slot.events.get(peer)
                if theirs is not None:
                    if not theirs.started:
                        needs.append(theirs.lane)
                        if explain:
                            why.append(
                                f"{theirs.lane.name()} to reach it (it waits at "
                                f"{theirs.lane.queue[0].what} first)"
                            )
                elif peer in self.exited:
                    needs.append(_NEVER)
                    if explain:
                        why.append(f"rank {peer}, which exited without it")
                else:  # a later message may bring it, once that lane passed what it holds
                    later = self.lanes.get((peer, slot.label(peer)))
                    if later is not None:
                        needs.append(later)
                    if explain:
                        why.append(f"rank {peer}, which was not sent it")
        return needs, why

    def _stuck(self) -> list[_Lane]:
        """Lanes that wait forever whatever is sent later (a cycle, or a rank gone)."""
        needs = {lane: self._needs(lane)[0] for lane in self.busy}
        stuck = set(needs)
        changed = True
        while changed:
            changed = False
            for lane in list(stuck):
                if not any(other is _NEVER or other in stuck for other in needs[lane]):
                    stuck.discard(lane)
                    changed = True
        return sorted(stuck, key=lambda lane: (lane.rank, str(lane.label)))

    def _cycle(self, stuck: list[_Lane]) -> str:
        lines = []
        for lane in stuck[:6]:
            lines.append(self._describe(lane))
        more = f" (and {len(stuck) - 6} more lanes)" if len(stuck) > 6 else ""
        return (
            "these messages would wait on each other forever, so nothing of this flush "
            "was sent: " + "; ".join(lines) + more + ". Send every member of a collective "
            "or send its part in the same order, and borrows in their order"
        )

    def _describe(self, lane: _Lane) -> str:
        _, why = self._needs(lane, explain=True)
        return f"{lane.name()} waits at {lane.queue[0].what} for " + ", ".join(dict.fromkeys(why))

    def waiting(self, rank: int | None = None, stream: int | None = None) -> ProtocolError | None:
        """What would wait forever if nothing more were sent, or None.

        All lanes, or only what a read on ``rank``'s ``stream`` waits for (the
        stream and the rank's control steps).
        """
        lanes = sorted(
            (
                lane
                for lane in self.busy
                if rank is None or (lane.rank == rank and lane.label in (stream, CONTROL))
            ),
            key=lambda lane: (lane.rank, str(lane.label)),
        )
        if not lanes:
            return None
        text = "; ".join(self._describe(lane) for lane in lanes[:6])
        more = f" (and {len(lanes) - 6} more lanes)" if len(lanes) > 6 else ""
        return ProtocolError(
            lanes[0].rank,
            f"waiting would never end: {text}{more}. Send "
            "every member of a collective or send its part before waiting",
        )


def _queued(lane: _Lane, key: Any) -> str:
    for event in lane.queue:
        if event.kind is _SIGNAL and event.key == key:
            return event.what
    return "its signal"


def _group(mesh: tuple[list[str], Slice], rank: int, dims: tuple[str, ...]) -> tuple[int, ...]:
    """The worker's ``DeviceMesh.ranks_for_dims``: ranks varying along ``dims``, others ours."""
    names, s = mesh
    if not dims:
        return tuple(s)
    coords = s.coordinates(rank)
    axes = [names.index(d) for d in dims]
    base = rank - sum(coords[a] * s.strides[a] for a in axes)
    return tuple(
        base + sum(c * s.strides[a] for c, a in zip(cs, axes))
        for cs in product(*(range(s.sizes[a]) for a in axes))
    )


def _reduction(reduction: Any) -> str:
    return reduction if isinstance(reduction, str) else reduction.name.lower()


def _copy(ref: int, src_stream: int | None) -> str:
    if src_stream is None:
        return f"the copy of SendTensor r{ref} to another stream of the rank"
    return f"SendTensor r{ref} (the copy from stream {src_stream})"


def _borrow_step(t: type, borrow: int) -> str:
    waits = {
        m.BorrowFirstUse: " (waits for the lender's BorrowCreate)",
        m.BorrowDrop: " (waits for the borrower's BorrowLastUse)",
    }
    return f"{t.__name__} {borrow}{waits.get(t, '')}"


def _mismatch(
    rank: int, other: int, index: int, what: str, other_what: str, sig: tuple, other_sig: tuple
) -> str:
    where = f"operation #{index} of its communicator"
    if sig[1] != other_sig[1] or sig[0] != other_sig[0]:
        return (
            f"{where} is {what} on rank {rank} but {other_what} on rank {other}: every member "
            "of a collective or send must be sent the same ones in the same order (one of "
            "them was not sent to every member, or they were sent in another order)"
        )
    if sig[0] == "Reduce" and sig[2:4] != other_sig[2:4]:
        return (
            f"{what}: rank {rank} does {_describe_op(sig)} but rank {other} "
            f"{_describe_op(other_sig)}: members of a collective must do the same one"
        )
    return (
        f"{what}: rank {rank} has shape {tuple(sig[-2])} {sig[-1]} but rank {other} "
        f"{tuple(other_sig[-2])} {other_sig[-1]} (the factory of its members must agree "
        "on shape and dtype)"
    )


def _describe_op(sig: tuple) -> str:
    return f"{_reduction(sig[2])}{' with scatter' if sig[3] else ''}"
