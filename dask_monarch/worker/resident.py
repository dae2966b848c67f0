"""The rank's side of ``dm.OpaqueRef``: build an object and keep it whole in the stream's table.

A call's results are bound leaf by leaf (docs/protocol.md §2.3), which would
take a factory's dict or list apart; the client cannot know the object's
structure in advance. So an OpaqueRef is a ``CallFunction`` of :func:`build`
that names the ref in ``mutates`` (poisoned there if the factory or an input
failed, §4.1) and binds it here, as one value.
"""

from __future__ import annotations

from typing import Any

from ..protocol.messages import Cloudpickle, FunctionPath
from ..protocol.names import rank_function
from .calls import resolve_function
from .errors import FatalError
from .lane import current_lane

PATH = "dask_monarch.worker.resident.build"


@rank_function
def build(ref_id: int, factory: FunctionPath | Cloudpickle, *args: Any, **kwargs: Any) -> None:
    """Run ``factory`` (resolved like any remote function) and bind its result to ``ref_id``."""
    obj = resolve_function(factory)(*args, **kwargs)
    env = current_lane().env
    if ref_id in env:
        raise FatalError(f"Duplicate write to reference r{ref_id}")
    env[ref_id] = obj
