"""Names and formats that the controller, the workers and the deployment code must agree on.

Dask matches them as plain strings: a task names its lane's executor and its
rank's resource, a controller finds the plugin and the rank resources on the
workers, and the client reads the description a rank gives of a function's
outputs. Built here and nowhere else. No torch at import: the scheduler and
the plugin's setup import this module.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

# -- the worker plugin ---------------------------------------------------------------------

PLUGIN_NAME = "dask_monarch"
# Comm handlers the plugin adds to its worker: a controller's report stream, the dashboard's
# state snapshot.
REPORTS_HANDLER = "dask_monarch_reports"
STATE_HANDLER = "dask_monarch_state"
# The stream one worker relays the segments of a flush to another on (worker/relay.py).
RELAY_HANDLER = "dask_monarch_relay"
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


# -- the id a user sees --------------------------------------------------------------------


def mesh_id(token: str) -> str:
    """The one id of controller ``token``'s mesh that users see: in reprs, errors, logs, the
    command line and the ``/monarch/`` page. A hash (stable, not secret): the token itself
    names the controller's tasks and lets a client act on its ranks, so it is not shown."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


# -- lane executors ------------------------------------------------------------------------


def executor_name(token: str, lane: Any) -> str:
    """The executor of ``lane`` (a stream id or the control lane) of controller ``token``."""
    return f"monarch-{token}-{lane}"


def executor_prefix(token: str) -> str:
    """How every executor name of controller ``token`` starts."""
    return executor_name(token, "")


# -- task keys: the task stream's colours and Dask's task groups -----------------------------

# Dask colours the task stream by a key's prefix (``key_split``) and groups tasks by its first
# element; a segment's is ``monarch_<work>`` plus, inside ``dask_monarch.span``, the span's
# label. Work families whose task name differs from the protocol family:
TASK_WORK_NAMES = {"call": "ops"}


def task_name(family: str, span_label: str = "") -> str:
    """``monarch_ops``, ``monarch_reduce``, ... (``span_label``: from :func:`span_label`)."""
    return f"monarch_{TASK_WORK_NAMES.get(family, family)}{span_label}"


def span_label(name: str, span_id: str) -> str:
    """``-forward-1a2b3c4d``: a span's part of a task name.

    Its letters join the prefix (``monarch_ops-forward``: a colour of its own
    in the task stream; ``key_split`` keeps only alphabetic words), its id
    (8 hex digits, which ``key_split`` drops) makes a task group per span, as
    ``distributed``'s spans need: a group belongs to the span it first met.
    """
    words = "-".join(_keepable(w) for w in re.findall(r"[A-Za-z]+", name))
    return f"-{words}-{span_id[:8]}" if words else f"-{span_id[:8]}"


def _keepable(word: str) -> str:
    """``key_split`` drops an 8-letter word that starts like hex (``backward``): capitalised,
    it stays (``Backward``)."""
    return word.capitalize() if len(word) == 8 and word[0] in "abcdef" else word


# -- output descriptions -------------------------------------------------------------------


def describe_output(leaf: Any, keep_value: bool = True) -> tuple:
    """One leaf of a function's output as plain data, for the client to mirror.

    ``("tensor", shape, stride, storage offset, dtype, device)`` for a tensor,
    otherwise ``("value", leaf)``, or ``("value", None)`` without ``keep_value``.
    """
    import torch

    if isinstance(leaf, torch.Tensor):
        return (
            "tensor",
            tuple(leaf.shape),
            tuple(leaf.stride()),
            leaf.storage_offset(),
            leaf.dtype,
            str(leaf.device),
        )
    return ("value", leaf if keep_value else None)


def described_tensor(description: tuple) -> tuple | None:
    """``(shape, stride, storage offset, dtype, torch.device)`` of a described tensor, else None."""
    if description[0] != "tensor":
        return None
    import torch

    _, shape, stride, offset, dtype, device = description
    return (shape, stride, offset, dtype, torch.device(device))


# -- functions dask_monarch calls on ranks by path ---------------------------------------------

RANK_FUNCTION_MARK = "__dask_monarch_rank_function__"


def rank_function(fn: Any) -> Any:
    """Mark a function of dask_monarch that the user API calls on ranks by its import path
    (``dask_monarch.mesh._coordinate``): ``dask_monarch.functions.allow`` admits it without
    listing ``dask_monarch`` (docs/security.md); any function it calls for the user is
    checked against the list itself."""
    setattr(fn, RANK_FUNCTION_MARK, True)
    return fn
