"""Command-line values shared by ``dask-monarch worker`` and the preloads, checked by click.

A bad value must be a usage error naming the option: dask's own parsers
raise a bare ``KeyError``/``ValueError`` (a traceback on the command line),
and a preload's failure is only logged by Dask, which starts the worker
without it (no rank resource, no plugin), so the message is all the user
gets. Nothing heavy is imported here: ``dask`` loads the CLI for every
``dask ...`` command.
"""

from __future__ import annotations

from typing import Any

import click


class Duration(click.ParamType):
    """A duration of zero or more seconds (``0.001``, ``1ms``, ``2s``), as float seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            return value
        from dask.utils import parse_timedelta

        try:
            seconds = parse_timedelta(value, default="s")
        except (KeyError, ValueError, TypeError):
            self.fail(
                f"{value!r} is not a duration: give seconds (0.001) or a duration with a "
                "unit ('1ms', '2s')",
                param,
                ctx,
            )
        if seconds is None or not seconds >= 0:
            self.fail(f"{value!r}: a duration must be zero or more seconds", param, ctx)
        return float(seconds)


class MemoryLimit(click.ParamType):
    """``auto``, ``0``/``none`` (no limit: None) or a size (``16GB``, bytes) as an int."""

    name = "memory"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None or isinstance(value, int) or value == "auto":
            return value
        if str(value).strip().lower() in ("0", "none"):
            return None
        from dask.utils import parse_bytes

        try:
            return parse_bytes(value)
        except (KeyError, ValueError, TypeError):
            self.fail(
                f"{value!r} is not a size: give 'auto', bytes, or a size with a unit "
                "('16GB', '4GiB'); 0 or none for no limit",
                param,
                ctx,
            )


DURATION = Duration()
MEMORY_LIMIT = MemoryLimit()
