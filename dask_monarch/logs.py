"""``dask_monarch.logs``: worker log records in the notebook or script, at their public path.

The same objects as :mod:`dask_monarch.observability.logs`.
"""

from .observability.logs import LOGGER, forward_worker_logs, plugin_name, stop_worker_logs

__all__ = ["LOGGER", "forward_worker_logs", "plugin_name", "stop_worker_logs"]
