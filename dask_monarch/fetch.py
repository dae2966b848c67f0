"""Fetching values from the ranks (docs/protocol.md §1.5).

A fetch resolves only after every rank has passed it, and raises
:class:`~dask_monarch.RemoteException` if anything the value depends on
failed on any rank. Tensors come back on the CPU. :func:`fetch_value` sends
the ``SendValue`` every fetch is made of (also the internal ones of pipes and
remote functions).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .borrows import first_use
from .controller.futures import MeshFuture
from .controller.session import Session
from .exceptions import RemoteException
from .mesh import DeviceMesh
from .protocol import messages as m
from .stream import get_active_stream
from .tensor import Tensor, check_usable, placement
from .transfer import MeshSliceTensor


def shard_rank(mesh: DeviceMesh, shard: dict[str, int]) -> int:
    """The global rank at ``shard`` (every dim named; coordinate 0 when ``shard`` is empty)."""
    if not shard:
        shard = {d: 0 for d in mesh.dims}
    missing = [d for d in mesh.dims if d not in shard]
    if missing:
        raise ValueError(f"Missing key(s) {missing} in shard {shard}: name every dim of {mesh!r}")
    extra = [d for d in shard if d not in mesh.dims]
    if extra:
        raise KeyError(f"{extra} are not dimensions of {mesh!r}")
    sizes, coords = mesh.sizes, []
    for d in mesh.dims:
        c = shard[d]
        if isinstance(c, bool) or not hasattr(type(c), "__index__"):
            raise TypeError(f"shard {d}={c!r} is not an integer coordinate")
        if not 0 <= operator.index(c) < sizes[d]:
            raise ValueError(f"shard {d}={c!r} is outside {mesh!r}")
        coords.append(operator.index(c))
    return mesh.slice_.location(coords)


def fetch_shard(obj: Any, shard: dict[str, int] | None = None, **coords: int) -> MeshFuture:
    """The value of ``obj`` (a mesh tensor or a pytree of them) on one rank, as a future.

    Parameters
    ----------
    obj
        A mesh tensor, or a pytree of them and plain values.
    shard, **coords
        The rank, by its coordinate along every dim of the mesh:
        ``fetch_shard(t, host=1, gpu=0)`` or ``fetch_shard(t, {"host": 1, "gpu": 0})``;
        by default coordinate 0 of every dim.

    Returns
    -------
    MeshFuture
        Resolves once every rank has passed the fetch, to the value with
        tensors on the CPU; raises ``RemoteException`` if what it depends on
        failed on any rank.
    """
    if shard is not None and coords:
        raise TypeError("give the shard as a dict or as keywords, not both")
    leaves = tree_leaves(obj)
    for x in leaves:
        if isinstance(x, MeshSliceTensor):  # else pickled as a plain value: "cannot be pickled"
            raise TypeError(
                f"{x!r} is the shards of a tensor on a sub-mesh, not a tensor: move them "
                "first (t.slice_mesh(...).to_mesh(mesh)), or fetch the tensor on one rank "
                "directly (dask_monarch.inspect(t, gpu=0))"
            )
    handles = [x for x in leaves if isinstance(x, Tensor)]
    # the fetch runs on the active stream, as in Monarch
    mesh, _ = placement(handles, "fetch_shard", "fetch it under that stream")
    rank = shard_rank(mesh, shard if shard is not None else coords)
    return fetch_value(mesh._session, rank, obj)


def inspect(
    obj: Any, shard: dict[str, int] | None = None, *, timeout: float | None = None, **coords: int
) -> Any:
    """``fetch_shard(obj, ...).result(timeout)``: the value on one rank, tensors on the CPU.

    Parameters
    ----------
    obj, shard, **coords
        As :func:`fetch_shard`.
    timeout
        Seconds to wait at most (None: until it resolves); a ``TimeoutError``
        names the lanes still running and what they wait on.
    """
    return fetch_shard(obj, shard, **coords).result(timeout)


def fetch_value(
    session: Session,
    rank: int,
    value: Any,
    function: m.FunctionPath | m.Cloudpickle | None = None,
    args_kwargs: m.ArgsKwargs | None = None,
    inputs: Sequence[Any] = (),
) -> MeshFuture:
    """Send ``value`` (or ``function(*args)``) from global ``rank`` back to the client.

    ``inputs``: the handles ``function``'s arguments hold (tensors, OpaqueRefs), so the
    fetch fails at once with what they depend on.
    """
    if session.capture is not None:
        raise session.capture.no_fetch()
    with session.lock:
        stream_ref = session.stream_ref(get_active_stream())
        if args_kwargs is None:
            args_kwargs = m.ArgsKwargs.from_python((value,))
        leaves = tree_leaves(value)
        handles = [h for h in leaves if isinstance(h, Tensor)]
        for h in handles:
            check_usable(h)
        first_use(session, handles)
        uses = [h._ref.id for h in handles]
        if inputs:
            first_use(session, [h for h in inputs if isinstance(h, Tensor)])
            uses += [h._ref.id for h in inputs]
        future = session.fetch((rank,), stream_ref, function, args_kwargs, uses)
        if function is None and handles:
            future.check = _Declared(leaves, rank, future.seq)
    session.controller.flush()
    return future


class _Declared:
    """A fetched value's tensors must have the shapes and dtypes the client believes its
    handles have: a remote function whose propagation lied is caught here, not later."""

    def __init__(self, leaves: list[Any], rank: int, seq: int) -> None:
        # by position among the value's leaves: local tensors may be among them
        self.declared = {
            i: (tuple(h.shape), h.dtype) for i, h in enumerate(leaves) if isinstance(h, Tensor)
        }
        self.leaves = len(leaves)
        self.rank, self.seq = rank, seq

    def __call__(self, value: Any) -> None:
        got = tree_leaves(value)
        if len(got) != self.leaves:  # an OpaqueRef's object came back as a container
            return
        for i, (shape, dtype) in self.declared.items():
            leaf = got[i]
            if isinstance(leaf, torch.Tensor) and (tuple(leaf.shape), leaf.dtype) == (shape, dtype):
                continue
            if isinstance(leaf, torch.Tensor):
                held = f"shape {tuple(leaf.shape)} dtype {leaf.dtype}"
            else:
                held = f"a {type(leaf).__name__}"
            raise RemoteException(
                f"the value on rank {self.rank} is {held}, "
                f"but the client believes shape {shape} dtype {dtype}: the function that "
                "made it returned something else than its propagation said (fix its "
                "propagate or its result)",
                rank=self.rank,
                seq=self.seq,
            )
