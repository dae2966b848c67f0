"""Module coverage in CI: PyTorch's ModuleInfo samples on a 2-rank mesh equal local torch.

A representative subset of ``module_db`` (every family: linear, convolutions
1-d to 3-d and transposed, pooling with adaptive and fractional, the norms,
recurrent layers, transformer layers and a TransformerEncoder built from a
layer, attention, embedding, activations, losses with list lengths and 1-D
targets, and a lazy module), the first 3 samples of each in training mode and
in eval mode where they differ (dropout inside the transformer layers),
compared in forward, backward and the state after both, through the machinery
of benchmarks/module_coverage.py, which runs every ModuleInfo.

The lists below are the failures that remain, each with its cause. The test is
strict both ways: a module that fails otherwise than listed fails it, and so
does a listed module that now passes ("remove it from the list"); a wrong
answer without an error fails it always. ``nn.EmbeddingBag`` and ``nn.Dropout``
have no ModuleInfo in module_db.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import op_sweep
import pytest

pytestmark = pytest.mark.timeout(240)


def _load_benchmark():
    """benchmarks/module_coverage.py, which is no package: loaded from its file."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "module_coverage.py"
    spec = importlib.util.spec_from_file_location("module_coverage", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


module_coverage = _load_benchmark()

MODULES = [
    # linear, convolutions
    *("nn.Linear", "nn.Bilinear", "nn.Conv1d", "nn.Conv2d", "nn.Conv3d", "nn.ConvTranspose2d"),
    # pooling: plain, adaptive, fractional (its random samples cast to float32)
    *("nn.MaxPool2d", "nn.AvgPool1d", "nn.AdaptiveAvgPool2d", "nn.FractionalMaxPool2d"),
    # norms (running statistics compared in the state phase)
    *("nn.BatchNorm2d", "nn.LayerNorm", "nn.GroupNorm", "nn.InstanceNorm1d"),
    # recurrent
    *("nn.RNN", "nn.LSTM", "nn.GRU"),
    # transformers (eval mode: dropout off), a layer given to a constructor, attention
    *("nn.TransformerEncoderLayer", "nn.TransformerDecoderLayer", "nn.TransformerEncoder"),
    *("nn.MultiheadAttention",),
    # embedding, activations
    *("nn.Embedding", "nn.GELU", "nn.PReLU"),
    # losses: CTCLoss with lengths as lists, MultiLabelMarginLoss with a 1-D input
    *("nn.CrossEntropyLoss", "nn.CTCLoss", "nn.MultiLabelMarginLoss"),
    # lazy: the known refusal (LAZY below)
    *("nn.LazyConv2d",),
]

# Lazy modules size their parameters on their first call, which a mesh refuses: their
# mesh errors are noted as refused, with this error (built under the mesh, their local
# placeholders are then given mesh values; before, torch refused to make the placeholders).
LAZY = {"nn.LazyConv2d"}
LAZY_ERROR = "LOCAL_TENSOR: a lazy module's parameter"

# module -> the cause of its mesh errors (a category of op_sweep, or a part of the error's
# first line); every error the module raises must have it. Empty: the test fails on any.
EXPECTED_ERRORS: dict[str, str] = {}

# module -> a wrong answer it gives with no error. Empty: the test fails on any.
KNOWN_MISMATCHES: dict[str, str] = {}

_FAILING = (op_sweep.MISMATCH, op_sweep.MESH_ERROR)


def _module(outcome: op_sweep.Outcome) -> str:
    return outcome.op.split("[")[0]  # "nn.LSTM[train]" -> "nn.LSTM"


@pytest.fixture(scope="module", params=op_sweep.PLACEMENTS)
def sweep(client2, request):
    """The subset, with inputs and state placed by dm.put (the client keeps small values)
    and through the ranks (every value and shape comes from them)."""
    sweep = module_coverage.ModuleSweep(client2, samples=3, placement=request.param)
    try:
        sweep.run(module_coverage.select_modules(names=MODULES))
    finally:
        sweep.close()
    return sweep


def test_every_module_of_the_subset_runs_on_the_mesh(sweep):
    """Each module ran at least one sample (local torch can make and run it), and no mesh
    broke; the eval mode ran where it differs."""
    ran = {_module(o) for o in sweep.outcomes if o.status != op_sweep.LOCAL_ERROR}
    assert set(MODULES) - ran == set()
    assert sweep.unsupported == []
    assert sweep.new_meshes == 0
    assert "nn.TransformerEncoderLayer[eval]" in {o.op for o in sweep.outcomes}


def test_no_module_gives_a_wrong_answer_without_an_error(sweep):
    mismatches = op_sweep.failures(sweep.outcomes, op_sweep.MISMATCH, _module)
    new = [o for m, items in mismatches.items() if m not in KNOWN_MISMATCHES for o in items]
    assert not new, f"wrong values or metadata, with no error raised:\n{op_sweep.lines(new)}"
    fixed = sorted(set(KNOWN_MISMATCHES) - set(mismatches))
    assert not fixed, f"{fixed} now agree with local torch: remove them from KNOWN_MISMATCHES"


def test_every_mesh_error_is_the_listed_one(sweep):
    errors = op_sweep.failures(sweep.outcomes, op_sweep.MESH_ERROR, _module)
    unexpected = [
        o
        for m, items in errors.items()
        for o in items
        if m not in EXPECTED_ERRORS or EXPECTED_ERRORS[m] not in o.category + o.detail
    ]
    assert not unexpected, f"errors not in EXPECTED_ERRORS:\n{op_sweep.lines(unexpected)}"
    passing = sorted(set(EXPECTED_ERRORS) - set(errors))
    assert not passing, f"{passing} now pass: remove them from EXPECTED_ERRORS"


def test_only_lazy_modules_are_refused_and_for_the_known_reason(sweep):
    refused = op_sweep.failures(sweep.outcomes, module_coverage.REFUSED, _module)
    assert set(refused) == LAZY, "a lazy module that now runs: remove it from LAZY"
    other = [o for items in refused.values() for o in items if LAZY_ERROR not in o.detail]
    assert not other, f"lazy modules refused otherwise than known:\n{op_sweep.lines(other)}"


def test_the_summary_counts_what_ran(sweep):
    """The figures benchmarks/module_coverage.py prints add up."""
    summary = module_coverage.summarise(sweep.outcomes)
    tried = {o.op for o in sweep.outcomes if o.status in (op_sweep.PASS, *_FAILING)}
    failing = {o.op for o in sweep.outcomes if o.status in _FAILING}
    assert summary.modules_tried["all"] == len(tried)
    assert summary.modules_passing["all"] == len(tried) - len(failing)
    assert sum(len(v) for v in summary.refused.values()) == sum(
        len(v) for v in op_sweep.failures(sweep.outcomes, module_coverage.REFUSED, _module).values()
    )
    text = module_coverage.report(summary)
    assert f"modules fully passing {len(tried) - len(failing)} / {len(tried)}" in text
    assert f"MISMATCHES: {len(summary.mismatches)}" in text
