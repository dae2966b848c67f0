"""The propagation cache's keys (pure): equal exactly when an op's outputs look the same."""

from __future__ import annotations

import torch

from dask_monarch.borrows import StorageInfo
from dask_monarch.propagation import _key, _key_of, op_info

aten = torch.ops.aten


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


def test_a_float_is_keyed_by_its_value_unless_the_op_is_pointwise_or_foreach():
    # a learning rate or a bias correction changes every step: an elementwise op's outputs
    # look the same for any float, a shape-making op's (arange) do not; ints and the float
    # type itself still count (pow(t, -1) of integers raises, 2 and 2.0 promote differently)
    for op in (aten.mul.Tensor, aten.addcdiv_.default, aten._foreach_add_.ScalarList):
        info = op_info(op)
        assert _key(info, (0.1, [0.5, 0.25]), {}, []) == _key(info, (0.2, [1.5, 0.75]), {}, [])
        assert _key(info, (2,), {}, []) != _key(info, (-1,), {}, []) != _key(info, (2.0,), {}, [])
    arange = op_info(aten.arange.start_step)
    assert _key(arange, (0.0, 1.5, 0.5), {}, []) != _key(arange, (0.0, 2.0, 0.5), {}, [])


class _Handle:
    """What a key reads of a mesh tensor: its metadata key and its storage."""

    def __init__(self, storage: StorageInfo) -> None:
        self._mkey, self._storage = "meta", storage


def test_many_tensors_name_the_first_sharing_their_storage_as_a_few_do():
    # a fused optimizer step names five tensors per parameter: found by a dict, not a scan
    # per tensor (quadratic), with the same answer as the scan
    for count in (3, 40):
        storages = [StorageInfo() for _ in range(count)]
        handles = [_Handle(s) for s in storages]
        alias = _Handle(storages[1])  # a view of the second tensor, named last
        handles.append(alias)
        stranger = _Handle(StorageInfo())  # in a nested list: not among the handles
        _, key, _ = _key(op_info(aten.add.Tensor), (handles[0], alias, [[stranger]]), {}, handles)
        assert key[:2] == (("meta", 0), ("meta", 1))
        assert key[2] == (list, ((list, (("meta", -1),)),))
