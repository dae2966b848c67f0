"""``MeshFuture``: the value of a fetch, resolving once every rank has passed it.

A :class:`MeshFuture` is a ``concurrent.futures.Future`` (``result``,
``done``, ``add_done_callback``, ``concurrent.futures.wait``), awaitable, and
never waits past a broken or exited mesh. It is not a ``distributed.Future``:
its value lives in this process. Dask's tools that find it by type or by
protocol refuse it saying what to call instead (docs/dask.md §5);
``dm.gather`` resolves it beside Dask futures.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING, Any

from .controller import fresh_copy

if TYPE_CHECKING:
    from .seam import ControllerSeam
    from .session import Session


class MeshFuture(concurrent.futures.Future):
    """The value of a fetch: resolves once every rank has passed it (``.result()``)."""

    def __init__(self, session: Session, seq: int, ranks: int = 1) -> None:
        super().__init__()
        self._session = session
        self.seq = seq
        self.ranks = ranks  # values expected: one per rank, returned as a list when > 1
        self.check: Any = None  # called with the value before result() returns it

    def result(self, timeout: float | None = None) -> Any:
        """The value; waits ``timeout`` seconds at most (None: until it resolves).

        Never waits past a broken mesh (its DeviceException is raised) or an
        exited one; a TimeoutError names the lanes still running and what they
        wait on, as a LivenessWarning does.
        """
        controller = self._session.controller
        if not self.done() and not controller.can_wait_for_ranks():
            # the ranks' reports arrive on this very thread: the wait could never end, and
            # it would stop the loop (heartbeats, every mesh of the client) meanwhile
            raise RuntimeError(
                f"the fetch of seq {self.seq} cannot be waited for on the Dask client's event "
                "loop thread (a done callback of a MeshFuture runs there): the ranks' "
                "reports arrive on that thread. Wait for it elsewhere (in your own thread, "
                "or `await` it in async code), or read it in a later done callback"
            )
        controller.flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                value = super().result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                if controller.debugging:  # a rank stopped in pdb: its user may drive it here
                    controller.attend_debugger()
                broken = controller.broken
                if broken is not None:
                    raise fresh_copy(broken) from None
                if controller.closed and not self.done():
                    raise RuntimeError(
                        f"the mesh was exited before the fetch of seq {self.seq} resolved"
                    ) from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the fetch of seq {self.seq} did not resolve within "
                        f"{timeout}s: {waiting_for(controller)}"
                    ) from None
            except Exception as e:  # failed: its own copy (see fresh_copy)
                raise fresh_copy(e) from None
            else:
                if self.check is not None:
                    self.check(value)
                return value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The failure (any type: a DryRunError, an exited mesh's RuntimeError too), or None;
        only a wait past ``timeout`` raises (TimeoutError), as ``concurrent.futures`` does."""
        try:
            self.result(timeout)
        except TimeoutError:
            if self.done():  # the fetch itself failed with one
                return super().exception(timeout=0)
            raise
        except Exception as e:
            return e
        return None

    # -- the ways Dask and asyncio users wait ---------------------------------------------------

    def __await__(self) -> Any:
        """``await f``: the value, without blocking the event loop (a notebook's, say)."""
        return self._result_async().__await__()

    async def _result_async(self) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        resolved = asyncio.Event()

        def wake(_: concurrent.futures.Future) -> None:
            try:
                loop.call_soon_threadsafe(resolved.set)
            except RuntimeError:  # the loop closed while we waited
                pass

        self.add_done_callback(wake)
        controller = self._session.controller
        await loop.run_in_executor(None, controller.flush)
        while not self.done():
            try:
                await asyncio.wait_for(resolved.wait(), 0.05)
            except asyncio.TimeoutError:
                if controller.broken is not None or controller.closed:
                    break  # result() raises what happened
        return await loop.run_in_executor(None, self.result)

    # Dask finds futures by type and by protocol; each hook it reads here refuses, so no Dask
    # tool answers silently and wrongly. Client.gather reads none, and hands a MeshFuture
    # back as it is: dm.gather resolves both kinds (controller/gather.py, docs/dask.md §5).

    def __dask_graph__(self) -> Any:
        """Refuse Dask's collection helpers: ``distributed.wait``, ``progress``, ``compute``
        would otherwise see no Dask future here and answer at once, wrongly."""
        raise TypeError(
            _not_for_dask(self, "distributed.wait/as_completed/progress, compute and delayed")
        )

    @property
    def __dask_future__(self) -> bool:
        """Refuse being a task's argument (``client.submit(fn, f)``, ``client.map``): the
        scheduler would wait for a key no worker holds."""
        raise TypeError(_not_for_dask(self, "client.submit/map and task graphs"))

    def __dask_tokenize__(self) -> Any:
        """Refuse Dask's tokenizing (``client.submit``, ``client.scatter`` hash arguments)."""
        raise TypeError(_not_for_dask(self, "client.submit/map/scatter and task graphs"))

    def __reduce__(self) -> Any:
        """Refuse pickling (a remote function's argument, ``client.run``): the value lives in
        this process only, and may not have arrived yet."""
        raise TypeError(_not_for_dask(self, "pickling (a remote function's arguments)"))

    def __repr__(self) -> str:
        return (
            f"<MeshFuture seq {self.seq}, {self._state.lower()}: a dask_monarch future, not a "
            "distributed.Future: f.result(), await f, concurrent.futures.wait/as_completed>"
        )

    def _repr_html_(self) -> str:
        from html import escape

        state = self._state.lower()
        if state == "finished":
            error = super().exception(timeout=0)
            state = f"failed: {type(error).__name__}" if error is not None else "resolved"
        return (
            f"<div><strong>dask_monarch.MeshFuture</strong> seq {self.seq}: "
            f"{escape(state)}<br><small>f.result() (or <code>await f</code>) waits for the "
            "value</small></div>"
        )


def _not_for_dask(future: MeshFuture, what: str) -> str:
    """The refusal every Dask hook of a MeshFuture raises: what it is, what to call instead."""
    return (
        f"MeshFuture seq {future.seq} ({future._state.lower()}) is a dask_monarch future, not a "
        f"distributed.Future: {what} cannot use it. Get its value with f.result() (or "
        "dask_monarch.gather(f), which takes Dask futures too); `await f` in async code, "
        "[f.result() for f in futures] for several, "
        "dm.inspect(t) to fetch a tensor and wait in one call. Wait for several with "
        "concurrent.futures.wait/as_completed, and pass values, not MeshFutures, to "
        "client.submit/map/scatter and remote functions"
    )


def waiting_for(controller: ControllerSeam) -> str:
    """What a timed-out wait says: the lanes still running and what each waits on."""
    lanes = controller.waiting_for()
    if lanes:
        return f"waiting for {lanes}"
    return "every rank has run everything sent to it, but its reports have not arrived"
