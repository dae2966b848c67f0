"""What a lane is blocked on, in words: one text for liveness warnings, timeouts and the dashboard.

A worker describes each of its lanes as a :class:`~dask_monarch.protocol.wire.LaneProgress`
(to its controller's heartbeat and to the dashboard). The controller's
``LivenessWarning``, the ``TimeoutError`` of a blocking call and the
``/monarch/`` page all turn it into words here, so the user reads the same
sentence wherever a rank is stuck: the rank, the stream, the seq, what the
lane waits on, and which peers of a collective or send are not there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .wire import CONTROL, LaneProgress

LanesOf = Callable[[int], "Mapping[Any, LaneProgress] | None"]  # a rank's lanes, None: unknown
OutstandingOf = Callable[[int, Any], "int | None"]  # segments sent to a lane and not yet run


def lane_name(lane: Any, name: str | None = None) -> str:
    """``control steps``, ``stream 7``, or with the name the user gave it ``stream 'comms' (7)``."""
    if lane == CONTROL:
        return "control steps"
    return f"stream {name!r} ({lane})" if name is not None else f"stream {lane}"


def _seq(seq: int) -> str:
    return f"seq {seq}" if seq >= 0 else "its first seq"


def position(p: LaneProgress) -> str:
    """Where a waiting lane is: in seq N, or between the seq it started last and the next."""
    if p.seq is not None:
        return f"seq {p.seq}"
    parts = [f"after seq {p.last_seq}"] if p.last_seq >= 0 else []
    if p.next_seq is not None:
        parts.append(f"before seq {p.next_seq}")
    return ", ".join(parts) or "before its first seq"


def stuck_seq(p: LaneProgress) -> int:
    """The seq a stalled lane holds back: the one it waits in, the next one, or its last."""
    if p.seq is not None:
        return p.seq
    return p.next_seq if p.next_seq is not None else p.last_seq


def status(p: LaneProgress, outstanding: int | None = None) -> str:
    """``p`` in words: at which seq the lane is, and what it runs or waits on.

    ``outstanding`` (known to the controller only) is how many segments sent
    to the lane have not run: an idle lane that has some never got its task.
    """
    if p.state == "waiting":
        return f"{position(p)}: waiting {p.for_s:.1f}s on {p.doing}"
    if p.state == "running":
        if p.doing:
            return f"after {_seq(p.last_seq)}: running {p.doing} for {p.for_s:.1f}s"
        where = f", {p.where}" if p.where else ""
        return f"{_seq(p.last_seq)}: running for {p.for_s:.1f}s{where}"
    done = f"idle after seq {p.done_seq}" if p.done_seq >= 0 else "idle"
    if outstanding:
        return (f"{done}: the next segment sent to it has not started "
                "(its Dask task has not run yet)")
    if outstanding == 0:
        return f"{done}: it has run everything sent to it"
    return done


def missing_peers(rank: int, p: LaneProgress, lanes_of: LanesOf,
                  outstanding_of: OutstandingOf | None = None) -> list[str]:
    """The peers ``p``'s wait needs that are not in it, each with what it does instead.

    A peer is in the wait when its lane waits too and names ``rank``'s lane
    among its own peers (the same collective, the other end of the send).
    """
    missing = []
    for peer_rank, peer_lane in p.peers:
        where = f"rank {peer_rank} {lane_name(peer_lane)}"
        lanes = lanes_of(peer_rank)
        if lanes is None:
            missing.append(f"{where} (unknown: its worker has not answered yet)")
            continue
        q = lanes.get(peer_lane)
        if q is None:
            missing.append(f"{where} (the stream does not exist there)")
        elif q.state != "waiting" or (rank, p.lane) not in q.peers:
            outstanding = outstanding_of(peer_rank, peer_lane) if outstanding_of else None
            missing.append(f"{where} ({status(q, outstanding)})")
    return missing


def explain(rank: int, p: LaneProgress, lanes_of: LanesOf,
            outstanding_of: OutstandingOf | None = None) -> str:
    """:func:`status` of ``rank``'s lane ``p``, and the peers its wait needs that are not in it."""
    outstanding = outstanding_of(rank, p.lane) if outstanding_of else None
    text = status(p, outstanding)
    if p.state == "waiting" and p.peers:
        missing = missing_peers(rank, p, lanes_of, outstanding_of)
        if missing:
            text += "; still waiting for " + ", ".join(missing)
    return text


def describe(rank: int, p: LaneProgress, lanes_of: LanesOf,
             outstanding_of: OutstandingOf | None = None) -> str:
    """``rank r, stream s: <what explain says>``."""
    return f"rank {rank}, {lane_name(p.lane)}: {explain(rank, p, lanes_of, outstanding_of)}"


def from_snapshot(lane: Mapping[str, Any]) -> LaneProgress:
    """A lane of the worker's dashboard snapshot (JSON-shaped) as a LaneProgress."""
    return LaneProgress(
        lane["stream"], lane["state"], lane["doing"], lane.get("seq"), lane.get("next_seq"),
        lane["last_seq"], lane["done_seq"], lane["segments"], lane.get("for_s", 0.0),
        tuple(tuple(peer) for peer in lane.get("peers", ())), lane.get("where", ""))
