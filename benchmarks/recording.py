"""Replaying a recording against sending the same commands again.

    python benchmarks/recording.py [--commands 1000] [--calls 20] [--repeat 5]

A recording of ``commands`` chained adds on small tensors (``y = y + x``) is
defined once on 2 ranks, then called ``calls`` times with one CallRecording
each; the same commands are also sent as plain CallFunction messages. Prints
microseconds per command for the bare op (in-process torch), for resending
and for replaying, end to end (send to sync) and on the workers' lanes, and
the replay overhead over the op itself. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from distributed import Client

import dask_monarch as dm
from dask_monarch import messages as m
from dask_monarch.messages import ArgsKwargs, Ref, StreamRef

S0 = StreamRef(0)
ADD = m.FunctionPath("torch.ops.aten.add.Tensor")
BOTH = (0, 1)


def call(seq, result, *args):
    return m.CallFunction(seq, [result], [], ADD, ArgsKwargs.from_python(args), S0, [])


def lane_seconds(client, token) -> float:
    def busy(dask_worker, token=token):
        state = dask_worker.plugins["dask_monarch"].ranks[token]
        return state.lanes[0].busy_seconds

    return max(client.run(busy).values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    k, calls = args.commands, args.calls

    x = torch.ones(4)
    y = torch.zeros(4)
    op_times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        for _ in range(k * calls):
            y = torch.ops.aten.add.Tensor(y, x)
        op_times.append((time.perf_counter() - start) / (k * calls))

    with dm.LocalMeshCluster(n_ranks=2, device="cpu") as cluster, Client(cluster) as client:
        with dm.Controller(client, world_size=2) as ctrl:
            ctrl.send(BOTH, m.CreateStream(S0, m.StreamCreationMode.UseDefaultStream))
            ctrl.send(
                BOTH,
                m.CallFunction(
                    0,
                    [Ref(1)],
                    [],
                    m.FunctionPath("torch.ones"),
                    ArgsKwargs.from_python((4,)),
                    S0,
                    [],
                ),
            )
            # the recording: y1 = formal + x; y2 = y1 + x; ...; result y_k
            formal = Ref(100)
            commands = [m.RecordingFormal(formal, 0, S0)]
            prev = formal
            for i in range(k):
                commands.append(call(0, Ref(101 + i), prev, Ref(1)))
                prev = Ref(101 + i)
            commands.append(m.RecordingResult(prev, 0, S0))
            chunk = 1000
            chunks = [commands[i : i + chunk] for i in range(0, len(commands), chunk)]
            for i, part in enumerate(chunks):
                ctrl.send(BOTH, m.DefineRecording(Ref(50), 1, 1, part, len(chunks), i))
            ctrl.sync()

            seq = 1
            resend, replay, replay_lane = [], [], []
            next_ref = 10**6
            for _ in range(args.repeat):
                # resend the same commands as plain messages
                start = time.perf_counter()
                for _ in range(calls):
                    prev = Ref(1)
                    for _ in range(k):
                        ctrl.send(BOTH, call(seq, Ref(next_ref), prev, Ref(1)))
                        prev, next_ref, seq = Ref(next_ref), next_ref + 1, seq + 1
                ctrl.sync(timeout=600)
                resend.append((time.perf_counter() - start) / (k * calls))
                ctrl.send(
                    BOTH, m.DeleteRefs([Ref(r) for r in range(next_ref - k * calls, next_ref)])
                )
                ctrl.sync()
                # replay the recording
                busy = lane_seconds(client, ctrl.token)
                start = time.perf_counter()
                for _ in range(calls):
                    ctrl.send(BOTH, m.CallRecording(seq, Ref(50), [Ref(next_ref)], [Ref(1)]))
                    next_ref, seq = next_ref + 1, seq + 1
                ctrl.sync(timeout=600)
                replay.append((time.perf_counter() - start) / (k * calls))
                replay_lane.append((lane_seconds(client, ctrl.token) - busy) / (k * calls))

    op = statistics.median(op_times)
    rows = [
        ("bare op (in-process torch)", op),
        ("resend as CallFunction, end to end", statistics.median(resend)),
        ("replay, end to end", statistics.median(replay)),
        ("replay, on the lane", statistics.median(replay_lane)),
    ]
    print(f"\n{k} commands x {calls} calls on 2 ranks, median of {args.repeat}")
    for label, value in rows:
        print(f"{label:<40}{value * 1e6:>8.2f} us/command")
    print(
        f"{'replay overhead over the op (lane)':<40}"
        f"{(statistics.median(replay_lane) - op) * 1e6:>8.2f} us/command"
    )


if __name__ == "__main__":
    main()
