"""Running a test's functions in threads at once, to bring out a race."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def race(*targets: Callable[[], None]) -> list[BaseException]:
    """Run each of ``targets`` in a thread of its own, all at once, with CPython switching
    threads as often as it can (a race then shows in a fraction of a second); return what
    they raised."""
    errors: list[BaseException] = []

    def run(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:  # noqa: B036 - the test reports it
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    return errors
