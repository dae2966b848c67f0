"""``dask_monarch.messages``: the worker protocol's messages, at their public path.

The same objects as :mod:`dask_monarch.protocol.messages`, where they are
defined next to the rest of the protocol (api.md §1).
"""

from .protocol.messages import *  # noqa: F403  (its __all__: every message and value type)
from .protocol.messages import (
    __all__,  # noqa: F401
    memory_format,  # noqa: F401  (how batches name a memory format)
)
