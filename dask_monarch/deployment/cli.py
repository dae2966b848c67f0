"""The ``dask-monarch`` command (also ``dask monarch``): run a script on a mesh, look at a cluster.

::

    dask-monarch run train.py --lr 0.1                       # an embedded LocalMeshCluster
    dask-monarch run --ranks 4 --device cpu train.py
    dask-monarch run --scheduler-file sched.json train.py    # an existing Dask cluster
    dask-monarch info --scheduler-file sched.json            # its ranks: workers, resources, GPUs

The contract with a script: ``run`` creates a :class:`distributed.Client`
before the script starts and makes it the default client, so the script
finds it with ``distributed.default_client()`` — which is what
``dask_monarch.device_mesh(client=None, ...)`` does (and what a raw
``dask_monarch.Controller(distributed.default_client(), world_size=N)``
needs). The script runs as ``__main__`` (``python SCRIPT ARGS`` semantics:
``sys.argv == [SCRIPT, *ARGS]``, its directory first on ``sys.path``), or as
a module with ``-m``. Processes spawned while it runs (a restarted rank of
the embedded cluster, for one) do not re-import it, so a script needs no
``if __name__ == "__main__":`` guard for dask_monarch's sake.

Exit status: the script's own (``sys.exit``); 0 when it returns; 1 when it
raises; 3 for a :class:`dask_monarch.RemoteException` (a remote function
failed: its remote traceback is printed) and 4 for a
:class:`dask_monarch.DeviceException` (the mesh broke); 2 for a usage error.
The module imports nothing heavy at import time: ``dask`` loads every
``dask_cli`` entry point for each ``dask ...`` command.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, TextIO

import click

EXIT_ERROR = 1
EXIT_REMOTE = 3
EXIT_DEVICE = 4

RUN_HELP = """Run a Python SCRIPT (with its ARGS) on a dask_monarch mesh.

Without --scheduler-address/--scheduler-file, an embedded LocalMeshCluster
is started (--ranks, --device) and closed at the end. Before SCRIPT starts,
a distributed.Client to the cluster is created and made the default client:
scripts get it with distributed.default_client(), and
dask_monarch.device_mesh(client=None, ...) uses it.

SCRIPT runs as __main__ with sys.argv = [SCRIPT, *ARGS] (or as a module with
-m). Exit status: the script's own; 1 if it raised; 3 if it raised
dask_monarch.RemoteException (the remote traceback is printed); 4 for
dask_monarch.DeviceException.
"""


@click.group(name="monarch", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dask-monarch", prog_name="dask-monarch")
def cli() -> None:
    """dask_monarch: Monarch's single-controller tensor engine on Dask."""


# -- run -------------------------------------------------------------------------------------


@cli.command(help=RUN_HELP, context_settings={"ignore_unknown_options": True,
                                              "allow_interspersed_args": False})
@click.option("--ranks", "-n", type=click.IntRange(min=1), default=None,
              help="Embedded cluster: the number of ranks [default: one per visible GPU, else "
                   "dask_monarch.cli.cpu-ranks]. Existing cluster: wait for this many workers.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="Embedded cluster: GPU ranks, CPU ranks, or GPUs if "
                                      "there are enough.")
@click.option("--scheduler-address", default=None, metavar="ADDRESS",
              help="Use the running Dask cluster at ADDRESS (default: the dask config "
                   "'scheduler-address', i.e. DASK_SCHEDULER_ADDRESS, if set).")
@click.option("--scheduler-file", default=None, type=click.Path(dir_okay=False),
              help="Use the running Dask cluster described by this scheduler file.")
@click.option("--dashboard-address", default="127.0.0.1:0", show_default=True,
              help="Embedded cluster: where its dashboard listens ('' for none).")
@click.option("--progress/--no-progress", default=None,
              help="Show a progress line on stderr [default: when stderr is a terminal].")
@click.option("-m", "--module", "as_module", is_flag=True,
              help="SCRIPT is a module name, run like python -m.")
@click.option("--log-level", default=None,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
              help="Level of the dask_monarch loggers in this process (workers: the dask "
                   "config 'logging', or dask_monarch.logs.forward_worker_logs).")
@click.option("-q", "--quiet", is_flag=True, help="No information lines on stderr.")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(ranks: int | None, device: str, scheduler_address: str | None,
        scheduler_file: str | None, dashboard_address: str, progress: bool | None,
        as_module: bool, log_level: str | None, quiet: bool, script: str,
        args: tuple[str, ...]) -> None:
    if scheduler_address and scheduler_file:
        raise click.UsageError("give --scheduler-address or --scheduler-file, not both")
    if not as_module and not os.path.isfile(script):
        raise click.UsageError(f"no such script: {script}")
    if log_level:
        logging.getLogger("dask_monarch").setLevel(log_level.upper())
        _ensure_handler(logging.getLogger("dask_monarch"))
    import dask.config

    scheduler_address = scheduler_address or dask.config.get("scheduler-address", None)
    say = (lambda text: None) if quiet else (lambda text: click.echo(f"dask-monarch: {text}",
                                                                      err=True))
    if progress is None:
        progress = sys.stderr.isatty()
    with contextlib.ExitStack() as stack:
        if scheduler_address or scheduler_file:
            client = _connect(scheduler_address, scheduler_file, ranks)
            stack.enter_context(client)
            say(f"using the cluster at {client.scheduler.address} "
                f"({len(client.scheduler_info()['workers'])} workers)"
                + _dashboard_note(client))
        else:
            client = stack.enter_context(
                _embedded_client(ranks, device, dashboard_address or None))
            cluster = client.cluster
            say(f"{cluster.n_ranks} {cluster.device} ranks on an embedded cluster at "
                f"{cluster.scheduler_address}" + _dashboard_note(client))
        line = ProgressLine(sys.stderr) if progress else None
        if line is not None:
            line.start()
        try:
            code = run_script(script, args, as_module=as_module)
        finally:
            if line is not None:
                line.stop()
        _close_controllers(drain=code != 130)
    sys.exit(code)


def _dashboard_note(client) -> str:
    link = client.dashboard_link  # "" without a dashboard
    return f", dashboard {link.rsplit('/', 1)[0]}/monarch/" if link else ""


def _connect(address: str | None, scheduler_file: str | None, ranks: int | None):
    from distributed import Client

    from .. import config

    timeout = config.seconds("cli.wait-for-workers") or 60
    if scheduler_file is not None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(scheduler_file):  # a scheduler that is still starting
            if time.monotonic() > deadline:
                raise click.ClickException(f"no scheduler file at {scheduler_file}")
            time.sleep(0.2)
    try:
        if scheduler_file is not None:
            client = Client(scheduler_file=scheduler_file, set_as_default=True)
        else:
            client = Client(address, set_as_default=True)
    except OSError as e:
        where = address or f"the address in {scheduler_file}"
        raise click.ClickException(f"cannot reach the scheduler at {where}: {e}") from None
    if ranks:
        try:
            client.wait_for_workers(ranks, timeout=timeout)
        except TimeoutError:
            client.close()
            raise click.ClickException(
                f"the cluster has {len(client.scheduler_info()['workers'])} workers, "
                f"fewer than --ranks {ranks}, after {timeout:g}s") from None
    return client


@contextlib.contextmanager
def _embedded_client(ranks: int | None, device: str, dashboard_address: str | None):
    from distributed import Client

    from .. import config
    from .cluster import LocalMeshCluster, _visible_gpus

    if ranks is None and (device == "cpu" or not _visible_gpus()):
        if device == "cuda":
            raise click.ClickException("--device cuda but no GPU is visible")
        ranks = int(config.get("cli.cpu-ranks", 2))
        device = "cpu" if device == "auto" else device
    try:
        cluster = LocalMeshCluster(ranks, device=device, dashboard_address=dashboard_address)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    with cluster, Client(cluster, set_as_default=True) as client:
        yield client


def _close_controllers(drain: bool = True) -> None:
    """Close what the script left open before its cluster goes away.

    A controller drains its outstanding work first (up to
    ``dask_monarch.timeouts.close``), as the script's own ``close`` would;
    after Ctrl-C nothing drains and the workers free the state when this
    process's report streams close.
    """
    from ..controller.controller import live_controllers

    if not drain:  # the cluster closes under the controllers: that is expected, not news
        logging.getLogger("dask_monarch.controller").setLevel(logging.ERROR)
        return
    for controller in live_controllers():
        try:
            controller.close()
        except Exception as e:  # already reported by the controller; exit anyway
            logging.getLogger("dask_monarch.cli").info("closing %r: %s", controller, e)


# -- running the script ----------------------------------------------------------------------


def run_script(script: str, args: tuple[str, ...] | list[str], *, as_module: bool = False,
               stderr: TextIO | None = None) -> int:
    """Run ``script`` like ``python script args`` (or ``python -m``); return an exit status.

    Exceptions are printed like Python prints them (without this module's
    frames); a RemoteException also gets its remote traceback, and the
    status says which kind of failure it was (see the module docstring).
    """
    stderr = stderr or sys.stderr
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if as_module:
            sys.path.insert(0, os.getcwd())  # as python -m does, before looking it up
            code = _module_code(script)
            path = code.co_filename
            sys.argv = [path, *args]
        else:
            path = os.path.abspath(script)
            with open(path, "rb") as f:
                code = compile(f.read(), path, "exec")
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(path))
        _exec_main(code, path)
    except SystemExit as e:
        return _exit_status(e.code, stderr)
    except KeyboardInterrupt:
        traceback.print_exc(file=stderr)
        return 130
    except BaseException as e:
        return report_exception(e, stderr)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _module_code(name: str):
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name}", name=name)
    if spec.submodule_search_locations is not None:  # a package: run its __main__
        return _module_code(f"{name}.__main__")
    return spec.loader.get_code(name)


def _exec_main(code, path: str) -> None:
    """Execute ``code`` as the ``__main__`` module, as ``python path`` would.

    Its ``__spec__`` is named ``__main__``, which tells multiprocessing's
    spawn not to re-run the script in child processes (a nanny restarting a
    rank of the embedded cluster spawns one from this process).
    """
    import builtins
    import types

    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = builtins
    module.__spec__ = importlib.machinery.ModuleSpec("__main__", None, origin=path)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _exit_status(code: Any, stderr: TextIO) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return EXIT_ERROR


def _in_chain(exc: BaseException, kind: type) -> BaseException | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def report_exception(exc: BaseException, stderr: TextIO) -> int:
    """Print ``exc`` as Python would (minus our own frames), plus what dask_monarch knows."""
    from ..exceptions import DeviceException, RemoteException

    tb = exc.__traceback__
    here = os.path.abspath(__file__)
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == here:
        tb = tb.tb_next  # the frames of run_script and _exec_main
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    stderr.write(text)
    remote = _in_chain(exc, RemoteException)
    if remote is not None:
        if remote.traceback and remote.traceback.strip() not in text:
            where = f" (rank {remote.rank})" if remote.rank is not None else ""
            stderr.write(f"\nRemote traceback{where}:\n{remote.traceback}")
        where = ", ".join(f"{k} {v}" for k, v in (("rank", remote.rank), ("seq", remote.seq))
                          if v is not None)
        stderr.write(f"\ndask-monarch: a remote function failed{f' ({where})' if where else ''}"
                     "; the remote traceback is above\n")
        return EXIT_REMOTE
    device = _in_chain(exc, DeviceException)
    if device is not None:
        stderr.write(f"\ndask-monarch: the mesh broke: {device}\n")
        return EXIT_DEVICE
    return EXIT_ERROR


# -- progress --------------------------------------------------------------------------------


class ProgressLine:
    """A one-line summary of this process's live controllers, refreshed on ``stream``.

    On a terminal the line is redrawn in place and erased at the end;
    elsewhere (``--progress`` into a file) a line is written when it changes.
    It appears once the run has lasted ``dask_monarch.cli.progress-delay``.
    """

    def __init__(self, stream: TextIO, interval: float | None = None,
                 delay: float | None = None):
        from .. import config

        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.interval = interval or config.seconds("cli.progress-interval") or 0.5
        self.delay = config.seconds("cli.progress-delay") if delay is None else delay
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="dask-monarch-progress")
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
        elapsed = int(now - self._start)
        text = (f"dask-monarch: {len(stats)} mesh{'es' if len(stats) != 1 else ''}, "
                f"{messages:,} messages ({rate:,.0f}/s), {done:,}/{total:,} tasks done, "
                f"{elapsed // 60}:{elapsed % 60:02d} elapsed")
        if broken:
            text += f", {broken} broken"
        return (len(stats), messages, done, total, broken), text

    def _loop(self) -> None:
        shown = None
        while not self._stop.wait(self.interval):
            if time.monotonic() - self._start < self.delay:
                continue
            try:
                key, text = self._measure()
            except Exception:  # a display must never fail the run
                continue
            if self.tty:
                self.stream.write("\r" + text + "\x1b[K")
            elif key != shown:  # a log file gets a line per change, not per tick
                self.stream.write(text + "\n")
            else:
                continue
            shown, self._shown = key, text
            self.stream.flush()


# -- info ------------------------------------------------------------------------------------


@cli.command()
@click.option("--scheduler-address", default=None, metavar="ADDRESS",
              help="The cluster's scheduler (default: the dask config 'scheduler-address').")
@click.option("--scheduler-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The cluster's scheduler file.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def info(scheduler_address: str | None, scheduler_file: str | None, as_json: bool) -> None:
    """Print the ranks of a running cluster: workers, resources, GPUs, meshes."""
    import json

    import dask.config
    from distributed import Client

    from ..controller.placement import natural_key
    from ..worker.plugin import describe_worker

    scheduler_address = scheduler_address or dask.config.get("scheduler-address", None)
    if not (scheduler_address or scheduler_file):
        raise click.UsageError("give --scheduler-address or --scheduler-file")
    if scheduler_file:
        client = Client(scheduler_file=scheduler_file, set_as_default=False)
    else:
        client = Client(scheduler_address, set_as_default=False)
    with client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        described = client.run(describe_worker)
        meshes = client.run(_meshes_held)
        rows = []
        for address, w in workers.items():
            d = described.get(address, {})
            rows.append({
                "name": str(w.get("name")), "address": address,
                "resource": d.get("resource"), "nthreads": w.get("nthreads"),
                "memory_limit": w.get("memory_limit"), "gpus": d.get("gpus"),
                "plugin": d.get("has_plugin", False), "meshes": meshes.get(address, []),
                "resources": w.get("resources", {}),
            })
        rows.sort(key=lambda r: (r["resource"] is None, natural_key(r["resource"] or r["name"])))
        link = client.dashboard_link
        scheduler = client.scheduler.address
    if as_json:
        click.echo(json.dumps({"scheduler": scheduler, "dashboard": link, "workers": rows},
                              indent=2, default=str))
        return
    from dask.utils import format_bytes

    click.echo(f"scheduler {scheduler}, {len(rows)} workers"
               + (f", dashboard {link.rsplit('/', 1)[0]}/monarch/" if link else ""))
    header = ("worker", "address", "rank resource", "threads", "memory", "GPUs", "plugin",
              "meshes")
    table = [header] + [
        (r["name"], r["address"], r["resource"] or "-", str(r["nthreads"]),
         format_bytes(r["memory_limit"]) if r["memory_limit"] else "-", str(r["gpus"]),
         "yes" if r["plugin"] else "no", ", ".join(r["meshes"]) or "-")
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def _meshes_held(dask_worker=None) -> list[str]:
    plugin = dask_worker.plugins.get("dask_monarch")
    ranks = getattr(plugin, "ranks", {}) if plugin is not None else {}
    return [f"{token} (rank {state.rank})" for token, state in list(ranks.items())]


def _ensure_handler(logger: logging.Logger) -> None:
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)


def main() -> None:
    """The ``dask-monarch`` console script."""
    cli(prog_name="dask-monarch")


if __name__ == "__main__":
    main()
