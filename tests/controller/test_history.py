"""The dependency history (docs/protocol.md §4.2), as pure bookkeeping."""

from dask_monarch.controller.history import History


def test_failure_poisons_transitive_users_only():
    # Monarch's "failure_propagation": 0 defines r0; 1 uses r0 defines r1; 2 uses r1;
    # 3 independent; 4 uses r1 -> failing 1 poisons 2 and 4, not 0 or 3
    h = History()
    h.invoke(0, [], [100])
    h.invoke(1, [100], [101])
    h.invoke(2, [101], [102])
    h.invoke(3, [], [103])
    h.invoke(4, [101, 103], [104])
    boom = RuntimeError("boom")
    assert sorted(h.fail(1, boom)) == [1, 2, 4]
    assert h.failure(0) is None and h.failure(3) is None
    assert h.failure(2) is boom and h.failure(4) is boom
    # later users of failed defs are born failed; independent ones are not
    assert h.invoke(5, [102], [105]) is boom
    assert h.invoke(6, [103], [106]) is None


def test_eager_failures_in_a_chain():
    # nodes 0->1->2->3 chained, 4 independent; failures at 0 and 3
    h = History()
    for seq in range(4):
        h.invoke(seq, [100 + seq - 1] if seq else [], [100 + seq])
    h.invoke(4, [], [104])
    first, second = RuntimeError("first"), RuntimeError("second")
    assert sorted(h.fail(0, first)) == [0, 1, 2, 3]
    assert h.fail(3, second) == []  # already failed: the root stays the first failure
    assert h.failure(3) is first
    h.complete(5)
    assert [h.failure(s) is not None for s in range(5)] == [True] * 4 + [False]


def test_completed_invocations_are_pruned_but_failures_kept():
    h = History()
    h.invoke(0, [], [1])
    h.invoke(1, [1], [2])
    h.fail(1, RuntimeError("x"))
    h.complete(2)
    assert 0 not in h.invocations and 1 in h.invocations
    assert h.failure_of_ref(1) is None and h.failure_of_ref(2) is not None
    assert h.invoke(2, [2], [3]) is not None  # a late user still fails


def test_a_redefinition_replaces_the_definer():
    h = History()
    h.invoke(0, [], [1])
    h.invoke(1, [1], [1])  # in place: 1 redefines ref 1
    h.fail(0, RuntimeError("old"))
    assert h.failure_of_ref(1) is not None  # 1 used 0's value, so it failed too
    h2 = History()
    h2.invoke(0, [], [1])
    h2.complete(1)
    h2.invoke(1, [], [1])
    h2.fail(1, RuntimeError("new"))
    assert str(h2.failure_of_ref(1)) == "new"


def test_dropped_refs_are_forgotten():
    h = History()
    h.invoke(0, [], [1])
    h.fail(0, RuntimeError("x"))
    h.drop([1])
    assert h.invoke(1, [1], [2]) is None


def test_a_definer_used_many_times_keeps_its_users_in_an_untracked_array():
    # a tensor made once and used in every op of a loop gets a user per op until a Status
    # completes its definer: the users are appended in O(1) (a tuple was copied on each use,
    # 50 us per op at 10 000 uses), the garbage collector visits none of them (it walks a list
    # element by element), and all fail with it
    import gc

    h = History()
    h.invoke(0, [], [1])
    for seq in range(1, 20_001):
        h.invoke(seq, [1], [1000 + seq])
    users = h.invocations[0].users
    assert len(users) == 20_000 and gc.get_referents(users) == [type(users)]
    assert len(h.fail(0, RuntimeError("x"))) == 20_001
    assert h.invocations[0].users == ()


def test_a_chain_of_messages_keeps_no_container_of_its_own_per_message():
    # thousands of invocations wait for a Status; each container they hold is a young object the
    # garbage collector walks until they go: one def and one user are kept as ints, and the
    # origin is one tuple per site in the user's code (user_frame)
    import gc

    from dask_monarch.controller.session import user_frame

    def issue_site() -> tuple:
        return user_frame()

    origins = {id(issue_site()) for _ in range(3)}
    assert len(origins) == 1
    origin = issue_site()
    h = History()
    h.invoke(0, [], [1], origin)
    for seq in range(1, 101):
        h.invoke(seq, [seq], [seq + 1], origin)
    for inv in h.invocations.values():
        held = [x for x in gc.get_referents(inv) if x is not origin and x is not type(inv)]
        assert not any(gc.is_tracked(x) for x in held), inv
    assert len(h.fail(0, RuntimeError("x"))) == 101
    assert str(h.failure_of_ref(101)) == "x"
    h2 = History()
    h2.invoke(0, [], [1, 2])
    h2.invoke(1, [1], [3])
    h2.invoke(2, [1, 2], [4])
    h2.complete(1)
    assert 1 not in h2.definer and 2 not in h2.definer and h2.definer == {3: 1, 4: 2}
