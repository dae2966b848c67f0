"""Reports: what a controller's ranks tell it, on one stream per rank that the rank's worker serves.

Reports come back on that stream (:mod:`dask_monarch.worker.plugin`) rather
than through task results: a fetch costs no extra gather, and a lost worker
shows up at once as a closed stream. A rank reports the segments it finished
(``LaneDone``), controller messages (``Status``, ``RemoteFunctionFailed``, and
fetched values, unpickled here into ``FetchResult``), what a probe read
(``RefValue``), its exit (``Exited``) and failures that break the mesh
(``Fatal``).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

from distributed.comm import Comm, connect
from distributed.comm.core import CommClosedError

from ..exceptions import DeviceException
from ..protocol.messages import FetchResult, RemoteFunctionFailed, Status
from ..protocol.wire import Exited, Fatal, Fetched, LaneDone, RefValue

logger = logging.getLogger("dask_monarch.controller")


class Reports:
    """What a controller's ranks have reported so far, and the streams the reports arrive on.

    Batches are applied on the client's event loop, under ``progress`` (the
    controller's condition, which they wake); a report that breaks the mesh
    goes to ``fail`` with ``progress`` held.
    """

    def __init__(self, token: str, progress: threading.Condition,
                 fail: Callable[[DeviceException], None]) -> None:
        self.token = token
        self.progress = progress
        self.fail = fail
        self.expected: dict[tuple[int, Any], int] = {}  # (rank, lane) -> newest segment
        self.done: dict[tuple[int, Any], int] = {}  # (rank, lane) -> last finished segment
        self.inbox: list = []  # controller messages not yet returned by a sync
        self.replies: dict[int, RefValue] = {}  # probe -> what it read
        self.listeners: list[Callable[[Any], None]] = []
        self.exited: set[int] = set()
        self.comms: dict[int, Comm] = {}  # rank -> its report stream

    # -- the streams --------------------------------------------------------------------------

    async def subscribe(self, workers: list[str], connection_args: dict) -> None:
        """Open the report stream of every rank (``workers[rank]``) and start reading it."""
        comms = await asyncio.gather(*(self._subscribe(a, connection_args) for a in workers))
        for rank, comm in enumerate(comms):
            self.comms[rank] = comm
            asyncio.ensure_future(self._read(rank, workers[rank], comm))

    async def _subscribe(self, address: str, connection_args: dict) -> Comm:
        comm = await connect(address, **connection_args)
        comm.name = f"dask_monarch reports {self.token}"
        await comm.write({"op": "dask_monarch_reports", "token": self.token, "reply": False})
        return comm

    async def _read(self, rank: int, address: str, comm: Comm) -> None:
        try:
            while True:
                batch = await comm.read()
                self.on_reports(rank, batch)
        except (CommClosedError, OSError) as e:
            logger.debug("report stream of rank %d ended: %r", rank, e)
        except asyncio.CancelledError:  # the client's event loop is going away, not the worker
            with self.progress:
                self.fail(DeviceException(
                    "its Client was closed while the mesh was in use, so no report can arrive "
                    "(exit meshes before closing their Client)"))
            raise
        except Exception as e:  # a report we cannot read: the mesh cannot be trusted
            logger.exception("bad report from rank %d", rank)
            with self.progress:
                self.fail(DeviceException(f"unreadable report from its worker: {e!r}", rank=rank))
            return
        with self.progress:  # a no-op once the controller is closed
            self.fail(DeviceException(
                f"lost connection to its worker {address} "
                "(the worker died, restarted or was removed)", rank=rank))

    def hang_up(self) -> None:
        """Abort every report stream (the workers then free this controller's state)."""
        comms = list(self.comms.values())
        self.comms.clear()
        for comm in comms:
            comm.abort()

    # -- what they say ------------------------------------------------------------------------

    def on_reports(self, rank: int, batch: list) -> None:
        """Apply one batch of ``rank``'s reports, then hand its controller messages to listeners."""
        delivered = []
        with self.progress:
            for item in batch:
                t = type(item)
                if t is LaneDone:
                    key = (item.rank, item.lane)
                    if item.index > self.done.get(key, -1):
                        self.done[key] = item.index
                elif t is Fetched:
                    delivered.append(_fetch_result(item))
                elif t is Status or t is RemoteFunctionFailed:
                    delivered.append(item)
                elif t is RefValue:
                    if item.probe > 0:
                        self.replies[item.probe] = item
                elif t is Fatal:
                    self.fail(DeviceException(item.cause, rank=item.rank))
                elif t is Exited:
                    self.exited.add(item.rank)
                    if item.error is not None:
                        source, text = item.error
                        self.fail(DeviceException(
                            f"Exit with an error from {source or 'an unknown source'}: {text}",
                            rank=item.rank))
            self.inbox.extend(delivered)
            self.progress.notify_all()
        for msg in delivered:
            for listener in self.listeners:
                listener(msg)

    def expect(self, counts: dict[tuple[int, Any], int]) -> None:
        """A flush was submitted: ``counts`` gives each of its lanes' newest segment."""
        with self.progress:
            self.expected.update(counts)

    def ranks_idle(self) -> bool:
        """Every segment submitted so far has run (takes ``progress``; any thread)."""
        with self.progress:
            return self.caught_up()

    def caught_up(self) -> bool:
        """Every segment submitted so far has run (the caller holds ``progress``)."""
        done = self.done
        return all(done.get(lane, -1) >= index for lane, index in self.expected.items())

    def pending(self) -> str:
        """The lanes that have not run everything yet, for a timeout's message."""
        pending = [
            f"rank {rank} {'control steps' if lane == 'control' else f'stream {lane}'} "
            f"(ran {self.done.get((rank, lane), -1) + 1} of {index + 1} segments)"
            for (rank, lane), index in sorted(self.expected.items(), key=str)
            if self.done.get((rank, lane), -1) < index
        ]
        return ", ".join(pending)

    def segments(self) -> tuple[int, int]:
        """Segments submitted and segments finished (the caller holds ``progress``)."""
        expected = sum(index + 1 for index in self.expected.values())
        done = sum(min(self.done.get(lane, -1), index) + 1
                   for lane, index in self.expected.items())
        return expected, done

    def take_inbox(self) -> list:
        """The controller messages since the last call (the caller holds ``progress``)."""
        messages, self.inbox = self.inbox, []
        return messages


def _fetch_result(item: Fetched) -> FetchResult | RemoteFunctionFailed:
    try:
        return FetchResult(item.seq, item.rank, pickle.loads(item.payload))
    except Exception as e:
        return RemoteFunctionFailed(item.seq, item.rank,
                                    f"the fetched value cannot be unpickled on the client: {e!r}")
