"""PyTorch code users already have runs on a mesh unchanged, and is never silently wrong (issue 34).

Client-made values are mesh values; values Python asks for are fetched from every rank
(visibly, and only when the client does not know them); every handle's metadata is what
the ranks hold; ``copy.deepcopy`` clones on the ranks; ``dm.compile`` replays what eager
code would do, from an optimizer's first step on.
"""

from __future__ import annotations

import collections
import copy
import io
import pickle
import re
import subprocess
import sys
import warnings

import dask
import pytest
import torch
from torch import nn

import dask_monarch as dm
from dask_monarch import implicit_fetch

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def fresh_sites(monkeypatch):
    """Each call site warns once per process: these tests start with none warned."""
    monkeypatch.setattr(implicit_fetch, "_warned", set())


@pytest.fixture
def no_fetch():
    """Any implicit fetch inside is an error."""
    with dask.config.set({"dask_monarch.implicit-fetch": "error"}):
        yield


def _unknown(t: torch.Tensor) -> torch.Tensor:
    """``t``'s value on the active mesh, computed so that only the ranks know it (a mean is
    not bit-exact on every device, so the client does not compute it)."""
    t = t if isinstance(t, dm.Tensor) else dm.put(t)
    return (t.unsqueeze(0).expand(2, *t.shape)).mean(0)


# -- values made on the client -------------------------------------------------------------


def test_values_made_on_the_client_are_mesh_tensors(mesh2, no_fetch):
    import numpy as np

    with mesh2.activate():
        made = [
            torch.tensor([1.0, 2.0]),
            torch.as_tensor([1.0, 2.0]),
            torch.from_numpy(np.array([1.0, 2.0], dtype=np.float32)),
            torch.Tensor([1.0, 2.0]),
        ]
        assert all(isinstance(t, dm.Tensor) for t in made)
        assert [dm.inspect(t, gpu=1).tolist() for t in made] == [[1.0, 2.0]] * 4
        empty = torch.tensor([])  # how transformers finds the default device
        assert isinstance(empty, dm.Tensor) and empty.device.type == "cpu"
        assert empty.shape == (0,)
        eos = 3
        local = dm.inspect(torch.tensor([1, 3]) + 0)
        assert isinstance(local, torch.Tensor) and not isinstance(local, dm.Tensor)
        found = local == eos  # all-local inputs run locally: an elementwise tensor
        assert isinstance(found, torch.Tensor) and found.tolist() == [False, True]


def test_a_list_of_mesh_scalars_makes_a_mesh_tensor_on_the_ranks(mesh2, no_fetch):
    with mesh2.activate():
        loss = _unknown(torch.tensor(1.5))  # a value only the ranks know
        step = torch.tensor(2, dtype=torch.int64)
        losses = torch.tensor([loss, loss * 2])  # logging code: torch.tensor(losses)
        mixed = torch.as_tensor([[step, 1], [3, step]])
        wide = torch.tensor([step, loss.double()], dtype=torch.float16)
        assert isinstance(losses, dm.Tensor) and not losses.requires_grad
        dtypes = (losses.dtype, mixed.dtype, wide.dtype)
        assert dtypes == (torch.float32, torch.int64, torch.float16)
        assert mixed.shape == (2, 2)
    outside = torch.tensor([loss])  # after the block: on the mesh of its elements
    assert dm.inspect(losses, gpu=1).tolist() == [1.5, 3.0]
    assert dm.inspect(outside).tolist() == [1.5]
    assert dm.inspect(mixed).tolist() == [[2, 1], [3, 2]]
    assert dm.inspect(wide).tolist() == [2.0, 1.5]


def test_torch_functions_wrapped_for_meshes_still_script(mesh2):
    def scripted(x: torch.Tensor) -> torch.Tensor:  # torch.tensor and manual_seed are wrapped
        torch.manual_seed(0)
        return x + torch.tensor([1.0]) + torch.as_tensor([2.0])

    assert torch.jit.script(scripted)(torch.zeros(1)).tolist() == [3.0]


def test_torch_device_contexts_still_give_the_wrapped_constructors_their_device():
    """torch caches the functions ``with torch.device(d):`` gives ``device=d``: cached after
    a mesh replaced ``torch.tensor``, the cache held the wrapper, not the function torch's
    mode sees, and ``torch.tensor([])`` under ``torch.device("meta")`` was a CPU tensor
    (transformers then gave a Llama garbage rotary frequencies). In a fresh process, as the
    cache is filled once."""
    code = (
        "import torch\n"
        "from dask_monarch import tensor\n"
        "tensor.install_tensor_constructors()\n"
        "with torch.device('meta'):\n"
        "    made = [torch.tensor([]), torch.as_tensor([1.0]), torch.asarray([1])]\n"
        "    made.append(torch.empty(1))\n"
        "assert [t.device.type for t in made] == ['meta'] * 4, made\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_legacy_constructor_of_mesh_scalars_makes_a_mesh_tensor_on_the_ranks(mesh2, no_fetch):
    """``torch.Tensor([loss_a, loss_b])`` (the old-style constructor) failed in torch's C++
    ("data is not allocated yet"); it is made on the ranks, as torch makes it locally: the
    default dtype, whatever the elements' dtypes."""
    local = [torch.tensor(1.5), torch.tensor(2, dtype=torch.int64)]
    expected = torch.Tensor([[local[0], 3], [local[1], local[0]]])
    with mesh2.activate():
        loss = _unknown(torch.tensor(1.5))  # a value only the ranks know
        step = torch.tensor(2, dtype=torch.int64)
        made = torch.Tensor([[loss, 3], [step, loss]])
        assert isinstance(made, dm.Tensor) and not made.requires_grad
        assert (made.dtype, made.shape) == (expected.dtype, expected.shape)
        assert torch.Tensor([1.0, 2.0]).tolist() == [1.0, 2.0]  # plain data as before
    outside = torch.Tensor([loss])  # after the block: on the mesh of its elements
    assert dm.inspect(made, gpu=1).tolist() == expected.tolist()
    assert dm.inspect(outside).tolist() == [1.5]
    with pytest.raises(ValueError, match="only one element"):  # torch's own rule and words
        torch.Tensor([loss.expand(2)])


def test_a_small_local_tensor_is_placed_and_a_large_one_refused_naming_the_call(mesh2):
    with mesh2.activate():
        x = torch.ones(4)
    index = torch.tensor([0, 2])  # made outside the mesh
    big = torch.ones(100)
    with mesh2.activate(), dask.config.set({"dask_monarch.local-tensors.max-bytes": 64}):
        assert dm.inspect(x.index_select(0, index)).tolist() == [1.0, 1.0]
        assert dm.inspect(x[[1, 2]]).tolist() == [1.0, 1.0]  # torch.tensor([1, 2]) inside
        with pytest.raises(TypeError, match="LOCAL_TENSOR") as info:
            x.sum() * big
        text = str(info.value)
        assert "400 bytes" in text and "dask_monarch.put" in text and __file__ in text
        placed = dm.put(big)  # any size, on purpose
        assert dm.inspect(x.sum() * placed).tolist() == [4.0] * 100
    with pytest.raises(RuntimeError, match="needs a mesh"):
        dm.put(big)


def test_placed_local_values_are_the_values_of_the_moment_in_every_dtype(mesh2):
    """``dm.put`` and ``torch.tensor(data)`` send a local value's bytes: every dtype, views
    at an offset, non-contiguous views and conjugate views arrive as they were when placed
    (later changes to the local tensor are not sent), as owned tensors the ranks may resize."""
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    values = [
        torch.randn(3, 5),
        torch.tensor([True, False, True]),
        torch.arange(-5, 5, dtype=torch.int8),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.randn(4, dtype=torch.complex64),
        torch.tensor([]),
        torch.tensor(7, dtype=torch.int64),
        base[1:3],  # a view at an offset
        base.t(),  # not contiguous
        torch.randn(3, dtype=torch.complex64).conj(),  # a conjugate view
        torch.zeros(0, 3, dtype=torch.int32),
    ]
    expected = [v.clone().resolve_conj() for v in values]
    two = torch.ones(2)
    with mesh2.activate():
        placed = [dm.put(v) for v in values]
        literal = torch.tensor([[1.5, 2.5], [3.5, 4.5]])
        for v in values:
            if not v.is_conj():
                v.zero_()  # after placing: not what the ranks hold
        grown = dm.put(two).resize_(6)  # an owned storage, as clone makes
    for p, e in zip(placed, expected):
        assert (p.dtype, p.shape) == (e.dtype, e.shape)
        got = dm.inspect(p.resolve_conj() if p.is_conj() else p)
        assert torch.equal(got, e), (got, e)
    assert dm.inspect(literal).tolist() == [[1.5, 2.5], [3.5, 4.5]]
    assert dm.inspect(grown).shape == (6,)


def test_a_local_tensor_given_a_mesh_value_as_data_is_refused(mesh2):
    """torch's ``.data`` setter would give the local tensor the mesh tensor's metadata and no
    storage: its next local op crashed the process. A lazy module's first call on mesh inputs
    does this (``param.data = torch.empty(shape)``)."""
    local = nn.Parameter(torch.zeros(3, 2))
    lazy = nn.LazyLinear(4)
    with mesh2.activate():
        with pytest.raises(TypeError, match=r"LOCAL_TENSOR: t.data = .* local tensor of shape"):
            local.data = torch.ones(3, 2)
        with pytest.raises(TypeError, match="lazy module.*nn.Linear\\(in_features"):
            lazy(torch.ones(2, 3))
        built_here = nn.LazyConv1d(4, 3)  # failed in torch's own code: a mesh placeholder
        with pytest.raises(TypeError, match="lazy module.*nn.Linear\\(in_features"):
            built_here(torch.ones(2, 3, 5))
    assert local.tolist() == [[0.0, 0.0]] * 3  # untouched, and usable
    local.data = torch.ones(3, 2)  # local values as before
    assert local.sum().item() == 6.0


def test_an_op_whose_fake_kernel_says_another_shape_is_planned_by_the_ranks(mesh2):
    """torch's fake kernel of multilabel_margin_loss keeps a dim of size 1 for a 1-D input
    unreduced, where the CPU kernel returns a 0-d loss (found by nn.MultiLabelMarginLoss's
    ModuleInfo samples): the client's handle said shape [1], silently. Its plan is learned
    from the ranks once per input metadata; 2-D inputs keep the fake's (right) plan."""
    x, target = torch.randn(10), torch.tensor([3, 0, -1, 1, 0, 0, 0, 0, 0, 0])
    loss = nn.MultiLabelMarginLoss(reduction="none")
    with mesh2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.ImplicitFetchWarning)
        first = loss(dm.put(x), dm.put(target))
        fetched = mesh2._session.implicit_fetches
        again = loss(dm.put(x), dm.put(target))
        rows = loss(dm.put(x.expand(2, 10)), dm.put(target.expand(2, 10)))
        assert mesh2._session.implicit_fetches == fetched  # learned once; 2-D: the fake's
    for got, want in ((first, loss(x, target)), (again, loss(x, target))):
        assert got.shape == want.shape == () and dm.inspect(got).shape == ()
        assert torch.allclose(dm.inspect(got), want)
    assert rows.shape == (2,) and dm.inspect(rows).shape == (2,)


def test_ctc_loss_equals_local_without_a_round_trip(mesh2, no_fetch):
    """nn.CTCLoss's default reduction makes a tensor of the target lengths in torch's C++
    (``at::empty``, then a write into its memory): under a mesh that was a mesh tensor, with
    no memory ("data is not allocated yet"), for mesh inputs (found by nn.CTCLoss's
    ModuleInfo samples) and for local ones (op_db's samples of local tensors under a mesh).
    ``log_alpha``'s shape follows from the longest target, which the client knows: it was
    fetched from the ranks on every call."""
    torch.manual_seed(0)
    log_probs = torch.randn(12, 2, 6).log_softmax(2)
    padded = torch.randint(1, 6, (2, 5))
    lengths = ((12, 10), (5, 3))
    joined = torch.cat([padded[0, :5], padded[1, :3]])  # targets one after the other
    for reduction in ("mean", "sum", "none"):
        for targets in (padded, joined):
            leaf = log_probs.clone().requires_grad_()
            want = nn.CTCLoss(reduction=reduction)(leaf, targets, *lengths)
            want.sum().backward()
            with mesh2.activate():
                assert torch.equal(nn.CTCLoss(reduction=reduction)(leaf, targets, *lengths), want)
                mesh_leaf = dm.put(log_probs).requires_grad_()
                got = nn.CTCLoss(reduction=reduction)(mesh_leaf, dm.put(targets), *lengths)
                got.sum().backward()
            assert torch.allclose(dm.inspect(got, gpu=1), want)
            assert torch.allclose(dm.inspect(mesh_leaf.grad, gpu=1), leaf.grad)


def test_local_ops_under_a_mesh_stay_local_where_torch_makes_scalars_or_indices(mesh2):
    """torch's C++ makes scalars inside composite ops of local tensors (cosine_similarity's
    eps, quantile's q, cov's correction, logdet's) and the indices of ``local[[1, 5]]``: an
    active mesh made them mesh tensors, so the local op went to the ranks, or was refused
    (a write into a local tensor, a large one). Found by op_db's samples of local tensors
    run under a mesh. A one-element value the client knows joins a local op as a number
    would, as torch lets a 0-d CPU tensor join a CUDA op."""
    torch.manual_seed(0)
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    square = a[:3] @ a[:3].T + torch.eye(3)
    big = torch.randn(20000, 4)  # 320 000 bytes: more than a local tensor placed by itself
    cases = {
        "cosine_similarity": lambda: nn.functional.cosine_similarity(a, b),
        "quantile": lambda: torch.quantile(a, 0.25, dim=0),
        "cov": lambda: torch.cov(a),
        "logdet": lambda: torch.logdet(square),
        "index rows": lambda: big[[1, 7, 3]],
        "index columns": lambda: a[:, [0, 2]],
        "index_put": lambda: a.clone().index_put_((torch.tensor([0, 2]),), torch.tensor(0.5)),
    }
    want = {name: case() for name, case in cases.items()}
    with mesh2.activate(), dask.config.set({"dask_monarch.implicit-fetch": "error"}):
        got = {name: case() for name, case in cases.items()}
        written = a.clone()
        written[[0, 2]] = 0.5
        scale = torch.tensor(2.0)  # a mesh tensor the client knows: a number to local ops
        scaled = a * scale
        on_mesh = torch.ones(3)  # a mesh input of more than one element decides
        assert isinstance(a * on_mesh, dm.Tensor)
        weight = torch.tensor(2.0, requires_grad=True)  # its gradient belongs on the mesh
        assert isinstance(a * weight, dm.Tensor)
    for name in cases:
        assert type(got[name]) is torch.Tensor, name
        assert torch.equal(got[name], want[name]), name
    assert type(written) is torch.Tensor and written[[0, 2]].eq(0.5).all()
    assert type(scaled) is torch.Tensor and torch.equal(scaled, a * 2)


def test_values_the_client_knows_are_read_without_a_round_trip(mesh2, no_fetch):
    with mesh2.activate():
        step = torch.tensor(0.0)  # an optimizer's step count
        for _ in range(3):
            step += 1
        assert step.item() == 3.0 and int(step) == 3
        size = 4
        mask = torch.triu(torch.full((size, size), float("-inf")), diagonal=1)
        causal = nn.Transformer.generate_square_subsequent_mask(size)
        assert bool((mask == causal).all())  # what nn.TransformerEncoder checks
        assert step.tolist() == 3.0
    assert dm.inspect(step, gpu=1).item() == 3.0  # the ranks hold what the client computed


def test_masked_writes_and_constant_pads_of_known_values_stay_known(mesh2, no_fetch):
    """Longformer builds its attention mask with ``ext[mask == 2] = finfo.max`` and reads
    ``.any().item()`` of it each step; transformers pads with ``F.pad``: both are copies, so
    the client follows them. Writes through integer indices (which may repeat: the winner
    differs by device) or that sum (``accumulate=True``) are left to the ranks."""
    with mesh2.activate():
        mask = torch.tensor([[1, 2, 1], [2, 2, 0]])
        ext = torch.zeros(2, 3)
        ext[mask == 2] = torch.finfo(torch.float32).max
        assert bool((ext > 0).any().item()) and (ext > 0).sum().item() == 3
        padded = torch.nn.functional.pad(torch.arange(3.0), (1, 2), value=0.5)
        assert padded.tolist() == [0.5, 0.0, 1.0, 2.0, 0.5, 0.5]
        summed = torch.zeros(3)
        summed.index_put_((torch.tensor([1, 1]),), torch.tensor([1.0, 2.0]), accumulate=True)
        picked = torch.zeros(3)
        picked[torch.tensor([0, 2])] = 2.0
        for unknown in (summed, picked):
            with pytest.raises(RuntimeError, match="implicit-fetch is 'error'"):
                unknown.tolist()
    assert dm.inspect(summed).tolist() == [0.0, 3.0, 0.0]
    assert dm.inspect(picked).tolist() == [2.0, 0.0, 2.0]
    big = torch.finfo(torch.float32).max
    assert dm.inspect(ext, gpu=1).tolist() == [[0.0, big, 0.0], [big, big, 0.0]]


def test_masks_the_client_knows_select_without_a_round_trip(mesh2, no_fetch):
    """``x[mask]`` and ``masked_select`` make as many elements as the mask holds true ones: a
    mask the client knows (placed from the client, ``ones_like``, a comparison of known
    values: ``prune.global_unstructured`` indexes so) plans them; each was a fetch."""
    x = torch.arange(12.0).reshape(3, 4)
    local_mask = x % 3 == 0
    with mesh2.activate():
        values = torch.tensor(x.tolist())
        unknown = _unknown(x)  # only the ranks know it: the mask decides the shape
        rows = unknown[torch.tensor([True, False, True])]
        picked = unknown[local_mask]
        selected = torch.masked_select(unknown, values > 6)
        assert rows.shape == (2, 4) and picked.shape == (4,) and selected.shape == (5,)
        got = dm.inspect((rows, picked, selected))
    assert torch.equal(got[0], x[[0, 2]]) and torch.equal(got[1], x[local_mask])
    assert torch.equal(got[2], x[x > 6])


def test_a_quantized_modules_weights_are_refused_naming_the_op_and_the_mesh_lives(mesh2):
    """A model quantized locally (``quantize_dynamic``) called on a mesh tensor sent its
    packed weights, a ``torch.ScriptObject``, to the ranks: the next flush could not
    serialise it, and the mesh was broken for good. Quantizing under the mesh raised torch's
    dispatcher listing of backends (found by a probe of model tooling)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation
        quantized = torch.ao.quantization.quantize_dynamic(
            nn.Sequential(nn.Linear(4, 2)), {nn.Linear}, dtype=torch.qint8
        )
    with mesh2.activate():
        x = torch.ones(3, 4)
        with pytest.raises(TypeError, match="torch.classes object.*run the module locally"):
            quantized(x)
        with pytest.raises(NotImplementedError, match="quantized tensor.*run the model locally"):
            torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
        assert dm.inspect(x.sum()).item() == 12.0  # the mesh runs on


def test_an_in_place_op_that_reshapes_a_known_value_keeps_it_right(mesh2):
    """``squeeze_``, ``resize_``, ``as_strided_`` (and an integer ``1-D @ 2-D`` matmul, which
    torch ends with ``squeeze_``) of a value the client knows: the new shape made it forget
    the value, then mirror the op on an empty stand-in, and Python read that garbage as the
    value (found by a probe of op_db in integer dtypes)."""
    cases = {
        "squeeze_": lambda: torch.tensor([[5, 1, 7]]).squeeze_(),
        "resize_": lambda: torch.tensor([1, 2, 3, 4]).resize_(2),
        "as_strided_": lambda: torch.tensor([3, 4, 5, 6]).as_strided_((2,), (2,)),
        "matmul": lambda: torch.tensor([1, 2]) @ torch.tensor([[3, 4, 5], [6, 7, 8]]),
    }
    want = {name: case().tolist() for name, case in cases.items()}
    with mesh2.activate(), warnings.catch_warnings():
        warnings.simplefilter("ignore", dm.ImplicitFetchWarning)  # resize_: not followed
        made = {name: case() for name, case in cases.items()}
        read = {name: t.tolist() for name, t in made.items()}  # the client's copies
        held = dm.inspect(made)
    assert read == want and {name: t.tolist() for name, t in held.items()} == want


def test_batch_norm_running_statistics_are_read_as_the_ranks_hold_them(mesh2):
    """``native_batch_norm`` updates its running statistics in place without saying so in its
    schema: the client kept its copy of ``torch.zeros(3)`` and ``bn.running_mean.tolist()``
    read zeros after training (found by a probe of op_db in half precision)."""
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    with mesh2.activate():
        bn = nn.BatchNorm1d(3)
        bn(x).sum().backward()
        read = bn.running_mean.tolist()  # implicit fetches, or the client's stale copy
        held = dm.inspect(bn.running_mean)
    assert read == held.tolist() and read != [0.0, 0.0, 0.0]


def test_a_value_the_ranks_change_is_no_longer_known(mesh2, no_fetch):
    with mesh2.activate():
        count = torch.tensor([1.0, 2.0])
        count.reduce_("gpu", "sum")  # the ranks changed it: the client does not follow
        with pytest.raises(RuntimeError, match="implicit-fetch is 'error'"):
            count.tolist()
    assert dm.inspect(count).tolist() == [2.0, 4.0]


# -- values Python asks for ----------------------------------------------------------------


def test_python_asking_for_a_value_fetches_it_with_one_warning_per_line(mesh2, fresh_sites):
    with mesh2.activate():
        x = _unknown(torch.tensor([1.0, -2.0, 3.0]))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            taken = [bool(x.sum() > 0) for _ in range(3)]  # one line, three fetches
            if x.any():
                value = x.max().item()
        assert taken == [True] * 3 and value == 3.0
        fetches = [w for w in caught if issubclass(w.category, dm.ImplicitFetchWarning)]
        assert len(fetches) == 3  # a warning per line (three lines), not per fetch (five)
        first = fetches[0]
        assert first.filename == __file__ and f"{__file__}:" in str(first.message)
        assert first.message.count == 1 and "implicit fetch #1" in str(first.message)
        assert [w.message.count for w in fetches] == [1, 4, 5]  # each line's first fetch
        with dask.config.set({"dask_monarch.implicit-fetch": "allow"}):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert float(x[0]) == 1.0  # silent
        with dask.config.set({"dask_monarch.implicit-fetch": "error"}):
            with pytest.raises(RuntimeError, match=re.escape(__file__)):
                float(x[1])


def test_a_scalar_formats_as_its_number_as_in_torch(mesh2, fresh_sites):
    """switch_transformers and NLLB-MoE pick an expert with ``self[f"expert_{idx[0]}"]``:
    a 0-d tensor formats as its number with or without a spec (fetched unless the client
    knows it); any other tensor as its handle, and a spec for it is refused as torch does."""
    experts = nn.ModuleDict({f"expert_{i}": nn.Linear(2, 2) for i in range(3)})
    with mesh2.activate():
        known = torch.tensor([2, 0])
        with dask.config.set({"dask_monarch.implicit-fetch": "error"}):
            assert f"expert_{known[0]}" == "expert_2" and experts[f"expert_{known[0]}"]
        x = _unknown(torch.tensor([1.25, 3.0]))
        with dask.config.set({"dask_monarch.implicit-fetch": "allow"}):
            assert f"{x[0]}|{x[1]:.2f}" == "1.25|3.00"
        assert f"{x}" == repr(x)
        with pytest.raises(TypeError, match="only a 0-d tensor"):
            f"{x:.2f}"


def test_ranks_that_disagree_on_a_value_raise_naming_ranks_and_values(mesh2, fresh_sites):
    with mesh2.activate(), dask.config.set({"dask_monarch.implicit-fetch": "allow"}):
        me = mesh2.rank("gpu")
        with pytest.raises(ValueError, match="rank 0: 0, rank 1: 1"):
            int(me)
        assert int(me.reduce("gpu", "max")) == 1  # made to agree first


def test_shapes_that_depend_on_data_are_fetched_from_the_ranks(mesh2, fresh_sites):
    local = torch.tensor([[0.0, 1.5, -2.0], [3.0, 0.0, 0.5]])
    with mesh2.activate(), dask.config.set({"dask_monarch.implicit-fetch": "allow"}):
        x = _unknown(local)
        mask = x > 0.4
        results = {
            "nonzero": x.nonzero(),
            "unique": torch.unique(x.round()),
            "masked_select": torch.masked_select(x, mask),
            "x[mask]": x[mask],
        }
        for name, got in results.items():
            assert isinstance(got, dm.Tensor), name
        values = {k: dm.inspect(v) for k, v in results.items()}
        me = mesh2.rank("gpu").float()
        per_rank = torch.stack([me, me + 1, torch.zeros(())])  # rank 0: one nonzero, rank 1: two
        with pytest.raises(ValueError, match="disagree"):
            per_rank.nonzero()
    want = {
        "nonzero": local.nonzero(),
        "unique": torch.unique(local.round()),
        "masked_select": torch.masked_select(local, local > 0.4),
        "x[mask]": local[local > 0.4],
    }
    for name in want:
        assert torch.equal(values[name], want[name]), name


# -- no stale handle -----------------------------------------------------------------------


def _families():
    """Op families whose result metadata the client once got wrong, as (name, fn)."""
    window = torch.hann_window(8)
    return [
        ("v @ m", lambda v, m: v @ m),
        ("m @ v", lambda v, m: m.t() @ v),
        ("linear, 1-D input", lambda v, m: nn.functional.linear(v, m.t())),
        ("squeeze_", lambda v, m: m[:1].clone().squeeze_()),
        ("unsqueeze_", lambda v, m: v.clone().unsqueeze_(1)),
        ("t_", lambda v, m: m.clone().t_()),
        ("transpose_", lambda v, m: m.clone().unsqueeze(0).transpose_(0, 2)),
        ("as_strided_", lambda v, m: m.clone().as_strided_((2, 2), (1, 3), 1)),
        ("resize_ smaller", lambda v, m: m.clone().resize_(2, 2)),
        ("resize_ larger", lambda v, m: m.clone().resize_(5, 6)[:2].clone()),
        ("quantile of 0-d", lambda v, m: torch.quantile(v[0], 0.5)),
        (
            "stft",
            lambda v, m: torch.stft(
                torch.cat([v, v, v, v]), 8, window=window, return_complex=True
            ).abs(),
        ),
    ]


@pytest.mark.parametrize("name, fn", _families(), ids=[n for n, _ in _families()])
def test_every_op_family_keeps_the_metadata_the_ranks_hold(mesh2, name, fn):
    v, m = torch.arange(4.0), torch.arange(20.0).reshape(4, 5)
    want = fn(v, m)
    with mesh2.activate():
        got = fn(_unknown(v), _unknown(m))
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
        flat = got.reshape(got.shape[0], -1).sum(1) if got.dim() else got  # uses the shape
    fetched = dm.inspect(got, gpu=1)
    if "resize_ larger" not in name:  # its new elements are uninitialised memory
        assert torch.equal(fetched, want)
        want_flat = want.reshape(want.shape[0], -1).sum(1) if want.dim() else want
        assert torch.allclose(dm.inspect(flat), want_flat)
    assert fetched.shape == want.shape


def test_a_conjugate_view_keeps_its_bit(mesh2):
    local = torch.tensor([1 + 2j, 3 - 1j])
    with mesh2.activate():
        z = dm.put(local)
        y = z.conj()
        assert y.is_conj()
        real = torch.view_as_real(y.resolve_conj())
    assert torch.equal(dm.inspect(real), torch.view_as_real(local.conj().resolve_conj()))


def test_assigning_data_rebinds_the_handle_as_nn_module_to_and_half_do(mesh2):
    torch.manual_seed(0)
    local = nn.Linear(4, 3)
    with mesh2.activate():
        w = torch.ones(3)
        old_view = w[:2]
        w.data = torch.arange(6, dtype=torch.float64).reshape(2, 3)  # new dtype and shape
        assert (w.shape, w.dtype) == ((2, 3), torch.float64)
        doubled = w * 2
        model = nn.Linear(4, 3)
        model.load_state_dict(local.state_dict())
        model.half()  # nn.Module._apply: param.data = param.half()
        assert model.weight.dtype == torch.float16 and model.weight.requires_grad
        model.to(torch.float64)
        out = model(torch.ones(2, 4, dtype=torch.float64))
        out.sum().backward()
    assert torch.equal(dm.inspect(w, gpu=1), torch.arange(6.0).reshape(2, 3).double())
    assert dm.inspect(old_view).tolist() == [1.0, 1.0]  # a view made before keeps its storage
    assert torch.equal(dm.inspect(doubled), torch.arange(0.0, 12.0, 2).reshape(2, 3).double())
    local.half().to(torch.float64)
    want = local(torch.ones(2, 4, dtype=torch.float64))
    want.sum().backward()
    assert dm.inspect(model.weight).dtype == torch.float64
    assert torch.equal(dm.inspect(model.weight), local.weight.detach())
    assert torch.equal(dm.inspect(out.detach()), want.detach())
    assert torch.equal(dm.inspect(model.weight.grad), local.weight.grad)


# -- copies --------------------------------------------------------------------------------


def _resumable(lr: float | torch.Tensor, fused: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.Tanh(), nn.Linear(300, 1))  # 77 KiB of weight
    return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)


@pytest.mark.parametrize("lr", [0.01, "tensor"], ids=["float lr", "tensor lr"])
@pytest.mark.parametrize("fused", [False, True], ids=["for-loop", "fused"])
def test_resuming_from_a_checkpoint_loaded_with_torch_load_equals_local(mesh2, lr, fused):
    """``torch.load`` under a mesh rebuilt each tensor on an empty mesh tensor (torch refused:
    "set the storage of a tensor on device 'meta'"); ``Optimizer.load_state_dict`` deep-copies
    its param groups (a tensor lr: the same); the moments it loaded stayed local, and the
    next step was refused; a weight over ``local-tensors.max-bytes`` was refused by
    ``copy_``. Found by a probe of torch's optimizer database."""
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))

    def step(model, optimizer):
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    learning_rate = torch.tensor(0.01) if lr == "tensor" else lr
    model, optimizer = _resumable(learning_rate, fused)
    step(model, optimizer)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, saved)
    want = [step(model, optimizer) for _ in range(2)]
    with mesh2.activate():
        checkpoint = torch.load(io.BytesIO(saved.getvalue()))
        assert type(checkpoint["model"]["0.weight"]) is torch.Tensor  # local, as in one process
        learning_rate = torch.tensor(0.01) if lr == "tensor" else lr
        resumed, resumed_optimizer = _resumable(learning_rate, fused)
        resumed.load_state_dict(checkpoint["model"])
        resumed_optimizer.load_state_dict(checkpoint["optim"])
        got = [step(resumed, resumed_optimizer) for _ in range(2)]
        weights = dm.inspect(resumed.state_dict())
    assert torch.equal(torch.stack(dm.inspect(got)), torch.stack(want))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_a_safetensors_file_loads_under_a_mesh_as_local_tensors(mesh2, tmp_path):
    """safetensors reads a file into ``torch.asarray(storage)``; torch's C++ sizes it with an
    ``at::empty``, which an active mesh made a mesh tensor, then refused ("could not determine
    the shape of object type 'torch.storage.UntypedStorage'"): transformers' Trainer could not
    resume (found by a probe of the Trainer)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    local = nn.Linear(3, 2)
    save_file(local.state_dict(), tmp_path / "model.safetensors")
    with mesh2.activate():
        loaded = load_file(tmp_path / "model.safetensors")
        with safe_open(tmp_path / "model.safetensors", "pt") as f:
            bias = f.get_tensor("bias")
        assert type(loaded["weight"]) is torch.Tensor and type(bias) is torch.Tensor
        model = nn.Linear(3, 2)
        model.load_state_dict(loaded)
        weight = dm.inspect(model.weight)
    assert torch.equal(weight, local.weight) and torch.equal(bias, local.bias)


def test_fetching_state_dicts_and_trees_of_local_and_mesh_values(mesh2):
    """``dm.inspect(model.state_dict())``: an OrderedDict, whose mesh tensors were pickled
    (refused) instead of fetched; a local tensor ahead of a mesh tensor in the fetched tree
    was compared with the mesh tensor's metadata (a false RemoteException). Found by a probe
    of torch's optimizer database (LBFGS keeps a local lr in its state)."""
    local = torch.tensor(0.5)
    with mesh2.activate():
        model = nn.Linear(3, 2)
        t = torch.arange(3.0)
        got = dm.inspect(
            {
                "state": model.state_dict(),
                "ordered": collections.OrderedDict(a=t),
                "default": collections.defaultdict(list, a=[t]),
                "mixed": [local, t],
                "topk": torch.topk(t, 2),
            }
        )
    assert type(got["state"]) is collections.OrderedDict and got["state"]["weight"].shape == (2, 3)
    assert type(got["ordered"]) is collections.OrderedDict and got["ordered"]["a"].equal(t)
    assert type(got["default"]) is collections.defaultdict and got["default"]["b"] == []
    assert got["mixed"][0].item() == 0.5 and got["mixed"][1].equal(t)
    assert type(got["topk"]).__name__ == "topk" and got["topk"].values.tolist() == [2.0, 1.0]


def test_share_memory_of_a_mesh_model_is_nothing_to_do(mesh2):
    """pytorch/examples' hogwild calls model.share_memory(): torch's path failed on the
    handle's meta storage with a message about devices."""
    with mesh2.activate():
        model = nn.Linear(4, 2)
        assert model.share_memory() is model
        assert model.weight.share_memory_() is model.weight and not model.weight.is_shared()
        assert dm.inspect(model(torch.ones(1, 4))).shape == (1, 2)


def test_deepcopy_clones_tensors_and_modules_on_the_ranks(mesh2):
    torch.manual_seed(0)
    local = nn.Linear(3, 2)
    with mesh2.activate():
        model = nn.Linear(3, 2)
        model.load_state_dict(local.state_dict())
        x = torch.ones(3)
        x2 = copy.deepcopy(x)
        x.add_(1)
        ema = copy.deepcopy(model)  # an EMA copy of a model
        assert all(isinstance(p, dm.Tensor) and p.requires_grad for p in ema.parameters())
        assert all(
            a is not b and a._ref != b._ref for a, b in zip(ema.parameters(), model.parameters())
        )
        with torch.no_grad():
            model.weight.mul_(2)
        out = ema(x2)
    assert dm.inspect(x2).tolist() == [1.0] * 3 and dm.inspect(x).tolist() == [2.0] * 3
    assert torch.allclose(dm.inspect(out.detach()), local(torch.ones(3)).detach())


def test_transformer_encoder_with_a_mask_equals_local(mesh2, no_fetch):
    torch.manual_seed(0)

    def build():
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    local = build()
    src = torch.randn(5, 1, 8)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    want = local(src, mask=mask)
    with mesh2.activate():
        encoder = build()  # deep-copies its layer
        encoder.load_state_dict(local.state_dict())
        got = encoder(dm.put(src), mask=nn.Transformer.generate_square_subsequent_mask(5))
        got.sum().backward()
    assert torch.allclose(dm.inspect(got.detach(), gpu=1), want.detach(), atol=1e-5)
    want.sum().backward()
    grads = [dm.inspect(p.grad) for p in encoder.parameters()]
    assert all(torch.allclose(a, b.grad, atol=1e-5) for a, b in zip(grads, local.parameters()))


def test_a_view_has_the_strides_the_ranks_give_it_and_group_norm_runs_at_batch_one(mesh2):
    """torch's fake view gives a dimension of size 1 another stride than its kernels do;
    group_norm decided by it to copy nothing, and the rank's kernel refused its input
    (diffusers' attention block feeding a ResnetBlock's GroupNorm, at batch size 1)."""
    torch.manual_seed(0)
    x = torch.randn(1, 64, 16)
    norm = nn.GroupNorm(4, 16)
    want = norm(x.transpose(-1, -2).reshape(1, 16, 8, 8))
    want.sum().backward()
    with mesh2.activate():
        mesh_norm = nn.GroupNorm(4, 16)
        mesh_norm.load_state_dict(norm.state_dict())
        h = dm.put(x).transpose(-1, -2).reshape(1, 16, 8, 8)
        views = [h, dm.put(x)[:, :4].view(1, 4, 4, 4), dm.put(x)[0].t().unflatten(1, (1, 64))]
        held = [(v.shape, v.stride(), v.storage_offset()) for v in views]
        on_ranks = [(v.shape, v.stride(), v.storage_offset()) for v in map(dm.inspect, views)]
        got = mesh_norm(h)
        got.sum().backward()
        grads = [dm.inspect(p.grad) for p in mesh_norm.parameters()]
        got = dm.inspect(got.detach())
    assert held == on_ranks
    assert torch.allclose(got, want.detach(), atol=1e-6)
    assert all(torch.allclose(a, p.grad, atol=1e-5) for a, p in zip(grads, norm.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_pointwise_ops_have_the_layout_the_ranks_give(mesh2, dtype):
    """torch's fake kernels in bfloat16 and float16 made a fully expanded input times a
    channels-last one contiguous; the ranks' kernels lay it out channels-last, as in
    float32: the gradient of a channels-last CNN's ``.pow(2).sum()`` then failed its
    ``flatten`` on the ranks, and ``as_strided`` read the wrong elements, silently."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 5).to(dtype).contiguous(memory_format=torch.channels_last)
    want = torch.ones((), dtype=dtype).expand(2, 3, 4, 5) * x
    leaf = x.detach().requires_grad_()
    nn.functional.interpolate(leaf, scale_factor=2).pow(2).sum().backward()
    with mesh2.activate():
        xm = _unknown(x).contiguous(memory_format=torch.channels_last)
        y = torch.ones((), dtype=dtype).expand(2, 3, 4, 5) * xm
        assert y.stride() == dm.inspect(y).stride() == want.stride()
        assert torch.equal(dm.inspect(y.as_strided(y.shape, y.stride())), want)
        assert dm.inspect(y.flatten(1)).shape == (2, 60)
        mleaf = xm.detach().requires_grad_()
        nn.functional.interpolate(mleaf, scale_factor=2).pow(2).sum().backward()
        assert mleaf.grad.stride() == dm.inspect(mleaf.grad).stride() == leaf.grad.stride()
        assert torch.equal(dm.inspect(mleaf.grad.flatten()), leaf.grad.flatten())


def test_copy_copy_of_a_mesh_tensor_shares_its_storage(mesh2):
    with mesh2.activate():
        t = torch.arange(3.0)
        c = copy.copy(t)
        t.add_(1)
        assert dm.inspect(c).tolist() == [1.0, 2.0, 3.0]
        w = torch.ones(2, requires_grad=True)
        assert copy.copy(w).requires_grad and copy.copy(w).is_leaf


def test_a_nested_tensor_is_refused_saying_how_to_avoid_it(mesh2):
    torch.manual_seed(0)

    def build(nested: bool):
        layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()

    local = build(False)
    src = torch.randn(2, 3, 8)
    pad = torch.tensor([[False, False, True], [False, False, False]])
    with torch.no_grad():
        want = local(src, src_key_padding_mask=pad)
    with mesh2.activate(), torch.no_grad():
        encoder = build(True)
        encoder.load_state_dict(local.state_dict())
        x = dm.put(src)
        # its fast path packs the unpadded rows into a nested tensor, which is not dense
        with pytest.raises(NotImplementedError, match="enable_nested_tensor=False"):
            encoder(x, src_key_padding_mask=pad)
        encoder.use_nested_tensor = False  # what enable_nested_tensor=False sets
        got = encoder(x, src_key_padding_mask=pad)
    assert torch.allclose(dm.inspect(got), want, atol=1e-5)


def test_a_sparse_result_is_refused_on_the_client_saying_how_to_avoid_it(mesh2):
    """nn.Embedding(sparse=True) makes a sparse gradient: before, the client took it for a
    dense one (a fake sparse tensor has strides of 0) and the ranks failed at its next use."""
    torch.manual_seed(0)
    local = nn.Embedding(10, 3)
    ids = torch.tensor([1, 2, 2])
    local(ids).sum().backward()
    with mesh2.activate():
        embedding = nn.Embedding(10, 3, sparse=True)
        embedding.load_state_dict(local.state_dict())
        with pytest.raises(NotImplementedError, match="sparse_coo.*sparse=False"):
            embedding(ids).sum().backward()
        with pytest.raises(NotImplementedError, match="sparse_coo"):
            torch.ones(2, 2).to_sparse()
        embedding.sparse = False  # what sparse=False builds: the mesh serves it as before
        embedding.weight.grad = None
        embedding(ids).sum().backward()
        grad = dm.inspect(embedding.weight.grad)
    assert torch.equal(grad, local.weight.grad)


def test_factories_follow_the_clients_default_dtype_and_plans_follow_its_changes(mesh2):
    """torch.set_default_dtype(torch.float64) in the client: the ranks keep torch's default,
    so a factory's dtype goes explicitly; plans cached before a change are made again."""
    default = torch.get_default_dtype()
    try:
        with mesh2.activate():
            torch.set_default_dtype(torch.float64)
            made = [torch.ones(3), torch.randn(2), torch.full((2,), 0.5), torch.linspace(0, 1, 3)]
            assert {t.dtype for t in made} == {torch.float64}
            assert [dm.inspect(t).dtype for t in made] == [torch.float64] * 4
            torch.set_default_dtype(torch.float32)
            again = torch.ones(3)  # planned float64 a moment ago: the cache is stale now
            assert again.dtype == torch.float32
            assert dm.inspect(again).dtype == torch.float32
    finally:
        torch.set_default_dtype(default)


def test_promotions_by_the_clients_default_dtype_equal_local(mesh2):
    """``int_tensor / 2`` makes the default dtype: float64 in a client that set it, float32 on
    the ranks (which keep torch's), so the ranks computed in float32 what the client planned
    as float64; a float64 op later made it float64 again, with float32's rounding. The ranks
    now read the integer inputs cast to the client's default, as torch computes them."""
    default = torch.get_default_dtype()
    cases = {
        "div": lambda i, b: i / 3,
        "mul": lambda i, b: i * 1.1,
        "sqrt": lambda i, b: torch.sqrt(i),
        "bool": lambda i, b: b * 0.3,
        "where": lambda i, b: torch.where(b, i, 0.7),
        "clamp": lambda i, b: i.clamp(min=1.5),
        "complex": lambda i, b: i * (1 + 0.5j),  # the default's complex dtype: complex128
    }
    try:
        torch.set_default_dtype(torch.float64)
        i, b = torch.arange(7), torch.arange(7) % 3 == 0
        want = {name: case(i, b) for name, case in cases.items()}
        with mesh2.activate():
            known = {
                name: case(torch.arange(7), torch.arange(7) % 3 == 0)
                for name, case in cases.items()
            }
            drawn = torch.randint(0, 9, (7,))  # a value only the ranks know
            unknown = torch.sqrt(drawn) + 0.0
            got, values = dm.inspect(known), dm.inspect((unknown, drawn))
    finally:
        torch.set_default_dtype(default)
    for name in cases:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert unknown.dtype == torch.float64
    assert torch.equal(values[0], torch.sqrt(values[1].double()))


def test_a_users_custom_ops_run_on_the_mesh_with_or_without_a_fake_kernel(mesh2):
    """torch.library custom ops (a user's own kernels): with a fake kernel they are planned
    as any op, gradients too; without one the client refused them with torch's error about
    torch.compile tracing, and now the ranks run them and report their outputs' metadata,
    once per input metadata (found by a probe of pretrained models and custom ops)."""
    from helpers.custom_ops import doubled_rows, scaled

    x = torch.arange(6.0).reshape(3, 2)
    with mesh2.activate(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", dm.ImplicitFetchWarning)
        leaf = torch.tensor(x.tolist(), requires_grad=True)
        scaled(leaf, 3.0).sum().backward()
        assert not caught
        first = doubled_rows(leaf.detach())
        again = doubled_rows(leaf.detach() + 1)  # the same input metadata: planned
        assert first.shape == (6, 2) and len(caught) == 1
        assert "register_fake" in str(caught[0].message)
        got = dm.inspect((leaf.grad, first, again))
    assert torch.equal(got[0], torch.full((3, 2), 3.0))
    assert torch.equal(got[1], torch.cat([x, x])) and torch.equal(got[2], torch.cat([x, x]) + 1)


def test_pickling_a_mesh_tensor_says_what_to_do(mesh2):
    with mesh2.activate():
        x = torch.ones(2)
    with pytest.raises(TypeError, match="cannot be pickled.*dask_monarch.inspect"):
        pickle.dumps(x)
    with pytest.raises(TypeError, match="cannot be pickled"):
        torch.save(x, "/dev/null")
    # safetensors (save_pretrained, transformers' Trainer) asks for a storage's pointer
    with pytest.raises(RuntimeError, match="no local storage.*state_dict=dask_monarch.inspect"):
        x.storage()


# -- torch's optimizers ----------------------------------------------------------------------

FOREACH = ["Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "ASGD", "RMSprop", "SGD"]


def _optimizer_steps(mesh, name: str, steps: int = 4) -> tuple[list, list[int]]:
    """Weights after ``steps`` steps of ``torch.optim.<name>(foreach=True)`` on an MLP, and
    how many plans the mesh's propagation cache held after each step (None: locally)."""
    local = _mlp()
    plans = []
    with mesh.activate() if mesh else dm.no_mesh.activate():
        model = _mlp()
        model.load_state_dict(local.state_dict())
        momentum = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
        optimizer = getattr(torch.optim, name)(
            model.parameters(), lr=0.05, foreach=True, **momentum
        )
        x = torch.tensor([[0.1 * i + j for j in range(4)] for i in range(5)])
        for _ in range(steps):
            optimizer.zero_grad()
            ((model(x) - 1) ** 2).mean().backward()
            optimizer.step()
            plans.append(len(mesh._propagator._cache) if mesh else None)
        weights = [p.detach() for p in model.parameters()]
        return [dm.inspect(w) if mesh else w for w in weights], plans


@pytest.mark.parametrize("name", FOREACH)
def test_foreach_optimizers_step_without_a_round_trip_and_equal_local(mesh2, no_fetch, name):
    """Adam's family reads each parameter's step count with ``.item()`` after a
    ``_foreach_add_`` of the counts: the client mirrors list ops as it does single ones, so
    no step fetches (before: one implicit fetch per parameter per step, 0.6 s per step at 50
    parameters). The bias corrections and step sizes are new floats every step: the ops
    they go to are planned once, not once per value (the cache stops growing)."""
    weights, plans = _optimizer_steps(mesh2, name)
    local, _ = _optimizer_steps(None, name)
    assert all(torch.equal(a, b) for a, b in zip(weights, local))
    assert plans[1] == plans[-1]


def test_clip_grad_norm_of_bucketed_gradients_is_a_few_messages_and_equals_local(mesh2):
    """torch clips tensor by tensor a tensor type it does not know; mesh tensors are known
    to it (as DTensor is), so ``clip_grad_norm_`` sends a few messages for all gradients,
    not one per gradient each naming every alias of its ``ddp_hooks`` bucket (quadratic:
    1.9 s per call at 800 parameters)."""
    torch.manual_seed(0)
    local = nn.Sequential(*[nn.Linear(3, 3) for _ in range(10)])
    x = torch.randn(2, 3)
    local(x).sum().backward()
    local_norm = nn.utils.clip_grad_norm_(local.parameters(), 0.1)
    with mesh2.activate():
        model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(10)])
        model.load_state_dict(local.state_dict())
        dm.ddp_hooks(model, "gpu")
        model.zero_grad()
        model(x).sum().backward()
        controller = mesh2._session.controller
        controller.flush()
        sent = controller.messages_sent
        norm = nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        controller.flush()
        messages = controller.messages_sent - sent
        grads = [dm.inspect(p.grad) for p in model.parameters()]
        norm = dm.inspect(norm)
    assert messages <= 12, messages  # 20 gradients: one message per op of the clip
    torch.testing.assert_close(norm, local_norm)
    for got, want in zip(grads, (p.grad for p in local.parameters())):
        torch.testing.assert_close(got, want)


# -- dm.compile ----------------------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


OPTIMIZERS = {
    "AdamW": (lambda p: torch.optim.AdamW(p, lr=0.05), None),
    "AdamW fused": (lambda p: torch.optim.AdamW(p, lr=0.05, fused=True), None),
    "Adam": (lambda p: torch.optim.Adam(p, lr=0.05), None),
    "SGD momentum": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), None),
    "SGD, StepLR": (
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
    ),
}


def _train(mesh, make_optimizer, make_scheduler, compiled, steps=7):
    """Losses and weights of ``steps`` steps, the step compiled from step 0 or not; and how
    many times it was traced."""
    local = _mlp()
    traces = 0
    with mesh.activate():
        model = _mlp()
        model.load_state_dict(local.state_dict())
        optimizer = make_optimizer(model.parameters())
        scheduler = make_scheduler(optimizer) if make_scheduler else None
        x = torch.tensor([[0.1 * i + j for j in range(4)] for i in range(5)])
        y = torch.tensor([[float(i % 2)] for i in range(5)])

        def step(x, y):
            optimizer.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            return loss.detach()

        if compiled:
            step = dm.compile(step)
            original = step._trace

            def counted(*args):
                nonlocal traces
                traces += 1
                return original(*args)

            step._trace = counted
        losses = []
        for _ in range(steps):
            losses.append(step(x, y))
            if scheduler:
                scheduler.step()
        losses = [dm.inspect(loss).item() for loss in losses]
        weights = [dm.inspect(p.detach()) for p in model.parameters()]
    return losses, weights, traces


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_compiled_training_step_equals_eager_from_its_first_step(mesh2, name):
    make_optimizer, make_scheduler = OPTIMIZERS[name]
    eager_losses, eager_weights, _ = _train(mesh2, make_optimizer, make_scheduler, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, weights, traces = _train(mesh2, make_optimizer, make_scheduler, True)
    assert losses == pytest.approx(eager_losses, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(weights, eager_weights))
    gave_up = [w for w in caught if issubclass(w.category, dm.CompileWarning)]
    if name in ("AdamW fused", "SGD momentum"):  # state made, then confirmed: replays
        assert traces == 3 and not gave_up
    else:  # every call reads a value it changes (Adam's step count), or the lr changes
        assert len(gave_up) == 1 and "fused=True" in str(gave_up[0].message)
        # Adam: 1 + RETRACES traces; StepLR: one more, as a second trace agreed once
        assert traces == (5 if "StepLR" in name else 4)


def test_a_compiled_function_cannot_fetch_and_names_the_line(mesh2):
    @dm.compile
    def branches(x):
        if x.sum() > 0:  # needs the value of x
            return x + 1
        return x - 1

    with mesh2.activate():
        x = _unknown(torch.ones(2))
        with pytest.raises(RuntimeError, match=rf"{re.escape(__file__)}:\d+ .*compiled function"):
            branches(x)


def test_a_value_read_inside_guards_the_recording(mesh2, no_fetch):
    @dm.compile
    def scaled(x, factor):
        return x * factor.item()  # read on the client: the recording holds the number

    with mesh2.activate():
        x = torch.ones(2) + _unknown(torch.zeros(2))
        twice = dm.inspect(scaled(x, torch.tensor(2.0)))
        again = dm.inspect(scaled(x, torch.tensor(2.0)))
        thrice = dm.inspect(scaled(x, torch.tensor(3.0)))  # traced again, not replayed
    assert twice.tolist() == again.tolist() == [2.0, 2.0] and thrice.tolist() == [3.0, 3.0]


def test_verify_renumbers_keyword_tensors_and_borrows(mesh2):
    comms = dm.Stream("verify_comms")

    @dm.compile(verify=True)
    def attend(q, k, v, mask):
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        grad, borrow = comms.borrow(out, mutable=True)
        with comms.activate():
            grad.reduce_("gpu", "avg")
        borrow.drop()
        return out

    with mesh2.activate():
        q = torch.ones(1, 2, 3, 4) + _unknown(torch.zeros(1, 2, 3, 4))
        mask = torch.ones(3, 3, dtype=torch.bool)
        first = attend(q, q, q, mask)
        second = attend(q, q, q, mask)  # traced again and compared: no false alarm
    assert torch.equal(dm.inspect(first), dm.inspect(second))
