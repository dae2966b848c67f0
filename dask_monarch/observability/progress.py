"""The progress line of ``dask-monarch run``: this process's live controllers, on one line.

It reads :meth:`Controller.progress` of every live controller (messages
sent, segments done, broken or not) from a daemon thread, so the script
being run never waits on the display. Settings: ``dask_monarch.cli.
progress-interval`` (refresh) and ``dask_monarch.cli.progress-delay`` (a
short run shows no line at all). While a rank is paused in pdb the line
says so, and on a terminal it is erased and not redrawn: the debugger
session owns the terminal then (docs/debugging.md).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TextIO

logger = logging.getLogger(__name__)


class ProgressLine:
    """A one-line summary of this process's live controllers, refreshed on ``stream``.

    On a terminal the line is redrawn in place and erased at the end;
    elsewhere (``--progress`` into a file) a line is written when it changes.
    It appears once the run has lasted ``dask_monarch.cli.progress-delay``.
    """

    def __init__(
        self, stream: TextIO, interval: float | None = None, delay: float | None = None
    ) -> None:
        from .. import config

        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.interval = interval or config.seconds("cli.progress-interval") or 0.5
        self.delay = config.seconds("cli.progress-delay") if delay is None else delay
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name="dask-monarch-progress"
        )
        self._start = time.monotonic()
        self._last = (self._start, 0)
        self._shown = ""

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.tty and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def line(self) -> str:
        """The text of the line now."""
        return self._measure()[1]

    def _measure(self) -> tuple[tuple, str]:
        from ..controller.controller import live_controllers

        stats = [c.progress() for c in live_controllers()]
        now = time.monotonic()
        messages = sum(s["messages"] for s in stats)
        then, before = self._last
        rate = (messages - before) / (now - then) if now > then else 0.0
        self._last = (now, messages)
        done = sum(s["segments_done"] for s in stats)
        total = sum(s["segments"] for s in stats)
        broken = sum(1 for s in stats if s["state"] == "broken")
        paused = sum(s.get("paused", 0) for s in stats)
        elapsed = int(now - self._start)
        text = (
            f"dask-monarch: {len(stats)} mesh{'es' if len(stats) != 1 else ''}, "
            f"{messages:,} messages ({rate:,.0f}/s), {done:,}/{total:,} tasks done, "
            f"{elapsed // 60}:{elapsed % 60:02d} elapsed"
        )
        if broken:
            text += f", {broken} broken"
        if paused:
            text += f", {paused} paused in the debugger"
        return (len(stats), messages, done, total, broken, paused), text

    def _loop(self) -> None:
        shown = None
        while not self._stop.wait(self.interval):
            if time.monotonic() - self._start < self.delay:
                continue
            try:
                key, text = self._measure()
            except Exception as e:  # a display must never fail the run
                logger.debug("progress line skipped a refresh: %r", e)
                continue
            if self.tty and key[-1]:  # a pdb session may own the terminal: leave it alone
                if self._shown:
                    self.stream.write("\r\x1b[K")
                    self._shown = ""
                    self.stream.flush()
                continue
            if self.tty:
                self.stream.write("\r" + text + "\x1b[K")
            elif key != shown:  # a log file gets a line per change, not per tick
                self.stream.write(text + "\n")
            else:
                continue
            shown, self._shown = key, text
            self.stream.flush()
