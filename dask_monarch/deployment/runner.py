"""What ``dask-monarch run`` does: give a script a cluster and a default client, run it, exit.

The contract with a script: a :class:`distributed.Client` is created before
the script starts and made the default client, so the script finds it with
``distributed.default_client()`` — which is what
``dask_monarch.device_mesh(client=None, ...)`` does (and what a raw
``dask_monarch.Controller(distributed.default_client(), world_size=N)``
needs). The script runs as ``__main__`` (``python SCRIPT ARGS`` semantics:
``sys.argv == [SCRIPT, *ARGS]``, its directory first on ``sys.path``), or as
a module with ``-m``. Processes spawned while it runs (a restarted rank of
the embedded cluster, for one) do not re-import it, so a script needs no
``if __name__ == "__main__":`` guard for dask_monarch's sake.

With ``max_restarts`` (``--max-restarts N``), a run whose mesh broke (status
4) runs again, up to N times, once the cluster has its ranks again
(:mod:`.restarts`): the script resumes from its own checkpoint, and reads
which run it is from ``DASK_MONARCH_RESTART`` (0 first; set for every run).

Exit status: the script's own (``sys.exit``); 0 when it returns; 1 when it
raises; 3 for a :class:`dask_monarch.RemoteException` (a remote function
failed: its remote traceback is printed) and 4 for a
:class:`dask_monarch.DeviceException` (the mesh broke). (2, a usage error,
is the command line's.) A failure nobody fetched, on a mesh the script
left without ``mesh.exit()``, is reported when the script ends and turns a
status of 0 into 3 (4 if the mesh broke). Problems found before the script starts (no
scheduler, too few workers, no GPU) raise :class:`SetupError`.

Only the standard library is imported at import time; Dask and the
controller come with the first run.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import itertools
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from types import CodeType

    from distributed import Client, Security

EXIT_ERROR = 1
EXIT_REMOTE = 3
EXIT_DEVICE = 4
EXIT_INTERRUPTED = 130
INTERRUPTED_CLOSE_S = 2  # after Ctrl-C the client and the cluster each get this long to close


class SetupError(Exception):
    """The run could not start: its cluster is unreachable, too small or impossible."""


def run(
    script: str,
    args: Sequence[str],
    *,
    as_module: bool = False,
    ranks: int | None = None,
    device: str = "auto",
    scheduler_address: str | None = None,
    scheduler_file: str | None = None,
    dashboard_address: str | None = None,
    progress: bool = False,
    say: Callable[[str], None] = lambda text: None,
    security: Security | None = None,
    max_restarts: int = 0,
) -> int:
    """Run ``script`` on an existing cluster, or on an embedded one; return its exit status.

    With ``scheduler_address`` or ``scheduler_file`` the cluster exists (wait
    for ``ranks`` workers); otherwise a LocalMeshCluster of ``ranks``
    ``device`` ranks starts here and closes at the end. ``say`` receives the
    information lines (where the cluster and its dashboard are). ``security``
    (:func:`security_for`): every comm is ``tls://``. ``max_restarts``: a run
    that ends with a broken mesh (exit status 4) runs again, up to this many
    times, once the cluster has as many workers as at the start
    (:mod:`.restarts`; the script reads ``DASK_MONARCH_RESTART``).
    """
    from ..controller.placement import registered_workers
    from ..controller.session import live_sessions
    from ..observability.progress import ProgressLine
    from . import restarts
    from .cluster_info import dashboard_note, monarch_page

    existing = bool(scheduler_address or scheduler_file)
    cpu_ranks = not existing and ranks is None
    check_settings(
        existing=existing, cpu_ranks=cpu_ranks, progress=progress, restarts=max_restarts > 0
    )
    with contextlib.ExitStack() as stack:
        if scheduler_address or scheduler_file:
            client = _connect(scheduler_address, scheduler_file, ranks, security)
            stack.enter_context(client)
            say(
                f"using the cluster at {client.scheduler.address} "
                f"({len(registered_workers(client))} workers)"
                + dashboard_note(client.dashboard_link, monarch_page(client))
            )
        else:
            client = stack.enter_context(
                _embedded_client(ranks, device, dashboard_address, security, say, progress)
            )
            cluster = client.cluster
            # Without a dashboard Dask's scheduler still listens for HTTP (no page of its own
            # or ours): there is nothing to link to.
            link = client.dashboard_link if dashboard_address is not None else None
            say(
                f"{cluster.n_ranks} {cluster.device} ranks on an embedded cluster at "
                f"{cluster.scheduler_address}" + dashboard_note(link, link and monarch_page(client))
            )
        embedded = client.cluster is not None and hasattr(client.cluster, "n_ranks")
        n = client.cluster.n_ranks if embedded else ranks or len(registered_workers(client))
        for restart in itertools.count():
            restarts.set_run(restart)
            line = ProgressLine(sys.stderr) if progress else None
            if line is not None:
                line.start()
            caught: list[BaseException] = []
            try:
                code = run_script(script, args, as_module=as_module, caught=caught)
            finally:
                if line is not None:
                    line.stop()
            if code == EXIT_INTERRUPTED:
                break
            cause = restarts.restart_cause(caught[0]) if caught and code == EXIT_DEVICE else None
            if cause is not None:  # told already: close its meshes quietly
                restarts.close_sessions([s for s in live_sessions() if s.controller.broken])
            code = _exit_meshes(code, sys.stderr)
            _close_controllers()
            if cause is None or restart >= max_restarts:
                if restart:
                    say(f"the script ran {restart + 1} times ({restart} restarts)")
                return code
            say(
                f"the mesh broke ({restarts.describe(cause)}): restart {restart + 1} of "
                f"{max_restarts}; waiting for {n} ranks"
            )
            try:
                restarts.wait_for_ranks(client, n, say)
            except TimeoutError as e:
                say(f"not restarting: {e}")
                return code
        with _second_interrupt_exits():  # the cluster closes now, quietly and promptly
            _quiet_dask(client, embedded=client.cluster is not None)
            _close_controllers(drain=False)
            for close in (client.close, getattr(client.cluster, "close", None)):
                if close is not None:
                    try:
                        close(timeout=INTERRUPTED_CLOSE_S)
                    except Exception as e:  # exiting anyway: the processes end with us
                        logging.getLogger("dask_monarch.cli").debug("closing: %r", e)
    return code


def check_settings(*, existing: bool, cpu_ranks: bool, progress: bool, restarts: bool) -> None:
    """Read the settings this run will read, before anything starts: a bad value is a
    :class:`SetupError` (one line), not a traceback halfway through the run (or, for
    ``elastic.wait-for-ranks``, after the script ran and its mesh broke)."""
    from .. import config

    durations = [
        *(["cli.wait-for-workers"] if existing else []),
        *(["cli.progress-interval", "cli.progress-delay"] if progress else []),
        *(["elastic.wait-for-ranks"] if restarts else []),
    ]
    try:
        for key in durations:
            config.seconds(key)
        if cpu_ranks:
            config.integer("cli.cpu-ranks", minimum=1)
    except ValueError as e:
        raise SetupError(str(e)) from None


def security_for(
    ca_file: str | None, cert: str | None, key: str | None, temporary: bool = False
) -> Security | None:
    """The TLS settings of ``--tls-ca-file/--tls-cert/--tls-key`` or ``--tls-temporary``.

    One certificate serves every role (scheduler, workers, client), as
    ``Security.temporary()`` does; None when no TLS option was given.
    """
    from distributed import Security

    if temporary:
        try:
            return Security.temporary()
        except ImportError as e:
            raise SetupError(f"--tls-temporary: {e}") from None
    if not (ca_file or cert or key):
        return None
    if not (ca_file and cert and key):
        raise SetupError("TLS needs a CA file, a certificate and its key together")
    return Security(
        tls_ca_file=ca_file,
        tls_client_cert=cert,
        tls_client_key=key,
        tls_scheduler_cert=cert,
        tls_scheduler_key=key,
        tls_worker_cert=cert,
        tls_worker_key=key,
        require_encryption=True,
    )


def _connect(
    address: str | None,
    scheduler_file: str | None,
    ranks: int | None,
    security: Security | None = None,
) -> Client:
    from distributed import Client

    from .. import config
    from ..controller.placement import registered_workers

    timeout = config.seconds("cli.wait-for-workers") or 60
    if scheduler_file is not None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(scheduler_file):  # a scheduler that is still starting
            if time.monotonic() > deadline:
                raise SetupError(f"no scheduler file at {scheduler_file}")
            time.sleep(0.2)
    try:
        if scheduler_file is not None:
            client = Client(scheduler_file=scheduler_file, set_as_default=True, security=security)
        else:
            client = Client(address, set_as_default=True, security=security)
    except OSError as e:
        where = address or f"the address in {scheduler_file}"
        raise SetupError(f"cannot reach the scheduler at {where}: {e}") from None
    if ranks:
        try:
            client.wait_for_workers(ranks, timeout=timeout)
        except TimeoutError:
            have = len(registered_workers(client))  # before closing
            client.close()
            raise SetupError(
                f"the cluster has {have} worker{'s' if have != 1 else ''}, fewer than "
                f"--ranks {ranks}, after waiting {timeout:g}s: start more workers, or "
                "ask for fewer ranks"
            ) from None
    return client


@contextlib.contextmanager
def _embedded_client(
    ranks: int | None,
    device: str,
    dashboard_address: str | None,
    security: Security | None = None,
    say: Callable[[str], None] = lambda text: None,
    progress: bool = False,
) -> Iterator:
    from distributed import Client

    from .. import config
    from ..observability.progress import StartupLine
    from .cluster import LocalMeshCluster
    from .workers import visible_gpus

    gpus = [] if device == "cpu" else visible_gpus()
    if ranks is None and not gpus:
        if device == "cuda":
            raise SetupError("--device cuda but no GPU is visible")
        ranks = config.integer("cli.cpu-ranks", minimum=1)
    ranks = len(gpus) if ranks is None else ranks
    if device == "auto":  # as LocalMeshCluster chooses
        device = "cuda" if gpus and len(gpus) >= ranks else "cpu"
    say(f"starting an embedded cluster of {ranks} {device} ranks (a worker process each)")
    try:
        with StartupLine(sys.stderr, ranks, device) if progress else contextlib.nullcontext():
            cluster = LocalMeshCluster(
                ranks, device=device, dashboard_address=dashboard_address, security=security
            )
    except ValueError as e:
        raise SetupError(str(e)) from None
    with cluster, Client(cluster, set_as_default=True) as client:
        yield client


def _exit_meshes(code: int, stderr: TextIO) -> int:
    """Exit the meshes the script left open, as ``mesh.exit()`` would: a remote failure
    nobody fetched is reported, and a script that otherwise succeeded exits non-zero."""
    from ..controller.session import live_sessions

    for session in live_sessions():
        try:
            session.exit()
        except Exception as e:
            stderr.write(
                "dask-monarch: the script ended with a failure nobody fetched on a mesh "
                "it did not exit:\n"
            )
            status = report_exception(e, stderr)
            stderr.write(
                "dask-monarch: fetch results (dask_monarch.inspect) or call mesh.exit() "
                "in the script to see failures where they happen\n"
            )
            stderr.flush()
            code = code or status
    return code


def _close_controllers(drain: bool = True) -> None:
    """Close what the script left open before its cluster goes away.

    A controller drains its outstanding work first (up to
    ``dask_monarch.timeouts.close``), as the script's own ``close`` would;
    after Ctrl-C nothing drains: each releases its ranks at once (on a shared
    cluster too), before the client and the cluster close.
    """
    from ..controller.controller import live_controllers

    if not drain:  # whatever breaks while closing after Ctrl-C is expected, not news
        logging.getLogger("dask_monarch.controller").setLevel(logging.ERROR)
    for controller in live_controllers():
        try:
            controller.close(timeout=None if drain else 0)
        except Exception as e:  # already reported by the controller; exit anyway
            logging.getLogger("dask_monarch.cli").info("closing %r: %s", controller, e)


def _quiet_dask(client: Client, embedded: bool) -> None:
    """After Ctrl-C, the cluster's own shutdown chatter (closed comms, cancelled tasks) is
    not the user's news: one line said what happened. The workers of an embedded cluster
    (they write to this terminal) are quieted too; a shared cluster's are left alone."""
    _quiet_loggers()
    if embedded:
        try:
            client.run(_quiet_loggers)
        except Exception as e:  # only cosmetic
            logging.getLogger("dask_monarch.cli").debug("quieting the workers: %r", e)


def _quiet_loggers() -> None:
    for name in ("distributed", "tornado", "asyncio"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


@contextlib.contextmanager
def _second_interrupt_exits() -> Iterator[None]:
    """While the cluster closes after Ctrl-C, a second Ctrl-C exits at once.

    The embedded scheduler then ends with this process (it watches its
    stdin) and the rank workers with their nannies' pipes.
    """
    import signal

    def exit_now(signum: int, frame: Any) -> None:
        os.write(2, b"dask-monarch: interrupted again; exiting without closing the cluster\n")
        os._exit(EXIT_INTERRUPTED)

    try:
        previous = signal.signal(signal.SIGINT, exit_now)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# -- running the script in this process ------------------------------------------------------


def run_script(
    script: str,
    args: Sequence[str],
    *,
    as_module: bool = False,
    stderr: TextIO | None = None,
    caught: list[BaseException] | None = None,
) -> int:
    """Run ``script`` like ``python script args`` (or ``python -m``); return an exit status.

    Exceptions are printed like Python prints them (without this module's
    frames); a RemoteException also gets its remote traceback, and the
    status says which kind of failure it was (see the module docstring).
    ``caught`` receives the exception the script ended with, if any.
    """
    stderr = stderr or sys.stderr
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    path = script
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
        with _interrupts_never_lost():
            _exec_main(code, path)
    except SystemExit as e:
        return _exit_status(e.code, stderr)
    except KeyboardInterrupt as e:
        where = _script_frame(e, path)
        stderr.write(
            f"dask-monarch: interrupted (Ctrl-C){where}; releasing the ranks and stopping\n"
        )
        stderr.flush()
        return EXIT_INTERRUPTED
    except BaseException as e:
        if caught is not None:
            caught.append(e)
        return report_exception(e, stderr)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


@contextlib.contextmanager
def _interrupts_never_lost() -> Iterator[None]:
    """A Ctrl-C that lands in a finalizer is raised again where the script goes on.

    Python only prints an exception raised in ``__del__``, a weakref callback
    or a GC callback (``sys.unraisablehook``): a KeyboardInterrupt raised there
    was lost, and a script that frees an object per step (every mesh tensor
    does) now and then ran on after Ctrl-C. Here nothing is printed for it; it
    is raised again at the script's next line outside any ``__del__`` (a trace
    function, set only until then, raises it: raising it from the hook would
    land in the hook, and a timer might land in the next finalizer again).
    """
    previous = sys.unraisablehook
    tracer = sys.gettrace()  # a debugger's or coverage's, given back once raised
    armed = []

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous(unraisable)
            return
        caller = sys._getframe(1)  # what ran when the finalizer was called

        def raise_outside_finalizers(frame: Any, event: str, arg: Any) -> Any:
            if _in_finalizer(frame):
                return raise_outside_finalizers
            sys.settrace(tracer)
            caller.f_trace = None
            armed.clear()
            raise KeyboardInterrupt

        caller.f_trace, caller.f_trace_lines = raise_outside_finalizers, True
        sys.settrace(raise_outside_finalizers)  # frames' f_trace run only while tracing
        armed.append(True)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        if armed:
            sys.settrace(tracer)


def _in_finalizer(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _script_frame(exc: BaseException, path: str) -> str:
    """`` at train.py:12`` for the script's innermost frame in ``exc``'s traceback, or ''."""
    tb, where = exc.__traceback__, ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if os.path.abspath(code.co_filename) == os.path.abspath(path):
            where = f" at {os.path.basename(path)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _module_code(name: str) -> CodeType:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name}", name=name)
    if spec.submodule_search_locations is not None:  # a package: run its __main__
        return _module_code(f"{name}.__main__")
    return spec.loader.get_code(name)


def _exec_main(code: CodeType, path: str) -> None:
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


# -- reporting what the script raised --------------------------------------------------------


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
        where = ", ".join(
            f"{k} {v}" for k, v in (("rank", remote.rank), ("seq", remote.seq)) if v is not None
        )
        stderr.write(
            f"\ndask-monarch: a remote function failed{f' ({where})' if where else ''}"
            "; the remote traceback is above\n"
        )
        return EXIT_REMOTE
    device = _in_chain(exc, DeviceException)
    if device is not None:
        stderr.write(f"\ndask-monarch: the mesh broke: {device}\n")
        return EXIT_DEVICE
    return EXIT_ERROR
