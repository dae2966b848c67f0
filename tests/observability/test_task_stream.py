"""The task stream tells the story: task names say what ran, dm.span labels phases.

After a small data-parallel training loop, the scheduler's task groups and
spans are read back: each phase issued under ``dm.span`` is a ``distributed``
span holding its own task groups (``monarch_ops-forward``, ...), fine
performance metrics are attributed to it, and without a span the segments are
named after what dominates them (ops, reduce, fetch).
"""

from __future__ import annotations

import pytest
import torch
from helpers.waiting import wait_until

import dask_monarch as dm

pytestmark = pytest.mark.timeout(300)


def _scheduler_view(dask_scheduler=None) -> dict:
    """Per span of the scheduler: its name, its task groups' prefixes and names, and the
    task prefixes its fine performance metrics name."""
    spans = dask_scheduler.extensions["spans"].spans
    return {
        span_id: {
            "name": span.name,
            "prefixes": sorted({tg.prefix.name for tg in span.groups}),
            "groups": sorted(tg.name for tg in span.groups),
            "metrics": sorted(
                {
                    k[1]
                    for k in span.cumulative_worker_metrics
                    if k[0] == "execute" and str(k[1]).startswith("monarch_")
                }
            ),
        }
        for span_id, span in spans.items()
    }


def test_training_loop_shows_spans_and_named_task_groups(client2, mesh2):
    steps, ids = 3, {"forward": [], "backward": [], "optimizer": []}
    with mesh2.activate():
        dm.random.manual_seed(0)
        w = torch.rand(4, 1)
        for _ in range(steps):
            x = torch.rand(8, 4)
            with dm.span("forward") as span_id:
                w.requires_grad_(True)
                loss = ((x @ w) ** 2).mean()
            ids["forward"].append(span_id)
            with dm.span("backward") as span_id:
                (grad,) = torch.autograd.grad(loss, [w])
                grad = grad.reduce("gpu", "avg")
            ids["backward"].append(span_id)
            with dm.span("optimizer") as span_id:
                w = (w.detach() - 0.1 * grad).detach()
            ids["optimizer"].append(span_id)
            assert dm.inspect(loss).numel() == 1  # outside any span: a fetch segment
        # no span: named after what dominates
        total = w.reduce("gpu", "sum")
        dm.inspect(total)
    # fine performance metrics reach the scheduler with the workers' heartbeats: wait for one

    def with_metrics() -> dict | None:
        view = client2.run_on_scheduler(_scheduler_view)
        return view if any(view[i]["metrics"] for i in ids["forward"]) else None

    view = wait_until(with_metrics, 30, "a heartbeat with the forward spans' metrics", every=0.2)
    for name, span_ids in ids.items():
        assert len(set(span_ids)) == steps  # a span per phase and step
        for span_id in span_ids:
            span = view[span_id]
            assert span["name"] == (name,), span
            assert span["prefixes"], span  # the span holds its own task groups ...
            label = name.capitalize() if name == "backward" else name  # see names.span_label
            assert all(p.endswith(f"-{label}") for p in span["prefixes"]), span
            assert all(span_id[:8] in g for g in span["groups"]), span  # ... a group per span
    forward = view[ids["forward"][0]]
    assert forward["prefixes"] == ["monarch_ops-forward"], forward  # ops: compute
    backward = view[ids["backward"][0]]
    assert "monarch_reduce-Backward" in backward["prefixes"], backward  # communication
    # fine performance metrics are attributed to the spans, by task prefix
    assert any(view[i]["metrics"] for i in ids["forward"]), [view[i] for i in ids["forward"]]
    metrics = {p for i in ids["forward"] for p in view[i]["metrics"]}
    assert metrics <= {"monarch_ops-forward"}, metrics
    prefixes = {p for v in view.values() for p in v["prefixes"]}
    assert {"monarch_fetch", "monarch_reduce"} <= prefixes, prefixes  # outside any span
    assert "monarch_segment" not in prefixes, prefixes
