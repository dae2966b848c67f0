"""Lazy views: a view op sends no message; what reads it names it as a RefView.

Every test compares with the same code run on local tensors, and uses tensors
whose values the client does not know (it mirrors small ones it made itself, and
their views are then computed on the client, not lazy).
"""

from __future__ import annotations

import dask
import pytest
import torch

import dask_monarch as dm
from dask_monarch import messages as m

pytestmark = pytest.mark.timeout(120)


def unknown(*shape: int) -> torch.Tensor:
    """``arange`` of ``shape``, on the ranks only (a seeded op: the client cannot mirror it)."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(float(n)).reshape(shape) + torch.zeros(shape).normal_() * 0


def _sent(mesh: dm.DeviceMesh) -> int:
    controller = mesh._session.controller
    return controller.messages_sent + len(controller._buffer)


def _calls(mesh: dm.DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> list:
    """The CallFunctions the session sends from now on."""
    calls: list = []
    session = mesh._session
    send = session.send

    def spy(ranks, message):
        if type(message) is m.CallFunction:
            calls.append(message)
        return send(ranks, message)

    monkeypatch.setattr(session, "send", spy)
    return calls


def test_views_send_nothing_and_read_as_their_op(mesh2, monkeypatch):
    with mesh2.activate():
        x = unknown(4, 6)
        calls = _calls(mesh2, monkeypatch)
        v = x.view(6, 4).t().detach()  # three views, none sent
        assert v._lazy is not None and "ref=lazy" in repr(v)
        assert calls == []
        y = v * 2 + x
        call = calls[0]  # v * 2 (then + x)
        assert len(calls) == 2
        first = call.args_kwargs[0][0]
        assert type(first) is m.RefView and first.root() == x._ref
        assert [v.function.path.split(".")[3] for v in (first, first[0], first[0][0])] == [
            "detach",
            "t",
            "view",
        ]
        got = dm.inspect(y)
    local = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(got, local.view(6, 4).t().detach() * 2 + local)


def test_a_view_reads_its_base_as_changed_in_place_after_it(mesh2):
    with mesh2.activate():
        x = unknown(2, 3)
        row = x[1]
        x.mul_(2)  # the view is sent before the write: it aliases what the write changes
        row.add_(5)
        got_x, got_row = dm.inspect((x, row))
    assert got_x.tolist() == [[0, 2, 4], [11, 13, 15]] and got_row.tolist() == [11, 13, 15]


def test_a_view_keeps_its_layout_when_its_base_is_restrided(mesh2):
    local = torch.arange(6.0).reshape(2, 3)
    flat_local = local.view(6)
    local.t_()
    with mesh2.activate():
        x = unknown(2, 3)
        flat = x.view(6)
        x.t_()  # changes x's strides: flat must have been made from the old ones
        got_flat, got_x = dm.inspect((flat * 1, x * 1))
    assert torch.equal(got_flat, flat_local) and torch.equal(got_x, local)


def test_fetching_a_view_sends_it_once(mesh2):
    with mesh2.activate():
        x = unknown(3, 4)
        v = x.t()
        before = _sent(mesh2)
        got = dm.inspect(v)
        assert v._lazy is None and _sent(mesh2) > before
        ref = v._ref
        assert dm.inspect(v + 0).tolist() == got.tolist() and v._ref == ref
    assert torch.equal(got, torch.arange(12.0).reshape(3, 4).t())


def test_dropping_the_base_keeps_its_views(mesh2):
    with mesh2.activate():
        x = unknown(3, 3)
        row, col = x[1], x[:, 2]
        x.drop()
        assert dm.inspect(row + col).tolist() == [5.0, 9.0, 13.0]
        with pytest.raises(TypeError, match="DROPPED"):
            x + 1


def test_chains_deeper_than_the_limit(mesh2):
    with mesh2.activate():
        x = unknown(4, 6)
        q = x
        for _ in range(25):
            q = q.view(-1).view(4, 6).t().t()
        assert q._lazy[4] <= 8
        assert torch.equal(dm.inspect(q * 1), torch.arange(24.0).reshape(4, 6))


def test_views_of_views_in_lists(mesh2):
    with mesh2.activate():
        x = unknown(2, 4)
        parts = [x[0].view(2, 2), x[1].view(2, 2).t()]
        got = dm.inspect(torch.cat(parts))
    local = torch.arange(8.0).reshape(2, 4)
    assert torch.equal(got, torch.cat([local[0].view(2, 2), local[1].view(2, 2).t()]))


def test_a_lent_tensor_sends_its_views_first(mesh2):
    other = dm.Stream("lazy-views-other")
    with mesh2.activate():
        x = unknown(4)
        v = x.view(2, 2)
        borrowed, borrow = other.borrow(x, mutable=True)
        assert v._lazy is None  # a ref before its base was lent
        with other.activate():
            borrowed.mul_(10)
            w = borrowed.view(2, 2)  # a view on the borrower's stream
            assert w._lazy is not None
        borrow.drop()
        with pytest.raises(TypeError, match="DROPPED"), other.activate():
            w + 1
        assert dm.inspect(v).tolist() == [[0.0, 10.0], [20.0, 30.0]]


def test_a_failure_reaches_the_readers_of_a_view(mesh2):
    @dm.remote(propagate=lambda x: x.clone())
    def explode(x):
        raise ValueError("the base failed")

    with mesh2.activate():
        bad = explode(unknown(2, 2))
        worse = bad.t()[0] * 2
        with pytest.raises(dm.RemoteException, match="the base failed"):
            dm.inspect(worse)
        with pytest.raises(dm.RemoteException, match="the base failed"):
            dm.inspect(bad.t())


def test_views_made_before_a_compiled_function_are_refs_in_it(mesh2):
    with mesh2.activate():
        x = unknown(2, 3)
        v = x.t()

        @dm.compile
        def step(a):
            return (a + v.t()).sum()

        results = [dm.inspect(step(x)).item() for _ in range(3)]
        assert v._lazy is None
    assert results == [30.0, 30.0, 30.0]


def test_a_dry_run_sends_views_made_before_it(mesh2):
    with mesh2.activate():
        x = unknown(2, 2)
        v = x.t()
        with dm.dry_run(mesh2):
            v * 2
        assert v._lazy is None
        assert dm.inspect(v).tolist() == [[0.0, 2.0], [1.0, 3.0]]


def test_switched_off_every_view_is_a_message(client2):
    with dask.config.set({"dask_monarch.lazy-views": False}):
        mesh = dm.device_mesh(client2, gpu=2)
    try:
        with mesh.activate():
            x = unknown(2, 2)
            before = _sent(mesh)
            v = x.t()
            assert v._lazy is None and _sent(mesh) == before + 1
            assert dm.inspect(v).tolist() == [[0.0, 2.0], [1.0, 3.0]]
    finally:
        mesh.exit()


def test_training_a_model_sends_fewer_messages(client2):
    """A transformer layer's step (forward, backward, AdamW) reads the same with its views
    lazy: the weights end equal to the same step run with every view a message."""

    def run(lazy: bool) -> tuple[list[torch.Tensor], int]:
        with dask.config.set({"dask_monarch.lazy-views": lazy}):
            mesh = dm.device_mesh(client2, gpu=2)
        try:
            with mesh.activate():
                dm.random.manual_seed(0)
                layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
                optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
                data = torch.zeros(2, 5, 8).normal_()
                before = _sent(mesh)
                for _ in range(2):
                    loss = layer(data).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                sent = _sent(mesh) - before
                return dm.inspect([p.detach() for p in layer.parameters()]), sent
        finally:
            mesh.exit()

    lazy, lazy_sent = run(True)
    eager, eager_sent = run(False)
    assert all(torch.equal(a, b) for a, b in zip(lazy, eager))
    assert lazy_sent < 0.75 * eager_sent
