"""Pipes on the client: feed a mesh from a per-rank producer (``dm.create_pipe``).

``create_pipe(fn, *args, max_messages=k)`` starts ``fn(pipe, *args)`` next to
every rank of the active mesh (in a process of its own: a data loader doing
real work does not hold the rank's GIL). ``pipe.recv()`` returns the next
value as mesh tensors; ``pipe.send(x)`` hands a value to the producers. What
``recv`` returns is described by ``propagate`` (a callable returning example
tensors), or learnt once from the first value on the mesh's first rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten, treespec_loads

from .borrows import first_use
from .fetch import fetch_value
from .protocol import messages as m
from .protocol.names import described_tensor
from .remote_function import Spec, bind_outputs, propagate_locally, resolvable
from .stream import get_active_stream
from .tensor import Tensor, active_mesh

if TYPE_CHECKING:
    from .mesh import DeviceMesh


class Pipe:
    """Both ends of a pipe on the client: values to the producers, batches from them."""

    def __init__(
        self,
        mesh: DeviceMesh,
        fn: Callable | str,
        args: tuple,
        kwargs: dict,
        max_messages: int,
        propagate: Callable | None,
    ) -> None:
        if type(max_messages) is not int or max_messages < 1:
            raise ValueError(f"max_messages must be a positive int, got {max_messages!r}")
        self.mesh = mesh
        self._session = session = mesh._session
        self._spec = propagate_locally(propagate, (), {})[0] if propagate else None
        name = fn if isinstance(fn, str) else getattr(fn, "__qualname__", "pipe")
        with session.lock:
            self.ref = session.new_ref()
            session.send_setup(
                mesh._ranks,
                m.CreatePipe(
                    self.ref,
                    str(name),
                    resolvable(fn),
                    max_messages,
                    session.mesh_ref(mesh.dims, mesh.slice_),
                    m.ArgsKwargs.from_python(args, kwargs),
                ),
            )

    def __monarch_ref__(self) -> m.Ref:
        return self.ref

    def recv(self, timeout: float | None = None) -> Any:
        """The next value from every rank's producer, as mesh tensors.

        Only the first call without ``propagate`` blocks (it learns what the
        values look like from the first rank), for ``timeout`` seconds at most.
        """
        if self._spec is None:
            peek = m.FunctionPath("dask_monarch.worker.pipe.peek")
            future = fetch_value(
                self._session,
                self.mesh._ranks[0],
                None,
                function=peek,
                args_kwargs=m.ArgsKwargs.from_python((self,)),
            )
            packed, treespec = future.result(timeout)
            treespec = treespec_loads(treespec)
            self._spec = tree_unflatten(
                [None if (t := described_tensor(p)) is None else Spec((*t, None)) for p in packed],
                treespec,
            )
        self._session.flush_pending()

        def message(seq: int, results: list, _: list, stream_ref: m.StreamRef) -> m.PipeRecv:
            return m.PipeRecv(seq, results, self.ref, stream_ref)

        return bind_outputs(self._spec, self.mesh, get_active_stream(), [], message)

    def send(self, value: Any) -> None:
        """Hand ``value`` (mesh tensors or plain values) to every rank's producer."""
        session, mesh = self._session, self.mesh
        stream = get_active_stream()
        with session.lock:
            stream_ref = session.stream_ref(stream)
            handles = [h for h in tree_leaves(value) if isinstance(h, Tensor)]
            first_use(session, handles)
            uses = [h._ref.id for h in handles]  # before the seq: naming a lazy view sends it
            seq = session.new_seq()
            session.invoke(seq, uses, [])
            session.send(
                mesh._ranks,
                m.SendValue(
                    seq, self.ref, [], None, m.ArgsKwargs.from_python((value,)), stream_ref
                ),
            )

    def __repr__(self) -> str:
        return f"<Pipe {self.ref} on {self.mesh!r}>"


def create_pipe(
    fn: Callable | str,
    *args: Any,
    max_messages: int = 2,
    propagate: Callable | None = None,
    **kwargs: Any,
) -> Pipe:
    """Start ``fn(pipe, *args, **kwargs)`` for every rank of the active mesh.

    Parameters
    ----------
    fn
        The producer (a callable, or an import path): it runs once per rank, in
        a process of its own, and sends values with ``pipe.send(...)``.
    *args, **kwargs
        Plain values for ``fn`` (mesh tensors go through ``Pipe.send``).
    max_messages
        How many values a producer may send ahead of the stream's ``recv``.
    propagate
        A function of fake tensors returning what one ``recv`` gives, when it
        cannot be worked out from the first value.

    Returns
    -------
    Pipe
        ``pipe.recv()`` is a mesh tensor (or pytree) on the active stream.
    """
    mesh = active_mesh()
    if mesh is None:
        raise RuntimeError("create_pipe needs an active mesh (with mesh.activate())")
    if any(isinstance(x, Tensor) for x in tree_flatten((args, kwargs))[0]):
        raise TypeError("producer arguments are plain values; send tensors with pipe.send")
    return Pipe(mesh, fn, args, kwargs, max_messages, propagate)
