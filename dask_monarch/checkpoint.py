"""Checkpoints of mesh state (``dm.checkpoint.save`` and ``dm.checkpoint.load``).

``save(state, path)`` writes a pytree of mesh tensors and plain values
(``model.state_dict()``, ``optimizer.state_dict()``, a step counter,
``dm.random.get_state()``) as a torch.distributed.checkpoint: every rank of
the mesh writes its part in parallel, over the mesh's own process group,
straight to the file system (nothing passes through the client or the
scheduler); a value equal on every rank (a data-parallel model) is written
once, the ranks sharing the writes; one that differs is written by each rank
for itself (worker/checkpointing.py has the protocol).

``path`` is a directory of checkpoints: each save adds ``checkpoint-<n>``
(renamed into place once complete) and then points ``path/latest`` at it, so
a save killed midway never replaces the last complete one. ``load(state,
path)`` reads ``latest`` (or the checkpoint directory given), fills the
state's tensors in place on the ranks and its plain values on the client,
adds entries the state lacks (a fresh optimizer's), and returns the state.

Saves run on a stream of their own, ``checkpoint``: the state is lent to it
immutably (docs/protocol.md §1.6). ``asynchronous=True`` copies it there
first (host memory) and gives it back, so the next steps run while the
copies are written; the training stream waits only for the copy.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch

from . import state_tree
from .controller.session import MeshFuture
from .fetch import fetch_value
from .mesh import DeviceMesh, RemoteProcessGroup
from .opaque_ref import OpaqueRef
from .protocol import messages as m
from .remote_function import remote
from .stream import Stream
from .tensor import Tensor, active_mesh, cpu_ranks

if TYPE_CHECKING:
    from .controller.session import Session

__all__ = ["save", "load"]

_RANKS = "dask_monarch.worker.checkpointing."
STREAM = Stream("checkpoint")  # every save and load of this process runs on it, in order
VERSION = 1

_save = remote(_RANKS + "save", propagate=lambda *a, **k: torch.empty((), dtype=torch.int64))


def _fill(tensors: list[torch.Tensor], *args: Any) -> None:
    """The load's propagation: every target is changed by it (its version bumped: 0.6 us,
    where a ``zero_`` on a fake tensor took 240, 0.8 s of a 3 200-tensor load)."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)


_load = remote(_RANKS + "load", propagate=_fill)
_groups: weakref.WeakKeyDictionary[Session, dict] = weakref.WeakKeyDictionary()


def _group(mesh: DeviceMesh) -> RemoteProcessGroup:
    """The process group over every rank of ``mesh`` that its checkpoints use (made once)."""
    groups = _groups.setdefault(mesh._session, {})
    group = groups.get((mesh.dims, mesh.slice_))
    if group is None:
        group = groups[(mesh.dims, mesh.slice_)] = mesh.process_group(mesh.dims)
    return group


def _mesh_of(tensors: list[Tensor], what: str) -> DeviceMesh:
    """The one mesh ``tensors`` live on (the active mesh if there are none)."""
    if not tensors:
        mesh = active_mesh()
        if mesh is None:
            raise ValueError(
                f"dask_monarch.checkpoint.{what} needs mesh tensors in the state or an active "
                "mesh (with mesh.activate())"
            )
        return mesh
    mesh = tensors[0]._mesh
    for t in tensors[1:]:
        if t._mesh is not mesh and t._mesh != mesh:
            raise ValueError(
                f"dask_monarch.checkpoint.{what}: the state holds tensors of {mesh._label()} and "
                f"of {t._mesh._label()}; a checkpoint is of one mesh"
            )
    return mesh


def _split(state: Any) -> tuple[list, list[tuple[state_tree.Path, Tensor]], dict[str, Any]]:
    """The state's entries, its mesh tensors (with paths) and its plain values (by key)."""
    items = state_tree.entries(state)
    tensors = [(path, v) for path, v in items if isinstance(v, Tensor)]
    values = {state_tree.key(path): v for path, v in items if not isinstance(v, Tensor)}
    return items, tensors, values


def save(state: Any, path: str | os.PathLike, *, asynchronous: bool = False) -> str | MeshFuture:
    """Write ``state`` as a new checkpoint under the directory ``path``; returns its directory.

    ``asynchronous=True``: returns a future of it once the state is copied, and
    the write overlaps what the program does next (later saves and loads wait
    for it; ``mesh.exit()`` too). A save that fails or is killed midway leaves
    the checkpoints before it untouched.
    """
    root = os.fspath(path)
    if not isinstance(root, str):
        raise TypeError(f"a checkpoint path is a str or os.PathLike, got {path!r}")
    items, tensors, values = _split(state)
    handles = [t for _, t in tensors]
    mesh = _mesh_of(handles, "save")
    record = {
        "version": VERSION,
        "dims": mesh.sizes,
        "entries": [(p, state_tree.key(p), isinstance(v, Tensor)) for p, v in items],
        "containers": state_tree.containers(state),
    }
    keys = [state_tree.key(p) for p, _ in tensors]
    group = _group(mesh)
    lent = [STREAM.borrow(t) for t in handles]  # immutably: training may read, not change them
    with mesh.activate(), STREAM.activate():
        borrowed = [b for b, _ in lent]
        if asynchronous:
            staged = OpaqueRef(_RANKS + "stage", borrowed)
            for _, borrow in lent:
                borrow.drop()
            number = _save(staged, keys, values, record, root, group)
            staged.drop()
        else:
            number = _save(borrowed, keys, values, record, root, group)
            for _, borrow in lent:
                borrow.drop()
        future = fetch_value(
            mesh._session,
            mesh._ranks[0],
            None,
            function=m.FunctionPath(_RANKS + "saved_path"),
            args_kwargs=m.ArgsKwargs.from_python((root, number)),
            inputs=[number],
        )
    return future if asynchronous else future.result()


def load(state: Any, path: str | os.PathLike) -> Any:
    """Fill ``state`` from the checkpoint at ``path`` (a directory of checkpoints: its latest
    one; or one checkpoint's directory); returns the state.

    Mesh tensors are filled in place on the ranks (they must have the saved
    shapes and dtypes), plain values replaced on the client, and entries the
    state lacks are added (new mesh tensors on its mesh). Values equal on every
    rank load onto a mesh of any size; values that differed across ranks load
    only onto a mesh of as many ranks (ValueError when the state holds one; left
    out with a RuntimeWarning when it does not). Raises FileNotFoundError if there is no
    checkpoint at ``path``, ValueError (before anything changes) if the state
    and the checkpoint disagree.
    """
    root = os.fspath(path)
    _, tensors, _ = _split(state)
    mesh = _mesh_of([t for _, t in tensors], "load")
    with STREAM.activate():  # after the saves in flight
        info = fetch_value(
            mesh._session,
            mesh._ranks[0],
            None,
            function=m.FunctionPath(_RANKS + "describe"),
            args_kwargs=m.ArgsKwargs.from_python((root,)),
        ).result()
    if info is None:
        raise FileNotFoundError(f"no checkpoint at {root!r} (nothing complete there)")
    state, targets = fill(state, info, mesh)
    if targets:
        keys = [state_tree.key(p) for p, _ in targets]
        per_rank = [k in info["record"]["per_rank"] for k in keys]
        with mesh.activate():
            _load([t for _, t in targets], keys, per_rank, info["directory"], _group(mesh))
    return state


def fill(state: Any, info: dict, mesh: DeviceMesh) -> tuple[Any, list[tuple[tuple, Tensor]]]:
    """Make ``state`` ready to receive the saved state ``info`` describes: plain values put
    back, entries it lacks made (mesh tensors on ``mesh``, under the active stream); returns
    the state and the (path, mesh tensor) pairs to fill, in the saved order.

    ``info``: ``record`` (``entries``: (path, key, is a mesh tensor) in order,
    ``containers``: (path, kind, length) of every dict, list and tuple, so that
    those the state lacks are made as saved, ``per_rank`` keys and the
    ``ranks`` that saved them), ``tensors`` (key ->
    saved shape and dtype), ``values`` (key -> plain value) and ``directory``
    (its name in errors). Raises one ValueError listing every disagreement,
    before anything changes.
    """
    plan = _plan_load(state, info, mesh)
    current = dict(state_tree.entries(state))
    state, tuples = _make_containers(state, info["record"].get("containers", ()))
    for path_, value in plan["values"]:
        here = current.get(path_)
        if _same_local_tensor(here, value):
            here.copy_(value)  # a local tensor of the state, filled in place
        else:
            state = state_tree.put(state, path_, value)
    targets = []
    # an entry the state lacks (a fresh optimizer's exp_avg) is made where the mesh's tensors
    # live: on a GPU mesh, on each rank's GPU
    device = None if cpu_ranks(mesh) else "cuda"
    with mesh.activate():
        for path_, t, shape, dtype in plan["tensors"]:
            if t is None:
                t = torch.empty(shape, dtype=dtype, device=device)
                state = state_tree.put(state, path_, t)
            targets.append((path_, t))
    for path_ in reversed(tuples):  # children before parents
        state = state_tree.put(state, path_, tuple(state_tree.get(state, path_)))
    return state, targets


def _make_containers(state: Any, layout: Any) -> tuple[Any, list[tuple]]:
    """Make the saved containers ``state`` lacks, of their saved kind and length, and lengthen
    its shorter lists and tuples, so that every saved leaf has its place (a missing list made
    as a dict, or a short list, would change what the state is). Tuples are made as lists
    while they are filled; returns the state and their paths, parents first."""
    slots: set[tuple] = set()  # places made here, not yet filled
    tuples = []
    for path, kind, length in layout:
        here = state_tree.get(state, path)
        if here is state_tree.MISSING or path in slots:
            here = {} if kind == "dict" else [None] * length
            slots.update((*path, i) for i in range(len(here)))
            if kind == "tuple":
                tuples.append(path)
            state = state_tree.put(state, path, here)
        elif kind != "dict" and len(here) < length:
            slots.update((*path, i) for i in range(len(here), length))
            if not isinstance(here, list):
                tuples.append(path)
            state = state_tree.put(state, path, [*here, *[None] * (length - len(here))])
    return state, tuples


def _same_local_tensor(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and not isinstance(a, Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
    )


def _plan_load(state: Any, info: dict, mesh: DeviceMesh) -> dict:
    """Match ``state`` against the checkpoint ``info`` describes; raise one ValueError listing
    every disagreement (nothing is changed then)."""
    record, saved = info["record"], info["tensors"]
    per_rank = set(record["per_rank"])
    ranks = record["ranks"]
    have = {state_tree.key(p): (p, v) for p, v in state_tree.entries(state)}
    problems, tensors, values, left_out = [], [], [], []
    wanted = set()
    for path, kind, _ in record.get("containers", ()):
        here = state_tree.get(state, path)
        mine = state_tree.kind(here)
        if here is state_tree.MISSING or mine == kind or {mine, kind} == {"list", "tuple"}:
            continue
        wanted.add(state_tree.key(path))  # not also an entry the checkpoint lacks
        where = repr(state_tree.key(path)) if path else "the root"
        problems.append(f"{where} is a {mine or type(here).__name__} in the state, a {kind} saved")
    for path, name, is_tensor in record["entries"]:
        wanted.add(name)
        found = have.get(name)
        if not is_tensor:
            if found is not None and isinstance(found[1], Tensor):
                problems.append(f"{name!r} is a mesh tensor in the state, a plain value saved")
            else:
                values.append((path, info["values"][name]))
            continue
        if name in per_rank and ranks != mesh.size():
            if found is None:  # not asked for: left out, said so
                left_out.append(name)
                continue
            problems.append(
                f"{name!r} differed across the {ranks} ranks that saved it: it loads only onto "
                f"a mesh of {ranks} ranks, not {mesh.size()} (values equal on every rank load "
                "onto any mesh)"
            )
            continue
        shape, dtype = saved[name]
        if found is None:
            tensors.append((path, None, shape, dtype))
            continue
        current = found[1]
        if not isinstance(current, Tensor):
            problems.append(f"{name!r} is a mesh tensor saved, but {type(current).__name__} here")
        elif tuple(current.shape) != shape or current.dtype != dtype:
            problems.append(
                f"{name!r} was saved with shape {list(shape)} {dtype}, the state's has "
                f"{list(current.shape)} {current.dtype}"
            )
        else:
            tensors.append((path, current, shape, dtype))
    extra = sorted(set(have) - wanted)
    if extra:
        problems.append(f"the state has entries the checkpoint lacks: {extra}")
    if problems:
        raise ValueError(
            f"cannot load {info['directory']} into this state:\n  " + "\n  ".join(problems)
        )
    if left_out:
        warnings.warn(
            f"{info['directory']} was saved by {ranks} ranks; its entries {left_out} differed "
            f"across them and were left out of the state loaded onto {mesh.size()} ranks",
            RuntimeWarning,
            stacklevel=3,
        )
    return {"tensors": tensors, "values": values}
