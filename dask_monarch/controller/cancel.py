"""``mesh.exit(cancel=True)`` on the client: release the ranks now and say what was stopped.

The ranks do the interrupting (``worker/cancel.py``); this gathers what each
busy lane was running and where, and warns once with all of it. A call that
did not stop within ``dask_monarch.timeouts.cancel`` is in C code: it still
holds its lane's thread and an execution slot on its worker until it returns,
and the warning names the worker whose restart frees them.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .. import config

if TYPE_CHECKING:
    from .session import Session


def cancel_session(session: Session) -> None:
    """Release ``session``'s ranks at once, interrupting their running calls; warn with what
    was interrupted (nothing queued or buffered runs after this)."""
    grace = config.seconds("timeouts.cancel") or 0.0
    try:
        lanes = session.controller.cancel_running(grace)
    finally:
        session.closed = True
        session.controller.close(timeout=0)
    if lanes:
        warnings.warn(report(lanes, grace), RuntimeWarning, stacklevel=4)


def report(lanes: list[dict], grace: float) -> str:
    """What ``mesh.exit(cancel=True)`` found running, one line per lane."""
    lines, stuck = [], []
    for lane in lanes:
        what = f"seq {lane['seq']}" if lane["seq"] >= 0 else "its first message"
        if lane["doing"]:
            what += f", waiting on {lane['doing']}"
        where = f" {lane['where']}" if lane["where"] else ""
        if lane["stopped"]:
            state = "interrupted" if not lane["doing"] else "stopped waiting"
        else:
            state = f"still running after {grace:g}s (in C code, which cannot be interrupted)"
            stuck.append(lane["worker"])
        lines.append(f"  rank {lane['rank']} {lane['lane']}: {what}{where}: {state}")
    text = "mesh.exit(cancel=True) stopped the mesh's ranks:\n" + "\n".join(lines)
    if stuck:
        workers = sorted(set(stuck))
        text += (
            f"\nthe calls still running hold their lane's thread and an execution slot until "
            f"they return; client.restart_workers({workers}) restarts their workers to free them"
        )
    return text
