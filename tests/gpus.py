"""How many GPUs this machine shows the tests, and a skip for tests that need more."""

from __future__ import annotations

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} GPUs, {GPUS} visible")
