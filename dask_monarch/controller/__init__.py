"""The controller layer: seqs, refs, buffering, the compiler, reports and failure detection.

``controller`` (the raw :class:`Controller` of Monarch's protocol), ``compiler``
(a flush becomes one Dask graph), ``history`` (which values a failure poisons),
``session`` (what the user API shares per root mesh: ids, history, futures).
"""

from .controller import Controller, live_controllers

__all__ = ["Controller", "live_controllers"]
