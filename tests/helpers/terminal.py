"""A command run on a pseudo-terminal, and what a terminal shows of its output."""

from __future__ import annotations

import os
import pty
import select
import subprocess
from pathlib import Path


def run_on_a_terminal(args: list[str], cwd: Path, env: dict | None = None) -> tuple[int, str]:
    """Run ``args`` with stdout and stderr on one pseudo-terminal; (exit status, raw output)."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower
    )
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 1)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the terminal closed with the process
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    os.close(leader)
    return process.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def terminal_lines(raw: str) -> list[str]:
    """What a terminal shows for ``raw``: carriage returns, erase-to-end-of-line, newlines."""
    lines, line, col = [], [], 0
    i = 0
    while i < len(raw):
        if raw.startswith("\x1b[K", i):
            del line[col:]
            i += 3
            continue
        ch = raw[i]
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line))
            line, col = [], 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
        i += 1
    if line:
        lines.append("".join(line))
    return lines
