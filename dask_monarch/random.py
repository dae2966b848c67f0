"""Random state on every rank of the active mesh (``dm.random``), as Monarch's ``monarch.random``.

``manual_seed(s)`` gives every rank the same seed, so factories like
``torch.rand`` draw the same values everywhere. A state is a mesh tensor of
bytes: the CPU generator's state, then a flag and the state of the rank's CUDA
generator (zeros with flag 0 on ranks that have not used CUDA). ``get_state``
forks (a snapshot), ``set_state`` restores one, ``new_state(seed)`` makes the
state a seed would give without touching the generators in use.

Per-stream generators: by default every stream of a rank draws from the rank's
default generators, shared by its streams, so two streams drawing at the same
time interleave in whatever order their lanes run. ``seed_stream(seed)`` gives
the active stream generators of its own on every rank (CPU and CUDA, kept on
the stream's lane as :class:`~dask_monarch.OpaqueRef` values): random ops
issued on it then call the overload that takes ``generator=`` with them
(``tensor.dispatch``), and ``manual_seed``, ``get_state``, ``set_state`` and
``fork_rng`` under that stream act on them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .opaque_ref import OpaqueRef
from .protocol.names import rank_function
from .remote_function import remote
from .stream import Stream, get_active_stream
from .tensor import Tensor, active_mesh, as_torch_builtin, no_mesh
from .transfer import put
from .worker import rank_gpu

if TYPE_CHECKING:
    from .mesh import DeviceMesh


def _active() -> DeviceMesh:
    mesh = active_mesh()
    if mesh is None:
        raise RuntimeError("dask_monarch.random needs an active mesh (with mesh.activate())")
    return mesh


CUDA_STATE_BYTES = 16  # Philox: seed and offset


# -- on the ranks -------------------------------------------------------------------------------


def _pack(cpu: torch.Tensor, cuda: torch.Tensor | None) -> torch.Tensor:
    flagged = torch.zeros(1 + CUDA_STATE_BYTES, dtype=torch.uint8)
    if cuda is not None:
        if cuda.numel() != CUDA_STATE_BYTES:
            raise RuntimeError(
                f"dask_monarch.random expects a {CUDA_STATE_BYTES}-byte CUDA "
                f"generator state, this torch has {cuda.numel()}"
            )
        flagged[0], flagged[1:] = 1, cuda
    return torch.cat([cpu, flagged])


@rank_function
def _states(
    cpu: torch.Generator | None = None, cuda: torch.Generator | None = None
) -> torch.Tensor:
    """This rank's generator states as one byte tensor (the stream's own ones if given)."""
    if cpu is not None:
        return _pack(cpu.get_state(), cuda.get_state() if cuda is not None else None)
    gpu = rank_gpu()
    used = gpu is not None and torch.cuda.is_initialized()
    return _pack(torch.get_rng_state(), torch.cuda.get_rng_state(gpu) if used else None)


@rank_function
def _set_states(
    states: torch.Tensor, cpu: torch.Generator | None = None, cuda: torch.Generator | None = None
) -> None:
    """Restore what :func:`_states` returned (to the stream's own generators if given)."""
    split = states.numel() - 1 - CUDA_STATE_BYTES
    cpu_state, has_cuda, cuda_state = states[:split], states[split].item(), states[split + 1 :]
    if cpu is not None:
        cpu.set_state(cpu_state.clone())
        if has_cuda and cuda is not None:
            cuda.set_state(cuda_state.clone())
        return
    torch.set_rng_state(cpu_state.clone())
    if has_cuda:
        torch.cuda.set_rng_state(cuda_state.clone())


@rank_function
def _seeded_states(seed: int) -> torch.Tensor:
    """The states ``manual_seed(seed)`` would give, without touching any generator."""
    cpu = torch.Generator().manual_seed(seed).get_state()
    gpu = rank_gpu()
    cuda = None if gpu is None else torch.Generator(device=gpu).manual_seed(seed).get_state()
    return _pack(cpu, cuda)


@rank_function
def _seed(seed: int, cpu: torch.Generator | None = None, cuda: torch.Generator | None = None):
    if cpu is None:
        torch.manual_seed(seed)
        return
    cpu.manual_seed(seed)
    if cuda is not None:
        cuda.manual_seed(seed)


@rank_function
def _generator(device_type: str, seed: int) -> torch.Generator | None:
    """A stream's own generator on this rank (None for CUDA on a rank without CUDA)."""
    if device_type == "cuda":
        gpu = rank_gpu()
        return None if gpu is None else torch.Generator(device=gpu).manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@rank_function
def _deterministic(enabled: bool, warn_only: bool = False) -> None:
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic = enabled
    if enabled:  # no autotuning; deterministic cuBLAS (torch.use_deterministic_algorithms)
        torch.backends.cudnn.benchmark = False
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def _deterministic_now() -> bool:
    return torch.are_deterministic_algorithms_enabled()


# -- on the client ------------------------------------------------------------------------------


def _state_like(*args, **kwargs) -> torch.Tensor:
    return torch.empty(_cpu_state_bytes() + 1 + CUDA_STATE_BYTES, dtype=torch.uint8)


_get_state = remote("dask_monarch.random._states", propagate=_state_like)
_set_state = remote("dask_monarch.random._set_states", propagate=lambda *a, **k: None)
_new_state = remote("dask_monarch.random._seeded_states", propagate=_state_like)
_manual_seed = remote("dask_monarch.random._seed", propagate=lambda *a, **k: None)
_make_deterministic = remote(
    "dask_monarch.random._deterministic", propagate=lambda enabled, warn_only=False: None
)


@dataclass
class _OwnGenerators:
    """A stream's own generators on the ranks of one session (see :func:`seed_stream`)."""

    ranks: frozenset[int]
    cpu: OpaqueRef
    cuda: OpaqueRef


def _own(stream: Stream, mesh: DeviceMesh) -> dict:
    """The keyword arguments that aim a state function at ``stream``'s own generators."""
    own = stream.generator_for(mesh, None)
    if own is None:
        return {}
    return {"cpu": own, "cuda": stream.generator_for(mesh, torch.device("cuda"))}


def _check_seed(seed: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")


def manual_seed(seed: int) -> None:
    """Seed the active stream's generators on every rank of the active mesh with ``seed``.

    Those are the ranks' default generators (CPU and CUDA), unless the stream
    has its own (:func:`seed_stream`).
    """
    mesh = _active()
    _check_seed(seed)
    _manual_seed(seed, **_own(get_active_stream(), mesh))


def _original(function: Callable) -> Callable:
    """torch's own function, also when this module is imported again after installing."""
    return getattr(function, "__dask_monarch_original__", function)


_torch_manual_seed = _original(torch.random.manual_seed)
_torch_get_rng_state = _original(torch.random.get_rng_state)
_torch_set_rng_state = _original(torch.random.set_rng_state)
_torch_use_deterministic_algorithms = _original(torch.use_deterministic_algorithms)


@functools.cache
def _cpu_state_bytes() -> int:
    """The size of a CPU generator's state (the client's: under a mesh torch.get_rng_state
    is the ranks'), the first part of a mesh state."""
    return _torch_get_rng_state().numel()


def _torch_manual_seed_on_the_mesh(seed: int) -> torch.Generator:
    """``torch.manual_seed(seed)``: the client's generator, as always, and under an active
    mesh the ranks' too (:func:`manual_seed`). torch's own seeds only the client, whose
    generator no mesh op draws from: code that seeds torch before building its model
    (transformers' ``set_seed``) got weights that differed from the same code run locally,
    and from rank to rank."""
    generator = _torch_manual_seed(seed)
    if active_mesh() is not None:
        manual_seed(int(seed))
    return generator


def _torch_get_rng_state_on_the_mesh() -> torch.Tensor:
    """``torch.get_rng_state()``: under an active mesh, the ranks' states (:func:`get_state`),
    which :func:`_torch_set_rng_state_on_the_mesh` restores. torch's own gave the client's,
    so ``torch.utils.checkpoint`` replayed dropout with other masks in backward (wrong
    gradients) and ``torch.random.fork_rng`` restored nothing on the ranks."""
    if active_mesh() is None:
        return _torch_get_rng_state()
    return get_state()


def _torch_set_rng_state_on_the_mesh(new_state: torch.Tensor) -> None:
    """``torch.set_rng_state(state)``: a mesh state (from ``torch.get_rng_state()`` under a
    mesh) is restored on its ranks, under its mesh if none is active (a checkpointed
    forward recomputed by a backward called outside ``mesh.activate()``).

    A local state (a checkpoint's: one process's, or a mesh's fetched) sets the client's
    generator and, under an active mesh, the ranks', as ``torch.manual_seed`` does there:
    torch's own set only the client's, whose generator no mesh op draws from, and a resumed
    run's dropout silently drew other masks. A fetched mesh state (CPU state, flag, CUDA
    state) sets the client's from its CPU part."""
    if isinstance(new_state, Tensor):
        if active_mesh() is None:
            with new_state._mesh.activate():
                set_state(new_state)
            return
        set_state(new_state)
        return
    cpu_part = new_state[: _cpu_state_bytes()] if _is_mesh_state(new_state) else new_state
    _torch_set_rng_state(cpu_part)
    if active_mesh() is not None:
        set_state(new_state)


def _is_mesh_state(state: torch.Tensor) -> bool:
    """A local tensor laid out as :func:`get_state`'s values: CPU state, flag, CUDA state."""
    size = _cpu_state_bytes() + 1 + CUDA_STATE_BYTES
    return state.dtype == torch.uint8 and state.shape == (size,)


def _torch_use_deterministic_algorithms_on_the_mesh(mode: bool, *, warn_only: bool = False) -> None:
    """``torch.use_deterministic_algorithms(mode)``: the client's, and under an active mesh the
    ranks' too (:func:`make_deterministic`), where the ops run. torch's own set only the
    client's, so ``Trainer(deterministic=True)`` (Lightning) left a GPU mesh's kernels
    nondeterministic, silently."""
    _torch_use_deterministic_algorithms(mode, warn_only=warn_only)
    if active_mesh() is not None:
        _make_deterministic(bool(mode), bool(warn_only))


def install_torch_rng() -> None:
    """Route ``torch.manual_seed``, ``torch.get_rng_state``, ``torch.set_rng_state`` (and
    their ``torch.random`` names, which ``fork_rng`` and ``torch.utils.checkpoint`` call) and
    ``torch.use_deterministic_algorithms``
    through the functions above. The first mesh of a client does it."""
    for wrapper, original in (
        (_torch_manual_seed_on_the_mesh, _torch_manual_seed),
        (_torch_get_rng_state_on_the_mesh, _torch_get_rng_state),
        (_torch_set_rng_state_on_the_mesh, _torch_set_rng_state),
        (_torch_use_deterministic_algorithms_on_the_mesh, _torch_use_deterministic_algorithms),
    ):
        wrapper.__dask_monarch_original__ = original  # type: ignore[attr-defined]
        as_torch_builtin(wrapper, original)
    torch.manual_seed = torch.random.manual_seed = _torch_manual_seed_on_the_mesh
    torch.get_rng_state = torch.random.get_rng_state = _torch_get_rng_state_on_the_mesh
    torch.set_rng_state = torch.random.set_rng_state = _torch_set_rng_state_on_the_mesh
    torch.use_deterministic_algorithms = _torch_use_deterministic_algorithms_on_the_mesh


def get_state() -> Tensor:
    """Every rank's generator states (CPU and CUDA), as a mesh tensor of bytes: a fork of the
    active stream's generators that :func:`set_state` restores."""
    mesh = _active()
    return _get_state(**_own(get_active_stream(), mesh))


def set_state(state: Tensor) -> None:
    """Restore states returned by :func:`get_state` or :func:`new_state`.

    The CUDA part is restored where the state has one (its flag is set).
    """
    mesh = _active()
    if not isinstance(state, Tensor):
        state = _placed_state(state)
    _set_state(state, **_own(get_active_stream(), mesh))


def _placed_state(state: object) -> Tensor:
    """A local state as a mesh state of the active mesh: one fetched from :func:`get_state`
    (a checkpoint's), or a CPU generator's (``torch.get_rng_state()`` of one process), which
    leaves CUDA alone (flag 0)."""
    cpu_bytes = _cpu_state_bytes()
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1:
        if state.numel() == cpu_bytes:
            with no_mesh.activate():
                state = torch.cat([state, torch.zeros(1 + CUDA_STATE_BYTES, dtype=torch.uint8)])
        if _is_mesh_state(state):
            return put(state)
    raise TypeError(
        "set_state takes a state from dask_monarch.random.get_state() (a mesh tensor, or its "
        f"fetched value: {cpu_bytes + 1 + CUDA_STATE_BYTES} bytes) or a CPU generator's "
        f"({cpu_bytes} bytes, torch.get_rng_state() of one process), got {state!r}"
    )


def new_state(seed: int) -> Tensor:
    """The states ``manual_seed(seed)`` would give (CPU, and CUDA on ranks that have it), as a
    mesh tensor for :func:`set_state`; the generators in use are not touched."""
    _active()
    _check_seed(seed)
    return _new_state(seed)


@contextlib.contextmanager
def fork_rng(state: Tensor | None = None) -> Iterator[Tensor]:
    """Draw inside the block from ``state`` (or from a fork of the current state), and
    restore the generators as they were on the way out.

    Yields the state the block starts from. Like ``torch.random.fork_rng``, on every rank.
    """
    saved = get_state()
    start = saved if state is None else state
    if state is not None:
        set_state(state)
    try:
        yield start
    finally:
        set_state(saved)


def seed_stream(seed: int, stream: Stream | None = None) -> None:
    """Give ``stream`` (default: the active one) generators of its own on every rank of the
    active mesh, seeded with ``seed``.

    Random ops issued on the stream afterwards draw only from them, so what
    they draw does not depend on what other streams draw meanwhile; seeding
    again reseeds them. An op that draws random numbers but takes no
    ``generator`` (fused dropout, RNNs) is refused on such a stream.
    """
    mesh = _active()
    _check_seed(seed)
    stream = stream if stream is not None else get_active_stream()
    session = mesh._session
    generators = stream._generators
    if generators is None:
        generators = stream._generators = weakref.WeakKeyDictionary()
    old = generators.get(session)
    if old is not None and old.ranks.issuperset(mesh._ranks):
        with stream.activate():
            _manual_seed(seed, cpu=old.cpu, cuda=old.cuda)
        return
    with stream.activate():
        cpu = OpaqueRef("dask_monarch.random._generator", "cpu", seed)
        cuda = OpaqueRef("dask_monarch.random._generator", "cuda", seed)
    generators[session] = _OwnGenerators(frozenset(mesh._ranks), cpu, cuda)


def make_deterministic(enabled: bool = True) -> None:
    """Make every rank of the active mesh use deterministic algorithms (as Monarch's does:
    ``torch.use_deterministic_algorithms``, deterministic cuDNN and cuBLAS).

    These are settings of each rank's worker process: other controllers sharing
    those workers see them too. ``enabled=False`` turns them off again.
    """
    _active()
    _make_deterministic(bool(enabled))
