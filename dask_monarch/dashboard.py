"""``dask_monarch.dashboard``: the public path of :mod:`dask_monarch.observability.dashboard`."""

import sys

from .observability import dashboard as _module

sys.modules[__name__] = _module
