"""What a lane asks of its device: a stream to run in, events at hand-offs, blocks kept alive.

The stream discipline of docs/architecture.md ("Streams and hand-offs") in one
interface with two implementations:

* :class:`CudaDevice`: the lane's ``torch.cuda.Stream`` (made when the lane is
  made, before any segment), ``torch.cuda.Event`` at every hand-off between
  lanes, and ``Tensor.record_stream`` so the caching allocator does not hand a
  block to new work while the consumer's stream may still read it.
* :class:`HostDevice`: CPU ranks have no streams, so it does nothing but
  remember what it was asked (which stream each segment entered, each event
  recorded and waited on, each block kept). Tests read that log and fail if a
  step ran outside its lane's stream or a hand-off lacks its record/wait pair:
  the discipline is checked on machines without a GPU.

Every lane thread enters its stream with :meth:`Device.running` around a
segment; :func:`current_stream` says which stream the calling thread is in
(remote functions can ask, as they would ask ``torch.cuda.current_stream()``).
Threads outside the lanes that run user code on the rank (a pipe's producer
thread, an actor's constructor) enter the rank's device and a stream of their
own with :meth:`Device.running` too.

The CUDA device and the current stream are per thread, and so are torch's
dispatch modes: every thread that touches the device also enters the modes of
:func:`thread_modes` (torch's CUDA stream sanitizer under
``TORCH_CUDA_SANITIZER=1``; ``dask_monarch.worker.dispatch-mode``), or the
sanitizer would watch only the thread that imported torch.

What the worker makes itself (zeros for a failed input, receive buffers) is
made on the rank's device by :meth:`Device.zeros` and :meth:`Device.empty`,
whatever device the client's ``Factory`` names: the client's handle may say
``cuda:0`` for a rank whose GPU is ``cuda:3``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fcntl
import importlib
import itertools
import logging
import os
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import config
from ..protocol.messages import Factory, StreamCreationMode

logger = logging.getLogger("dask_monarch.worker")

DRAIN_POLL_S = 0.001  # how often a draining lane asks its stream whether it is done
LOG_LENGTH = 4096  # entries a HostDevice remembers: enough for a test, bounded for a long run

_entered = threading.local()


def current_stream() -> Any:
    """The device stream this thread's lane is running in (None outside a segment)."""
    return getattr(_entered, "stream", None)


# -- dispatch modes every device thread enters -----------------------------------------------

_modes: list | None = None
_modes_lock = threading.Lock()


def thread_modes() -> list:
    """The torch dispatch modes every thread that touches the device enters (made once).

    torch enters its CUDA stream sanitizer (``TORCH_CUDA_SANITIZER=1``) as a
    dispatch mode, which is thread-local, in the thread that imports torch
    only: a lane's ops run on the lane's thread, which it would never see.
    The same mode object is entered on every lane, pipe-producer and
    actor-constructor thread instead (one sanitizer state for the process, as
    torch keeps it). ``dask_monarch.worker.dispatch-mode`` names another mode
    class (``module.Class``, read on the worker) entered the same way: a
    debugging aid (and how the CPU tests prove the switch reaches the lanes).
    """
    global _modes
    if _modes is None:
        with _modes_lock:
            if _modes is None:
                _modes = _make_modes()
    return _modes


def _make_modes() -> list:
    modes = []
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        from torch.cuda import _sanitizer

        # torch entered it in the thread that imported torch (enable_cuda_sanitizer); the
        # same object here, whose state (what each stream accessed) is the process's
        modes.append(_sanitizer.cuda_sanitizer.dispatch)
    path = config.get("worker.dispatch-mode")
    if path:
        module, _, name = str(path).rpartition(".")
        try:
            modes.append(getattr(importlib.import_module(module), name)())
        except Exception as e:
            raise ValueError(
                f"dask_monarch.worker.dispatch-mode is {path!r}, which is not an importable "
                f"TorchDispatchMode class (module.Class): {type(e).__name__}: {e}"
            ) from e
    return modes


def enter_thread_modes() -> None:
    """Enter :func:`thread_modes` on the calling thread, once for the thread's life.

    Never left: a lane's thread lives as long as its lane, and leaving a mode
    that other threads entered too would restore another thread's flags. Never
    entered on an event loop (a CPU rank's quick segment, worker/inline.py):
    nothing user-written runs there (DESIGN decision 17), and CUDA ranks never
    run segments there.
    """
    if getattr(_entered, "modes", False) or asyncio._get_running_loop() is not None:
        return
    _entered.modes = True
    for mode in thread_modes():
        mode.__enter__()


class HostStream:
    """A CPU lane's stream: a name, so that logs and errors say which lane it is."""

    __slots__ = ("name", "default")

    def __init__(self, name: str, default: bool):
        self.name = name
        self.default = default

    def __repr__(self) -> str:
        return f"HostStream({self.name!r})"


class Device(abc.ABC):
    """The operations a lane needs from its device (see the module docstring)."""

    kind = "cpu"
    torch_device: torch.device | None = None

    @abc.abstractmethod
    def stream(self, name: str, mode: StreamCreationMode) -> Any:
        """The stream of a new lane: the device's default one or a fresh one."""

    @abc.abstractmethod
    @contextlib.contextmanager
    def running(self, stream: Any) -> Iterator[None]:
        """Run the body (a segment's steps) inside ``stream``, on the calling thread."""
        yield  # pragma: no cover

    @abc.abstractmethod
    def switch(self, stream: Any) -> None:
        """Move the running segment's thread to ``stream`` (a stream re-created mid-segment)."""

    @abc.abstractmethod
    def record(self, stream: Any) -> Any:
        """An event marking the work ``stream`` was given so far (producer side of a hand-off)."""

    @abc.abstractmethod
    def record_current(self) -> Any:
        """An event on the calling thread's current stream (a pipe's producer thread)."""

    @abc.abstractmethod
    def wait(self, stream: Any, event: Any) -> None:
        """Make later work on ``stream`` wait for ``event`` (consumer side of a hand-off)."""

    @abc.abstractmethod
    def keep(self, value: Any, stream: Any) -> None:
        """``stream`` uses ``value``'s memory: keep the allocator from reusing it early."""

    @abc.abstractmethod
    def synchronize(self, stream: Any) -> None:
        """Block the calling thread until ``stream``'s work is done (a hand-off out of a
        thread that will not say when it is done with the memory, e.g. an actor's constructor)."""

    @abc.abstractmethod
    def drain(self, stream: Any, give_up: Callable[[], bool], timeout: float) -> None:
        """Wait until ``stream``'s work is done, polling from the host: at most ``timeout``
        seconds, and not once ``give_up()`` (the rank aborts)."""

    # -- what the worker makes ----------------------------------------------------------------

    def where(self, factory: Factory) -> torch.device:
        """Where the worker makes a tensor the client declared with ``factory``: a CUDA
        factory means this rank's GPU (any index the client's handle carries is the
        client's view, not the rank's); a CPU rank has no GPU, its tensors are on the CPU."""
        declared = torch.device(factory.device)
        if declared.type == "cuda":
            return self.torch_device if self.torch_device is not None else torch.device("cpu")
        return declared

    def zeros(self, factory: Factory) -> torch.Tensor:
        """Zeros as declared (a failed input's part in a collective), on this rank's device."""
        return torch.zeros(
            factory.size, dtype=factory.dtype, layout=factory.layout, device=self.where(factory)
        )

    def empty(self, factory: Factory) -> torch.Tensor:
        """An uninitialised tensor as declared (a receive buffer), on this rank's device."""
        return torch.empty(
            factory.size, dtype=factory.dtype, layout=factory.layout, device=self.where(factory)
        )

    @contextlib.contextmanager
    def thread(self, name: str) -> Iterator[Any]:
        """Run the body on a thread outside the lanes (a pipe's producer, an actor's
        constructor) in this rank's device and a stream of its own; yields the stream.

        Its work is synchronised before the body's values leave the thread
        only where the caller says so (:meth:`synchronize`); a pipe producer's
        values travel with an event instead (``PipeEnd.send``).
        """
        stream = self.stream(name, StreamCreationMode.CreateNewStream)
        with self.running(stream):
            yield stream


class HostDevice(Device):
    """CPU ranks: nothing to synchronise; remembers what it was asked, for tests."""

    def __init__(self) -> None:
        self.log: deque[tuple] = deque(maxlen=LOG_LENGTH)
        self._events = itertools.count()

    def stream(self, name: str, mode: StreamCreationMode) -> HostStream:
        stream = HostStream(name, mode is StreamCreationMode.UseDefaultStream)
        self.log.append(("stream", name))
        return stream

    @contextlib.contextmanager
    def running(self, stream: HostStream) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        enter_thread_modes()
        previous, _entered.stream = current_stream(), stream
        try:
            yield
        finally:
            _entered.stream = previous

    def switch(self, stream: HostStream) -> None:
        self.log.append(("enter", stream.name))
        _entered.stream = stream

    def record(self, stream: HostStream) -> int:
        event = next(self._events)
        self.log.append(("record", stream.name, event))
        return event

    def record_current(self) -> int:
        current = current_stream()
        return self.record(current if current is not None else HostStream("thread", True))

    def wait(self, stream: HostStream, event: int) -> None:
        self.log.append(("wait", stream.name, event))

    def keep(self, value: Any, stream: HostStream) -> None:
        if _tensors(value):
            self.log.append(("keep", stream.name))

    def synchronize(self, stream: HostStream) -> None:
        self.log.append(("synchronize", stream.name))

    def drain(self, stream: HostStream, give_up: Callable[[], bool], timeout: float) -> None:
        self.log.append(("drain", stream.name))


class CudaDevice(Device):
    """A GPU rank: CUDA streams, events and ``record_stream`` on one device."""

    kind = "cuda"

    def __init__(self, device: torch.device):
        self.torch_device = device

    def stream(self, name: str, mode: StreamCreationMode) -> torch.cuda.Stream:
        if mode is StreamCreationMode.UseDefaultStream:
            return torch.cuda.default_stream(self.torch_device)
        return torch.cuda.Stream(device=self.torch_device)

    @contextlib.contextmanager
    def running(self, stream: torch.cuda.Stream) -> Iterator[None]:
        torch.cuda.set_device(self.torch_device)  # per thread, like the current stream
        enter_thread_modes()
        previous, _entered.stream = current_stream(), stream
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            _entered.stream = previous

    def switch(self, stream: torch.cuda.Stream) -> None:
        torch.cuda.set_stream(stream)  # the running() block restores the thread's stream after
        _entered.stream = stream

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def record_current(self) -> torch.cuda.Event:
        return self.record(torch.cuda.current_stream(self.torch_device))

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def keep(self, value: Any, stream: torch.cuda.Stream) -> None:
        for tensor in _tensors(value):
            if tensor.is_cuda:
                tensor.record_stream(stream)

    def synchronize(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()

    def drain(self, stream: torch.cuda.Stream, give_up: Callable[[], bool], timeout: float) -> None:
        event = self.record(stream)
        deadline = time.monotonic() + timeout
        while not event.query():  # not event.synchronize(): a peer that never comes holds it
            if give_up() or time.monotonic() > deadline:
                return
            time.sleep(DRAIN_POLL_S)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a handed-off value (a tensor, or a pytree of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple, dict)):
        from torch.utils._pytree import tree_leaves

        return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]
    return []


def device_for(torch_device: torch.device | None) -> Device:
    """The device implementation of a rank (``None``: a CPU rank)."""
    return HostDevice() if torch_device is None else CudaDevice(torch_device)


# -- which GPU a rank uses ---------------------------------------------------------------------

_claimed: list[torch.device] = []  # this process's GPU, once it claimed one
_claim_lock = threading.Lock()  # claims run on threads (asyncio.to_thread), maybe two at once
_locks: list = []  # open lock files: held for the life of the worker process


def pick_device(kind: str) -> torch.device | None:
    """This worker process's GPU (None: a CPU rank), chosen once and deliberately.

    One GPU per worker process, whatever ``kind`` asked for it (``auto`` or
    ``cuda``) and however many controllers claim ranks here at once: every CUDA
    rank of the process uses it (a second one would break the one-GPU-per-rank
    rule NCCL needs, and the host-wide lock files would run out).

    The first visible device that no other dask_monarch worker on this host
    holds: with ``CUDA_VISIBLE_DEVICES`` rotated per worker (LocalMeshCluster,
    ``dask monarch worker``) or narrowed by ``--monarch-gpu``/``MONARCH_GPU``,
    that is device 0, the worker's own GPU; with plain ``dask worker``
    processes that all see every GPU, each takes the next free one instead of
    all landing on GPU 0. A host with more ranks than GPUs shares them, with a
    warning; a controller refuses such ranks for an NCCL mesh.
    """
    if kind == "cpu" or not torch.cuda.is_available():
        return None
    with _claim_lock:
        if not _claimed:
            _claimed.append(_claim_free_gpu())
        return _claimed[0]


def _claim_free_gpu() -> torch.device:
    count = torch.cuda.device_count()
    for index in range(count):
        path = os.path.join(tempfile.gettempdir(), f"dask_monarch-gpu-{gpu_uuid(index)}.lock")
        lock = open(path, "a")  # held open (and locked) for the life of the process
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        _locks.append(lock)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    logger.warning(
        "every visible GPU (%d) is taken by another dask_monarch worker on this "
        "host; this rank shares GPU 0 (give each worker its own GPU: dask monarch "
        "worker, or --monarch-gpu)",
        count,
    )
    return torch.device("cuda", 0)


def gpu_uuid(index: int) -> str:
    """A name of GPU ``index`` that is the same in every process of the host."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid:
        return str(uuid)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    physical = visible[index].strip() if index < len(visible) and visible[index].strip() else index
    return f"{socket.gethostname()}-{physical}"
