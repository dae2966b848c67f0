"""Every worker message of the seed has a behavioural test that checks its effect."""

import importlib.util
import pathlib

from dask_monarch import messages as m


def test_every_worker_message_is_exercised_by_a_behavioural_test():
    exercised: dict[type, list[str]] = {}
    tests = pathlib.Path(__file__).parents[1]
    for path in sorted(tests.rglob("test_*.py")):
        spec = importlib.util.spec_from_file_location(f"coverage_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, fn in vars(module).items():
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "exercises":
                    for message in mark.args:
                        exercised.setdefault(message, []).append(f"{path.name}::{name}")
    names = {cls.__name__ for cls in m.WORKER_MESSAGES}
    assert set(exercised) <= names, f"unknown message names: {set(exercised) - names}"
    missing = sorted(names - set(exercised))
    assert not missing, f"worker messages without a behavioural test: {missing}"
