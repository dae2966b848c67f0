"""The worker runtime: the WorkerPlugin and what it runs for each controller's rank.

Other layers reach the worker only through the names below: the plugin, the
functions a controller runs on its workers (through ``Client.run``) and the
tasks it submits. Importing this package does not import torch.
"""

from ..protocol.names import PLUGIN_NAME
from .plugin import (
    MonarchWorkerPlugin,
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

__all__ = [
    "PLUGIN_NAME",
    "MonarchWorkerPlugin",
    "claim_rank",
    "construct_actor",
    "create_lanes",
    "describe_worker",
    "register_actor",
    "release_controller",
    "run_segment",
    "set_rendezvous",
    "start_rendezvous",
    "trace_collect",
    "trace_start",
]
