"""``dask-monarch debug``: list the ranks paused in pdb on a cluster, attach to one, resume all.

A shell on stdin, like Monarch's debugger client: ``list``, ``attach RANK``
(or ``attach MESH:RANK`` when several meshes paused that rank),
``continue`` and ``quit``. While attached, every line goes to the rank's pdb
until ``c`` or ``q`` ends the session; ``detach`` (or EOF) returns to the
shell and leaves the rank paused. It is a plain Dask client of the
scheduler: the sessions are driven through ``Client.run``
(:mod:`dask_monarch.controller.debugging`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

from ..controller.debugging import Paused, continue_all, drive, paused, wait_for

PROMPT = "dask_monarch debug> "
HELP = """commands:
  list                 the ranks paused in the debugger (rank, stream, seq, mesh, where)
  attach RANK [SECS]   drive RANK's pdb (waits SECS, default 0, for it to pause); also
                       attach MESH:RANK. 'detach' returns here, leaving it paused
  continue             resume every paused rank ('c' in each)
  quit                 leave (paused ranks stay paused)"""


def table(found: list[Paused]) -> list[str]:
    """``list``'s lines: one per paused lane."""
    if not found:
        return ["no rank is paused in the debugger"]
    return [
        f"  rank {p.rank:<3} {p.stream_title:<18} seq {p.seq:<6} mesh {p.mesh}  {p.where}"
        for p in found
    ]


class Shell:
    """The ``dask-monarch debug`` loop over ``stdin``/``stdout``."""

    def __init__(self, client: Any, stdin: TextIO, stdout: TextIO) -> None:
        self.client = client
        self.stdin = stdin
        self.stdout = stdout
        self.prompt = PROMPT if stdin.isatty() else ""

    def write(self, text: str) -> None:
        self.stdout.write(text)
        self.stdout.flush()

    def readline(self) -> str | None:
        self.write(self.prompt)
        line = self.stdin.readline()
        return None if line == "" else line.rstrip("\n")

    def run(self) -> int:
        self.write("dask_monarch debugger: 'help' lists the commands\n")
        while True:
            line = self.readline()
            if line is None:
                return 0
            words = line.split()
            if not words:
                continue
            command, args = words[0], words[1:]
            handler: Callable[[list[str]], bool | None] | None = getattr(
                self, f"do_{command}", None
            )
            if handler is None:
                self.write(f"unknown command {command!r}\n{HELP}\n")
                continue
            try:
                if handler(args):
                    return 0
            except (TimeoutError, ValueError) as e:
                self.write(f"{e}\n")

    def do_help(self, args: list[str]) -> None:
        self.write(HELP + "\n")

    def do_list(self, args: list[str]) -> None:
        self.write("\n".join(table(paused(self.client))) + "\n")

    def do_attach(self, args: list[str]) -> None:
        if not args:
            raise ValueError("attach RANK (or MESH:RANK) [SECONDS]")
        mesh, _, rank = args[0].rpartition(":")
        if not rank.isdigit():
            raise ValueError(f"attach: {args[0]!r} is no rank")
        wait = float(args[1]) if len(args) > 1 else 0.0
        target = wait_for(self.client, mesh or None, int(rank), wait)
        others = {p.mesh for p in paused(self.client, None, int(rank))} - {target.mesh}
        if others and not mesh:
            raise ValueError(
                f"rank {rank} is paused for several meshes ({target.mesh}, "
                f"{', '.join(sorted(others))}): attach MESH:RANK"
            )

        def read() -> str:
            line = self.stdin.readline()
            if line == "" or line.strip() == "detach":
                raise EOFError
            return line.rstrip("\n")

        drive(self.client, target, None, write=self.write, read=read)
        self.write("\n")

    def do_continue(self, args: list[str]) -> None:
        resumed = continue_all(self.client)
        self.write(f"resumed {len(resumed)} paused lanes\n")

    do_c = do_continue

    def do_quit(self, args: list[str]) -> bool:
        return True

    do_q = do_exit = do_quit


def connect(scheduler_address: str | None, scheduler_file: str | None) -> Any:
    """A client of the scheduler (raises ``OSError`` when it cannot be reached)."""
    from distributed import Client

    if scheduler_file:
        return Client(scheduler_file=scheduler_file, set_as_default=False)
    return Client(scheduler_address, set_as_default=False)


def run(client: Any) -> int:
    """The shell on this process's stdin and stdout, driving ``client``'s cluster."""
    return Shell(client, sys.stdin, sys.stdout).run()


def main(scheduler_address: str | None, scheduler_file: str | None) -> int:
    """Connect to the scheduler and run the shell on this process's stdin and stdout."""
    with connect(scheduler_address, scheduler_file) as client:
        return run(client)
