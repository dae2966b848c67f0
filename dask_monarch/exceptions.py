"""Exceptions and warnings that cross the API: user errors are values, broken meshes are not."""

from __future__ import annotations


class RemoteException(Exception):
    """A remote function failed; raised where a value that depends on it is fetched.

    ``traceback`` holds the remote traceback text, ``rank`` the rank that
    reported it and ``seq`` the failing invocation; ``controller_traceback``,
    when known, is where the failing call was issued on the client.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        seq: int | None = None,
        traceback: str = "",
        controller_traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.seq = seq
        self.traceback = traceback
        self.controller_traceback = controller_traceback

    def __str__(self) -> str:
        head = super().__str__()
        where = []
        if self.seq is not None:
            where.append(f"seq {self.seq}")
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        text = f"{head} ({', '.join(where)})" if where else head
        if self.controller_traceback:
            text += f"\n\nIssued at (controller traceback):\n{self.controller_traceback}"
        if self.traceback and self.traceback not in head:
            text += f"\n\nRemote traceback:\n{self.traceback}"
        return text

    def __reduce__(self) -> tuple:
        return (
            _rebuild_remote,
            (self.args[0], self.rank, self.seq, self.traceback, self.controller_traceback),
        )


def _rebuild_remote(
    message: str, rank: int | None, seq: int | None, traceback: str, controller_traceback: str
) -> RemoteException:
    return RemoteException(
        message, rank=rank, seq=seq, traceback=traceback, controller_traceback=controller_traceback
    )


class DeviceException(Exception):
    """The mesh is broken (lost worker, protocol violation, fatal error): it cannot be used again.

    ``rank`` names the rank where it happened (``None`` when it is not one
    rank's fault) and ``cause`` the reason.
    """

    def __init__(self, cause: str, *, rank: int | None = None) -> None:
        where = f"rank {rank}: " if rank is not None else ""
        super().__init__(f"{where}{cause}")
        self.rank = rank
        self.cause = cause

    def __reduce__(self) -> tuple:
        return (_rebuild_device, (self.cause, self.rank))


def _rebuild_device(cause: str, rank: int | None) -> DeviceException:
    return DeviceException(cause, rank=rank)


class LivenessWarning(UserWarning):
    """A rank has completed no message for ``dask_monarch.timeouts.liveness``: it may be stuck.

    Issued once per stall (``warnings.warn`` on the client, and logged on the
    ``dask_monarch`` logger); the mesh keeps running. ``rank``, ``stream``,
    ``seq`` and ``waiting_on`` describe the stalled lane (``stream`` is
    ``"control"`` for a rank's control steps; ``seq`` the seq it is at, or the
    last one it started); ``stalls`` holds one line per lane that stalled
    with it.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        stream: object = None,
        seq: int | None = None,
        waiting_on: str = "",
        stalls: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.stream = stream
        self.seq = seq
        self.waiting_on = waiting_on
        self.stalls = stalls


class ImplicitFetchWarning(UserWarning):
    """Python asked for the value of a mesh tensor, and it was fetched from every rank.

    ``bool(t)``, ``t.item()``, ``if t.any():`` and ops whose output shape
    depends on data wait for the ranks, as ``.item()`` on a GPU waits for the
    GPU. With ``dask_monarch.implicit-fetch: warn`` (the default) each call site
    (``filename``, ``lineno``: the first frame outside dask_monarch and torch)
    warns once; ``count`` is how many such fetches its mesh made so far.
    """

    def __init__(
        self, message: str, *, filename: str = "", lineno: int = 0, count: int = 0
    ) -> None:
        super().__init__(message)
        self.filename = filename
        self.lineno = lineno
        self.count = count


class CompileWarning(UserWarning):
    """A compiled function could not keep its recording and was traced again (or runs eagerly)."""
