"""The test tree collects on a clean clone: pytest imports test modules by basename
(rootdir-style, no ``__init__.py``), so two ``test_x.py`` in different folders collide
("import file mismatch") and stop the whole run before a test starts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_test_module_basenames_are_unique() -> None:
    names = Counter(path.name for path in TESTS.rglob("*.py") if path.name != "conftest.py")
    repeated = {name: count for name, count in names.items() if count > 1}
    assert not repeated, f"test modules share a basename (rename one): {repeated}"
