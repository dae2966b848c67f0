"""Fetched values of any kind: what pickle takes, and what only cloudpickle takes.

A value is pickled on its lane with dask_monarch's reducers (tensors as their
bytes, on the CPU: tests/gpu/test_cuda.py checks GPU tensors deep inside one);
what pickle refuses (a lambda, a local class) goes through cloudpickle with the
same reducers.
"""

from __future__ import annotations

from helpers.raw import S0, create_streams, fetch, values


def test_tensors_inside_custom_objects_and_beside_a_lambda_are_fetched(ctrl):
    create_streams(ctrl, [0, 1], S0)
    ctrl.send([0, 1], fetch(0, (), fn="helpers.remote_fns.holders"))
    got = values(ctrl.sync(timeout=120))
    for rank in (0, 1):
        plain, cloud = got[(0, rank)]
        assert plain.t.tolist() == [0.0, 1.0, 2.0]
        assert cloud.t.tolist() == [1.0, 1.0] and cloud.f() == 1
