"""Op coverage in CI: PyTorch's OpInfo samples on a 2-rank mesh equal local torch (issue 34).

A representative subset of ``op_db`` (every family: elementwise, reductions,
matmul with 1-D operands, views and in-place views, indexing, linalg, fft,
nn.functional, data-dependent shapes, factories, random ops, ops that need a
value), the first 3 samples of each (the third is where matmul takes a 1-D
operand), forward, in place and backward, through the machinery of
benchmarks/op_coverage.py (tests/user_api/op_sweep.py), which runs every op.

The lists below are the failures that remain, each with its cause. The test is
strict both ways: an op that fails otherwise than listed fails it, and so does
a listed op that now passes ("remove it from the list"); a wrong answer without
an error fails it always.
"""

from __future__ import annotations

import op_sweep
import pytest
import torch
from torch.testing._internal.opinfo.core import OpInfo, SampleInput

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)

OPS = [
    # elementwise
    *("add", "mul", "sub", "div.no_rounding_mode", "exp", "sigmoid", "where", "clamp"),
    *("pow", "abs"),
    # reductions
    *("sum", "mean", "amax", "argmax", "var", "std", "logsumexp", "cumsum", "prod", "norm"),
    *("quantile",),
    # the matmul family (1-D operands included)
    *("matmul", "mm", "bmm", "addmm", "__rmatmul__", "einsum", "dot", "mv"),
    # views and in-place views
    *("view", "reshape", "transpose", "t", "squeeze", "unsqueeze", "permute", "expand"),
    *("narrow", "as_strided", "resize_"),
    # indexing
    *("__getitem__", "index_select", "gather", "scatter", "index_put", "index_add"),
    *("masked_fill", "take_along_dim"),
    # linalg, fft
    *("linalg.solve", "linalg.det", "linalg.svd", "linalg.cholesky", "linalg.qr"),
    *("fft.fft", "fft.rfft", "fft.ifft", "stft"),
    # nn.functional
    *("nn.functional.linear", "nn.functional.conv2d", "softmax", "nn.functional.layer_norm"),
    *("nn.functional.cross_entropy", "nn.functional.embedding", "nn.functional.gelu"),
    *("nn.functional.scaled_dot_product_attention", "nn.functional.max_pool2d"),
    *("native_group_norm", "masked.sum"),
    # data-dependent output shapes, values asked for on the client
    *("nonzero", "unique", "masked_select", "argwhere", "item", "equal", "chalf", "allclose"),
    *("tensor_split", "addbmm", "cov"),
    # factories and random ops
    *("arange", "full", "zeros_like", "linspace", "signal.windows.hann"),
    *("normal", "bernoulli", "rand_like", "nn.functional.dropout"),
]

# op -> the cause of its mesh errors (a category of op_sweep, or a part of the error's first
# line); every error the op raises must have it. What remains is refused by torch itself on
# a tensor without local data, or by its meta kernels:
EXPECTED_ERRORS = {
    # tensor_split(x, indices) with a tensor of indices: torch's C++ reads the indices' memory
    # directly, which a mesh tensor does not have (docs/user_guide.md: pass indices.tolist())
    "tensor_split": "its data is not allocated yet",
    # in place, with a self that broadcasts: CPU torch resizes self, its meta kernel refuses
    "addbmm": "doesn't match the broadcast shape",
}

# op -> a wrong answer it gives with no error. Empty: the test fails on any.
KNOWN_MISMATCHES: dict[str, str] = {}


@pytest.fixture(scope="module", params=op_sweep.PLACEMENTS)
def sweep(client2, request):
    """The subset, with samples placed by dm.put (the client keeps small values and computes
    bit-exact ops itself) and through the ranks (every value and shape comes from them)."""
    sweep = op_sweep.Sweep(client2, samples=3, placement=request.param)
    try:
        sweep.run(op_sweep.select_ops(names=OPS))
    finally:
        sweep.close()
    return sweep


def test_every_op_of_the_subset_runs_on_the_mesh(sweep):
    """Each op ran at least one sample (local torch can make and run it), and no mesh broke."""
    tried = {o.op for o in sweep.outcomes if o.status != op_sweep.LOCAL_ERROR}
    assert set(OPS) - tried == set()
    assert sweep.unsupported == []
    assert sweep.new_meshes == 0


def test_no_op_gives_a_wrong_answer_without_an_error(sweep):
    mismatches = op_sweep.failures(sweep.outcomes, op_sweep.MISMATCH)
    new = [o for op, items in mismatches.items() if op not in KNOWN_MISMATCHES for o in items]
    assert not new, f"wrong values or metadata, with no error raised:\n{op_sweep.lines(new)}"
    fixed = sorted(set(KNOWN_MISMATCHES) - set(mismatches))
    assert not fixed, f"{fixed} now agree with local torch: remove them from KNOWN_MISMATCHES"


def test_every_mesh_error_is_the_listed_one(sweep):
    errors = op_sweep.failures(sweep.outcomes, op_sweep.MESH_ERROR)
    unexpected = [
        o
        for op, items in errors.items()
        for o in items
        if op not in EXPECTED_ERRORS or EXPECTED_ERRORS[op] not in o.category + o.detail
    ]
    assert not unexpected, f"errors not in EXPECTED_ERRORS:\n{op_sweep.lines(unexpected)}"
    passing = sorted(set(EXPECTED_ERRORS) - set(errors))
    assert not passing, f"{passing} now pass: remove them from EXPECTED_ERRORS"


def test_the_summary_counts_what_ran(sweep):
    """The figures benchmarks/op_coverage.py prints add up."""
    summary = op_sweep.summarise(sweep.outcomes)
    failing = set(op_sweep.failures(sweep.outcomes, op_sweep.MESH_ERROR))
    failing |= set(op_sweep.failures(sweep.outcomes, op_sweep.MISMATCH))
    assert summary.ops_tried["all"] == len(OPS)
    assert summary.ops_passing["all"] == len(OPS) - len(failing)
    mismatches = op_sweep.failures(sweep.outcomes, "mismatch")
    assert len(summary.mismatches) == sum(len(v) for v in mismatches.values())
    text = op_sweep.report(summary)
    assert f"ops fully passing {len(OPS) - len(failing)} / {len(OPS)}" in text


panic = dm.remote("__test_panic", propagate=lambda x: x.clone())


def _breaks_the_mesh(x: torch.Tensor) -> torch.Tensor:
    """A fatal error on the ranks (the mesh is broken); locally, a clone."""
    return panic(x) if isinstance(x, dm.Tensor) else x.clone()


def _one_sample(op, device, dtype, requires_grad, **kwargs):
    yield SampleInput(torch.ones(3, device=device, dtype=dtype))


def test_a_mesh_that_breaks_is_replaced_and_the_sweep_goes_on(client2):
    breaking = OpInfo(
        "breaks_the_mesh",
        op=_breaks_the_mesh,
        dtypes=(torch.float32,),
        sample_inputs_func=_one_sample,
        supports_autograd=False,
    )
    sweep = op_sweep.Sweep(client2, samples=1)
    try:
        sweep.run([breaking, *op_sweep.select_ops(names=["add"])])
    finally:
        sweep.close()
    first, *rest = sweep.outcomes
    assert (first.op, first.status, first.category) == (
        "breaks_the_mesh",
        op_sweep.MESH_ERROR,
        op_sweep.BROKEN,
    )
    assert "__test_panic" in first.detail
    assert sweep.new_meshes == 1
    assert rest and {o.status for o in rest} == {op_sweep.PASS}
