"""The progress line of ``dask-monarch run``: this process's live controllers, on one line.

It reads :meth:`Controller.progress` of every live controller (messages
sent, segments done, broken or not) from a daemon thread, so the script
being run never waits on the display. Settings: ``dask_monarch.cli.
progress-interval`` (refresh) and ``dask_monarch.cli.progress-delay`` (a
short run shows no line at all).

On a terminal the script's own output never lands on the line: while the
line runs, ``sys.stdout`` and ``sys.stderr`` (those that are terminals) are
wrapped, so each write first erases the line and, once the output ends with
a newline, draws it again below (what tqdm's ``write`` and rich's live
display do). The line is drawn only once a mesh has sent messages: its first
figures are real ones, never "0 meshes, 0 messages". While a rank is paused in pdb the line
says so, and on a terminal it is erased and not redrawn: the debugger
session owns the terminal then (docs/debugging.md).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, TextIO

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
        if delay is None:  # null: at once (a None here stopped the line's thread)
            delay = config.seconds("cli.progress-delay") or 0.0
        self.delay = delay
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name="dask-monarch-progress"
        )
        self._start = time.monotonic()
        self._last = (self._start, 0)
        self._shown = ""
        self._lock = threading.RLock()  # the terminal: the line and the script's writes
        self._on_screen = False  # the line is drawn now
        self._mid_line = False  # the script's output ended without a newline: do not draw
        self._wrapped: list[tuple[str, _AroundTheLine]] = []

    def start(self) -> None:
        if self.tty:  # the script's writes to this terminal erase and redraw the line
            for name in ("stdout", "stderr"):
                stream = getattr(sys, name)
                if getattr(stream, "isatty", lambda: False)():
                    wrapper = _AroundTheLine(stream, self)
                    setattr(sys, name, wrapper)
                    self._wrapped.append((name, wrapper))
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for name, wrapper in self._wrapped:
                if getattr(sys, name) is wrapper:  # unless the script replaced it since
                    setattr(sys, name, wrapper.inner)
            self._wrapped.clear()
            self._erase()

    # -- the terminal -------------------------------------------------------------------------

    def _erase(self) -> None:
        """Take the line off the screen (lock held)."""
        if self._on_screen:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._on_screen = False

    def _draw(self) -> None:
        """Put the line back, unless the script is in the middle of a line (lock held)."""
        if self._shown and not self._mid_line and not self._stop.is_set():
            self.stream.write("\r" + self._shown + "\x1b[K")
            self.stream.flush()
            self._on_screen = True

    def _around(self, inner: TextIO, text: str) -> int:
        """Write the script's ``text`` to ``inner`` with the line out of the way."""
        with self._lock:
            self._erase()
            written = inner.write(text)
            if text:
                inner.flush()
                self._mid_line = not text.endswith("\n")
                self._draw()
            return written

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
            if key[0] == 0 or key[1] == 0:
                continue  # no mesh, or no message yet: nothing real to show
            if self.tty and key[-1]:  # a pdb session may own the terminal: leave it alone
                with self._lock:
                    self._erase()
                    self._shown = ""
                continue
            if self.tty:
                with self._lock:
                    self._shown = text
                    self._draw()
                    continue
            if key != shown:  # a log file gets a line per change, not per tick
                self.stream.write(text + "\n")
                self.stream.flush()
                shown, self._shown = key, text


class _AroundTheLine:
    """A terminal stream of the script (``sys.stdout``/``sys.stderr``) that moves the progress
    line out of the way of each write; everything else is the stream's own."""

    def __init__(self, inner: TextIO, line: ProgressLine) -> None:
        self.inner = inner
        self._line = line

    def write(self, text: str) -> int:
        return self._line._around(self.inner, text)

    def writelines(self, lines: Any) -> None:
        for text in lines:
            self.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class StartupLine:
    """While ``dask-monarch run`` starts its embedded cluster: how many ranks are up, and for
    how long it has been starting (a cold start of torch in every rank takes seconds).

    The ranks are this process's nannies (one per rank worker, started here) that are
    running; on a terminal the line is redrawn in place and erased when the cluster is up,
    elsewhere a line is written each time another rank is up. Use it as a context manager
    around the cluster's start.
    """

    def __init__(self, stream: TextIO, ranks: int, device: str, interval: float = 0.5) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.ranks = ranks
        self.device = device
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="dask-monarch-start")
        self._start = time.monotonic()
        self._before: set[int] = set()
        self._on_screen = False

    def __enter__(self) -> StartupLine:
        self._before = {id(n) for n in _nannies()}
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._on_screen:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def stages(self) -> tuple[int, int]:
        """(worker processes started, ranks up: their worker registered) of this cluster."""
        from distributed.core import Status

        started = up = 0
        for nanny in _nannies():
            if id(nanny) in self._before:
                continue
            if nanny.status == Status.running:
                up += 1
            if getattr(getattr(nanny, "process", None), "process", None) is not None:
                started += 1
        return started, up

    def up(self) -> int:
        """The ranks of this cluster whose worker is running."""
        return self.stages()[1]

    def line(self) -> str:
        started, up = self.stages()
        elapsed = time.monotonic() - self._start
        if not started:  # the cluster starts its scheduler (a process of its own) first
            where = "the scheduler"
        else:
            where = f"{started} worker processes starting, {up} of {self.ranks} up"
        return f"dask-monarch: starting {self.ranks} {self.device} ranks: {where} ({elapsed:.0f}s)"

    def _loop(self) -> None:
        shown = 0
        while not self._stop.wait(self.interval):
            try:
                up, text = self.up(), self.line()
            except Exception as e:  # a display must never fail the run
                logger.debug("start-up line skipped a refresh: %r", e)
                continue
            if self.tty:
                self.stream.write("\r" + text + "\x1b[K")
                self._on_screen = True
            elif up != shown:
                self.stream.write(text + "\n")
            else:
                continue
            shown = up
            self.stream.flush()


def _nannies() -> list:
    """The nannies of this process (each starts and watches one worker process)."""
    from distributed import Nanny

    return list(getattr(Nanny, "_instances", ()))
