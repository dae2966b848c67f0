"""Mesh tensors: torch tensors whose values live on the ranks of a device mesh.

Semantics: docs/protocol.md §1.2 (client-side checks) and §1.3 (ops).

A :class:`Tensor` is a wrapper subclass holding only metadata (shape, dtype,
device, strides) and the ref of the value on each rank. Torch calls on it,
and factory calls under ``mesh.activate()``, come to :func:`dispatch`, which
works out the outputs on the client (:mod:`.propagation`), checks the
client-side rules, and sends one ``CallFunction`` to the mesh's ranks (a view
op sends none until something needs its ref: "lazy views" below).
Autograd runs on the client over these handles, so ``loss.backward()`` sends
the backward ops to the ranks too.

Handles that share storage (views, in-place results) share a
:class:`~dask_monarch.borrows.StorageInfo`, which tracks aliases for
mutation (every live alias of a mutated storage is poisoned together if the
op fails) and borrows.

The wrapper class, its checks, the active mesh and :func:`dispatch` stay in
one module: torch calls each of them from the others, and a split would only
add an import cycle.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import forward_ad
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

from . import client_values, config, implicit_fetch
from .borrows import StorageInfo, first_use
from .handles import Handle, exited, last_misuse, misuse
from .propagation import (
    DATA_DEPENDENT,
    FAKE_STRICTER,
    PLANNED_BY_VALUES,
    FakeDiffers,
    OpInfo,
    Plan,
    TensorMeta,
    extent,
    meta_of,
    op_info,
    plan_of,
    set_bits,
)
from .protocol import messages as m
from .protocol.tensor_bytes import contiguous_bytes, from_bytes
from .stream import Stream, get_active_stream

if TYPE_CHECKING:
    from torch._ops import OpOverload

    from .controller.session import Session
    from .mesh import DeviceMesh
    from .transfer import MeshSliceTensor

_tuple_new = tuple.__new__


class _SentOnUse:
    """``Tensor._ref`` when the handle has none of its own: a lazy view, which naming sends.

    A non-data descriptor: a handle's own ``_ref`` (its instance dict) comes first, so a
    sent tensor pays nothing for it (a ``__getattr__`` would tax every attribute).
    """

    def __get__(self, t: Tensor | None, owner: type | None = None) -> Any:
        if t is None:
            return self
        if t._lazy is None:
            raise AttributeError(f"{t._describe()} has no ref")
        materialize(t)
        return t.__dict__["_ref"]


class Tensor(torch.Tensor, Handle):
    """A tensor on every rank of a mesh; this object holds its metadata and its ref."""

    _ref: m.Ref
    _session: Session
    _mesh: DeviceMesh
    _stream: Stream

    @staticmethod
    def __new__(
        cls,
        meta: TensorMeta,
        session: Session,
        mesh: DeviceMesh,
        stream: Stream,
        ref: m.Ref,
        storage: StorageInfo | None = None,
        owns_ref: bool = True,
        known: torch.Tensor | None = None,
        lazy: tuple | None = None,
    ) -> Tensor:
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride,
            storage_offset=meta.offset,
            dtype=meta.dtype,
            device=meta.device,
        )
        if meta.bits:
            set_bits(t, meta.bits)
        t._mkey = meta
        t._session = session
        t._mesh = mesh
        t._stream = stream
        if lazy is None:
            t._ref = ref
            t._owns_ref = owns_ref
        else:  # a view not sent yet: no _ref until something names it (see _lazy_view)
            t._lazy = lazy
            t._owns_ref = False
        t._dropped = None
        t._known = None  # the value, when the client knows it (client_values)
        fresh = storage is None
        if fresh:
            storage = StorageInfo()
        t._storage = storage
        storage.add(t)
        if known is not None:
            storage.learn(t, known)
        watch = session.watch
        if watch is not None and lazy is None:  # a dry run counts what each ref holds
            watch(ref.id, storage, extent(meta) * meta.dtype.itemsize if fresh else 0, mesh._ranks)
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    _ref = _SentOnUse()  # type: ignore[assignment]  # a lazy view's, once named

    def _root_id(self) -> int:
        """The id of the ref a lazy view reads (the history's use of it)."""
        h = self
        while h._lazy is not None:
            h = h._lazy[0]
        return h._ref.id

    def _settle_views(self) -> None:
        """Send the lazy views of this tensor's storage: something is about to change what
        their bases are (a drop, a new ref, a borrow, an in-place op)."""
        if self._storage.lazy:
            settle_views(self._storage)

    # A lazy view dropped or disowned keeps its chain: views made from it still read it.

    def drop(self) -> None:
        if self._lazy is None:
            self._settle_views()
        Handle.drop(self)

    def disown(self, why: str | None = None, settle: bool = True) -> None:
        """As :meth:`Handle.disown`; the lazy views of its storage are sent first (they read
        it), unless ``settle`` is false: a dry run's end, where nothing of the block ran."""
        if why is None and settle and self._lazy is None:  # else unusable, with its views
            self._settle_views()
        Handle.disown(self, why)

    def rebind(self, ref: m.Ref) -> None:
        self._settle_views()  # itself too, if it is a lazy view
        Handle.rebind(self, ref)
        watch = self._session.watch
        if watch is not None:  # a dry run: the new ref holds this handle's storage
            watch(ref.id, self._storage, 0, self._mesh._ranks)

    @classmethod
    def __torch_dispatch__(
        cls, func: OpOverload, types: tuple[type, ...], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return dispatch(func, args, kwargs or {})

    # -- the mesh side ------------------------------------------------------------------------

    def _check(self) -> None:
        check_usable(self)

    def reduce(
        self,
        dims: str | Sequence[str],
        reduction: str = "sum",
        scatter: bool = False,
        mesh: DeviceMesh | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """A collective over mesh ``dims`` (see :func:`dask_monarch.reduce`)."""
        from .collectives import reduce

        return reduce(self, dims, reduction, scatter=scatter, mesh=mesh, out=out)

    def reduce_(
        self,
        dims: str | Sequence[str],
        reduction: str = "sum",
        scatter: bool = False,
        mesh: DeviceMesh | None = None,
    ) -> Tensor:
        """In-place :meth:`reduce`."""
        from .collectives import reduce_

        return reduce_(self, dims, reduction, scatter=scatter, mesh=mesh)

    def to_mesh(self, mesh: DeviceMesh, stream: Stream | None = None) -> Tensor:
        """A copy of this tensor on ``mesh`` (see :func:`dask_monarch.to_mesh`)."""
        from .transfer import to_mesh

        return to_mesh(self, mesh, stream=stream)

    def slice_mesh(self, **selection: int | slice) -> MeshSliceTensor:
        """The shards of this tensor on a sub-mesh, ready for ``.to_mesh``."""
        from .transfer import slice_mesh

        return slice_mesh(self, **selection)

    # -- python protocol ----------------------------------------------------------------------

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        state = " dropped" if self._dropped is not None else ""
        return (
            f"dask_monarch.Tensor(shape={list(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, mesh={self._mesh!r}, stream={self._stream.name!r}, "
            f"ref={self._ref if self._lazy is None else 'lazy'}{state})"
        )

    def __format__(self, spec: str) -> str:
        """As torch formats: a 0-d tensor as its number, ``f"{loss:.3f}"`` and ``f"{loss}"``
        alike (an implicit fetch unless the client knows it: models name modules by index,
        ``self[f"expert_{idx[0]}"]``); any other as ``str``, the handle here."""
        if self.dim() == 0:
            return format(self.item(), spec)
        if spec:
            raise TypeError(
                f"unsupported format string {spec!r} for {self._describe()}: only a 0-d tensor "
                "formats as a number (format dask_monarch.inspect(t) for a rank's values)"
            )
        return repr(self)

    def _repr_html_(self) -> str:
        """A notebook's view: what the handle is, not its value (that lives on the ranks)."""
        from html import escape

        state = " (dropped)" if self._dropped is not None else ""
        rows = (
            ("shape", list(self.shape)),
            ("dtype", self.dtype),
            ("device", self.device),
            ("mesh", self._mesh._label()),
            ("stream", self._stream.name),
            ("ref", f"{self._ref if self._lazy is None else 'lazy (a view not sent yet)'}{state}"),
        )
        cells = "".join(f"<tr><th>{k}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
        return (
            f"<div><strong>dask_monarch.Tensor</strong><table>{cells}</table>"
            "<small>values live on the ranks: <code>dask_monarch.inspect(t)</code> "
            "fetches one</small></div>"
        )

    def _describe(self) -> str:
        """``a float32 tensor of shape [3, 4] on DeviceMesh(gpu=2) (mesh 1a2b...)``."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"a {dtype} tensor of shape {list(self.shape)} on {self._mesh._label()}"

    # -- Python asks for the value: the client's copy, or an implicit fetch ------------------

    def numpy(self, *, force: bool = False) -> Any:
        return value_of(self, "t.numpy()").numpy()

    def tolist(self) -> Any:
        return value_of(self, "t.tolist()").tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        array = value_of(self, "numpy (np.asarray(t), np.array(t))").numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    # -- copies ---------------------------------------------------------------------------------

    def __deepcopy__(self, memo: dict) -> Tensor:
        """A new mesh tensor: a clone on the ranks (``copy.deepcopy`` of a module with mesh
        parameters, an EMA copy of a model, ``nn.TransformerEncoder``'s layers)."""
        done = memo.get(id(self))
        if done is not None:
            return done
        check_usable(self)
        with torch.no_grad(), self._stream.activate():
            new = self.clone(memory_format=torch.preserve_format)
        new.requires_grad_(self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        return new

    def __copy__(self) -> Tensor:
        """``copy.copy(t)``: as torch's, a new leaf sharing ``t``'s storage (a view, which
        sends nothing); it went through pickling, which a mesh tensor refuses."""
        new = self.detach()
        if self.requires_grad:
            new.requires_grad_(True)
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{self._describe()} cannot be pickled: its value lives on the ranks. Pass it to "
            "a remote function as an argument (only its ref travels), fetch it with "
            "dask_monarch.inspect(t) (a CPU tensor, which pickles), or save mesh state with "
            "dask_monarch.checkpoint.save. A framework saving its checkpoints for you "
            "(Lightning, transformers' Trainer) needs dask_monarch.inspect of the state in "
            "its save hook: docs/user_guide.md, 'Bringing existing model code'"
        )

    def storage(self) -> Any:  # type: ignore[override]
        """Refused, saying how to save: a mesh tensor has no local memory. safetensors asks
        for it (``save_pretrained``, transformers' Trainer) once ``untyped_storage()``'s
        pointer failed, and torch's error named an "invalid python storage"."""
        raise RuntimeError(
            f"{self._describe()} has no local storage: its value lives on the ranks. To save "
            "a model, fetch its state first: model.save_pretrained(path, "
            "state_dict=dask_monarch.inspect(model.state_dict())), or torch.save of "
            "dask_monarch.inspect(...); or save mesh state with dask_monarch.checkpoint.save"
        )

    def share_memory_(self) -> Tensor:
        """Nothing to do, as for a CUDA tensor: the value is in the ranks' memory
        (``model.share_memory()``, as hogwild training calls it; torch's own path failed
        on the meta storage of the handle)."""
        check_usable(self)
        return self

    def is_shared(self) -> bool:
        return False  # in no shared memory of the client's

    def _nbytes(self) -> int:
        return self.numel() * self.element_size()

    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        return _TORCH_DATA.__get__(self, type(self))

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        set_data(self, new)


_TORCH_DATA = torch._C.TensorBase.__dict__["data"]


def set_data(t: Tensor, new: Any) -> None:
    """``t.data = new`` (what ``nn.Module.to``, ``.half()`` and ``.double()`` do to each
    parameter). torch's setter only gives the wrapper ``new``'s metadata: the handle would
    keep its old ref, and read its old value on the ranks. It is rebound to an alias of
    ``new`` instead, as torch's ``t`` then shares ``new``'s storage (views made of ``t``
    before keep the old one)."""
    if not isinstance(new, Tensor):
        if isinstance(new, torch.Tensor):
            raise misuse(
                f"LOCAL_TENSOR: t.data = local tensor of shape {list(new.shape)}, with t "
                f"{t._describe()}: place it on the mesh first (t.data = "
                "dask_monarch.put(local)), or copy it in (with torch.no_grad(): t.copy_(local))"
            )
        _TORCH_DATA.__set__(t, new)  # torch's own TypeError
        return
    check_mutable(t)
    mesh, _ = placement([t, new], "t.data = new", "borrow it first")
    if mesh._session.capture is not None:
        raise NotImplementedError(
            "t.data = new inside dask_monarch.compile: a replay cannot rebind a handle; "
            "assign outside the compiled function, or copy the value in "
            "(with torch.no_grad(): t.copy_(new))"
        )
    t._settle_views()  # views of t read its old value: they get refs of their own first
    with torch.no_grad():
        alias = _aten.alias.default(new)
    ref = alias._ref  # sent now if it was a lazy view
    with mesh._session.lock:
        Handle.rebind(t, ref)  # deletes the value t owned on the ranks
        alias._owns_ref = False
        _TORCH_DATA.__set__(t, alias)  # the wrapper's shape, strides and dtype
        t._mkey = alias._mkey
        t._storage.remove(t)
        t._storage = alias._storage
        t._storage.add(t)
        t._known = None
        if alias._known is not None:
            t._storage.learn(t, alias._known)


def cpu_ranks(mesh: DeviceMesh) -> list[int]:
    """The ranks of ``mesh`` whose device is the CPU (they have no GPU)."""
    devices = mesh._session.controller.devices
    return [r for r in mesh._ranks if not str(devices[r]).startswith("cuda")]


def _check_gpus(mesh: DeviceMesh, op: str) -> None:
    """An op (``torch.ops.aten.ones.default``) that makes CUDA tensors, refused on a mesh with
    CPU ranks: their torch would fail later ("Torch not compiled with CUDA enabled")."""
    cpu = cpu_ranks(mesh)
    if cpu:
        name = op.rpartition(".")[0].removeprefix("torch.ops.")
        raise RuntimeError(no_gpu_text(mesh, cpu, f"the op {name}"))


def no_gpu_text(mesh: DeviceMesh, cpu: list[int], what: str) -> str:
    ranks = f"ranks {', '.join(map(str, cpu))} have" if len(cpu) > 1 else f"rank {cpu[0]} has"
    return (
        f"{what} asks for CUDA, but {ranks} no GPU on {mesh._label()} (their device is the "
        "CPU): use device='cpu' (or leave device= out) and no .cuda() on this mesh, or make a "
        "mesh of GPU workers (LocalMeshCluster(device='cuda'), `dask-monarch run --device "
        "cuda`, `dask monarch worker` on GPU nodes: docs/deployment.md)"
    )


def _lazy_cuda_init() -> None:
    """``torch.cuda._lazy_init``, which torch calls before the first CUDA op of a process
    (before any dispatch): when it fails here (a CPU build of torch, no driver) under an
    active mesh with CPU ranks, the error says that, not "Torch not compiled with CUDA"."""
    try:
        _torch_lazy_cuda_init()
    except Exception as e:
        mesh = active_mesh()
        cpu = cpu_ranks(mesh) if mesh is not None else []
        if cpu:
            raise RuntimeError(no_gpu_text(mesh, cpu, "this call")) from e
        raise


_torch_lazy_cuda_init = torch.cuda._lazy_init


def install_cuda_check() -> None:
    """Route torch's CUDA initialisation through :func:`_lazy_cuda_init` (torch looks it up
    by name each time). The first mesh of a client does it; workers keep torch's own."""
    torch.cuda._lazy_init = _lazy_cuda_init


def use_foreach_kernels() -> None:
    """Let torch take its multi-tensor (``_foreach_``) paths for mesh tensors wherever it
    takes them for plain tensors on the same device, as DTensor does: torch lists the
    tensor types it trusts with them, and steps a type it does not know tensor by tensor.
    ``clip_grad_norm_`` then sends one message per op for all gradients, not one per
    gradient (each naming every alias of a ``ddp_hooks`` bucket: quadratic in the
    parameters); an optimizer on a GPU mesh steps all parameters at once by default, as on
    plain CUDA tensors (on CPU torch keeps the per-parameter default for both)."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for trusted in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if Tensor not in trusted:
            trusted.append(Tensor)


def place_loaded_optimizer_state() -> None:
    """``optimizer.load_state_dict(state)`` of local tensors (a checkpoint ``torch.load``ed)
    for parameters on a mesh places each state tensor on its parameter's mesh (once per
    process: the first mesh of a client installs it). torch moves them to ``param.device``,
    which a mesh tensor's already is ("cpu"): they stayed local, and the next step was
    refused for writing a mesh value into a local tensor."""
    from torch.optim.optimizer import Optimizer

    name = "_process_value_according_to_param_policy"
    function = Optimizer.__dict__[name].__func__
    if getattr(function, "__dask_monarch_original__", None) is not None:
        return

    @functools.wraps(function)
    def process(param: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        value = function(param, value, *args, **kwargs)
        if isinstance(param, Tensor) and type(value) is torch.Tensor:
            return from_client(value, param._mesh, param._stream)
        return value

    process.__dask_monarch_original__ = function  # type: ignore[attr-defined]
    setattr(Optimizer, name, staticmethod(process))


def refuse_mesh_data_in_local_tensors() -> None:
    """``local.data = mesh_tensor`` raises LOCAL_TENSOR (once per process: the first mesh of a
    client installs it). torch's setter would take the mesh tensor's metadata and leave
    ``local`` with no storage, and the next local op on it crashed the process (a lazy
    module's first call on mesh inputs does this: ``param.data = torch.empty(shape)``)."""
    if "data" not in torch.Tensor.__dict__:
        torch.Tensor.data = property(_TORCH_DATA.__get__, _set_local_data)  # type: ignore[assignment]


def _set_local_data(t: torch.Tensor, new: Any) -> None:
    if isinstance(new, Tensor):
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):  # it has no shape yet
            raise misuse(
                f"LOCAL_TENSOR: a lazy module's parameter (nn.LazyLinear, ...) was sized by "
                f"{new._describe()}: a local parameter cannot hold a value that lives on the "
                "ranks; give the module its input sizes (nn.Linear(in_features, ...)) and "
                "build it under mesh.activate()"
            )
        raise misuse(
            f"LOCAL_TENSOR: t.data = {new._describe()}, with t a local tensor of shape "
            f"{list(t.shape)}: a local tensor cannot hold a value that lives on the ranks; "
            "make t on the mesh (build it under mesh.activate(), or dask_monarch.put)"
        )
    _TORCH_DATA.__set__(t, new)


def _mesh_leaves(data: Any, leaves: list) -> tuple[int, ...] | None:
    """The shape of nested lists ``data`` (their leaves appended to ``leaves``)."""
    if not isinstance(data, (list, tuple)):
        leaves.append(data)
        return ()
    shapes = {_mesh_leaves(v, leaves) for v in data}
    inner = shapes.pop() if len(shapes) == 1 else ()
    return (len(data), *inner)


_STORAGES = (torch.UntypedStorage, torch.TypedStorage)


def _of_a_storage(original: Callable, data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.asarray(storage)`` (safetensors' ``load_file``, a checkpoint read from its
    file), ``torch.tensor(storage)``: a local tensor over local memory, as ``torch.load``
    makes under a mesh (local_torch.py). torch's C++ sizes it with an ``at::empty``, which an
    active mesh made a mesh tensor, and refused pointing it at the storage."""
    if active_mesh() is None:
        return original(data, *args, **kwargs)
    with activate_mesh(None):
        return original(data, *args, **kwargs)


def _local_storages(original: Callable) -> Callable:
    """``torch.asarray``: :func:`_of_a_storage` for a storage, else torch's own."""

    def asarray(obj: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(obj, _STORAGES):
            return _of_a_storage(original, obj, *args, **kwargs)
        return original(obj, *args, **kwargs)

    return asarray


def _with_mesh_values(original: Callable) -> Callable:
    """``torch.tensor(data)`` / ``torch.as_tensor(data)``, when lists ``data`` hold mesh
    tensors (``torch.tensor(losses)``): torch's C++ reads each element's memory, which a
    mesh tensor has none of ("its data is not allocated yet"). Made on the ranks instead,
    each rank's elements stacked, with torch's dtype (the promotion of the elements')."""

    def constructor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(data, _STORAGES):
            return _of_a_storage(original, data, *args, **kwargs)
        try:  # torch's own first: nothing to pay unless it failed
            return original(data, *args, **kwargs)
        except RuntimeError:
            if not isinstance(data, (list, tuple)):
                raise
            leaves: list = []
            shape = _mesh_leaves(data, leaves)
            handles = [v for v in leaves if isinstance(v, Tensor)]
            if not handles:
                raise
        dtype = kwargs.get("dtype", args[0] if args else None)
        for h in handles:
            if h.numel() != 1:
                raise ValueError(
                    f"{original.__name__}(data): data holds {h._describe()}; only one-element "
                    "tensors can be elements (torch's rule): use torch.stack or torch.cat"
                )
        if dtype is None:
            dtype = handles[0].dtype
            for v in leaves:
                if isinstance(v, torch.Tensor):
                    other = v.dtype
                else:
                    with no_dispatch():  # a local tensor, for torch's inference of its dtype
                        other = original(v).dtype
                dtype = torch.promote_types(dtype, other)
        mesh = handles[0]._mesh
        with contextlib.nullcontext() if active_mesh() is mesh else mesh.activate():
            with torch.no_grad():
                values = [
                    v.detach().reshape(()).to(dtype)
                    if isinstance(v, torch.Tensor)
                    else original(v, dtype=dtype)
                    for v in leaves
                ]
                out = torch.stack(values).reshape(shape)
        if kwargs.get("requires_grad"):
            out.requires_grad_()
        return out

    return constructor


def as_torch_builtin(wrapper: Callable, original: Callable) -> None:
    """TorchScript compiles a call of ``wrapper`` (installed in place of torch's
    ``original``) as the aten op it compiled ``original`` to: scripted code never sees
    a mesh tensor, and a Python wrapper (``*args``, a ContextVar) cannot be scripted."""
    from torch.jit._builtins import _find_builtin, _register_builtin

    op = _find_builtin(original)
    if op is not None:
        _register_builtin(wrapper, op)


_TENSOR_NEW = torch._C.TensorBase.__new__


def _legacy_tensor_new(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.Tensor(data)``, the old-style constructor, when lists ``data`` hold mesh
    tensors (``torch.Tensor([loss_a, loss_b])``): torch's C++ reads each element's memory,
    which a mesh tensor has none of. Made on the ranks as ``torch.tensor(data)`` is
    (:func:`_with_mesh_values`), in the default dtype as torch's legacy constructor makes
    it. Everything else is torch's own, and nothing is paid unless torch's failed."""
    try:
        return _TENSOR_NEW(cls, *args, **kwargs)
    except RuntimeError:
        if cls is not torch.Tensor or kwargs or len(args) != 1:
            raise
        if not isinstance(args[0], (list, tuple)):
            raise
        leaves: list = []
        _mesh_leaves(args[0], leaves)
        if not any(isinstance(v, Tensor) for v in leaves):
            raise
    return torch.tensor(args[0], dtype=torch.get_default_dtype())


def install_tensor_constructors() -> None:
    """Route ``torch.tensor`` and ``torch.as_tensor`` through :func:`_with_mesh_values`,
    ``torch.Tensor(data)`` through :func:`_legacy_tensor_new`, ``torch.ctc_loss``, which
    makes a tensor of its lengths, through :func:`_ctc_loss_of_length_tensors`,
    ``torch.asarray`` of a storage through :func:`_local_storages`, and
    ``nn.Parameter(data)`` through :func:`_parameter_on_the_mesh` (once per process: the
    first mesh of a client does it)."""
    _replace_in_torch("tensor", _with_mesh_values)
    _replace_in_torch("as_tensor", _with_mesh_values)
    _replace_in_torch("ctc_loss", _ctc_loss_of_length_tensors)
    _replace_in_torch("asarray", _local_storages)
    parameter_new = torch.nn.Parameter.__dict__["__new__"].__func__
    if not hasattr(parameter_new, "__dask_monarch_original__"):
        torch.nn.Parameter.__new__ = staticmethod(_parameter_on_the_mesh(parameter_new))
    if "__new__" not in torch.Tensor.__dict__:  # torch's is TensorBase's: subclasses keep theirs
        torch.Tensor.__new__ = staticmethod(_legacy_tensor_new)  # type: ignore[method-assign]


def _device_constructors() -> set:
    """torch's set of the functions ``with torch.device(d):`` gives ``device=d`` (cached the
    first time it is asked for: a wrapper installed before then would stand in it for the
    original that ``torch.device``'s mode sees, and ``torch.tensor([])`` under
    ``torch.device("meta")`` made a CPU tensor; transformers builds models so)."""
    from torch.utils._device import _device_constructors as constructors

    return constructors()


def _replace_in_torch(name: str, wrap: Callable[[Callable], Callable]) -> None:
    """``torch.<name>`` replaced by ``wrap(torch.<name>)``, once: the wrapper keeps the
    original's name and doc, and as ``__dask_monarch_original__`` the original itself, and
    TorchScript compiles a call of it as the original's op (:func:`as_torch_builtin`)."""
    original = getattr(torch, name)
    if hasattr(original, "__dask_monarch_original__"):
        return
    wrapper = wrap(original)
    wrapper.__dask_monarch_original__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = original.__name__
    wrapper.__doc__ = original.__doc__
    as_torch_builtin(wrapper, original)
    constructors = _device_constructors()  # made now if not before: it lists the original
    if original in constructors:
        constructors.add(wrapper)
    setattr(torch, name, wrapper)


def _parameter_on_the_mesh(original: Callable) -> Callable:
    """``nn.Parameter(local)`` under an active mesh: a parameter on the mesh holding the local
    value, as ``torch.tensor(data)`` there is a mesh tensor. transformers' ``from_pretrained``
    makes each parameter so from what it read (its model built on the meta device): under
    ``mesh.activate()`` the model was local, and its first backward refused it."""

    @functools.wraps(original)
    def __new__(cls: type, data: torch.Tensor | None = None, requires_grad: bool = True) -> Any:
        mesh = active_mesh()
        if mesh is not None and type(data) is torch.Tensor and data.device.type == "cpu":
            data = from_client(data.detach(), mesh, get_active_stream())
        return original(cls, data, requires_grad)

    __new__.__dask_monarch_original__ = original  # type: ignore[attr-defined]
    return __new__


def _ctc_loss_of_length_tensors(original: Callable) -> Callable:
    """``torch.ctc_loss`` (``F.ctc_loss``, ``nn.CTCLoss``) of mesh tensors, lengths given as
    lists: torch's C++ makes a tensor of them with ``at::empty`` and writes into it (for the
    default reduction, 'mean'), which an active mesh makes a mesh tensor with no memory ("its
    data is not allocated yet"). The lengths are passed as tensors instead: torch's overload
    for those, the same loss. With local inputs only it is local torch's call, as any op of
    local tensors is under a mesh (that ``at::empty`` did the same there). Anything else is
    torch's own call."""

    def ctc_loss(
        log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, *args: Any, **kw: Any
    ) -> Any:
        tensors = (log_probs, targets, input_lengths, target_lengths)
        if not any(isinstance(t, Tensor) for t in tensors) and active_mesh() is not None:
            with activate_mesh(None):  # local inputs: local torch, its at::empty a local one
                return original(*tensors, *args, **kw)
        if isinstance(log_probs, Tensor) and not (
            isinstance(input_lengths, torch.Tensor) or isinstance(target_lengths, torch.Tensor)
        ):
            input_lengths = torch.tensor(input_lengths, dtype=torch.long)
            target_lengths = torch.tensor(target_lengths, dtype=torch.long)
        return original(log_probs, targets, input_lengths, target_lengths, *args, **kw)

    return ctc_loss


def _operator(name: str) -> Callable[[Tensor, Any], Any]:
    original = getattr(torch.Tensor, name)
    direct = _DIRECT.get(name)

    def operator(self: Tensor, other: Any) -> Any:
        func = direct and _direct_op(direct, self, other)
        if func is not None:
            return _operation(func, (other, self) if direct[2] else (self, other))
        last_misuse.value = None
        result = original(self, other)
        if result is NotImplemented and last_misuse.value is not None:
            raise last_misuse.value
        return result

    operator.__name__ = name
    return operator


# The operators that torch turns into one aten op with the operands in a fixed order: name ->
# (the op with a Python number, the op with another mesh tensor or None, number first). Without
# autograd or another mode to see the call, ``t + 1`` goes to :func:`dispatch` directly: torch's
# dispatcher would reach the same call with the same arguments ~12 us later (a third of an op's
# cost on the client; benchmarks/RESULTS.md). In-place operators always take torch's way: it
# bumps the version counter that autograd checks saved tensors against.
_aten = torch.ops.aten
_DIRECT: dict[str, tuple[OpOverload, OpOverload | None, bool]] = {
    "__add__": (_aten.add.Tensor, _aten.add.Tensor, False),
    "__radd__": (_aten.add.Tensor, None, False),
    "__sub__": (_aten.sub.Tensor, _aten.sub.Tensor, False),
    "__rsub__": (_aten.rsub.Scalar, None, False),
    "__mul__": (_aten.mul.Tensor, _aten.mul.Tensor, False),
    "__rmul__": (_aten.mul.Tensor, None, False),
    "__truediv__": (_aten.div.Tensor, _aten.div.Tensor, False),
    "__pow__": (_aten.pow.Tensor_Scalar, _aten.pow.Tensor_Tensor, False),
    "__rpow__": (_aten.pow.Scalar, None, True),
}
_NUMBERS = frozenset({int, float, bool, complex})
_grad_enabled = torch.is_grad_enabled
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_dispatch_mode_at = torch._C._get_dispatch_stack_at
_functorch_transform = torch._C._functorch.peek_interpreter_stack


def _operation(func: OpOverload, args: tuple[Any, Any]) -> Any:
    """:func:`dispatch` of a Python operator's op, fused for its common case: the propagation
    is cached and makes one new tensor, the client mirrors no value, no trace, recording or
    generator is involved. A quarter to a third less client CPU per op than the general path
    (benchmarks/RESULTS.md); anything else takes it."""
    info = op_info(func)
    a, b = args
    handles = [a, b] if type(a) is Tensor and type(b) is Tensor else [a if type(a) is Tensor else b]
    mesh, stream = placement(handles, func, "borrow it first")
    session = mesh._session
    plan = mesh._propagator.cached(info, args, handles)
    if (
        plan is None
        or not plan.fresh
        or plan.promote is not None
        or info.writes
        or info.seeded
        or session.capture is not None
        or client_values.kind(info, args, {}, handles, plan)
    ):
        return dispatch(func, args, {})
    if plan.cuda:
        _check_gpus(mesh, info.function.path)
    ref_args = (
        (a._ref if a._lazy is None else view_arg(a)) if type(a) is Tensor else a,
        (b._ref if b._lazy is None else view_arg(b)) if type(b) is Tensor else b,
    )
    with session.lock:
        stream_ref = session.stream_ref(stream)
        first_use(session, handles)
        ref = session.new_ref()
        out = Tensor(plan.outputs[0].meta, session, mesh, stream, ref)
        seq = session.issue(handles, [ref.id], (out,), views=True)
        session.send(mesh._ranks, _call(seq, [ref], [], info.function, ref_args, {}, stream_ref))
    return out


def _call(
    seq: int,
    results: list,
    mutates: list[int],
    function: Any,
    args: tuple,
    kwargs: dict,
    stream_ref: Any,
) -> m.CallFunction:
    """The CallFunction of a dispatched op, built without the field checks: every field is
    known to be well formed here (refs in place of mesh tensors, at most one list level)."""
    flat = _flat(args) and (not kwargs or _flat(kwargs.values()))
    return m.CallFunction._make(
        (
            seq,
            results,
            [m.Ref(r) for r in mutates],
            function,
            _tuple_new(m.ArgsKwargs, (args, kwargs, None, flat)),
            stream_ref,
            [],
        )
    )


def _direct_op(direct: tuple, self: Tensor, other: Any) -> OpOverload | None:
    """The aten op ``self <op> other`` reaches, when nothing but :func:`dispatch` would see it:
    no autograd to record it, no mode but a mesh's own, no functorch transform, no forward AD."""
    other_type = type(other)
    if other_type in _NUMBERS:
        func = direct[0]
    elif other_type is Tensor and direct[1] is not None:
        if other.requires_grad and _grad_enabled():
            return None
        func = direct[1]
    else:
        return None
    if type(self) is not Tensor or (self.requires_grad and _grad_enabled()):
        return None  # a subclass may dispatch its own way
    modes = _dispatch_modes()
    if modes and (modes > 1 or type(_dispatch_mode_at(0)) is not _MeshMode):
        return None
    if _function_modes() or _functorch_transform() is not None or forward_ad._current_level >= 0:
        return None
    return func


for _name in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__matmul__",
    "__rmatmul__",
    "__truediv__",
    "__rtruediv__",
    "__floordiv__",
    "__rfloordiv__",
    "__mod__",
    "__pow__",
    "__rpow__",
    "__and__",
    "__or__",
    "__xor__",
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
):
    if hasattr(torch.Tensor, _name):
        setattr(Tensor, _name, _operator(_name))


def check_usable(t: Tensor) -> None:
    """The client-side checks every use of a mesh tensor passes (docs/protocol.md §1.2)."""
    if t._session.closed or t._dropped is not None:
        Handle._check(t)  # raises what is wrong
    if t._storage.lent_mutably is not None:
        raise misuse(
            f"BORROWED: {t!r} is borrowed by stream "
            f"{t._storage.lent_mutably.borrowed._stream.name!r}; use the borrowed "
            "tensor until the borrow is dropped"
        )


def check_mutable(t: Tensor) -> None:
    """A tensor lent immutably, or borrowed immutably, may not change."""
    if t._storage._lent:
        raise misuse(
            f"MUTATING_BORROW: {t!r} is borrowed immutably by another stream and "
            "cannot be changed until the borrow is dropped"
        )
    borrow = t._storage.borrow
    if borrow is not None and not borrow.mutable:
        raise misuse(f"MUTATING_BORROW: {t!r} is an immutable borrow and cannot be changed")


# -- activation ------------------------------------------------------------------------------

# Per thread and per asyncio task: two threads (or tasks) may drive two meshes at once.
_active_mesh: ContextVar[DeviceMesh | None] = ContextVar("dask_monarch_active_mesh", default=None)
active_mesh: Callable[[], DeviceMesh | None] = _active_mesh.get


def placement(handles: list[Tensor], what: object, hint: str) -> tuple[DeviceMesh, Stream]:
    """The mesh and stream a use of ``handles`` runs on, after the checks of docs/protocol.md §1.2.

    Every handle must be usable, on one mesh, and on the active stream; with no
    handles the active mesh is used. ``what`` (an op or a name) is formatted only
    into an error; ``hint`` ends the WRONG_STREAM message.
    """
    stream = get_active_stream()
    if not handles:
        mesh = active_mesh()
        if mesh is None:
            raise RuntimeError(f"{what}: no device mesh is active (use mesh.activate())")
        return mesh, stream
    mesh = handles[0]._mesh
    for h in handles:
        check_usable(h)
        if h._mesh is not mesh and h._mesh != mesh:
            raise misuse(
                f"WRONG_MESH: {what} uses {h._describe()} together with tensors on "
                f"{mesh._label()}; an op runs on one mesh: move the tensor with "
                "t.to_mesh(mesh)"
            )
        if h._stream is not stream:
            raise misuse(
                f"WRONG_STREAM: {h!r} belongs to stream {h._stream.name!r}, but "
                f"stream {stream.name!r} is active; {hint}"
            )
    return mesh, stream


class _MeshMode(TorchDispatchMode):
    """Under ``mesh.activate()``: factories and client data become mesh tensors; an op whose
    tensor inputs are all local runs locally, as without a mesh."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no torch.compile inside: skip the wrapper that costs ~10 us per op

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: tuple[type, ...],
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        tensors = _tensor_inputs(args, kwargs)
        if tensors is _MESH:
            return dispatch(func, args, kwargs)
        mesh = active_mesh()
        if mesh is not None:
            if id(func) in _LIFTS:  # torch.tensor(data), as_tensor, from_numpy: a value
                return from_client(args[0], mesh, get_active_stream(), private=True)
            if tensors is None and op_info(func).makes_tensors:
                return dispatch(func, args, kwargs)  # a factory: made on the mesh
        return func(*args, **kwargs)  # no_mesh.activate(), local inputs, or no tensor made


_MESH, _LOCAL = object(), object()
# what torch.tensor(data) and friends call with the tensor they made from the data
_LIFTS = {id(op) for op in (_aten.lift_fresh.default, _aten.lift.default)}


def _tensor_inputs(args: tuple, kwargs: dict) -> object | None:
    """``_MESH`` if a mesh tensor is among the inputs (one list level deep), else ``_LOCAL``
    if a local tensor is, else None."""
    found = None
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if isinstance(a, Tensor):
                return _MESH
            found = _LOCAL
        elif isinstance(a, (list, tuple)):
            for v in a:
                if isinstance(v, torch.Tensor):
                    if isinstance(v, Tensor):
                        return _MESH
                    found = _LOCAL
    return found


@contextlib.contextmanager
def activate_mesh(mesh: DeviceMesh | None) -> Iterator[None]:
    """Make ``mesh`` the active mesh (``None``: plain local torch) inside the block."""
    token = _active_mesh.set(mesh)
    try:
        with _MeshMode():
            yield
    finally:
        _active_mesh.reset(token)


class _NoMesh:
    """``with dask_monarch.no_mesh.activate():`` runs plain local torch inside an active mesh."""

    def activate(self) -> contextlib.AbstractContextManager[None]:
        return activate_mesh(None)

    def __repr__(self) -> str:
        return "no_mesh"


no_mesh = _NoMesh()


# -- dispatch --------------------------------------------------------------------------------

# Ops that answer Python with a value (t.item(), bool(t), torch.equal), by id: an OpOverload
# hashes in Python, and this is asked on every op (torch keeps them alive). -> what Python asked
_ASKS = {
    id(_aten._local_scalar_dense.default): "t.item() (or bool(t), int(t), float(t))",
    id(_aten.is_nonzero.default): "bool(t)",
    id(_aten.equal.default): "torch.equal(a, b)",
}


class _LocalTensor(Exception):
    """A local tensor among an op's inputs (the rare path: dispatch places it, then retries)."""


_LOCAL_INPUT = _LocalTensor()


def _scan(value: Any, handles: list[Tensor]) -> Any:
    """``value`` with mesh tensors replaced by their refs (one list level); collects handles."""
    if isinstance(value, Tensor):
        handles.append(value)
        return value._ref if value._lazy is None else view_arg(value)
    t = type(value)
    if t is list or t is tuple:
        for v in value:  # usually a shape or dims: no tensor in it
            if isinstance(v, torch.Tensor):
                return t(_scan(v, handles) for v in value)
        return value
    if isinstance(value, torch.Tensor):
        raise _LOCAL_INPUT
    if t is torch.device and value.type == "cuda":
        return _RANKS_GPU
    if t is torch.ScriptObject:
        raise TypeError(
            f"a {value._type().qualified_name()} (a torch.classes object, such as a quantized "
            "module's packed weights) was given to an op on mesh tensors: it is a local "
            "object, which the ranks do not have; run the module locally "
            "(dask_monarch.inspect its input, under dask_monarch.no_mesh.activate())"
        )
    return value


# ``x.cuda()``, ``x.to("cuda")`` and ``device=x.device`` reach an op with the client's device
# index (torch fills in its current device; a mesh tensor says cuda:0): on the ranks ``cuda``
# is each rank's own GPU, the current device of its lanes, whatever index it has there.
_RANKS_GPU = torch.device("cuda")


def dispatch(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run a torch op on mesh tensors: check, propagate, send one CallFunction, return handles."""
    info = op_info(func)
    if info.answers:
        return python_value(func, args, kwargs)
    if info.seeded and type(kwargs.get("generator")) is torch.Generator:
        return _drawn_by_a_client_generator(func, info, args, kwargs)
    if info.writes:  # lazy views of what it changes are sent first: their bases change
        for h in _written(info, args, kwargs):
            h._settle_views()
    handles: list[Tensor] = []
    try:
        ref_args = tuple([_scan(a, handles) for a in args])
        ref_kwargs = {k: _scan(v, handles) for k, v in kwargs.items()} if kwargs else {}
    except _LocalTensor:
        here = _known_scalars_as_values(func, info, args, kwargs)
        if here is not None:
            return func(*here[0], **here[1])
        return dispatch(func, *_place_locals(func, args, kwargs))
    mesh, stream = placement(handles, func, "borrow it first")
    try:
        plan = mesh._propagator.plan(func, info, args, kwargs, handles)
    except DATA_DEPENDENT:
        unplanned = UNPLANNED.get(func)
        if unplanned is not None:
            return unplanned(func, info, args, handles, ref_args)
        plan = _plan_from_known(func, info, args, kwargs, handles)
        if plan is None:
            return _data_dependent(func, info, args, kwargs, handles, ref_args, ref_kwargs)
    except (RuntimeError, FakeDiffers) as e:
        if func not in FAKE_STRICTER and type(e) is not FakeDiffers and func.namespace == "aten":
            raise  # a user's op (torch.library) with no fake kernel is planned by the ranks
        return _data_dependent(func, info, args, kwargs, handles, ref_args, ref_kwargs, learn=True)
    if plan.cuda:
        _check_gpus(mesh, info.function.path)
    if not handles and "dtype" not in kwargs and plan.kind == "tensor" and "dtype" in info.names:
        ref_kwargs = _default_dtype_made_explicit(ref_kwargs, plan)
    if plan.promote is not None:
        ref_args, ref_kwargs = _promoted(info, plan.promote, args, kwargs, ref_args, ref_kwargs)
    how = client_values.kind(info, args, kwargs, handles, plan)
    session = mesh._session
    if (
        info.view
        and not how
        and session.lazy_views
        and session.capture is None
        and len(handles) == 1
        and args[0] is handles[0]
        and plan.kind == "tensor"
        and plan.outputs[0].alias == 0
    ):
        return _lazy_view(handles[0], info, plan.outputs[0].meta, ref_args, ref_kwargs)
    with session.lock:
        stream_ref = session.stream_ref(stream)
        if handles:
            first_use(session, handles)
        written = _written(info, args, kwargs) if info.writes else ()
        mutates = mutated_refs(written, keep_known=how == client_values.ALL_KNOWN)
        outputs, results = [], []
        for out in plan.outputs:
            if out is None:
                outputs.append(None)
                results.append(None)
                continue
            if out.is_arg:  # in place or out=: the caller's own handle, maybe restrided
                handle = argument(info, args, kwargs, out.alias)
                if handle._mkey != out.meta:  # the mirror reshapes a known value itself
                    restride(handle, out.meta, keep_known=how == client_values.ALL_KNOWN)
                outputs.append(handle)
                results.append(None)
                continue
            storage = None
            if out.alias is not None:  # a view: it shares the argument's storage
                base = argument(info, args, kwargs, out.alias)
                if isinstance(base, (list, tuple)):
                    base = base[0] if base else None
                storage = base._storage if isinstance(base, Tensor) else None
            ref = session.new_ref()
            outputs.append(Tensor(out.meta, session, mesh, stream, ref, storage))
            results.append(ref)
        if not results:
            results = [None]
        function, inputs = info.function, handles
        if info.seeded and stream._generators is not None:
            function, inputs = _own_generator(func, info, stream, mesh, plan, handles, ref_kwargs)
        made = [o for o, r in zip(outputs, results) if r is not None]  # not the in-place ones
        seq = session.issue(
            inputs, [r.id for r in results if r is not None] + mutates, made, views=True
        )
        session.send(
            mesh._ranks, _call(seq, results, mutates, function, ref_args, ref_kwargs, stream_ref)
        )
    if how:
        client_values.mirror(func, args, kwargs, outputs, how)
        capture = session.capture
        if capture is not None and capture.tracing:  # what a read of them would depend on
            capture.derive(outputs, () if how == client_values.VALUE_FREE else handles)
    return _returned(plan.kind, outputs)


def _default_dtype_made_explicit(ref_kwargs: dict, plan: Plan) -> dict:
    """A factory's ``dtype=`` when the client's default dtype is not torch's (after
    ``torch.set_default_dtype(torch.float64)``): the ranks keep torch's, and would make
    ``torch.ones(3)`` in float32 where the client planned float64."""
    if torch.get_default_dtype() is torch.float32:
        return ref_kwargs
    return {**ref_kwargs, "dtype": plan.outputs[0].meta.dtype}


def _promoted(
    info: OpInfo, dtype: torch.dtype, args: tuple, kwargs: dict, ref_args: tuple, ref_kwargs: dict
) -> tuple[tuple, dict]:
    """The arguments of a pointwise op whose result the client's default dtype decides
    (``Plan.promote``): its integer and boolean tensor inputs cast to it where the ranks read
    them (a RefView of ``_to_copy``), except a ``where``'s condition."""

    def cast(value: Any, ref: Any, name: str) -> Any:
        if isinstance(value, Tensor) and name != "condition":
            return _tuple_new(m.RefView, (ref, _TO_COPY, (), {"dtype": dtype}))
        return ref

    names = info.names
    return (
        tuple(
            cast(a, r, names[i] if i < len(names) else "")
            for i, (a, r) in enumerate(zip(args, ref_args))
        ),
        {k: cast(kwargs[k], r, k) for k, r in ref_kwargs.items()},
    )


_TO_COPY = m.FunctionPath("torch.ops.aten._to_copy.default")


# -- lazy views ------------------------------------------------------------------------------
# A view op (``view``, ``t``, ``detach``, ``transpose``...: its one output aliases its first
# argument and it writes nothing) sends no message: its handle holds ``_lazy = (parent,
# function, args, kwargs, depth)`` and no ``_ref``, and a call that reads it names it as a
# ``RefView``, computed on the lane that reads it (docs/protocol.md §1.3, §2.2). About half of a
# training step's ops are views, each a message, a ref, a delete and a rank's unpickling less.
# Anything else that names its ref (a fetch, a borrow, a collective, a remote function, a
# compiled block, a dry run) gets one: naming ``_ref`` sends the view's own CallFunction then
# (``materialize``). Before its base's ref changes or goes (an in-place op on the storage, a
# drop, a replay's new value, a borrow), the storage's views are sent (``settle_views``), so
# a view always reads what it would have read as a message sent when it was made.

MAX_VIEW_DEPTH = 8  # views of views kept lazy; a deeper one sends its parent first


def _lazy_view(
    base: Tensor, info: OpInfo, meta: TensorMeta, ref_args: tuple, ref_kwargs: dict
) -> Tensor:
    depth = 1 if base._lazy is None else base._lazy[4] + 1
    if depth > MAX_VIEW_DEPTH:
        materialize(base)
        depth = 1
    session = base._session
    lazy = (base, info.function, ref_args[1:], ref_kwargs, depth)
    out = Tensor(meta, session, base._mesh, base._stream, None, base._storage, lazy=lazy)
    base._storage.lazy = True
    session.unsent_views.add(out)
    return out


def view_arg(h: Tensor) -> m.Ref | m.RefView:
    """What a call's arguments name for lazy view ``h``: its RefView (its ref once sent)."""
    lazy = h._lazy
    if lazy is None:
        return h._ref
    if h._session.capture is not None:  # a recording names refs only
        materialize(h)
        return h._ref
    parent, function, args, kwargs, _ = lazy
    base = view_arg(parent)
    return _tuple_new(m.RefView, (base, function, args, kwargs))


def materialize(h: Tensor) -> None:
    """Send lazy view ``h`` as the CallFunction it would have been: it gets its own ref."""
    session = h._session
    with session.lock:
        lazy = h._lazy
        if lazy is None:
            return
        if session.closed:
            raise exited(h._mesh)
        parent, function, args, kwargs, _ = lazy
        base = view_arg(parent)
        ref = session.new_ref()
        stream_ref = session.stream_ref(h._stream)
        first_use(session, [h])
        seq = session.new_seq()
        session.invoke(seq, [h._root_id()], [ref.id])
        message = _call(seq, [ref], [], function, (base, *args), kwargs, stream_ref)
        if session.capture is None:
            session.send(h._mesh._ranks, message)
        else:  # made before the block: it runs before it, outside the recording
            session.send_setup(h._mesh._ranks, message)
        h._ref, h._owns_ref, h._lazy = ref, True, None
        watch = session.watch
        if watch is not None:  # a dry run: the view's own ref holds its base's storage
            watch(ref.id, h._storage, 0, h._mesh._ranks)


def settle_views(storage: StorageInfo) -> None:
    """Send every lazy view of ``storage`` (see above)."""
    for h in storage.handles:
        if h._lazy is not None:
            materialize(h)
    storage.lazy = False


def _returned(kind: str, outputs: list) -> Any:
    if kind == "tensor":
        return outputs[0]
    if kind == "none":
        return None
    return outputs if kind == "list" else tuple(outputs)


def _written(info: OpInfo, args: tuple, kwargs: dict) -> list[Tensor]:
    """The mesh tensors ``info``'s op changes in place."""
    mutated = []
    for index in info.writes:
        value = argument(info, args, kwargs, index)
        if isinstance(value, Tensor):
            mutated.append(value)
        elif isinstance(value, (list, tuple)):
            mutated.extend(v for v in value if isinstance(v, Tensor))
    return mutated


def restride(t: Tensor, meta: TensorMeta, keep_known: bool = False) -> None:
    """Give handle ``t`` the shape, strides and offset an in-place op gave its value on the
    ranks (``squeeze_``, ``t_``, ``resize_``, ``as_strided_``, an ``out=`` resized), as torch's
    own wrapper subclasses do: the op's meta kernel run on the wrapper itself."""
    with no_dispatch(), torch._C._AutoDispatchBelowADInplaceOrView():
        was_meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            needed = extent(meta) * t.element_size()
            if t.untyped_storage().nbytes() < needed:
                _aten.resize_.default(t, [extent(meta)])
            _aten.as_strided_.default(t, meta.shape, meta.stride, meta.offset)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(was_meta)
    t._mkey = meta
    if keep_known:
        return
    if t._known is not None and (t._known.shape != meta.shape or t._known.dtype != meta.dtype):
        t._storage.forget_known()


# -- values from the client -------------------------------------------------------------------


def from_client(
    value: torch.Tensor, mesh: DeviceMesh, stream: Stream, private: bool = False
) -> Tensor:
    """A mesh tensor holding local tensor ``value`` on every rank of ``mesh``, sent by value
    (``private``: nobody else holds ``value``, so it need not be copied first). The client
    keeps a copy when it is small (client_values)."""
    if value.layout != torch.strided:
        raise TypeError(
            f"a {value.layout} tensor cannot be placed on a mesh: mesh tensors are dense "
            "(strided); place t.to_dense(), or build it on the ranks in a remote function"
        )
    if value.requires_grad:
        raise misuse(
            f"LOCAL_TENSOR: a local tensor that requires grad (shape {list(value.shape)}) was "
            "used with mesh tensors: its gradient could not come back from the ranks; make it "
            "a mesh tensor first (dask_monarch.put(t).requires_grad_()), or, for a model's "
            "parameter, move the model (dask_monarch.put(model), or build it under "
            "mesh.activate())"
        )
    value = value.detach()
    if not value.is_contiguous() or value.storage_offset():
        value, private = value.clone(memory_format=torch.contiguous_format), True
    if value.device.type == "cpu" and not (value.is_conj() or value.is_neg() or value.is_quantized):
        # a copy of its bytes (later changes to value are not sent): 3x faster than pickling
        # the tensor here and unpickling it on the ranks
        args = m.ArgsKwargs.from_python((value.dtype, value.shape, contiguous_bytes(value)))
        function = _FROM_BYTES
    else:
        function, args = _CLONE, m.ArgsKwargs.from_python((value if private else value.clone(),))
    known = value.clone() if value.numel() <= client_values.MAX_ELEMENTS else None
    session = mesh._session
    with session.lock:
        stream_ref = session.stream_ref(stream)
        ref = session.new_ref()
        handle = Tensor(meta_of(value), session, mesh, stream, ref, known=known)
        seq = session.issue([], [ref.id], [handle])
        session.send(mesh._ranks, m.CallFunction(seq, [ref], [], function, args, stream_ref, []))
    return handle


_CLONE = m.FunctionPath("torch.ops.aten.clone.default")
_FROM_BYTES = m.FunctionPath(f"{from_bytes.__module__}.from_bytes")


def local_limit() -> int:
    """``dask_monarch.local-tensors.max-bytes``: the largest local tensor used with mesh
    tensors that is placed on the mesh by itself."""
    limit = config.get("local-tensors.max-bytes", 65536)
    if type(limit) is not int or limit < 0:
        raise ValueError(
            f"dask_monarch.local-tensors.max-bytes must be a number of bytes (an int >= 0), "
            f"got {limit!r}"
        )
    return limit


class _OnTheMesh(Exception):
    """A mesh input that decides where an op runs (see _known_scalars_as_values)."""


# Indexing ops: their indices (argument 1) do not decide where they run, the tensor indexed does.
_INDEXING = {
    id(op)
    for op in (
        _aten.index.Tensor,
        _aten.index_put.default,
        _aten.index_put_.default,
        _aten._index_put_impl_.default,
    )
}


def _known_scalars_as_values(
    func: OpOverload, info: OpInfo, args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    """An op of local tensors whose mesh inputs are only scalars the client knows, expanded or
    not (or the indices of a local tensor indexed), none written or requiring grad: ``args`` and
    ``kwargs`` with those inputs as the client's copies of their values, for the op to run
    locally; None when a mesh input decides, and the op runs on the mesh.

    As torch lets a 0-d CPU tensor join a CUDA op as a number would, a scalar does not decide
    where an op runs. torch's C++ makes such scalars inside composite ops of local tensors
    (``cosine_similarity``'s eps, ``quantile``'s q, ``cov``'s correction, ``logdet``) and
    such indices for ``local[[1, 5]]``: an active mesh made them mesh tensors (``quantile``
    expands its q), so the local op went to the ranks, or was refused (a write into a local
    tensor, a large one). An op that writes into a local tensor, which the mesh would refuse,
    takes any value the client knows. Not in a backward pass: a gradient's scalar (``sum``'s,
    expanded) with a local input makes a mesh parameter's gradient."""
    if _graph_task() >= 0:  # a backward pass: what it makes goes to the mesh's gradients
        return None
    written = _written_keys(info)
    indexing = id(func) in _INDEXING
    # an op writing into a local tensor would be refused on the mesh: any value the client
    # knows may join it (torch's invert_permutation scatters an arange it made into a local)
    into_local = any(
        type(v) is torch.Tensor for k, v in (*enumerate(args), *kwargs.items()) if k in written
    )

    def value(v: Any, key: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return type(v)(value(x, key) for x in v)
        if not isinstance(v, Tensor):
            return v
        if (
            v._known is None
            or v._session.capture is not None  # a trace records what the ranks run
            or v.requires_grad
            or key in written
            or not (into_local or indexing and key == 1 or _one_value(v))
        ):
            raise _OnTheMesh
        return v._known

    try:
        return (
            tuple(value(a, i) for i, a in enumerate(args)),
            {k: value(v, k) for k, v in kwargs.items()},
        )
    except _OnTheMesh:
        return None


_graph_task = torch._C._current_graph_task_id  # -1 outside a backward pass


def _written_keys(info: OpInfo) -> set:
    """The arguments ``info``'s op writes, by position and by name (as keyword)."""
    return {info.names[i] for i in info.writes} | set(info.writes)


def _one_value(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is one element of memory: a scalar, expanded or not."""
    return all(n == 1 or s == 0 for n, s in zip(t.shape, t.stride()))


def _flat_arguments(args: tuple, kwargs: dict) -> Iterator[Any]:
    """Every argument, and the items of list and tuple arguments (one level)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _place_locals(func: OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each small local tensor placed on the mesh of the op's mesh
    tensors (a scalar, an index list: as DTensor's implicit replication); a large one, or one
    the op would write into, is refused naming the call. The source of ``mesh_t.copy_(local)``
    is placed whatever its size, as ``cuda_t.copy_(cpu_t)`` copies (``load_state_dict`` of a
    checkpoint loaded locally)."""
    mesh = next((v._mesh for v in _flat_arguments(args, kwargs) if isinstance(v, Tensor)), None)
    if mesh is None:
        mesh = active_mesh()
    stream = get_active_stream()
    info = op_info(func)
    written = _written_keys(info)
    limit = local_limit()
    transfer = func is _aten.copy_.default  # mesh.copy_(local): asked for, any size

    def place(v: Any, key: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return type(v)(place(x, key) for x in v)
        if not isinstance(v, torch.Tensor) or isinstance(v, Tensor):
            return v
        nbytes = v.numel() * v.element_size()
        if key in written:
            site = implicit_fetch.where(implicit_fetch.call_site())
            raise misuse(
                f"LOCAL_TENSOR: {func} at {site} would write into a local tensor of shape "
                f"{list(v.shape)} a value computed on the ranks; fetch it instead "
                "(local.copy_(dask_monarch.inspect(t)))"
            )
        if nbytes > limit and not (transfer and key == 1):
            site = implicit_fetch.where(implicit_fetch.call_site())
            raise misuse(
                f"LOCAL_TENSOR: a local tensor of shape {list(v.shape)} ({nbytes} bytes) was "
                f"used with mesh tensors in {func} at {site}; local tensors up to {limit} bytes "
                "are placed on the mesh by themselves (dask_monarch.local-tensors.max-bytes). "
                "Place this one once with dask_monarch.put(t) (the same value on every rank), "
                "or create it under mesh.activate()"
            )
        capture = mesh._session.capture
        if capture is not None and capture.tracing:  # a replay reuses the value: guard it
            capture.locals.append((v, v._version))
        return from_client(v, mesh, stream)

    new_args = tuple(place(a, i) for i, a in enumerate(args))
    new_kwargs = {k: place(v, k) for k, v in kwargs.items()}
    return new_args, new_kwargs


# -- values Python asks for -------------------------------------------------------------------


def python_value(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    """``t.item()``, ``bool(t)``, ``torch.equal``, ``torch.allclose``: from the client's
    copies when it knows every input's value, else from metadata where that tells (fake
    tensors), else an implicit fetch from every rank of the mesh."""
    handles: list[Tensor] = []
    try:
        ref_args = tuple([_scan(a, handles) for a in args])
        ref_kwargs = {k: _scan(v, handles) for k, v in kwargs.items()}
    except _LocalTensor:
        return python_value(func, *_place_locals(func, args, kwargs))
    if all(h._known is not None for h in handles):
        _note_read(handles)
        return client_values.run(func, args, kwargs)
    what = _ASKS.get(id(func))
    if what is None:  # an op answering with Python values: metadata alone may do
        try:
            return handles[0]._mesh._propagator.run_fake(func, args, kwargs)
        except DATA_DEPENDENT:
            what = str(func)
    args_kwargs = m.ArgsKwargs.from_python(ref_args, ref_kwargs)
    return _ask(handles, what, op_info(func).function, args_kwargs)


def value_of(t: Tensor, what: str) -> torch.Tensor:
    """The value of ``t`` as a local CPU tensor (``t.tolist()``, ``t.numpy()``)."""
    if t._known is not None:
        _note_read([t])
        return t._known.clone()
    return _ask([t], what, None, m.ArgsKwargs.from_python((t._ref,)))


def _ask(
    handles: list[Tensor],
    what: str,
    function: m.FunctionPath | None,
    args_kwargs: m.ArgsKwargs,
) -> Any:
    """An implicit fetch: ``function(*args)`` (or the one argument) from every rank of the
    handles' mesh, announced by the policy, checked to agree."""
    mesh, stream = placement(handles, what, "fetch it under that stream")
    site = implicit_fetch.call_site()
    session = mesh._session
    implicit_fetch.announce(session, what, site, handles[0]._describe())
    values = implicit_fetch.from_every_rank(
        session, mesh._ranks, stream, function, args_kwargs, handles
    )
    return implicit_fetch.agreed(values, mesh._ranks, what, site)


def _note_read(handles: list[Tensor]) -> None:
    """A value the client knows was read by Python: a trace in progress must guard on it."""
    capture = handles[0]._session.capture if handles else None
    if capture is not None and capture.tracing:
        capture.read_known(handles, implicit_fetch.call_site())


def _plan_from_known(
    func: OpOverload, info: OpInfo, args: tuple, kwargs: dict, handles: list[Tensor]
) -> Plan | None:
    """The outputs of an op whose shapes depend on data, when the client knows the values they
    depend on: those of the inputs a PLANNED_BY_VALUES op names, or every input's, and then it
    runs the op itself (and mirrors it). None otherwise."""
    by_values = PLANNED_BY_VALUES.get(func)
    if by_values is not None:
        plan = by_values(args, _known_value, handles[0]._mesh._propagator.run_fake)
        if plan is not None:
            return plan
    if info.seeded or not all(h._known is not None for h in handles):
        return None
    return plan_of(client_values.run(func, args, kwargs), info)


def _known_value(value: Any) -> torch.Tensor | None:
    """The client's copy of a tensor argument's value: a local tensor's own, a mesh tensor's
    when the client knows it (client_values), else None."""
    if isinstance(value, Tensor):
        return value._known
    return value if isinstance(value, torch.Tensor) else None


_DESCRIBE = m.FunctionPath("dask_monarch.propagation.describe")


def _data_dependent(
    func: OpOverload,
    info: OpInfo,
    args: tuple,
    kwargs: dict,
    handles: list[Tensor],
    ref_args: tuple,
    ref_kwargs: dict,
    learn: bool = False,
) -> Any:
    """An op whose output shapes depend on its inputs' values (``nonzero``, ``unique``,
    ``x[mask]``): it runs on the ranks, and the outputs' metadata is an implicit fetch from
    every rank, which must agree (a mesh tensor has one shape on every rank).

    ``learn``: an op whose fake kernel refused inputs the ranks' kernel takes
    (FAKE_STRICTER) or is known to say other metadata (FAKE_DIFFERS); the metadata the ranks
    report is kept as the plan of the next call with inputs of the same metadata. A real
    error is the ranks' own."""
    mesh, stream = placement(handles, func, "borrow it first")
    returns = func._schema.returns
    if any(str(r.type) != "Tensor" for r in returns):
        raise ValueError(
            f"{func}: what it returns depends on the values of its inputs, and is not a fixed "
            "number of tensors; run it in a remote function (dask_monarch.remote) or fetch "
            "its inputs (dask_monarch.inspect)"
        )
    session = mesh._session
    what = str(func)
    site = implicit_fetch.call_site()
    detail, value = handles[0]._describe(), "value"
    if len(handles) > 1:  # which of them decides is the op's business (ctc_loss: the lengths)
        detail, value = f"its {len(handles)} mesh tensor inputs ({detail}, ...)", "values"
    need = (_LEARNED_NEED if learn else "its output's shape, which depends on the {}").format(value)
    implicit_fetch.announce(session, what, site, detail, need)
    targets: list = [
        argument(info, args, kwargs, info.returns_alias[i]) if info.returns_write[i] else None
        for i in range(len(returns))
    ]  # out=: the caller's handle, restrided below; else a new ref
    results = send_unplanned(
        mesh, stream, info, args, kwargs, handles, ref_args, ref_kwargs, targets
    )
    targets = [t if t is not None else r for t, r in zip(targets, results)]
    refs = [t._ref if isinstance(t, Tensor) else t for t in targets]
    fresh = [r for r in results if r is not None]
    try:
        metas = implicit_fetch.agreed(
            implicit_fetch.from_every_rank(
                session,
                mesh._ranks,
                stream,
                _DESCRIBE,
                m.ArgsKwargs.from_python(refs),
                [],
                [r.id for r in refs],
            ),
            mesh._ranks,
            what,
            site,
        )
    except BaseException:
        for ref in fresh:
            session.drop_ref(mesh._ranks, ref)
        raise
    device = handles[0].device
    outputs = []
    with session.lock:
        for i, (target, meta) in enumerate(zip(targets, metas)):
            meta = TensorMeta(*meta[:4], device, meta[5])
            if isinstance(target, Tensor):
                restride(target, meta)
                outputs.append(target)
                continue
            alias = info.returns_alias[i]
            base = argument(info, args, kwargs, alias) if alias is not None else None
            storage = base._storage if isinstance(base, Tensor) else None
            outputs.append(Tensor(meta, session, mesh, stream, target, storage))
    if learn:
        mesh._propagator.learn(info, args, kwargs, handles, outputs)
    return _returned("tensor" if len(returns) == 1 else "tuple", outputs)


_LEARNED_NEED = (
    "its outputs' metadata from the ranks (once per input metadata: fake tensors refuse this "
    "op on the CPU, are known to say other metadata, or it is a custom op with no fake kernel: "
    "give it one with register_fake), for its call on the {}"
)


def send_unplanned(
    mesh: DeviceMesh,
    stream: Stream,
    info: OpInfo,
    args: tuple,
    kwargs: dict,
    handles: list[Tensor],
    ref_args: tuple,
    ref_kwargs: dict,
    targets: list,
) -> list[m.Ref | None]:
    """Send the call of an op whose outputs were not planned: a new ref for each output whose
    ``targets`` entry is None, none for the others (an ``out=`` handle, or ``False``: an output
    the ranks do not keep). Returns the results' refs (None where no new one)."""
    session = mesh._session
    with session.lock:
        stream_ref = session.stream_ref(stream)
        first_use(session, handles)
        mutates = mutated_refs(_written(info, args, kwargs))
        results = [session.new_ref() if t is None else None for t in targets]
        seq = session.issue(handles, [r.id for r in results if r is not None] + mutates)
        message = _call(seq, results, mutates, info.function, ref_args, ref_kwargs, stream_ref)
        session.send(mesh._ranks, message)
    return results


# Ops whose outputs' shapes depend on data and that a module of their own makes (packed.py):
# op -> maker(func, info, args, handles, ref_args), called instead of an implicit fetch.
UNPLANNED: dict[OpOverload, Callable] = {}


def _flat(values: Any) -> bool:
    """No list or tuple among ``values`` (the worker then resolves refs one level deep)."""
    for v in values:
        if type(v) in _NOT_FLAT:
            return False
    return True


_NOT_FLAT = frozenset({list, tuple, m.RefView})


def _own_generator(
    func: OpOverload,
    info: OpInfo,
    stream: Stream,
    mesh: DeviceMesh,
    plan: Any,
    handles: list[Tensor],
    ref_kwargs: dict,
) -> tuple[m.FunctionPath, list]:
    """A random op on a stream with generators of its own (``dm.random.seed_stream``) draws
    from them: the overload that takes ``generator=``, given the stream's generator (an
    OpaqueRef on its lane). Adds the ``generator`` keyword to ``ref_kwargs``."""
    device = next((o.meta.device for o in plan.outputs if o is not None), None)
    if device is None and handles:
        device = handles[0].device
    generator = stream.generator_for(mesh, device)
    if generator is None or ref_kwargs.get("generator") is not None:
        return info.function, handles
    if info.with_generator is None:
        raise NotImplementedError(
            f"{func} draws random numbers but takes no generator, so it cannot use the own "
            f"generators of stream {stream.name!r} (dask_monarch.random.seed_stream); run it on "
            "a stream that draws from the ranks' default generators"
        )
    ref_kwargs["generator"] = generator.__monarch_ref__()
    return info.with_generator, [*handles, generator]


# Random ops that overwrite their tensor without reading it (by name, any overload): the draw
# needs its layout, not its value. ``*_like`` factories need only their input's layout too.
_FILLS = frozenset(
    {
        "uniform_",
        "normal_",
        "random_",
        "cauchy_",
        "log_normal_",
        "exponential_",
        "geometric_",
        "bernoulli_",
    }
)


def _drawn_by_a_client_generator(func: OpOverload, info: OpInfo, args: tuple, kwargs: dict) -> Any:
    """A random op given a ``torch.Generator`` of the client's runs on the client, as local
    torch, so that the generator advances as it does there, and its result is placed on the
    mesh: every rank gets the same draws, those local torch gives (diffusers'
    ``randn_tensor(shape, generator=g)``). Sent to the ranks, the generator travelled by value
    and never advanced: each flush drew the same numbers again.

    A draw into a mesh tensor (``t.normal_(generator=g)``, ``nn.init``) is made into a local
    tensor of its layout and copied in; a mesh input whose values the op reads
    (``torch.multinomial(probs, 1, generator=g)``) is fetched, as ``.item()`` is.
    """
    handles = [x for x in _flat_arguments(args, kwargs) if isinstance(x, Tensor)]
    mesh, stream = placement(handles, func, "borrow it first")
    capture = mesh._session.capture
    what = f"{func} with a torch.Generator of the client's"
    if capture is not None and capture.tracing:
        raise NotImplementedError(
            f"{what} inside a compiled function: its draws would be made once, when it is "
            "traced, and replayed unchanged. Draw outside and pass the tensor in, or draw from "
            "the ranks' generators (no generator=, seeded with torch.manual_seed or "
            "dask_monarch.random)"
        )
    device = kwargs.get("device")
    if any(h.device.type != "cpu" for h in handles) or (
        device is not None and torch.device(device).type != "cpu"
    ):
        raise NotImplementedError(
            f"{what} on a GPU: the client draws on its CPU. Draw on the CPU and move the result "
            "(torch.randn(shape, generator=g).to(device), as diffusers' randn_tensor does), or "
            "draw from the ranks' generators (no generator=)"
        )
    name = func._schema.name.split("::")[-1]
    layout_only = args[0] if args and (name in _FILLS or name.endswith("_like")) else None
    local_of: dict[int, torch.Tensor] = {}
    local_args = [_client_side(a, local_of, layout_only, what) for a in args]
    local_kwargs = {k: _client_side(v, local_of, layout_only, what) for k, v in kwargs.items()}
    with no_dispatch():
        result = func(*local_args, **local_kwargs)
    for h in _written(info, args, kwargs):  # the draws go into the mesh tensor
        dispatch(_aten.copy_.default, (h, local_of[id(h)]), {})
    mesh_of = {id(local_of[id(h)]): h for h in handles}
    return _placed_draws(result, mesh_of, mesh, stream)


def _client_side(x: Any, local_of: dict, layout_only: Any, what: str) -> Any:
    """Argument ``x`` of a draw the client makes: a mesh tensor as a local one (of its layout
    for ``layout_only``, else its value, fetched unless known), kept in ``local_of``."""
    if isinstance(x, Tensor):
        if id(x) not in local_of:
            if x is layout_only:
                local_of[id(x)] = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
            else:
                local_of[id(x)] = value_of(x, what)
        return local_of[id(x)]
    if isinstance(x, (list, tuple)):
        return type(x)(_client_side(v, local_of, layout_only, what) for v in x)
    return x


def _placed_draws(value: Any, mesh_of: dict, mesh: DeviceMesh, stream: Stream) -> Any:
    """What a client-side draw returned, on the mesh: its in-place targets' own handles
    (``mesh_of``: id of the local stand-in -> the mesh tensor), new tensors placed."""
    if isinstance(value, torch.Tensor):
        mine = mesh_of.get(id(value))
        return mine if mine is not None else from_client(value, mesh, stream, private=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_placed_draws(v, mesh_of, mesh, stream) for v in value)
    return value


def argument(info: OpInfo, args: tuple, kwargs: dict, index: int) -> Any:
    """The value passed for schema argument ``index``."""
    if index < len(args):
        return args[index]
    return kwargs.get(info.names[index])


def mutated_refs(handles: list[Tensor], keep_known: bool = False) -> list[int]:
    """Every live alias of every mutated storage (all of them are redefined by the op). The
    client no longer knows their values, unless ``keep_known``: it computes the op itself."""
    if not handles:
        return []
    refs: dict[int, None] = {}
    storages: set[int] = set()  # each once: a foreach op on a bucket's views names it per view
    for h in handles:
        check_mutable(h)
        storage = h._storage
        if id(storage) in storages:
            continue
        storages.add(id(storage))
        h._settle_views()  # the op redefines them too: they need refs of their own
        if not keep_known:
            storage.forget_known()
        for ref in storage.refs():
            refs[ref] = None
    return list(refs)


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))
