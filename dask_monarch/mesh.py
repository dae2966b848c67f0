"""Device meshes: named n-d views over the ranks of one controller (docs/protocol.md §1.1).

``device_mesh(client, host=2, gpu=2)`` claims 4 workers of a Dask client as
ranks and returns a mesh over them; ``rename``, ``split``, ``flatten`` and
``slice`` make other views of the same ranks (for pipeline stages, say). All
views share one controller; two ``device_mesh`` calls make two controllers,
isolated from each other even on the same workers.
"""

from __future__ import annotations

import contextlib
import html
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import distributed

from . import config
from .protocol import messages as m
from .protocol.names import rank_function
from .protocol.ndslice import Slice

if TYPE_CHECKING:
    import torch

    from .actor_mesh import ActorMesh
    from .controller.session import Session
    from .propagation import Propagator
    from .tensor import Tensor
    from .worker.mesh import DeviceMesh as RankMesh


class DeviceMesh:
    """Named dimensions over a slice of global ranks."""

    def __init__(
        self, session: Session, names: Sequence[str], ranks: Slice, propagator: Propagator
    ) -> None:
        names = tuple(names)
        if len(set(names)) != len(names):
            raise ValueError(f"Duplicate dimension name in {list(names)}")
        if len(names) != ranks.ndim:
            raise ValueError(f"{len(names)} names for a {ranks.ndim}-d slice")
        self._session = session
        self._propagator = propagator  # one per root mesh: its views share the op cache
        self._names = names
        self._slice = ranks
        self._ranks = tuple(ranks)

    # -- shape --------------------------------------------------------------------------------

    @property
    def dims(self) -> tuple[str, ...]:
        return self._names

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self._names, self._slice.sizes))

    def size(self, dims: str | Sequence[str] | None = None) -> int:
        """The number of ranks along ``dims`` (all dims by default)."""
        if dims is None:
            return len(self._ranks)
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        sizes = self.sizes
        for d in names:
            if d not in sizes:
                raise KeyError(f"{d!r} is not a dimension of {self!r}")
        return math.prod(sizes[d] for d in names)

    @property
    def ranks(self) -> list[int]:
        """Global ranks, row-major over the dims."""
        return list(self._ranks)

    @property
    def slice_(self) -> Slice:
        return self._slice

    # -- views --------------------------------------------------------------------------------

    def rename(self, **renames: str) -> DeviceMesh:
        """The same ranks with some dims renamed (``mesh.rename(gpu="tp")``)."""
        for old in renames:
            if old not in self._names:
                raise KeyError(f"{old!r} is not a dimension of {self!r}")
        return self._view([renames.get(n, n) for n in self._names], self._slice)

    def split(self, **spec: Any) -> DeviceMesh:
        """Split dims into several: ``mesh.split(host=("dp", "pp"), pp=2)``.

        A name mapped to a tuple is split into those new names; an int names
        the size of a new dim; one new size per split may be left out and is
        inferred.
        """
        splits = {k: tuple(v) for k, v in spec.items() if isinstance(v, (tuple, list))}
        sizes = {k: v for k, v in spec.items() if k not in splits}
        for dim in splits:
            if dim not in self._names:
                raise KeyError(f"{dim!r} is not a dimension of {self!r}")
        new_names = [n for parts in splits.values() for n in parts]
        unused = [k for k in sizes if k not in new_names]
        if unused:
            raise ValueError(f"unused size constraints: {unused}")
        names, out_sizes, out_strides = [], [], []
        for name, size, stride in zip(self._names, self._slice.sizes, self._slice.strides):
            if name not in splits:
                names.append(name)
                out_sizes.append(size)
                out_strides.append(stride)
                continue
            parts = splits[name]
            known = {p: sizes[p] for p in parts if p in sizes}
            missing = [p for p in parts if p not in known]
            product = math.prod(known.values())
            if len(missing) > 1:
                raise ValueError(f"Cannot infer size of {missing} when splitting {name!r}")
            if missing:
                if product == 0 or size % product:
                    raise ValueError(
                        f"dim {name!r} of size {size} cannot be evenly divided by {product}"
                    )
                known[missing[0]] = size // product
            if math.prod(known.values()) != size:
                raise ValueError(
                    f"dim {name!r} of size {size} cannot be evenly divided into "
                    f"{[known[p] for p in parts]}"
                )
            step = stride
            part_strides = []
            for p in reversed(parts):
                part_strides.append(step)
                step *= known[p]
            names.extend(parts)
            out_sizes.extend(known[p] for p in parts)
            out_strides.extend(reversed(part_strides))
        return self._view(names, Slice(self._slice.offset, out_sizes, out_strides))

    def flatten(self, name: str) -> DeviceMesh:
        """All dims as one: only when the ranks, row-major, step by one stride."""
        dims = [
            (size, stride)
            for size, stride in zip(self._slice.sizes, self._slice.strides)
            if size > 1
        ]
        for (_, outer), (size, inner) in zip(dims, dims[1:]):
            if outer != inner * size:
                raise ValueError(f"cannot flatten sparse mesh {self!r}")
        base = dims[-1][1] if dims else 1
        return self._view([name], Slice(self._slice.offset, [self.size()], [base]))

    def slice(self, **selection: int | slice) -> DeviceMesh:
        """A sub-mesh: an int removes the dim, a ``slice`` keeps it restricted."""
        offset = self._slice.offset
        names, sizes, strides = [], [], []
        for d in selection:
            if d not in self._names:
                raise KeyError(f"{d!r} is not a dimension of {self!r}")
        for name, size, stride in zip(self._names, self._slice.sizes, self._slice.strides):
            sel = selection.get(name)
            if sel is None:
                names.append(name)
                sizes.append(size)
                strides.append(stride)
            elif isinstance(sel, int):
                if not 0 <= sel < size:
                    raise IndexError(f"{name}={sel} is outside 0..{size - 1}")
                offset += sel * stride
            elif isinstance(sel, slice):
                start, stop, step = sel.indices(size)
                count = len(range(start, stop, step))
                offset += start * stride
                names.append(name)
                sizes.append(count)
                strides.append(stride * step)
            else:
                raise TypeError(f"select {name} with an int or a slice, got {sel!r}")
        return self._view(names, Slice(offset, sizes, strides))

    def __call__(self, **selection: int | slice) -> DeviceMesh:
        """Deprecated alias of :meth:`slice`."""
        return self.slice(**selection)

    def _view(self, names: Sequence[str], ranks: Slice) -> DeviceMesh:
        return DeviceMesh(self._session, names, ranks, self._propagator)

    def _is_subset_of(self, other: DeviceMesh) -> bool:
        return self._session is other._session and set(self._ranks) <= set(other._ranks)

    # -- running on it ------------------------------------------------------------------------

    @contextlib.contextmanager
    def activate(self) -> Iterator[DeviceMesh]:
        """Run torch code on this mesh: factories create mesh tensors, ops run on the ranks."""
        from .handles import exited
        from .tensor import activate_mesh

        if self._session.closed:
            raise exited(self)
        with activate_mesh(self):
            yield self

    def rank(self, dims: str | Sequence[str]) -> Tensor:
        """A mesh tensor holding each rank's coordinate along ``dims`` (row-major if several)."""
        from .remote_function import remote

        names = (dims,) if isinstance(dims, str) else tuple(dims)
        for d in names:
            if d not in self._names:
                raise KeyError(f"{d!r} is not a dimension of {self!r}")
        with self.activate():
            return remote("dask_monarch.mesh._coordinate", propagate=_coordinate_propagate)(
                self, names
            )

    def process_group(self, dims: str | Sequence[str]) -> RemoteProcessGroup:
        """A torch.distributed group over ``dims``, usable as an argument of remote functions."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        for d in names:
            if d not in self._names:
                raise KeyError(f"{d!r} is not a dimension of {self!r}")
        session = self._session
        with session.lock:
            ref = session.new_ref()
            session.send_setup(
                self._ranks,
                m.CreateRemoteProcessGroup(
                    ref, session.mesh_ref(self._names, self._slice), list(names)
                ),
            )
        return RemoteProcessGroup(self, names, ref)

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> ActorMesh:
        """An actor per rank (``cls(*args, **kwargs)``) whose methods take mesh tensors."""
        from .actor_mesh import ActorMesh

        return ActorMesh(self, name, cls, *args, **kwargs)

    def exit(self, timeout: float = 600, cancel: bool = False) -> None:
        """Wait for everything sent, release the ranks; raises a failure nobody fetched.

        A TimeoutError after ``timeout`` seconds names the lanes still running
        and what they wait on; the ranks are released either way.

        ``cancel=True`` waits for nothing: the ranks are released at once, and
        remote functions still running for this mesh are interrupted where
        Python code runs (within ``dask_monarch.timeouts.cancel``, 5 s). A
        ``RuntimeWarning`` says what each was running and where; a call stuck in
        C code (``time.sleep``, a long kernel) is named with the worker to
        restart to free it (``client.restart_workers``).
        """
        config.timeout(timeout, "mesh.exit")
        self._session.exit(timeout, cancel)

    # -- display ------------------------------------------------------------------------------

    def to_table(self) -> str:
        """One line per rank: its coordinates and its worker."""
        workers = self._session.controller.workers
        header = [*self._names, "rank", "worker"]
        rows = []
        for rank in self._ranks:
            coords = self._slice.coordinates(rank)
            rows.append([*map(str, coords), str(rank), workers[rank]])
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        workers = self._session.controller.workers
        head = "".join(f"<th>{html.escape(n)}</th>" for n in (*self._names, "rank", "worker"))
        body = "".join(
            "<tr>"
            + "".join(f"<td>{c}</td>" for c in self._slice.coordinates(r))
            + f"<td>{r}</td><td>{html.escape(workers[r])}</td></tr>"
            for r in self._ranks
        )
        dims = ", ".join(f"{n}={s}" for n, s in self.sizes.items())
        return (
            f"<div><strong>DeviceMesh</strong>({html.escape(dims)}) on "
            f"{len(self._ranks)} ranks, mesh {self._session.controller.mesh_id}"
            f"<table><tr>{head}</tr>{body}</table></div>"
        )

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in self.sizes.items())
        ranks = self._ranks
        if ranks != self._session.world:  # a sub-mesh (one rank too): say which ranks it holds
            dims += f", ranks={list(ranks)}" if dims else f"ranks={list(ranks)}"
        return f"DeviceMesh({dims})"

    def _label(self) -> str:
        """The repr and the mesh's id: tells two ``DeviceMesh(gpu=2)`` apart (the id that
        errors, logs, ``dask-monarch debug`` and the dashboard show: ``names.mesh_id``)."""
        return f"{self!r} (mesh {self._session.controller.mesh_id})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DeviceMesh)
            and other._session is self._session
            and other._names == self._names
            and other._slice == self._slice
        )

    def __hash__(self) -> int:
        return hash((id(self._session), self._names, self._slice))

    def __monarch_ref__(self) -> m.Ref:
        return self._session.mesh_ref(self._names, self._slice)


class RemoteProcessGroup:
    """A process group over some dims of a mesh; a remote function receives a real one."""

    def __init__(self, mesh: DeviceMesh, dims: tuple[str, ...], ref: m.Ref) -> None:
        self.mesh = mesh
        self.dims = dims
        self.ref = ref
        self._whole: dict[Slice, tuple[int, list[int] | None] | None] = {}

    def _axes(self) -> list[int]:
        """The mesh dims the group spans (no dims: the whole mesh, as on the ranks)."""
        names = self.mesh._names
        return [names.index(d) for d in self.dims] if self.dims else list(range(len(names)))

    def _members(self, rank: int) -> list[int]:
        """The members of the group ``rank`` is in: its mesh's ranks along :attr:`dims`,
        the other dims held at ``rank``'s coordinates (as the ranks make them)."""
        s = self.mesh._slice
        coords = s.coordinates(rank)
        axes = self._axes()
        members = []
        for values in itertools.product(*(range(s.sizes[a]) for a in axes)):
            for a, v in zip(axes, values):
                coords[a] = v
            members.append(s.location(coords))
        return sorted(members)

    def _split_by(self, ranks: Slice) -> tuple[int, list[int] | None] | None:
        """A rank of ``ranks`` (a call's) whose group has members outside them, with those
        members (None: the rank is not on the group's mesh); None when ``ranks`` hold
        whole groups only. Remembered per slice: a call on the group's own mesh costs
        nothing, one on a sub-mesh a pass over its ranks once."""
        if ranks == self.mesh._slice:
            return None
        if ranks not in self._whole:
            s = self.mesh._slice
            axes = set(self._axes())
            size = math.prod(s.sizes[a] for a in axes)
            found: dict[tuple, list[int]] = {}
            split = None
            for rank in ranks:
                if rank not in s:
                    split = (rank, None)
                    break
                coords = s.coordinates(rank)
                key = tuple(0 if a in axes else c for a, c in enumerate(coords))
                found.setdefault(key, []).append(rank)
            else:
                short = next((rs for rs in found.values() if len(rs) != size), None)
                if short is not None:
                    split = (short[0], self._members(short[0]))
            self._whole[ranks] = split
        return self._whole[ranks]

    def __monarch_ref__(self) -> m.Ref:
        return self.ref

    def __repr__(self) -> str:
        return f"RemoteProcessGroup({self.mesh!r}, dims={list(self.dims)})"


def device_mesh(
    client: distributed.Client | None = None,
    *,
    workers: Sequence[str] | None = None,
    distinct_hosts: bool = False,
    **dims: int,
) -> DeviceMesh:
    """A mesh over ``prod(dims)`` workers of ``client`` (GPU workers first), dims in order.

    Parameters
    ----------
    client
        The Dask client whose workers become ranks; None: Dask's default client
        (the one a script run by ``dask-monarch run`` gets).
    workers
        The workers (addresses or worker names) that become ranks 0..n-1, in
        that order; by default a stable choice (explicit rank resources first).
    distinct_hosts
        No two ranks on one host (a worker's host is the host of its address).
    **dims
        The mesh's dimensions and their sizes, in order (``host=2, gpu=4``);
        neither ``workers`` nor ``distinct_hosts`` can be a dimension.

    Returns
    -------
    DeviceMesh
        A mesh with a controller of its own: two meshes on the same workers
        are isolated from each other. ``mesh.exit()`` releases the ranks.
    """
    # imported here: the workers import this module (for _coordinate) and need none of these
    from . import tensor
    from .controller.session import Session
    from .local_torch import install as run_as_local_torch
    from .packed import install as route_packed_sequences
    from .propagation import Propagator, warm_up
    from .tensor import (
        Tensor,
        install_cuda_check,
        install_tensor_constructors,
        no_mesh,
        place_loaded_optimizer_state,
        refuse_mesh_data_in_local_tensors,
        use_foreach_kernels,
    )
    from .torch_collectives import install as answer_torch_collectives
    from .torch_compile import skip_in_dynamo

    if workers is not None and (
        isinstance(workers, (str, int)) or not hasattr(workers, "__iter__")
    ):
        raise TypeError(
            f"workers= is the list of worker addresses or names the ranks run on, got "
            f"{workers!r}; a dimension cannot be called 'workers'"
        )
    if type(distinct_hosts) is not bool:
        raise TypeError(
            f"distinct_hosts= is True or False, got {distinct_hosts!r}; a dimension cannot be "
            "called 'distinct_hosts'"
        )
    if not dims:
        raise ValueError("device_mesh needs at least one dimension: device_mesh(client, gpu=2)")
    for name, size in dims.items():
        if type(size) is not int or size < 1:
            raise ValueError(f"dimension {name}={size!r} must be a positive int")
    if client is None:
        try:
            client = distributed.default_client()
        except ValueError:
            raise ValueError(
                "device_mesh(client=None) uses Dask's default client, and there is none: "
                "pass one, device_mesh(Client(cluster), ...), with e.g. "
                "cluster = dask_monarch.LocalMeshCluster(n_ranks=4) (or Client(scheduler "
                "address) for a running cluster), or run the script with `dask-monarch run`, "
                "which makes one"
            ) from None
    sizes = list(dims.values())
    warm_up()  # before the controller freezes the GC: see propagation.warm_up
    session = Session(
        client,
        math.prod(sizes),
        workers=None if workers is None else list(workers),
        distinct_hosts=distinct_hosts,
    )
    answer_torch_collectives(Tensor)  # torch.distributed.all_reduce(t) points to t.reduce
    install_cuda_check()  # device="cuda" on CPU ranks names them, also on a CPU-only client
    install_tensor_constructors()  # torch.tensor([loss, ...]) of mesh tensors: on the ranks
    use_foreach_kernels()  # clip_grad_norm_, optimizers: one message for all tensors, as torch
    refuse_mesh_data_in_local_tensors()  # local.data = mesh tensor: an error, not a crash later
    place_loaded_optimizer_state()  # optimizer.load_state_dict(local state): on the params' mesh
    from .random import install_torch_rng

    install_torch_rng()  # torch.manual_seed, get/set_rng_state under mesh.activate(): the ranks'
    skip_in_dynamo()  # torch.compile'd code called on mesh tensors runs their ops eagerly
    run_as_local_torch(no_mesh.activate)  # DataLoaders, unpickled tensors, copies of local ones
    route_packed_sequences(tensor)  # PackedSequence.batch_sizes: a client tensor torch's C++ reads

    return DeviceMesh(session, list(dims), Slice.row_major(sizes), Propagator(Tensor))


@rank_function
def _coordinate(mesh: RankMesh, names: Sequence[str]) -> torch.Tensor:
    """Worker side of ``mesh.rank``: this rank's coordinate along ``names``, row-major."""
    import torch

    value = 0
    for name in names:
        dim = mesh.dims[name]
        value = value * dim.size + dim.rank
    return torch.tensor(value, dtype=torch.long)


def _coordinate_propagate(mesh: DeviceMesh, names: Sequence[str]) -> torch.Tensor:
    import torch

    return torch.empty((), dtype=torch.long)
