"""The worker runtime: the WorkerPlugin and what it runs for each controller's rank.

Other layers reach the worker only through the names below: the plugin, the
functions a controller runs on its workers (through ``Client.run``: claims,
rendezvous, actors, the debugger's sessions) and the tasks it submits.
Importing this package does not import torch.

Modules: ``plugin`` (the WorkerPlugin: per-controller rank state, segments,
claims); ``rank`` (everything one controller holds on one rank); ``lane`` (a
stream's thread, ref table and device stream); ``inline`` (quick segments on
the event loop); ``relay`` (relayed flushes: a task per wave, fanned out
worker to worker); ``dispatch`` (the handler table) and the handlers:
``handlers`` (calls, fetches, refs, streams, meshes, status, exit), ``calls``
(resolving functions and arguments, binding results), ``borrow``, ``comm``
(collectives and sends), ``recording`` and ``plan`` (replays), ``pipe``,
``actor``, ``resident`` (``dm.OpaqueRef``); what they rely on: ``mesh`` (the
rank's view of a device mesh), ``groups`` (process groups without a default
group), ``nccl_rules`` (NCCL's rules checked on CPU), ``nccl_watch`` (NCCL
failures end the mesh, not the worker), ``user_groups`` (the checked process
groups user functions get), ``cancel`` (interrupting running calls),
``device`` (streams, events and blocks
kept alive), ``errors`` and ``failures`` (user errors as values),
``restricted`` (plain-data unpickling), ``signals`` (Ctrl-C meant for others),
``debugger`` (pdb on a lane), ``tracing`` (``dm.trace``'s records),
``checkpointing`` (``dm.checkpoint`` over the mesh's group) and ``snapshots``
(``dm.run_steps``' host copies that outlive their controller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..protocol.names import PLUGIN_NAME
from .debugger import exchange as debug_exchange
from .debugger import list_sessions as list_debug_sessions
from .debugger import pause as debug_pause
from .debugger import suppressed as breakpoints_suppressed
from .plugin import (
    MonarchWorkerPlugin,
    cancel_controller,
    claim_rank,
    construct_actor,
    create_lanes,
    describe_worker,
    register_actor,
    release_controller,
    run_segment,
    set_rendezvous,
    start_rendezvous,
    trace_collect,
    trace_start,
)
from .relay import run_relay

if TYPE_CHECKING:
    import torch


def rank_gpu() -> torch.device | None:
    """The GPU (a ``torch.device``) of the rank whose lane runs the calling thread, None on
    a CPU rank: for rank functions of other layers (``dask_monarch.random``)."""
    from .lane import current_lane

    return current_lane().rank.torch_device


def drop_snapshots(key: str) -> None:
    """``Client.run`` target: forget the snapshot of ``dm.run_steps`` job ``key`` on this
    worker (worker/snapshots.py; imported here only when called: it needs torch)."""
    from .snapshots import drop

    drop(key)


__all__ = [
    "PLUGIN_NAME",
    "drop_snapshots",
    "rank_gpu",
    "breakpoints_suppressed",
    "MonarchWorkerPlugin",
    "cancel_controller",
    "claim_rank",
    "construct_actor",
    "create_lanes",
    "debug_exchange",
    "debug_pause",
    "describe_worker",
    "list_debug_sessions",
    "register_actor",
    "release_controller",
    "run_relay",
    "run_segment",
    "set_rendezvous",
    "start_rendezvous",
    "trace_collect",
    "trace_start",
]
