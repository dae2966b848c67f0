"""``coalescing()``: buffer a block's messages, send one CommandGroup per rank.

Semantics: docs/protocol.md §1.9.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .controller.session import Capture
from .protocol import messages as m
from .tensor import active_mesh

if TYPE_CHECKING:
    from .mesh import DeviceMesh


@contextlib.contextmanager
def coalescing(mesh: DeviceMesh | None = None) -> Iterator[None]:
    """Inside the block, messages are held back; at its end each rank gets one CommandGroup.

    Fetching inside the block is refused (``RuntimeError``): nothing of it has run yet.
    """
    mesh = mesh or active_mesh()
    if mesh is None:
        raise RuntimeError("coalescing() needs an active mesh (or mesh=)")
    session = mesh._session
    if session.capture is not None:  # nested: the outer block sends everything
        yield
        return
    session.send_views()
    capture = session.capture = Capture("coalescing")
    try:
        yield
    finally:
        session.capture = None
        by_rank: dict[int, list] = defaultdict(list)
        for ranks, message in capture.messages:
            for rank in ranks:
                by_rank[rank].append(message)
        with session.lock:  # straight to the controller: deletes queued meanwhile go after
            for rank in sorted(by_rank):
                session.controller.send((rank,), m.CommandGroup(by_rank[rank]))
