"""Rank trace records as a Chrome/Perfetto trace: a track per rank and stream, flows between them.

The ranks record ``(lane, kind, name, start, end, args)`` tuples
(:mod:`dask_monarch.worker.tracing`); :func:`chrome_trace` lays them out in
the Trace Event Format that ui.perfetto.dev and chrome://tracing open:

* one process per rank (``pid`` = rank; a second mesh's ranks follow at
  ``pid`` = 1000 * mesh + rank), one thread per stream (``tid`` = stream id;
  the control steps get the first id no stream uses, shown first);
* a complete event (``ph: X``) per segment, per message and per wait, nested
  in that order; timestamps in microseconds since the trace began;
* flows (``ph: s`` / ``f``) from a borrow's producer to its consumer
  (``BorrowCreate`` -> ``BorrowFirstUse``, and back at ``BorrowLastUse`` ->
  ``BorrowDrop``), from the first member of each collective to every other
  member, and from each sender of a ``SendTensor`` to its receiver.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from ..protocol.wire import CONTROL

_PIDS_PER_MESH = 1000


def chrome_trace(meshes: list[list[dict]], origin: float) -> dict:
    """The trace of ``meshes`` (per mesh, each rank's :meth:`Controller.collect_trace` reply),
    times relative to ``origin`` (seconds, the client's wall clock)."""
    events: list[dict] = []
    flows: list[dict] = []
    ids = itertools.count(1)
    dropped = 0
    for index, ranks in enumerate(meshes):
        slices: list[tuple[dict, str, dict]] = []  # (event, record name, args) for the flows
        for reply in ranks:
            pid = index * _PIDS_PER_MESH + reply["rank"]
            dropped += reply.get("dropped", 0)
            labels = {label for label, *_ in reply["records"]} | set(reply["lanes"])
            tids = _tids(labels)
            mesh = f" (mesh {index})" if index else ""
            events.append(_meta("process_name", pid, 0, f"rank {reply['rank']}{mesh}"))
            events.append(_meta("process_sort_index", pid, 0, pid, key="sort_index"))
            for label, tid in tids.items():
                title = reply["lanes"].get(label) or (
                    "control steps" if label == CONTROL else f"stream {label}"
                )
                events.append(_meta("thread_name", pid, tid, title))
                sort = -1 if label == CONTROL else tid
                events.append(_meta("thread_sort_index", pid, tid, sort, key="sort_index"))
            for label, kind, name, start, end, args in reply["records"]:
                event = {
                    "ph": "X",
                    "cat": kind,
                    "name": name,
                    "pid": pid,
                    "tid": tids[label],
                    "ts": _us(start - origin),
                    "dur": _us(max(end - start, 0.0)),
                    "args": args,
                }
                events.append(event)
                if kind == "message":
                    slices.append((event, name, args))
        flows.extend(_flows(slices, ids))
    # per track: by start time, an enclosing event before what it encloses
    events.sort(
        key=lambda e: (e["ph"] != "M", e["pid"], e["tid"], e.get("ts", 0), -e.get("dur", 0))
    )
    trace = {"traceEvents": events + flows, "displayTimeUnit": "ms"}
    if dropped:
        trace["otherData"] = {"dropped_records": dropped}
    return trace


def _tids(labels: set) -> dict[Any, int]:
    """Stream id -> tid (itself); the control lane gets the first id no stream of the rank has."""
    tids = {label: int(label) for label in labels if label != CONTROL}
    if CONTROL in labels:
        tids[CONTROL] = next(i for i in itertools.count() if i not in tids.values())
    return tids


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _meta(name: str, pid: int, tid: int, value: Any, key: str = "name") -> dict:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {key: value}}


def _flows(slices: list[tuple[dict, str, dict]], ids) -> list[dict]:
    """Flow arrows between the messages of one mesh that meet (see the module docs)."""
    borrows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    collectives: dict[int, list[dict]] = defaultdict(list)
    sends: dict[int, list[tuple[dict, dict]]] = defaultdict(list)
    for event, name, args in slices:
        if name.startswith("Borrow"):
            borrows[(event["pid"], args.get("borrow"))][name] = event
        elif name == "Reduce":
            collectives[args["result"]].append(event)
        elif name == "SendTensor":
            sends[args["result"]].append((event, args))
    out: list[dict] = []
    for (_, borrow), steps in borrows.items():
        for src, dst, what in (
            ("BorrowCreate", "BorrowFirstUse", "lent"),
            ("BorrowLastUse", "BorrowDrop", "returned"),
        ):
            if src in steps and dst in steps:
                out += _arrow(
                    next(ids), f"borrow {borrow} {what}", "borrow", steps[src], steps[dst]
                )
    for result, members in collectives.items():
        members.sort(key=lambda e: e["ts"])
        for member in members[1:]:
            out += _arrow(next(ids), f"Reduce r{result}", "collective", members[0], member)
    for result, parts in sends.items():
        receivers = {(e["pid"], a["from"]): e for e, a in parts if "from" in a}
        for event, args in parts:
            if "to" not in args:
                continue
            base = event["pid"] - event["pid"] % _PIDS_PER_MESH
            sender = event["pid"] - base
            receiver = receivers.get((base + args["to"], sender))
            if receiver is not None and receiver is not event:
                out += _arrow(next(ids), f"SendTensor r{result}", "send", event, receiver)
    return out


def _arrow(flow_id: int, name: str, cat: str, src: dict, dst: dict) -> list[dict]:
    """A flow from inside ``src`` to inside ``dst`` (bound to the enclosing slices), pointing
    forward in time where ``dst`` allows (a consumer that waited began before its producer;
    a member of a collective that came late may end before the first one's middle)."""
    common = {"name": name, "cat": cat, "id": flow_id, "bp": "e"}
    dst_end = round(dst["ts"] + dst["dur"], 3)
    start = max(src["ts"], min(round(src["ts"] + src["dur"] / 2, 3), dst_end))
    end = min(max(start, dst["ts"]), dst_end)
    return [
        {**common, "ph": "s", "pid": src["pid"], "tid": src["tid"], "ts": start},
        {**common, "ph": "f", "pid": dst["pid"], "tid": dst["tid"], "ts": end},
    ]
