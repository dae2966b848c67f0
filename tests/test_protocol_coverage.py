"""Every worker message of the seed has a behavioural test that checks its effect."""

import importlib
import pathlib

from dask_monarch import messages as m


def test_every_worker_message_is_exercised_by_a_behavioural_test():
    exercised: dict[type, list[str]] = {}
    for path in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
        module = importlib.import_module(path.stem)
        for name, fn in vars(module).items():
            for mark in getattr(fn, "pytestmark", []):
                if mark.name == "exercises":
                    for message in mark.args:
                        exercised.setdefault(message, []).append(f"{path.name}::{name}")
    names = {cls.__name__ for cls in m.WORKER_MESSAGES}
    assert set(exercised) <= names, f"unknown message names: {set(exercised) - names}"
    missing = sorted(names - set(exercised))
    assert not missing, f"worker messages without a behavioural test: {missing}"
