"""The client side of remote debugging: find paused ranks, drive their pdb, tell the user.

A rank stopped in pdb (:mod:`dask_monarch.worker.debugger`) is driven over
Dask alone: ``Client.run`` lists every worker's open sessions and exchanges
one command for pdb's output, on the worker's event loop. So any client of
the scheduler can attach: the controller's own process (a notebook cell,
the ``dask-monarch run`` terminal) and ``dask-monarch debug`` from another
terminal. The controller learns of each pause from the rank's
``DebuggerPaused`` report: it prints where the rank stopped and how to
attach (:func:`notice`), and a blocking wait in a process with an
interactive stdin attaches at once (:func:`attend`, ``dask_monarch.debug.attach``).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from ..protocol.liveness import lane_name
from ..protocol.names import mesh_id
from ..protocol.wire import DebuggerPaused
from ..worker import debug_exchange, list_debug_sessions

EXCHANGE_S = 5.0  # one Client.run waits this long for pdb's answer, then asks again


class Paused(NamedTuple):
    """A lane stopped in pdb, as its worker lists it."""

    session: str
    token: str
    rank: int
    stream: Any
    stream_title: str
    seq: int
    where: str
    since: float
    worker: str
    waiting: bool

    @property
    def mesh(self) -> str:
        """The id of the paused rank's mesh, as every message and the dashboard name it."""
        return mesh_id(self.token)

    def describe(self) -> str:
        return (
            f"rank {self.rank}, {self.stream_title}, seq {self.seq} (mesh {self.mesh}): "
            f"at {self.where}"
        )


class Reply(NamedTuple):
    """What pdb printed after a command; ``ended``: the session closed (``c``, ``q``)."""

    output: str
    ended: bool
    waiting: bool


def paused(client: Any, mesh: str | None = None, rank: int | None = None) -> list[Paused]:
    """Every lane paused in pdb on the cluster (of the mesh with id ``mesh``, of ``rank``)."""
    replies = client.run(list_debug_sessions, None, on_error="ignore")
    found = [Paused(**info) for infos in replies.values() for info in infos or ()]
    if mesh is not None:
        found = [p for p in found if p.mesh == mesh]
    if rank is not None:
        found = [p for p in found if p.rank == rank]
    return sorted(found, key=lambda p: (p.since, p.token, p.rank))


def wait_for(client: Any, mesh: str | None, rank: int | None, timeout: float | None) -> Paused:
    """The first session of ``rank`` (any rank: None) that opens within ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        found = paused(client, mesh, rank)
        if found:
            return found[0]
        if deadline is not None and time.monotonic() > deadline:
            who = "no rank" if rank is None else f"rank {rank}"
            of = f" of mesh {mesh}" if mesh else ""
            raise TimeoutError(
                f"{who}{of} paused in the debugger within {timeout}s (a breakpoint() or "
                "dm.breakpoint() in a remote or compiled function pauses a rank)"
            )
        time.sleep(0.1)


def send(
    client: Any,
    target: Paused,
    line: str | None,
    timeout: float = EXCHANGE_S,
    attach: bool = False,
) -> Reply:
    """Give ``line`` to ``target``'s pdb (None: nothing) and return what it printed
    (``attach``: everything since its last command, its header and prompt included)."""
    reply = client.run(
        debug_exchange, target.session, line, timeout, attach, workers=[target.worker]
    )
    answer = reply[target.worker]
    return Reply(answer["output"], answer["ended"], answer["waiting"])


def drive(
    client: Any,
    target: Paused,
    commands: Iterable[str] | None = None,
    write: Callable[[str], Any] | None = None,
    read: Callable[[], str] = input,
) -> str:
    """Run pdb commands on ``target``; returns what the session showed (commands echoed).

    ``commands`` None reads them with ``read`` (``input``) until the session
    ends; EOF or Ctrl-C detaches and leaves the rank paused. Given commands,
    the session stays paused after the last one unless it was ``c`` or ``q``.
    """
    transcript: list[str] = []

    def show(text: str) -> None:
        transcript.append(text)
        if write is not None and text:
            write(text)

    reply = _settle(client, target, send(client, target, None, attach=True), show)
    queue = iter(commands) if commands is not None else None
    while not reply.ended:
        if queue is not None:
            line = next(queue, None)
            if line is None:
                break
            show(line + "\n")
        else:
            try:
                line = read()
            except (EOFError, KeyboardInterrupt):
                show(f"\ndetached: rank {target.rank} stays paused\n")
                break
            transcript.append(line + "\n")
        reply = _settle(client, target, send(client, target, line), show)
    return "".join(transcript)


def _settle(client: Any, target: Paused, reply: Reply, show: Callable[[str], None]) -> Reply:
    """Show ``reply``; while the lane runs (a ``n`` over a long call) wait for the next prompt."""
    show(reply.output)
    while not (reply.ended or reply.waiting):
        reply = send(client, target, None)
        show(reply.output)
    return reply


def continue_all(client: Any, mesh: str | None = None) -> list[Paused]:
    """Send ``c`` to every paused lane (of the mesh with id ``mesh``); returns those resumed."""
    resumed = []
    for target in paused(client, mesh):
        send(client, target, "c", timeout=1.0)
        resumed.append(target)
    return resumed


# -- the controller's side ----------------------------------------------------------------------


def notice(item: DebuggerPaused, mesh: str, scheduler: str) -> str:
    """What the controller's user reads when a rank of theirs stops in pdb."""
    return (
        f"dask_monarch: rank {item.rank}, {lane_name(item.lane)}, seq {item.seq} of mesh "
        f"{mesh} paused in the debugger at {item.where}. Attach here with "
        f"dm.debug.attach({item.rank}) (or a blocking call from an interactive terminal does), "
        f"or from a shell: dask-monarch debug --scheduler-address {scheduler}. "
        "'c' resumes it, 'q' fails the call; collectives with it wait meanwhile."
    )


_attending = threading.local()
_declined: set[str] = set()  # sessions whose user detached: not attached again by a wait
_announced: set[str] = set()  # sessions whose notice the user's own thread printed
logger = logging.getLogger("dask_monarch.controller")


def announce(item: DebuggerPaused, mesh: str, scheduler: str, from_loop: bool = False) -> None:
    """Print :func:`notice` on stderr, once per session and thread kind.

    The event loop prints at once (a terminal sees it as the rank stops). In
    a notebook kernel, output of the event loop's thread lands in the cell
    that started it, so there the notice is printed by the user's thread
    instead, when it next waits (:func:`attend`).
    """
    text = notice(item, mesh, scheduler)
    if from_loop:
        logger.info("%s", text)
        if _in_kernel():
            return
    elif item.session in _announced:
        return
    else:
        _announced.add(item.session)
    print(text, file=sys.stderr, flush=True)


def _in_kernel() -> bool:
    return type(sys.stderr).__module__.startswith("ipykernel")


def interactive(mode: Any = "auto") -> bool:
    """May a wait ask this process's user for pdb commands? ``mode`` is ``debug.attach``:
    ``auto`` when stdin is a terminal or the notebook kernel allows input."""
    if mode in (False, "false", "never", "no"):
        return False
    if mode in (True, "true", "always", "yes"):
        return True
    ipython = sys.modules.get("IPython")
    if ipython is not None:
        shell = ipython.get_ipython() if hasattr(ipython, "get_ipython") else None
        kernel = getattr(shell, "kernel", None)
        if kernel is not None:
            return bool(getattr(kernel, "_allow_stdin", False))
    stdin = sys.stdin
    try:
        return stdin is not None and stdin.isatty()
    except (ValueError, OSError):
        return False


def attend(client: Any, mesh: str, debugging: dict, mode: Any = "auto") -> bool:
    """In a blocking wait: attach the user to this controller's paused lanes, one after another.

    ``debugging`` is the reports' session -> ``DebuggerPaused`` table. Only
    with an interactive stdin (:func:`interactive` of ``mode``, the controller's
    ``debug.attach``); never re-entered; a
    session the user detached from is left alone. True if it attached.
    """
    if getattr(_attending, "busy", False):
        return False
    items = list(debugging.values())
    if _in_kernel():
        scheduler = client.scheduler.address
        for item in items:
            announce(item, mesh, scheduler)
    if not interactive(mode):
        return False
    pending = [item for item in items if item.session not in _declined]
    if not pending:
        return False
    _attending.busy = True
    try:
        for item in sorted(pending, key=lambda i: i.rank):
            target = next((p for p in paused(client, mesh) if p.session == item.session), None)
            if target is None:
                continue
            text = drive(client, target, None, write=_write)
            if "\ndetached:" in text:
                _declined.add(item.session)
        return True
    finally:
        _attending.busy = False


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
