"""The controller layer: seqs, refs, buffering, the compiler, reports and failure detection.

Modules, in the order a message meets them:

* ``session``: what the user API shares per root mesh (ids, history, futures,
  captures, the substitution of a dry run); ``seam``: what it calls on a
  controller (``ControllerSeam``); ``history``: which values a failure poisons;
  ``futures``: ``MeshFuture``; ``gather``: ``dm.gather``;
* ``controller``: the raw :class:`Controller` of Monarch's protocol (send,
  flush, sync, failure); ``placement``: which workers become ranks and what is
  set up on them;
* ``routing``: which lane of each rank runs a message; ``precheck``: what would
  hang or mismatch across ranks is refused before dispatch; ``compiler``: a
  flush becomes one Dask graph; ``intake``: the scheduler makes its tasks;
  ``release`` and ``bookkeeping``: what Dask keeps of them once they ran;
* ``reports``: what the ranks report, on one stream each; ``liveness``: the
  heartbeat and stuck lanes; ``watch``: a client that lost its scheduler or its
  futures fails the controller; ``debugging``: ranks paused in pdb;
  ``cancel``: ``mesh.exit(cancel=True)``, and what it stopped;
* ``dry``: the controller that runs nothing (``dm.dry_run``).
"""

from .controller import Controller, live_controllers

__all__ = ["Controller", "live_controllers"]
