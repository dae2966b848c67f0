"""GPU checks: ``python -m pytest -m gpu`` on a machine with CUDA (every test here is marked).

While these tests run, worker processes start with ``TORCH_CUDA_SANITIZER=1``
(torch's CUDA stream sanitizer, which fails an op that touches memory another
stream may still use without synchronisation), unless the environment says
otherwise. torch enters the sanitizer, a per-thread dispatch mode, only in the
thread that imports it; every thread of a rank that touches the device (each
lane, a pipe's producer, an actor's constructor) enters it too
(``worker/device.py``, ``thread_modes``), so it sees every op the ranks run.
Tests that need more GPUs than the machine shows skip and say how many.
"""

from __future__ import annotations

import os

import pytest
from helpers.gpus import GPUS


def pytest_collection_modifyitems(items: list) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not GPUS:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="module", autouse=True)
def cuda_sanitizer():
    """The sanitizer for the processes this module starts (a CPU torch has no CUDA to check)."""
    before = os.environ.get("TORCH_CUDA_SANITIZER")
    if GPUS and before is None:
        os.environ["TORCH_CUDA_SANITIZER"] = "1"
    yield
    if before is None:
        os.environ.pop("TORCH_CUDA_SANITIZER", None)
