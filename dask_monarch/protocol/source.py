"""Functions sent by value keep their file name and their source lines.

cloudpickle renames the file of every code object it pickles to
``<dynamic-code>`` (so payloads do not depend on where a function was
defined), and a rank never has the file of a notebook cell (IPython keeps
cells in its own ``linecache``) nor, on another host, the user's script. So
a remote traceback, the dashboard's error rows, a rank's pause in pdb and
pdb's ``l``/``ll`` showed no line of the user's own code.

:func:`dumps` is cloudpickle with one change: each code object keeps its
file name and carries the lines of the user's source it spans (once per
span: a nested function's lines are in its outer function's). Loading it on
a rank (:func:`_code`) renames the code back and registers the lines in the
rank's ``linecache`` under that file name, unless the rank reads the same
lines from its own copy of the file. Entries are made as IPython makes its
cells' (no modification time), so ``linecache.checkcache`` keeps them.
"""

from __future__ import annotations

import io
import linecache
import types
from collections import ChainMap
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle

from . import tensor_bytes

_code_reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]


def dumps(obj: Any, protocol: int | None = None) -> bytes:
    """``cloudpickle.dumps(obj)``, with the file name and source lines of its code kept."""
    with io.BytesIO() as file:
        _SourcePickler(file, protocol=protocol).dump(obj)
        return file.getvalue()


class _SourcePickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, protocol: int | None = None) -> None:
        # the C pickler reads its dispatch table once, at construction; nothing in it refers
        # back to the pickler (a bound method would: a cycle that kept each pickle's memo, the
        # tensors it pickled among them, alive until the next garbage collection)
        ours = {types.CodeType: _CodeWithSource(), **tensor_bytes.REDUCERS}
        self.dispatch_table = ChainMap(ours, super().dispatch_table)
        super().__init__(file, protocol=protocol)


class _CodeWithSource:
    """Reduces a code object with its file name and the source lines it spans (once per span
    per pickle)."""

    def __init__(self) -> None:
        self.sent: dict[str, list[tuple[int, int]]] = {}  # file -> spans whose lines are sent

    def __call__(self, code: types.CodeType) -> tuple[Callable, tuple]:
        rebuild, args = _code_reduce(code)
        filename, first, text = code.co_filename, code.co_firstlineno, None
        last = max(_lines(code), default=first)
        sent = self.sent.setdefault(filename, [])
        if not any(a <= first and last <= b for a, b in sent):
            lines = linecache.getlines(filename)[first - 1 : last]
            if lines:
                text = "".join(lines)
                sent.append((first, last))
        return _code, (rebuild, args, filename, first, text)


def _lines(code: types.CodeType) -> Iterator[int]:
    """Every line number ``code`` and the code nested in it span."""
    positions = getattr(code, "co_positions", None)  # Python 3.11: end lines of statements too
    if positions is not None:
        for start, end, _, _ in positions():
            yield from (n for n in (start, end) if n is not None)
    else:
        yield from (n for _, _, n in code.co_lines() if n is not None)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _lines(const)


def _code(
    rebuild: Callable, args: tuple, filename: str, first: int, text: str | None
) -> types.CodeType:
    """Unpickling on a rank: the code object under its own file name, its lines known."""
    code = rebuild(*args)
    if code.co_filename != filename:
        code = code.replace(co_filename=filename)
    if text:
        remember(filename, first, text)
    return code


def remember(filename: str, first: int, text: str) -> None:
    """Make ``linecache`` show ``text`` as lines ``first...`` of ``filename`` (other lines kept)."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    end = first - 1 + len(lines)
    known = linecache.getlines(filename)  # a cached cell, or the rank's own copy of the file
    if known[first - 1 : end] == lines:
        return
    known = list(known) + ["\n"] * max(0, end - len(known))
    known[first - 1 : end] = lines
    linecache.cache[filename] = (sum(map(len, known)), None, known, filename)


__all__ = ["dumps", "remember"]
