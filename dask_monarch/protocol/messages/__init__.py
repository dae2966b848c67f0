"""The protocol's messages, as plain data: what a controller and its ranks exchange.

* :mod:`.checked`: construction checks fields, unpickling skips the checks;
* :mod:`.values`: what messages carry (refs, functions, arguments, factories);
* :mod:`.worker`: every ``WorkerMessage``, each with its meaning on a rank;
* :mod:`.controller`: what ranks send back (``Status``, ``FetchResult``,
  ``RemoteFunctionFailed``).

Import them from here (``dask_monarch.messages`` is the public path). The
classes name this package as their module, so they pickle (and print) under
one stable path whichever submodule defines them.
"""

from .controller import CONTROLLER_MESSAGES, FetchResult, RemoteFunctionFailed, Status
from .values import (
    ActorCallParams,
    ArgsKwargs,
    Cloudpickle,
    Factory,
    FunctionPath,
    ReduceOp,
    Reduction,
    Ref,
    ResolvableFunction,
    StreamCreationMode,
    StreamRef,
    as_function,
    as_ref,
    dumps,
    memory_format,
)
from .worker import (
    WORKER_MESSAGES,
    BackendNetworkInit,
    BackendNetworkPointToPointInit,
    BorrowCreate,
    BorrowDrop,
    BorrowFirstUse,
    BorrowLastUse,
    CallActorMethod,
    CallFunction,
    CallRecording,
    CommandGroup,
    CreateDeviceMesh,
    CreatePipe,
    CreateRemoteProcessGroup,
    CreateStream,
    DefineRecording,
    DeleteRefs,
    Exit,
    GetRefUnitTestsOnly,
    PipeRecv,
    RecordingFormal,
    RecordingResult,
    Reduce,
    RequestStatus,
    SendResultOfActorCall,
    SendTensor,
    SendValue,
    SetRefUnitTestsOnly,
    SplitComm,
    SplitCommForProcessGroup,
    WorkerMessage,
    flatten_groups,
)

__all__ = [
    "Ref",
    "StreamRef",
    "FunctionPath",
    "Cloudpickle",
    "ResolvableFunction",
    "ArgsKwargs",
    "Factory",
    "ReduceOp",
    "Reduction",
    "StreamCreationMode",
    "ActorCallParams",
    "WorkerMessage",
    "WORKER_MESSAGES",
    "CONTROLLER_MESSAGES",
    "BackendNetworkInit",
    "BackendNetworkPointToPointInit",
    "CallFunction",
    "CommandGroup",
    "CreateStream",
    "CreateDeviceMesh",
    "CreateRemoteProcessGroup",
    "BorrowCreate",
    "BorrowFirstUse",
    "BorrowLastUse",
    "BorrowDrop",
    "DeleteRefs",
    "RequestStatus",
    "Reduce",
    "SplitComm",
    "SplitCommForProcessGroup",
    "SendTensor",
    "SendValue",
    "SendResultOfActorCall",
    "CallActorMethod",
    "PipeRecv",
    "CreatePipe",
    "Exit",
    "DefineRecording",
    "RecordingFormal",
    "RecordingResult",
    "CallRecording",
    "SetRefUnitTestsOnly",
    "GetRefUnitTestsOnly",
    "Status",
    "FetchResult",
    "RemoteFunctionFailed",
    "as_ref",
    "as_function",
    "dumps",
    "flatten_groups",
]

# One module name per class (see above): pickles stay as short as, and identical to,
# those made before the split into submodules.
for _cls in (
    Ref,
    StreamRef,
    FunctionPath,
    Cloudpickle,
    ArgsKwargs,
    Factory,
    ReduceOp,
    StreamCreationMode,
    ActorCallParams,
    *WORKER_MESSAGES,
    *CONTROLLER_MESSAGES,
    memory_format,  # named by batches (see dumps)
):
    _cls.__module__ = __name__
del _cls
