"""Local ops under an active mesh stay local: every OpInfo sample of local tensors, run
inside ``mesh.activate()``, gives local torch's result as a local tensor.

An op whose tensor inputs are all local runs locally (docs/user_guide.md). torch's C++
makes tensors of its own inside composite ops, which an active mesh makes mesh tensors: a
scalar (``cosine_similarity``'s eps, ``quantile``'s q), the indices of ``local[[1, 5]]``,
a tensor its code writes into (``nn.CTCLoss``'s lengths). A probe of all of ``op_db``
(2026-12-07) found 16 ops that went to the ranks, or were refused, or failed; the ops below
are what remains, each with its cause. The test is strict both ways, as test_op_coverage is.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)

SAMPLES = 3

# op -> why a sample of local tensors gives a mesh tensor: torch makes a tensor of more than
# one value of its own, or a user-level factory in torch's Python makes one on the mesh
ON_THE_MESH = {
    "nn.functional.fractional_max_pool2d": "torch.rand() of its samples, in F's Python",
    "nn.functional.fractional_max_pool3d": "torch.rand() of its samples, in F's Python",
    "nn.functional.scaled_dot_product_attention": "the causal mask its C++ makes",
    "svd_lowrank": "torch.randn() of its projection, in torch's Python",
    "pca_lowrank": "torch.randn() of its projection, in torch's Python",
    "linalg.matrix_rank": "the tolerances its C++ makes of atol and rtol",
    "masked.mean": "the counts torch's masked Python makes",
}
# samples whose values are not a function of the inputs
UNCOMPARED = ("empty_like", "new_empty", "new_empty_strided")


def _tensors(value: object, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


def _outcome(op, sample, mesh) -> str | None:
    """None if the sample under the mesh is local torch's result, else what differs."""
    inputs = _tensors([sample.input, sample.args, sample.kwargs], [])
    if not inputs:
        return None  # a factory: under a mesh it makes a mesh tensor, on purpose
    torch.manual_seed(0)
    try:
        want = op(sample.input, *sample.args, **sample.kwargs)
    except Exception:
        return None  # torch refuses the sample itself
    torch.manual_seed(0)
    with mesh.activate(), warnings.catch_warnings():
        warnings.simplefilter("error", dm.ImplicitFetchWarning)
        try:
            got = op(sample.input, *sample.args, **sample.kwargs)
        except Exception as e:
            return f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    wants, gots = _tensors(want, []), _tensors(got, [])
    if any(isinstance(t, dm.Tensor) for t in gots):
        return "a mesh tensor"
    if len(wants) != len(gots):
        return f"{len(gots)} tensors, not {len(wants)}"
    for w, g in zip(wants, gots):
        if (w.shape, w.dtype) != (g.shape, g.dtype):
            return f"{g.shape} {g.dtype}, not {w.shape} {w.dtype}"
        if op.name not in UNCOMPARED and w.layout == torch.strided and not w.is_quantized:
            if not torch.allclose(w, g, equal_nan=True, atol=1e-6, rtol=1e-5):
                return "other values"
    return None


def test_every_sample_of_local_tensors_under_a_mesh_is_local_torch(mesh2):
    unexpected, now_local = {}, []
    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:SAMPLES]
        outcomes = {o for o in (_outcome(op, s, mesh2) for s in samples) if o is not None}
        name = f"{op.name}.{op.variant_test_name}".rstrip(".")
        if op.name in ON_THE_MESH:
            if not outcomes:
                now_local.append(name)
            outcomes -= {"a mesh tensor"}
        if outcomes:
            unexpected[name] = sorted(outcomes)
    assert not unexpected, "\n".join(f"{k}: {v}" for k, v in unexpected.items())
    assert not now_local, f"local torch now, remove them from ON_THE_MESH: {now_local}"
