import pickle

import pytest

from dask_monarch.ndslice import Slice


def test_row_major_iterates_in_order():
    s = Slice.row_major([2, 3])
    assert list(s) == [0, 1, 2, 3, 4, 5]
    assert len(s) == 6
    assert s.strides == (3, 1)
    assert list(Slice.row_major([2, 2], offset=4)) == [4, 5, 6, 7]


def test_location_coordinates_index_get_are_inverse():
    s = Slice(1, [2, 3], [6, 2])  # ranks 1,3,5,7,9,11
    assert list(s) == [1, 3, 5, 7, 9, 11]
    for i, rank in enumerate(s):
        coords = s.coordinates(rank)
        assert s.location(coords) == rank
        assert s.index(rank) == i
        assert s.get(i) == rank


def test_strided_slice_worked_example():
    # docs/protocol.md §2.4: slice(0, [2, 3], [3, 1])
    s = Slice(0, [2, 3], [3, 1])
    assert list(s) == [0, 1, 2, 3, 4, 5]
    assert s.coordinates(4) == [1, 1]
    assert s.location([1, 2]) == 5


def test_column_slice():
    s = Slice(1, [3], [4])  # ranks 1, 5, 9 of a 3x4 grid
    assert list(s) == [1, 5, 9]
    assert s.index(9) == 2
    assert 5 in s and 4 not in s


def test_rank_outside_slice():
    s = Slice(0, [2, 2], [4, 1])  # 0, 1, 4, 5
    with pytest.raises(ValueError):
        s.coordinates(2)
    with pytest.raises(ValueError):
        s.index(3)
    with pytest.raises(ValueError):
        s.get(4)
    with pytest.raises(ValueError):
        s.location([2, 0])


@pytest.mark.parametrize(
    "offset, sizes, strides",
    [
        (0, [2, 2], [1]),  # lengths differ
        (0, [2, 2], [1, 1]),  # strides not distinct
        (0, [2, 3], [2, 1]),  # overlaps: stride 2 < span 3
        (0, [2, 2], [3, 2]),  # 3 is not a multiple of 2
        (-1, [2], [1]),
    ],
)
def test_invalid_slices_raise_value_error(offset, sizes, strides):
    with pytest.raises(ValueError):
        Slice(offset, sizes, strides)


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError):
        Slice("0", [2], [1])
    with pytest.raises(TypeError):
        Slice(0, [2.0], [1])


def test_size_one_dims_may_share_strides():
    s = Slice(3, [1, 2], [1, 1])
    assert list(s) == [3, 4]


def test_slice_pickles_and_compares_by_value():
    s = Slice(2, [2, 2], [4, 1])
    assert pickle.loads(pickle.dumps(s)) == s
    assert hash(s) == hash(Slice(2, [2, 2], [4, 1]))
    assert s != Slice.row_major([2, 2])
    assert "Slice(offset=2" in repr(s)
