"""Actors on a mesh: one instance per rank, methods fed with mesh tensors (``mesh.spawn``).

``mesh.spawn("opt", Optimizer, lr=0.1)`` creates a Dask actor per rank.
``actors.call("step", grads)`` runs a method on every rank with the rank's
shard of each mesh tensor argument and returns a future of the per-rank
values; ``actors.call_tensor("scale", t, propagate=...)`` returns a mesh
tensor instead. Calls run on the active stream, in order with its tensor work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils._pytree import tree_flatten, tree_map

from .borrows import first_use
from .controller.futures import MeshFuture
from .protocol import messages as m
from .remote_function import bind_outputs, propagate_locally
from .stream import get_active_stream
from .tensor import Tensor, check_usable

if TYPE_CHECKING:
    from .mesh import DeviceMesh


class ActorMesh:
    """One actor per rank of a mesh; see :meth:`DeviceMesh.spawn`."""

    def __init__(self, mesh: DeviceMesh, name: str, cls: type, *args: Any, **kwargs: Any) -> None:
        self.mesh = mesh
        self.name = name
        self._session = mesh._session
        self.broker = self._session.controller.spawn_actor(mesh._ranks, name, cls, *args, **kwargs)

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[list[Tensor], tuple, dict]:
        leaves = tree_flatten((args, kwargs))[0]
        handles = [x for x in leaves if isinstance(x, Tensor)]
        for h in handles:
            check_usable(h)
            if h._mesh != self.mesh:
                raise TypeError(
                    f"WRONG_MESH: an actor on {self.mesh._label()} got {h._describe()}; "
                    "move it with t.to_mesh(mesh)"
                )
        local_args, local_kwargs = tree_map(
            lambda x: x._ref if isinstance(x, Tensor) else x, (args, kwargs)
        )
        return handles, local_args, local_kwargs

    def call(self, method: str, *args: Any, **kwargs: Any) -> MeshFuture:
        """Run ``method`` on every rank; a future of the values, in rank order."""
        handles, local_args, local_kwargs = self._prepare(args, kwargs)
        session, ranks = self._session, self.mesh._ranks
        stream = get_active_stream()
        self._refuse_tracing()
        if session.capture is not None:
            raise session.capture.no_fetch(f"an actor call ({method})")
        message = self._message(method, handles, local_args, local_kwargs)
        with session.lock:
            stream_ref = session.stream_ref(stream)
            first_use(session, handles)
            session.flush_pending()
            seq, future = session.expect_result([h._ref.id for h in handles], len(ranks))
            session.send(ranks, message(seq, None, (), stream_ref))
            session.request_status()
        session.controller.flush()
        return future

    def call_tensor(
        self, method: str, *args: Any, propagate: Callable | None = None, **kwargs: Any
    ) -> Any:
        """Run ``method`` on every rank; what it returns stays there, as mesh tensors."""
        if propagate is None or not callable(propagate):
            raise ValueError(
                "call_tensor needs propagate=: a function of fake tensors that "
                "returns tensors shaped like the method's result"
            )
        handles, local_args, local_kwargs = self._prepare(args, kwargs)
        spec, _ = propagate_locally(propagate, args, kwargs)
        stream = get_active_stream()
        self._refuse_tracing()
        message = self._message(method, handles, local_args, local_kwargs)
        self._session.flush_pending()
        return bind_outputs(spec, self.mesh, stream, handles, message)

    def _refuse_tracing(self) -> None:
        capture = self._session.capture
        if capture is not None and capture.tracing:
            raise NotImplementedError("actor calls inside compiled functions are not supported")

    def _message(
        self, method: str, handles: list[Tensor], args: tuple, kwargs: dict
    ) -> Callable[..., m.SendResultOfActorCall | m.CallActorMethod]:
        """What sends one call: the actor call itself goes to the ranks' actors through the
        controller, the returned message puts it in order on the stream."""
        session, ranks, broker = self._session, self.mesh._ranks, self.broker
        local_state = [h._ref for h in handles]

        def message(
            seq: int, results: list | None, _: Any, stream_ref: m.StreamRef
        ) -> m.SendResultOfActorCall | m.CallActorMethod:
            session.controller.call_actor(ranks, broker, seq, stream_ref, method, args, kwargs)
            if results is None:
                return m.SendResultOfActorCall(seq, broker, local_state, [], stream_ref)
            return m.CallActorMethod(
                results, m.ActorCallParams(seq, broker, local_state, [], stream_ref)
            )

        return message

    def __repr__(self) -> str:
        return f"<ActorMesh {self.name!r} on {self.mesh!r}>"
