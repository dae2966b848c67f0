"""``nn.utils.rnn``'s packed sequences of mesh tensors (dask_monarch/packed.py).

A PackedSequence's ``batch_sizes`` is a CPU tensor that torch's C++ reads directly (an
LSTM or GRU given a PackedSequence, and unpacking): as a mesh tensor it failed with
torch's internal "its data is not allocated yet". An RNN over packed sequences now
trains on a mesh as it does locally.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)

LENGTHS = [3, 5, 2]  # unsorted: pack_padded_sequence sorts them (enforce_sorted=False)


class Tagger(nn.Module):
    """What NLP code does with an RNN over padded sentences of different lengths."""

    def __init__(self, cell: type[nn.RNNBase]):
        super().__init__()
        self.rnn = cell(4, 3, batch_first=True)
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        hidden, _ = self.rnn(packed)
        padded, got_lengths = pad_packed_sequence(hidden, batch_first=True, total_length=6)
        return self.out(padded), got_lengths


def _train(tagger: nn.Module, x: torch.Tensor) -> list:
    optimizer = torch.optim.SGD(tagger.parameters(), lr=0.1)
    outputs = []
    for _ in range(2):
        y, lengths = tagger(x, LENGTHS)
        y.pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs += [y.detach(), lengths]
    return outputs + [p.detach() for p in tagger.parameters()]


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_an_rnn_over_packed_sequences_trains_on_the_mesh_as_it_does_locally(mesh2, cell):
    torch.manual_seed(0)
    local = Tagger(cell)
    init = {k: v.clone() for k, v in local.state_dict().items()}
    x = torch.randn(3, 6, 4)
    want = _train(local, x)
    with mesh2.activate():
        tagger = Tagger(cell)
        tagger.load_state_dict(init)  # local tensors copied into the mesh parameters
        got = [dm.inspect(v) if isinstance(v, dm.Tensor) else v for v in _train(tagger, x)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_packing_mesh_lengths_and_unpacking_give_what_torch_gives(mesh2):
    x = torch.randn(3, 5, 2)
    lengths = torch.tensor([5, 3, 1])
    want_packed = pack_padded_sequence(x, lengths, batch_first=True)
    want, want_lengths = pad_packed_sequence(want_packed, batch_first=False)
    with mesh2.activate():
        packed = pack_padded_sequence(dm.put(x), dm.put(lengths), batch_first=True)
        assert isinstance(packed.data, dm.Tensor)
        assert not isinstance(packed.batch_sizes, dm.Tensor)  # torch's C++ reads it
        assert torch.equal(packed.batch_sizes, want_packed.batch_sizes)
        padded, got_lengths = pad_packed_sequence(packed, batch_first=False)
        got = dm.inspect(padded)
    torch.testing.assert_close(dm.inspect(packed.data), want_packed.data)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_lengths, want_lengths)


def test_unsorted_local_lengths_pack_mesh_sequences(mesh2):
    """Lengths come from a DataLoader or a tokenizer as local tensors, unsorted: torch's
    ``invert_permutation`` scatters ``torch.arange(n)`` (a mesh tensor under the mesh, which
    the client knows) into a local tensor, which was refused as a write of a value computed
    on the ranks (found by a probe of evaluation loops)."""
    x = torch.randn(3, 5, 2)
    lengths = torch.tensor([3, 5, 1])
    want = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    with mesh2.activate():
        packed = pack_padded_sequence(dm.put(x), lengths, batch_first=True, enforce_sorted=False)
        assert type(packed.unsorted_indices) is torch.Tensor  # local, as the lengths
        data = dm.inspect(packed.data)
    torch.testing.assert_close(data, want.data)
    assert torch.equal(packed.unsorted_indices, want.unsorted_indices)
