"""Importable functions the workers call by path in tests."""

import os
import threading
import time
import weakref

import torch


def pair(x):
    return x + 1, x * 2


def nothing(x):
    return None


def number(x):
    return int(x.numel()) * 10


def as_dict(x):
    return {"a": x + 1, "b": [x - 1, None]}


def boom(x):
    raise RuntimeError("boom from a remote function")


def positive(x):
    """``x``, or an error where it holds a negative number (a failure that depends on values)."""
    if bool((x < 0).any()):
        raise ValueError("a negative input")
    return x


def touch(path, *after):
    """Append a line to ``path`` each time it runs (counts executions)."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    return torch.zeros(1)


def sleep_then(seconds, path=None):
    if path:
        touch(path)
    time.sleep(seconds)
    return torch.ones(1)


class WithRemoteImpl:
    """Resolution uses ``_remote_impl`` when an object has one (docs/protocol.md §1.4)."""

    @staticmethod
    def _remote_impl(x):
        return x * 100


remote_impl_holder = WithRemoteImpl()


def mix_(x, i):
    """An order-sensitive in-place step: x = (3x + i) mod 1_000_003."""
    x.mul_(3).add_(i).remainder_(1_000_003)


_barriers: dict = {}
_barrier_lock = __import__("threading").Lock()


def barrier_wait(name, parties=2, timeout=20.0):
    """Wait on a process-wide barrier: it completes only if ``parties`` lanes run at once."""
    import threading

    with _barrier_lock:
        barrier = _barriers.setdefault(name, threading.Barrier(parties))
    barrier.wait(timeout)
    return torch.ones(1)


def thread_name(*after):
    import threading

    return threading.current_thread().name


def slow_copy(x, seconds):
    time.sleep(seconds)
    return x.clone()


def per_rank(mesh, *shape, dtype=torch.float32, device=None):
    """A tensor that differs on every rank: arange + 10 * (rank + 1)."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, device=device) + 10 * (mesh.own_rank + 1)).to(dtype).reshape(shape)


def pg_collectives(x, pg, mesh):
    """Use a real torch ProcessGroup from a user function."""
    import torch.distributed as dist

    total = x.clone()
    dist.all_reduce(total, group=pg)
    gathered = [torch.empty_like(x) for _ in range(pg.size())]
    dist.all_gather(gathered, x, group=pg)
    first = x.clone()
    ranks = sorted(dist.get_process_group_ranks(pg))
    dist.broadcast(first, ranks[0], group=pg)
    dist.barrier(group=pg)
    me = mesh.own_rank
    peer = ranks[1] if me == ranks[0] else ranks[0]
    received = torch.empty_like(x)
    if me == ranks[0]:
        dist.send(x, peer, group=pg)
        dist.recv(received, peer, group=pg)
    else:
        dist.recv(received, peer, group=pg)
        dist.send(x, peer, group=pg)
    return total, torch.stack(gathered), first, received, pg.rank(), pg.size()


def pg_tensor_collectives(x, pg):
    """The flat-tensor collectives (what FSDP calls) on a user's ProcessGroup: an all-gather
    into one tensor, a reduce-scatter of one, an all-to-all of one, and two all-gathers
    coalesced."""
    import torch.distributed as dist

    size = pg.size()
    gathered = torch.empty(size * x.numel())
    dist.all_gather_into_tensor(gathered, x, group=pg)
    scattered = torch.empty(x.numel() // size)
    dist.reduce_scatter_tensor(scattered, x, group=pg)
    exchanged = torch.empty_like(x)
    dist.all_to_all_single(exchanged, x, group=pg)
    both = [torch.empty(size * x.numel()), torch.empty(size * x.numel())]
    with dist._coalescing_manager(group=pg, async_ops=True) as coalesced:
        dist.all_gather_into_tensor(both[0], x, group=pg)
        dist.all_gather_into_tensor(both[1], x * 10, group=pg)
    coalesced.wait()
    return gathered, scattered, exchanged, torch.stack(both)


def loader(pipe, batches, path=None):
    """A data loader: batch i is full of (i + 100 * coordinate on the mesh's first dim)."""
    offset = 100 * next(iter(pipe.ranks.values()))
    for i in range(batches):
        if path:
            with open(path, "a") as f:
                f.write(f"{i}\n")
        pipe.send((torch.full((2,), float(i + offset)), i))


def crashing_loader(pipe):
    pipe.send(torch.zeros(1))
    raise ValueError("the loader ran out of luck")


def unpicklable_loader(pipe):
    """Its second batch holds a lock, which cannot cross a process's queue."""
    pipe.send(torch.zeros(1))
    pipe.send((torch.ones(1), threading.Lock()))
    pipe.send(torch.full((1,), 2.0))


def echo_loader(pipe):
    while True:
        x = pipe.recv()
        first = next(iter(pipe.ranks))  # the mesh's first dim
        pipe.send((x * 2, pipe.ranks[first], pipe.sizes[first]))


def late_echo(pipe):
    """Sends back each value it receives half a second later, unchanged."""
    while True:
        x = pipe.recv()
        time.sleep(0.5)
        pipe.send(x.clone())


class Visits:
    """An actor that notes how many calls of its method were running at once, at most."""

    def __init__(self):
        self.inside = 0
        self.most = 0

    def visit(self, seconds):
        self.inside += 1
        self.most = max(self.most, self.inside)
        time.sleep(seconds)
        self.inside -= 1
        return self.most


class Accumulator:
    """An actor that sums what it is given, in the order calls arrive."""

    def __init__(self, start=0.0):
        self.total = torch.tensor(start)
        self.calls = []

    def add(self, t, label=""):
        self.total = self.total + t.sum()
        self.calls.append(label)
        return self.total.clone()

    def history(self):
        return list(self.calls)

    def scale_(self, t, factor):
        t.mul_(factor)
        return t

    def fail(self, t):
        raise KeyError("the actor refused")

    def __call__(self, *tensors):
        return sum(float(t.sum()) for t in tensors)


def tensors_held(*after):
    """How many tensors the calling lane's ref table holds right now."""
    from dask_monarch.worker.lane import current_lane

    return torch.tensor(sum(isinstance(v, torch.Tensor) for v in current_lane().env.values()))


def current_stream_name():
    """The device stream the calling lane runs in (worker/device.py), by name."""
    from dask_monarch.worker.device import current_stream

    stream = current_stream()
    return None if stream is None else stream.name


def device_log():
    """What this rank's device was asked to do so far (a CPU rank's HostDevice log)."""
    from dask_monarch.worker.lane import current_lane

    return list(current_lane().rank.device.log)


def gpu_uuid():
    """The GPU this rank's stream runs on, as a host-wide name."""
    from dask_monarch.worker.device import gpu_uuid as uuid

    return uuid(torch.cuda.current_device())


def current_cuda_stream_is_default():
    return torch.cuda.current_stream() == torch.cuda.default_stream()


def cuda_allocated():
    torch.cuda.synchronize()
    return torch.tensor(torch.cuda.memory_allocated())


def returns_on_release(x, path=None, closer_s=1.0):
    """Returns as soon as its rank is released, whose release then takes ``closer_s`` more
    (a slow closer, as a pipe's producer or a communicator can be)."""
    from dask_monarch.worker.lane import current_lane

    state = current_lane().rank
    state.on_release(lambda: time.sleep(closer_s))
    if path:
        with open(path, "a") as f:
            f.write("started\n")
    while not state.released:
        time.sleep(0.002)
    return x


_EXECUTOR_ERRORS: list[str] = []


def executor_errors(start=False):
    """What the threads of this worker's thread pools logged dying of (since ``start``)."""
    import logging

    if start:

        class Keep(logging.Handler):
            def emit(self, record):
                _EXECUTOR_ERRORS.append(f"{record.getMessage()}: {record.exc_info}")

        logging.getLogger("concurrent.futures").addHandler(Keep())
    return list(_EXECUTOR_ERRORS)


def interrupt_main_then(x, seconds=1.0):
    """What a terminal's Ctrl-C does to a worker: a SIGINT for its main thread."""
    import _thread

    _thread.interrupt_main()
    time.sleep(seconds)
    return x + 1


def raise_keyboard_interrupt(x):
    raise KeyboardInterrupt("interrupted inside a remote function")


def exit_process(x, code=1):
    """Kill this worker process at once (no cleanup, no exception): a lost worker."""
    import os

    os._exit(code)


def allocate(x, mib):
    """Hold ``mib`` MiB of touched memory for a while (trips a nanny's memory limit)."""
    block = torch.ones(mib * 2**18)  # 4-byte floats
    time.sleep(30)
    return block.sum()


# -- worker-resident objects (dm.OpaqueRef) ------------------------------------------------------

_residents: "weakref.WeakSet[Resident]" = weakref.WeakSet()


class Resident:
    """A rank's object for OpaqueRef tests: a running total, counted while it lives."""

    def __init__(self, start, rank=None, fail_rank=None):
        if rank is not None and int(rank) == fail_rank:
            raise ValueError(f"Resident refused to start on rank {int(rank)}")
        self.total = float(start) + (100.0 * int(rank) if rank is not None else 0.0)
        _residents.add(self)

    def bump(self, by):
        self.total += float(by)
        return torch.tensor(self.total)


def resident_bump(obj, by=1.0):
    return obj.bump(by)


def resident_fail(obj):
    raise RuntimeError(f"this use of a Resident at {obj.total} failed")


def residents_alive(*_):
    import gc

    gc.collect()
    return len(_residents)


def first_plus(x, big):
    """Reads a (large) argument, keeps nothing of it (tests/controller/test_memory.py)."""
    return x + big[:1]


def grow(x, items):
    """Changes its list argument: x + how many items it holds after one more."""
    items.append(0)
    return x + len(items)


def describe(*args, **kwargs):
    """What a call received, as text: containers kept, leaves named by type
    (tests/worker/test_arguments.py)."""

    def shape(x):
        if type(x) is list:
            return [shape(v) for v in x]
        if type(x) is tuple:
            return tuple(shape(v) for v in x)
        if type(x) is dict:
            return {k: shape(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor):
            return f"Tensor{list(x.shape)}"
        return type(x).__name__

    return repr((shape(args), shape(kwargs)))


# -- NCCL's rules on CPU (tests/worker/test_nccl_rules.py) -------------------------------------


def checked_communicators():
    """{communicator name: operations issued} of this rank's checked (emulate-nccl) ones."""
    from dask_monarch.worker.lane import current_lane

    comms = current_lane().rank.comms
    if comms is None:
        return {}
    return {seq.name: seq.count + sum(seq.pairs.values()) for seq in list(comms.sequences.values())}


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops it sees, by thread (as dask_monarch.worker.dispatch-mode)."""

    seen: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import threading

        name = threading.current_thread().name
        CountOps.seen[name] = CountOps.seen.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def ops_seen(*after):
    """{thread name: ops CountOps saw on it} in this worker process."""
    return dict(CountOps.seen)


class ZerosActor:
    """An actor whose constructor makes a tensor (where it runs is checked)."""

    def __init__(self):
        import threading

        self.thread = threading.current_thread().name
        self.value = torch.zeros(2) + 1

    def __call__(self, *tensors):
        return self.thread


# -- CUDA ranks (tests/gpu) ---------------------------------------------------------------------


def device_of(x):
    """Where a tensor (or each tensor of a list) lives, as text."""
    if isinstance(x, (list, tuple)):
        return [str(t.device) for t in x]
    return str(x.device)


def current_cuda_device():
    return torch.cuda.current_device()


def cuda_loader(pipe, batches):
    """A data loader on the rank's GPU: batch i is full of i, made with device="cuda"."""
    for i in range(batches):
        pipe.send(torch.full((4,), float(i), device="cuda"))


def cuda_echo_loader(pipe):
    """Doubles what the lanes send it, on the GPU, and says which device it got it on."""
    while True:
        x = pipe.recv()
        pipe.send((x * 2, str(x.device)))


class Holder:
    """A value that is not a list, tuple or dict, holding tensors (fetched whole)."""

    def __init__(self, **tensors):
        self.__dict__.update(tensors)


def holders(device="cpu"):
    """A tensor inside a custom object, and inside one pickle cannot take (a lambda)."""
    plain = Holder(t=torch.arange(3.0, device=device))
    cloud = Holder(t=torch.ones(2, device=device), f=lambda: 1)
    return plain, cloud


class CudaActor:
    """An actor whose constructor makes a CUDA tensor with device="cuda"."""

    def __init__(self):
        self.value = torch.arange(4.0, device="cuda")

    def device(self):
        return str(self.value.device)

    def add(self, t):
        return (self.value + t).sum().item()


# -- user code that is slow where the worker's event loop might run it (issue 35, item 1) -------


def _slow_int(value, seconds):
    time.sleep(seconds)
    return SlowUnpickle(value, seconds)


class SlowUnpickle(int):
    """An int whose unpickling sleeps ``seconds`` (a user value sent as a plain argument)."""

    def __new__(cls, value, seconds):
        self = super().__new__(cls, value)
        self.seconds = seconds
        return self

    def __reduce__(self):
        return (_slow_int, (int(self), self.seconds))


class SlowDel:
    """A rank's object whose ``__del__`` sleeps ``seconds`` (freed by a dropped OpaqueRef)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __del__(self):
        time.sleep(self.seconds)


def plus(x, n):
    return x + int(n)


def scaled(x, by):
    """``x * by`` (a remote function for the hardened-mode programs)."""
    return x * by


def running_total(start):
    """A rank's object: its running total (an OpaqueRef factory by path)."""
    return {"total": float(start)}


def add_to_total(obj, x):
    obj["total"] += float(x.sum())
    return torch.tensor(obj["total"])


def mismatched_collective(x, pg, rank, how):
    """A user collective whose ranks disagree on rank 1: ``how`` is "size" or "dtype" (an
    all-reduce), or the name of the ``torch.distributed`` function to call with a size
    rank 1 does not share."""
    import torch.distributed as dist

    odd = int(rank) == 1
    n, extra = x.numel(), 3 if odd else 0
    if how == "dtype":
        t = torch.ones(n, dtype=torch.float64 if odd else torch.float32)
        dist.all_reduce(t, group=pg)
    elif how == "all_gather_into_tensor":
        t = torch.ones(2 * (n + extra))
        dist.all_gather_into_tensor(t, torch.ones(n + extra), group=pg)
    elif how == "reduce_scatter_tensor":
        t = torch.ones(n + extra)
        dist.reduce_scatter_tensor(t, torch.ones(2 * (n + extra)), group=pg)
    elif how == "all_to_all_single":
        t = torch.ones(2 * (n + extra))
        dist.all_to_all_single(t, torch.ones(2 * (n + extra)), group=pg)
    else:
        t = torch.ones(n + extra)
        dist.all_reduce(t, group=pg)
    return t.sum()


def mismatched_send(x, pg, rank):
    """Rank 0 sends 7 elements where rank 1 receives 4 (gloo aborts the receiver on it)."""
    import torch.distributed as dist

    if int(rank) == 0:
        t = torch.ones(7)
        dist.send(t, 1, group=pg)
    else:
        t = torch.ones(4)
        dist.recv(t, 0, group=pg)
    return t.sum()


def spin(x, path=None):
    """Never returns: a loop in Python (``mesh.exit(cancel=True)`` interrupts it)."""
    if path:
        touch(path)
    while True:
        pass


def sleep_in_c(x, seconds, path=None):
    """Sleeps in C, where no asynchronous exception reaches it."""
    if path:
        touch(path)
    time.sleep(seconds)
    return x


def sleep_on(x, rank, sleeper, seconds):
    """``x``, after ``seconds`` of sleep on rank ``sleeper`` only (a late collective member)."""
    if int(rank) == sleeper:
        time.sleep(seconds)
    return x.clone()


def until_lane_busy(stream_id, timeout=60.0):
    """Block the calling lane until stream ``stream_id``'s lane on this rank runs a segment
    (or waits in one): an event that makes two lanes' segments overlap in time."""
    from dask_monarch.worker.lane import current_lane

    other = current_lane().rank.lanes[stream_id]
    deadline = time.monotonic() + timeout  # its own loop, as gates.py says
    while other.state == "idle":
        if time.monotonic() > deadline:
            raise TimeoutError(f"stream {stream_id}'s lane did not start within {timeout}s")
        time.sleep(0.001)


def pg_fails_partway(x, pg, fails_at, extra=0):
    """All-reduce ``x`` twice over ``pg``; group rank 1 raises before the ``fails_at``-th
    (0, 1; 2: after both), and calls ``extra`` more all-reduces than its peers."""
    import torch.distributed as dist

    total = x.clone()
    for i in range(3):
        if i == fails_at and pg.rank() == 1:
            raise ValueError(f"group rank 1 gave up before all-reduce {i}")
        if i < 2:
            dist.all_reduce(total, group=pg)
    for _ in range(extra if pg.rank() == 1 else 0):
        dist.all_reduce(total, group=pg)
    return total


def pg_fails_between_groups(x, first, second):
    """All-reduce ``x`` over ``first``, then over ``second``; group rank 1 raises between."""
    import torch.distributed as dist

    total = x.clone()
    dist.all_reduce(total, group=first)
    if first.rank() == 1:
        raise ValueError("group rank 1 gave up between its groups")
    dist.all_reduce(total, group=second)
    return total


def pg_positive_partway(x, pg):
    """All-reduce ``x`` over ``pg`` twice; a member whose ``x`` holds a negative number raises
    between the two."""
    import torch.distributed as dist

    total = x.clone()
    dist.all_reduce(total, group=pg)
    positive(x)
    dist.all_reduce(total, group=pg)
    return total
