"""``torch.utils.data`` inside a mesh's block (dask_monarch/local_torch.py).

A DataLoader draws its seeds with local torch (``torch.empty(()).random_().item()``):
under ``mesh.activate()`` that was a mesh tensor drawn by each rank's own generator, and
iterating any DataLoader raised "the ranks disagree". Its iteration is local torch now:
batches are local tensors, shuffled by the client's generator as in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)


class Squares(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([float(i), 1.0]) / 10
        return x, (x**2).sum(0, keepdim=True)


def _train(num_workers: int) -> tuple[list, list]:
    """Seed, model and loader as a script makes them; the order batches came in and the
    final weights."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)  # drawn by the ranks' generators under a mesh, not the client's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # the client's generator, which shuffles, from here on
    loader = DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=num_workers)
    order = []
    for _ in range(2):
        for x, y in loader:
            assert not isinstance(x, dm.Tensor) and type(x) is torch.Tensor
            order.append(x[:, 0].tolist())
            (model(x) - y).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    return order, [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shuffling_data_loader_feeds_a_mesh_as_it_feeds_one_process(mesh2, num_workers):
    want_order, want_weights = _train(num_workers)
    with mesh2.activate():
        order, weights = _train(num_workers)
        got = [dm.inspect(w) for w in weights]
    assert order == want_order  # the client's generator shuffles, seeded by torch.manual_seed
    for g, w in zip(got, want_weights):
        torch.testing.assert_close(g, w)
