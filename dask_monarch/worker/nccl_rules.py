"""NCCL's rules checked on CPU: every rank issues the same operations on a communicator.

NCCL runs a communicator's operations in the order a rank issues them and
matches them across ranks by that order alone: a collective pairs with
whatever the other members issued at the same place, and a grouped
send/receive waits for its peer's matching call before anything issued after
it on that communicator runs. gloo forgives much of this (its sends and
receives match by tag, and a small send completes without its receiver), so a
CPU run can pass where a GPU run hangs or mixes up data.

With ``dask_monarch.comm.emulate-nccl: true`` (docs/configuration.md) every
communicator of a rank gets an :class:`OpSequence` that holds the CPU run to
NCCL's rules. Before a rank issues an operation it writes what it is about to
do into the controller's store, at the operation's place on the communicator
(its index; for a grouped send/receive, its index among the calls this rank
made with each peer), waits until the other members wrote theirs at the same
place, and compares:

* a collective: every member must issue the same one (kind, reduction, shape,
  dtype and result) at the same index;
* a grouped send/receive: for each peer, what this rank sends it is what the
  peer receives from it, and the other way round, in the same message;
* one lane per communicator on a rank: NCCL orders what one thread issues, and
  two lanes of a rank would issue in an order that differs between ranks.

A difference fails the mesh at once with a :class:`~.errors.FatalError`
naming the communicator, the place and both ranks' operations; a peer that
never reaches the place fails it after ``timeouts.collective``, as a hang on
NCCL would never end. Waiting for the peer's entry is also what makes a send
wait for its receiver, as NCCL's does. Operations that user functions issue on
a process group themselves are not seen.

The store entries of a place are deleted by their writer once every peer has
moved past it, so a long run does not fill the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .errors import FatalError

POLL_FIRST_S = 0.0005  # a peer usually writes its entry within a millisecond
POLL_MAX_S = 0.02  # ... and a slow one is polled for no more often than this


class OpSequence:
    """The operations one rank issued on one communicator, checked against its peers'."""

    def __init__(
        self,
        store: dist.Store,
        name: str,
        ranks: list[int],
        rank: int,
        timeout: float,
        stopped: Callable[[], str | None],
    ):
        self.store = store  # a client of its own: a lane polling it never holds another's
        self.name = name
        self.ranks = ranks
        self.rank = rank
        self.timeout = timeout
        self.stopped = stopped  # why to stop waiting (the controller failed), or None
        self.count = 0  # collectives issued
        self.pairs: dict[int, int] = {}  # peer -> grouped calls issued with it
        self.lane: tuple[Any, str] | None = None  # (label, title) of the lane that issues

    # -- the rules ----------------------------------------------------------------------------

    def collective(self, lane: Any, what: str) -> None:
        """``lane`` is about to issue the collective ``what``: every member issues it here."""
        self._owned(lane)
        index = self.count
        self.count += 1
        self.store.set(f"{index}/{self.rank}", what)
        keys = [f"{index}/{r}" for r in self.ranks]
        self._wait(keys, self.ranks, f"operation #{index} ({what})")
        for peer, theirs in zip(self.ranks, self.store.multi_get(keys)):
            if theirs.decode() != what:
                raise FatalError(
                    f"{self._where()}: operation #{index} is {what} on rank {self.rank} but "
                    f"{theirs.decode()} on rank {peer}. NCCL pairs a communicator's "
                    "operations by their order alone: every member must issue the same ones "
                    "in the same order (dask_monarch.comm.emulate-nccl)"
                )
        if index:
            self.store.delete_key(f"{index - 1}/{self.rank}")

    def point_to_point(
        self, lane: Any, message: str, sends: dict[int, str], receives: dict[int, str]
    ) -> None:
        """``lane`` is about to issue one grouped call of ``message``: ``sends`` and
        ``receives`` map each peer (a global rank) to what goes to it or comes from it."""
        self._owned(lane)
        peers = sorted({*sends, *receives})
        places = {}
        for peer in peers:
            place = places[peer] = self.pairs.get(peer, 0)
            self.pairs[peer] = place + 1
            entry = f"{message}|{sends.get(peer, '')}|{receives.get(peer, '')}"
            self.store.set(f"p/{self.rank}-{peer}/{place}", entry)
        keys = [f"p/{peer}-{self.rank}/{places[peer]}" for peer in peers]
        self._wait(keys, peers, f"{message}")
        for peer, theirs in zip(peers, self.store.multi_get(keys)):
            their_message, their_send, their_receive = theirs.decode().split("|")
            mine = _describe(message, sends.get(peer, ""), receives.get(peer, ""), peer)
            if (their_message, their_send, their_receive) != (
                message,
                receives.get(peer, ""),
                sends.get(peer, ""),
            ):
                other = _describe(their_message, their_send, their_receive, self.rank)
                raise FatalError(
                    f"{self._where()}: the grouped call #{places[peer]} between ranks "
                    f"{self.rank} and {peer} is {mine} on rank {self.rank} but {other} on "
                    f"rank {peer}. NCCL matches a communicator's sends and receives by their "
                    "order alone: both ends must issue them in the same messages and order "
                    "(dask_monarch.comm.emulate-nccl)"
                )
        for peer, place in places.items():
            if place:
                self.store.delete_key(f"p/{self.rank}-{peer}/{place - 1}")

    def _owned(self, lane: Any) -> None:
        """One lane issues every operation of the communicator on this rank."""
        if self.lane is None:
            self.lane = (lane.label, lane.title)
        elif self.lane[0] != lane.label:
            raise FatalError(
                f"{self._where()}: rank {self.rank} issues on it from {self.lane[1]} and from "
                "this stream. NCCL runs a communicator's operations in the order a rank issues "
                "them, and two lanes of a rank would issue them in an order that differs "
                "between ranks (dask_monarch.comm.emulate-nccl)"
            )

    def _wait(self, keys: list[str], peers: list[int], what: str) -> None:
        """Until every key is in the store; a FatalError when the controller gives up on the
        rank or after the timeout, naming the peers that never came."""
        deadline = time.monotonic() + self.timeout
        pause = POLL_FIRST_S
        while not self.store.check(keys):
            why = self.stopped()
            if why is not None:
                raise FatalError(f"{self._where()}: rank {self.rank} stopped waiting: {why}")
            if time.monotonic() > deadline:
                missing = [p for p, k in zip(peers, keys) if not self.store.check([k])]
                raise FatalError(
                    f"{self._where()}: ranks {', '.join(map(str, missing))} never issued "
                    f"{what} within {self.timeout:g}s (dask_monarch.timeouts.collective); "
                    "on NCCL this would hang"
                )
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    def _where(self) -> str:
        return f"communicator {self.name} of rank {self.rank}"


def _describe(message: str, send: str, receive: str, peer: int) -> str:
    parts = []
    if send:
        parts.append(f"sends {send} to rank {peer}")
    if receive:
        parts.append(f"receives {receive} from rank {peer}")
    return f"{message} ({' and '.join(parts) or 'nothing'})"
