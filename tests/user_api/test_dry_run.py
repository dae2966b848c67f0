"""``dm.dry_run``: a program runs on the client alone, against fake tensors.

No task reaches the scheduler and no rank runs a message; the report gives
per rank the peak tensor bytes, the messages and the bytes of each collective
and send; shape, mesh and protocol errors are raised inside the block; a
fetch fails with DryRunError; the mesh comes out usable, and what the block
made fails clearly if used later.
"""

from __future__ import annotations

import gc
import time
import traceback

import pytest
import torch

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.controller.dry import DryController, DryRunError
from dask_monarch.protocol.ndslice import Slice

pytestmark = pytest.mark.timeout(300)

MiB = 1 << 20


def scheduler_counts(client) -> tuple[int, int]:
    def counts(dask_scheduler=None):
        return dask_scheduler.transition_counter, len(dask_scheduler.tasks)

    return client.run_on_scheduler(counts)


def rank_messages(client, token: str) -> dict[int, int]:
    def messages(dask_worker=None):
        plugin = dask_worker.plugins["dask_monarch"]
        return [(s["rank"], s["messages"]) for s in plugin.state_snapshot() if s["token"] == token]

    return dict(pair for pairs in client.run(messages).values() for pair in pairs)


def program(mesh):
    """128 KiB tensors, a borrow, an all-reduce, a send from rank 0 to rank 1."""
    comms = dm.Stream("comms")
    with mesh.activate():
        a = torch.zeros(32 * 1024)  # 128 KiB
        b = a + 1  # 128 KiB
        del a  # its delete waits for the next batch of deletes, as in a real run
        borrowed, borrow = comms.borrow(b)  # no new memory
        with comms.activate():
            total = borrowed.reduce("gpu", "sum")  # 128 KiB
        borrow.drop()
        moved = b.slice_mesh(gpu=0).to_mesh(mesh.slice(gpu=1))  # 128 KiB on rank 1
    return b, total, moved


def test_nothing_reaches_the_scheduler_or_a_rank(mesh2, client2):
    with mesh2.activate():
        torch.ones(3)  # the mesh is set up and has run something
    dm.inspect(mesh2.rank("gpu"))
    controller = mesh2._session.controller
    gc.collect()
    mesh2._session.flush_pending()  # the deletes of the garbage above go now, not at the entry
    controller.sync()
    deadline = time.monotonic() + 30  # the last tail future goes once its report arrived
    while scheduler_counts(client2)[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    before = (scheduler_counts(client2), rank_messages(client2, controller.token))
    sent = controller.messages_sent, controller.flushes
    with dm.dry_run(mesh2) as run:
        assert isinstance(mesh2._session.controller, DryController)
        program(mesh2)
    assert mesh2._session.controller is controller
    assert (controller.messages_sent, controller.flushes) == sent
    assert scheduler_counts(client2) == before[0]
    assert rank_messages(client2, controller.token) == before[1]
    assert run.messages > 0


def test_report_gives_peak_memory_messages_and_collective_and_send_bytes(mesh2):
    with dm.dry_run(mesh2) as run:
        b, total, moved = program(mesh2)
        del b, total, moved
        gc.collect()  # the borrow and its handles form a cycle
    ranks = run.ranks
    assert set(ranks) == {0, 1}
    # a (its delete is batched), b and the all-reduce's result; rank 1 also gets the copy
    assert ranks[0].peak_tensor_bytes == 3 * 128 * 1024
    assert ranks[1].peak_tensor_bytes == 4 * 128 * 1024
    assert ranks[0].tensor_bytes == ranks[1].tensor_bytes == 0  # all deleted at the end
    assert ranks[0].messages > 5 and ranks[1].messages >= ranks[0].messages - 2
    (reduce,) = run.collectives
    assert (reduce.kind, reduce.reduction, reduce.dims) == ("all-reduce", "sum", ("gpu",))
    assert reduce.ranks == (0, 1) and reduce.bytes == 128 * 1024
    assert ranks[0].collective_bytes == ranks[1].collective_bytes == 128 * 1024
    (send,) = run.sends
    assert send.pairs == [(0, 1)] and send.bytes == 128 * 1024
    assert (ranks[0].sent_bytes, ranks[1].received_bytes) == (128 * 1024, 128 * 1024)
    text = run.report()
    assert "all-reduce (sum) over ['gpu'] of ranks [0, 1]" in text
    assert "send float32[32768] 0->1: 128.0 KiB each" in text
    assert "384.0 KiB" in text and "512.0 KiB" in text


def test_deleted_tensors_free_their_bytes(mesh2):
    with dm.dry_run(mesh2) as run:
        with mesh2.activate():
            for _ in range(10):
                t = torch.ones(4 * MiB)  # 16 MiB, dropped each round
                t.drop()
    # deletes go out in batches of 64 MiB of handles (session.DELETE_BYTES), as in a real run
    assert 64 * MiB <= run.ranks[0].peak_tensor_bytes <= 80 * MiB
    assert run.ranks[0].tensor_bytes == 0


def test_shape_and_mesh_errors_are_raised_inside_the_block(mesh2, client2):
    controller = mesh2._session.controller
    sent = controller.messages_sent
    with pytest.raises(RuntimeError, match="broadcast"):
        with dm.dry_run(mesh2):
            with mesh2.activate():
                torch.ones(3) + torch.ones(4)
    other = dm.device_mesh(client2, gpu=2)
    try:
        with pytest.raises(TypeError, match="WRONG_MESH") as info:
            with dm.dry_run(mesh2):
                with mesh2.activate():
                    x = torch.ones(3)
                with other.activate():
                    y = torch.ones(3)
                x + y
        assert controller.mesh_id in str(info.value)  # the same id as outside the dry run
    finally:
        other.exit()
    assert controller.messages_sent == sent


def _reduce_rank_1_never_gets(mesh) -> None:
    """Send rank 0 its part of a reduce over both ranks, and rank 1 nothing."""
    with mesh.activate():
        t = torch.ones(3)
    session = mesh._session
    stream = session.stream_ref(dm.get_active_stream())
    mesh_ref = session.mesh_ref(("gpu",), Slice.row_major([2]))
    session.ensure_split(mesh_ref, stream, ("gpu",))
    factory = m.Factory((3,), torch.float32, torch.strided, "cpu")
    reduce = m.Reduce(
        session.new_ref(), t._ref, factory, mesh_ref, stream, ["gpu"], m.ReduceOp.SUM,
        False, False, None,
    )  # fmt: skip
    session.send((0,), reduce)


def test_protocol_errors_are_raised_before_anything_runs(mesh2):
    """A collective one member never receives: the pre-dispatch check refuses it."""
    controller = mesh2._session.controller
    sent = controller.messages_sent
    with pytest.raises(dm.DeviceException, match="rank 1") as info:
        with dm.dry_run(mesh2):
            _reduce_rank_1_never_gets(mesh2)
    assert "never" in str(info.value) or "wait" in str(info.value)
    assert controller.messages_sent == sent
    assert controller.broken is None  # the real mesh is fine
    with mesh2.activate():
        assert dm.inspect(torch.ones(2) * 2).tolist() == [2.0, 2.0]


def _first_site(dry: DryController) -> None:
    dry.sync()


def _second_site(dry: DryController) -> None:
    dry.sync()


def test_each_raise_of_a_broken_dry_run_has_its_own_traceback(mesh2):
    """A broken dry run raised its one DeviceException object again on every call: each
    raise added its frames to the traceback of every earlier one (as the real controller
    did before it raised fresh copies)."""
    errors = []
    with pytest.raises(dm.DeviceException, match="rank 1"):
        with dm.dry_run(mesh2):
            _reduce_rank_1_never_gets(mesh2)
            dry = mesh2._session.controller
            assert isinstance(dry, DryController)
            for site in (_first_site, _second_site, _second_site):
                with pytest.raises(dm.DeviceException) as info:
                    site(dry)
                errors.append(info.value)
    assert len({id(e) for e in errors}) == 3 and len({str(e) for e in errors}) == 1
    frames = ["".join(traceback.format_tb(e.__traceback__)) for e in errors]
    assert "_first_site" in frames[0] and "_second_site" not in frames[0]
    assert "_second_site" in frames[1] and "_first_site" not in frames[1]
    assert len({len(traceback.extract_tb(e.__traceback__)) for e in errors[1:]}) == 1


def test_a_fetch_inside_fails_clearly_and_the_mesh_comes_out_usable(mesh2):
    with mesh2.activate():
        before = torch.arange(4.0)
    with dm.dry_run(mesh2) as run:
        with mesh2.activate():
            made = before * 2
            with pytest.raises(DryRunError, match="nothing runs in a dry run"):
                dm.inspect(made)
            before.add_(100)  # never runs
            mesh2.exit()  # ends nothing
    assert run.exited
    with mesh2.activate():
        assert dm.inspect(before).tolist() == [0.0, 1.0, 2.0, 3.0]
        assert dm.inspect(before + 1).tolist() == [1.0, 2.0, 3.0, 4.0]
        with pytest.raises(DryRunError, match="made inside a dask_monarch.dry_run"):
            dm.inspect(made)
        side = dm.Stream("after")
        with side.activate():
            assert dm.inspect(torch.ones(2)).tolist() == [1.0, 1.0]


def test_a_dry_run_costs_a_normal_run_nothing():
    from dask_monarch.tensor import Tensor

    assert "_counting_new" not in repr(Tensor.__dict__["__new__"])


def test_a_remote_function_with_propagate_runs_in_a_dry_run(mesh2):
    """Its result check (the step saying what the call returns) is counted, not sent."""
    double = dm.remote("torch.mul", propagate=lambda x, k: x)
    with dm.dry_run(mesh2) as run, mesh2.activate():
        y = double(torch.ones(4), 2)
        assert y.shape == (4,)
    assert all(figures.messages > 0 for figures in run.ranks.values())


def test_ddp_hooks_train_in_a_dry_run(mesh2):
    """Backward with ``dm.ddp_hooks`` runs dry: its bucket's all-reduce is in the report, and
    the hooks' flush-when-idle leaves the dry messages buffered."""
    with mesh2.activate():
        model = torch.nn.Linear(4, 2)
        hooks = dm.ddp_hooks(model, "gpu", stream=dm.Stream("dry-ddp"))
    with dm.dry_run(mesh2) as run, mesh2.activate():
        model(torch.ones(3, 4)).sum().backward()
        assert model.weight.grad.shape == (2, 4)
    hooks.remove()
    (reduce,) = run.collectives
    assert (reduce.kind, reduce.reduction, reduce.dims) == ("all-reduce", "avg", ("gpu",))
    assert reduce.bytes == 10 * 4  # the flat bucket: weight and bias


def test_a_function_compiled_before_a_dry_run_runs_in_it_and_after(mesh2):
    """Its recording on the ranks names streams the dry run does not know: inside, it is traced
    for the dry run (checked and counted like the eager code), and outside it replays its own
    recording again. One compiled first inside is traced anew after."""

    @dm.compile
    def step(x):
        return (x * 2 + 1).reduce("gpu", "sum")

    @dm.compile
    def first_inside(x):
        return x + 1

    with mesh2.activate():
        x = torch.ones(2)
        y = step(step(x))  # traced, then replayed
        with dm.dry_run(mesh2) as run:
            z = step(step(x))  # a replay of the recording from before, then of the dry run's
            w = first_inside(z)
            assert w.shape == (2,)
        assert all(figures.messages > 0 for figures in run.ranks.values())
        assert dm.inspect(step(y)).tolist() == [106.0, 106.0]
        assert dm.inspect(first_inside(y)).tolist() == [27.0, 27.0]


def test_the_collectives_and_sends_of_a_compiled_function_count_at_each_replay(mesh2):
    """They travel inside the recording, not as messages of their own: each replay counts
    them, once each with the ranks that run them, as the eager calls would be counted."""

    @dm.compile
    def step(x):
        total = (x * 2).reduce("gpu", "sum")
        moved = total.slice_mesh(gpu=0).to_mesh(mesh2.slice(gpu=1))
        return total, moved

    with dm.dry_run(mesh2) as run, mesh2.activate():
        x = torch.ones(4)
        step(x)  # traced and replayed
        step(x)  # replayed
    assert [(c.kind, c.ranks, c.bytes) for c in run.collectives] == [("all-reduce", (0, 1), 16)] * 2
    assert [(s.pairs, s.bytes) for s in run.sends] == [([(0, 1)], 16)] * 2
    assert [f.collective_bytes for f in run.ranks.values()] == [32, 32]
    assert (run.ranks[0].sent_bytes, run.ranks[1].received_bytes) == (32, 32)


def _figures(mesh, fn, kept: dict, keep: bool) -> list[tuple[int, int]]:
    """(peak, at the end) tensor bytes per rank of three calls of ``fn`` on a 1 MiB tensor,
    with their results and what ``fn`` keeps in ``kept`` held at the end (``keep``) or
    dropped."""
    with dm.dry_run(mesh) as run, mesh.activate():
        x = torch.ones(MiB // 4)
        outs = [fn(x) for _ in range(3)]
        if not keep:
            del x, outs
            kept.clear()
            gc.collect()
    kept.clear()
    return [(f.peak_tensor_bytes, f.tensor_bytes) for f in run.ranks.values()]


def test_a_compiled_function_counts_what_the_eager_code_holds(mesh2):
    """The handles a trace makes (formals, intermediates) are the recording's own: the ranks
    hold none of them outside a replay, which frees its intermediates itself. The dry run was
    never told they were gone, so its figures stayed above the eager code's for good."""
    kept: dict = {}

    def step(x):
        y = x * 2
        z = y + 1
        kept["last"] = z * 0  # made inside and held outside: each replay rebinds it
        return z * 3

    compiled = dm.compile(step)
    for keep in (True, False):
        eager = _figures(mesh2, step, kept, keep)
        traced = _figures(mesh2, compiled, kept, keep)
        # x, three results and the kept tensor, or nothing
        assert [end for _, end in eager] == [5 * MiB if keep else 0] * 2
        assert [end for _, end in traced] == [end for _, end in eager], (keep, traced, eager)
        assert all(t <= e for (t, _), (e, _) in zip(traced, eager)), (keep, traced, eager)


def test_views_cost_a_dry_run_no_message_as_they_cost_a_real_one(mesh2):
    """Views send no message (lazy views); the dry run sent each one, and predicted a
    transformers GPT-2 step's messages 1.6x too many. A view it must send still counts."""

    def counted(program) -> int:
        with dm.dry_run(mesh2) as run, mesh2.activate():
            kept = program()  # alive at the block's end, as a step's outputs are
        del kept
        return run.messages

    def plain():
        x = torch.randn(2, 3)  # a value only the ranks know (the client sends a view of its own)
        return x * 2

    def viewed():
        x = torch.randn(2, 3)
        return (x.t().t() * 2).unsqueeze(0).squeeze(0)

    def sent():
        x = torch.randn(2, 3)
        v = x.t()
        dm.reduce(v, "gpu", "sum")  # a collective names the view's own ref: it is sent
        return v

    assert counted(viewed) == counted(plain)
    assert counted(sent) > counted(plain)
