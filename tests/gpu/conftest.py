"""GPU checks: ``python -m pytest -m gpu`` on a machine with CUDA (every test here is marked).

Worker processes inherit ``TORCH_CUDA_SANITIZER=1`` (torch's CUDA stream
sanitizer, which fails an op that touches memory another stream may still
use without synchronisation), unless the environment already sets it.
"""

from __future__ import annotations

import os

import pytest
from gpus import GPUS

os.environ.setdefault("TORCH_CUDA_SANITIZER", "1")


def pytest_collection_modifyitems(items: list) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not GPUS:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
