"""Protocol fields are checked with the field's name: ids, seqs and the lanes a rank holds.

No cluster: the messages and the compiler are checked where the client builds them.
"""

from __future__ import annotations

import pickle

import dask
import pytest
from helpers.raw import S0, S1, S2, call, fetch

from dask_monarch import messages as m
from dask_monarch.controller.compiler import Compiler
from dask_monarch.messages import Ref, StreamRef

DEFAULT = m.StreamCreationMode.UseDefaultStream


@pytest.mark.parametrize("cls", [Ref, StreamRef])
def test_ids_that_are_not_ints_name_the_kind_of_id(cls):
    with pytest.raises(TypeError, match=f"{cls.__name__} id must be an int, got 'a'"):
        cls("a")
    with pytest.raises(ValueError, match="64 unsigned bits"):
        cls(2**70)


def test_a_seq_out_of_range_names_the_field():
    with pytest.raises(ValueError, match=r"CallFunction\.seq must fit in 64 unsigned bits"):
        call(2**70, Ref(1), "torch.ones", 1)
    with pytest.raises(ValueError, match=r"SendValue\.seq must be non-negative"):
        fetch(-1, Ref(1))


def _compile(compiler, *messages, ranks=(0, 1)):
    return compiler.compile([(ranks, msg) for msg in messages])


def _compiler():
    return Compiler("tok", ["monarch-rank0", "monarch-rank1"])


@pytest.mark.parametrize("second", [3, 2])  # duplicate, decreasing
def test_seqs_must_increase_on_a_stream(second):
    compiler = _compiler()
    plan = _compile(
        compiler,
        m.CreateStream(S0, DEFAULT),
        call(3, Ref(1), "torch.ones", 1),
        fetch(second, Ref(1)),
    )
    assert plan.error is not None and plan.error.rank == 0
    assert f"SendValue.seq={second} does not increase" in plan.error.cause
    assert plan.messages == 0 and plan.graph is None  # nothing of a refused flush runs


def test_seqs_are_checked_across_flushes_and_per_stream():
    compiler = _compiler()
    plan = _compile(
        compiler,
        m.CreateStream(S0, DEFAULT),
        m.CreateStream(S1, DEFAULT),
        call(5, Ref(1), "torch.ones", 1),
        call(5, Ref(2), "torch.ones", 1, stream=S1),
        m.RequestStatus(5),
    )
    assert plan.error is None  # another stream, and RequestStatus repeats the last seq
    plan = _compile(compiler, call(4, Ref(3), "torch.ones", 1), ranks=(1,))
    assert plan.error is not None and plan.error.rank == 1
    assert "was already sent seq 5" in plan.error.cause


def test_the_lanes_of_a_rank_are_capped():
    with dask.config.set({"dask_monarch.limits.lanes": 2}):
        compiler = _compiler()
    plan = _compile(
        compiler,
        m.CreateStream(S0, DEFAULT),
        m.CreateStream(S1, DEFAULT),
        m.CreateStream(S2, DEFAULT),
    )
    assert plan.error is not None and plan.error.rank == 0
    assert "dask_monarch.limits.lanes=2" in plan.error.cause
    assert "stream 2" in plan.error.cause


@pytest.mark.parametrize("second", [4, 3])  # duplicate, decreasing
def test_seqs_must_increase_within_a_run_of_calls(second):
    """Consecutive calls on the same ranks and stream take the compiler's quick way: their
    seqs are still checked, and recorded for the next flush."""
    compiler = _compiler()
    plan = _compile(
        compiler,
        m.CreateStream(S0, DEFAULT),
        call(3, Ref(1), "torch.ones", 1),
        call(4, Ref(2), "torch.ones", 1),
        call(second, Ref(3), "torch.ones", 1),
    )
    assert plan.error is not None and plan.error.rank == 0
    assert f"CallFunction.seq={second} does not increase" in plan.error.cause
    compiler = _compiler()
    plan = _compile(
        compiler,
        m.CreateStream(S0, DEFAULT),
        *(call(s, Ref(s), "torch.ones", 1) for s in (3, 4, 5)),
    )
    assert plan.error is None and plan.messages == 4
    assert [len(task_steps) for task_steps in _steps(plan)] == [4, 4]
    plan = _compile(compiler, call(5, Ref(9), "torch.ones", 1), ranks=(1,))
    assert plan.error is not None and "was already sent seq 5" in plan.error.cause


def _steps(plan) -> list[list]:
    return [[s for chunk in task.payload for s in pickle.loads(chunk)] for task in plan.tasks]
