"""The ranks' side of in-job recovery (``dm.run_steps``, docs/recovery.md): snapshots that
outlive their controller, and the restore that copies one from a live replica.

A snapshot is a copy of a job's replicated state in host memory, kept in
this worker process under the job's key, outside every controller's ref
tables: when a rank is lost and its controller breaks, the survivors release
the controller's lanes and values, but their snapshots stay for the new mesh
to restore from. Each worker keeps its newest snapshot per job; the client
drops them when the job ends (:func:`drop`, run on every worker).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from ..protocol.names import rank_function
from .checkpointing import digests, exchange, stage
from .errors import FatalError

_lock = threading.Lock()
_held: dict[str, tuple[int, list[torch.Tensor]]] = {}  # job key -> (step, copies)
NONE = -(2**62)  # "no snapshot": older than any step


@rank_function
def take(
    key: str,
    number: int,
    tensors: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
    names: list[str] = (),
) -> torch.Tensor:
    """Keep a copy of ``tensors`` as snapshot ``number`` of job ``key`` (replacing an older
    one once the copy is complete); returns ``number``.

    With ``group``, the ranks first check that their copies are equal (digests):
    a state that differs across ranks (``names``: its entries) cannot be restored
    from a peer, and fails here, before it is ever needed.
    """
    copies = stage(list(tensors))
    if group is not None:
        everyone = exchange(group, digests(copies))
        differ = [n for i, n in enumerate(names) if len({d[i] for d in everyone}) > 1]
        if differ:
            raise ValueError(
                f"the state is not replicated: {differ} differ across the ranks of the mesh; "
                "run_steps copies a lost rank's state from a peer, so every rank must hold the "
                "same state (docs/recovery.md)"
            )
    with _lock:
        held = _held.get(key)
        if held is None or held[0] <= number:
            _held[key] = (number, copies)
    return torch.tensor(number, dtype=torch.int64)


@rank_function
def differing(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Which of ``tensors`` differ across the ranks of ``group`` (digests compared)."""
    everyone = exchange(group, digests([t.detach() for t in tensors]))
    return torch.tensor([len({d[i] for d in everyone}) > 1 for i in range(len(tensors))])


def _mine(key: str) -> tuple[int, list[torch.Tensor]]:
    with _lock:
        return _held.get(key, (NONE, []))


@rank_function
def newest(key: str, group: dist.ProcessGroup) -> torch.Tensor:
    """The newest snapshot of job ``key`` that some rank of ``group`` holds (NONE: none)."""
    return torch.tensor(max(exchange(group, _mine(key)[0])), dtype=torch.int64)


@rank_function
def restore(key: str, number: int, tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Fill ``tensors`` with snapshot ``number`` of job ``key``, from the first rank holding it.

    The holders compare digests first: snapshots that differ mean the state was
    not replicated, and no peer can stand in for another (a ValueError: the job
    falls back to a restart from its checkpoint).
    """
    held, copies = _mine(key)
    mine = held == number and len(copies) == len(tensors)
    everyone = exchange(group, digests(copies) if mine else None)
    holders = [rank for rank, sums in enumerate(everyone) if sums is not None]
    if not holders:
        raise FatalError(f"no rank of the mesh holds snapshot {number} of job {key} any more")
    if any(everyone[r] != everyone[holders[0]] for r in holders):
        differ = [
            i for i in range(len(tensors)) if len({bytes(everyone[r][i]) for r in holders}) > 1
        ]
        raise ValueError(
            f"the ranks {holders} hold different values of the state's entries at positions "
            f"{differ}: it is not replicated, so a lost rank's part cannot be copied from a peer"
        )
    source = holders[0]
    rank = group.rank()
    for i, t in enumerate(tensors):
        buffer = copies[i] if rank == source else torch.empty(t.shape, dtype=t.dtype)
        options = dist.BroadcastOptions()
        options.rootRank = source
        try:
            group.broadcast([buffer], options).wait()
        except RuntimeError as e:
            raise FatalError(f"copying snapshot {number} from rank {source} failed: {e}") from e
        with torch.no_grad():
            t.copy_(buffer)


@rank_function
def drop(key: str) -> None:
    """Forget job ``key``'s snapshot on this worker (the job ended)."""
    with _lock:
        _held.pop(key, None)


def held() -> dict[str, int]:
    """Job key -> the step of the snapshot this worker holds (for tests and the dashboard)."""
    with _lock:
        return {key: step for key, (step, _) in _held.items()}
