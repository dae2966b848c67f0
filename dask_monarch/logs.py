"""``dask_monarch.logs``: the public path of :mod:`dask_monarch.observability.logs`."""

import sys

from .observability import logs as _module

sys.modules[__name__] = _module
