"""``dask_monarch.span``: label the work issued in a block as a ``distributed`` span.

Built on :func:`distributed.span`: the segments issued inside carry its
annotation, so the dashboard's span views, the scheduler's span records and
fine performance metrics group by it, and their task names carry its label
(``monarch_ops-forward``: a colour of its own in the task stream, and a Dask
task group per span, which distributed's spans need: a group belongs to the
span it first met). Entering and leaving flush every live mesh of this
process, so a segment never straddles a span boundary; the flushes cost a
task per rank and lane, so spans suit phases (forward, backward, the
optimizer step), not single ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import dask
import distributed

from .controller.controller import working_controllers
from .protocol.names import span_label


@contextlib.contextmanager
def span(name: str) -> Iterator[str]:
    """Label the work every mesh of this process issues inside the block as span ``name``.

    Nested spans nest (``("train", "forward")``), as :func:`distributed.span`'s
    do; yields the span's id (the scheduler's ``extensions["spans"].spans``
    key).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"span(name): name must be a non-empty str, got {name!r}")
    controllers = working_controllers()
    _flush(controllers)  # what came before is not in the span
    with distributed.span(name) as span_id:
        annotation = dask.get_annotations()["span"]
        previous = [c.span for c in controllers]
        label = span_label("-".join(annotation["name"]), span_id)
        for controller in controllers:
            controller.span = (annotation, label)
        try:
            yield span_id
        finally:
            _flush(controllers)  # what came inside is in it
            for controller, before in zip(controllers, previous):
                controller.span = before


def _flush(controllers: list) -> None:
    for controller in controllers:
        if controller.broken is None and not controller.closed:
            with contextlib.suppress(Exception):  # a broken mesh raises at its next use
                controller.flush()
