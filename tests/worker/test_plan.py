"""A replay plan as generated code (worker/plan.py), without a cluster: what it runs,
what it frees, and where it hands back to the interpreter."""

from __future__ import annotations

import weakref

import torch

from dask_monarch.worker import plan as plan_module
from dask_monarch.worker.errors import SeqError
from dask_monarch.worker.plan import FastCall, generate

ADD = torch._C._VariableFunctions.add


class Replay:
    error = None


def chain(n: int, start_ref: int = 1000) -> tuple[list, list]:
    """``r[i] = ones + r[i-1]``, n times, from ref 2 (ones is ref 1); each intermediate
    freed by the command after it (the inputs are kept)."""
    plan, frees = [], []
    for i in range(n):
        previous = start_ref + i - 1 if i else 2
        plan.append(
            FastCall((ADD, [None, None], ((0, 1), (1, previous)), {}, start_ref + i, None, None))
        )
        frees.append((previous,) if i else ())
    return plan, frees


def env() -> dict:
    return {1: torch.ones(3), 2: torch.zeros(3)}


def test_a_plan_longer_than_a_piece_runs_whole_and_keeps_only_what_it_returns():
    plan, frees = chain(2 * plan_module.PIECE + 7)
    run = generate(plan, frees, step=None)
    values = env()
    assert run(None, values, Replay, None) == len(plan)
    assert sorted(values) == [1, 2, 1000 + len(plan) - 1]
    assert torch.equal(values[1000 + len(plan) - 1], torch.full((3,), float(len(plan))))


def test_a_missing_or_errored_argument_or_a_failed_replay_hands_back_before_the_call():
    plan, frees = chain(2 * plan_module.PIECE)
    run = generate(plan, frees, step=None)
    values = env()
    del values[1]
    assert run(None, values, Replay, None) == 0  # the interpreter reports the missing ref
    values = env()
    values[1] = SeqError(7, "an earlier failure")
    assert run(None, values, Replay, None) == 0
    values = env()

    class Failed:
        error = SeqError(8, "another stream failed")

    assert run(None, values, Failed, None) == 0
    assert sorted(values) == [1, 2]  # nothing ran


def test_a_hand_back_in_a_later_piece_keeps_what_ran_before_it():
    plan, frees = chain(plan_module.PIECE + 10)
    plan[plan_module.PIECE + 3] = FastCall(
        (ADD, [None, None], ((0, 1), (1, 99)), {}, 1000 + plan_module.PIECE + 3, None, None)
    )  # reads ref 99, which nobody defined
    run = generate(plan, frees, step=None)
    values = env()
    assert run(None, values, Replay, None) == plan_module.PIECE + 3
    assert torch.equal(
        values[1000 + plan_module.PIECE + 2], torch.full((3,), plan_module.PIECE + 3.0)
    )


def test_other_commands_go_through_the_interpreters_step_in_order():
    plan, frees = chain(4)
    seen = []
    plan.insert(2, "a formal, a borrow or a collective")
    frees.insert(2, ())

    def step(lane, replay, plan_, index, msg):
        seen.append((index, plan_[index], sorted(values)))

    run = generate(plan, frees, step)
    values = env()
    assert run("lane", values, Replay, "msg") == 5
    assert seen == [(2, "a formal, a borrow or a collective", [1, 2, 1001])]
    assert torch.equal(values[1003], torch.full((3,), 4.0))


def test_a_call_not_settled_yet_is_not_generated():
    plan, frees = chain(3)
    plan[1] = FastCall((*plan[1][:6], ("overload", "binding")))
    assert generate(plan, frees, step=None) is None


def test_a_freed_argument_is_not_kept_by_the_generated_code():
    """The interpreter's locals go with each command; the generated code's ``a0``... must
    not keep a freed tensor until its piece returns (a replay holds no more than the same
    ops sent one by one)."""
    big = torch.ones(1000)
    held = weakref.ref(big)
    plan = [
        FastCall((torch.where, [None, None, None], ((0, 1), (1, 2), (2, 3)), {}, 10, None, None)),
        "a later command",
        FastCall((ADD, [None, None], ((0, 10), (1, 10)), {}, 11, None, None)),
        "another",
    ]
    frees = [(3,), (), (), ()]
    alive = []
    run = generate(plan, frees, step=lambda *_: alive.append(held() is not None))
    values = {1: torch.tensor([True] * 1000), 2: torch.zeros(1000), 3: big}
    del big
    assert run(None, values, Replay, None) == 4
    assert alive == [False, False]


def test_a_list_argument_naming_refs_is_built_afresh_and_hands_back_on_an_errored_item():
    cat = torch._C._VariableFunctions.cat
    constant = torch.full((3,), 7.0)
    template = [[None, constant, None], 0]  # cat([r1, constant, r2], 0)
    plan = [
        FastCall((cat, template, (((0, 0), 1), ((0, 2), 2)), {}, 10, None, None)),
        FastCall(
            (
                torch._C._VariableFunctions.stack,
                [(None, None)],
                (((0, 0), 10), ((0, 1), 10)),
                {},
                11,
                None,
                None,
            )
        ),
    ]
    run = generate(plan, [(), ()], step=None)
    values = env()
    assert run(None, values, Replay, None) == 2
    want = torch.cat([torch.ones(3), constant, torch.zeros(3)])
    assert torch.equal(values[10], want) and torch.equal(values[11], torch.stack([want, want]))
    assert template == [[None, constant, None], 0]  # the constant list is not written to
    values = env()
    values[2] = SeqError(7, "an earlier failure")
    assert run(None, values, Replay, None) == 0 and 10 not in values
    values = env()
    del values[1]
    assert run(None, values, Replay, None) == 0 and 10 not in values
