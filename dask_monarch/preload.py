"""``dask_monarch.preload``: the public path of :mod:`dask_monarch.deployment.preload`."""

import sys

from .deployment import preload as _module

sys.modules[__name__] = _module
