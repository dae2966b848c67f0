"""Tensors pickled as their bytes, not as ``torch.save``'s archive.

torch pickles a tensor as its storage, offset, sizes and strides, and the
storage through ``torch.save`` into a buffer: 40-60 µs to dump and 55-290 µs
to load a small tensor. Everything dask_monarch pickles that may hold a
tensor (fetched values, message batches, pickled arguments and functions)
uses :data:`REDUCERS`: a CPU storage travels as its raw bytes
(:func:`storage`: about 20 µs to dump and 13 to load), and a tensor of a
dtype torch cannot pickle at all (no typed storage class) as its storage's
bytes with its layout (:func:`raw_tensor`). Both builders check the dtype
they are given and build nothing but a tensor: the restricted loader of
workers that accept no pickled code allows them (worker/restricted.py). A
local tensor placed on a mesh needs no pickling at all: a call of
:func:`from_bytes` with its dtype, shape and bytes (:func:`contiguous_bytes`).
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

import torch


def storage(dtype: str, data: bytearray) -> torch.storage.TypedStorage:
    """A CPU storage of ``torch.<dtype>`` over ``data``: how :data:`REDUCERS` pickle one."""
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise ValueError(f"torch.{dtype} is not a dtype")
    if type(data) is not bytearray:  # torch.frombuffer wants a writable buffer
        data = bytearray(data)
    with _local():
        untyped = (
            torch.frombuffer(data, dtype=torch.uint8).untyped_storage()  # shares data, keeps it
            if data
            else torch.UntypedStorage(0)
        )
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=kind, _internal=True)


def _reduce_storage(value: torch.storage.TypedStorage) -> tuple:
    untyped = value._untyped_storage
    if untyped.device.type != "cpu":  # torch's own way (to_cpu moves fetched tensors first)
        return value.__reduce__()
    return storage, (str(value._dtype).removeprefix("torch."), _bytes_of(untyped))


def _reduce_tensor(value: torch.Tensor) -> Any:
    """torch pickles no tensor of a dtype without a typed storage class (complex32, uint16 to
    uint64, the float8s, the bits types): those travel as their storage's bytes."""
    if value.dtype not in _RAW_DTYPES or value.device.type != "cpu":
        return value.__reduce_ex__(5)
    return raw_tensor, (
        str(value.dtype).removeprefix("torch."),
        tuple(value.shape),
        value.stride(),
        value.storage_offset(),
        _bytes_of(value.untyped_storage()),
    )


def _bytes_of(untyped: torch.UntypedStorage) -> pickle.PickleBuffer:
    """Every byte of a CPU storage, without a copy."""
    with _local():
        return pickle.PickleBuffer(torch.empty(0, dtype=torch.uint8).set_(untyped).numpy())


# Plain local torch: no dispatch mode sees the tensors made here (a value is pickled or loaded
# while a mesh is active: its mode would make them mesh tensors); as client_values runs ops
_local = torch._C._DisableTorchDispatch


def raw_tensor(
    dtype: str, shape: tuple, stride: tuple, offset: int, data: bytearray
) -> torch.Tensor:
    """A CPU tensor of ``torch.<dtype>`` over the bytes of its storage (:func:`_reduce_tensor`)."""
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise ValueError(f"torch.{dtype} is not a dtype")
    if type(data) is not bytearray:
        data = bytearray(data)
    with _local():
        flat = (
            torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(kind).as_strided(shape, stride, offset)


def contiguous_bytes(value: torch.Tensor) -> bytes:
    """A copy of the bytes of CPU tensor ``value``, contiguous at offset 0, in its order."""
    n = value.numel() * value.element_size()
    return bytes(_bytes_of(value.untyped_storage()).raw()[:n]) if n else b""


def from_bytes(dtype: torch.dtype, shape: torch.Size, data: bytes) -> torch.Tensor:
    """A new CPU tensor of ``dtype`` and ``shape`` holding ``data`` (:func:`contiguous_bytes`):
    how a local tensor is placed on a mesh's ranks, one copy and no unpickling of it
    (``dask_monarch.tensor.from_client``)."""
    if type(dtype) is not torch.dtype or type(data) is not bytes:
        raise TypeError(f"from_bytes takes a torch.dtype and bytes, not {dtype!r} and {type(data)}")
    with _local():
        out = torch.empty(shape, dtype=dtype)
    if out.numel() * out.element_size() != len(data):
        raise ValueError(f"{len(data)} bytes cannot fill a {dtype} tensor of shape {list(shape)}")
    if data:
        ctypes.memmove(out.data_ptr(), data, len(data))
    return out


_RAW_DTYPES = frozenset(
    d
    for d in (
        getattr(torch, name, None)
        for name in (
            "complex32 uint16 uint32 uint64 float8_e4m3fn float8_e5m2 float8_e4m3fnuz "
            "float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2 bits1x8 bits2x4 bits4x2 bits8 "
            "bits16"
        ).split()
    )
    if isinstance(d, torch.dtype)
)
REDUCERS = {  # a pickler's dispatch table entries
    torch.storage.TypedStorage: _reduce_storage,
    torch.Tensor: _reduce_tensor,
}


def _reduce_storage_on_cpu(value: torch.storage.TypedStorage) -> tuple:
    if value._untyped_storage.device.type != "cpu":
        value = value.cpu()  # on the calling thread's stream: the lane's, after its work
    return _reduce_storage(value)


def _reduce_tensor_on_cpu(value: torch.Tensor) -> Any:
    if value.device.type != "cpu":
        value = value.detach().cpu()
    return _reduce_tensor(value)


# What a fetched value is pickled with: every tensor and storage reaches the client on the CPU,
# however deep in the value (a dataclass, a custom object), as the spec says fetched tensors
# are. Elsewhere a device is kept: a message may carry a tensor for a device on purpose.
FETCHED_REDUCERS = {
    torch.storage.TypedStorage: _reduce_storage_on_cpu,
    torch.Tensor: _reduce_tensor_on_cpu,
}
