"""A stream's replay plan: simple calls precompiled, then the whole plan as one function.

Semantics: docs/protocol.md §3.18; costs: docs/dask.md §12.

At definition each simple call becomes a :class:`FastCall` (function resolved,
argument positions of refs worked out once); its first replay checks whether
torch's Python binding may call it (:func:`settle`). Once a plan has replayed
``recordings.generate-after`` times and its calls have settled,
:func:`generate` writes it as straight-line Python that does, per command, what
the interpreter in ``recording.py`` does (look up the arguments, call, bind the
result, delete the refs nothing later names), with ref ids and constants in the
code instead of read from tuples and lists. A chain of adds of 100x100 (one
process): 0.25 µs per op over calling torch's binding directly, against 0.70
interpreted; compiling costs 60-100 µs per command, once. Anything out of the
ordinary (a missing or errored argument, a replay already failed) returns the
command's index and the interpreter goes on from there; other commands
(formals, results, borrows, collectives) call the interpreter's step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..protocol import messages as m
from ..protocol.rules import Opaque, named_refs
from .calls import TEST_PANIC, bind_results, constant, load_arguments, resolve_function
from .errors import FatalError, SeqError
from .failures import call_failed

if TYPE_CHECKING:
    from .rank import RankState

PIECE = 500  # commands per generated function: Python's compiler holds the GIL ~50 ms for one


class FastCall(tuple):
    """``(function, argument template, (position, ref) slots, kwargs, result ref, message,
    binding)``: ``binding`` is torch's Python binding of the ATen overload ``function``
    calls, until the first replay has checked it (:func:`settle`), then None."""

    __slots__ = ()


class _Watch(TorchDispatchMode):
    """Notes the ATen overloads a call reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's wrapper that keeps dynamo out imports it (see _reaches_only)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _overload(cmd: m.CallFunction) -> Any:
    """The ATen overload (``OpOverload``) a call's path names, else None."""
    path = cmd.function.path if type(cmd.function) is m.FunctionPath else ""
    if not path.startswith("torch.ops.aten."):
        return None
    packet_name, _, overload_name = path[len("torch.ops.aten.") :].partition(".")
    op = getattr(getattr(torch.ops.aten, packet_name, None), overload_name or "default", None)
    return op if type(op) is torch._ops.OpOverload else None


def _binding(cmd: m.CallFunction) -> tuple[Any, Any] | None:
    """``(overload, binding)`` for a call of a functional, deterministic ATen overload that
    torch's Python functions (``torch._C._VariableFunctions``) also name, else None."""
    op = _overload(cmd)
    if op is None:
        return None
    binding = getattr(torch._C._VariableFunctions, op._schema.name.split("::")[-1], None)
    if binding is None or op._schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
        return None
    return op, binding


def _keeps_arguments(cmd: m.CallFunction) -> bool:
    """Whether the ATen overload ``cmd`` calls neither writes to nor returns (an alias of)
    any of its arguments, so that one loaded copy of its pickled arguments serves every
    replay."""
    op = _overload(cmd)
    return (
        op is not None
        and not op._schema.is_mutable
        and all(r.alias_info is None for r in op._schema.returns)
    )


def settle(cmd: FastCall, args: list, kwargs: dict) -> FastCall:
    """``cmd`` calling torch's binding if, for arguments like these, the binding reaches
    exactly the recorded overload and nothing else (:func:`_reaches_only`), else calling
    the overload as before.

    An overload called through ``OpOverload`` goes through torch's boxed call,
    which converts every argument against the schema: 0.4-1.2 µs more per op
    than the binding's parser (2.79 against 2.24 µs for an add of 100x100).
    The binding picks its overload from the arguments, so it is taken only
    where it picks the same one.
    """
    fn, template, slots, kw, result, message, (op, binding) = cmd
    if _reaches_only(op, binding, args, kwargs):
        fn = binding
    return FastCall((fn, template, slots, kw, result, message, None))


def _reaches_only(op: Any, binding: Any, args: list, kwargs: dict) -> bool:
    """Whether ``binding(*args, **kwargs)`` calls ``op`` and nothing else, tried once per
    kind of arguments (their types; a tensor's dtype, device and number of dims) on
    one-element tensors of ones in place of the tensors. Only calls whose tensors are all
    plain tensors and that name no device (a factory would run for real) are tried.

    Not on meta tensors: their kernels are Python, and the first one imports dynamo (800
    modules and 117 000 objects that every full collection of the worker's garbage
    collector would walk from then on).
    """
    key = (op, *map(_kind, args), *((k, _kind(v)) for k, v in kwargs.items()))
    known = _REACHES.get(key)
    if known is not None:
        return known
    values = [*args, *kwargs.values()]
    values += [x for a in values if type(a) in (list, tuple) for x in a]
    tensors = [a for a in values if isinstance(a, torch.Tensor)]
    ops: list = []
    if tensors and all(type(a) is torch.Tensor for a in tensors) and "device" not in kwargs:

        def tiny(a: Any) -> Any:
            if type(a) is torch.Tensor:
                return torch.ones((1,) * a.dim(), dtype=a.dtype, device=a.device)
            if type(a) in (list, tuple):
                return type(a)(map(tiny, a))
            return a

        try:
            tinies = [tiny(a) for a in args]
            tiny_kwargs = {k: tiny(v) for k, v in kwargs.items()}
            watch = _Watch()
            with watch:  # the copies are made outside: only the call's own ops are noted
                binding(*tinies, **tiny_kwargs)
            ops = watch.ops
        except Exception:  # the binding refuses these arguments: keep the overload
            ops = []
    known = _REACHES[key] = ops == [op]
    return known


_REACHES: dict[tuple, bool] = {}  # (overload, kinds of the arguments) -> binding reaches it


def _kind(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (type(value), value.dtype, value.device, value.dim())
    if type(value) in (list, tuple):
        return (type(value), *map(_kind, value))
    return type(value)


def compile_command(state: RankState, cmd: Any) -> Any:
    """A FastCall for a simple CallFunction, else the message itself (handled generically).

    Simple: a function that resolves, refs only as arguments or as items of a
    list or tuple argument (``cat([a, b])``, the lists of a fused optimizer
    step), none in keyword arguments, any number of results. A container
    argument is a constant of the recording, handed to every replay as is
    (refs put in a copy): only to ATen operators, which never change their
    list arguments (``view(x, [2, 32])``, ``sum(x, [0])``, ``randn([64, 16])``
    are a quarter of a training step's commands), or where nothing in it can
    change (:func:`_shared_safely`). Arguments that travel
    pickled (a tensor of the caller's, captured as a constant) are loaded
    once, here, for an ATen operator that neither changes nor returns its
    arguments (:func:`_keeps_arguments`); anything else loads them afresh on
    every replay, as outside a recording.
    """
    if (
        type(cmd) is not m.CallFunction
        or cmd.remote_process_groups
        or (type(cmd.function) is m.FunctionPath and cmd.function.path == TEST_PANIC)
    ):
        return cmd
    try:
        fn = resolve_function(cmd.function)
    except Exception:  # reported when the call is replayed
        return cmd
    aten = type(cmd.function) is m.FunctionPath and cmd.function.path.startswith("torch.ops.aten.")
    if cmd.args_kwargs._payload is not None:
        if not _keeps_arguments(cmd):
            return cmd
        try:
            args, kwargs = load_arguments(cmd.args_kwargs._payload)
        except Exception:  # reported when the call is replayed
            return cmd
    else:
        args, kwargs = cmd.args_kwargs._args, cmd.args_kwargs._kwargs
        if not (cmd.args_kwargs.flat or aten or _shared_safely(args, kwargs)):
            return cmd
    if named_refs(kwargs, set()) or _views_in(kwargs.values()):
        return cmd
    template, slots = [], []
    for i, a in enumerate(args):
        t = type(a)
        if t is m.Ref:
            mesh = state.meshes.get(a.id)
            template.append(mesh)
            if mesh is None:
                slots.append((i, a.id))
        elif (t is list or t is tuple) and any(type(x) is m.Ref for x in a):
            if named_refs([x for x in a if type(x) is not m.Ref], set()) or _views_in(a):
                return cmd  # refs deeper down, views: the interpreter
            if any(type(x) is m.Ref and x.id in state.meshes for x in a):
                return cmd
            template.append(a)
            slots += [((i, j), x.id) for j, x in enumerate(a) if type(x) is m.Ref]
        elif named_refs(a, set()) or _views_in((a,)):
            return cmd
        else:
            template.append(a)
    result = cmd.results[0] if len(cmd.results) == 1 else None
    return FastCall(
        (
            fn,
            template,
            tuple(slots),
            kwargs,
            None if result is None else result.id,
            cmd,
            _binding(cmd),
        )
    )


def _shared_safely(args: tuple, kwargs: dict) -> bool:
    """Whether a function that is not an ATen operator may get these arguments' containers
    on every replay: each is a :func:`constant` tuple, or a list or tuple of refs and
    constants (built afresh per replay). A mutable container would be one object shared by
    every replay, which a user's function could change."""
    for a in args:
        if constant(a) or type(a) is m.Ref:
            continue
        if type(a) not in (list, tuple) or m.Ref not in map(type, a):
            return False  # a list naming no ref would be handed over as is
        if not all(type(x) is m.Ref or constant(x) for x in a):
            return False
    return all(constant(v) for v in kwargs.values())


def _views_in(values: Any) -> bool:
    """Whether a RefView is among ``values`` or in a container among them."""
    for v in values:
        t = type(v)
        if t is m.RefView or ((t is list or t is tuple) and _views_in(v)):
            return True
        if t is dict and _views_in(v.values()):
            return True
    return False


def refs_named(plan_item: Any) -> set[int]:
    """Every ref a command of a plan names (``rules.named_refs``), pickled arguments
    included: a FastCall's were loaded when it was made (its slots), a call's are loaded
    here; ``Opaque`` where they cannot be."""
    if type(plan_item) is FastCall:
        cmd, named = plan_item[5], {ref for _, ref in plan_item[2]}
    else:
        try:
            return named_refs(plan_item, set())
        except Opaque:
            if type(plan_item) is not m.CallFunction:
                raise
        cmd = plan_item
        try:
            loaded = load_arguments(cmd.args_kwargs._payload)
        except Exception:
            raise Opaque from None
        named = named_refs(loaded, set())
    return named_refs([f for f in cmd if type(f) is not m.ArgsKwargs], named)


# -- the plan as code ------------------------------------------------------------------------

Step = Callable[[Any, Any, list, int, Any], None]  # (lane, replay, plan, index, CallRecording)
Generated = Callable[[Any, dict, Any, Any], int]  # (lane, env, replay, CallRecording) -> stop


def generate(plan: list, frees: list[tuple[int, ...]], step: Step) -> Generated | None:
    """``plan`` as Python: a function returning the index of the first command it left to
    the interpreter (``len(plan)`` when it ran them all); None while a call has not
    settled (its first replay).

    Compiled in functions of :data:`PIECE` commands, so that the worker's event loop
    gets the GIL between them; the pieces run one after the other.
    """
    if any(type(c) is FastCall and c[6] is not None for c in plan):
        return None
    bounds = [(start, min(start + PIECE, len(plan))) for start in range(0, len(plan), PIECE)]
    pieces = [(_piece(plan, frees, step, start, end), end) for start, end in bounds]
    if len(pieces) == 1:
        return pieces[0][0]

    def replay_pieces(lane: Any, env: dict, replay: Any, msg: Any) -> int:
        for piece, end in pieces:
            stop = piece(lane, env, replay, msg)
            if stop != end:
                return stop
        return len(plan)

    return replay_pieces


def _piece(plan: list, frees: list, step: Step, start: int, end: int) -> Generated:
    """Commands ``start`` to ``end`` of ``plan`` as one function (see :func:`generate`).

    Each run of calls is one ``try``; ``x`` says where in it the code is: ``i`` while
    command ``i`` looks up its arguments (a missing one: the interpreter redoes the
    command and reports it), ``~i`` once it calls (the call failed: poison, report,
    go on after it). Only ints (ref ids, indices) are written into the source;
    functions, constants and messages are the function's globals, so nothing a user
    sent becomes code.
    """
    names: dict[str, Any] = {
        "__name__": __name__,  # pdb skips this module's frames (worker/debugger.py)
        "Tensor": torch.Tensor,
        "SeqError": SeqError,
        "FatalError": FatalError,
        "step": step,
        "plan": plan,
        "store": store,
        "failed": lambda lane, env, e, x: _failed(lane, env, plan, frees, e, x),
    }
    lines = ["def replay_plan(lane, env, replay, msg):"]
    calls = False  # inside a run of calls (a try)
    for index in range(start, end):
        cmd = plan[index]
        fast = type(cmd) is FastCall
        if fast and not calls:
            lines.append("    try:")
        elif calls and not fast:
            lines += _except
        calls = fast
        pad = " " * (8 if fast else 4)
        if fast:
            lines += [pad + line for line in _call_source(index, cmd, frees[index], names)]
        else:
            lines.append(f"{pad}step(lane, replay, plan, {index}, msg)")
            lines += [f"{pad}env.pop({int(ref)}, None)" for ref in frees[index]]
    if calls:
        lines += _except
    lines.append(f"    return {end}")
    where = (
        f"<recording replay generated by dask_monarch/worker/plan.py: commands {start}-{end - 1}>"
    )
    code = compile("\n".join(lines), where, "exec")
    exec(code, names)
    return names.pop("replay_plan")  # no cycle through its own globals: freed with the plan


_except = [
    "    except FatalError:",
    "        raise",
    "    except BaseException as e:  # user code cannot kill a rank (SystemExit...)",
    "        return failed(lane, env, e, x)",
]


def _call_source(
    index: int, cmd: FastCall, freed: tuple[int, ...], names: dict[str, Any]
) -> list[str]:
    """One FastCall: what the interpreter does with it, its tuple unpacked into code; then
    the refs it is the last to name go, and its locals with them (a freed tensor is not
    kept until the piece returns)."""
    fn, template, slots, kwargs, result, message, _ = cmd
    names[f"f{index}"], names[f"c{index}"] = fn, message
    refs = {p: ref for p, ref in slots if type(p) is int}  # position -> ref id
    items = {p[0]: {} for p, _ in slots if type(p) is tuple}  # list argument -> {item: ref}
    for (i, j), ref in ((p, ref) for p, ref in slots if type(p) is tuple):
        items[i][j] = ref
    args, lookups, errored = [], "", ""
    for position, value in enumerate(template):
        if position in refs:
            lookups += f"; a{position} = env[{int(refs[position])}]"
            errored += f" or type(a{position}) is SeqError"
        elif position in items:  # a list or tuple naming refs: built afresh, refs looked up
            parts = []
            for j, item in enumerate(value):
                if j in items[position]:
                    parts.append(f"env[{int(items[position][j])}]")
                else:
                    names[f"k{index}_{position}_{j}"] = item
                    parts.append(f"k{index}_{position}_{j}")
            built = f"[{', '.join(parts)}]" if type(value) is list else f"({', '.join(parts)},)"
            lookups += f"; a{position} = {built}"
            errored += f" or SeqError in map(type, a{position})"
        else:
            names[f"k{index}_{position}"] = value
            args.append(f"k{index}_{position}")
            continue
        args.append(f"a{position}")
    if kwargs:
        names[f"kw{index}"] = kwargs
        args.append(f"**kw{index}")
    local = [f"a{p}" for p in (*refs, *items)]
    lines = [
        f"x = {index}{lookups}",
        f"if replay.error is not None{errored}:",
        f"    return {index}",
        f"x = {~index}; v = f{index}({', '.join(args)})",
    ]
    if result is None:
        lines.append(f"store(env, c{index}, None, v)")
    else:
        lines += [
            "if type(v) is Tensor:",
            f"    env[{int(result)}] = v",
            "else:",
            f"    store(env, c{index}, {int(result)}, v)",
        ]
    lines += [f"env.pop({int(ref)}, None)" for ref in freed]
    return [*lines, f"del {', '.join([*local, 'v'])}"]


def _failed(lane: Any, env: dict, plan: list, frees: list, exc: BaseException, x: int) -> int:
    """Where the interpreter goes on after an exception in a run of calls (see _piece)."""
    if x >= 0:  # an argument is missing: the interpreter reports it
        return x
    index = ~x
    message = plan[index][5]
    call_failed(lane, message.seq, message.results, message.mutates, exc)
    for ref in frees[index]:
        env.pop(ref, None)
    return index + 1


def store(env: dict, message: m.CallFunction, result: int | None, value: Any) -> None:
    """Bind a call's value: several results from a container, else its one result (as
    the handler binds them: the same errors)."""
    if isinstance(value, (list, tuple, dict)) or len(message.results) != 1:
        bind_results(env, message.results, value)
    elif result is not None:
        env[result] = value
