"""Op coverage: PyTorch's OpInfo samples on a 2-rank mesh, compared with local torch (issue 34).

    python benchmarks/op_coverage.py [--ops REGEX] [--limit N] [--samples 3]
                                     [--scheduler ADDRESS] [--json PATH] [--verbose]

Every OpInfo of ``torch.testing._internal.common_methods_invocations.op_db``
that supports float32 on CPU (or those whose full name matches ``--ops``, the
first ``--limit``) runs its first ``--samples`` samples forward (the function
variant), in place (the in-place variant, where there is one) and backward
(where it supports autograd), on a mesh of 2 CPU ranks and locally; outputs,
their client-side metadata and gradients are compared (tests/user_api/op_sweep.py
says how). Prints ops fully passing and samples passing per phase, every
mismatch (a wrong value or stale metadata with no error raised), and the mesh
errors grouped by cause with the ops in each (``--verbose``: every failing
sample with its exception's first line). Exits 1 on any mismatch.

By default it starts its own ``LocalMeshCluster(n_ranks=2, device="cpu")``;
``--scheduler`` uses an existing cluster with at least 2 rank workers.
Needs ``expecttest`` (the ``test`` extra), which torch's OpInfo module imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "user_api"))

import op_sweep  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    op_sweep.add_arguments(
        parser,
        "op",
        select_help="regex searched in each OpInfo's full name",
        samples_help="samples per op and phase",
        placed="samples",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    ops = op_sweep.select_ops(args.ops)[: args.limit]
    sweep, outcomes, elapsed = op_sweep.run_sweep(op_sweep.Sweep, ops, args)

    summary = op_sweep.summarise(outcomes)
    print(op_sweep.report(summary, verbose=args.verbose))
    print(
        f"\n{len(ops)} OpInfos selected, {len(sweep.unsupported)} without float32 on CPU; "
        f"{args.samples} samples each, placed with {args.placement}; new meshes after a "
        f"broken one: {sweep.new_meshes}; "
        f"{elapsed:.0f} s"
    )
    if args.json:
        data = {
            "samples": args.samples,
            "seconds": elapsed,
            "new_meshes": sweep.new_meshes,
            "unsupported": sweep.unsupported,
            "ops_passing": summary.ops_passing,
            "ops_tried": summary.ops_tried,
            "samples_passing": summary.samples_passing,
            "samples_tried": summary.samples_tried,
            "categories": {c: len(items) for c, items in summary.categories.items()},
            "outcomes": [dataclasses.asdict(o) for o in outcomes],
        }
        args.json.write_text(json.dumps(data, indent=1))
    return 1 if summary.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
