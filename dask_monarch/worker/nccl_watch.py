"""NCCL failures end the mesh, never the Dask worker.

An NCCL operation's ``wait()`` only makes the lane's stream wait for it: the
lane goes on, and a failure (a peer gone, a peer later than
``dask_monarch.timeouts.collective``, e.g. paused in a debugger as on gloo)
shows only later. With torch's defaults NCCL's watchdog then ends the whole
process, and its heartbeat monitor ends one whose watchdog looks stuck: a Dask
worker serving other controllers would die with it. :func:`nccl_environment`
makes the watchdog abort the communicators instead, which ends their kernels
(with garbage in their outputs); :class:`NcclWatch` follows every operation a
rank enqueued and fails the rank with a :class:`~.errors.FatalError` naming
the operation (the controller raises ``DeviceException`` naming the rank), and
:func:`check_device` makes sure no value computed from a failed operation is
fetched. Releasing a rank aborts its NCCL communicators (``groups.release_group``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from .errors import FatalError

if TYPE_CHECKING:
    from .rank import RankState

logger = logging.getLogger("dask_monarch.worker")

# What NCCL's watchdog does when an operation fails or outlives the group's timeout: with
# torch's defaults it ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), and its heartbeat
# monitor ends a process whose watchdog looks stuck. A Dask worker serves other controllers
# and must survive: abort the communicators only (2: CleanUpOnly), which ends their kernels,
# and let NcclWatch fail the mesh with a DeviceException naming the rank.
NCCL_ENVIRONMENT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "TORCH_NCCL_BLOCKING_WAIT": "0",
}


def nccl_environment() -> None:
    """Set :data:`NCCL_ENVIRONMENT` before an NCCL communicator is made (each reads it then)."""
    for name, value in NCCL_ENVIRONMENT.items():
        before = os.environ.get(name)
        if before != value:
            if before is not None:
                logger.warning(
                    "%s=%s would let NCCL end this Dask worker on a collective's failure; "
                    "dask_monarch sets it to %s",
                    name,
                    before,
                    value,
                )
            os.environ[name] = value


class NcclWatch:
    """The NCCL operations a rank enqueued and has not seen complete.

    NCCL's watchdog marks an operation failed when it errs or outlives the
    group's timeout. A thread of this class's own follows the operations and
    fails the rank, naming the operation, as soon as one failed; :meth:`check`
    looks at them before a fetched value leaves the rank (its copy to the host
    waited for their kernels, which an abort ends).
    """

    POLL_S = 0.1

    def __init__(self, state: RankState):
        self.state = state
        self.pending: deque[tuple[Any, str]] = deque()  # (work, what it is), oldest first
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, work: Any, what: str) -> None:
        with self.lock:
            self.pending.append((work, what))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name=f"monarch-nccl-watch-{self.state.rank}", daemon=True
                )
                self.thread.start()

    def check(self) -> None:
        """A FatalError if an operation that completed failed (the fetch must not answer)."""
        failure = self._sweep()
        if failure is not None:
            raise FatalError(failure)

    def clear(self) -> None:
        with self.lock:
            self.pending.clear()

    def _sweep(self) -> str | None:
        """Forget the operations that completed; why the first failed one failed, if any.

        Every operation is looked at, not only the oldest: operations of other groups
        and streams complete in any order, and one still running must not hide one
        that failed after it."""
        failure = None
        with self.lock:
            running: deque[tuple[Any, str]] = deque()
            for work, what in self.pending:
                if not work.is_completed():
                    running.append((work, what))
                elif failure is None:
                    error = _work_error(work)
                    if error is not None:
                        failure = (
                            f"rank {self.state.rank}: {what} failed on NCCL: {error} (a peer "
                            "failed, left, or waited longer than "
                            "dask_monarch.timeouts.collective; the communicators were aborted)"
                        )
            self.pending = running
        return failure

    def _run(self) -> None:
        """Sweep until nothing is pending, an operation failed or the rank aborts; the thread
        says it is gone under the same lock that found nothing pending, so that an
        :meth:`add` after that starts a new one."""
        state = self.state
        while True:
            stopping = state.abort.wait(self.POLL_S)
            failure = None if stopping else self._sweep()
            if failure is not None:
                state.fail(failure)
            with self.lock:
                if stopping or failure is not None or not self.pending:
                    self.thread = None
                    return


def _work_error(work: Any) -> str | None:
    """Why a completed torch.distributed work failed, or None."""
    try:
        error = work.exception()
    except Exception as e:  # a torch that raises the work's error here
        return f"{type(e).__name__}: {e}"
    return None if error is None else f"{type(error).__name__}: {error}"


def check_device(state: RankState) -> None:
    """Before a value leaves the rank: a FatalError if an NCCL operation it may depend on
    failed (an aborted operation leaves garbage behind; wrong numbers never reach a user)."""
    comms = state.comms
    if comms is not None and comms.watch.pending:
        comms.watch.check()
