"""``dask_monarch.ndslice``: the public path of :mod:`dask_monarch.protocol.ndslice`."""

import sys

from .protocol import ndslice as _module

sys.modules[__name__] = _module
