"""``dask_monarch.messages``: the public path of :mod:`dask_monarch.protocol.messages`."""

import sys

from .protocol import messages as _module

sys.modules[__name__] = _module
