"""Borrows: a tensor crosses from one stream to another of the same rank.

Semantics: docs/protocol.md §3.7-§3.10.

Both ends live on one worker, so the four steps synchronise through two
in-process one-shot channels, plus the device's events (DESIGN decisions 5
and 15, ``worker/device.py``):

* ``BorrowCreate`` (lender lane) records an event on the lender's stream and
  puts ``(value, event)`` into the first-use channel;
* ``BorrowFirstUse`` (borrower lane) blocks until it is there, makes its
  stream wait on the event, keeps the block from reuse while its stream may
  read it, and binds the *same* object (shared storage);
* ``BorrowLastUse`` (borrower lane) removes the binding and puts an event
  recorded on its stream into the last-use channel;
* ``BorrowDrop`` (lender lane) blocks until it is there and waits on the event.

Happens-before: lender work before the create precedes borrower work after
the first use; borrower work before the last use precedes lender work after
the drop. The lent object is kept alive by the borrow until the drop, even if
the lender deletes its ref meanwhile. An errored value travels as the same
root error (no new report). The compiler has already checked the order of the
steps (an unknown borrow or a step out of order never reaches a worker), so a
borrow's two lanes can be created here by whichever side arrives first.
"""

from __future__ import annotations

import threading
from typing import Any

from ..protocol.messages import BorrowCreate, BorrowDrop, BorrowFirstUse, BorrowLastUse
from .errors import FatalError, SeqError
from .lane import Lane

_MISSING = object()


class Borrow:
    """The two one-shot channels of one borrow."""

    __slots__ = (
        "id",
        "result",
        "from_stream",
        "to_stream",
        "value",
        "created",
        "lent_event",
        "last_used",
        "returned_event",
    )

    def __init__(self, borrow_id: int):
        self.id = borrow_id
        self.result: int | None = None
        self.from_stream: Any = None
        self.to_stream: Any = None
        self.value: Any = None  # the lent object: alive until the drop
        self.created = threading.Event()
        self.lent_event = None
        self.last_used = threading.Event()
        self.returned_event = None


def _key(lane: Lane, borrow_id: int):
    """Borrows made inside a recording are new on every replay: key them by its seq."""
    return borrow_id if lane.recording is None else (lane.recording.seq, borrow_id)


def _borrow(lane: Lane, borrow_id: int) -> Borrow:
    state = lane.rank
    key = _key(lane, borrow_id)
    with state.lock:
        borrow = state.borrows.get(key)
        if borrow is None:
            borrow = state.borrows[key] = Borrow(borrow_id)
        return borrow


def borrow_create(lane: Lane, msg: BorrowCreate) -> None:
    """Lend ``tensor`` to ``to_stream`` (lender lane; never blocks).

    Fatal if the tensor is not on this stream. An errored value is lent as is.
    """
    value = lane.env.get(msg.tensor.id, _MISSING)
    if value is _MISSING:
        raise FatalError(f"BorrowCreate {msg.borrow}: r{msg.tensor.id} is not on this stream")
    if lane.recording is not None and type(value) is SeqError:
        lane.recording.dependent(value)
    borrow = _borrow(lane, msg.borrow)
    borrow.result, borrow.from_stream, borrow.value = msg.result.id, lane.label, value
    borrow.to_stream = msg.to_stream.id
    borrow.lent_event = lane.rank.device.record(lane.stream)
    borrow.created.set()


def borrow_first_use(lane: Lane, msg: BorrowFirstUse) -> None:
    """Bind the lent object on the borrower lane; blocks until the lender ran the create."""
    borrow = _borrow(lane, msg.borrow)
    lane.rank.wait(lane, borrow.created, f"borrow {msg.borrow} (the lender's BorrowCreate)")
    device = lane.rank.device
    device.wait(lane.stream, borrow.lent_event)
    if borrow.result in lane.env:
        raise FatalError(f"Duplicate write to reference r{borrow.result} (borrow {msg.borrow})")
    device.keep(borrow.value, lane.stream)
    lane.env[borrow.result] = borrow.value


def borrow_last_use(lane: Lane, msg: BorrowLastUse) -> None:
    """Give the object back: unbind it on the borrower lane (fatal if it is gone)."""
    borrow = _borrow(lane, msg.borrow)
    if lane.env.pop(borrow.result, _MISSING) is _MISSING:
        raise FatalError(f"BorrowLastUse {msg.borrow}: r{borrow.result} is not on this stream")
    borrow.returned_event = lane.rank.device.record(lane.stream)
    borrow.last_used.set()


def borrow_drop(lane: Lane, msg: BorrowDrop) -> None:
    """End the borrow on the lender lane; blocks until the borrower passed its last use."""
    borrow = _borrow(lane, msg.borrow)
    if not borrow.last_used.is_set():
        to = borrow.to_stream
        lane.rank.wait(
            lane,
            borrow.last_used,
            f"borrow {msg.borrow} (the BorrowLastUse on stream {to})",
            peers=((lane.rank.rank, to),),
        )
    lane.rank.device.wait(lane.stream, borrow.returned_event)
    with lane.rank.lock:
        lane.rank.borrows.pop(_key(lane, msg.borrow), None)
    borrow.value = None
