"""The worker-side mesh (docs/protocol.md §2.4 worked examples)."""

import pytest

from dask_monarch.ndslice import Slice
from dask_monarch.worker.mesh import DeviceMesh


def test_members_of_a_strided_mesh():
    mesh = DeviceMesh(["x", "y"], Slice(0, [2, 3], [3, 1]), 1)
    assert mesh.dims["x"].members == [1, 4] and mesh.dims["x"].rank == 0
    assert mesh.dims["y"].members == [0, 1, 2] and mesh.dims["y"].rank == 1
    assert mesh.all_ranks == [0, 1, 2, 3, 4, 5]


def test_ranks_for_dims_in_a_cube():
    mesh = DeviceMesh(["x", "y", "z"], Slice.row_major([2, 2, 2]), 1)
    assert mesh.ranks_for_dims(["x"]) == [1, 5]
    assert mesh.ranks_for_dims(["y"]) == [1, 3]
    assert mesh.ranks_for_dims(["z"]) == [0, 1]
    assert mesh.ranks_for_dims(["x", "y"]) == [1, 3, 5, 7]
    assert mesh.ranks_for_dims(["y", "z"]) == [0, 1, 2, 3]
    assert mesh.ranks_for_dims(["x", "y", "z"]) == list(range(8))
    assert mesh.ranks_for_dims([]) == []


def test_python_worker_examples():
    mesh = DeviceMesh(["a", "b"], Slice(0, [3, 4], [4, 1]), 1)
    assert mesh.dims["b"].members == [0, 1, 2, 3] and mesh.dims["b"].rank == 1
    assert mesh.dims["a"].members == [1, 5, 9] and mesh.dims["a"].rank == 0
    mesh = DeviceMesh(["a", "b"], Slice(0, [3, 4], [4, 1]), 6)
    assert mesh.dims["b"].members == [4, 5, 6, 7] and mesh.dims["b"].rank == 2
    assert mesh.dims["a"].members == [2, 6, 10] and mesh.dims["a"].rank == 1


def test_rank_outside_mesh_or_wrong_names():
    with pytest.raises(ValueError):
        DeviceMesh(["x"], Slice.row_major([2]), 3)
    with pytest.raises(ValueError):
        DeviceMesh(["x", "y"], Slice.row_major([2]), 0)
