"""The protocol as plain data: every variant constructs, checks its fields, pickles by value."""

import pickle

import cloudpickle
import pytest
import torch

from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef
from dask_monarch.ndslice import Slice

S0, S1 = StreamRef(0), StreamRef(1)
AK = ArgsKwargs.from_python((Ref(1), 2), {"alpha": 3})
FACTORY = m.Factory((2, 3), torch.float32, torch.strided, "cpu")
CALL = m.ActorCallParams(7, ("broker", 0), [Ref(1)], [Ref(2)], S0)


def examples() -> dict[type, object]:
    """One instance of every worker message variant."""
    call = m.CallFunction(1, [Ref(2), None], [Ref(3)], "torch.ops.aten.add.Tensor", AK, S0, [])
    out = [
        m.BackendNetworkInit(),
        m.BackendNetworkPointToPointInit(S0, S1),
        call,
        m.CommandGroup([call, m.DeleteRefs([Ref(2)])]),
        m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream),
        m.CreateDeviceMesh(Ref(9), ["host", "gpu"], Slice.row_major([2, 2])),
        m.CreateRemoteProcessGroup(Ref(10), Ref(9), ["gpu"]),
        m.BorrowCreate(Ref(11), 1, Ref(2), S0, S1),
        m.BorrowFirstUse(1),
        m.BorrowLastUse(1),
        m.BorrowDrop(1),
        m.DeleteRefs([Ref(1), Ref(2)]),
        m.RequestStatus(5),
        m.Reduce(Ref(12), Ref(2), FACTORY, Ref(9), S0, ["gpu"], m.ReduceOp.SUM, False, False, None),
        m.SplitComm(["gpu"], Ref(9), S0),
        m.SplitCommForProcessGroup(Ref(10), S0),
        m.SendTensor(Ref(13), Slice(0, [2], [1]), Slice(2, [2], [1]), Ref(2), FACTORY, S0, S0),
        m.SendValue(6, None, [], None, ArgsKwargs.from_python((Ref(2),)), S0),
        m.SendResultOfActorCall(7, ("broker", 0), [Ref(1)], [Ref(2)], S0),
        m.CallActorMethod([Ref(14)], CALL),
        m.PipeRecv(8, [Ref(15)], Ref(16), S0),
        m.CreatePipe(Ref(16), "loader", "mypkg.loader", 2, Ref(9), ArgsKwargs.from_python()),
        m.Exit(),
        m.DefineRecording(Ref(17), 1, 1, [m.RecordingFormal(Ref(18), 0, S0)], 1, 0),
        m.RecordingFormal(Ref(18), 0, S0),
        m.RecordingResult(Ref(18), 0, S0),
        m.CallRecording(9, Ref(17), [Ref(19)], [Ref(2)]),
        m.SetRefUnitTestsOnly(Ref(20), [1, "two", 3.0], S0),
        m.GetRefUnitTestsOnly(Ref(20), S0),
    ]
    return {type(x): x for x in out}


def test_every_seed_variant_has_a_class_and_an_example():
    assert set(examples()) == set(m.WORKER_MESSAGES)
    assert len(m.WORKER_MESSAGES) == 29  # 28 seed variants + CreatePipe


def test_batches_send_tensors_as_their_bytes():
    """A tensor in a message (a client value, a generator's state) travels as its storage's
    bytes, not ``torch.save``'s archive; both loaders give back equal tensors, with their
    strides, offsets and dtypes (those torch itself cannot pickle too)."""
    from dask_monarch.worker.restricted import loads as restricted_loads

    values = [
        torch.arange(12.0).reshape(3, 4)[:, 1:],  # a view: its offset and strides
        torch.randint(0, 64, (8, 16)),
        torch.zeros(0),
        torch.tensor([1, 2], dtype=torch.uint16),  # no typed storage class in torch
        torch.ones(2, requires_grad=True),
    ]
    data = m.dumps(values)
    assert b"_load_from_bytes" not in data
    for loads in (pickle.loads, restricted_loads):
        for value, back in zip(values, loads(data)):
            assert back.dtype == value.dtype and torch.equal(back, value.detach())
            assert back.stride() == value.stride()
            assert back.storage_offset() == value.storage_offset()
            assert back.requires_grad == value.requires_grad


def test_pickled_arguments_send_tensors_as_their_bytes():
    """Arguments that are not plain data (a generator, a local tensor beside a closure) are
    cloudpickled into the message's payload: their tensors travel as bytes too, and load
    with the restricted loader where nothing else in them needs code."""
    from dask_monarch.worker.restricted import loads as restricted_loads

    value = torch.arange(6.0).reshape(2, 3).t()
    args = ArgsKwargs.from_python((Ref(1), value), {"scale": torch.tensor([2], dtype=torch.uint16)})
    payload = args[2]
    assert payload is not None and b"_load_from_bytes" not in payload
    for loads in (pickle.loads, restricted_loads):
        (ref, back), kwargs = loads(payload)
        assert ref == Ref(1) and torch.equal(back, value) and back.stride() == value.stride()
        assert kwargs["scale"].dtype == torch.uint16


@pytest.mark.parametrize("msg", list(examples().values()), ids=lambda x: type(x).__name__)
def test_messages_pickle_and_compare_by_value(msg):
    for dumps in (pickle.dumps, cloudpickle.dumps, m.dumps):
        back = pickle.loads(dumps(msg))
        assert type(back) is type(msg)
        assert back == msg
    assert len(repr(msg)) < 400


def test_batches_name_memory_formats_without_searching_modules():
    """``m.dumps`` pickles memory formats through ``m.memory_format`` (pickle's own way
    searches every loaded module for the name); both loaders, plain and restricted,
    give back torch's objects."""
    from dask_monarch.worker.restricted import loads as restricted_loads

    formats = [torch.contiguous_format, torch.preserve_format, torch.channels_last]
    call = m.CallFunction(
        1,
        [Ref(2)],
        [],
        "torch.ones_like",
        ArgsKwargs.from_python((Ref(1),), {"memory_format": formats[1]}),
        StreamRef(0),
        [],
    )
    data = m.dumps([call, formats])
    assert b"memory_format" in data and b"contiguous_format" in data
    for loads in (pickle.loads, restricted_loads):
        back_call, back_formats = loads(data)
        assert back_call == call and all(a is b for a, b in zip(back_formats, formats))
    with pytest.raises(ValueError, match="not a memory format"):
        m.memory_format("float32")


def test_fetched_values_carry_cpu_storages_as_bytes():
    """``dumps_value`` (what a rank sends for a fetch) pickles a CPU storage as its bytes,
    not through ``torch.save``; torch's tensor reducers still carry the rest, so dtype,
    shape, strides, offset, requires_grad and the tensor's class come back as they were,
    and the loaded tensors are writable."""
    from dask_monarch.protocol.messages.values import dumps_value
    from dask_monarch.protocol.tensor_bytes import storage

    values = [
        torch.arange(4.0),
        torch.tensor(3.5),
        torch.zeros(2, 0, 3),
        torch.arange(12.0).reshape(3, 4).t(),  # strided view
        torch.arange(10.0)[3:7],  # offset view
        torch.ones(3, dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.ones(4, dtype=torch.complex64),
        torch.arange(5, dtype=torch.int64),
        torch.nn.Parameter(torch.ones(3)),
        torch.ones(2, 3, requires_grad=True),
    ]
    data = dumps_value({"values": values, "again": values[0], "note": "x"})
    assert b"_load_from_bytes" not in data and b"storage" in data
    back = pickle.loads(data)
    assert back["again"] is back["values"][0] and back["note"] == "x"
    for sent, got in zip(values, back["values"]):
        assert type(got) is type(sent) and got.dtype == sent.dtype
        assert got.shape == sent.shape and got.stride() == sent.stride()
        assert got.storage_offset() == sent.storage_offset()
        assert got.requires_grad == sent.requires_grad
        assert torch.equal(got.detach(), sent.detach())
    back["values"][0].add_(1)  # a writable buffer underneath
    assert back["values"][0].tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="not a dtype"):
        storage("contiguous_format", bytearray(4))


def test_controller_messages_pickle():
    for msg in (
        m.Status(3, 1),
        m.FetchResult(2, 0, torch.ones(2)),
        m.RemoteFunctionFailed(1, 0, "Traceback ..."),
    ):
        back = pickle.loads(pickle.dumps(msg))
        assert type(back) is type(msg) and back.seq == msg.seq and back.rank == msg.rank


def test_fields_by_keyword_and_defaults():
    call = m.CallFunction(
        seq=1,
        results=[Ref(2)],
        mutates=[],
        function=m.FunctionPath("a.b"),
        args_kwargs=AK,
        stream=S0,
        remote_process_groups=[],
    )
    assert call.function == m.FunctionPath("a.b")
    assert m.RequestStatus(4).controller is False
    assert m.Exit().error is None and m.BackendNetworkInit().unique_id is None
    assert m.CallActorMethod(results=[None], call=CALL).call.seq == 7


def test_equality_depends_on_type():
    assert m.BorrowFirstUse(1) != m.BorrowLastUse(1)
    assert Ref(3) != StreamRef(3)
    assert Ref(3) == Ref(3) and hash(Ref(3)) == hash(Ref(3))


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: m.RequestStatus("1"), TypeError),
        (lambda: m.RequestStatus(-1), ValueError),
        (lambda: m.RequestStatus(True), TypeError),
        (lambda: m.CallFunction(1, [2], [], "a.b", AK, S0, []), TypeError),
        (lambda: m.CallFunction(1, [], [], 42, AK, S0, []), TypeError),
        (lambda: m.CallFunction(1, [], [], "a.b", (1, 2), S0, []), TypeError),
        (lambda: m.CallFunction(1, [], [], "a.b", AK, Ref(0), []), TypeError),
        (lambda: m.CreateDeviceMesh(Ref(1), "xy", Slice.row_major([2])), TypeError),
        (lambda: m.CreateDeviceMesh(Ref(1), ["x"], [0, 1]), TypeError),
        (
            lambda: m.Reduce(
                Ref(1), Ref(2), FACTORY, Ref(3), S0, ["x"], "mean", False, False, None
            ),
            ValueError,
        ),
        (
            lambda: m.Reduce(Ref(1), Ref(2), FACTORY, Ref(3), S0, ["x"], "stack", 0, False, None),
            TypeError,
        ),
        (lambda: m.Exit(("rank 0",)), TypeError),
        (lambda: m.SendResultOfActorCall(1, "broker", [], [], S0), TypeError),
        (lambda: m.Factory((2,), "float32", torch.strided, "cpu"), TypeError),
        (lambda: m.Factory((-1,), torch.float32, torch.strided, "cpu"), ValueError),
        (lambda: m.CommandGroup([1]), TypeError),
        (lambda: Ref("3"), TypeError),
        (lambda: Ref(-3), ValueError),
    ],
)
def test_bad_fields_raise_clear_errors(make, error):
    with pytest.raises(error) as info:
        make()
    assert str(info.value)


def test_error_names_the_field():
    with pytest.raises(TypeError, match="CallFunction.stream"):
        m.CallFunction(1, [], [], "a.b", AK, 0, [])


def test_monarch_ref_objects_become_refs():
    class Handle:
        def __init__(self, ref):
            self.ref = ref

        def __monarch_ref__(self):
            return self.ref

    ak = ArgsKwargs.from_python((Handle(4), [Handle(Ref(5))]), {"k": Handle(6)})
    args, kwargs = ak.to_python()
    assert args == (Ref(4), [Ref(5)]) and kwargs == {"k": Ref(6)}
    assert m.DeleteRefs([Handle(7)]).refs == [Ref(7)]


def test_args_kwargs_round_trip_keeps_types():
    args = (
        True,
        None,
        [Ref(1), {"a": Ref(2), "b": (None, False)}],
        3,
        2.5,
        "s",
        torch.float16,
        torch.device("cpu"),
        torch.Size([2, 3]),
    )
    kwargs = {"flag": False, "none": None, "refs": (Ref(3),)}
    ak = ArgsKwargs.from_python(args, kwargs)
    back = pickle.loads(pickle.dumps(ak)).to_python()
    assert back == (args, kwargs)
    assert back[0][0] is True and back[0][1] is None and back[1]["flag"] is False
    assert type(back[0][2][0]) is Ref


def test_args_kwargs_snapshots_local_objects():
    t = torch.zeros(2)
    ak = ArgsKwargs.from_python((t,), {})
    t.add_(1)
    (got,), _ = ak.to_python()
    assert torch.equal(got, torch.zeros(2))
    assert ak == pickle.loads(pickle.dumps(ak))


def test_args_kwargs_flat_flag():
    assert ArgsKwargs.from_python((Ref(1), 2)).flat
    assert not ArgsKwargs.from_python(([Ref(1)],)).flat


def test_factory_from_tensor_and_zeros():
    t = torch.ones(2, 3, dtype=torch.float64)
    f = m.Factory.from_tensor(t)
    assert f == m.Factory((2, 3), torch.float64, torch.strided, torch.device("cpu"))
    assert f.device == "cpu"
    assert torch.equal(f.zeros(), torch.zeros(2, 3, dtype=torch.float64))


def test_reduce_op_names_match_torch():
    import torch.distributed as dist

    for op in m.ReduceOp:
        assert hasattr(dist.ReduceOp, op.name)


def test_cloudpickle_function_round_trip():
    fn = m.Cloudpickle.dumps(lambda x: x + 1)
    assert cloudpickle.loads(fn.bytes)(1) == 2
    assert pickle.loads(pickle.dumps(fn)) == fn


def wire_steps() -> dict[type, object]:
    """One instance of every step the compiler adds to segments besides worker messages."""
    from dask_monarch.protocol import wire

    out = [
        wire.StatusProbe(5, 1, 2),
        wire.ReadRef(3, m.GetRefUnitTestsOnly(Ref(20), S0)),
        wire.ActorCall(("broker", 0), 7, "add", ArgsKwargs.from_python((Ref(1),))),
        wire.ExpectResults(4, "helpers.remote_fns.pair", (((2, 3), torch.float32, "cpu"), None)),
        wire.DropLane(),
    ]
    return {type(x): x for x in out}


def test_every_step_has_an_example():
    from dask_monarch.protocol import wire

    assert set(wire_steps()) == set(wire.STEPS)


@pytest.mark.parametrize(
    "step", [*examples().values(), *wire_steps().values()], ids=lambda x: type(x).__name__
)
def test_every_message_and_step_is_plain_data_to_the_restricted_loader(step):
    """A worker that accepts no pickled code (docs/security.md) loads whatever the project
    itself sends; so does the event loop's stricter loader (worker/inline.py)."""
    from dask_monarch.worker.restricted import loads, loads_ours

    data = m.dumps([step])
    for load in (loads, loads_ours):
        (back,) = load(data)
        assert type(back) is type(step) and back == step
