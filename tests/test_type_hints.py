"""Every public function of the package has type hints (parameters and return).

Public means: a module-level function or a method of a public class whose name
does not start with ``_`` (``__init__`` included, its return exempt). Checked
from the source with ``ast``, so a new unannotated function fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dask_monarch"


def _unannotated(path: Path) -> list[str]:
    found = []

    def visit(node: ast.AST, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                if not child.name.startswith("_"):
                    visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if child.name.startswith("_") and child.name != "__init__":
                    continue
                args = child.args
                params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
                if owner and params and params[0].arg in ("self", "cls"):
                    params = params[1:]
                params += [a for a in (args.vararg, args.kwarg) if a is not None]
                missing = [a.arg for a in params if a.annotation is None]
                if child.returns is None and child.name != "__init__":
                    missing.append("return")
                if missing:
                    name = f"{owner}.{child.name}" if owner else child.name
                    found.append(
                        f"{path.relative_to(PACKAGE.parent)}:{child.lineno} {name} {missing}"
                    )

    visit(ast.parse(path.read_text()), None)
    return found


def test_public_functions_are_annotated():
    missing = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _unannotated(path)]
    assert missing == [], "public functions without type hints:\n" + "\n".join(missing)
