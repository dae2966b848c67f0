"""How a rank resolves a call's arguments (docs/protocol.md §2.2): Refs inside lists and
tuples, in the pytree's order, without the pytree walk where the containers hold only
leaves; RefViews (a view named instead of a ref) computed where they are read."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers.raw import S0, call, create_streams, failures

from dask_monarch.messages import ArgsKwargs, FunctionPath, Ref, RefView, dumps

BOTH = [0, 1]


def _setup(ctrl):
    create_streams(ctrl, BOTH, S0)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 2))
    ctrl.send(BOTH, call(1, Ref(2), "torch.zeros", 3))


@pytest.mark.timeout(120)
def test_refs_inside_lists_and_tuples_are_resolved_and_containers_kept(ctrl):
    _setup(ctrl)
    ctrl.send(BOTH, call(2, Ref(3), "torch.ops.aten.cat.default", [Ref(1), Ref(2)]))
    ctrl.send(BOTH, call(3, Ref(4), "torch.ops.aten.view.default", Ref(3), [5, 1]))
    ctrl.send(
        BOTH,
        call(
            4,
            Ref(5),
            "helpers.remote_fns.describe",
            Ref(1),
            [Ref(2), 2, None],
            (Ref(1), "a", torch.float32),
            (),
            dims=[0, 1],
            pair=(Ref(2), 1.5),
        ),
    )
    # containers of containers take the pytree walk: the same answer
    ctrl.send(
        BOTH, call(5, Ref(6), "helpers.remote_fns.describe", [[Ref(1)], (Ref(2),)], d={"x": Ref(1)})
    )
    assert ctrl.sync() == []
    for rank in BOTH:
        assert torch.equal(ctrl.get_ref(rank, Ref(3), S0), torch.tensor([1.0, 1, 0, 0, 0]))
        assert ctrl.get_ref(rank, Ref(4), S0).shape == (5, 1)
        assert ctrl.get_ref(rank, Ref(5), S0) == repr(
            (
                (
                    "Tensor[2]",
                    ["Tensor[3]", "int", "NoneType"],
                    ("Tensor[2]", "str", "dtype"),
                    (),
                ),
                {"dims": ["int", "int"], "pair": ("Tensor[3]", "float")},
            )
        )
        assert ctrl.get_ref(rank, Ref(6), S0) == repr(
            (([["Tensor[2]"], ("Tensor[3]",)],), {"d": {"x": "Tensor[2]"}})
        )


@pytest.mark.timeout(120)
def test_the_first_bad_ref_in_order_decides_the_error(ctrl):
    """A missing ref is a fresh failure, an errored one a dependent failure: whichever comes
    first in the arguments (lists included, kwargs last) decides, as the pytree walk does."""
    _setup(ctrl)
    ctrl.send(BOTH, call(2, Ref(3), "helpers.remote_fns.boom", Ref(1)))  # fails: r3 holds an error
    ctrl.send(BOTH, call(3, Ref(4), "torch.ops.aten.cat.default", [Ref(3), Ref(99)]))
    ctrl.send(BOTH, call(4, Ref(5), "torch.ops.aten.cat.default", [Ref(1), Ref(99), Ref(3)]))
    ctrl.send(BOTH, call(5, Ref(6), "helpers.remote_fns.describe", [Ref(1)], k=[Ref(3)], j=Ref(98)))
    ctrl.send(
        BOTH, call(6, Ref(7), "helpers.remote_fns.describe", [Ref(1), 2], k=(Ref(98), Ref(3)))
    )
    reports = failures(ctrl.sync())
    assert sorted((r.seq, r.rank) for r in reports) == [
        (2, 0),
        (2, 1),
        (4, 0),
        (4, 1),
        (6, 0),
        (6, 1),
    ]
    assert all("ref not found: r99" in r.error for r in reports if r.seq == 4)
    assert all("ref not found: r98" in r.error for r in reports if r.seq == 6)
    for ref in (Ref(4), Ref(6)):  # dependent: the root error, reported once under seq 2
        with pytest.raises(Exception, match="boom"):
            ctrl.get_ref(0, ref, S0)


def _count_walks(dask_worker=None) -> None:
    """Count the pytree walks of argument resolution on this worker (until _walks)."""
    from dask_monarch.worker import calls

    original = calls.tree_flatten

    def counting(tree):
        counting.walks += 1
        return original(tree)

    counting.walks, counting.original = 0, original
    calls.tree_flatten = counting


def _walks(dask_worker=None) -> int:
    from dask_monarch.worker import calls

    walks = calls.tree_flatten.walks
    calls.tree_flatten = calls.tree_flatten.original
    return walks


@pytest.mark.timeout(120)
def test_lists_and_tuples_of_leaves_skip_the_pytree_walk(ctrl, client2):
    """A shape, a list of dims, a list of tensors: about a quarter of a training step's
    calls; the walk costs several times the op (docs/dask.md §12)."""
    _setup(ctrl)
    assert ctrl.sync() == []
    client2.run(_count_walks)
    try:
        ctrl.send(BOTH, call(2, Ref(3), "torch.ops.aten.cat.default", [Ref(1), Ref(2)]))
        ctrl.send(BOTH, call(3, Ref(4), "torch.ops.aten.view.default", Ref(3), [5, 1]))
        ctrl.send(BOTH, call(4, Ref(5), "torch.ops.aten.sum.dim_IntList", Ref(4), [0], True))
        ctrl.send(BOTH, call(5, Ref(6), "torch.ops.aten.randn.default", [2, 2], dtype=None))
        ctrl.send(BOTH, call(6, Ref(7), "helpers.remote_fns.describe", {"nested": Ref(1)}))  # walks
        assert ctrl.sync() == []
    finally:
        walks = client2.run(_walks)
    assert sorted(walks.values()) == [1, 1]
    assert ctrl.get_ref(0, Ref(5), S0).shape == (1, 1)


@pytest.mark.timeout(120)
def test_ref_views_are_their_op_applied_to_their_base(ctrl):
    """A RefView leaf is ``function(base, *args, **kwargs)`` on the reading lane: at the top
    level, in lists, nested in another RefView and as a keyword (docs/protocol.md §2.2)."""
    _setup(ctrl)
    ctrl.send(BOTH, call(2, Ref(3), "torch.ops.aten.arange.default", 6, dtype=torch.float32))
    view = FunctionPath("torch.ops.aten.view.default")
    rows = RefView(Ref(3), view, ([2, 3],))
    cols = RefView(rows, FunctionPath("torch.ops.aten.t.default"))
    ctrl.send(BOTH, call(3, Ref(4), "torch.ops.aten.mul.Tensor", cols, 2))
    ctrl.send(BOTH, call(4, Ref(5), "torch.ops.aten.cat.default", [rows, rows]))
    ctrl.send(BOTH, call(5, Ref(6), "torch.ops.aten.add.Tensor", Ref(4), other=cols))
    ctrl.send(BOTH, call(6, Ref(7), "torch.ops.aten.add_.Tensor", rows, 1))  # in place: base too
    assert ctrl.sync() == []
    local = torch.arange(6.0).view(2, 3)
    for rank in BOTH:
        assert torch.equal(ctrl.get_ref(rank, Ref(4), S0), local.t() * 2)
        assert torch.equal(ctrl.get_ref(rank, Ref(5), S0), torch.cat([local, local]))
        assert torch.equal(ctrl.get_ref(rank, Ref(6), S0), local.t() * 3)
        assert torch.equal(ctrl.get_ref(rank, Ref(3), S0), torch.arange(6.0) + 1)


@pytest.mark.timeout(120)
def test_a_ref_view_of_a_failed_or_missing_base_fails_as_a_ref_would(ctrl):
    _setup(ctrl)
    ctrl.send(BOTH, call(2, Ref(3), "helpers.remote_fns.boom", Ref(1)))  # r3 holds an error
    t = FunctionPath("torch.ops.aten.t.default")
    ctrl.send(BOTH, call(3, Ref(4), "torch.ops.aten.neg.default", RefView(Ref(3), t)))
    ctrl.send(BOTH, call(4, Ref(5), "torch.ops.aten.neg.default", RefView(Ref(99), t)))
    reports = failures(ctrl.sync())
    assert sorted((r.seq, r.rank) for r in reports) == [(2, 0), (2, 1), (4, 0), (4, 1)]
    assert all("ref not found: r99" in r.error for r in reports if r.seq == 4)
    with pytest.raises(Exception, match="boom"):  # dependent: the root error
        ctrl.get_ref(0, Ref(4), S0)


def test_ref_views_check_their_fields_and_pickle_as_tuples():
    base = RefView(Ref(1), FunctionPath("torch.ops.aten.t.default"))
    assert base.root() == Ref(1) and RefView(base, base.function).root() == Ref(1)
    for bad in (
        lambda: RefView(1, base.function),
        lambda: RefView(Ref(1), "torch.ops.aten.t.default"),
        lambda: RefView(Ref(1), base.function, [2]),
        lambda: RefView(Ref(1), base.function, (), {1: 2}),
    ):
        with pytest.raises(TypeError, match="RefView"):
            bad()
    args = ArgsKwargs.from_python((base, [base, 2]))
    assert not args.flat
    (loaded,) = pickle.loads(dumps([args]))
    assert loaded == args and type(loaded[0][0]) is RefView
