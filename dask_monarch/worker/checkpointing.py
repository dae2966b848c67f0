"""The ranks' side of ``dm.checkpoint``: torch.distributed.checkpoint (DCP) over a mesh's group.

DCP's own ``save``/``load`` need torch's default process group (they ask
``dist.get_rank(group)``), which a worker holding ranks of many meshes never
has (worker/groups.py). So :func:`save` drives DCP's public planner and
storage interfaces itself, step for step as ``dcp.save`` does, with the
exchanges between steps done over the mesh's group (:func:`_agree`): the
format on disk is DCP's own, and a torchrun job reads it with ``dcp.load``.

What every rank does, in parallel, nothing through the client or the scheduler:

1. Digest its tensors; the ranks compare digests. A value equal on every rank
   is *replicated*: it is offered under its key by every rank and DCP's
   deduplication has one rank write it (the ranks share the writes). A value
   that differs is *per rank*: each rank writes its own under ``key@rank<i>``.
2. The coordinator (group rank 0) picks the checkpoint's number and makes a
   temporary directory ``.checkpoint-<n>.tmp-<token>`` beside the complete
   ones, after removing what torn saves left behind. It holds its temporary
   directory locked (``flock``) until the save ends, so that a save of another
   mesh into the same directory at the same time leaves it alone.
3. DCP plans (local plans, the coordinator's global plan), every rank writes
   its part into the temporary directory, the coordinator writes DCP's
   ``.metadata``.
4. The coordinator renames the directory to ``checkpoint-<n>`` (atomic; the
   next free number if another save took ``n`` meanwhile) and then replaces
   the ``latest`` marker (atomic): a save killed at any point leaves the last
   complete checkpoint and ``latest`` as they were.

A step that fails on one rank fails on every rank (each learns of it at the
next exchange), so no rank waits for a peer that gave up.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import hashlib
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from .. import config
from ..protocol.names import rank_function
from .errors import FatalError

RECORD = "_dask_monarch"  # the DCP key of the record: the state's layout, ranks, per-rank keys
LATEST = "latest"
_COMPLETE = re.compile(r"^checkpoint-(\d+)$")
_TORN = re.compile(r"^\.checkpoint-\d+\.tmp-")


class CheckpointError(RuntimeError):
    """A save or a load failed on some rank of the mesh (named in the message)."""


def per_rank_key(key: str, rank: int) -> str:
    """Where a value that differs across ranks is stored for ``rank`` (its group rank)."""
    return f"{key}@rank{rank}"


def checkpoint_name(number: int) -> str:
    return f"checkpoint-{number:06d}"


# -- exchanges over the group -------------------------------------------------------------------


def exchange(group: dist.ProcessGroup, value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in group-rank order, on every rank.

    Two all-gathers on the group's CPU backend (gloo): the sizes, then the
    padded bytes; DCP's plans and results are small. An all-gather that fails
    means a peer was lost or stopped answering: the mesh is broken
    (:class:`FatalError`, a ``DeviceException`` on the client, which
    ``--max-restarts`` restarts), not the user's code.
    """
    data = pickle.dumps(value)
    n = group.size()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    _all_gather(group, sizes, size)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    _all_gather(group, everyone, mine)
    return [
        pickle.loads(t[: int(s.item())].numpy().tobytes())  # peers of our own mesh
        for t, s in zip(everyone, sizes)
    ]


def _all_gather(group: dist.ProcessGroup, out: list[torch.Tensor], mine: torch.Tensor) -> None:
    try:
        group.allgather([out], [mine]).wait()
    except RuntimeError as e:
        raise FatalError(
            f"an exchange over the mesh's process group failed (a rank was lost or stopped "
            f"answering): {e}"
        ) from e


def _agree(group: dist.ProcessGroup, what: str, fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` on this rank; every rank gets every rank's result, or every rank raises.

    A rank whose ``fn`` raised re-raises its own error; the others raise a
    :class:`CheckpointError` naming that rank and its error.
    """
    error: BaseException | None = None
    try:
        mine = (True, fn())
    except Exception as e:
        error = e
        mine = (False, f"{type(e).__name__}: {e}")
    everyone = exchange(group, mine)
    if error is not None:
        raise error
    failed = [(rank, text) for rank, (ok, text) in enumerate(everyone) if not ok]
    if failed:
        rank, text = failed[0]
        raise CheckpointError(f"{what} failed on group rank {rank} of the mesh: {text}")
    return [value for _, value in everyone]


# -- digests ------------------------------------------------------------------------------------


def digest(t: torch.Tensor) -> bytes:
    """A digest of ``t``'s shape, dtype and bytes: equal digests mean equal values (SHA-1)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.sha1(usedforsecurity=False)
    h.update(repr((tuple(t.shape), t.dtype)).encode())
    if t.numel():
        h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return h.digest()


def digests(tensors: list[torch.Tensor]) -> list[bytes]:
    """Digests of ``tensors``, computed in threads (hashing releases the GIL).

    A GPU tensor is copied to the host on the calling lane's stream: a new
    thread's current stream is the device's default one, which does not wait
    for the lane's (lane streams are non-blocking), so its copy could read a
    tensor the lane is still writing.
    """
    if len(tensors) < 2:
        return [digest(t) for t in tensors]
    lane_stream = torch.cuda.current_stream() if any(t.is_cuda for t in tensors) else None

    def on_lane_stream(t: torch.Tensor) -> bytes:
        if lane_stream is None or not t.is_cuda:
            return digest(t)
        with torch.cuda.stream(lane_stream):
            return digest(t)

    workers = min(len(tensors), max(1, torch.get_num_threads()))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(on_lane_stream, tensors))


# -- the directory ------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(number, directory) of the complete checkpoints under ``root``, oldest first."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        match = _COMPLETE.match(name)
        if match and os.path.exists(os.path.join(root, name, ".metadata")):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def _numbers(root: str) -> list[int]:
    """The numbers of the checkpoints under ``root``."""
    return [int(m.group(1)) for m in map(_COMPLETE.match, os.listdir(root)) if m]


def _lock(path: str) -> int | None:
    """A descriptor of the directory ``path`` holding it locked (``flock``, released when
    closed), or None if it is gone or another process holds it. Where the file system has no
    ``flock``, the directory is not locked (saves into one path then run one at a time)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            raise
    try:  # still the directory at ``path``: not removed before the lock was had
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            return fd
    except FileNotFoundError:
        pass
    os.close(fd)
    return None


def _begin(root: str) -> tuple[int, str, int | None]:
    """The coordinator's first step: the new checkpoint's number, its temporary directory and
    the descriptor that holds the latter locked until the save ends.

    A temporary directory no process holds locked is a torn save's, and removed; one
    that is locked is another mesh's save in progress, and left alone. A checkpoint's own
    directory is refused: a load of it reads that checkpoint, never one saved inside it.
    """
    if os.path.exists(os.path.join(root, ".metadata")):
        parent = os.path.dirname(os.path.normpath(root)) or "."
        raise ValueError(
            f"{root} is a checkpoint, not a directory of them: save into {parent} (its "
            "latest is what a load of that directory reads)"
        )
    os.makedirs(root, exist_ok=True)
    while True:
        for name in os.listdir(root):
            if _TORN.match(name):
                torn = _lock(os.path.join(root, name))
                if torn is not None:
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                    os.close(torn)
        number = max(_numbers(root), default=0) + 1
        temp = os.path.join(root, f".{checkpoint_name(number)}.tmp-{uuid.uuid4().hex[:8]}")
        os.makedirs(temp)
        fd = _lock(temp)
        if fd is not None:
            return number, temp, fd
        # another save's clean-up found it before it was locked (and removes it): again


def _commit(root: str, temp: str, number: int) -> int:
    """Rename the written directory into place, then point ``latest`` at it (both atomic);
    returns its number: ``number``, or the next free one if another save took it."""
    _fsync_dir(temp)
    while True:
        try:
            os.rename(temp, os.path.join(root, checkpoint_name(number)))
            break
        except OSError as e:  # another mesh's save into ``root`` committed ``number`` first
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            number = max(number, *_numbers(root)) + 1
    marker = os.path.join(root, f".{LATEST}.tmp-{uuid.uuid4().hex[:8]}")
    with open(marker, "w") as f:
        f.write(checkpoint_name(number) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker, os.path.join(root, LATEST))
    _fsync_dir(root)
    keep = config.get("checkpoint.keep")
    if keep:
        for _, old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return number


def resolve(path: str) -> str | None:
    """The checkpoint directory ``path`` names: itself if it is one, else ``path/latest``'s,
    else the newest complete one under it; None if there is none."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    try:
        with open(os.path.join(path, LATEST)) as f:
            named = os.path.join(path, f.read().strip())
        if os.path.exists(os.path.join(named, ".metadata")):
            return named
    except OSError:
        pass
    complete = complete_checkpoints(path)
    return complete[-1][1] if complete else None


# -- saving -------------------------------------------------------------------------------------


@rank_function
def stage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` in host memory (pinned for CUDA ones), for an asynchronous save:
    taken on the checkpoint stream while the tensors are lent to it, so training cannot
    change them meanwhile, and complete when this returns."""
    copies = []
    cuda = False
    for t in tensors:
        t = t.detach()
        if t.device.type == "cuda":
            cuda = True
            copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            copies.append(copy.copy_(t, non_blocking=True))
        else:
            copies.append(t.clone())
    if cuda:
        torch.cuda.current_stream().synchronize()
    return copies


@rank_function
def save(
    tensors: list[torch.Tensor],
    keys: list[str],
    values: dict[str, Any],
    record: dict,
    root: str,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """Write this rank's part of a checkpoint of ``tensors`` (under ``keys``) and ``values``
    under ``root``; returns the checkpoint's number (on every rank, once it is complete)."""
    locks: list[int] = []  # the coordinator's, on its temporary directory: held to the end
    try:
        return _write(tensors, keys, values, record, root, group, locks)
    finally:
        for fd in locks:
            os.close(fd)


def _write(
    tensors: list[torch.Tensor],
    keys: list[str],
    values: dict[str, Any],
    record: dict,
    root: str,
    group: dist.ProcessGroup,
    locks: list[int],
) -> torch.Tensor:
    rank, size = group.rank(), group.size()
    coordinator = rank == 0

    def prepare() -> tuple[list[bytes] | None, tuple[int, str] | None]:
        sums = digests(list(tensors)) if size > 1 else None
        if not coordinator:
            return sums, None
        number, temp, fd = _begin(root)
        locks.append(fd)
        return sums, (number, temp)

    prepared = _agree(group, "preparing the checkpoint", prepare)
    number, temp = prepared[0][1]
    if size > 1:
        replicated = [len({p[0][i] for p in prepared}) == 1 for i in range(len(keys))]
    else:
        replicated = [True] * len(keys)
    state: dict[str, Any] = {}
    for key, t, same in zip(keys, tensors, replicated):
        state[key if same else per_rank_key(key, rank)] = t.detach()
    state.update(values)
    per_rank = [key for key, same in zip(keys, replicated) if not same]
    state[RECORD] = {**record, "ranks": size, "per_rank": per_rank}

    planner = DefaultSavePlanner(flatten_state_dict=False)
    writer = FileSystemWriter(temp)
    metadata = None

    def local_plan() -> Any:
        planner.set_up_planner(state, writer.storage_meta(), coordinator)
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_plan() -> Any:
        nonlocal metadata
        plans, metadata = planner.create_global_plan(local_plans)
        return writer.prepare_global_plan(plans)

    local_plans = _agree(group, "planning the checkpoint", local_plan)
    plans = _agree(group, "planning the checkpoint", global_plan if coordinator else _nothing)
    central = plans[0][rank]

    def write() -> Any:
        written = writer.write_data(planner.finish_plan(central), planner)
        written.wait()
        return written.value()

    results = _agree(group, "writing the checkpoint", write)

    def commit() -> int:
        writer.finish(metadata, results)
        return _commit(root, temp, number)

    committed = _agree(group, "committing the checkpoint", commit if coordinator else _nothing)
    return torch.tensor(committed[0], dtype=torch.int64)


def _nothing() -> None:
    return None


@rank_function
def saved_path(root: str, number: torch.Tensor) -> str:
    """The directory of checkpoint ``number`` under ``root`` (what a save's future gives)."""
    return os.path.join(root, checkpoint_name(int(number)))


# -- loading ------------------------------------------------------------------------------------


@rank_function
def describe(path: str) -> dict | None:
    """What a load needs to know before it sends anything: the checkpoint ``path`` names,
    its record, its plain values, and the shape and dtype of every tensor (None: none)."""
    directory = resolve(path)
    if directory is None:
        return None
    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    if not isinstance(metadata.get(RECORD), BytesStorageMetadata):
        raise ValueError(
            f"{directory} is a torch.distributed.checkpoint without dask_monarch's record: "
            "load it with torch.distributed.checkpoint.load"
        )
    record = _read({RECORD: None}, directory)[RECORD]
    tensors = {
        key: (tuple(md.size), md.properties.dtype)
        for key, md in metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    plain: dict[str, Any] = {}  # plain values: pickled, or local tensors saved as tensors
    for _, key, is_tensor in record["entries"]:
        if not is_tensor:
            known = tensors.get(key)
            plain[key] = None if known is None else torch.empty(known[0], dtype=known[1])
    if plain:
        plain = _read(plain, directory)
    for key in record["per_rank"]:  # the client asks by the state's key
        tensors[key] = tensors[per_rank_key(key, 0)]
    return {"directory": directory, "record": record, "values": plain, "tensors": tensors}


def _read(state: dict[str, Any], directory: str) -> dict[str, Any]:
    """Read ``state``'s keys from the checkpoint in ``directory``: tensors in place, plain
    values returned (in the dict returned). DCP's load as one process does it, without its
    warning that no default process group exists."""
    planner = DefaultLoadPlanner(flatten_state_dict=False)
    reader = FileSystemReader(directory)
    metadata = reader.read_metadata()
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
    reader.read_data(planner.finish_plan(plan), planner).wait()
    return planner.state_dict


@rank_function
def load(
    tensors: list[torch.Tensor],
    keys: list[str],
    per_rank: list[bool],
    directory: str,
    group: dist.ProcessGroup,
) -> None:
    """Read ``keys`` of the checkpoint in ``directory`` into ``tensors``, in place.

    Every rank reads what it needs by itself (a load writes nothing, so it
    needs no exchange): a replicated value under its key, a per-rank one
    under this rank's (its rank in ``group``, the loading mesh's).
    """
    rank = group.rank()
    state = {
        per_rank_key(key, rank) if own else key: t.detach()
        for key, own, t in zip(keys, per_rank, tensors)
    }
    if state:
        _read(state, directory)
