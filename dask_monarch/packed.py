"""Packed sequences on a mesh: ``nn.utils.rnn.pack_padded_sequence`` and ``pad_packed_sequence``.

A ``PackedSequence``'s ``batch_sizes`` is a CPU tensor whose memory torch's
C++ reads directly: an LSTM or GRU given a PackedSequence decomposes by it,
and so does unpacking. A mesh tensor has no memory on the client, so they
failed there with torch's internal "its data is not allocated yet". Here:

* packing makes ``batch_sizes`` on the client, a local tensor computed from
  the lengths (the client's copy of them, else an implicit fetch on which
  every rank must agree, as on any shape), and the ranks make only the packed
  data, whose shape the lengths give;
* unpacking (``torch._VF._pad_packed_sequence``, which allocates its scratch
  lengths with ``at::empty``: an active mesh would make that a mesh tensor) of
  mesh data is done with mesh ops: one ``index_copy`` of the packed rows into
  a tensor of padding, by positions the client computes from ``batch_sizes``.

An RNN then runs the packed data on the ranks, op by op, as torch decomposes it.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.utils._python_dispatch import _disable_current_modes

from .propagation import OpInfo, TensorMeta

if TYPE_CHECKING:
    from .tensor import Tensor

_PACK = torch.ops.aten._pack_padded_sequence.default
_mesh: Any = None  # dask_monarch.tensor, given to install(): this module imports none of the
# user API's modules (they import one another, and the first mesh installs this)


def pack_padded(
    func: Any, info: OpInfo, args: tuple, handles: list[Tensor], ref_args: tuple
) -> tuple[Tensor, torch.Tensor]:
    """``aten._pack_padded_sequence`` of mesh data: the data on the ranks, ``batch_sizes`` here."""
    data, lengths, batch_first = args
    if isinstance(lengths, _mesh.Tensor):
        lengths = _mesh.value_of(lengths, "pack_padded_sequence's lengths")
    with _disable_current_modes():  # torch's own checks of the lengths, and the batch sizes
        packed, batch_sizes = func(torch.empty(*data.shape[:2], 1), lengths, batch_first)
    mesh, stream = _mesh.placement(handles, func, "borrow it first")
    shape = (packed.shape[0], *data.shape[2:])
    meta = TensorMeta(shape, make_contiguous_strides_for(shape), 0, data.dtype, data.device)
    targets = [None, False]  # the ranks keep the data, not their batch_sizes
    ref, _ = _mesh.send_unplanned(mesh, stream, info, args, {}, handles, ref_args, {}, targets)
    return _mesh.Tensor(meta, mesh._session, mesh, stream, ref), batch_sizes


def pad_packed(
    data: Any, batch_sizes: Any, batch_first: bool, padding_value: float, total_length: int
) -> tuple[Any, torch.Tensor]:
    """``torch._VF._pad_packed_sequence``; mesh data is unpacked with mesh ops."""
    if not isinstance(data, _mesh.Tensor):
        return _torch_pad_packed(data, batch_sizes, batch_first, padding_value, total_length)
    if isinstance(batch_sizes, _mesh.Tensor):  # a PackedSequence built by hand on the mesh
        batch_sizes = _mesh.value_of(batch_sizes, "a PackedSequence's batch_sizes")
    with _disable_current_modes():
        steps, batch = len(batch_sizes), int(batch_sizes[0])
        filled = torch.arange(batch) < batch_sizes.unsqueeze(1)  # [step, b]: a packed row
        positions = filled.flatten().nonzero().squeeze(1)  # in packed order: step, then b
        lengths = filled.sum(0)
    rows = max(total_length, steps)
    padded = data.new_full((rows * batch, *data.shape[1:]), padding_value)
    where = _mesh.from_client(positions, data._mesh, data._stream, private=True)
    padded = padded.index_copy(0, where, data).view(rows, batch, *data.shape[1:])
    return (padded.transpose(0, 1) if batch_first else padded), lengths


_torch_pad_packed = torch._VF._pad_packed_sequence


def install(mesh_tensors: ModuleType) -> None:
    """Route packing and unpacking of mesh tensors here (idempotent); ``mesh_tensors`` is
    dask_monarch.tensor."""
    global _mesh
    _mesh = mesh_tensors
    mesh_tensors.UNPLANNED[_PACK] = pack_padded
    torch._VF._pad_packed_sequence = pad_packed  # type: ignore[attr-defined]
