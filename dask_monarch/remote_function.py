"""Remote functions: user Python run on every rank of a mesh (docs/protocol.md §1.4).

``@dm.remote`` turns a function into one that runs on the ranks of the mesh
its tensor arguments live on (or the active mesh) and returns mesh tensors.
Their shapes come from ``propagate``: a callable run on fake tensors,
``"inspect"`` (nothing tracked: the call returns None), or ``None``: rank 0
runs the function once on fake copies of its inputs, and the answer is
cached by input metadata. Functions importable by their module path travel
as that path; closures and ``__main__`` functions are cloudpickled.
:func:`bind_outputs` sends a call whose outputs are described this way (remote
functions, pipe receives, actor calls that return mesh tensors).
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import (
    tree_flatten,
    tree_map,
    tree_unflatten,
    treespec_dumps,
    treespec_loads,
)

from . import config
from .borrows import first_use
from .collectives import without_gradient
from .fetch import fetch_value, shard_rank
from .mesh import DeviceMesh, RemoteProcessGroup
from .opaque_ref import OpaqueRef, place, split_handles
from .propagation import TensorMeta, fake_from_meta
from .protocol import messages as m
from .protocol.messages.values import resolvable
from .protocol.names import describe_output, described_tensor, rank_function
from .stream import Stream
from .tensor import Tensor, mutated_refs

logger = logging.getLogger("dask_monarch.remote_function")


def _resolve_locally(fn: Callable | str) -> Callable:
    if not isinstance(fn, str):
        return fn
    module, name = fn.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), name)
    return getattr(obj, "_remote_impl", obj)


class Remote:
    """A function that runs on every rank of a mesh; see :func:`remote`."""

    def __init__(self, fn: Callable | str, propagate: Callable | str | None = None) -> None:
        if not (callable(fn) or isinstance(fn, str)):
            raise TypeError(f"remote needs a callable or an import path, got {fn!r}")
        if propagate is not None and propagate != "inspect" and not callable(propagate):
            raise ValueError(f"propagate must be a callable, 'inspect' or None, got {propagate!r}")
        self._fn = fn
        self._function = resolvable(fn)
        self._propagate = propagate
        self._cache: dict = {}
        if callable(fn):
            functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = tree_flatten((args, kwargs))
        handles, objects = split_handles(leaves)
        groups = [x for x in leaves if isinstance(x, RemoteProcessGroup)]
        mesh, stream = place(handles, objects, repr(self), groups)
        if self._propagate == "inspect":
            # it may change any of its tensors: the client's copies of their values go
            spec, mutated = None, []
            for h in handles:
                h._storage.forget_known()
        elif self._propagate is not None:
            spec, mutated = propagate_locally(self._propagate, args, kwargs)
        elif objects:
            raise ValueError(
                f"{self!r} takes {objects[0]!r}: learning its output shapes by running it "
                "once on rank 0 would run it on the rank's real object (advancing a loader, "
                "stepping an optimizer); give it propagate= (a callable run on fake tensors, "
                "which receives the OpaqueRef handle itself) or propagate='inspect' when it "
                "returns no tensors"
            )
        else:
            spec, mutated = self._propagate_remotely(mesh, args, kwargs, leaves, handles)

        declared = None
        if spec is not None and mesh._session.capture is None:  # checked where it is bound
            declared = [
                (leaf[0], leaf[3], leaf[4].type) if isinstance(leaf, Spec) else None
                for leaf in tree_flatten(spec)[0]
            ]

        def message(
            seq: int, results: list, mutates: list[int], stream_ref: m.StreamRef
        ) -> m.CallFunction:
            if declared is not None and any(declared):
                mesh._session.controller.expect_results(
                    mesh._ranks, seq, stream_ref, self._name(), declared
                )
            return m.CallFunction(
                seq,
                results,
                [m.Ref(r) for r in mutates],
                self._function,
                m.ArgsKwargs.from_python(args, kwargs),
                stream_ref,
                [g.ref for g in groups],
            )

        out = bind_outputs(spec, mesh, stream, handles, message, mutated, groups, objects)
        differentiable = [h for h in handles if h.requires_grad]
        if out is None or not differentiable or not torch.is_grad_enabled():
            return out
        # autograd cannot see into it: backward reaching its outputs raises, saying so
        what = f"{self!r} (a remote function)"
        because = "Autograd cannot see what it computes on the ranks: "
        return tree_map(
            lambda o: (
                without_gradient(differentiable[0], lambda: o, what, because)
                if isinstance(o, Tensor) and (o.is_floating_point() or o.is_complex())
                else o
            ),
            out,
        )

    def _propagate_remotely(
        self, mesh: DeviceMesh, args: tuple, kwargs: dict, leaves: list, handles: list[Tensor]
    ) -> tuple[Any, list]:
        key = tuple((h._mkey, id(h._storage)) for h in handles)
        try:
            key = (key, _static_key((args, kwargs)))
        except TypeError:
            key = None
        cached = self._cache.get(key) if key is not None else None
        if cached is None:
            rank = mesh._ranks[0]
            future = fetch_value(
                mesh._session,
                rank,
                None,
                function=m.FunctionPath("dask_monarch.remote_function._propagate_on_rank"),
                args_kwargs=m.ArgsKwargs.from_python((self._function, args, kwargs)),
            )
            cached = _unpack_spec(future.result())
            if key is not None:
                self._cache[key] = cached
        spec, changed = cached  # ``changed``: positions among ``leaves``, the arguments'
        return spec, [leaves[i] for i in changed if isinstance(leaves[i], Tensor)]

    def call_on_shard_and_fetch(self, *args: Any, shard: dict | None = None, **kwargs: Any) -> Any:
        """Run the function on one rank only and return its value (tensors on the CPU)."""
        leaves, _ = tree_flatten((args, kwargs))
        handles, objects = split_handles(leaves)
        mesh, _ = place(handles, objects, repr(self))
        rank = shard_rank(mesh, shard or {})
        return fetch_value(
            mesh._session,
            rank,
            None,
            function=self._function,
            args_kwargs=m.ArgsKwargs.from_python(args, kwargs),
            inputs=[*handles, *objects],
        ).result()

    def _name(self) -> str:
        """How errors name the function: its import path, or module and qualified name."""
        fn = self._fn
        if isinstance(fn, str):
            return fn
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

    def __repr__(self) -> str:
        name = self._fn if isinstance(self._fn, str) else getattr(self._fn, "__qualname__", "?")
        return f"<remote {name}>"


def remote(
    fn: Callable | str | None = None, *, propagate: Callable | str | None = None
) -> Remote | Callable[[Callable], Remote]:
    """Make ``fn`` (a callable or an import path) run on every rank of a mesh.

    Usable as ``@remote``, ``@remote(propagate=...)`` and ``remote("pkg.mod.fn", ...)``.

    Parameters
    ----------
    fn
        A function (sent by value: closures and notebook cells work) or the
        import path of one (``"pkg.mod.fn"``; ``functions.allow`` may restrict
        which). It receives each rank's values for mesh tensors, OpaqueRefs and
        process groups among its arguments.
    propagate
        What it returns, worked out on the client: a function run on fake
        tensors with the same arguments; ``"inspect"``: it returns no mesh tensor
        (only a fetch gives its value); None: rank 0 runs it once on fake copies
        of its inputs, and the answer is cached by their metadata.

    Returns
    -------
    Remote
        Calling it under ``mesh.activate()`` (or with mesh tensors) returns mesh
        tensors in the structure ``propagate`` describes;
        ``.call_on_shard_and_fetch(*args, shard=...)`` runs it on one rank and
        returns its value. docs/protocol.md §1.4.
    """
    if fn is None:
        return lambda f: Remote(f, propagate)
    return Remote(fn, propagate)


def bind_outputs(
    spec: Any,
    mesh: DeviceMesh,
    stream: Stream,
    handles: list[Tensor],
    make: Callable,
    mutated: Sequence[Tensor] = (),
    groups: Sequence[RemoteProcessGroup] = (),
    objects: Sequence[OpaqueRef] = (),
) -> Any:
    """Send ``make(seq, results, mutates, stream_ref)``, a call whose outputs are ``spec``'s
    tensors (or nothing when ``spec`` is None); returns handles in ``spec``'s shape.

    Remote functions, pipes and actors describe their outputs this way; ``objects``
    (OpaqueRefs among the arguments) are read by the call, as ``handles`` are.
    """
    session = mesh._session
    with session.lock:
        stream_ref = session.stream_ref(stream)
        for group in groups:
            session.ensure_group_split(group.mesh._ranks, group.ref, stream_ref)
        first_use(session, handles)
        mutates = mutated_refs(mutated)
        leaves, treespec = tree_flatten(spec)
        results, out = [], []
        for leaf in leaves:
            if isinstance(leaf, Spec):
                *metadata, alias = leaf  # shape, stride, offset, dtype, device
                ref = session.new_ref()
                storage = alias._storage if alias is not None else None
                out.append(Tensor(TensorMeta(*metadata), session, mesh, stream, ref, storage))
                results.append(ref)
            else:
                out.append(leaf)
                results.append(None)
        inputs = [*handles, *objects] if objects else handles
        seq = session.issue(inputs, [r.id for r in results if r is not None] + mutates, out)
        session.send(mesh._ranks, make(seq, results, mutates, stream_ref))
    return None if spec is None else tree_unflatten(out, treespec)


# -- propagation -----------------------------------------------------------------------------

_fake_modes = threading.local()


def _fake_mode_() -> FakeTensorMode:
    """This thread's fake mode: one mode used by two threads at once fails torch's own check
    of its kernel state (``AssertionError: False, True``: two meshes saving checkpoints
    from two threads)."""
    mode = getattr(_fake_modes, "mode", None)
    if mode is None:
        mode = _fake_modes.mode = FakeTensorMode()
    return mode


def propagate_locally(propagate: Callable, args: tuple, kwargs: dict) -> tuple[Any, list]:
    """Run ``propagate`` on fake copies of the arguments: output metadata and mutated inputs."""
    mode = _fake_mode_()
    fakes: dict[int, torch.Tensor] = {}

    def fake(x: Any) -> Any:
        if isinstance(x, Tensor):
            f = fakes.get(id(x))
            if f is None:
                shape, stride, offset, dtype, device, bits = x._mkey
                meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                f = fakes[id(x)] = fake_from_meta(mode, meta, device, bits)
            return f
        return x

    with _disable_current_modes():  # the mesh's own mode must not see the fakes
        fake_args, fake_kwargs = tree_map(fake, (args, kwargs))
        handles = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
        versions = [fakes[id(h)]._version for h in handles]
        with mode:
            out = propagate(*fake_args, **fake_kwargs)
    mutated = [h for h, v in zip(handles, versions) if fakes[id(h)]._version != v]
    storages = {StorageWeakRef(fakes[id(h)].untyped_storage()): h for h in handles}
    spec = tree_map(lambda x: _spec(x, storages) if isinstance(x, torch.Tensor) else x, out)
    return spec, mutated


class Spec(tuple):
    """(shape, stride, offset, dtype, device, aliased input handle or None) of an output tensor."""

    __slots__ = ()


def _spec(t: torch.Tensor, storages: dict) -> Spec:
    alias = storages.get(StorageWeakRef(t.untyped_storage())) if storages else None
    return Spec((tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device, alias))


def _static_key(tree: Any) -> tuple:
    leaves, spec = tree_flatten(tree)
    parts = [x._mkey if isinstance(x, Tensor) else x for x in leaves]
    return (str(spec), tuple(parts))


@rank_function
def _propagate_on_rank(
    function: m.FunctionPath | m.Cloudpickle, args: tuple, kwargs: dict
) -> tuple[list[tuple], str]:
    """On rank 0: run the function on fake copies of its real inputs; return output metadata."""
    from .worker import breakpoints_suppressed
    from .worker.calls import resolve_function

    fn = resolve_function(function)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args, fake_kwargs = tree_map(
        lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
    )
    inputs = tree_flatten((fake_args, fake_kwargs))[0]
    versions = [x._version if isinstance(x, torch.Tensor) else None for x in inputs]
    with mode, breakpoints_suppressed():  # a breakpoint() stops the real call, not this one
        out = fn(*fake_args, **fake_kwargs)
    leaves, spec = tree_flatten(out)
    packed = [describe_output(x) for x in leaves]
    changed = [
        i for i, (x, v) in enumerate(zip(inputs, versions)) if v is not None and x._version != v
    ]
    config.freeze_new_imports()  # the first fake run imports dynamo into this worker
    return packed, treespec_dumps(spec), changed


def _unpack_spec(reply: tuple[list[tuple], str, list[int]]) -> tuple[Any, list[int]]:
    """The output spec, and the positions among the call's argument leaves of the inputs the
    function changed in place (the client forgets its copies of their values)."""
    packed, spec, changed = reply
    spec = treespec_loads(spec)
    leaves = [p[1] if (t := described_tensor(p)) is None else Spec((*t, None)) for p in packed]
    return tree_unflatten(leaves, spec), changed
