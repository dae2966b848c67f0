"""Values Python asks for: fetched from every rank of the mesh, checked to agree, announced.

Library code branches on tensor values (``if mask.all():``), reads scalars
(``.item()``) and calls ops whose output shape depends on data (``nonzero``,
``x[mask]``). On a mesh tensor whose value the client does not know
(:mod:`.client_values`), each is an *implicit fetch*: the value (or the
output's shape) comes from every rank of the tensor's mesh, and the ranks must
agree, so the program takes the branch local torch would take, or learns that
the ranks disagree (``ValueError`` naming ranks and values). Like ``.item()``
on a GPU, it waits for the ranks.

``dask_monarch.implicit-fetch`` says what happens: ``warn`` (the default: one
:class:`~dask_monarch.ImplicitFetchWarning` per call site, the first frame
outside dask_monarch and torch), ``allow``, or ``error``. Inside
``dm.compile`` or ``coalescing()`` it is always an error: a recording cannot
depend on a value. DESIGN decision 16; docs/user_guide.md, "Bringing existing
model code".
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch

from . import config
from .borrows import first_use
from .controller.session import user_frame
from .exceptions import ImplicitFetchWarning

if TYPE_CHECKING:
    from .controller.session import Session
    from .protocol import messages as m

POLICIES = ("warn", "allow", "error")
Site = tuple[str, int, str]
_warned: set[Site | None] = set()  # call sites that warned (once each, in this process)


def policy() -> str:
    """``dask_monarch.implicit-fetch``, checked."""
    value = config.get("implicit-fetch", "warn")
    if value not in POLICIES:
        raise ValueError(
            f"dask_monarch.implicit-fetch is {value!r}; it must be one of {', '.join(POLICIES)}"
        )
    return value


def call_site() -> Site | None:
    """The line that asked: the first frame outside dask_monarch and torch."""
    return user_frame(sys._getframe(1))


def where(site: Site | None) -> str:
    if site is None:
        return "a line outside any Python file"
    return f"{site[0]}:{site[1]} (in {site[2]})"


def announce(
    session: Session, what: str, site: Site | None, detail: str, need: str = "the value"
) -> None:
    """Apply the policy to one implicit fetch: ``what`` (the call) at ``site`` needs ``need``
    of ``detail`` (which tensor, on which mesh). Raises where the fetch may not happen."""
    capture = session.capture
    if capture is not None:
        inside = "a compiled function" if capture.tracing else "a coalescing() block"
        raise RuntimeError(
            f"{what} at {where(site)} needs {need} of {detail} inside {inside}: a "
            "recording cannot depend on a value its replays would not fetch. Keep the value a "
            "tensor (torch.where(c, a, b) instead of `if c:`), compute it before the call and "
            "pass it in, or run this part outside the compiled function"
        )
    mode = policy()
    if mode == "error":
        raise RuntimeError(
            f"{what} at {where(site)} needs {need} of {detail}, and "
            "dask_monarch.implicit-fetch is 'error': fetch it explicitly with "
            "dask_monarch.inspect(t), keep it a tensor, or set the policy to 'warn' or 'allow'"
        )
    session.implicit_fetches += 1
    if mode == "warn" and site not in _warned:
        _warned.add(site)
        count = session.implicit_fetches
        message = (
            f"{what} at {where(site)} needs {need} of {detail}: fetching it from every rank "
            f"of the mesh, which must agree (a round trip to the ranks; implicit fetch #{count} "
            "of this mesh; later ones at this line are not reported). "
            "dask_monarch.implicit-fetch: 'allow' silences this, 'error' refuses it"
        )
        filename, lineno = (site[0], site[1]) if site is not None else ("<unknown>", 0)
        warnings.warn_explicit(
            ImplicitFetchWarning(message, filename=filename, lineno=lineno, count=count),
            ImplicitFetchWarning,
            filename,
            lineno,
        )


def from_every_rank(
    session: Session,
    ranks: tuple[int, ...],
    stream: Any,
    function: m.FunctionPath | m.Cloudpickle | None,
    args_kwargs: m.ArgsKwargs,
    handles: list,
    uses: list[int] | None = None,
) -> list[Any]:
    """``function(*args)`` (or the one argument) on each of ``ranks``, run on ``stream`` (a
    Stream) after everything sent before, in rank order. ``handles``: the mesh tensors it
    reads; ``uses``: the ref ids its value depends on (theirs by default)."""
    with session.lock:
        stream_ref = session.stream_ref(stream)
        first_use(session, handles)
        if uses is None:
            uses = [h._ref.id for h in handles]
        future = session.fetch(ranks, stream_ref, function, args_kwargs, uses)
    session.controller.flush()
    values = future.result()
    return values if len(ranks) > 1 else [values]


def agreed(values: list[Any], ranks: tuple[int, ...], what: str, site: Site | None) -> Any:
    """The one value every rank gave, or a ValueError naming ranks and values."""
    first = values[0]
    if all(same_value(first, v) for v in values[1:]):
        return first
    shown = ", ".join(f"rank {r}: {_short(v)}" for r, v in zip(ranks, values))
    raise ValueError(
        f"{what} at {where(site)}: the ranks disagree ({shown}). Python gets one value for "
        "the whole program: make the ranks agree first (t.reduce(dims, 'max'), say), or "
        "read one rank's value with dask_monarch.inspect(t, ...)"
    )


def same_value(a: Any, b: Any) -> bool:
    """Equal values, tensors and containers of them included (NaN equals NaN)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _short(value: Any) -> str:
    text = repr(value.tolist() if isinstance(value, torch.Tensor) else value)
    return text if len(text) <= 60 else text[:57] + "..."
