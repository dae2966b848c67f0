"""torch.distributed process groups without a default group (DESIGN decision 6).

A worker process may hold ranks of many meshes, but ``init_process_group``
works once per process, so every group here is built directly over a
prefixed store: a ``ProcessGroup`` whose CPU backend is gloo and, on GPU
workers, whose CUDA backend is NCCL (docs/dask.md §12). The group is entered in
torch's global-to-group rank table so that user functions can call
``dist.send(t, dst, group=pg)`` with controller ranks; ``dist.get_rank(pg)``
still wants a default group, so use ``pg.rank()`` and ``pg.size()``.

These are private torch APIs, kept in this one module; the collective and
send tests (``tests/worker/test_collectives.py``) exercise every one of them
on the installed torch.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable

import psutil
import torch
import torch.distributed as dist
from distributed.comm.addressing import get_address_host
from torch.distributed import distributed_c10d as c10d

from .. import config
from .nccl_watch import nccl_environment

logger = logging.getLogger("dask_monarch.worker")


def reachable_host(worker_address: str) -> str:
    """The address peers reach this rank at: the worker's own, or ``comm.interface``'s.

    Never the host name (which may resolve to 127.0.1.1 or to another network)
    and never loopback: by default the host of the address the worker
    registered with, which the client and the scheduler already reach it at.
    ``dask_monarch.comm.interface`` (read on the worker, e.g.
    ``DASK_MONARCH__COMM__INTERFACE=ib0`` where ``dask worker`` starts) picks
    that interface's first IPv4 address (else IPv6) instead, for a fast
    network the worker does not register on.
    """
    interface = config.get("comm.interface")
    if not interface:
        return get_address_host(worker_address)
    addresses = psutil.net_if_addrs()
    if interface not in addresses:
        raise ValueError(
            f"dask_monarch.comm.interface is {interface!r} but this host "
            f"({worker_address}) has no such interface (it has: "
            f"{', '.join(sorted(addresses))}); set it to one of them or unset it"
        )
    by_family = {a.family: a.address for a in reversed(addresses[interface])}
    for family in (socket.AF_INET, socket.AF_INET6):
        if family in by_family:
            return by_family[family].split("%")[0]
    raise ValueError(
        f"dask_monarch.comm.interface {interface!r} has no IP address on {worker_address}"
    )


def start_store(host: str, timeout: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on ``host`` only (a port of its own choosing)."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        None,
        True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    return store, port


CONNECT_ATTEMPT_S = 1.0  # one try at reaching a store (torch retries within it)


def connect_store(
    host: str, port: int, timeout: float, stopped: Callable[[], bool] | None = None
) -> dist.TCPStore:
    """A client of the store at ``host:port`` (operations then time out after ``timeout``).

    Connects in short attempts, so that it gives up as soon as ``stopped()``
    says so (the controller failed or released the rank: the store may be gone
    with it), not after ``timeout``: torch retries a refused connection until then.
    """
    deadline = time.monotonic() + timeout
    while True:
        attempt = max(min(CONNECT_ATTEMPT_S, deadline - time.monotonic()), 0.1)
        try:
            store = dist.TCPStore(
                host, port, None, False, timeout=datetime.timedelta(seconds=attempt)
            )
        except dist.DistNetworkError:
            if time.monotonic() >= deadline or (stopped is not None and stopped()):
                raise
            continue
        store.set_timeout(datetime.timedelta(seconds=timeout))
        return store


def new_group(
    store: dist.Store,
    prefix: str,
    ranks: list[int],
    rank: int,
    *,
    host: str,
    timeout: float,
    cuda: str | None,
    device: torch.device | None = None,
    lazy: bool = True,
) -> dist.ProcessGroup:
    """The group of global ``ranks`` as seen by global ``rank`` (a blocking rendezvous).

    ``ranks`` is the group in group-rank order; every member must call this
    with the same ``prefix`` and ``ranks``. CPU tensors always use gloo; ``cuda``
    names the backend for CUDA tensors (``"nccl"`` or ``"gloo"``; None on CPU
    workers). An NCCL communicator is made here, eagerly, on ``device`` (the
    rank's GPU): made lazily it would start inside the group's first
    operation, on whichever lane issues it first, uninterruptibly and in an
    order that differs between ranks.

    ``lazy`` (``dask_monarch.comm.gloo-connect: lazy``): gloo connects a pair
    of members at their first operation together, not every pair in the
    constructor. A whole-mesh group then costs each rank the pairs its
    operations use (two neighbours for a ring all-reduce, one peer per send)
    instead of ``len(ranks) - 1`` connections made up front.
    """
    group_rank, size = ranks.index(rank), len(ranks)
    prefixed = dist.PrefixStore(prefix, store)
    delta = datetime.timedelta(seconds=timeout)
    pg = dist.ProcessGroup(prefixed, group_rank, size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = delta
    options._devices = [gloo_device(host, lazy)]
    gloo = dist.ProcessGroupGloo(prefixed, group_rank, size, options)
    gloo._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    if cuda == "gloo":  # for user functions' collectives (gloo stages CUDA tensors in those);
        # dask_monarch's own ops hand gloo host copies (worker/comm.py)
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, gloo)
    elif cuda == "nccl":
        nccl_environment()
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = delta
        nccl = dist.ProcessGroupNCCL(
            dist.PrefixStore("nccl/", prefixed), group_rank, size, nccl_options
        )
        nccl._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        if device is not None:
            nccl.eager_connect_single_device(device)
    c10d._world.pg_group_ranks[pg] = {r: i for i, r in enumerate(ranks)}
    return pg


def gloo_device(host: str, lazy: bool) -> dist.ProcessGroupGloo.Device:
    """A gloo device bound to ``host`` whose pairs connect at first use if ``lazy`` (and the
    installed torch knows how: 2.8 or later; older ones connect every pair up front)."""
    try:
        return dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=lazy)
    except TypeError:  # a torch without lazy_init
        return dist.ProcessGroupGloo.create_device(hostname=host)


RELEASED_HELD_S = 5.0  # a released group is kept this long off the lanes (release_group)


def release_group(pg: dist.ProcessGroup) -> None:
    """Forget the group and stop its backends (a peer blocked in it then fails fast; an op
    of ours that waits on a peer ends at its timeout, off the lane: :func:`finish`).

    A group with an NCCL communicator is aborted rather than shut down: a
    shutdown waits for the kernels in flight, which wait forever for a peer
    that is gone; an abort ends them, and the worker goes on.

    The group itself is let go of on a thread of its own, a few seconds later:
    gloo's destructor joins the group's threads, and one of them may sit in an
    operation whose peer is gone until the collective timeout. Dropped by
    whoever held it last (a lane's failed segment, whose traceback names it),
    it would hold that lane as long.
    """
    c10d._world.pg_group_ranks.pop(pg, None)
    try:
        if uses_nccl(pg):
            pg.abort()
        else:
            pg.shutdown()
    except Exception as e:  # a group whose peers are gone may refuse; it is dropped anyway
        logger.debug("shutting down process group %r: %r", pg, e)
    held = [pg]

    def let_go() -> None:
        time.sleep(RELEASED_HELD_S)
        held.clear()  # the last reference, once the lanes let theirs go: joins its threads here

    threading.Thread(target=let_go, name="dask_monarch-released-group", daemon=True).start()


TIMEOUT_GRACE_S = 1.0  # past the collective timeout before finish gives up on gloo's own error


def finish(
    work: dist.Work, stopped: Callable[[], bool], timeout: float, poll: float = 0.05
) -> bool:
    """Wait for ``work`` (a gloo op's); False as soon as ``stopped()`` says to give up.

    Waits in slices of ``poll`` seconds, each returning the moment the op
    completes, so a finished op costs nothing extra; the op itself goes on
    without the caller until it completes or fails at its own timeout. For gloo
    collectives only: a timed wait on a gloo send or receive closes its pair when
    it expires, and an NCCL work's ``wait(timeout)`` blocks the host on the GPU.

    An op still pending ``TIMEOUT_GRACE_S`` after ``timeout`` (the collective
    timeout, which gloo's op was given) raises ``RuntimeError``: a group whose
    pairs connect at first use (``lazy_init``) never times out on the side that
    waits for a peer to connect, when that peer has not reached the op.
    """
    step = datetime.timedelta(seconds=poll)
    deadline = time.monotonic() + timeout + TIMEOUT_GRACE_S
    while True:
        try:
            work.wait(step)
            return True
        except RuntimeError:
            if work.is_completed():  # the op failed (or completed as the slice ended)
                work.wait()  # raises the op's own error, if any
                return True
            if stopped():
                return False
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Timed out waiting {timeout:g}s for the collective to complete "
                    "(dask_monarch.timeouts.collective): a member has not reached it"
                ) from None


def point_to_point(
    pg: dist.ProcessGroup,
    send: tuple[torch.Tensor, int] | None,
    recv: tuple[torch.Tensor, int] | None,
    tag: int,
) -> list:
    """Start a send and/or a receive on ``pg`` (peers in group ranks) as one grouped call;
    returns their works.

    One call on every backend and for every rank, whatever it does: NCCL runs
    a send and a receive issued apart in order (two ranks exchanging large
    tensors would each wait in its send for the other's receive), and it runs
    a lone send or receive on a two-rank communicator of its own but a grouped
    one on the group's, so ranks that grouped and ranks that did not would
    never meet. gloo, which does not group, issues the two one after the other.
    """
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send[0], group=pg, tag=tag, group_peer=send[1]))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv[0], group=pg, tag=tag, group_peer=recv[1]))
    return dist.batch_isend_irecv(ops) if ops else []


def uses_nccl(pg: dist.ProcessGroup) -> bool:
    """Whether CUDA tensors in ``pg`` go through NCCL (False: gloo, or no CUDA backend)."""
    try:
        return pg._get_backend(torch.device("cuda")).name() == "nccl"
    except (RuntimeError, AttributeError) as e:  # no CUDA backend on this group
        logger.debug("group %r has no CUDA backend: %r", pg, e)
        return False
