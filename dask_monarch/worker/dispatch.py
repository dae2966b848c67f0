"""The worker's handler table: which function runs each message type on a lane.

Every handler takes ``(lane, message)``: the lane it runs on (a stream's lane,
or the rank's control lane for worker-level messages) and the message. The
rank-wide state is ``lane.rank``. Handlers run on the lane's thread, in
message order for that lane; their docstrings state blocking and error
behaviour. Adding a message is one class, one handler and one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..protocol import messages as m
from ..protocol.wire import ActorCall, DropLane, ExpectResults, ReadRef, StatusProbe
from . import actor, borrow, comm, handlers, pipe, recording
from .errors import FatalError
from .lane import Lane

Handler = Callable[[Lane, Any], None]


def handle(lane: Lane, message: Any) -> None:
    """Run one message on ``lane`` (used for nested messages: groups, recordings)."""
    try:
        handler = HANDLERS[type(message)]
    except KeyError:
        raise FatalError(f"no handler for {type(message).__name__}") from None
    handler(lane, message)


def command_group(lane: Lane, msg: m.CommandGroup) -> None:
    """Handle each message in order; the first fatal error stops the rest.

    Semantics: docs/protocol.md §3.4.
    """
    for message in msg.messages:
        handle(lane, message)


HANDLERS: dict[type, Handler] = {
    # calls, fetches, refs, streams, meshes, status, exit
    m.CallFunction: handlers.call_function,
    ExpectResults: handlers.expect_results,
    m.SendValue: handlers.send_value,
    m.DeleteRefs: recording.delete_refs,
    m.CreateStream: handlers.create_stream,
    DropLane: handlers.drop_lane,
    StatusProbe: handlers.status_probe,
    m.SetRefUnitTestsOnly: handlers.set_ref,
    m.GetRefUnitTestsOnly: handlers.read_ref,
    ReadRef: handlers.read_ref,
    m.CommandGroup: command_group,
    m.CreateDeviceMesh: handlers.create_device_mesh,
    m.Exit: handlers.exit_,
    # borrows
    m.BorrowCreate: borrow.borrow_create,
    m.BorrowFirstUse: borrow.borrow_first_use,
    m.BorrowLastUse: borrow.borrow_last_use,
    m.BorrowDrop: borrow.borrow_drop,
    # communicators and collectives
    m.BackendNetworkInit: comm.backend_network_init,
    m.SplitComm: comm.split_comm,
    m.BackendNetworkPointToPointInit: comm.point_to_point_init,
    m.CreateRemoteProcessGroup: comm.create_remote_process_group,
    m.SplitCommForProcessGroup: comm.split_comm_for_process_group,
    m.Reduce: comm.reduce,
    m.SendTensor: comm.send_tensor,
    # recordings
    m.DefineRecording: recording.define_recording,
    m.RecordingFormal: recording.outside_recording,
    m.RecordingResult: recording.outside_recording,
    m.CallRecording: recording.call_recording,
    # pipes
    m.CreatePipe: pipe.create_pipe,
    m.PipeRecv: pipe.pipe_recv,
    # actors
    ActorCall: actor.actor_call_info,
    m.SendResultOfActorCall: actor.send_result_of_actor_call,
    m.CallActorMethod: actor.call_actor_method,
}
