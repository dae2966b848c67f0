"""Pipes: a producer per rank feeding a stream through a bounded buffer.

Semantics: docs/protocol.md §3.20, §3.21.

Monarch dropped pipes; they are how data loaders feed a mesh, so they are
here. ``CreatePipe`` starts ``function(pipe, *args, **kwargs)`` on every rank
of the mesh; the producer sees ``pipe.ranks`` (its coordinates) and
``pipe.sizes``, sends values with ``pipe.send(x)`` (blocking once
``max_messages`` are waiting: back-pressure) and reads what the controller
sends it with ``pipe.recv()``. ``PipeRecv`` binds the next value on a stream
like a call's results; a producer that raised or died becomes a user error
reported for that ``PipeRecv``.

The producer runs in a process of its own (spawned, so a loader doing real
CPU work does not hold the worker's GIL; ``LocalMeshCluster`` makes workers
non-daemonic for this). On a daemonic worker, which may not have children,
it runs in a thread instead, with a warning.

On a CUDA rank the producer works on the rank's GPU: a producer process sets
it as its device and works on its default stream (torch's CUDA IPC records an
event there for every tensor it sends, which the receiving lane's stream waits
on); it stays alive until the pipe is closed, since the worker's lanes use its
memory until then. A producer thread enters the rank's device and a stream of
its own (``Device.thread``), and every value between it and a lane is a
hand-off: an event recorded by the side that made it, waited on by the other,
which keeps the block (docs/architecture.md, "Streams and hand-offs"). A value
a lane sends into a producer process waits for the lane's stream first: the
producer reads it on its own default stream. Values between a process and
the worker are pickled by the side that sends them (:class:`_Pickled`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import threading
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any

import torch
import torch.multiprocessing as tmp
from torch.utils._pytree import tree_map_only

from ..protocol.messages import CreatePipe, PipeRecv, Ref
from ..protocol.names import describe_output, rank_function
from . import calls
from .device import current_stream, enter_thread_modes
from .errors import FatalError, format_exception
from .failures import fail_call
from .lane import Lane, current_lane

if TYPE_CHECKING:
    from multiprocessing.queues import Queue as ProcessQueue

    from .device import Device
    from .rank import RankState

logger = logging.getLogger("dask_monarch.worker.pipe")
POLL_S = 0.05


class _Ended:
    pass


class _Failed:
    def __init__(self, text: str):
        self.text = text


class _Close:
    """The worker read the producer's last value: the producer may exit."""


class PipeClosed(BaseException):
    """Raised in a producer thread's ``send`` or ``recv`` once its pipe was closed (the
    controller left): the thread cannot be terminated, so its next use of the pipe ends it.
    A BaseException, as ``GeneratorExit``: a loader's ``except Exception`` does not keep it
    going."""


class _Pickled:
    """A value pickled by the side that sends it into a process's queue, then put as bytes.

    The queue itself pickles later, on its feeder thread, and drops a value it
    cannot pickle with only a traceback on that process's stderr: the other
    side would silently get the next value in its place (a loader's batch
    holding a lock, a file). Pickled here, such a value fails the send
    instead, as the producer's error or the ``SendValue``'s. One pickling, as
    before: the queue's own of the bytes is a copy.
    """

    __slots__ = ("data",)

    def __init__(self, value: Any):
        self.data = bytes(ForkingPickler.dumps(value))

    def load(self) -> Any:
        return ForkingPickler.loads(self.data)


class _HandOff:
    """A value a producer thread made, with the event its stream recorded after making it.

    (A producer process's tensors come through torch's IPC, which synchronises
    them on the receiving thread's current stream: the lane's.)
    """

    __slots__ = ("value", "event")

    def __init__(self, value: Any, event: Any):
        self.value, self.event = value, event


class PipeEnd:
    """What the producer function gets: its coordinates, and the two directions of the pipe."""

    def __init__(
        self,
        ranks: dict[str, int],
        sizes: dict[str, int],
        out_queue: queue.Queue | ProcessQueue,
        in_queue: queue.Queue | ProcessQueue,
        device: Device | None = None,
        closed: threading.Event | None = None,
    ):
        self.ranks = ranks
        self.sizes = sizes
        self._out = out_queue
        self._in = in_queue
        self._device = device  # a producer thread shares the rank's device: values are hand-offs
        self._closed = closed  # a producer thread's: set when the worker closed the pipe

    def send(self, value: Any) -> None:
        """Hand a value to the stream; blocks while ``max_messages`` values wait."""
        if self._device is not None:
            value = _HandOff(value, self._device.record_current())
        else:  # a process: one that cannot be pickled is this send's error (see _Pickled)
            value = _Pickled(value)
        self._put(value)

    def recv(self) -> Any:
        """The next value the controller sent into the pipe."""
        value = self._get()
        if type(value) is _Pickled:
            return value.load()
        if type(value) is _HandOff:  # made on a lane's stream: this thread's waits for it
            device, stream = self._device, current_stream()
            device.wait(stream, value.event)
            device.keep(value.value, stream)
            value = value.value
        return value

    def _put(self, value: Any) -> None:
        """``put`` on the queue to the stream; a producer thread's gives up when closed."""
        closed = self._closed
        if closed is None:  # a process: terminated on close
            self._out.put(value)
            return
        while not closed.is_set():
            try:
                self._out.put(value, timeout=POLL_S)
                return
            except queue.Full:
                pass
        raise PipeClosed("the pipe was closed")

    def _get(self) -> Any:
        """``get`` from the queue from the controller; a producer thread's gives up when
        closed."""
        closed = self._closed
        if closed is None:
            return self._in.get()
        while not closed.is_set():
            try:
                return self._in.get(timeout=POLL_S)
            except queue.Empty:
                pass
        raise PipeClosed("the pipe was closed")


def _produce(
    function, args, kwargs, ranks, sizes, out_queue, in_queue, device=None, gpu=None, closed=None
) -> None:
    """Run a producer to its end; its failure travels down the pipe as a value.

    The producer then waits for the worker to say it may end (:class:`_Close`):
    tensors cross the queue as shared memory whose descriptors the worker
    fetches from this process, and CUDA ones as this process's memory, which
    the worker's lanes may use until the pipe closes. ``device`` is the rank's
    (a producer thread); ``gpu`` its index (a producer process); ``closed`` a producer
    thread's: set when the pipe closes, it ends the thread at its next use of the pipe
    (:class:`PipeClosed`), which a process's termination does for a process.
    """
    end = PipeEnd(ranks, sizes, out_queue, in_queue, device, closed)
    try:
        with device.thread("pipe producer") if device is not None else _in_process(gpu):
            try:
                fn = calls.resolve_function(function)
                fn(end, *args, **kwargs)
                last: _Ended | _Failed = _Ended()
            except PipeClosed:
                raise
            except BaseException as e:  # noqa: B036 - a producer's failure is a value for PipeRecv
                last = _Failed(format_exception(e))
            end._put(last)
        while not isinstance(end._get(), _Close):
            pass
    except PipeClosed:  # the pipe was closed before the producer ended: nothing reads it
        pass


@contextlib.contextmanager
def _in_process(gpu: int | None) -> Iterator[None]:
    """A producer process: on the rank's GPU (its default stream, see the module docs), in the
    dispatch modes every thread that touches the device enters."""
    if gpu is not None:
        import torch

        torch.cuda.set_device(gpu)
    enter_thread_modes()
    yield


class Pipe:
    """The worker side of one pipe: the producer and its two queues."""

    def __init__(
        self,
        state: RankState,
        msg: CreatePipe,
        args: tuple,
        kwargs: dict,
        ranks: dict[str, int],
        sizes: dict[str, int],
    ):
        self.state = state
        self.ref = msg.result.id
        self.key = msg.key
        self.ended: str | None = None
        self.held: list = []  # a value read ahead by peek(), handed to the next recv
        in_thread = multiprocessing.current_process().daemon
        if in_thread:
            logger.warning(
                "pipe %r runs its producer in a thread: this Dask worker is "
                "daemonic and may not start processes "
                "(distributed.worker.daemon: false allows it)",
                msg.key,
            )
            make_queue, producer_type = queue.Queue, threading.Thread
        else:
            ctx = tmp.get_context("spawn")
            make_queue, producer_type = ctx.Queue, ctx.Process
        self.out_queue, self.in_queue = make_queue(msg.max_messages), make_queue()
        self.closed = threading.Event() if in_thread else None  # see PipeClosed
        producer = producer_type(
            target=_produce,
            daemon=True,
            name=f"monarch-pipe-{msg.key}",
            args=(
                msg.function,
                args,
                kwargs,
                ranks,
                sizes,
                self.out_queue,
                self.in_queue,
                state.device if in_thread else None,
                None if state.torch_device is None else state.torch_device.index,
                self.closed,
            ),
        )
        producer.start()
        self.process = None if in_thread else producer  # a thread cannot be terminated
        self.in_thread = in_thread

    def recv(self, lane: Lane) -> Any:
        """The next value (blocks the lane); raises PipeFailed when the producer cannot give one."""
        if self.held:
            return self.held.pop()
        if self.ended is not None:
            raise PipeFailed(self.ended)
        lane.set_waiting(
            f"pipe {self.key!r} (its producer on this rank has not sent a value)",
            seq=lane.last_seq if lane.last_seq >= 0 else None,
        )
        try:
            while True:
                try:
                    value = self.out_queue.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    if self.state.abort.is_set():
                        raise FatalError(
                            f"stopped waiting for pipe {self.key!r}: "
                            f"{self.state.failed or 'released'}"
                        ) from None
                    if self.process is not None and not self.process.is_alive():
                        self.ended = (
                            f"the producer of pipe {self.key!r} died with exit code "
                            f"{self.process.exitcode}"
                        )
                        raise PipeFailed(self.ended) from None
        finally:
            lane.set_running()
        if isinstance(value, (_Failed, _Ended)):
            if self.state.torch_device is None:  # its CUDA memory is in use until the close
                self.in_queue.put(_Close())
            self.ended = (
                f"the producer of pipe {self.key!r} failed:\n{value.text}"
                if isinstance(value, _Failed)
                else f"the producer of pipe {self.key!r} has finished"
            )
            raise PipeFailed(self.ended)
        if type(value) is _Pickled:
            return value.load()
        if type(value) is _HandOff:
            device = self.state.device
            device.wait(lane.stream, value.event)
            device.keep(value.value, lane.stream)
            value = value.value
        return value

    def send(self, value: Any, lane: Lane) -> None:
        """A value ``lane`` made goes to the producer (a hand-off between their streams), as it
        is now: its tensors are copied on the lane's stream first. Pickling for a process
        producer moves a CPU tensor's storage to shared memory in place, and a thread producer
        would hold the lane's own tensor: the lane's next steps (an in-place op) would reach
        either. A value that cannot be pickled fails here (:class:`_Pickled`)."""
        value = tree_map_only(torch.Tensor, _copy, value)
        device = self.state.device
        if self.in_thread:
            value = _HandOff(value, device.record(lane.stream))
        else:
            if self.state.torch_device is not None:
                device.synchronize(lane.stream)  # the producer's stream is not the lane's
            value = _Pickled(value)
        self.in_queue.put(value)

    def close(self) -> None:
        """Stop the producer (on release): a process is terminated, a thread ends at its next
        use of the pipe (it cannot be stopped in the middle of the user's code)."""
        if self.closed is not None:
            self.closed.set()
        finished = self.ended is not None and self.state.torch_device is not None
        if finished and self.process is not None and self.process.is_alive():
            self.in_queue.put(_Close())  # it waits to be told it may end (CUDA: see recv)
            self.process.join(timeout=1)
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        for q in (self.out_queue, self.in_queue):
            if hasattr(q, "cancel_join_thread"):
                q.cancel_join_thread()
                q.close()


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` the lane will not touch (a leaf, as ``t`` asks for gradients or not)."""
    return t.detach().clone().requires_grad_(t.requires_grad)


class PipeFailed(Exception):
    """The producer raised, ended or died: a user error for the receiving seq."""


@rank_function
def peek(pipe: Pipe) -> tuple:
    """Read the next value ahead (kept for the next PipeRecv); return what its leaves look like.

    The client calls it through a fetch the first time it receives from a
    pipe without a ``propagate``: it learns the structure of the values.
    """
    from torch.utils._pytree import tree_flatten, treespec_dumps

    value = pipe.recv(current_lane())
    pipe.held.append(value)
    leaves, spec = tree_flatten(value)
    packed = [describe_output(x, keep_value=False) for x in leaves]
    return packed, treespec_dumps(spec)


def pipe_for(lane: Lane, ref: Ref) -> Pipe:
    pipe = lane.rank.pipes.get(ref.id)
    if pipe is None:
        raise FatalError(f"r{ref.id} is not a pipe on rank {lane.rank.rank}")
    return pipe


def create_pipe(lane: Lane, msg: CreatePipe) -> None:
    """Start this rank's producer (control lane); fatal if the mesh or the id is wrong."""
    state = lane.rank
    mesh = state.meshes.get(msg.mesh.id)
    if mesh is None:
        raise FatalError(f"CreatePipe r{msg.result.id}: unknown device mesh r{msg.mesh.id}")
    if msg.result.id in state.pipes:
        raise FatalError(f"CreatePipe: r{msg.result.id} already exists")
    args, kwargs = msg.args_kwargs.to_python()
    if any(type(a) is Ref for a in (*args, *kwargs.values())):
        raise FatalError(f"CreatePipe r{msg.result.id}: producer arguments cannot be refs")
    ranks = {name: d.rank for name, d in mesh.dims.items()}
    sizes = {name: d.size for name, d in mesh.dims.items()}
    pipe = state.pipes[msg.result.id] = Pipe(state, msg, args, kwargs, ranks, sizes)
    state.on_release(pipe.close)


def pipe_recv(lane: Lane, msg: PipeRecv) -> None:
    """Bind the producer's next value like a call's results; blocks until there is one."""
    lane.last_seq = msg.seq
    pipe = pipe_for(lane, msg.pipe)
    try:
        value = pipe.recv(lane)
        calls.bind_results(lane.env, msg.results, value)
    except FatalError:
        raise
    except BaseException as e:  # user code cannot kill a rank (SystemExit...)
        fail_call(lane, msg.seq, msg.results, (), e)
