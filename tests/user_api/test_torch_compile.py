"""``torch.compile``d code called on mesh tensors (dask_monarch/torch_compile.py).

Dynamo, torch.compile's tracer, must not trace dask_monarch's own dispatch of
each op: it failed there with an internal ``AssertionError`` ("Please convert
all Tensors to FakeTensors first"). With dask_monarch on its skip list, each op
on a mesh tensor runs on the ranks as eager code does, with the same values.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)


def _loss(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sin().sum()


def test_a_torch_compiled_function_gives_eager_values_on_mesh_tensors(mesh2):
    compiled = torch.compile(_loss)  # the default backend, inductor
    want = [_loss(torch.arange(4.0) + i) for i in range(3)]
    with mesh2.activate():
        got = [dm.inspect(compiled(torch.arange(4.0) + i)) for i in range(3)]  # a call per input
    torch.testing.assert_close(got, want)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _train(model: nn.Module, steps: int = 3) -> tuple[list, list]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(12.0).reshape(3, 4) / 10
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach() for p in model.parameters()]


def test_a_torch_compiled_module_trains_on_the_mesh_as_it_does_locally(mesh2):
    want_losses, want_weights = _train(_model())
    with mesh2.activate():
        model = _model()
        model.load_state_dict({k: v.clone() for k, v in _model().state_dict().items()})
        losses, weights = _train(torch.compile(model))
        got_losses = [dm.inspect(v) for v in losses]
        got_weights = [dm.inspect(w) for w in weights]
    for got, want in zip(got_losses + got_weights, want_losses + want_weights):
        torch.testing.assert_close(got, want)


def test_dynamo_imported_after_dask_monarch_skips_its_files():
    """The usual order: a mesh is made before the first torch.compile imports Dynamo
    (importing it costs over a second, so dask_monarch waits for it)."""
    code = (
        "import sys, dask_monarch.tensor as t\n"
        "from dask_monarch.torch_compile import skip_in_dynamo\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "skip_in_dynamo(); skip_in_dynamo()\n"
        "import torch._dynamo.trace_rules as rules\n"
        "assert rules.check_file(t.__file__).skipped, rules.check_file(t.__file__)\n"
        "assert not any(type(f).__name__ == '_WhenImported' for f in sys.meta_path)\n"
        "skip_in_dynamo()  # every mesh made calls it: added once\n"
        "assert sum(d.rstrip('/').endswith('dask_monarch') for d in rules.SKIP_DIRS) == 1\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
