"""A rank's cost per CallFunction beyond the op itself, measured in one process (no cluster).

    python benchmarks/worker_calls.py [--n 20000] [--repeat 5]

Runs typical messages of a training step through the worker's handler table
on a lane of a rank made in this process (the rank never reports: nothing
fails), and the same torch operator called directly with its arguments ready.
Prints microseconds per message of thread CPU time (``time.thread_time``, so
other processes on the machine count less than in wall time): handler, bare
op, and the difference, which is what dask_monarch adds per message on a lane
(resolving the function and the Refs, binding the result; not the unpickling
of the segment, nor Dask's per-segment work). Minimum over the repeats.
"""

from __future__ import annotations

import argparse
import gc
import time
import types
from collections.abc import Callable

import torch

from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, FunctionPath, Ref, StreamRef
from dask_monarch.worker.dispatch import HANDLERS
from dask_monarch.worker.rank import RankState

RESULT = 100


def _call(path: str, args: tuple, kwargs: dict | None = None) -> m.CallFunction:
    return m.CallFunction(
        7,
        [Ref(RESULT)],
        [],
        FunctionPath(path),
        ArgsKwargs.from_python(args, kwargs or {}),
        StreamRef(1),
        [],
    )


def _rank() -> RankState:
    """A rank in this process: its plugin only needs an event loop, which nothing here uses."""
    loop = types.SimpleNamespace(add_callback=lambda *args: None)
    plugin = types.SimpleNamespace(worker=types.SimpleNamespace(loop=loop))
    return RankState(plugin, "benchmark", 0, 1, None, {})


def _time(fn: Callable[[], object], n: int) -> float:
    start = time.thread_time_ns()
    for _ in range(n):
        fn()
    return (time.thread_time_ns() - start) / n / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="messages per measurement")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rank = _rank()
    lane = rank.add_lane(1, m.StreamCreationMode.UseDefaultStream)
    rank.meshes[999] = object()  # a mesh, as every rank of a user mesh holds one
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    lane.env.update({1: x, 2: y})
    aten = torch.ops.aten
    cases = {
        "t(x)": (_call("torch.ops.aten.t.default", (Ref(1),)), lambda: aten.t.default._op(x)),
        "add(x, y, alpha=0.5)": (
            _call("torch.ops.aten.add.Tensor", (Ref(1), Ref(2)), {"alpha": 0.5}),
            lambda: aten.add.Tensor._op(x, y, alpha=0.5),
        ),
        "view(x, [32, 16])": (
            _call("torch.ops.aten.view.default", (Ref(1), [32, 16])),
            lambda: aten.view.default._op(x, [32, 16]),
        ),
        "cat([x, y])": (
            _call("torch.ops.aten.cat.default", ([Ref(1), Ref(2)],)),
            lambda: aten.cat.default._op([x, y]),
        ),
    }
    handler, env = HANDLERS[m.CallFunction], lane.env

    print(f"per message, thread CPU, min of {args.repeat} x {args.n} (torch {torch.__version__})")
    print(f"  {'message':<22}{'handler us':>11}{'bare op us':>11}{'added us':>10}")
    gc.disable()  # a collection landing in one measurement only would decide the minimum
    try:
        for name, (msg, bare) in cases.items():

            def through_handler(msg=msg):
                handler(lane, msg)
                del env[RESULT]

            rounds = [
                (_time(through_handler, args.n), _time(bare, args.n)) for _ in range(args.repeat)
            ]
            handled = min(h for h, _ in rounds)
            direct = min(b for _, b in rounds)
            print(f"  {name:<22}{handled:>11.2f}{direct:>11.2f}{handled - direct:>10.2f}")
    finally:
        gc.enable()
    assert rank.failed is None, rank.failed


if __name__ == "__main__":
    main()
