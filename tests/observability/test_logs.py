"""Worker log records reach the client on request (dask_monarch.logs)."""

from __future__ import annotations

import logging
import time

from helpers.raw import S0, create_streams

import dask_monarch as dm
from dask_monarch.logs import forward_worker_logs, plugin_name, stop_worker_logs


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def worker_level(client):
    return client.run(lambda dask_worker: logging.getLogger("dask_monarch").level)


def test_worker_records_are_forwarded_to_the_client(client2):
    before = worker_level(client2)
    collect = Collect()
    logger = logging.getLogger("dask_monarch")
    logger.addHandler(collect)
    saved_level = logger.level
    try:
        forward_worker_logs(client2, level="INFO")
        assert set(worker_level(client2).values()) == {logging.INFO}
        ctrl = dm.Controller(client2, world_size=2)
        create_streams(ctrl, [0, 1], S0)
        ctrl.sync()
        ctrl.close()  # no Exit: each worker logs (INFO) that it releases the rank
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            found = [
                r
                for r in collect.records
                if "left without Exit" in r.getMessage() and ctrl.mesh_id in r.getMessage()
            ]
            if len(found) == 2:
                break
            time.sleep(0.1)
        assert len(found) == 2, [r.getMessage() for r in collect.records]
        assert {r.worker for r in found} == set(ctrl.workers)
        assert all(r.name == "dask_monarch.worker" and r.levelno == logging.INFO for r in found)
    finally:
        stop_worker_logs(client2)
        logger.removeHandler(collect)
        logger.setLevel(saved_level)
    assert worker_level(client2) == before
    plugins = client2.run(lambda dask_worker: list(dask_worker.plugins))
    assert all(plugin_name() not in names for names in plugins.values())
