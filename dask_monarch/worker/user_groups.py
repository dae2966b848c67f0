"""The process groups user code gets (``mesh.process_group(...)``): checked before every op.

A collective whose members pass different sizes or dtypes does not fail in
gloo: it throws ``gloo::EnforceNotMet`` on gloo's own thread, which ends in
``std::terminate``, and the worker process dies with every controller's rank
on it (a receive smaller than what its peer sends does the same). The
protocol's own ``Reduce`` and ``SendTensor`` are checked before dispatch and
on the rank (worker/comm.py); a user function calling ``dist.all_reduce``
cannot be. So the group a remote function receives is a :class:`CheckedGroup`:
the same communicators, with every collective preceded by an exchange of a
fixed-size description of it (the op, its root and reduce op, dtype, device,
sizes) over the group's gloo backend. Members that disagree all raise
:class:`CollectiveMismatch`, naming each rank's call, and none enters the
collective: the user's function fails, the workers live on. A send carries its
description ahead of its data; the receive checks it, takes a mismatched
payload into a buffer of the sent size (so gloo reads what it was sent) and
raises.

The exchange costs one small collective (a point-to-point message for a send)
per op: user-code collectives pay it, dask_monarch's own never do.

A call that takes groups starts with one more exchange (:func:`agree_to_start`):
a member whose input failed skips the call, as any call does, and its peers
would wait for it in their first collective until the collective timeout,
after which the group is broken. So the members first tell each other whether
each can start; if one cannot, none does, and each learns that member's
error.

It ends with one more too (:func:`end_call`), on the same channel as the ops'
descriptions and of the same size: a member whose function returned says
"done", one whose function raised says "failed" with its rank, seq and error.
Each member's k-th exchange on a group pairs with its peers' k-th, so a peer
still inside its function meets that row in its next op's description
exchange: it raises :class:`MemberFailed` (the failed member's error, naming
its rank) or, facing "done", :class:`CollectiveMismatch` (the members called
different numbers of collectives), and enters no collective; a peer whose
function returned meets it in its own closing exchange and poisons its
results. Either way every member has made the same number of exchanges when
the call ends, and the group serves the next call. Not covered: a ``recv``
(or a ``send`` gloo blocks on) from a member that raised before its matching
``send``: point-to-point has no exchange of all members to meet it in, so it
waits until the collective timeout as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .errors import DependentError, SeqError

__all__ = [
    "CollectiveMismatch",
    "CheckedGroup",
    "MemberFailed",
    "MemberFailure",
    "agree_to_start",
    "checked",
    "end_call",
]

_CPU = torch.device("cpu")
_KINDS = (
    "barrier",
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
)
_DTYPES = tuple(v for v in (getattr(torch, n) for n in dir(torch)) if isinstance(v, torch.dtype))
# header fields: kind, reduce op, root, dtype, device type, unit size, tensors, local problem
_HEADER = 8
# a call's end, in a row of the same size as an op's: kind, rank, seq, error text's length
_DONE, _FAILED = len(_KINDS), len(_KINDS) + 1
_ERROR_BYTES = 1 << 16  # the most of a failed member's error text its peers get
_DEVICES = ("cpu", "cuda")


class CollectiveMismatch(RuntimeError):
    """Members of a user's process group called a collective that does not agree across them."""


class MemberFailed(DependentError):
    """A member of a user's process group failed in the call: its peers stop at their next
    op on the group (the root is that member's error, naming its rank: unreported)."""

    def __str__(self) -> str:
        return self.root.error


def _dtype_code(tensors: list[torch.Tensor]) -> tuple[int, bool]:
    dtypes = {t.dtype for t in tensors}
    if not dtypes:
        return -1, True
    dtype = next(iter(dtypes))
    return _DTYPES.index(dtype), len(dtypes) == 1


def _device_code(tensors: list[torch.Tensor]) -> tuple[int, bool]:
    kinds = {t.device.type for t in tensors}
    if not kinds:
        return -1, True
    kind = next(iter(kinds))
    return (_DEVICES.index(kind) if kind in _DEVICES else len(_DEVICES)), len(kinds) == 1


def _op_code(opts: Any) -> int:
    op = getattr(opts, "reduceOp", None)
    return -1 if op is None else int(op.op)  # RedOpType: SUM 0, AVG 1, ...


def _text(row: list[int], size: int) -> str:
    kind, op, root, dtype, device, unit, count, problem = row[:_HEADER]
    parts = [_KINDS[kind] if 0 <= kind < len(_KINDS) else f"op {kind}"]
    if dtype >= 0:
        parts.append(str(_DTYPES[dtype]).removeprefix("torch."))
    if device >= 0:
        parts.append("on " + (_DEVICES[device] if device < len(_DEVICES) else "another device"))
    if unit >= 0:
        parts.append(f"of {unit} elements")
    if root >= 0:
        parts.append(f"root {root}")
    if op >= 0:
        parts.append(f"reduce op {dist.ReduceOp.RedOpType(op).name}")
    if count > 1:
        parts.append(f"{count} tensors")
    if problem:
        parts.append("(its own tensors disagree: sizes, dtypes or devices)")
    if any(row[_HEADER:]):
        parts.append(f"sending {row[_HEADER : _HEADER + size]}")
        parts.append(f"receiving {row[_HEADER + size :]}")
    return " ".join(parts)


class CheckedGroup(dist.ProcessGroup):
    """``pg``'s communicators, each collective checked across the members first."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        super().__init__(pg.rank(), pg.size())
        self.original = pg
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        for device in (_CPU, torch.device("cuda")):
            try:
                backend = pg._get_backend(device)
            except RuntimeError:  # no backend for this device (CUDA on a CPU rank)
                continue
            kind = (
                dist.ProcessGroup.BackendType.NCCL
                if backend.name() == "nccl"
                else dist.ProcessGroup.BackendType.GLOO
            )
            self._register_backend(device, kind, backend)
        self._gloo = pg._get_backend(_CPU)
        self._sending: list[dist.Work] = []  # descriptions of sends still on their way
        # this call's end on the group, once a member's "done" or "failed" was exchanged:
        # None while it runs, else the failure (or the mismatch's text) that ended it, if any
        self.ended: tuple[MemberFailure | str | None] | None = None
        c10d._world.pg_group_ranks[self] = dict(c10d._world.pg_group_ranks.get(pg, {}))

    # -- the check ----------------------------------------------------------------------------

    def _agree(
        self,
        kind: str,
        tensors: list[torch.Tensor],
        unit: int = -1,
        opts: Any = None,
        root: int = -1,
        problem: bool = False,
        counts: tuple[list[int], list[int]] | None = None,
    ) -> None:
        """Exchange this member's description of the call; raise on every member if any
        differs (``counts``: elements sent to and received from each member, all-to-all)."""
        size = self.size()
        dtype, one_dtype = _dtype_code(tensors)
        device, one_device = _device_code(tensors)
        problem = problem or not (one_dtype and one_device)
        header = [_KINDS.index(kind), _op_code(opts), root, dtype, device, unit, len(tensors)]
        sent, received = counts if counts is not None else ([0] * size, [0] * size)
        self._check_open()
        mine = torch.tensor([*header, int(problem), *sent, *received], dtype=torch.int64)
        exchange = _Exchange(self, mine).wait()
        if self._note_end(exchange.rows, exchange.texts) is not None:
            self._check_open()
        rows = exchange.rows
        if _agreeing(rows, size):
            return
        calls = "; ".join(f"group rank {i}: {_text(row, size)}" for i, row in enumerate(rows))
        raise CollectiveMismatch(
            f"the members of process group {dist.get_process_group_ranks(self)} called "
            f"{kind} with arguments that disagree ({calls}); gloo would abort the process on "
            "it, so no member ran it"
        )

    def _agree_into(
        self, kind: str, whole: list[torch.Tensor], parts: list[torch.Tensor], opts: Any
    ) -> None:
        """An all-gather into (``whole`` the outputs, ``parts`` the inputs) or a reduce-scatter
        of (``whole`` the inputs, ``parts`` the outputs) one tensor per pair: each whole
        holds a part per member."""
        bad = len(whole) != len(parts) or any(
            w.numel() != p.numel() * self.size() for w, p in zip(whole, parts)
        )
        self._agree(kind, [*whole, *parts], _numel(parts), opts, problem=bad)

    # -- the call's end -----------------------------------------------------------------------

    def _end_row(self, failure: MemberFailure | None) -> tuple[torch.Tensor, bytes]:
        """This member's row for :func:`end_call` (an op's size) and its error's text."""
        text = b"" if failure is None else failure.error.encode()[:_ERROR_BYTES]
        fields = [_DONE, -1, -1, 0] if failure is None else [_FAILED, *failure[:2], len(text)]
        row = torch.zeros(_HEADER + 2 * self.size(), dtype=torch.int64)
        row[:4] = torch.tensor(fields, dtype=torch.int64)
        return row, text

    def _note_end(self, rows: list[list[int]], texts: list[str]) -> tuple | None:
        """Whether an exchange's rows end the call on this group (a member's "done" or
        "failed" row among them), noting how in :attr:`ended`; the same on every member."""
        ends = [i for i, row in enumerate(rows) if row[0] in (_DONE, _FAILED)]
        if not ends:
            return None
        failed = next((i for i in ends if rows[i][0] == _FAILED), None)
        ops = [i for i, row in enumerate(rows) if row[0] not in (_DONE, _FAILED)]
        outcome: MemberFailure | str | None = None
        if failed is not None:
            _, rank, seq = rows[failed][:3]
            outcome = MemberFailure(rank, seq, texts[failed])
        elif ops:
            calls = "; ".join(f"group rank {i}: {_text(rows[i], self.size())}" for i in ops)
            outcome = (
                f"the members of process group {dist.get_process_group_ranks(self)} called "
                f"different numbers of collectives: group ranks {ends} had returned from the "
                f"function while the others called one more ({calls}), which no member ran"
            )
        self.ended = (outcome,)
        return self.ended

    def _check_open(self) -> None:
        """Refuse an op once the call has ended on the group (the user caught the error)."""
        if self.ended is None:
            return
        outcome = self.ended[0]
        if isinstance(outcome, MemberFailure):
            raise MemberFailed(member_error(outcome, self, "failed in it"))
        raise CollectiveMismatch(outcome or "the call has ended on this process group")

    def start(self, failure: MemberFailure | None) -> MemberFailure | None:
        """One member's part of :func:`agree_to_start` on this group."""
        text = b"" if failure is None else failure.error.encode()
        rank, seq = (-1, -1) if failure is None else (failure.rank, failure.seq)
        mine = torch.tensor([int(failure is not None), rank, seq, len(text)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.size())]
        self._gloo.allgather([every], [mine]).wait()
        rows = [row.tolist() for row in every]
        if not any(row[0] for row in rows):
            return None
        longest = max(row[3] for row in rows)  # the same on every member
        data = torch.zeros(longest, dtype=torch.uint8)
        texts = [data] * self.size()
        if longest:
            if text:  # a healthy member sends padding only
                data[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            texts = [torch.empty_like(data) for _ in range(self.size())]
            self._gloo.allgather([texts], [data]).wait()
        if failure is not None:
            return failure
        first, row = next((i, row) for i, row in enumerate(rows) if row[0])
        error = texts[first][: row[3]].numpy().tobytes().decode(errors="replace")
        return MemberFailure(row[1], row[2], error)

    # -- collectives (what torch.distributed's functions call on a group) ---------------------

    def barrier(self, opts: Any = None) -> dist.Work:
        self._agree("barrier", [])
        return self.original.barrier(*_given(opts))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        self._agree("all_reduce", tensors, _numel(tensors), opts)
        return self.original.allreduce(tensors, *_given(opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        self._agree("all_reduce_coalesced", tensors, _numel(tensors), opts)
        return self.original.allreduce_coalesced(tensors, *_given(opts))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        root = getattr(opts, "rootRank", 0)
        self._agree("broadcast", tensors, _numel(tensors), root=root)
        return self.original.broadcast(tensors, *_given(opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        root = getattr(opts, "rootRank", 0)
        self._agree("reduce", tensors, _numel(tensors), opts, root)
        return self.original.reduce(tensors, *_given(opts))

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        unit = _numel(inputs)
        flat = [t for ts in outputs for t in ts]
        bad = any(len(ts) != self.size() for ts in outputs) or any(t.numel() != unit for t in flat)
        self._agree("all_gather", [*inputs, *flat], unit, problem=bad)
        return self.original.allgather(outputs, inputs, *_given(opts))

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        unit = _numel(outputs)
        flat = [t for ts in inputs for t in ts]
        bad = any(len(ts) != self.size() for ts in inputs) or any(t.numel() != unit for t in flat)
        self._agree("reduce_scatter", [*outputs, *flat], unit, opts, problem=bad)
        return self.original.reduce_scatter(outputs, inputs, *_given(opts))

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        root = getattr(opts, "rootRank", 0)
        unit = _numel(inputs)
        flat = [t for ts in outputs for t in ts]
        bad = self.rank() == root and (
            any(len(ts) != self.size() for ts in outputs) or any(t.numel() != unit for t in flat)
        )
        self._agree("gather", [*inputs, *flat], unit, root=root, problem=bad)
        return self.original.gather(outputs, inputs, *_given(opts))

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        root = getattr(opts, "rootRank", 0)
        unit = _numel(outputs)
        flat = [t for ts in inputs for t in ts]
        bad = self.rank() == root and (
            any(len(ts) != self.size() for ts in inputs) or any(t.numel() != unit for t in flat)
        )
        self._agree("scatter", [*outputs, *flat], unit, root=root, problem=bad)
        return self.original.scatter(outputs, inputs, *_given(opts))

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        counts = ([t.numel() for t in inputs], [t.numel() for t in outputs])
        bad = len(inputs) != self.size() or len(outputs) != self.size()
        if bad:
            counts = ([0] * self.size(), [0] * self.size())
        self._agree("all_to_all", [*inputs, *outputs], problem=bad, counts=counts)
        return self.original.alltoall(outputs, inputs, *_given(opts))

    # -- point to point -----------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """The description goes ahead of the data, on the same pair and tag (its work is kept
        until it completes: a dropped gloo work may take its buffer with it)."""
        self._check_open()
        self._sending = [w for w in self._sending if not w.is_completed()]
        self._sending.append(self.original.send([_describe_send(tensors)], dst, tag))
        return self.original.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        self._check_open()
        return _CheckedRecv(self, tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        self._check_open()
        return _CheckedRecv(self, tensors, None, tag)


def _checked_flat(name: str, kind: str, gathers: bool, lists: bool) -> Any:
    """CheckedGroup's method ``name``: a flat-tensor all-gather (``gathers``) or
    reduce-scatter of one pair of tensors, or of lists of them (``lists``: coalesced),
    checked as ``kind`` (:meth:`CheckedGroup._agree_into`), then called on the group."""

    def method(self: CheckedGroup, output: Any, input: Any, opts: Any = None) -> dist.Work:
        outputs, inputs = (output, input) if lists else ([output], [input])
        whole, parts = (outputs, inputs) if gathers else (inputs, outputs)
        self._agree_into(kind, whole, parts, None if gathers else opts)
        return getattr(self.original, name)(output, input, *_given(opts))

    method.__name__ = method.__qualname__ = name
    return method


def _checked_all_to_all(name: str) -> Any:
    """CheckedGroup's method ``name``: an all-to-all of one tensor split along dim 0, the
    elements each member sends and receives checked against its peers'."""

    def method(
        self: CheckedGroup,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        size = self.size()
        sent, bad_in = _split_counts(input, input_split_sizes, size)
        received, bad_out = _split_counts(output, output_split_sizes, size)
        problem = bad_in or bad_out
        self._agree("all_to_all_single", [input, output], problem=problem, counts=(sent, received))
        return getattr(self.original, name)(
            output, input, output_split_sizes, input_split_sizes, *_given(opts)
        )

    method.__name__ = method.__qualname__ = name
    return method


# torch 2.13 reaches a group by the ``*_single`` names (which ``all_gather_into_tensor`` and
# ``reduce_scatter_tensor`` call) and their coalesced forms, older releases by the ``_base``
# ones: each is checked.
for _name, _kind, _gathers, _lists in (
    ("all_gather_single", "all_gather_into_tensor", True, False),
    ("_allgather_base", "all_gather_into_tensor", True, False),
    ("all_gather_single_coalesced", "all_gather_into_tensor_coalesced", True, True),
    ("allgather_into_tensor_coalesced", "all_gather_into_tensor_coalesced", True, True),
    ("reduce_scatter_single", "reduce_scatter_tensor", False, False),
    ("_reduce_scatter_base", "reduce_scatter_tensor", False, False),
    ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", False, True),
    ("reduce_scatter_tensor_coalesced", "reduce_scatter_tensor_coalesced", False, True),
):
    setattr(CheckedGroup, _name, _checked_flat(_name, _kind, _gathers, _lists))
for _name in ("all_to_all_single", "alltoall_base"):  # torch 2.13's name, older releases'
    setattr(CheckedGroup, _name, _checked_all_to_all(_name))


def _given(opts: Any) -> tuple:
    return () if opts is None else (opts,)


def _numel(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _split_counts(t: torch.Tensor, splits: list[int], size: int) -> tuple[list[int], bool]:
    """Elements ``t`` sends to (or receives from) each member of an all-to-all; whether the
    splits do not fit ``t``."""
    row = t[0].numel() if t.dim() > 0 and t.shape[0] else 0
    if not splits:
        rows = t.shape[0] if t.dim() > 0 else 0
        if rows % size:
            return [0] * size, True
        return [rows // size * row] * size, False
    if len(splits) != size or sum(splits) != (t.shape[0] if t.dim() > 0 else 0):
        return [0] * size, True
    return [s * row for s in splits], False


_SEND_FIELDS = 3  # dtype, bytes, elements


def _describe_send(tensors: list[torch.Tensor]) -> torch.Tensor:
    dtype, _ = _dtype_code(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return torch.tensor([dtype, nbytes, _numel(tensors)], dtype=torch.int64)


class _CheckedRecv(dist.Work):
    """A receive that checks the sender's description before it takes the data.

    The description's receive is posted at once and the data's when the work is
    waited for, so that a receive posted before its own rank's send (``irecv``
    then ``isend`` on both ranks) cannot wait on a peer that waits on it.
    """

    def __init__(
        self, group: CheckedGroup, tensors: list[torch.Tensor], src: int | None, tag: int
    ) -> None:
        super().__init__()
        self.group, self.tensors, self.tag = group, tensors, tag
        self.described = torch.zeros(_SEND_FIELDS, dtype=torch.int64)
        pg = group.original
        if src is None:
            self.head = pg.recv_anysource([self.described], tag)
        else:
            self.head = pg.recv([self.described], src, tag)
        self.src = src
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        if self.done:
            return True
        self.head.wait()
        if self.src is None:
            self.src = self.head._source_rank()
        dtype, nbytes, numel = self.described.tolist()
        mine = _describe_send(self.tensors).tolist()
        pg = self.group.original
        if [dtype, nbytes, numel] == mine:
            pg.recv(self.tensors, self.src, self.tag).wait()
            self.done = True
            return True
        sink = torch.empty(nbytes, dtype=torch.uint8)  # gloo reads exactly what was sent
        pg.recv([sink], self.src, self.tag).wait()
        self.done = True
        sent = f"{numel} elements of {_DTYPES[dtype] if dtype >= 0 else '?'}"
        raise CollectiveMismatch(
            f"a receive from group rank {self.src} of process group "
            f"{dist.get_process_group_ranks(self.group)} expected "
            f"{mine[2]} elements of {self.tensors[0].dtype if self.tensors else '?'}, but the "
            f"send carried {sent}: the data was dropped"
        )

    def is_completed(self) -> bool:
        return self.done

    def _source_rank(self) -> int:
        return -1 if self.src is None else self.src


def _agreeing(rows: list[list[int]], size: int) -> bool:
    """Whether the members' descriptions of one call agree (see :meth:`CheckedGroup._agree`)."""
    if any(row[_HEADER - 1] for row in rows):  # a member's own tensors disagree
        return False
    first = rows[0]
    kind = _KINDS[first[0]] if 0 <= first[0] < len(_KINDS) else ""
    fields = range(_HEADER - 1)
    if kind in ("all_to_all", "all_to_all_single"):
        fields = range(5)  # kind, op, root, dtype, device: the sizes are per pair
    if any(row[i] != first[i] for row in rows for i in fields):
        return False
    if kind in ("all_to_all", "all_to_all_single"):
        sent = [row[_HEADER : _HEADER + size] for row in rows]
        received = [row[_HEADER + size :] for row in rows]
        return all(sent[i][j] == received[j][i] for i in range(size) for j in range(size))
    return True


class MemberFailure(NamedTuple):
    """Why a member of a call's group could not start it: its rank, the root error's seq
    and text."""

    rank: int
    seq: int
    error: str


def agree_to_start(
    groups: Iterable[CheckedGroup], failure: MemberFailure | None
) -> MemberFailure | None:
    """Tell every member of ``groups`` (in the call's order: the same on each member)
    whether this one can start the call (``failure`` None) or not; the failure that stops
    it (this member's own first), or None when every member can start.

    A member that learns of a failure through one group passes it on through the others:
    with ``n`` groups, ``n`` passes over them reach every member of groups that overlap,
    in the same order on each member. One small all-gather per group and pass (one in
    all for a call taking one group); a second one, of the errors' text, only when a
    member failed.
    """
    groups = list(groups)
    for group in groups:
        group.ended = None  # a new call on the group
    for _ in groups:
        for group in groups:
            failure = group.start(failure)
    return failure


def end_call(
    groups: Iterable[CheckedGroup], failure: MemberFailure | None
) -> SeqError | str | None:
    """This member's part of the closing exchange on each of ``groups`` whose call has not
    ended yet: "done" (``failure`` None) or "failed". What a member whose function
    returned makes of the first group the call ended on with a failure: a member's
    error, naming its rank (the root to poison its results with, unreported), or the text
    of a mismatch (a fresh failure); None when every member's function returned.

    The exchanges on all groups are posted before any is waited for: a peer may sit in an
    op's exchange on the second group, and only leave it (to join the first group's
    closing) once this member's row reaches it there.
    """
    groups = list(groups)
    pending = []
    for group in groups:
        if group.ended is None:
            row, text = group._end_row(failure)
            pending.append(_Exchange(group, row, text))
    while pending:
        if len(pending) == 1:
            pending[0].wait()
        waiting = [exchange for exchange in pending if not exchange.ready()]
        for exchange in pending:
            if exchange not in waiting:
                exchange.group._note_end(exchange.rows, exchange.texts)
        if len(waiting) == len(pending):
            time.sleep(0.0005)
        pending = waiting
    for group in groups:
        outcome = group.ended[0] if group.ended else None
        if isinstance(outcome, MemberFailure):
            return member_error(outcome, group, "failed in it")
        if outcome is not None:
            return outcome
    return None


def member_error(failure: MemberFailure, group: CheckedGroup, what: str) -> SeqError:
    """The root a member's failure leaves its peers (unreported: the controller has it)."""
    return SeqError(
        failure.seq,
        f"{failure.error}\n(rank {failure.rank}, a member of process group "
        f"{dist.get_process_group_ranks(group)} that this call takes, {what})",
    )


class _Exchange:
    """One exchange of the members' fixed-size rows on a group's gloo side, then, when a
    row says its member failed, one of the failures' texts (:attr:`texts`, "" for the
    others). Posted at once; :meth:`ready` advances it without blocking."""

    def __init__(self, group: CheckedGroup, mine: torch.Tensor, text: bytes = b"") -> None:
        self.group, self.mine, self.text = group, mine, text  # kept until sent
        self.every = [torch.empty_like(mine) for _ in range(group.size())]
        self.work = group._gloo.allgather([self.every], [mine])
        self.rows: list[list[int]] | None = None
        self.texts: list[str] | None = None

    def ready(self) -> bool:
        if self.rows is None:
            if not self.work.is_completed():
                return False
            self.work.wait()  # raises what the exchange failed with
            self.rows = [row.tolist() for row in self.every]
            failed = [row[3] for row in self.rows if row[0] == _FAILED]
            if not any(failed):
                self.texts = [""] * len(self.rows)
                return True
            self.data = torch.zeros(max(failed), dtype=torch.uint8)  # kept until it is sent
            if self.text:
                mine = torch.frombuffer(bytearray(self.text), dtype=torch.uint8)
                self.data[: len(self.text)] = mine
            self.parts = [torch.empty_like(self.data) for _ in self.rows]
            self.work = self.group._gloo.allgather([self.parts], [self.data])
        if self.texts is None:
            if not self.work.is_completed():
                return False
            self.work.wait()
            self.texts = [
                part[: row[3]].numpy().tobytes().decode(errors="replace")
                if row[0] == _FAILED
                else ""
                for part, row in zip(self.parts, self.rows)
            ]
        return True

    def wait(self) -> _Exchange:
        while not self.ready():
            self.work.wait()
        return self


def checked(groups: dict[int, dist.ProcessGroup], cache: dict) -> dict[int, CheckedGroup]:
    """The user's views of ``groups`` (ref id -> group), made once per group and kept in
    ``cache`` (the rank's: released with it)."""
    out = {}
    for ref_id, pg in groups.items():
        view = cache.get(id(pg))
        if view is None or view.original is not pg:
            view = cache[id(pg)] = CheckedGroup(pg)
        out[ref_id] = view
    return out


def forget(cache: dict) -> None:
    """Drop the user's views (the rank is released; their groups are shut down)."""
    for view in cache.values():
        c10d._world.pg_group_ranks.pop(view, None)
    cache.clear()
