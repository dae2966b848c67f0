"""Python operators on mesh tensors: the direct way to dispatch and torch's way agree."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import dask_monarch as dm
from dask_monarch import client_values
from dask_monarch import messages as m
from dask_monarch import tensor as mesh_tensor

pytestmark = pytest.mark.timeout(120)

EXPRESSIONS = [
    "t + 1",
    "1 + t",
    "t + u",
    "t - 2.5",
    "1 - t",
    "t - u",
    "t * u",
    "3 * t",
    "t / 2",
    "t / u",
    "t ** 2",
    "t ** u",
    "2 ** t",
    "t + True",
    "t * 2j",
    "i + 1.5",  # type promotion: int64 + float
    "i / 2",
    "i * t",
]


def _recorded(expression: str, env: dict, direct: bool) -> list:
    """The calls ``expression`` sends to the ranks: (function, args with tensors by name)."""
    calls = []
    session = next(iter(env.values()))._session
    send = session.send
    names = {v._ref.id: k for k, v in env.items()}

    def spy(ranks, message):
        if type(message) is m.CallFunction:
            args, kwargs, payload, flat = message.args_kwargs
            args = tuple(names.get(a.id, a) if type(a) is m.Ref else a for a in args)
            calls.append((message.function, args, kwargs, payload, flat))
        return send(ranks, message)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(session, "send", spy)
        if not direct:
            patch.setattr(mesh_tensor, "_direct_op", lambda *a: None)
        result = eval(expression, {}, env)
    return calls, result


@pytest.mark.parametrize("n", [4, 5000], ids=["values-known-to-the-client", "values-on-ranks"])
def test_operators_send_what_torchs_dispatcher_sends(mesh2, monkeypatch, n):
    """Small tensors the client made keep their values on the client (client_values: the
    general path mirrors each op); larger ones take the fused path once propagation is
    cached (the torch-way pass caches it)."""
    with mesh2.activate():
        t = torch.arange(n, dtype=torch.float32) + 1
        u = torch.full((n,), 2.0)
        i = torch.arange(n)
        env = {"t": t, "u": u, "i": i}
        general = []
        monkeypatch.setattr(mesh_tensor, "dispatch", _counting(mesh_tensor.dispatch, general))
        for expression in EXPRESSIONS:
            via_torch, slow = _recorded(expression, env, direct=False)
            general.clear()
            direct, fast = _recorded(expression, env, direct=True)
            assert direct == via_torch, expression
            if n > client_values.MAX_ELEMENTS:
                assert not general, f"{expression}: the fused path was not taken"
            assert (fast.shape, fast.dtype, fast.stride()) == (
                slow.shape,
                slow.dtype,
                slow.stride(),
            )
            assert dm.inspect(fast).tolist() == dm.inspect(slow).tolist(), expression
    local = {"t": torch.arange(n) + 1.0, "u": torch.full((n,), 2.0), "i": torch.arange(n)}
    expected = [eval(expression, {}, local).tolist() for expression in EXPRESSIONS]
    with mesh2.activate():
        got = [dm.inspect(eval(expression, {}, env)).tolist() for expression in EXPRESSIONS]
    assert got == expected


def _counting(dispatch, calls: list):
    def counted(func, args, kwargs):
        calls.append(func)
        return dispatch(func, args, kwargs)

    return counted


def test_the_direct_way_is_taken_only_when_nothing_else_would_see_the_op(mesh2):
    add = mesh_tensor._DIRECT["__add__"]
    with mesh2.activate():
        t, u = torch.ones(2), torch.ones(2)
        assert mesh_tensor._direct_op(add, t, 1) is torch.ops.aten.add.Tensor
        assert mesh_tensor._direct_op(add, t, u) is torch.ops.aten.add.Tensor
        assert mesh_tensor._direct_op(add, t, [1, 2]) is None  # not a number: torch decides
        assert mesh_tensor._direct_op(mesh_tensor._DIRECT["__radd__"], t, u) is None
        w = torch.ones(2, requires_grad=True)
        assert mesh_tensor._direct_op(add, w, 1) is None  # autograd records it
        assert mesh_tensor._direct_op(add, t, w) is None
        assert (w + 1).grad_fn is not None and (t + w).grad_fn is not None
        with torch.no_grad():
            assert mesh_tensor._direct_op(add, w, 1) is torch.ops.aten.add.Tensor
            assert (w + 1).grad_fn is None

        seen = []

        class Watch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))

        class WatchCalls(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))

        with Watch():
            assert mesh_tensor._direct_op(add, t, 1) is None
            t + 1
        with WatchCalls():
            assert mesh_tensor._direct_op(add, t, 1) is None
            t + 1
        assert seen[0] is torch.ops.aten.add.Tensor
        assert any("add" in getattr(f, "__name__", "") for f in seen[1:]), seen
        before = t._version
        t += 1  # in place: torch's way, which bumps the version autograd checks
        assert t._version == before + 1
        assert dm.inspect(t).tolist() == [2.0, 2.0]


def test_misuse_through_the_direct_way_says_what_was_wrong(mesh2):
    with mesh2.activate():
        t = torch.ones(2)
        side = dm.Stream("operators-side")
        with side.activate():
            with pytest.raises(TypeError, match="WRONG_STREAM"):
                t + 1
        t.drop()
        with pytest.raises(TypeError, match="DROPPED"):
            2 * t
