"""The controller layer: seqs, refs, buffering, the compiler, reports and failure detection.

``controller`` (the raw :class:`Controller` of Monarch's protocol: send, flush,
sync, failure), ``placement`` (which workers become ranks, and what is set up on
them), ``reports`` (what the ranks report, on one stream each), ``watch`` (a client
that lost its scheduler or its futures fails the controller), ``routing`` (which
lane of each rank runs a message), ``precheck`` (what would hang or mismatch across
ranks is refused before dispatch), ``compiler`` (a flush becomes one Dask
graph), ``history`` (which values a failure poisons) and
``session`` (what the user API shares per root mesh: ids, history, futures).
"""

from .controller import Controller, live_controllers

__all__ = ["Controller", "live_controllers"]
