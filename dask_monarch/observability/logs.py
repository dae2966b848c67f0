"""dask_monarch's worker log records, shown where the notebook or script runs.

Workers log under ``dask_monarch.*`` (a controller that left without Exit,
a released rank, ...). By default those records stay in the worker
processes; :func:`forward_worker_logs` ships them to the client through
``Client.forward_logging`` and makes sure they are shown there::

    from dask_monarch.logs import forward_worker_logs
    forward_worker_logs(client, level="INFO")

Log levels in general follow the dask convention: ``logging:
{dask_monarch: info}`` in a dask config file (``DASK_LOGGING__DASK_MONARCH=info``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from distributed import Client, WorkerPlugin

if TYPE_CHECKING:
    from distributed import Worker

LOGGER = "dask_monarch"
_FORMAT = "%(asctime)s %(levelname)s %(name)s%(where)s: %(message)s"


class LoggerLevel(WorkerPlugin):
    """Set a logger's level on every worker, including workers that join later.

    The worker-side level decides which records exist at all; forwarding
    alone would only ship what the (default WARNING) level lets through.
    Teardown restores the previous level.
    """

    def __init__(self, logger: str, level: int) -> None:
        self.logger = logger
        self.level = level
        self.name = plugin_name(logger)
        self._before: int | None = None

    def setup(self, worker: Worker) -> None:
        log = logging.getLogger(self.logger)
        self._before = log.level
        log.setLevel(self.level)

    def teardown(self, worker: Worker) -> None:
        if self._before is not None:
            logging.getLogger(self.logger).setLevel(self._before)


def plugin_name(logger: str = LOGGER) -> str:
    return f"dask_monarch-log-level-{logger}"


class _WorkerFormatter(logging.Formatter):
    """Names the worker a forwarded record came from (``record.worker``), if any."""

    def format(self, record: logging.LogRecord) -> str:
        worker = getattr(record, "worker", None)
        record.where = f" [worker {worker}]" if worker else ""
        return super().format(record)


def _level(level: int | str) -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(f"unknown log level {level!r}")
    return value


def forward_worker_logs(client: Client, level: int | str = "INFO", logger: str = LOGGER) -> None:
    """Ship ``logger``'s records of at least ``level`` from every worker to this process.

    Sets the level on the workers (now and on workers that join later), sets
    it here too if this process would drop such records, and adds a stderr
    handler here only if nothing would show them. Stop with
    :func:`stop_worker_logs`.
    """
    number = _level(level)
    client.register_plugin(LoggerLevel(logger, number), name=plugin_name(logger))
    client.forward_logging(logger, number)
    local = logging.getLogger(logger)
    if local.getEffectiveLevel() > number:
        local.setLevel(number)
    if not local.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(_WorkerFormatter(_FORMAT))
        local.addHandler(handler)


def stop_worker_logs(client: Client, logger: str = LOGGER) -> None:
    """Stop forwarding ``logger`` and give the workers their previous level back."""
    client.unforward_logging(logger)
    client.unregister_worker_plugin(plugin_name(logger))
