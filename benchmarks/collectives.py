"""Collectives: dask_monarch Reduce and SendTensor against plain torch.distributed (gloo).

    python benchmarks/collectives.py [--repeat 5] [--small-repeat 3] [--ops 10] [--more-ops 50]
                                     [--timeline 5] [--hops 20]

For 1 M and 16 M float32 elements on 2 ranks: an in-place all-reduce (Reduce
SUM) and a rank 0 -> rank 1 send (SendTensor, which makes a new tensor on the
receiver), timed as ``ops`` operations in a row then a sync, next to the same
operations in two plain processes that called ``init_process_group("gloo")``
(receiving into a new tensor each time too; a barrier before and after).
Both stay up for the whole run and take turns, one repeat each, so they see
the same machine. Medians over the repeats; ratio = ours / plain. A 1 M batch
is cheap, so each repeat times it ``--small-repeat`` times (the sides taking
turns each time), for a median that moves less from run to run.

A send's receiver fills a fresh tensor each time, and the kernel's pages
come dearer to the first process that takes gigabytes after a while than
to one that takes them just after another freed them: the first side of a
turn paid 130-168 ms per 16 M receive in batches of 50, the second 48-54
(benchmarks/RESULTS.md). So each turn of sends starts with an untimed batch
of its first side, and both timed sides find pages just freed.

Every dask_monarch figure carries one flush and one sync round trip (a few
milliseconds, benchmarks/latency.py) spread over ``ops`` operations. The run
also times ``--more-ops`` operations per sync, and prints the marginal cost
of one more operation, ``(t[more] - t[ops]) / (more - ops)``, on both sides:
what a collective costs once the round trip is paid.

Last, ``--timeline`` batches of ``ops`` operations per side and shape are
timed inside: ours from ``dm.trace``'s records on each rank (the flush until
the first operation starts, the c10d call and wait, the handler around it,
the gaps, the sync's way back), plain gloo from clock reads around each call,
and each rank process's CPU and minor page faults from the kernel. The table
says which part holds a ratio above 1.

Then ``--hops`` batches of the 1 M all-reduce, where that part weighs most,
are stamped hop by hop in every process with ``benchmarks/latency.py``'s
stamps (installed only now, so they cost the ratios nothing): the client's
compile and send, the scheduler's intake and ``compute-task`` to each rank,
each worker's task and lane starting, the ranks' reports and the client
reading them. The flush and the sync are those hops.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import os
import statistics
import time

import latency
import torch
import torch.distributed as dist
from distributed import Client
from gloo_ranks import GlooRanks

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Factory, ReduceOp, Ref, StreamRef
from dask_monarch.ndslice import Slice

S0 = StreamRef(0)
MESH = Ref(1)
SIZES = {"1M": 1 << 20, "16M": 1 << 24}
HOPS_SIZE = "1M"  # --hops: the size where the flush and the sync weigh most
HOPS_PAUSE_S = 0.05  # --hops: before each batch, so that it starts on a quiet machine
SMALL = {"1M"}  # cheap to time: --small-repeat times per repeat, for a steadier median
OPS = ("Reduce", "SendTensor")  # the trace's names of the timed messages


def _mean(parts: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.fmean(p[key] for p in parts) for key in parts[0]}


def _usage(pid: int) -> tuple[float, int]:
    """A process's CPU seconds on all its threads (the kernel's run times, in ns) and its
    minor page faults (Linux ``/proc``)."""
    ns = 0
    for task in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            with open(task) as f:
                ns += int(f.read().split()[0])
    with open(f"/proc/{pid}/stat") as f:
        faults = int(f.read().rsplit(")", 1)[1].split()[7])
    return ns / 1e9, faults


# -- plain torch.distributed ---------------------------------------------------------------------


_tensors: dict[str, torch.Tensor] = {}  # a plain rank's operands, made on its first command


def _plain(rank: int, sizes: dict, kind: str, name: str, ops: int, split: bool) -> tuple:
    """One command of a plain rank: ``ops`` operations of ``kind`` on the ``name`` tensor,
    timed between barriers (``split``: each operation timed too); ``(rank, figures)``."""
    if not _tensors:
        _tensors.update({size: torch.ones(n) for size, n in sizes.items()})
    x, n = _tensors[name], sizes[name]
    received = []  # like SendTensor: every receive makes a new tensor
    inside = 0.0  # split: the time spent in the operations' calls and waits
    before = _usage(os.getpid()) if split else (0.0, 0)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(ops):
        begun = time.perf_counter()
        if kind == "reduce":
            work = dist.all_reduce(x, async_op=split)
        elif rank == 0:
            work = dist.isend(x, 1) if split else dist.send(x, 1)
        else:
            received.append(torch.empty(n))
            work = dist.irecv(received[-1], 0) if split else dist.recv(received[-1], 0)
        if split:  # what the blocking calls do inside, with a clock read between ops
            work.wait()
            inside += time.perf_counter() - begun
    ended = time.perf_counter()
    dist.barrier()
    elapsed = time.perf_counter() - start
    after = _usage(os.getpid()) if split else (0.0, 0)
    del received
    if not split:
        return rank, elapsed
    return rank, {
        "total": elapsed,
        "head": 0.0,
        "in the op": inside,
        "between ops": ended - start - inside,
        "tail": elapsed - (ended - start),
        "cpu": after[0] - before[0],
        "faults": after[1] - before[1],
    }


class PlainTorch(GlooRanks):
    """Two gloo processes that stay up and time one batch of operations on request."""

    def __init__(self, sizes) -> None:
        super().__init__(2, _plain)
        self.sizes = sizes

    def time(self, kind: str, name: str, ops: int) -> float:
        return dict(self.run(self.sizes, kind, name, ops, False))[0]  # rank 0's

    def timeline(self, kind: str, name: str, ops: int) -> dict[str, float]:
        """One batch with each operation timed: its parts in seconds, averaged over the ranks."""
        before = _usage(os.getpid())[0]
        parts = _mean([figures for _, figures in self.run(self.sizes, kind, name, ops, True)])
        return {**parts, "others": _usage(os.getpid())[0] - before}


# -- dask_monarch --------------------------------------------------------------------------------


class Ours:
    """A 2-rank mesh on the raw controller, with a communicator for reduces and for sends."""

    def __init__(self, sizes) -> None:
        self.cluster = dm.LocalMeshCluster(n_ranks=2, device="cpu")
        self.client = Client(self.cluster)
        self.ctrl = ctrl = dm.Controller(self.client, world_size=2)
        both = self.both = [0, 1]
        ctrl.send(both, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
        ctrl.send(both, m.CreateDeviceMesh(MESH, ["gpu"], Slice.row_major([2])))
        ctrl.send(both, m.BackendNetworkInit())
        ctrl.send(both, m.SplitComm(["gpu"], MESH, S0))
        ctrl.send(both, m.BackendNetworkPointToPointInit(S0, S0))
        self.inputs, self.factories = {}, {}
        for seq, (name, n) in enumerate(sizes.items()):
            x = self.inputs[name] = Ref(10 + seq)
            self.factories[name] = Factory((n,), torch.float32, torch.strided, "cpu")
            fn = m.FunctionPath("torch.ones")
            ctrl.send(both, m.CallFunction(seq, [x], [], fn, ArgsKwargs.from_python((n,)), S0, []))
        ctrl.sync(timeout=600)
        pids = self.client.run(os.getpid, workers=list(ctrl.workers))
        self.pids = [pids[address] for address in ctrl.workers]  # by rank
        nannies = self.client.run(os.getppid, workers=list(ctrl.workers))  # here, usually
        scheduler = self.client.run_on_scheduler(os.getpid)
        self.others = sorted({os.getpid(), scheduler, *nannies.values()})

    def time(self, kind: str, name: str, ops: int) -> float:
        start = time.perf_counter()
        self._run(kind, name, ops)
        elapsed = time.perf_counter() - start
        self._free(ops)
        return elapsed

    def timeline(self, kind: str, name: str, ops: int) -> dict[str, float]:
        """One traced batch (``dm.trace``'s records of every message and wait): its parts
        in seconds, averaged over the ranks."""
        ctrl = self.ctrl
        ctrl.start_trace()
        before = [_usage(pid) for pid in self.pids + self.others]
        start = time.time()
        self._run(kind, name, ops)
        end = time.time()
        after = [_usage(pid) for pid in self.pids + self.others]
        ranks = len(self.pids)
        others = sum(b[0] - a[0] for a, b in zip(before[ranks:], after[ranks:]))
        traces = ctrl.collect_trace()
        self._free(ops)
        parts = []
        for rank in traces:
            records = rank["records"]
            messages = [r for r in records if r[1] == "message" and r[2] in OPS]
            first, last = min(r[3] for r in messages), max(r[4] for r in messages)
            handled = sum(r[4] - r[3] for r in messages)
            inside = sum(r[4] - r[3] for r in records if r[1] == "wait" and first <= r[3] <= last)
            parts.append(
                {
                    "total": end - start,
                    "head": first - start,
                    "in the op": inside,
                    "handler": handled - inside,
                    "between ops": last - first - handled,
                    "tail": end - last,
                    "cpu": after[rank["rank"]][0] - before[rank["rank"]][0],
                    "faults": after[rank["rank"]][1] - before[rank["rank"]][1],
                    "others": others,
                }
            )
        return _mean(parts)

    def hops(self, kind: str, name: str, ops: int, batches: int) -> dict[str, list[float]]:
        """``batches`` batches stamped hop by hop in every process (``latency.py``'s stamps,
        which stay: call it last); per hop, the ms from each batch's start to its first stamp.
        A pause before each batch lets the previous one's bookkeeping end first."""
        client = self.client
        stamps = latency.install_stamps(client, self.ctrl)
        latency.wrap_comms(client)  # every comm exists by now
        for _ in range(3):  # warm: a wrapped read pending on each comm
            self.time(kind, name, ops)
        latency.take_log(client, stamps)
        batches_seen = []
        for _ in range(batches):
            time.sleep(HOPS_PAUSE_S)
            plans = len(stamps.plans)
            stamps.mark("start")
            start = time.time()
            self._run(kind, name, ops)
            end = time.time()
            keys = [key for plan in stamps.plans[plans:] for key in plan]
            batches_seen.append({"t0": start, "end": end, "ids": latency.segment_ids(keys)})
            self._free(ops)
        ranks = {address: f"rank {r}" for r, address in enumerate(self.ctrl.workers)}
        return latency.hops(batches_seen, latency.take_log(client, stamps), ranks)

    def _run(self, kind: str, name: str, ops: int) -> None:
        """``ops`` operations on results ``Ref(100)``..., then a sync."""
        ctrl, both, x, factory = self.ctrl, self.both, self.inputs[name], self.factories[name]
        for i in range(ops):
            result = Ref(100 + i)
            if kind == "reduce":
                message = m.Reduce(
                    result, x, factory, MESH, S0, ["gpu"], ReduceOp.SUM, False, True, None
                )
            else:
                message = m.SendTensor(
                    result, Slice(0, [1], [1]), Slice(1, [1], [1]), x, factory, S0, S0
                )
            ctrl.send(both, message)
        ctrl.sync(timeout=600)

    def _free(self, ops: int) -> None:
        self.ctrl.send(self.both, m.DeleteRefs([Ref(100 + i) for i in range(ops)]))
        self.ctrl.sync(timeout=600)  # freeing (gigabytes at 16 M) must not land in the next timing

    def close(self) -> None:
        self.ctrl.close()
        self.client.close()
        self.cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--small-repeat", type=int, default=3, help="1 M batches timed this often per repeat"
    )
    parser.add_argument("--ops", type=int, default=10)
    parser.add_argument("--more-ops", type=int, default=50, help="0: no marginal cost")
    parser.add_argument(
        "--timeline", type=int, default=5, help="batches timed inside, per side (0: none)"
    )
    parser.add_argument(
        "--hops", type=int, default=20, help="1 M all-reduce batches stamped hop by hop (0: none)"
    )
    args = parser.parse_args()
    counts = [args.ops] + ([args.more_ops] if args.more_ops > args.ops else [])
    plain, mine = PlainTorch(SIZES), Ours(SIZES)
    times: dict[tuple, list[float]] = {}
    try:
        for r in range(args.repeat + 1):  # the first repeat warms up and is dropped
            for kind in ("reduce", "send"):
                for name in SIZES:
                    turns = args.small_repeat if name in SMALL else 1
                    for ops, turn in itertools.product(counts, range(turns)):
                        sides = (("plain", plain), ("ours", mine))
                        order = sides if (r + turn) % 2 == 0 else sides[::-1]
                        if kind == "send":  # both timed sides receive into pages just freed
                            order[0][1].time(kind, name, ops)
                        for side, runner in order:
                            elapsed = runner.time(kind, name, ops)
                            if r:
                                times.setdefault((side, kind, name, ops), []).append(elapsed)
        timelines = {}  # (side, kind, size) -> the parts of each batch (the first warms up)
        for r in range(args.timeline + 1 if args.timeline else 0):
            for kind in ("reduce", "send"):
                for name in SIZES:
                    if kind == "send":  # as above: both timed sides find pages just freed
                        plain.time(kind, name, args.ops)
                    for side, runner in (("plain", plain), ("ours", mine)):
                        parts = runner.timeline(kind, name, args.ops)
                        if r:
                            timelines.setdefault((side, kind, name), []).append(parts)
        hops = mine.hops("reduce", HOPS_SIZE, args.ops, args.hops) if args.hops else None
    finally:
        mine.close()
        plain.close()

    def per_op(side, kind, name, ops):
        return statistics.median(times[(side, kind, name, ops)]) / ops

    print(
        f"\n2 ranks, float32, {args.ops} operations then a sync, median of {args.repeat} "
        f"({args.repeat * args.small_repeat} at 1 M; plain and ours taking turns)"
    )
    print(f"{'operation':<26}{'plain gloo ms':>14}{'dask_monarch ms':>17}{'ratio':>8}")
    for kind, label in (("reduce", "all-reduce SUM"), ("send", "send rank 0 -> 1")):
        for name in SIZES:
            a, b = per_op("plain", kind, name, args.ops), per_op("ours", kind, name, args.ops)
            print(f"{label + ' ' + name:<26}{a * 1e3:>14.2f}{b * 1e3:>17.2f}{b / a:>8.2f}")
    if len(counts) == 2:
        more = args.more_ops
        gap = more - args.ops
        print(f"\nmarginal cost of one more operation, (t[{more}] - t[{args.ops}]) / {gap}")
        print(f"{'operation':<26}{'plain gloo ms':>14}{'dask_monarch ms':>17}{'ratio':>8}")
        for kind, label in (("reduce", "all-reduce SUM"), ("send", "send rank 0 -> 1")):
            for name in SIZES:
                a, b = (
                    (
                        statistics.median(times[(side, kind, name, more)])
                        - statistics.median(times[(side, kind, name, args.ops)])
                    )
                    / (more - args.ops)
                    for side in ("plain", "ours")
                )
                print(f"{label + ' ' + name:<26}{a * 1e3:>14.2f}{b * 1e3:>17.2f}{b / a:>8.2f}")
    if timelines:
        print_timeline(timelines, args.ops, args.timeline)
    if hops:
        latency.print_table(
            f"dask_monarch: {args.ops} all-reduces of {HOPS_SIZE} then a sync, hop by hop",
            hops,
            args.hops,
        )


TIMELINE_ROWS = (
    ("head", "batch start -> first op starts", 1e3),
    ("in the op", "in the op (c10d call, wait)", 1e3),
    ("handler", "our handler around the op", 1e3),
    ("between ops", "between ops", 1e3),
    ("tail", "last op ends -> caller back", 1e3),
    ("total", "total", 1e3),
    ("cpu", "CPU of a rank's process", 1e3),
    ("faults", "its minor page faults (count)", 1),
    ("others", "CPU of all other processes", 1e3),
)


def print_timeline(timelines: dict, ops: int, batches: int) -> None:
    """Where a batch's time goes, per operation: the part both sides share (the op) and ours
    alone (the flush that brings the ops to the ranks, the handler, the sync's way back)."""
    print(
        f"\nwhere the time of {ops} operations then a sync goes, fp32, ms per operation "
        f"(median of {batches} batches;\nplain: clock reads around each call, its tail the "
        "closing barrier; ours: dm.trace's records;\nboth averaged over the 2 ranks; the "
        "other processes: plain's driver; our client,\nthe scheduler and the 2 nannies)"
    )
    columns = [(kind, name) for kind in ("reduce", "send") for name in SIZES]
    titles = {"reduce": "all-reduce", "send": "send 0 -> 1"}
    print(f"{'':<32}" + "".join(f"{titles[k] + ' ' + n:>18}" for k, n in columns))
    print(f"{'part':<32}" + f"{'plain':>9}{'ours':>9}" * len(columns))
    for key, label, scale in TIMELINE_ROWS:
        cells = []
        for kind, name in columns:
            for side in ("plain", "ours"):
                batches_parts = timelines[(side, kind, name)]
                if key not in batches_parts[0]:
                    cells.append(f"{'-':>9}")
                    continue
                median = statistics.median(p[key] for p in batches_parts) / ops * scale
                cells.append(f"{median:>9.3f}" if scale != 1 else f"{median:>9.0f}")
        print(f"{label:<32}" + "".join(cells))


if __name__ == "__main__":
    main()
