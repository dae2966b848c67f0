"""The propagation cache's keys (pure): equal exactly when an op's outputs look the same."""

from __future__ import annotations

import torch

from dask_monarch.propagation import _key_of


def key(x):
    return _key_of(x, [])


def test_a_generator_is_keyed_by_its_device_not_its_state():
    # its state decides the values an op draws, never their shape, dtype or device: a loop
    # that draws each step's batch with one generator propagates once, not every step
    drawn, fresh = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    torch.rand(3, generator=drawn)
    assert key(drawn) == key(fresh)
    assert key(drawn) != key(torch.device("cpu"))


def test_lists_of_ints_are_their_own_keys_and_differ_from_every_other_list():
    assert key([2, 3]) == key([2, 3]) and key([2, 3]) != key([3, 2])
    assert key([2, 3]) != key((2, 3)) != key(torch.Size([2, 3]))  # the container counts
    # 1 == True == 1.0 in Python, but they promote differently: never the same key
    assert len({key([1, 2]), key([True, 2]), key([1.0, 2]), key([1, 2.0])}) == 4
    assert key([]) == key([]) and key([]) != key(())
    assert key([[1, 2]]) != key([1, 2])
