"""``dm.random`` on a 2-rank mesh: forks, new states, per-stream generators (Monarch's
``monarch.random``; docs/user_guide.md, random numbers)."""

from __future__ import annotations

import pytest
import torch

import dask_monarch as dm

pytestmark = pytest.mark.timeout(180)


def _local(seed: int, *shapes: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n, generator=g) for n in shapes]


def test_new_state_is_a_seed_s_state_without_touching_the_generators(mesh2):
    with mesh2.activate():
        dm.random.manual_seed(1)
        a = torch.rand(3)
        fresh = dm.random.new_state(7)  # the generators in use go on as if nothing happened
        b = torch.rand(3)
        dm.random.set_state(fresh)
        c = torch.rand(3)
        got = [dm.inspect((a, b, c), gpu=r) for r in range(2)]
        state = dm.inspect(fresh, gpu=1)
    cpu_bytes = torch.get_rng_state().numel()  # a CPU generator's (under a mesh: the ranks')
    a1, b1 = _local(1, 3, 3)
    (c7,) = _local(7, 3)
    for a_, b_, c_ in got:
        assert torch.equal(a_, a1) and torch.equal(b_, b1) and torch.equal(c_, c7)
    assert torch.equal(state[:cpu_bytes], torch.Generator().manual_seed(7).get_state())
    assert state[cpu_bytes] == 0  # CPU ranks: no CUDA part


def test_fork_rng_restores_the_generators_on_the_way_out(mesh2):
    with mesh2.activate():
        dm.random.manual_seed(3)
        with dm.random.fork_rng():
            inside = torch.rand(4)
        after = torch.rand(4)
        with dm.random.fork_rng(dm.random.new_state(9)):
            seeded = torch.rand(2)
        last = torch.rand(4)
        got = dm.inspect((inside, after, seeded, last), gpu=1)
    first, second = _local(3, 4, 4)
    (nine,) = _local(9, 2)
    assert torch.equal(got[0], first) and torch.equal(got[1], first)
    assert torch.equal(got[2], nine) and torch.equal(got[3], second)


def test_a_stream_with_its_own_generator_draws_independently(mesh2):
    data = dm.Stream("rng_data")
    with mesh2.activate():
        dm.random.manual_seed(0)
        dm.random.seed_stream(5, data)
        main_first = torch.rand(3)
        with data.activate():
            own = [torch.rand(3), torch.randn(2, 2), torch.empty(4).uniform_()]
            fork = dm.random.get_state()
            again = torch.rand(3)
            dm.random.set_state(fork)
            replay = torch.rand(3)
            drawn = dm.inspect([*own, again, replay], gpu=1)
        main_second = torch.rand(3)  # main's default generator never saw data's draws
        mains = dm.inspect((main_first, main_second), gpu=0)
    g = torch.Generator().manual_seed(5)
    expected = [torch.rand(3, generator=g), torch.randn(2, 2, generator=g)]
    expected.append(torch.empty(4).uniform_(generator=g))
    expected.append(torch.rand(3, generator=g))
    for got, want in zip(drawn, expected):
        assert torch.equal(got, want)
    assert torch.equal(drawn[4], drawn[3])  # get_state/set_state act on the stream's generator
    assert all(torch.equal(x, y) for x, y in zip(mains, _local(0, 3, 3)))


def test_seeding_a_stream_again_reseeds_its_generator(mesh2):
    data = dm.Stream("rng_reseed")
    with mesh2.activate(), data.activate():
        dm.random.seed_stream(11)
        first = torch.rand(2)
        dm.random.manual_seed(11)  # under the stream: its own generator
        second = torch.rand(2)
        dm.random.seed_stream(11)
        third = torch.rand(2)
        got = dm.inspect((first, second, third), gpu=1)
    (want,) = _local(11, 2)
    assert all(torch.equal(x, want) for x in got)


def test_make_deterministic_sets_each_rank_and_can_be_undone(mesh2):
    now = dm.remote("dask_monarch.random._deterministic_now", propagate="inspect")
    with mesh2.activate():
        try:
            dm.random.make_deterministic()
            assert now.call_on_shard_and_fetch(shard={"gpu": 1}) is True
        finally:
            dm.random.make_deterministic(False)  # the workers are shared with other tests
        assert now.call_on_shard_and_fetch(shard={"gpu": 1}) is False


def test_torch_use_deterministic_algorithms_under_a_mesh_sets_the_ranks_too(mesh2):
    """Lightning's Trainer(deterministic=True) calls it: only the client was set, and a GPU
    mesh would run its nondeterministic kernels, silently."""
    now = dm.remote("dask_monarch.random._deterministic_now", propagate="inspect")
    with mesh2.activate():
        try:
            torch.use_deterministic_algorithms(True)
            assert torch.are_deterministic_algorithms_enabled()
            assert now.call_on_shard_and_fetch(shard={"gpu": 1}) is True
        finally:
            torch.use_deterministic_algorithms(False)  # the workers are shared with other tests
        assert now.call_on_shard_and_fetch(shard={"gpu": 0}) is False
    assert not torch.are_deterministic_algorithms_enabled()


def test_random_needs_a_mesh_and_an_int_seed(mesh2):
    with pytest.raises(RuntimeError, match="active mesh"):
        dm.random.new_state(1)
    with mesh2.activate():
        with pytest.raises(TypeError, match="seed must be an int"):
            dm.random.seed_stream(1.5)
        with pytest.raises(TypeError, match="seed must be an int"):
            dm.random.new_state(True)


def test_torch_manual_seed_under_a_mesh_seeds_the_ranks_too(mesh2):
    from torch import nn

    torch.manual_seed(0)
    want_draw, want = torch.rand(3), nn.Linear(3, 2)
    with mesh2.activate():
        torch.random.manual_seed(5)  # transformers' set_seed, model code seeding itself
        before = torch.rand(3)
        assert torch.manual_seed(0) is torch.default_generator  # torch's own result
        draw, model = torch.rand(3), nn.Linear(3, 2)
    # the client's generator is seeded too, as before (the mesh's draws are the ranks')
    assert torch.equal(torch.rand(3), want_draw)
    (five,) = _local(5, 3)
    for rank in range(2):
        assert torch.equal(dm.inspect(before, gpu=rank), five)
        assert torch.equal(dm.inspect(draw, gpu=rank), want_draw)
        assert torch.equal(dm.inspect(model.weight.detach(), gpu=rank), want.weight.detach())


def test_checkpointed_dropout_replays_its_masks_through_torch_s_rng_state(mesh2):
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    def run(reentrant: bool) -> tuple:
        torch.manual_seed(0)
        lin = nn.Linear(8, 8)
        x = torch.arange(16.0).reshape(2, 8).requires_grad_()
        # recomputed in backward from the RNG state torch.get_rng_state() gave in forward
        y = checkpoint(lambda t: nn.functional.dropout(lin(t), 0.5), x, use_reentrant=reentrant)
        y.sum().backward()
        with torch.random.fork_rng():  # restores the generators on the way out
            torch.rand(3)
        return y.detach(), x.grad, lin.weight.grad, torch.rand(3)

    for reentrant in (False, True):
        want = run(reentrant)
        with mesh2.activate():
            got = run(reentrant)
        for rank in range(2):
            assert all(torch.equal(a, b) for a, b in zip(dm.inspect(got, gpu=rank), want))


def _drawn_with_a_generator() -> tuple[list[torch.Tensor], torch.Tensor]:
    """What diffusers and nn.init draw from a generator of the caller's, in one program."""
    g = torch.Generator().manual_seed(5)
    out = [torch.randn(3, generator=g), torch.randint(0, 10, (4,), generator=g)]
    t = torch.zeros(2, 3)
    t.normal_(generator=g)  # into a mesh tensor under a mesh
    strided = torch.empty(4, 4).t()
    strided.uniform_(generator=g)  # its draws land in its own element order
    out += [t, strided, torch.randn_like(t, generator=g)]
    out.append(torch.multinomial(torch.tensor([0.1, 0.5, 0.4]), 2, generator=g))
    w = torch.empty(3, 5)
    torch.nn.init.kaiming_uniform_(w, generator=g)
    out += [w, torch.randperm(6, generator=g), torch.randn(3, generator=g)]
    return out, g.get_state()


def test_a_generator_of_the_clients_draws_what_it_draws_locally_and_advances(mesh2):
    """A client torch.Generator went to the ranks by value and never advanced: every flush
    drew the same numbers again (a diffusers sampling loop got the same noise each step)."""
    want, want_state = _drawn_with_a_generator()
    with mesh2.activate():
        drawn, state = _drawn_with_a_generator()
        assert all(isinstance(t, dm.Tensor) for t in drawn)
        on_ranks = [dm.inspect(drawn, gpu=r) for r in range(2)]
        g = torch.Generator().manual_seed(9)
        first = dm.inspect(torch.randn(3, generator=g))  # a flush between two draws
        second = dm.inspect(torch.randn(3, generator=g))
    for got in on_ranks:
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(state, want_state)
    local = torch.Generator().manual_seed(9)
    assert torch.equal(first, torch.randn(3, generator=local))
    assert torch.equal(second, torch.randn(3, generator=local))


def test_a_generator_of_the_clients_is_refused_inside_a_compiled_function(mesh2):
    g = torch.Generator().manual_seed(0)

    @dm.compile
    def noisy(x):
        return x + torch.randn(3, generator=g)

    with mesh2.activate():
        with pytest.raises(NotImplementedError, match="traced, and replayed unchanged"):
            noisy(torch.zeros(3))


def test_a_loader_with_its_own_generator_shuffles_and_drops_out_as_in_one_process(mesh2):
    """The user guide's recipe (random numbers, "Two generators"): the loader's draws come
    from its own generator, the model's from the ranks' seeded by torch.manual_seed."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(8))

    def program() -> tuple:
        torch.manual_seed(0)
        init = torch.randn(3)
        loader = DataLoader(
            data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
        )
        order = torch.cat([batch[0] for batch in loader])
        return init, order, torch.nn.functional.dropout(torch.ones(8), 0.5)

    want = program()
    with mesh2.activate():
        got = [dm.inspect(t) if isinstance(t, dm.Tensor) else t for t in program()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_local_state_sets_the_ranks_and_the_client_and_a_fetched_one_restores(mesh2):
    """A resumed run's checkpoint holds a local state: one process's (torch.get_rng_state()
    there) or a mesh's, fetched. torch.set_rng_state of a local state set only the client's
    generator, and the ranks' dropout silently drew other masks; a fetched mesh state was
    refused by both setters."""
    with dm.no_mesh.activate():
        torch.manual_seed(0)
        one_process = torch.get_rng_state()
        want = torch.rand(3)
    with mesh2.activate():
        torch.manual_seed(123)
        torch.set_rng_state(one_process)
        drawn = torch.rand(3)
        ranks = [dm.inspect(drawn, gpu=r) for r in range(2)]
        with dm.no_mesh.activate():
            client = torch.rand(3)
        fetched = dm.inspect(torch.get_rng_state())
        first = dm.inspect(torch.rand(3))
        torch.set_rng_state(fetched)
        again = dm.inspect(torch.rand(3))
        dm.random.set_state(fetched)
        once_more = dm.inspect(torch.rand(3))
        with dm.no_mesh.activate():
            wrong = torch.zeros(3, dtype=torch.uint8)
        with pytest.raises(TypeError, match="set_state takes a state"):
            dm.random.set_state(wrong)
    assert all(torch.equal(r, want) for r in ranks) and torch.equal(client, want)
    assert torch.equal(again, first) and torch.equal(once_more, first)
