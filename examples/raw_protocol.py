"""Drive Monarch's worker protocol directly on an embedded 2-rank cluster.

python examples/raw_protocol.py
"""

import torch
from distributed import Client

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef


def call(seq, result, fn, *args, mutates=()):
    return m.CallFunction(
        seq, [result], list(mutates), fn, ArgsKwargs.from_python(args), StreamRef(0), []
    )


def main():
    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        print(f"cluster: {cluster}")
        with dm.Controller(client, world_size=2) as ctrl:
            both = [0, 1]
            ctrl.send(both, m.CreateStream(StreamRef(0), m.StreamCreationMode.UseDefaultStream))
            ctrl.send(both, call(0, Ref(1), "torch.ones", 3))
            ctrl.send(both, call(1, Ref(2), "torch.ops.aten.mul.Tensor", Ref(1), 2))
            ctrl.send(
                both, call(2, None, "torch.ops.aten.add_.Tensor", Ref(2), Ref(1), mutates=[Ref(2)])
            )
            ctrl.send(both, call(3, Ref(3), "torch.ops.aten.mm.default", Ref(1), Ref(1)))  # fails
            ctrl.send(
                1, m.SendValue(4, None, [], None, ArgsKwargs.from_python((Ref(2),)), StreamRef(0))
            )
            ctrl.send(both, m.RequestStatus(4))
            for msg in ctrl.sync():
                text = msg.error.strip().splitlines()[-1] if hasattr(msg, "error") else msg
                print(f"  {type(msg).__name__:<22} seq={msg.seq} rank={msg.rank}: {text}")
            x = ctrl.get_ref(0, Ref(2), StreamRef(0))
            print(f"rank 0 holds r2 = {x}")
            assert torch.equal(x, torch.full((3,), 3.0))


if __name__ == "__main__":
    main()
