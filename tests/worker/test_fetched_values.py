"""Fetched values of any kind: what pickle takes, and what only cloudpickle takes.

A value is pickled on its lane with dask_monarch's reducers (tensors as their
bytes, on the CPU: tests/gpu/test_cuda.py checks GPU tensors deep inside one);
what pickle refuses (a lambda, a local class) goes through cloudpickle with the
same reducers.
"""

from __future__ import annotations

import pytest
import torch
from helpers.raw import S0, call, create_streams, fetch, values

import dask_monarch as dm
from dask_monarch.messages import Ref


def test_tensors_inside_custom_objects_and_beside_a_lambda_are_fetched(ctrl):
    create_streams(ctrl, [0, 1], S0)
    ctrl.send([0, 1], fetch(0, (), fn="helpers.remote_fns.holders"))
    got = values(ctrl.sync(timeout=120))
    for rank in (0, 1):
        plain, cloud = got[(0, rank)]
        assert plain.t.tolist() == [0.0, 1.0, 2.0]
        assert cloud.t.tolist() == [1.0, 1.0] and cloud.f() == 1


def test_reading_a_value_that_cannot_be_pickled_fails_the_read_not_the_mesh(ctrl):
    """``Controller.get_ref`` of an object no pickler takes (a lock): the read raises, naming
    it; the stream and the mesh carry on."""
    create_streams(ctrl, [0], S0)
    ctrl.send(0, call(0, Ref(1), "threading.Lock"))
    ctrl.send(0, call(1, Ref(2), "torch.ones", 2))
    assert ctrl.sync(timeout=60) == []
    with pytest.raises(dm.RemoteException, match=r"r1 holds a lock, which cannot be read back"):
        ctrl.get_ref(0, Ref(1), S0)
    assert torch.equal(ctrl.get_ref(0, Ref(2), S0), torch.ones(2))
