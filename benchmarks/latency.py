"""Fetch latency, hop by hop: where one op + fetch spends its time, next to a bare Dask task.

    python benchmarks/latency.py [--n 100] [--rounds 3]

On one 2-rank ``LocalMeshCluster`` (Dask's batched-send gaps lowered as
dask_monarch lowers them, the same for both paths), alternating:

* dask_monarch: ``x = x + 1`` on a mesh scalar, then ``fetch_shard(x).result()``;
* bare Dask: ``client.submit(f).result()`` of a no-op on a rank worker.

Every process stamps what it did with ``time.time()`` (one machine: one
clock): the client (op issued, flush compiled, graph handed to Dask, the
client's event loop sending it, the bytes written), the scheduler (graph read,
``update-graph`` handled, each task's transitions, ``compute-task`` written),
each rank's worker (``compute-task`` read, the task executing, the lane
starting, a report queued and written, ``task-finished`` written), and the
client again (a report or ``key-in-memory`` read, the future resolved, the
user's thread woken). The stamps come from wrappers this script puts around
the comms' ``read``/``write`` and a few handlers in each process, and from a
scheduler and a worker plugin's ``transition`` hooks; nothing in dask_monarch
or Dask is changed for it. Prints the median time of each hop from the start
of the round trip, for both paths.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import cloudpickle
import torch
from distributed import Client
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

import dask_monarch as dm

# -- stamping (runs in every process; functions travel by value) ---------------------------------


def _ids(msg: Any) -> tuple:
    """What a message is about: task keys, report seqs and segments, as strings."""
    data = getattr(msg, "data", msg)  # ToPickle
    if isinstance(data, dict):
        op = data.get("op", "")
        keys = data.get("keys") or ()
        segments = data.get("segments")  # the scheduler's dask_monarch intake
        if segments is not None:
            keys = [s[0] for s in getattr(segments, "data", segments)]
        key = data.get("key")
        out = [str(_seg(k)) for k in keys] + ([str(_seg(key))] if key is not None else [])
        return tuple(f"{op}:{k}" for k in out) or (f"{op}:",)
    name = type(data).__name__
    rank = getattr(data, "rank", "?")
    if name in ("Fetched", "FetchResult"):
        return (f"{name} r{rank}:seq{data.seq}",)
    if name == "Status":
        return (f"Status r{rank}:seq{data.seq - 1}",)
    if name == "LaneDone":
        return (f"LaneDone r{rank}:{data.rank}/{data.lane}/{data.index}",)
    return (name,)


def _seg(key: Any) -> Any:
    """A dask_monarch segment key as ``rank/lane/index``; any other key as it is."""
    if isinstance(key, tuple) and len(key) == 5 and str(key[0]).startswith("monarch_"):
        return f"{key[2]}/{key[3]}/{key[4]}"
    return key


def _flatten(msgs: Any) -> list:
    return list(msgs) if isinstance(msgs, (list, tuple)) else [msgs]


def _wrap_comm(comm: Any, log: list, where: str, what: str) -> None:
    """Stamp every read and write of ``comm`` with what the messages are about."""
    if getattr(comm, "_timeline", False):
        return
    comm._timeline = True
    read, write = comm.read, comm.write

    async def timed_read(*args: Any, **kwargs: Any) -> Any:
        msgs = await read(*args, **kwargs)
        t = time.time()
        log.append((t, where, f"{what} read", [i for m in _flatten(msgs) for i in _ids(m)]))
        return msgs

    async def timed_write(msgs: Any, *args: Any, **kwargs: Any) -> Any:
        ids = [i for m in _flatten(msgs) for i in _ids(m)]
        log.append((time.time(), where, f"{what} write", ids))
        return await write(msgs, *args, **kwargs)

    comm.read, comm.write = timed_read, timed_write


class SchedulerStamps(SchedulerPlugin):
    """Task transitions on the scheduler, and its comms to the client and the ranks."""

    name = "timeline-scheduler"

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler._timeline = self.log = []
        handler = scheduler.stream_handlers["update-graph"]

        async def update_graph(**kwargs: Any) -> Any:
            ids = [f"update-graph:{_seg(k)}" for k in kwargs.get("keys", ())]
            self.log.append((time.time(), "scheduler", "update-graph handler start", ids))
            try:
                return await handler(**kwargs)
            finally:
                self.log.append((time.time(), "scheduler", "update-graph handler end", ids))

        scheduler.stream_handlers["update-graph"] = update_graph

    def wrap_intake(self) -> None:
        """The dask_monarch intake's handler, once a controller registered it."""
        from dask_monarch.controller.intake import OP

        handler = self.scheduler.stream_handlers.get(OP)
        if handler is None or getattr(handler, "_timeline", False):
            return

        def intake(**kwargs: Any) -> Any:
            ids = [f"intake:{_seg(s[0])}" for s in kwargs.get("segments", ())]
            self.log.append((time.time(), "scheduler", "intake handler start", ids))
            try:
                return handler(**kwargs)
            finally:
                self.log.append((time.time(), "scheduler", "intake handler end", ids))

        intake._timeline = True
        self.scheduler.stream_handlers[OP] = intake

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        self.log.append((time.time(), "scheduler", f"{start}->{finish}", [f"task:{_seg(key)}"]))


def _wrap_scheduler_comms(dask_scheduler: Any = None) -> None:
    log = dask_scheduler._timeline
    dask_scheduler.plugins[SchedulerStamps.name].wrap_intake()
    for addr, bcomm in dask_scheduler.stream_comms.items():
        _wrap_comm(bcomm.comm, log, "scheduler", f"worker {addr}")
    for bcomm in dask_scheduler.client_comms.values():
        _wrap_comm(bcomm.comm, log, "scheduler", "client")


def _scheduler_log(dask_scheduler: Any = None) -> list:
    log = list(dask_scheduler._timeline)
    dask_scheduler._timeline.clear()
    return log


class WorkerStamps(WorkerPlugin):
    """Task transitions on a worker, its lanes starting, its reports and its comms."""

    name = "timeline-worker"

    def setup(self, worker: Any) -> None:
        self.worker = worker
        worker._timeline = self.log = []

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        self.log.append(
            (time.time(), self.worker.address, f"{start}->{finish}", [f"task:{_seg(key)}"])
        )


def _wrap_worker(dask_worker: Any = None) -> None:
    from dask_monarch.worker.rank import RankState

    log = dask_worker._timeline
    where = dask_worker.address
    _wrap_comm(dask_worker.batched_stream.comm, log, where, "scheduler")
    if not getattr(RankState, "_timeline", False):
        RankState._timeline = True
        run_segment, report, deliver = RankState.run_segment, RankState.report, RankState._deliver

        def timed_run_segment(self, label, index, payload, steps=None):
            on = "event loop" if threading.current_thread() is threading.main_thread() else "lane"
            ids = [f"task:{self.rank}/{label}/{index}"]
            log.append((time.time(), where, f"segment starts ({on})", ids))
            return run_segment(self, label, index, payload, steps)

        def timed_report(self, item):
            log.append((time.time(), where, "report made", list(_ids(item))))
            return report(self, item)

        def timed_deliver(self, item):
            log.append((time.time(), where, "report on the loop", list(_ids(item))))
            if self._stream is not None:
                _wrap_comm(self._stream.comm, log, where, "report")
            return deliver(self, item)

        RankState.run_segment, RankState.report = timed_run_segment, timed_report
        RankState._deliver = timed_deliver


def _worker_log(dask_worker: Any = None) -> list:
    log = list(dask_worker._timeline)
    dask_worker._timeline.clear()
    return log


def noop_now(i: int) -> float:
    """The bare Dask task: returns when it started (the worker's clock)."""
    return time.time()


# -- the two round trips -------------------------------------------------------------------------


class ClientStamps:
    """The client's own stamps: the benchmark's steps and wrappers around the controller."""

    def __init__(self, client: Client, controller: Any) -> None:
        self.log: list = []
        self.plans: list = []
        log = self.log
        compile_, get = controller._compiler.compile, client.get
        send, send_safe = client._send_to_scheduler, client._send_to_scheduler_safe

        def timed_compile(*args: Any, **kwargs: Any) -> Any:
            log.append((time.time(), "client", "compile start", []))
            plan = compile_(*args, **kwargs)
            ids = [f"task:{_seg(k)}" for k in plan.keys]
            log.append((time.time(), "client", "compiled", ids))
            self.plans.append(plan.keys)
            return plan

        def timed_get(*args: Any, **kwargs: Any) -> Any:
            out = get(*args, **kwargs)
            log.append((time.time(), "client", "graph handed to Dask", []))
            return out

        def timed_send(msg: dict) -> Any:
            log.append((time.time(), "client", "message queued for the loop", list(_ids(msg))))
            return send(msg)

        def timed_send_safe(msg: dict) -> Any:
            log.append((time.time(), "client", "loop sends it", list(_ids(msg))))
            return send_safe(msg)

        controller._compiler.compile, client.get = timed_compile, timed_get
        client._send_to_scheduler, client._send_to_scheduler_safe = timed_send, timed_send_safe
        client.sync(self._wrap, client, controller)

    async def _wrap(self, client: Client, controller: Any) -> None:
        _wrap_comm(client.scheduler_comm.comm, self.log, "client", "scheduler")
        for comm in controller._reports.comms.values():
            _wrap_comm(comm, self.log, "client", "report")
        on_reports = controller._reports.on_reports

        def timed_on_reports(rank: int, batch: Any) -> Any:
            out = on_reports(rank, batch)
            ids = [i for m in _flatten(batch) for i in _ids(m)]
            self.log.append((time.time(), "client", "reports applied", ids))
            return out

        controller._reports.on_reports = timed_on_reports

    def mark(self, event: str, ids: list | None = None) -> None:
        self.log.append((time.time(), "client", event, ids or []))


def install_stamps(client: Client, controller: Any) -> ClientStamps:
    """Stamp what every process of ``client``'s cluster does for ``controller``; the comms
    are wrapped by :func:`wrap_comms`, once they exist."""
    if __name__ != "__main__":  # imported by another benchmark: the others cannot import it
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    client.register_plugin(SchedulerStamps())
    client.register_plugin(WorkerStamps(), name=WorkerStamps.name)
    return ClientStamps(client, controller)


def wrap_comms(client: Client) -> None:
    """Wrap the scheduler's and the workers' comms that exist by now (again once more do)."""
    client.run_on_scheduler(_wrap_scheduler_comms)
    client.run(_wrap_worker)


def take_log(client: Client, stamps: ClientStamps) -> list:
    """Every process's stamps so far; each process's list starts empty again."""
    log = list(stamps.log)
    stamps.log.clear()  # in place: the wrappers append to this list
    log += client.run_on_scheduler(_scheduler_log)
    for entries in client.run(_worker_log).values():
        log += entries
    return log


def segment_ids(keys: list) -> set[str]:
    """What identifies the stamps of the segments ``keys`` (see :func:`hops`)."""
    return {str(_seg(k)) for k in keys}


def monarch_round(x: Any, stamps: ClientStamps) -> tuple[Any, dict]:
    """One op and one fetch; returns the new value and what identifies this round trip."""
    stamps.mark("start")
    t0 = time.time()
    x = x + 1
    stamps.mark("op issued")
    future = dm.fetch_shard(x)
    future.result()
    stamps.mark("user thread woken")
    keys = stamps.plans[-1] if stamps.plans else []
    ids = segment_ids(keys) | {f"seq{future.seq}"}
    return x, {"t0": t0, "ids": ids, "seq": future.seq, "end": time.time()}


def dask_round(client: Client, i: int, stamps: ClientStamps) -> dict:
    stamps.mark("start")
    t0 = time.time()
    future = client.submit(noop_now, i, pure=False, workers=[stamps.rank0])
    key = future.key
    stamps.mark("submit returned", [f"task:{key}"])
    started = future.result()
    stamps.mark("user thread woken", [f"task:{key}"])
    return {"t0": t0, "ids": {str(key)}, "started": started, "end": time.time()}


# -- the table -----------------------------------------------------------------------------------


def _matches(stamp_ids: list, ids: set) -> bool:
    """Whether a stamp is about this round trip (``op:key``, ``Status:seqN:rankR``, ...)."""
    return any(part in ids for s in stamp_ids for part in s.split(":"))


def hops(rounds: list[dict], log: list, ranks: dict[str, str]) -> dict[str, list[float]]:
    """Per hop (first stamp of each kind after the round began): ms since the round began."""
    log = sorted(log, key=lambda s: s[0])
    out: dict[str, list[float]] = defaultdict(list)
    for r in rounds:
        t0, end, ids = r["t0"], r["end"], r["ids"]
        seen: dict[str, float] = {}
        for t, where, event, stamp_ids in log:
            if t < t0 - 1e-4 or t > end + 0.05:
                continue
            if where == "client" and event in ("start", "op issued", "compile start"):
                label = f"client: {event}"
            elif not _matches(stamp_ids, ids):
                continue
            else:
                rank = ranks.get(where, where)
                event = " ".join(ranks.get(w, w) for w in event.split(" "))
                if event.startswith(("report", "reports")):
                    kinds = {s.split(":")[0] for s in stamp_ids if _matches([s], ids)}
                    labels = [f"{rank}: {event} ({kind})" for kind in sorted(kinds)]
                else:
                    labels = [f"{rank}: {event}"]
                for label in labels:
                    seen.setdefault(label, t)
                continue
            seen.setdefault(label, t)
        for label, t in seen.items():
            out[label].append((t - t0) * 1e3)
        if "started" in r:
            out[f"{ranks.get('task', 'rank 0')}: the function runs"].append(
                (r["started"] - t0) * 1e3
            )
        out["total"].append((end - t0) * 1e3)
    return out


def print_table(title: str, table: dict[str, list[float]], n: int) -> None:
    """The hops in time order; the total where the caller got its answer, so that the rows
    after it are the bookkeeping that followed (``hops`` looks 50 ms past the end)."""
    print(f"\n{title} (median ms since the round trip began, over {n} round trips)")
    rows = sorted((statistics.median(v), label, len(v)) for label, v in table.items())
    prev = 0.0
    print(f"{'hop':<62}{'ms':>8}{'+ms':>8}{'seen':>6}")
    for ms, label, count in rows:
        if label == "total":
            print(f"{'total (the caller has the answer)':<62}{ms:>8.2f}{ms - prev:>8.2f}")
        else:
            print(f"{label:<62}{ms:>8.2f}{ms - prev:>8.2f}{count:>6}")
        prev = ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="round trips of each kind per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    args = parser.parse_args()

    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        mesh = dm.device_mesh(client, gpu=2)
        controller = mesh._session.controller
        ranks = {addr: f"rank {r}" for r, addr in enumerate(controller.workers)}
        stamps = install_stamps(client, controller)
        stamps.rank0 = controller.workers[0]
        ranks["task"] = "rank 0"
        with mesh.activate():
            x = torch.zeros(())
            dm.inspect(x)
            client.submit(noop_now, 0, pure=False, workers=[stamps.rank0]).result()
            wrap_comms(client)
            dm.inspect(x)
            for _ in range(3):  # warm: every comm wrapped, a read pending on each
                x, _ = monarch_round(x, stamps)
                dask_round(client, -1, stamps)
            take_log(client, stamps)
            mon, bare = [], []
            for _ in range(args.rounds):
                for _i in range(args.n):
                    x, r = monarch_round(x, stamps)
                    mon.append(r)
                for i in range(args.n):
                    bare.append(dask_round(client, i, stamps))
        log = take_log(client, stamps)
        mesh.exit()

    print(f"torch {torch.__version__}; {args.rounds} alternating rounds of {args.n}")
    print_table(
        "dask_monarch: x = x + 1, then fetch_shard(x).result()", hops(mon, log, ranks), len(mon)
    )
    print_table(
        "bare Dask: client.submit(noop, workers=[rank 0]).result()",
        hops(bare, log, ranks),
        len(bare),
    )


if __name__ == "__main__":
    main()
