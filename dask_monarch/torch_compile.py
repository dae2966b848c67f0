"""``torch.compile`` on mesh tensors: Dynamo must not trace dask_monarch's own code.

Code that users already have compiles its model or loss with ``torch.compile``
and may call it on mesh tensors. Dynamo traces every Python frame the call
reaches that is not on its skip list, dask_monarch's dispatch of each op
included: it then runs the propagation's fake tensors under its own tracing
and fails with an internal ``AssertionError`` ("Please convert all Tensors to
FakeTensors first"). With dask_monarch's files on Dynamo's skip list, an op
on a mesh tensor is a call that Dynamo does not trace (a graph break): it is
sent to the ranks op by op, as eager code is, with the same values. To have a
step recorded once and replayed as one message per rank, ``dm.compile`` it.

Importing Dynamo costs more than a second, so it is not imported for this:
when it is already imported the skip is added at once, otherwise as soon as
it is (a one-shot import hook).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

_RULES = "torch._dynamo.trace_rules"  # where Dynamo keeps the directories it does not trace


def skip_in_dynamo() -> None:
    """Put dask_monarch's files on Dynamo's skip list, now or when Dynamo is imported (once
    per process: every mesh made calls this)."""
    rules = sys.modules.get(_RULES)
    if rules is not None:
        _skip(rules)
    elif not any(type(f) is _WhenImported for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())


_skipped: list[ModuleType] = []  # the trace rules module given our files, once


def _skip(rules: ModuleType) -> None:
    if rules in _skipped:
        return
    try:
        rules.add(__package__)
        _skipped.append(rules)
    except Exception as e:  # another torch, whose internals moved: compiled code may then fail
        logger.warning("could not keep torch.compile out of dask_monarch's code: %r", e)


class _WhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when Dynamo's trace rules are imported, adds the skip after
    their module ran, then leaves ``sys.meta_path``."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _RULES:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def run_then_skip(module: Any) -> None:
            run(module)
            _skip(module)

        spec.loader.exec_module = run_then_skip  # type: ignore[method-assign]
        return spec
