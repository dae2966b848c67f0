"""Randomized raw-protocol sequences, valid and invalid, and a harness that runs them.

``generate(seed)`` builds one sequence from pieces (streams, calls, fetches,
deletes, status requests, borrows in and out of order, communicators,
reduces over dims with and without all members, sends, recordings, exits)
as a *program*: a list of messages, each for some ranks. The program is sent
as is, or split per rank and interleaved at random (each rank still gets its
messages in program order), with flushes in between; some sequences are then
*mutated* (a rank skips a collective, gets two of them the other way round,
another shape; a rank exits early; an unknown stream or borrow). A sequence
that is neither mutated nor uses an invalid piece is *valid*: its per-rank
orders come from one program order, so it cannot deadlock, and the
pre-dispatch check must never refuse it as a hang.

``run(client, sequence)`` runs one on a fresh raw Controller and says how it
ended: ``ok`` (the final sync returned), ``refused`` (the compiler refused a
flush before dispatch), ``failed`` (a DeviceException from the ranks), or
``hang`` (the sync timed out, or a collective timed out on a rank), or
``lost`` (a worker process died). Used by
tests/compiler/test_fuzz.py (a few dozen) and benchmarks/fuzz.py (thousands).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Factory, ReduceOp, Ref, StreamRef
from dask_monarch.ndslice import Slice

FLUSH = "flush"
SHAPE = (4,)
MESH = Ref(9)
# a message that waits on other ranks or lanes: what mutations reorder or drop
_SYNCING = (
    m.Reduce,
    m.SendTensor,
    m.SplitComm,
    m.BackendNetworkInit,
    m.BackendNetworkPointToPointInit,
    m.BorrowCreate,
    m.BorrowFirstUse,
    m.BorrowLastUse,
    m.BorrowDrop,
)


@dataclass
class Sequence:
    seed: int
    actions: list  # (ranks, message) or FLUSH, in send order
    pieces: list[str] = field(default_factory=list)
    valid: bool = True  # no mutation, no invalid piece: must not be refused as a hang

    def __len__(self) -> int:
        return sum(1 for a in self.actions if a != FLUSH)


def _factory(shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32) -> Factory:
    return Factory(shape, dtype, torch.strided, "cpu")


def _call(
    seq: int,
    result: Ref | None,
    fn: str,
    *args: Any,
    stream: StreamRef,
    mutates: tuple = (),
    **kwargs: Any,
) -> m.CallFunction:
    return m.CallFunction(
        seq, [result], list(mutates), fn, ArgsKwargs.from_python(args, kwargs), stream, []
    )


class _Program:
    """One program: its messages and what the generator knows the ranks hold."""

    def __init__(self, rng: random.Random, world: int):
        self.rng = rng
        self.world = tuple(range(world))
        self.messages: list[tuple[tuple[int, ...], Any]] = []
        self.pieces: list[str] = []
        self.valid = True
        self.ids = itertools.count(100)
        self.seqs = itertools.count(0)
        self.streams: list[StreamRef] = []
        self.tensors: dict[int, list[Ref]] = {}  # stream -> refs of SHAPE made on every rank
        self.stacked: dict[int, list[Ref]] = {}  # stream -> refs of gathered (stacked) tensors
        self.borrow_ids = itertools.count(1)
        self.dropped: list[int] = []
        self.open: list[list] = []  # [borrow id, lender, borrower, result, tensor, state]
        self.meshed = self.networked = False
        self.splits: set[int] = set()
        self.p2p: set[tuple[int, int]] = set()
        # (from stream, to stream) of two streams -> rank -> "send"/"receive": a rank only sends
        # or only receives over such a pair (docs/architecture.md, "Streams and hand-offs")
        self.roles: dict[tuple[int, int], dict[int, str]] = {}
        self.exited = False

    def send(self, ranks: tuple[int, ...], msg: Any) -> None:
        self.messages.append((tuple(ranks), msg))

    def invalid(self, name: str) -> None:
        self.valid = False
        self.pieces.append(f"invalid:{name}")

    def ref(self) -> Ref:
        return Ref(next(self.ids))

    def stream(self) -> StreamRef:
        return self.rng.choice(self.streams)

    def tensor(self, stream: StreamRef) -> Ref | None:
        refs = self.tensors.get(stream.id)
        return self.rng.choice(refs) if refs else None

    # -- pieces -------------------------------------------------------------------------------

    def streams_piece(self) -> None:
        for i in range(self.rng.choice((1, 2, 2, 3))):
            s = StreamRef(i)
            mode = (
                m.StreamCreationMode.UseDefaultStream
                if i == 0
                else m.StreamCreationMode.CreateNewStream
            )
            if i and self.rng.random() < 0.03:
                self.send((self.rng.choice(self.world),), m.CreateStream(s, mode))
                self.invalid("stream-on-one-rank")
            else:
                self.send(self.world, m.CreateStream(s, mode))
            self.streams.append(s)

    def call(self) -> None:
        s, r = self.stream(), self.ref()
        self.send(
            self.world,
            _call(next(self.seqs), r, "torch.full", SHAPE, float(self.rng.randint(0, 9)), stream=s),
        )
        self.tensors.setdefault(s.id, []).append(r)
        self.pieces.append("call")

    def op(self) -> None:
        s = self.stream()
        a, b = self.tensor(s), self.tensor(s)
        if a is None:
            return self.call()
        if self.rng.random() < 0.5:
            r = self.ref()
            self.send(
                self.world, _call(next(self.seqs), r, "torch.ops.aten.add.Tensor", a, b, stream=s)
            )
            self.tensors[s.id].append(r)
        else:
            self.send(
                self.world,
                _call(
                    next(self.seqs),
                    None,
                    "torch.ops.aten.mul_.Scalar",
                    a,
                    2,
                    stream=s,
                    mutates=(a,),
                ),
            )
        self.pieces.append("op")

    def failing_call(self) -> None:
        s = self.stream()
        a = self.tensor(s)
        fn = "torch.ops.aten.mm.default" if a is not None else "no_such_module.fn"
        self.send(self.world, _call(next(self.seqs), self.ref(), fn, a, a, stream=s))
        self.pieces.append("failing-call")

    def fetch(self) -> None:
        s = self.stream()
        a = self.tensor(s)
        if a is None:
            return self.call()
        self.send(
            self.world,
            m.SendValue(next(self.seqs), None, [], None, ArgsKwargs.from_python((a,), {}), s),
        )
        self.pieces.append("fetch")

    def delete(self) -> None:
        s = self.stream()
        refs = self.tensors.get(s.id)
        if not refs:
            return
        gone = refs.pop(self.rng.randrange(len(refs)))
        ranks = self.world if self.rng.random() < 0.8 else (self.rng.choice(self.world),)
        self.send(ranks, m.DeleteRefs([gone]))
        self.pieces.append("delete")

    def status(self) -> None:
        self.send(self.world, m.RequestStatus(next(self.seqs)))
        self.pieces.append("status")

    def borrow(self) -> None:
        """Open a borrow, or take the next step of an open one (steps interleave with others)."""
        rng = self.rng
        if self.open and rng.random() < 0.7:
            return self.borrow_step(rng.choice(self.open))
        lender = self.stream()
        t = self.tensor(lender)
        if t is None:
            return self.call()
        borrower = self.stream()
        if self.dropped and rng.random() < 0.15:
            bid = self.dropped.pop(rng.randrange(len(self.dropped)))  # an id used before:
            self.invalid("borrow-reused-id")  # refused unless its drop is known to have run
        else:
            bid = next(self.borrow_ids)
            self.pieces.append("borrow")
        result = self.ref()
        self.send(self.world, m.BorrowCreate(result, bid, t, lender, borrower))
        self.open.append([bid, lender, borrower, result, t, "created"])

    def borrow_step(self, b: list) -> None:
        bid, lender, borrower, result, t, state = b
        rng = self.rng
        if rng.random() < 0.02:  # a step out of order
            wrong = [
                x
                for x in (m.BorrowFirstUse, m.BorrowLastUse, m.BorrowDrop)
                if x
                is not {
                    "created": m.BorrowFirstUse,
                    "first-used": m.BorrowLastUse,
                    "used": m.BorrowLastUse,
                    "last-used": m.BorrowDrop,
                }[state]
            ]
            self.send(self.world, rng.choice(wrong)(bid))
            self.invalid("borrow-out-of-order")
            return
        if state == "created":
            self.send(self.world, m.BorrowFirstUse(bid))
            b[5] = "first-used"
        elif state == "first-used":
            self.send(
                self.world,
                _call(
                    next(self.seqs),
                    self.ref(),
                    "torch.ops.aten.neg.default",
                    result,
                    stream=borrower,
                ),
            )
            b[5] = "used"
        elif state == "used":
            self.send(self.world, m.BorrowLastUse(bid))
            b[5] = "last-used"
        else:
            self.send(self.world, m.BorrowDrop(bid))
            self.open.remove(b)
            self.dropped.append(bid)
        self.pieces.append(f"borrow-{state}")

    def comms(self) -> None:
        rng = self.rng
        if not self.meshed:
            self.meshed = True
            self.send(
                self.world, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([len(self.world)]))
            )
        if not self.networked:
            self.networked = True
            if rng.random() < 0.04:
                self.send((rng.choice(self.world),), m.BackendNetworkInit())
                self.invalid("network-on-one-rank")
            else:
                self.send(self.world, m.BackendNetworkInit())
        s = self.stream()
        if rng.random() < 0.5:
            if s.id in self.splits and rng.random() > 0.05:
                return
            if s.id in self.splits:
                self.invalid("split-twice")
            self.splits.add(s.id)
            self.send(self.world, m.SplitComm(["gpu"], MESH, s))
        else:
            d = self.stream()
            self.p2p.add((s.id, d.id))
            self.send(self.world, m.BackendNetworkPointToPointInit(s, d))
        self.pieces.append("comms")

    def reduce(self) -> None:
        rng = self.rng
        ready = [s for s in self.streams if s.id in self.splits and self.tensors.get(s.id)]
        if not ready:
            return self.comms()
        s = rng.choice(ready)
        t, r = self.tensor(s), self.ref()
        op = rng.choice((ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG, "stack"))
        in_place = op != "stack" and rng.random() < 0.3
        msg = m.Reduce(r, t, _factory(), MESH, s, ["gpu"], op, False, in_place, None)
        x = rng.random()
        if x < 0.03:  # only some members
            self.send((rng.choice(self.world),), msg)
            self.invalid("reduce-some-members")
        elif x < 0.05:  # members disagree on the shape
            self.send((0,), msg)
            self.send(
                self.world[1:],
                m.Reduce(r, t, _factory((5,)), MESH, s, ["gpu"], op, False, in_place, None),
            )
            self.invalid("reduce-shapes-differ")
        else:
            self.send(self.world, msg)
            self.pieces.append("reduce")
        if op == "stack":
            self.stacked.setdefault(s.id, []).append(r)
        elif not in_place:
            self.tensors[s.id].append(r)

    def send_tensor(self) -> None:
        rng = self.rng
        if not self.p2p:
            return self.comms()
        fs, ts = rng.choice(sorted(self.p2p))
        src, dst = StreamRef(fs), StreamRef(ts)
        t = self.tensor(src)
        if t is None:
            return self.call()
        r = self.ref()
        n = len(self.world)
        a, b = rng.sample(self.world, 2) if rng.random() < 0.7 else (rng.choice(self.world),) * 2
        if rng.random() < 0.2:  # every rank to itself (a copy, maybe to another stream)
            every = Slice.row_major([n])
            self.send(self.world, m.SendTensor(r, every, every, t, _factory(), src, dst))
        else:
            roles = self.roles.setdefault((fs, ts), {})
            if fs != ts and a != b:
                if roles.get(a, "send") != "send" or roles.get(b, "receive") != "receive":
                    if rng.random() < 0.1:
                        self.invalid("send-and-receive-over-two-streams")
                    else:
                        a, b = b, a  # the way this pair of streams already goes
                roles.setdefault(a, "send")
                roles.setdefault(b, "receive")
            frm, to = Slice(a, [1], [1]), Slice(b, [1], [1])
            ranks = tuple(sorted({a, b}))
            if a != b and rng.random() < 0.04:
                ranks = (a,)  # the receiver is never told
                self.invalid("send-without-receiver")
            self.send(ranks, m.SendTensor(r, frm, to, t, _factory(), src, dst))
        self.tensors.setdefault(ts, []).append(r)
        self.pieces.append("send")

    def recording(self) -> None:
        rng = self.rng
        s = self.stream()
        a = self.tensor(s)
        if a is None:
            return self.call()
        rec, x, y, out = self.ref(), self.ref(), self.ref(), self.ref()
        commands = [
            m.RecordingFormal(x, 0, s),
            _call(0, y, "torch.ops.aten.add.Tensor", x, x, stream=s),
        ]
        if s.id in self.splits and rng.random() < 0.5:
            z = self.ref()
            commands.append(
                m.Reduce(z, y, _factory(), MESH, s, ["gpu"], ReduceOp.SUM, False, False, None)
            )
            y = z
        if len(self.streams) > 1 and rng.random() < 0.4:
            other = rng.choice([t for t in self.streams if t != s])
            bid, lent = next(self.borrow_ids), self.ref()
            commands += [
                m.BorrowCreate(lent, bid, y, s, other),
                m.BorrowFirstUse(bid),
                _call(0, self.ref(), "torch.ops.aten.neg.default", lent, stream=other),
                m.BorrowLastUse(bid),
                m.BorrowDrop(bid),
            ]
        commands.append(m.RecordingResult(y, 0, s))
        chunks = rng.choice((1, 1, 2))
        size = -(-len(commands) // chunks)
        for i in range(chunks):
            self.send(
                self.world,
                m.DefineRecording(rec, 1, 1, commands[i * size : (i + 1) * size], chunks, i),
            )
        for _ in range(rng.choice((1, 2))):
            self.send(self.world, m.CallRecording(next(self.seqs), rec, [out], [a]))
        self.tensors[s.id].append(out)
        self.pieces.append("recording")

    def bad_piece(self) -> None:
        rng = self.rng
        kind = rng.choice(
            ("unknown-stream", "unknown-borrow", "unknown-recording", "early-exit", "factory-lies")
        )
        if kind == "unknown-stream":
            self.send(
                self.world, _call(next(self.seqs), self.ref(), "torch.ones", 2, stream=StreamRef(7))
            )
        elif kind == "unknown-borrow":
            self.send(self.world, m.BorrowFirstUse(999))
        elif kind == "unknown-recording":
            self.send(self.world, m.CallRecording(next(self.seqs), Ref(99_999), [], []))
        elif kind == "early-exit":
            self.send((rng.choice(self.world),), m.Exit())
        else:  # a gathered tensor sent or reduced as if it had SHAPE
            s = self.stream()
            lying = self.stacked.get(s.id)
            if not lying:
                return
            if s.id in self.splits and rng.random() < 0.5:
                self.send(
                    self.world,
                    m.Reduce(
                        self.ref(),
                        rng.choice(lying),
                        _factory(),
                        MESH,
                        s,
                        ["gpu"],
                        ReduceOp.SUM,
                        False,
                        False,
                        None,
                    ),
                )
            elif (s.id, s.id) in self.p2p:
                self.send(
                    self.world,
                    m.SendTensor(
                        self.ref(),
                        Slice(0, [1], [1]),
                        Slice(1, [1], [1]),
                        rng.choice(lying),
                        _factory(),
                        s,
                        s,
                    ),
                )
            else:
                return
        self.invalid(kind)

    def exit(self) -> None:
        self.send(self.world, m.Exit())
        self.pieces.append("exit")


_PIECES = [
    ("call", 8),
    ("op", 6),
    ("failing_call", 1),
    ("fetch", 5),
    ("delete", 3),
    ("status", 2),
    ("borrow", 10),
    ("comms", 3),
    ("reduce", 8),
    ("send_tensor", 6),
    ("recording", 3),
    ("bad_piece", 0.25),
]


def generate(seed: int, world: int = 2, size: tuple[int, int] = (8, 40)) -> Sequence:
    """One sequence (see module docs); the same seed gives the same sequence."""
    rng = random.Random(seed)
    p = _Program(rng, world)
    p.streams_piece()
    names = [n for n, _ in _PIECES]
    weights = [w for _, w in _PIECES]
    for name in rng.choices(names, weights, k=rng.randint(*size)):
        getattr(p, name)()
    if rng.random() < 0.3:
        p.exit()
    per_rank = rng.random() < 0.5
    if per_rank and rng.random() < 0.25:
        _mutate(p)
    actions = _deliver(p, per_rank)
    return Sequence(seed, actions, p.pieces, p.valid)


def _mutate(p: _Program) -> None:
    """Give one rank its collectives, sends or borrows in another order, or drop one."""
    rng = p.rng
    rank = rng.choice(p.world)
    mine = [
        i
        for i, (ranks, msg) in enumerate(p.messages)
        if rank in ranks and isinstance(msg, _SYNCING)
    ]
    if len(mine) < 2:
        return
    i, j = sorted(rng.sample(mine, 2))
    (ri, mi), (rj, mj) = p.messages[i], p.messages[j]
    others = tuple(r for r in ri if r != rank)
    if rng.random() < 0.5:  # swap the two for this rank only
        p.messages[i] = ((rank,), mj)
        p.messages[j] = ((rank,), mi)
        p.messages.insert(j + 1, (tuple(r for r in rj if r != rank), mj))
        p.messages.insert(i + 1, (others, mi))
        p.messages = [(r, x) for r, x in p.messages if r]
        p.invalid("swapped-for-one-rank")
    else:  # this rank never gets the first one
        p.messages[i] = (others, mi)
        p.messages = [(r, x) for r, x in p.messages if r]
        p.invalid("dropped-for-one-rank")


def _deliver(p: _Program, per_rank: bool) -> list:
    """The send order: the program as is, or per rank, interleaved at random; some flushes."""
    rng = p.rng
    if not per_rank:
        sends = list(p.messages)
    else:
        queues = {r: [msg for ranks, msg in p.messages if r in ranks] for r in p.world}
        sends = []
        while any(queues.values()):
            r = rng.choice([r for r, q in queues.items() if q])
            for _ in range(rng.randint(1, 4)):
                if queues[r]:
                    sends.append(((r,), queues[r].pop(0)))
    actions: list = []
    for send in sends:
        actions.append(send)
        if rng.random() < 0.08:
            actions.append(FLUSH)
    return actions


# -- running ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # ok | refused | failed | hang | lost (a worker died)
    seconds: float
    error: str = ""
    token: str = ""  # the controller's (its tasks' keys name it)


def run(client: Any, sequence: Sequence, bound: float = 60.0) -> Outcome:
    """Run ``sequence`` on a fresh 2-rank raw controller, then sync within ``bound`` seconds."""
    start = time.monotonic()
    ctrl = dm.Controller(client, world_size=2)
    try:
        for action in sequence.actions:
            if action == FLUSH:
                ctrl.flush()
            else:
                ctrl.send(*action)
        ctrl.sync(timeout=bound)
        kind, error = "ok", ""
    except dm.DeviceException as e:
        if ctrl._compiler.refused is not None:
            kind = "refused"
        elif "lost connection to its worker" in str(e):
            kind = "lost"
        elif "timed out" in str(e).lower() or "timeout" in str(e).lower():
            kind = "hang"  # a collective that waited for a peer until its timeout
        else:
            kind = "failed"
        error = str(e)
    except TimeoutError as e:
        kind, error = "hang", str(e)
    finally:
        ctrl.close()
    return Outcome(kind, time.monotonic() - start, error, ctrl.token)


def _executing(token: str = "monarch", dask_worker: Any = None) -> list[str]:
    return [f"{ts.key} ({ts.state})" for ts in dask_worker.state.executing if token in str(ts.key)]


def executing(client: Any, token: str = "monarch") -> list[str]:
    """The rank tasks the workers are executing (or believe they are); only those of
    controller ``token`` if given."""
    return [key for keys in client.run(_executing, token).values() for key in keys]


def quiesce(client: Any, timeout: float = 60.0, token: str = "monarch") -> float | None:
    """Wait until no rank task of any controller (or of controller ``token``) is executing
    on the workers (a broken controller's lane may still be leaving a wait); the seconds
    waited, or None if some still are after ``timeout`` (a worker lost an execution slot)."""
    start = time.monotonic()
    pause = 0.05
    while executing(client, token):
        if time.monotonic() - start > timeout:
            return None
        time.sleep(pause)
        pause = min(2 * pause, 1.0)  # each look asks every worker: few of them
    return time.monotonic() - start


def healthy(client: Any, timeout: float = 60.0) -> bool:
    """A normal controller on the same workers runs a call and a fetch."""
    s = StreamRef(0)
    with dm.Controller(client, world_size=2) as ctrl:
        ctrl.send([0, 1], m.CreateStream(s, m.StreamCreationMode.UseDefaultStream))
        ctrl.send([0, 1], _call(0, Ref(1), "torch.ones", 3, stream=s))
        ctrl.send([0, 1], m.SendValue(1, None, [], None, ArgsKwargs.from_python((Ref(1),), {}), s))
        got = ctrl.sync(timeout=timeout)
    return sum(1 for x in got if type(x) is m.FetchResult) == 2
