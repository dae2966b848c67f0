"""``dask_monarch.ndslice``: slices of global ranks, at their public path.

The same objects as :mod:`dask_monarch.protocol.ndslice`.
"""

from .protocol.ndslice import Slice

__all__ = ["Slice"]
