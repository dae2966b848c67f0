"""Short builders for raw protocol messages in tests (``from helpers.raw import call, ...``)."""

from __future__ import annotations

from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef

S0, S1, S2, S3 = (StreamRef(i) for i in range(4))


def call(seq, results, fn, *args, mutates=(), stream=S0, groups=(), **kwargs):
    """CallFunction of ``fn`` (a path or callable); ``results`` a Ref, None or a list."""
    if results is None or isinstance(results, Ref):
        results = [results]
    return m.CallFunction(
        seq,
        list(results),
        list(mutates),
        fn,
        ArgsKwargs.from_python(args, kwargs),
        stream,
        list(groups),
    )


def fetch(seq, value, stream=S0, fn=None, mutates=(), **kwargs):
    """SendValue of ``value`` (a ref or args tuple) to the controller."""
    args = value if isinstance(value, tuple) else (value,)
    return m.SendValue(seq, None, list(mutates), fn, ArgsKwargs.from_python(args, kwargs), stream)


def create_streams(ctrl, ranks, *streams):
    modes = m.StreamCreationMode
    for i, s in enumerate(streams):
        mode = modes.UseDefaultStream if i == 0 else modes.CreateNewStream
        ctrl.send(ranks, m.CreateStream(s, mode))


def values(messages, kind=m.FetchResult):
    """{(seq, rank): value} of the FetchResults (or other kind) in ``messages``."""
    return {(x.seq, x.rank): getattr(x, "value", x) for x in messages if type(x) is kind}


def failures(messages):
    return [x for x in messages if type(x) is m.RemoteFunctionFailed]


def mixes_on_two_streams(ctrl, ranks, n):
    """Streams S0 and S1 on ``ranks``, ``n`` dependent in-place ``mix_`` calls on each (on
    refs 10 and 11), flushed every 37 rounds and left to the idle timer now and then (many
    segments per lane, chained across flushes), then fetches of both (seqs 1000 and 1001)."""
    import time

    import torch

    create_streams(ctrl, ranks, S0, S1)
    for stream in (S0, S1):
        ctrl.send(
            ranks, call(0, Ref(10 + stream.id), "torch.zeros", 1, dtype=torch.int64, stream=stream)
        )
    for i in range(n):
        for stream, offset in ((S0, 0), (S1, 7)):
            x = Ref(10 + stream.id)
            mixed = call(
                1 + i, None, "helpers.remote_fns.mix_", x, i + offset, mutates=[x], stream=stream
            )
            ctrl.send(ranks, mixed)
        if i % 37 == 0:
            ctrl.flush()
        if i % 101 == 0:
            time.sleep(0.01)  # let the idle timer flush too
    ctrl.send(ranks, fetch(1000, Ref(10), stream=S0))
    ctrl.send(ranks, fetch(1001, Ref(11), stream=S1))
