"""The worker runtime: the WorkerPlugin and what it runs for each controller's rank."""

from ..protocol.names import PLUGIN_NAME
from .plugin import MonarchWorkerPlugin, run_segment

__all__ = ["PLUGIN_NAME", "MonarchWorkerPlugin", "run_segment"]
