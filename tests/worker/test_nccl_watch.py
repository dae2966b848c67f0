"""NcclWatch's bookkeeping (worker/nccl_watch.py), without NCCL: the operations it follows
are stand-ins with a Work's two methods, the rank a stand-in with what the watch uses.

On a GPU the watch follows NCCL works (tests/gpu/test_nccl.py, the failing peers); here only
its own logic is checked: which operations it forgets, which failure it reports,
and that its thread comes back for work added after it stopped."""

from __future__ import annotations

import threading
import time

import pytest

from dask_monarch.worker.errors import FatalError
from dask_monarch.worker.nccl_watch import NcclWatch

pytestmark = pytest.mark.timeout(60)


class Work:
    """What the watch asks of a torch.distributed Work."""

    def __init__(self, completed: bool = False, error: Exception | None = None) -> None:
        self.completed, self.error = completed, error

    def is_completed(self) -> bool:
        return self.completed

    def exception(self) -> Exception | None:
        return self.error


class Rank:
    """What the watch asks of a RankState."""

    def __init__(self) -> None:
        self.rank = 3
        self.abort = threading.Event()
        self.failures: list[str] = []

    def fail(self, why: str) -> None:
        self.failures.append(why)


def _wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_running_operation_does_not_hide_a_later_one_that_failed():
    watch = NcclWatch(Rank())
    older = Work()  # still running, on another stream
    watch.pending.extend(
        [(older, "Reduce r1"), (Work(True), "Reduce r2"), (Work(True, RuntimeError("gone")), "S")]
    )
    with pytest.raises(FatalError, match=r"rank 3: S failed on NCCL: RuntimeError: gone"):
        watch.check()
    assert list(watch.pending) == [(older, "Reduce r1")]  # the completed ones are forgotten


def test_the_thread_fails_the_rank_and_a_new_one_follows_later_work():
    rank = Rank()
    watch = NcclWatch(rank)
    slow = Work()
    watch.add(slow, "Reduce r1")
    watch.add(Work(True, RuntimeError("peer left")), "SendTensor r2")
    _wait_for(lambda: rank.failures and watch.thread is None)
    assert rank.failures == [
        "rank 3: SendTensor r2 failed on NCCL: RuntimeError: peer left (a peer failed, left, "
        "or waited longer than dask_monarch.timeouts.collective; the communicators were aborted)"
    ]
    slow.completed = True
    watch.add(Work(), "Reduce r3")  # after the thread stopped: a new one follows it
    assert watch.thread is not None
    watch.pending[-1][0].completed = True
    _wait_for(lambda: watch.thread is None and not watch.pending)


def test_the_thread_stops_once_nothing_is_pending_and_when_the_rank_aborts():
    rank = Rank()
    watch = NcclWatch(rank)
    work = Work()
    watch.add(work, "Reduce r1")
    work.completed = True
    _wait_for(lambda: watch.thread is None)
    assert not watch.pending and rank.failures == []
    watch.add(Work(), "Reduce r2")  # never completes
    rank.abort.set()
    _wait_for(lambda: watch.thread is None)
    assert rank.failures == []
