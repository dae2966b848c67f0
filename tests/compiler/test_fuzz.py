"""Random raw-protocol sequences end in results or a clear error; none hangs (issue 13).

The generator is tests/compiler/fuzz.py; benchmarks/fuzz.py runs thousands.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import pytest
import torch

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.compiler import Compiler
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef
from dask_monarch.ndslice import Slice

sys.path.insert(0, str(Path(__file__).parent))  # fuzz.py sits here (also when imported by path)
import fuzz  # noqa: E402

# also run with dask_monarch.comm.emulate-nccl (tests/conftest.py)
pytestmark = pytest.mark.nccl_rules

S0, S1 = StreamRef(0), StreamRef(1)

SEED = 20_000  # the suite's seeds: SEED, SEED + 1, ...


def test_valid_sequences_are_never_refused_and_mutated_ones_mostly_are():
    """On the compiler alone, for many sequences: a valid one (its per-rank orders come from
    one program order) cannot deadlock, so the check must let it through up to its final wait."""
    kinds: collections.Counter = collections.Counter()
    for seed in range(SEED, SEED + 400):
        sequence = fuzz.generate(seed)
        compiler = Compiler("tok", ["r0", "r1"])
        buffer: list = []
        error = None
        for action in [*sequence.actions, "final"]:
            if action in (fuzz.FLUSH, "final"):
                error = compiler.compile(buffer, final=action == "final").error
                buffer = []
                if error is not None:
                    break
            else:
                buffer.append(action)
        assert not (sequence.valid and error), f"seed {seed} ({sequence.pieces}): {error}"
        kinds[sequence.valid, error is not None] += 1
    assert kinds[True, False] > 100 and kinds[False, True] > 50, kinds


@pytest.fixture(scope="module")
def fuzz_client(throwaway_cluster):
    """A throw-away cluster: the sequences break controllers on purpose."""
    with throwaway_cluster(2, config={"dask_monarch.timeouts.collective": "15s"}) as (_, client):
        yield client


@pytest.mark.timeout(900)
def test_random_sequences_end_in_results_or_a_clear_error(fuzz_client):
    kinds: collections.Counter = collections.Counter()
    for seed in range(SEED, SEED + 30):
        sequence = fuzz.generate(seed)
        outcome = fuzz.run(fuzz_client, sequence, bound=90)
        kinds[outcome.kind] += 1
        assert outcome.kind != "hang", f"seed {seed} hung: {outcome.error}"
        assert not (sequence.valid and outcome.kind == "refused"), (
            f"seed {seed} is valid but was refused: {outcome.error}"
        )
        if outcome.kind != "ok":
            assert outcome.error and "rank" in outcome.error  # it names the rank
        # a broken controller's lane may sit in a collective until its timeout; let it end
        # (best effort: a task Dask cancelled under a lane may hold its slot for good, which
        # the next check shows only if it costs the workers their use)
        fuzz.quiesce(fuzz_client, timeout=30)
    assert kinds["ok"] and kinds["refused"], kinds
    assert fuzz.healthy(fuzz_client)  # the workers stay usable


# ------------------------------------------------------------------ what the fuzzer found


def _call(seq, result, fn, *args, stream=S0):
    return m.CallFunction(seq, [result], [], fn, ArgsKwargs.from_python(args, {}), stream, [])


def _streams(ctrl, ranks=(0, 1)):
    ctrl.send(ranks, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
    ctrl.send(ranks, m.CreateStream(S1, m.StreamCreationMode.CreateNewStream))


def _lend_and_return(ctrl, bid, result, tensor, lender, borrower, slow=0.0):
    ctrl.send(0, m.BorrowCreate(result, bid, tensor, lender, borrower))
    ctrl.send(0, m.BorrowFirstUse(bid))
    ctrl.send(0, m.BorrowLastUse(bid))
    if slow:  # the lender is still busy when the borrower moves on
        ctrl.send(0, _call(2, None, "time.sleep", slow, stream=lender))
    ctrl.send(0, m.BorrowDrop(bid))


@pytest.mark.timeout(180)
def test_a_borrow_id_used_again_before_its_drop_ran_is_refused(fuzz_client):
    """The rank keys borrows by id: the second borrow's first use met the first borrow's
    channel (already popped by its drop) and waited forever ("ran 0 of 1 segments")."""
    ctrl = dm.Controller(fuzz_client, world_size=2)
    try:
        _streams(ctrl, (0,))
        ctrl.send(0, _call(0, Ref(1), "torch.ones", 2))
        ctrl.send(0, _call(1, Ref(2), "torch.zeros", 2, stream=S1))
        _lend_and_return(ctrl, 1, Ref(3), Ref(1), S0, S1, slow=0.5)
        _lend_and_return(ctrl, 1, Ref(4), Ref(2), S1, S0)
        start = time.monotonic()
        with pytest.raises(
            dm.DeviceException, match="whose earlier BorrowDrop on stream 0 may not have run yet"
        ) as info:
            ctrl.sync(timeout=20)
        assert info.value.rank == 0 and time.monotonic() - start < 15
    finally:
        ctrl.close()
    with dm.Controller(fuzz_client, world_size=2) as ctrl:  # after a sync the id may return
        _streams(ctrl, (0,))
        ctrl.send(0, _call(0, Ref(1), "torch.ones", 2))
        ctrl.send(0, _call(1, Ref(2), "torch.zeros", 2, stream=S1))
        _lend_and_return(ctrl, 1, Ref(3), Ref(1), S0, S1)
        ctrl.sync(timeout=60)
        _lend_and_return(ctrl, 1, Ref(4), Ref(2), S1, S0)
        ctrl.sync(timeout=60)


@pytest.mark.timeout(180)
def test_exit_does_not_hold_the_control_steps_before_it(fuzz_client):
    """Seed 4005737: rank 0 got a Reduce, then a BackendNetworkPointToPointInit and Exit; rank 1
    the init before its Reduce. Exit's drain (every lane) was put on the control segment that
    also held the init, so rank 0's init waited for its Reduce, which waited for rank 1's,
    which follows rank 1's init, which waits for rank 0's: a hang until the collective
    timeout that the pre-dispatch check (rightly) does not see."""
    mesh = Ref(9)
    factory = m.Factory((2,), torch.float32, torch.strided, "cpu")
    reduce = m.Reduce(
        Ref(2), Ref(1), factory, mesh, S0, ["gpu"], m.ReduceOp.SUM, False, False, None
    )
    ctrl = dm.Controller(fuzz_client, world_size=2)
    try:
        both = (0, 1)
        ctrl.send(both, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
        ctrl.send(both, m.CreateDeviceMesh(mesh, ["gpu"], Slice(0, [2], [1])))
        ctrl.send(both, m.BackendNetworkInit())
        ctrl.send(both, m.SplitComm(["gpu"], mesh, S0))
        ctrl.send(both, _call(0, Ref(1), "torch.ones", 2))
        ctrl.send(1, m.BackendNetworkPointToPointInit(S0, S0))
        ctrl.send(1, reduce)
        ctrl.send(1, m.Exit())
        ctrl.send(0, reduce)
        ctrl.send(0, m.BackendNetworkPointToPointInit(S0, S0))
        ctrl.send(0, m.Exit())
        ctrl.sync(timeout=60)  # before: DeviceException, the Reduce timed out after 15 s
    finally:
        ctrl.close()
