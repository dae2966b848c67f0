"""N-dimensional slices of global ranks (Monarch's ``ndslice::Slice``).

A slice is ``offset + sum(coord[i] * strides[i])`` over the coordinates
``0 <= coord[i] < sizes[i]``; iteration is row-major over ``sizes``. Every
rank set in a message is a slice of *global* worker ranks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import prod
from typing import Any


def _as_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"Slice {name} must be a sequence of ints, got {values!r}")
    out = tuple(values)
    for v in out:
        if type(v) is not int:
            raise TypeError(f"Slice {name} must hold ints, got {v!r} in {values!r}")
        if v < 0:
            raise ValueError(f"Slice {name} must be non-negative, got {values!r}")
    return out


class Slice:
    """A rectangular, non-overlapping set of ranks: ``Slice(offset, sizes, strides)``."""

    __slots__ = ("offset", "sizes", "strides")

    def __init__(self, offset: int, sizes: Sequence[int], strides: Sequence[int]) -> None:
        if type(offset) is not int:
            raise TypeError(f"Slice offset must be an int, got {offset!r}")
        if offset < 0:
            raise ValueError(f"Slice offset must be non-negative, got {offset}")
        sizes = _as_ints("sizes", sizes)
        strides = _as_ints("strides", strides)
        if len(sizes) != len(strides):
            raise ValueError(
                f"Slice sizes {list(sizes)} and strides {list(strides)} differ in length"
            )
        _check_layout(sizes, strides)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "strides", strides)

    @classmethod
    def row_major(cls, sizes: Sequence[int], offset: int = 0) -> Slice:
        """The dense slice of ``sizes`` laid out row-major from ``offset``."""
        sizes = _as_ints("sizes", sizes)
        strides, step = [], 1
        for size in reversed(sizes):
            strides.append(step)
            step *= max(size, 1)
        return cls(offset, sizes, strides[::-1])

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Slice is immutable")

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def __len__(self) -> int:
        return prod(self.sizes)

    def __iter__(self) -> Iterator[int]:
        for i in range(len(self)):
            yield self.get(i)

    def __contains__(self, rank: object) -> bool:
        try:
            self.coordinates(rank)  # type: ignore[arg-type]
        except (ValueError, TypeError):
            return False
        return True

    def location(self, coords: Sequence[int]) -> int:
        """The rank at ``coords``."""
        coords = tuple(coords)
        if len(coords) != self.ndim:
            raise ValueError(f"expected {self.ndim} coordinates for {self!r}, got {list(coords)}")
        for c, size in zip(coords, self.sizes):
            if type(c) is not int or not 0 <= c < size:
                raise ValueError(f"coordinates {list(coords)} are outside {self!r}")
        return self.offset + sum(c * s for c, s in zip(coords, self.strides))

    def coordinates(self, rank: int) -> list[int]:
        """The coordinates of ``rank``; ValueError if it is not in the slice."""
        if type(rank) is not int:
            raise TypeError(f"rank must be an int, got {rank!r}")
        rest = rank - self.offset
        coords = [0] * self.ndim
        if rest >= 0:
            order = sorted(range(self.ndim), key=lambda d: self.strides[d], reverse=True)
            for d in order:
                if self.sizes[d] <= 1 or self.strides[d] == 0:
                    continue
                c = rest // self.strides[d]
                if c >= self.sizes[d]:
                    break
                coords[d] = c
                rest -= c * self.strides[d]
        if rest != 0 or len(self) == 0:
            raise ValueError(f"rank {rank} is not in {self!r}")
        return coords

    def index(self, rank: int) -> int:
        """Row-major position of ``rank`` in iteration order."""
        pos = 0
        for c, size in zip(self.coordinates(rank), self.sizes):
            pos = pos * size + c
        return pos

    def get(self, index: int) -> int:
        """The rank at row-major position ``index``."""
        if type(index) is not int or not 0 <= index < len(self):
            raise ValueError(f"index {index!r} is outside {self!r} of {len(self)} ranks")
        coords = []
        for size in reversed(self.sizes):
            index, c = divmod(index, size)
            coords.append(c)
        return self.offset + sum(c * s for c, s in zip(reversed(coords), self.strides))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Slice):
            return NotImplemented
        return (self.offset, self.sizes, self.strides) == (other.offset, other.sizes, other.strides)

    def __hash__(self) -> int:
        return hash((self.offset, self.sizes, self.strides))

    def __repr__(self) -> str:
        sizes, strides = list(self.sizes), list(self.strides)
        return f"Slice(offset={self.offset}, sizes={sizes}, strides={strides})"

    def __reduce__(self) -> tuple:
        return (Slice, (self.offset, list(self.sizes), list(self.strides)))


def _check_layout(sizes: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """Dims with more than one element must nest: distinct strides, each a
    multiple of the next smaller one and at least that dim's span."""
    dims = sorted((stride, size) for size, stride in zip(sizes, strides) if size > 1)
    span = 1
    prev_stride = None
    for stride, size in dims:
        if stride == 0:
            raise ValueError(f"Slice strides {list(strides)} repeat ranks (stride 0)")
        if prev_stride is not None:
            if stride == prev_stride:
                raise ValueError(f"Slice strides {list(strides)} are not distinct")
            if stride % prev_stride:
                raise ValueError(
                    f"Slice stride {stride} is not a multiple of stride {prev_stride} "
                    f"in {list(strides)}"
                )
        if stride < span:
            raise ValueError(
                f"Slice with sizes {list(sizes)} and strides {list(strides)} overlaps itself"
            )
        span = stride * size
        prev_stride = stride
