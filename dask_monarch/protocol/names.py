"""Names and formats that the controller, the workers and the deployment code must agree on.

Dask matches them as plain strings: a task names its lane's executor and its
rank's resource, a controller finds the plugin and the rank resources on the
workers, and the client reads the description a rank gives of a function's
outputs. Built here and nowhere else. No torch at import: the scheduler and
the plugin's setup import this module.
"""

from __future__ import annotations

from typing import Any

# -- the worker plugin ---------------------------------------------------------------------

PLUGIN_NAME = "dask_monarch"
# Comm handlers the plugin adds to its worker: a controller's report stream, the dashboard's
# state snapshot.
REPORTS_HANDLER = "dask_monarch_reports"
STATE_HANDLER = "dask_monarch_state"
# What a controller writes on a rank's report stream to ask for a wire.Heartbeat.
HEARTBEAT_OP = "dask_monarch_heartbeat"

# -- rank resources ------------------------------------------------------------------------

RESOURCE_PREFIX = "monarch-"  # every rank resource starts with it
# Pins tasks to the worker without limiting them: far more than any number of lanes.
RESOURCE_CAPACITY = 1_000_000


def rank_resource(rank: int) -> str:
    """The resource of a worker started as rank ``rank`` (controllers order ranks by it)."""
    return f"{RESOURCE_PREFIX}rank{rank}"


def worker_resource(worker_name: Any) -> str:
    """The resource a worker started without a rank advertises once a controller claims it."""
    return f"{RESOURCE_PREFIX}{worker_name}"


# -- lane executors ------------------------------------------------------------------------


def executor_name(token: str, lane: Any) -> str:
    """The executor of ``lane`` (a stream id or the control lane) of controller ``token``."""
    return f"monarch-{token}-{lane}"


def executor_prefix(token: str) -> str:
    """How every executor name of controller ``token`` starts."""
    return executor_name(token, "")


# -- output descriptions -------------------------------------------------------------------


def describe_output(leaf: Any, keep_value: bool = True) -> tuple:
    """One leaf of a function's output as plain data, for the client to mirror.

    ``("tensor", shape, stride, storage offset, dtype, device)`` for a tensor,
    otherwise ``("value", leaf)``, or ``("value", None)`` without ``keep_value``.
    """
    import torch

    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset(),
                leaf.dtype, str(leaf.device))
    return ("value", leaf if keep_value else None)


def described_tensor(description: tuple) -> tuple | None:
    """``(shape, stride, storage offset, dtype, torch.device)`` of a described tensor, else None."""
    if description[0] != "tensor":
        return None
    import torch

    _, shape, stride, offset, dtype, device = description
    return (shape, stride, offset, dtype, torch.device(device))
