"""The worker runtime: the WorkerPlugin and what it runs for each controller's rank."""

from .plugin import PLUGIN_NAME, MonarchWorkerPlugin, run_segment

__all__ = ["PLUGIN_NAME", "MonarchWorkerPlugin", "run_segment"]
