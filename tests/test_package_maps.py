"""The package docstrings and docs/architecture.md map the code as it is.

Each package's docstring names every module of its folder (a reader finds a
concept from its package's map), and the processes-and-threads table of
docs/architecture.md names every module that starts a thread, and only modules
that exist.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dask_monarch"
PACKAGES = ["", "controller", "worker", "protocol", "protocol/messages", "deployment"]
PACKAGES.append("observability")


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p or "dask_monarch")
def test_every_package_docstring_names_each_of_its_modules(package):
    folder = PACKAGE / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    names = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
    names += [p.parent.name for p in folder.glob("*/__init__.py")]
    missing = [n for n in names if f"``{n}``" not in doc and f":mod:`.{n}`" not in doc]
    assert not missing, f"{folder.relative_to(ROOT)}/__init__.py does not name {missing}"


def _table() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text.split("## Processes and threads", 1)[1].split("\n## ", 1)[0]


def test_every_module_that_starts_a_thread_is_in_the_processes_table():
    table = _table()
    starts = re.compile(r"threading\.Thread\(|ThreadPoolExecutor\(")
    modules = [
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if starts.search(p.read_text())
    ]
    assert modules
    missing = [m for m in modules if f"`{m}`" not in table]
    assert not missing, f"docs/architecture.md, Processes and threads, does not name {missing}"


def test_the_processes_table_names_only_modules_that_exist():
    named = re.findall(r"\| `([\w/]+\.py)`|, `([\w/]+\.py)`", _table())
    named = [a or b for a, b in named]
    assert named
    assert [m for m in named if not (PACKAGE / m).is_file()] == []
