"""A gloo collective waited for with ``groups.finish`` ends at the collective timeout when a
member never comes, and completes when both do (worker/groups.py).

Two real, lazily connected gloo groups in one process, one member each, each in turn the
one that never comes. Here gloo's own timeout ends the wait on either side; across worker
processes the side that waits for its peer to connect did not (it waited for as long as the
peer took), which ``finish``'s deadline now bounds: tests/controller/
test_refused_before_dispatch.py reproduces that case on a cluster.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from dask_monarch.worker import groups

TIMEOUT = 1.0


def _pair(prefix: str) -> list[dist.ProcessGroup]:
    """Both members of a lazily connected two-rank gloo group, made together."""
    host = "127.0.0.1"
    server, port = groups.start_store(host, 30.0)
    made: dict[int, dist.ProcessGroup] = {}

    def member(rank: int) -> None:
        store = groups.connect_store(host, port, 30.0)
        made[rank] = groups.new_group(
            store, prefix, [0, 1], rank, host=host, timeout=TIMEOUT, cuda=None, lazy=True
        )

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    _pair.keep.append(server)  # the store outlives the groups of this test
    return [made[0], made[1]]


_pair.keep = []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("waiting", [0, 1])
def test_a_collective_whose_peer_never_comes_fails_at_the_timeout(waiting):
    pgs = _pair(f"deadline-{waiting}/")
    work = dist.all_reduce(torch.ones(4), group=pgs[waiting], async_op=True)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="[Tt]imed out"):
        groups.finish(work, lambda: False, TIMEOUT)
    assert time.monotonic() - start < TIMEOUT + groups.TIMEOUT_GRACE_S + 2.0
    for pg in pgs:
        groups.release_group(pg)


@pytest.mark.timeout(60)
def test_a_collective_both_members_reach_completes():
    pgs = _pair("deadline-both/")
    values = [torch.full((4,), float(r + 1)) for r in (0, 1)]
    works = [dist.all_reduce(v, group=pg, async_op=True) for v, pg in zip(values, pgs)]
    assert all(groups.finish(w, lambda: False, TIMEOUT) for w in works)
    assert all(v.tolist() == [3.0] * 4 for v in values)
    for pg in pgs:
        groups.release_group(pg)
