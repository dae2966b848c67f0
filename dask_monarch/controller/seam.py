"""The seam between the user API and a controller: what a Session and the concept modules call.

A :class:`~dask_monarch.controller.session.Session` drives either the real
:class:`~dask_monarch.controller.Controller` or, inside ``dm.dry_run``, a
:class:`~dask_monarch.controller.dry.DryController` that compiles and checks
what it is sent and submits nothing. Both satisfy :class:`ControllerSeam`
(Monarch types the same seam: ``TController``); the session swaps them with
:meth:`Session.substitute <dask_monarch.controller.session.Session.substitute>`,
which a stand-in supports through the few more names of :class:`Substitute`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from distributed import Client

    from ..exceptions import DeviceException
    from ..protocol import messages as m

Ranks = Any  # int | Iterable[int] | Slice


@runtime_checkable
class ControllerSeam(Protocol):
    """What the user API calls on the controller of its session."""

    world_size: int
    workers: list[str]  # the rank workers' addresses, by rank
    backend: str  # "auto" or "gloo"
    token: str  # the controller's id (the dashboard's routes)
    mesh_id: str  # the short id users read in errors, logs and the dashboard
    devices: list[str]  # each rank's device ("cpu", "cuda:0"), by rank
    span: tuple[dict, str] | None  # the distributed span (annotation, label) work is issued in
    # run on the client's event loop once the controller broke or closed (the session fails
    # its pending fetches there)
    on_shutdown: Callable[[], None] | None

    @property
    def client(self) -> Client: ...

    @property
    def broken(self) -> DeviceException | None: ...

    @property
    def closed(self) -> bool: ...

    @property
    def debugging(self) -> dict: ...

    def send(self, ranks: Ranks, message: m.WorkerMessage) -> None: ...

    def flush(self) -> None: ...

    def sync(self, timeout: float = 60) -> list: ...

    def drain(self, timeout: float = 60) -> None: ...

    def ranks_idle(self) -> bool: ...

    def can_wait_for_ranks(self) -> bool: ...

    def waiting_for(self) -> str: ...

    def attend_debugger(self) -> bool: ...

    def add_listener(self, listener: Callable[[Any], None], *, consume: bool = False) -> None: ...

    def name_stream(self, stream: m.StreamRef, name: str) -> None: ...

    def drop_stream(self, ranks: Ranks, stream: m.StreamRef) -> None: ...

    def expect_results(
        self, ranks: Ranks, seq: int, stream: m.StreamRef, function: str, results: list
    ) -> None: ...

    def spawn_actor(self, ranks: Ranks, name: str, cls: type, *args: Any, **kwargs: Any) -> Any: ...

    def call_actor(
        self,
        ranks: Ranks,
        broker_id: tuple[str, int],
        seq: int,
        stream: m.StreamRef,
        method: str,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> None: ...

    def start_trace(self, limit: int | None = None) -> None: ...

    def collect_trace(self, stop: bool = True) -> list[dict]: ...

    def cancel_running(self, grace: float) -> list[dict]: ...

    def close(self, timeout: float | None = None) -> None: ...


@runtime_checkable
class Substitute(ControllerSeam, Protocol):
    """A controller that stands in for a session's own for a while (``dm.dry_run``)."""

    first_id: int  # ref and stream ids below it existed before the substitution
    real_deletes: list  # (ranks, ref id) of refs made before it, deleted meanwhile
    real_drops: list  # StreamRefs made before it that died meanwhile

    def created(self, ref: int, storage: Any, nbytes: int, ranks: tuple[int, ...]) -> None:
        """A handle of ``ref`` on ``ranks`` was made over ``storage`` (``nbytes`` if new)."""

    def forgotten(self, ref: int) -> None:
        """Ref ``ref`` is gone without a ``DeleteRefs``: a compiled trace's own (compiled.py)."""

    def storages(self) -> Iterable[Any]:
        """The storages of the handles made while it stood in."""

    def nothing_ran(self) -> BaseException:
        """What a later use of a value made while it stood in raises (it has none)."""
