"""Remote debugging from the controller: ``dm.breakpoint()`` and pdb sessions on paused ranks.

``breakpoint()`` or ``dm.breakpoint()`` inside a remote function stops that
rank's lane in pdb (:mod:`dask_monarch.worker.debugger`); called by the
controller (in a compiled function too, where a plain ``breakpoint()`` is
recorded the same way) it stops every rank of the mesh at that point of the
stream, with the local shards of the tensors it was given in ``values``.
The controller prints where each rank stopped; :func:`attach` drives one
(interactively, or with a list of commands), :func:`continue_all` resumes
them, :func:`paused` lists them. ``dask-monarch debug`` does the same from
a shell. docs/debugging.md is the guide.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from .controller.debugging import Paused, drive, wait_for
from .controller.debugging import continue_all as _continue_all
from .controller.debugging import paused as _paused
from .controller.session import live_sessions
from .mesh import DeviceMesh
from .remote_function import Remote
from .tensor import Tensor, active_mesh

_REMOTE_BREAKPOINT = Remote("dask_monarch.worker.debugger.remote_breakpoint", propagate="inspect")


def breakpoint(*tensors: Tensor) -> None:
    """Stop in pdb: this rank, on a rank; every rank of the mesh, on the controller.

    On a rank (inside a remote function) it is ``breakpoint()``. On the
    controller it sends a stop to the ranks of ``tensors``' mesh (or the
    active mesh) on the active stream, after everything sent before: each
    rank pauses with the local shards of ``tensors`` in ``values``. Inside a
    compiled function it is recorded, and every replay stops there.
    """
    from .worker import debug_pause

    if debug_pause(sys._getframe(1), "dm.breakpoint()"):  # on a rank's lane: nothing after it
        return None
    frame = sys._getframe(1)
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    _REMOTE_BREAKPOINT(*tensors, where=where)
    return None


@contextlib.contextmanager
def recorded_breakpoints() -> Iterator[None]:
    """While a compiled function is traced, ``breakpoint()`` in it is ``dm.breakpoint()``."""
    previous = sys.breakpointhook

    def hook(*args: Any, **kwargs: Any) -> None:
        frame = sys._getframe(1)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        _REMOTE_BREAKPOINT(where=where)

    sys.breakpointhook = hook
    try:
        yield
    finally:
        sys.breakpointhook = previous


def _scope(mesh: DeviceMesh | None, client: Any) -> tuple[Any, str | None]:
    """The client to ask and the id of the mesh to filter by (None: every mesh)."""
    if mesh is None and client is None:
        mesh = active_mesh()
        if mesh is None:  # the pause notice's dm.debug.attach(1), after the `with` block
            open_ = live_sessions()
            if len(open_) != 1:
                raise RuntimeError(
                    f"no device mesh is active and {len(open_)} are open: pass mesh= (or "
                    "client= for every mesh's ranks)"
                )
            return open_[0].controller.client, open_[0].controller.mesh_id
    if mesh is not None:
        controller = mesh._session.controller
        return controller.client, controller.mesh_id
    return client, None


def paused(mesh: DeviceMesh | None = None, *, client: Any = None) -> list[Paused]:
    """The lanes of ``mesh``'s controller (default: the active mesh) paused in pdb; with
    ``client=`` only, those of every controller on its cluster."""
    client, mesh_id = _scope(mesh, client)
    return _paused(client, mesh_id)


def attach(
    rank: int | None = None,
    commands: Iterable[str] | None = None,
    *,
    mesh: DeviceMesh | None = None,
    client: Any = None,
    timeout: float | None = 60.0,
    echo: bool = True,
) -> str:
    """Drive the pdb of ``rank`` (None: the first rank that paused); returns the transcript.

    Waits up to ``timeout`` seconds for the rank to pause. ``commands`` None
    reads commands from stdin until ``c`` or ``q`` (EOF detaches and leaves
    it paused); a list runs those commands and returns, the rank still
    paused unless one was ``c`` or ``q``. ``echo`` prints the session as it
    goes (the transcript is returned either way).
    """
    client, mesh_id = _scope(mesh, client)
    target = wait_for(client, mesh_id, rank, timeout)
    write = _print if echo else None
    return drive(client, target, commands if commands is None else list(commands), write)


def continue_all(mesh: DeviceMesh | None = None, *, client: Any = None) -> list[Paused]:
    """Resume (``c``) every paused lane of ``mesh``'s controller (``client=``: of every
    controller); returns those resumed."""
    client, mesh_id = _scope(mesh, client)
    return _continue_all(client, mesh_id)


def _print(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


__all__ = ["Paused", "attach", "breakpoint", "continue_all", "paused", "recorded_breakpoints"]
