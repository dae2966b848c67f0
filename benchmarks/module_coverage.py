"""Module coverage: PyTorch's ModuleInfo samples on a 2-rank mesh, compared with local torch.

    python benchmarks/module_coverage.py [--modules REGEX] [--limit N] [--samples 3]
                                         [--placement put|ranks] [--scheduler ADDRESS]
                                         [--json PATH] [--verbose]

Every ModuleInfo of ``torch.testing._internal.common_modules.module_db`` that
supports float32 (or those whose name matches ``--modules``, the first
``--limit``) runs its first ``--samples`` ModuleInputs in training mode, and in
eval mode too where the ModuleInfo says the two differ. Each sample runs
locally and on a mesh of 2 CPU ranks:

* locally: ``torch.manual_seed(seed)``; the module constructed; its initial
  state kept; ``torch.manual_seed(seed + 1)``; forward; a fixed weighted sum of
  the floating outputs that require grad; ``.backward()``;
* on the mesh, under ``mesh.activate()``: the same, with every tensor of the
  constructor and forward inputs placed on the mesh (``--placement``, as
  tests/user_api/op_sweep.py's ``place``), the module constructed under the mesh
  and given the local initial state with ``load_state_dict`` (so the comparison
  does not rest on the two sides drawing the same initial weights).

Three phases are compared, as op_sweep compares an op's outputs (client-side
metadata, the rank's metadata, then the values): ``forward`` (the outputs),
``backward`` (every parameter's and input's ``.grad``), ``state`` (the
module's ``state_dict`` after forward and backward: running statistics).

Three corrections to module_db's samples, applied alike on both sides: every
forward input is made a leaf (module_db makes some as ``make_input().log()``,
whose ``.grad`` local torch leaves None while a placed input is a leaf); a
module given to a constructor (TransformerEncoder's layer) is a copy with its
parameters and buffers placed on the mesh, as a user who built it under the
mesh has; FractionalMaxPool's ``_random_samples``, which module_db makes
float64 whatever the dtype asked for, are cast to float32.

Lazy modules (``nn.Lazy*``) are a known refusal: they size their parameters on
their first call, which a mesh refuses (give the module its input sizes). Their
mesh errors count as ``refused``, with the error, not as failures.

Prints modules fully passing and samples passing per phase, the refusals, every
mismatch (a wrong value or stale metadata with no error raised), and the mesh
errors grouped by cause with the modules in each (``--verbose``: every failing
sample with its exception and the end of its traceback). Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import signal
import sys
import traceback
import warnings
import zlib
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.testing._internal.common_modules import ModuleInfo, module_db
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "user_api"))

import op_sweep  # noqa: E402
from op_sweep import (  # noqa: E402
    LOCAL_ERROR,
    MESH_ERROR,
    MISMATCH,
    PASS,
    Mismatch,
    Outcome,
    category,
    check_metadata,
    check_values,
    place,
    place_tree,
)

import dask_monarch as dm  # noqa: E402

PHASES = ("forward", "backward", "state")
REFUSED = "refused"  # a known refusal (lazy modules): neither a pass nor a failure
LAZY_REFUSAL = "lazy module: cannot size its parameters on a mesh (give it its input sizes)"
# seconds for one sample in all (placing and constructing included): past it, the mesh is
# taken for hung and replaced
SAMPLE_TIMEOUT = 120


def select_modules(pattern: str | None = None, names: Iterable[str] | None = None) -> list:
    """ModuleInfos whose name matches ``pattern`` (a regex, searched) or is in ``names``."""
    return op_sweep.select(module_db, "module_db", lambda mi: mi.name, pattern, names)


def _float_grad_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if op_sweep._is_float(t) and t.requires_grad]


def _input_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _as_leaf(x: Any) -> Any:
    return x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


def _on_alarm(signum: int, frame: Any) -> None:
    raise TimeoutError(f"sample took longer than {SAMPLE_TIMEOUT} s")


class ModuleSweep(op_sweep.Sweep):
    """Runs ModuleInfo samples on one mesh (made anew when it breaks) and keeps the outcomes:
    op_sweep.Sweep's mesh and bookkeeping, with a module's phases.

    An outcome's ``op`` is ``name[train]`` or ``name[eval]``; a failure before the forward
    (placing the inputs, constructing the module) is noted in the ``forward`` phase.
    """

    def run(self, infos: Iterable[ModuleInfo]) -> list[Outcome]:
        for mi in infos:
            if torch.float32 not in mi.dtypes:
                self.unsupported.append(mi.name)
                continue
            modes = [True] + ([False] if mi.train_and_eval_differ else [])
            for training in modes:
                start = len(self.outcomes)
                self.run_module(mi, training)
                bad = [o for o in self.outcomes[start:] if o.status in (MISMATCH, MESH_ERROR)]
                label = self.outcomes[start].op if len(self.outcomes) > start else mi.name
                self.log(f"{label}: {len(self.outcomes) - start} runs, {len(bad)} failing")
        return self.outcomes

    def run_module(self, mi: ModuleInfo, training: bool) -> None:
        label = f"{mi.name}[{'train' if training else 'eval'}]"
        seed = zlib.crc32(label.encode())
        torch.manual_seed(seed)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecations and betas of the modules themselves
                made = mi.module_inputs_func(
                    mi, device="cpu", dtype=torch.float32, requires_grad=True, training=training
                )
                samples, error = op_sweep._take(made, self.samples)
        except Exception as e:
            samples, error = [], e
        lazy = issubclass(mi.module_cls, LazyModuleMixin)
        for index, sample in enumerate(samples):
            if sample.forward_input is None:
                continue
            start = len(self.outcomes)
            self.run_sample(mi.module_cls, label, training, index, sample, seed + 17 * index)
            if lazy:  # its mesh errors are the known refusal
                for o in self.outcomes[start:]:
                    if o.status == MESH_ERROR:
                        o.status, o.category = REFUSED, LAZY_REFUSAL
        if error is not None:  # the ModuleInfo cannot make its next sample here
            self._note(label, "forward", len(samples), LOCAL_ERROR, "", op_sweep._describe(error))

    def run_sample(
        self, cls: type, label: str, training: bool, index: int, sample: Any, seed: int
    ) -> None:
        cin, fin = sample.constructor_input, sample.forward_input
        ckw = dict(cin.kwargs)
        if isinstance(ckw.get("_random_samples"), torch.Tensor):  # float64 from module_db
            ckw["_random_samples"] = ckw["_random_samples"].to(torch.float32)
        ctree = (tuple(cin.args), ckw)
        ftree = tree_map(_as_leaf, (tuple(fin.args), dict(fin.kwargs)))
        old = signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(SAMPLE_TIMEOUT)
        try:
            self._run_sample(cls, label, training, index, ctree, ftree, seed)
        except TimeoutError as e:  # in placing, constructing, ...
            self.renew_mesh()
            self._note(label, "forward", index, MESH_ERROR, category(e), op_sweep._describe(e))
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)

    def _run_sample(
        self,
        cls: type,
        label: str,
        training: bool,
        index: int,
        ctree: tuple,
        ftree: tuple,
        seed: int,
    ) -> None:
        mesh = self.mesh
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")
            warnings.simplefilter("always", dm.ImplicitFetchWarning)
            fetches = lambda: sum(  # noqa: E731
                1 for w in caught if issubclass(w.category, dm.ImplicitFetchWarning)
            )
            # placed first: the local run may change the inputs in place
            try:
                pc = place_tree(_modules_on_mesh(ctree, mesh, self.placement), mesh, self.placement)
                pf = place_tree(ftree, mesh, self.placement)
            except (dm.DeviceException, TimeoutError) as e:
                self.renew_mesh()
                detail = op_sweep._describe(e)
                return self._note(label, "forward", index, MESH_ERROR, category(e), detail)
            except Exception as e:  # a tensor dask_monarch cannot hold
                detail = op_sweep._describe(e)
                return self._note(label, "forward", index, MESH_ERROR, f"placing: {detail}", detail)
            strides = op_sweep.same_layouts(ftree, pf)

            try:
                init, lout, lgrads, lstate, seeded, bw_error = self._local(
                    cls, training, ctree, ftree, seed
                )
            except Exception as e:
                return self._note(label, "forward", index, LOCAL_ERROR, "", op_sweep._describe(e))
            extra = " (random ops ran)" if seeded else ""

            # forward: the module built under the mesh, given the local initial state
            try:
                with mesh.activate():
                    torch.manual_seed(seed)
                    mm = cls(*pc[0], **pc[1])
                    mm.train(training)
                    with dm.no_mesh.activate():
                        pstate = {k: place(v, mesh, self.placement) for k, v in init.items()}
                    mm.load_state_dict(pstate)
                    torch.manual_seed(seed + 1)
                    mout = mm(*pf[0], **pf[1])
                pending = check_metadata("forward", lout, mout, strides)
                check_values(pending, True, {}, self.timeout)
                self._note(label, "forward", index, PASS, "", "", fetches())
            except Exception as e:
                return self._fail(label, "forward", index, e, extra, fetches())

            # backward: every parameter's and input's .grad
            if bw_error is not None:
                self._note(label, "backward", index, LOCAL_ERROR, "", bw_error)
            elif lgrads is not None:
                try:
                    with mesh.activate():
                        leaves = _float_grad_leaves(mout)
                        ws = [place(op_sweep._weights(t), mesh, self.placement) for t in leaves]
                        op_sweep._weighted_sum(leaves, ws).backward()
                        mgrads = tuple(p.grad for p in mm.parameters()) + tuple(
                            x.grad for x in _input_leaves(pf)
                        )
                    a, b = op_sweep._none_for_zeros(lgrads, mgrads)
                    check_values(check_metadata("grad", a, b, False), True, {}, self.timeout)
                    self._note(label, "backward", index, PASS, "", "", fetches())
                except Exception as e:
                    self._fail(label, "backward", index, e, extra, fetches())

            # state after forward and backward: running statistics
            if lstate:
                try:
                    with mesh.activate():
                        mstate = dict(mm.state_dict())
                    if list(mstate) != list(lstate):
                        raise Mismatch(f"state keys: mesh {list(mstate)}, local {list(lstate)}")
                    pending = check_metadata(
                        "state", tuple(lstate.values()), tuple(mstate.values()), False
                    )
                    check_values(pending, True, {}, self.timeout)
                    self._note(label, "state", index, PASS, "", "", fetches())
                except Exception as e:
                    self._fail(label, "state", index, e, extra, fetches())

    def _local(self, cls: type, training: bool, ctree: tuple, ftree: tuple, seed: int) -> tuple:
        """The initial state, outputs, gradients (None: nothing to differentiate), state
        afterwards, whether random ops ran, and the backward's error if it failed."""
        torch.manual_seed(seed)
        m = cls(*ctree[0], **ctree[1])
        m.train(training)
        if isinstance(m, LazyModuleMixin):  # its initial state is known after sizing only
            m._infer_parameters(m, ftree[0], ftree[1])
        init = {k: v.detach().clone() for k, v in m.state_dict().items()}
        torch.manual_seed(seed + 1)
        record = op_sweep._Record()
        with record:
            out = m(*ftree[0], **ftree[1])
        grads, bw_error = None, None
        leaves = _float_grad_leaves(out)
        inputs = _input_leaves(ftree)
        params = list(m.parameters())
        if leaves and (inputs or any(p.requires_grad for p in params)):
            try:
                loss = op_sweep._weighted_sum(leaves, [op_sweep._weights(t) for t in leaves])
                loss.backward()
                grads = tuple(p.grad for p in params) + tuple(x.grad for x in inputs)
            except Exception as e:
                bw_error = op_sweep._describe(e)
        state = {k: v.detach().clone() for k, v in m.state_dict().items()}
        return init, out, grads, state, record.seeded, bw_error

    def _fail(
        self, label: str, phase: str, index: int, e: Exception, extra: str, fetches: int
    ) -> None:
        if isinstance(e, Mismatch):
            return self._note(label, phase, index, MISMATCH, "", str(e) + extra, fetches)
        if isinstance(e, (dm.DeviceException, TimeoutError)):
            self.renew_mesh()
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-4:])
        detail = f"{op_sweep._describe(e)}\n{tb.rstrip()}"
        self._note(label, phase, index, MESH_ERROR, category(e), detail, fetches)

    def _note(self, label: str, phase: str, index: int, *outcome: Any) -> None:
        self.outcomes.append(Outcome(label, phase, index, *outcome))


def _modules_on_mesh(tree: Any, mesh: dm.DeviceMesh, placement: str) -> Any:
    """A local nn.Module given to a constructor (TransformerEncoder's layer): a copy with its
    parameters and buffers placed on the mesh, as if the user had built it under the mesh."""

    def convert(x: Any) -> Any:
        if not isinstance(x, torch.nn.Module):
            return x
        x = copy.deepcopy(x)
        with mesh.activate():
            for sub in x.modules():
                for k, v in list(sub._parameters.items()):
                    if v is not None:
                        handle = place(v.detach(), mesh, placement)
                        sub._parameters[k] = torch.nn.Parameter(handle, v.requires_grad)
                for k, v in list(sub._buffers.items()):
                    if v is not None:
                        sub._buffers[k] = place(v.detach(), mesh, placement)
        return x

    return tree_map(convert, tree, is_leaf=lambda x: isinstance(x, torch.nn.Module))


# -- summarising ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Summary:
    """Counts per phase: modules fully passing / tried, samples passing / tried (a module is
    ``name[train]`` or ``name[eval]``; refused and local errors are not tried)."""

    modules_passing: dict[str, int]
    modules_tried: dict[str, int]
    samples_passing: dict[str, int]
    samples_tried: dict[str, int]
    mismatches: list[Outcome]
    categories: dict[str, list[Outcome]]  # mesh errors by category, most frequent first
    refused: dict[str, list[Outcome]]  # by reason
    local_errors: int
    implicit: list[Outcome]  # samples during which a value was fetched implicitly


def summarise(outcomes: list[Outcome]) -> Summary:
    keys = (*PHASES, "all")
    tried = [o for o in outcomes if o.status in (PASS, MISMATCH, MESH_ERROR)]
    by_module: dict[tuple[str, str], set[str]] = defaultdict(set)
    for o in tried:
        by_module[(o.phase, o.op)].add(o.status)
        by_module[("all", o.op)].add(o.status)
    modules_tried = {p: sum(1 for (ph, _) in by_module if ph == p) for p in keys}
    failing = {
        p: sum(1 for (ph, _), s in by_module.items() if ph == p and s - {PASS}) for p in keys
    }
    categories: dict[str, list[Outcome]] = defaultdict(list)
    refused: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        if o.status == MESH_ERROR:
            categories[o.category].append(o)
        elif o.status == REFUSED:
            refused[o.category].append(o)
    return Summary(
        modules_passing={p: modules_tried[p] - failing[p] for p in keys},
        modules_tried=modules_tried,
        samples_passing={
            p: sum(1 for o in tried if o.status == PASS and p in (o.phase, "all")) for p in keys
        },
        samples_tried={p: sum(1 for o in tried if p in (o.phase, "all")) for p in keys},
        mismatches=[o for o in tried if o.status == MISMATCH],
        categories=dict(sorted(categories.items(), key=lambda kv: -len(kv[1]))),
        refused=dict(refused),
        local_errors=sum(1 for o in outcomes if o.status == LOCAL_ERROR),
        implicit=[o for o in tried if o.implicit_fetches],
    )


def _names(outcomes: list[Outcome]) -> list[str]:
    return sorted({o.op for o in outcomes})


def report(summary: Summary, verbose: bool = False) -> str:
    """The human-readable summary, as op_sweep.report's for ops."""
    lines = []
    for p in (*PHASES, "all"):
        lines.append(
            f"{p:>8}: modules fully passing {summary.modules_passing[p]} / "
            f"{summary.modules_tried[p]}, samples passing {summary.samples_passing[p]} / "
            f"{summary.samples_tried[p]}"
        )
    lines.append(f"local errors (samples skipped: local torch fails too): {summary.local_errors}")
    for reason, items in summary.refused.items():
        lines.append(f"refused (known, not failures): {len(items)} samples, {reason}")
        lines.append(f"         {', '.join(_names(items))}")
    if summary.implicit:
        lines.append(f"samples that fetched a value implicitly: {len(summary.implicit)}")
        lines.append(f"         {', '.join(_names(summary.implicit))}")
    lines.append(f"\nMISMATCHES: {len(summary.mismatches)}")
    for o in summary.mismatches:
        lines.append(f"  {o.op} [{o.phase} sample {o.sample}]: {o.detail}")
    lines.append("\nmesh errors by category:")
    for cat, items in summary.categories.items():
        names = _names(items)
        lines.append(f"  {len(items):4d} samples, {len(names):3d} modules  {cat}")
        if verbose:
            for o in items:
                detail = o.detail.replace("\n", "\n           ")
                lines.append(f"         {o.op} [{o.phase} sample {o.sample}]: {detail}")
        else:
            lines.append(f"         {', '.join(names)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    op_sweep.add_arguments(
        parser,
        "module",
        select_help="regex searched in each ModuleInfo's name",
        samples_help="samples per module and mode",
        placed="inputs and state",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    infos = select_modules(args.modules)[: args.limit]
    sweep, outcomes, elapsed = op_sweep.run_sweep(ModuleSweep, infos, args)

    summary = summarise(outcomes)
    print(report(summary, verbose=args.verbose))
    print(
        f"\n{len(infos)} ModuleInfos selected, {len(sweep.unsupported)} without float32; "
        f"{args.samples} samples each in train mode and in eval mode where it differs (a "
        f"module above is one ModuleInfo in one mode), placed with "
        f"{args.placement}; new meshes after a broken one: {sweep.new_meshes}; {elapsed:.0f} s"
    )
    if args.json:
        data = {
            "samples": args.samples,
            "placement": args.placement,
            "seconds": elapsed,
            "new_meshes": sweep.new_meshes,
            "unsupported": sweep.unsupported,
            "modules_passing": summary.modules_passing,
            "modules_tried": summary.modules_tried,
            "samples_passing": summary.samples_passing,
            "samples_tried": summary.samples_tried,
            "refused": {r: len(items) for r, items in summary.refused.items()},
            "categories": {c: len(items) for c, items in summary.categories.items()},
            "outcomes": [dataclasses.asdict(o) for o in outcomes],
        }
        args.json.write_text(json.dumps(data, indent=1))
    return 1 if summary.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
