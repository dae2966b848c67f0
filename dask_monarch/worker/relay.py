"""Relayed flushes: one Dask task per lane of a flush, fanned out over the ranks as a tree.

With ``dask_monarch.flush.relay: k`` (k > 0) the compiler does not make a
task per (rank, stream) of a flush: it makes one task per *wave*, the
segments that the flush gives one lane on every rank (docs/protocol.md,
"Relayed flushes"). The scheduler then places one task per wave whatever the
mesh's size, and each rank's segment travels the rest of the way worker to
worker:

* the wave's task runs on the event loop of its first rank's worker
  (:func:`run_relay`, a coroutine task) and hands the wave to
  :meth:`Relay.deliver`;
* ``deliver`` keeps its own rank's segment and splits the others into ``k``
  runs, sending each run to the worker of its first rank over an ordered
  stream between the two workers, which delivers it the same way: a tree of
  fan-out ``k``, ``log_k(N)`` deep;
* each rank's :class:`Inbox` puts its segments on their lanes' threads in
  index order, and a segment waits there for the segments of its own rank
  that it follows (what Dask's edges between segment tasks ensure otherwise;
  the compiler sends each segment's edges as ``(lane, index)`` of its own
  rank).

Every rank still reports each segment it ran to the controller, as before;
only the dispatch changes. A stream to a worker that cannot be opened or
written fails the rank that relays through it (a ``Fatal`` report names the
worker), so the controller fails its mesh instead of waiting for segments
that never arrive.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from typing import TYPE_CHECKING, Any

from distributed import get_worker
from distributed.comm import connect
from distributed.comm.core import CommClosedError

from ..protocol.names import RELAY_HANDLER, mesh_id
from ..protocol.wire import CONTROL

if TYPE_CHECKING:
    from distributed import Worker
    from distributed.comm import Comm

    from .plugin import MonarchWorkerPlugin
    from .rank import RankState

logger = logging.getLogger("dask_monarch.worker")

# A wave's entries: [rank, index, [blob indices], [[lane, index], ...], worker address]
RANK, INDEX, BLOBS, AFTER, ADDRESS = range(5)
WAIT_POLL_S = 0.05  # how often a segment waiting for its rank's earlier ones checks for abort


async def run_relay(token: str, wave: dict) -> int:
    """The task of one wave (on the event loop of its first rank's worker): deliver it."""
    plugin = get_worker().plugins.get("dask_monarch")
    if plugin is None:
        raise RuntimeError("dask_monarch's worker plugin is not installed on this worker")
    plugin.relay.deliver(wave)
    return len(wave["entries"])


def split(entries: list, fanout: int) -> list[list]:
    """``entries`` in at most ``fanout`` consecutive runs of nearly equal length."""
    if not entries:
        return []
    size = math.ceil(len(entries) / fanout)
    return [entries[i : i + size] for i in range(0, len(entries), size)]


def narrowed(wave: dict, run: list) -> dict:
    """``wave`` for the entries of ``run`` only, with only the pickles they use.

    A wave's pickles are mostly shared by every rank, but a few are one rank's
    own (a fetch's probe, a delete of one rank's refs): forwarded whole, each of
    N ranks would receive all N of them, N² pickles per flush."""
    blobs, kept, where, entries = wave["blobs"], [], {}, []
    for rank, index, ids, after, address in run:
        for i in ids:
            if i not in where:
                where[i] = len(kept)
                kept.append(blobs[i])
        entries.append((rank, index, [where[i] for i in ids], after, address))
    return {**wave, "blobs": kept, "entries": entries}


class Relay:
    """A worker's end of relayed waves: delivers its ranks' segments, forwards the rest."""

    def __init__(self, plugin: MonarchWorkerPlugin) -> None:
        self.plugin = plugin
        self.links: dict[str, _Link] = {}

    @property
    def worker(self) -> Worker:
        return self.plugin.worker

    def deliver(self, wave: dict) -> None:
        """Forward ``wave``'s other entries down the tree, then queue this rank's segment (on
        the event loop)."""
        own, *rest = wave["entries"]
        for run in split(rest, wave["fanout"]):
            self._link(run[0][ADDRESS]).send(narrowed(wave, run), wave["token"])
        token = wave["token"]
        state = self.plugin.ranks.get(token)
        if state is None or state.rank != own[RANK]:
            logger.debug("relayed segment for %s rank %s: no such rank here", token, own[RANK])
            return
        blobs = wave["blobs"]
        payload = tuple(blobs[i] for i in own[BLOBS])
        inbox = state.inbox
        if inbox is None:
            inbox = state.inbox = Inbox(state)
        inbox.put(wave["lane"], own[INDEX], payload, own[AFTER])

    def _link(self, address: str) -> _Link:
        link = self.links.get(address)
        if link is None or link.broken:
            link = self.links[address] = _Link(self, address)
        return link

    async def serve(self, comm: Comm) -> None:
        """Deliver the waves another worker relays to this one, until it hangs up."""
        try:
            while True:
                for wave in await comm.read():
                    self.deliver(wave)
        except (CommClosedError, OSError) as e:
            logger.debug("relay stream ended: %r", e)

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()

    def failed(self, address: str, tokens: set[str], error: BaseException) -> None:
        """A stream to ``address`` broke: the ranks here that relayed through it fail."""
        for token in tokens:
            state = self.plugin.ranks.get(token)
            if state is not None:
                state.fail(
                    f"rank {state.rank} of mesh {mesh_id(token)} could not relay segments to "
                    f"worker {address} ({type(error).__name__}: {error}); the ranks behind it "
                    "will not run them"
                )


class _Link:
    """An ordered stream of waves from this worker to another, opened on first use."""

    def __init__(self, relay: Relay, address: str) -> None:
        self.relay = relay
        self.address = address
        self.queue: list = []
        self.tokens: set[str] = set()  # controllers that relayed through it
        self.wake = asyncio.Event()
        self.broken = False
        self.task = asyncio.ensure_future(self._pump())

    def send(self, wave: dict, token: str) -> None:
        self.queue.append(wave)
        self.tokens.add(token)
        self.wake.set()

    async def _pump(self) -> None:
        comm = None
        try:
            worker = self.relay.worker
            comm = await connect(self.address, **worker.connection_args)
            comm.name = "dask_monarch relay"
            await comm.write({"op": RELAY_HANDLER, "reply": False})
            while True:
                await self.wake.wait()
                self.wake.clear()
                batch, self.queue = self.queue, []
                if batch:
                    await comm.write(batch)
        except asyncio.CancelledError:
            pass
        except Exception as e:
            self.broken = True
            logger.warning("dask_monarch: relay stream to %s broke: %r", self.address, e)
            self.relay.failed(self.address, self.tokens, e)
        finally:
            if comm is not None:
                comm.abort()

    def close(self) -> None:
        self.task.cancel()


class Inbox:
    """One rank's relayed segments: on their lanes' threads in index order, each after the
    segments of this rank it follows."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        self.waiting: dict[Any, dict[int, tuple]] = {}  # lane -> index -> (payload, after)
        self.next: dict[Any, int] = {}  # lane -> the index to hand its thread next
        self.done: dict[Any, int] = {}  # lane -> the newest index its thread finished
        self.ran = threading.Condition()

    def put(self, label: Any, index: int, payload: tuple, after: list) -> None:
        """Queue segment ``index`` of lane ``label`` (on the event loop)."""
        state = self.state
        lane = state.control if label == CONTROL else state.lanes.get(label)
        if lane is None:
            state.fail(f"rank {state.rank}: no lane for stream {label} (never created, or dropped)")
            return
        waiting = self.waiting.setdefault(label, {})
        waiting[index] = (payload, after)
        expected = self.next.setdefault(label, lane.next_index)
        try:
            while expected in waiting:
                payload, after = waiting.pop(expected)
                if not self._run_here(lane, label, expected, payload, after):
                    lane.executor.submit(self._run, label, expected, payload, after)
                expected += 1
        except RuntimeError:  # the lane's thread was retired: the rank was released
            if not (state.released or state.failed):
                raise
        self.next[label] = expected

    def _run_here(self, lane: Any, label: Any, index: int, payload: tuple, after: list) -> bool:
        """Run a quick segment on the event loop, as worker/inline.py does for a segment task,
        when nothing of its lane is left to run before it and what it follows ran."""
        state = self.state
        if not state.plugin.inline or state.torch_device is not None or state.abort.is_set():
            return False
        if self.done.get(label, -1) != index - 1 or not self._followed(after):
            return False
        from .inline import is_quick, small_steps  # import torch, as every rank has
        from .lane import _current

        steps = small_steps(payload)
        if steps is None or not is_quick(steps, lane.env):
            return False
        try:
            self._segment(label, index, (), steps)
        finally:
            _current.lane = None  # the loop is no lane's thread
        lane.inlined += 1
        return True

    def _run(self, label: Any, index: int, payload: tuple, after: list) -> None:
        """Run one segment on its lane's thread, once the ones it follows ran."""
        if after and not self._wait(after):
            with self.ran:  # the rank failed or was released: nothing more runs
                self.done[label] = index
                self.ran.notify_all()
            return
        self._segment(label, index, payload)

    def _segment(self, label: Any, index: int, payload: tuple, steps: list | None = None) -> None:
        """Run one segment (a failure is reported by run_segment: no Dask task carries it),
        then mark it done for the segments that follow it."""
        state = self.state
        try:
            state.run_segment(label, index, payload, steps)
        except Exception as e:
            logger.debug("relayed segment %s/%s of rank %d: %r", label, index, state.rank, e)
        finally:
            with self.ran:
                self.done[label] = index
                self.ran.notify_all()

    def _followed(self, after: list) -> bool:
        """Whether every segment in ``after`` (``(lane, index)`` of this rank) ran."""
        done = self.done
        return all(done.get(lane, -1) >= index for lane, index in after)

    def _wait(self, after: list) -> bool:
        """Wait until ``after`` ran; False if the rank failed or was released first."""
        abort = self.state.abort

        def ready() -> bool:
            return abort.is_set() or self._followed(after)

        with self.ran:
            while not self.ran.wait_for(ready, WAIT_POLL_S):
                pass
        return not abort.is_set()
