"""Every worker message of the seed has a behavioural test that checks its effect.

The ``exercises`` marks are read from the test files' source with ``ast``
(importing them would need each folder's own conftest and helpers on the path).
"""

import ast
import pathlib

from dask_monarch import messages as m


def _exercised(path: pathlib.Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith(
                "mark.exercises"
            ):
                for arg in decorator.args:
                    found.setdefault(ast.literal_eval(arg), []).append(f"{path.name}::{node.name}")
    return found


def test_every_worker_message_is_exercised_by_a_behavioural_test():
    exercised: dict[str, list[str]] = {}
    tests = pathlib.Path(__file__).parents[1]
    for path in sorted(tests.rglob("test_*.py")):
        for message, where in _exercised(path).items():
            exercised.setdefault(message, []).extend(where)
    names = {cls.__name__ for cls in m.WORKER_MESSAGES}
    assert set(exercised) <= names, f"unknown message names: {set(exercised) - names}"
    missing = sorted(names - set(exercised))
    assert not missing, f"worker messages without a behavioural test: {missing}"
