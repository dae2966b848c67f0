"""Stream discipline, checked on CPU: every step runs in its lane's stream, every hand-off
between lanes records an event on the producer, waits on it on the consumer, keeps the block.

CPU ranks use worker/device.py's HostDevice, which does what the CUDA device does to streams
and events as a log; these tests read it (docs/architecture.md, "Streams and hand-offs").
"""

from __future__ import annotations

import torch
from helpers.raw import S0, S1, S2, call, create_streams, fetch, values

from dask_monarch import messages as m
from dask_monarch.messages import Factory, Ref
from dask_monarch.ndslice import Slice

BOTH = [0, 1]


def log_of(ctrl, rank, seq, stream=S0):
    """The device log of ``rank`` as seen from ``stream`` after everything sent so far."""
    ctrl.send(rank, fetch(seq, (), fn="helpers.remote_fns.device_log", stream=stream))
    return values(ctrl.sync(timeout=60))[(seq, rank)]


def handoffs(log, producer, consumer):
    """Events recorded on ``producer`` and waited on by ``consumer`` (stream names)."""
    recorded = {e[2] for e in log if e[0] == "record" and e[1] == producer}
    return {e[2] for e in log if e[0] == "wait" and e[1] == consumer and e[2] in recorded}


def test_the_first_segment_after_create_stream_runs_in_the_new_stream(ctrl):
    """CreateStream and the first ops of a stream arrive in one segment: they run in it."""
    ctrl.send(BOTH, m.CreateStream(S2, m.StreamCreationMode.CreateNewStream))
    ctrl.send(BOTH, call(0, Ref(1), "helpers.remote_fns.current_stream_name", stream=S2))
    ctrl.send(BOTH, fetch(1, Ref(1), stream=S2))
    assert values(ctrl.sync(timeout=60)) == {(1, 0): "2", (1, 1): "2"}


def test_every_step_runs_in_its_own_lanes_stream(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    for seq, stream in enumerate((S0, S1, S0, S1)):
        ctrl.send(
            BOTH, call(seq, Ref(10 + seq), "helpers.remote_fns.current_stream_name", stream=stream)
        )
    for seq, stream in enumerate((S0, S1, S0, S1)):
        ctrl.send(BOTH, fetch(4 + seq, Ref(10 + seq), stream=stream))
    got = values(ctrl.sync(timeout=60))
    assert got == {
        (4 + seq, rank): str(stream.id)
        for seq, stream in enumerate((S0, S1, S0, S1))
        for rank in BOTH
    }
    log = log_of(ctrl, 0, 8)
    assert ("stream", "1") in log and log.index(("stream", "1")) < log.index(("enter", "1"))


def test_a_borrow_hands_off_with_an_event_each_way_and_keeps_the_block(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, call(0, Ref(1), "torch.ones", 4))
    ctrl.send(BOTH, m.BorrowCreate(Ref(2), 1, Ref(1), S0, S1))
    ctrl.send(BOTH, m.BorrowFirstUse(1))
    ctrl.send(
        BOTH, call(1, None, "torch.ops.aten.mul_.Scalar", Ref(2), 3, mutates=[Ref(2)], stream=S1)
    )
    ctrl.send(BOTH, m.BorrowLastUse(1))
    ctrl.send(BOTH, m.BorrowDrop(1))
    ctrl.send(BOTH, fetch(2, Ref(1)))
    got = values(ctrl.sync(timeout=60))
    assert torch.equal(got[(2, 0)], torch.full((4,), 3.0))
    log = log_of(ctrl, 0, 3)
    assert len(handoffs(log, "0", "1")) == 1  # create -> first use
    assert len(handoffs(log, "1", "0")) == 1  # last use -> drop
    assert ("keep", "1") in log  # the borrower's stream keeps the lender's block


def test_a_send_between_two_streams_of_one_rank_hands_off(ctrl):
    create_streams(ctrl, BOTH, S0, S1)
    ctrl.send(BOTH, m.CreateDeviceMesh(Ref(100), ["gpu"], Slice.row_major([2])))
    ctrl.send(0, call(0, Ref(1), "torch.ones", 2))
    r0 = Slice(0, [1], [1])
    factory = Factory((2,), torch.float32, torch.strided, "cpu")
    ctrl.send(0, m.SendTensor(Ref(2), r0, r0, Ref(1), factory, S0, S1))
    ctrl.send(0, fetch(1, Ref(2), stream=S1))
    assert torch.equal(values(ctrl.sync(timeout=60))[(1, 0)], torch.ones(2))
    log = log_of(ctrl, 0, 2)
    assert len(handoffs(log, "0", "1")) == 1
    assert ("keep", "1") in log
