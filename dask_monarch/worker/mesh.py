"""The worker-side device mesh (docs/protocol.md §2.4): what UDFs see for a mesh ref."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from ..protocol.ndslice import Slice


@dataclass(frozen=True)
class MeshDim:
    """One dimension as seen from this rank: its coordinate, size and the ranks along it."""

    name: str
    rank: int
    size: int
    members: list[int]


class DeviceMesh:
    """Named dimensions over a slice of global ranks, seen from ``own_rank``."""

    def __init__(self, names: list[str], ranks: Slice, own_rank: int):
        if len(names) != ranks.ndim:
            raise ValueError(f"mesh names {names} do not match the {ranks.ndim} dims of {ranks!r}")
        if own_rank not in ranks:
            raise ValueError(f"rank {own_rank} is not in mesh {ranks!r}")
        self.names = list(names)
        self.slice = ranks
        self.own_rank = own_rank
        coords = ranks.coordinates(own_rank)
        self.dims = {
            name: MeshDim(
                name, c, size, [own_rank - stride * c + stride * i for i in range(size)]
            )
            for name, c, size, stride in zip(names, coords, ranks.sizes, ranks.strides)
        }
        self.all_ranks = list(ranks)

    def ranks_for_dims(self, names: list[str] | tuple[str, ...]) -> list[int]:
        """Ranks varying along ``names`` (row-major in that order), others held at ours."""
        if not names:
            return []
        if len(names) == 1:
            return list(self.dims[names[0]].members)
        base = self.own_rank - sum(
            self.dims[n].rank * self._stride(n) for n in names
        )
        sizes = [self.dims[n].size for n in names]
        strides = [self._stride(n) for n in names]
        return [base + sum(c * s for c, s in zip(cs, strides))
                for cs in product(*map(range, sizes))]

    def _stride(self, name: str) -> int:
        return self.slice.strides[self.names.index(name)]

    def coordinate(self, name: str) -> int:
        return self.dims[name].rank

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={d.size}" for n, d in self.dims.items())
        return f"DeviceMesh({dims}, rank={self.own_rank})"
