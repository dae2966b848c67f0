"""The ``dask-monarch`` command (also ``dask monarch``): parses options and delegates.

::

    dask-monarch run train.py --lr 0.1                       # an embedded LocalMeshCluster
    dask-monarch run --ranks 4 --device cpu train.py
    dask-monarch run --scheduler-file sched.json train.py    # an existing Dask cluster
    dask-monarch run --tls-temporary train.py                # everything over tls://
    dask-monarch run --max-restarts 3 train.py               # again after a lost rank
    dask-monarch info --scheduler-file sched.json            # its ranks: workers, resources, GPUs
    dask-monarch debug --scheduler-file sched.json           # ranks paused in breakpoint(): attach
    dask-monarch worker tcp://sched:8786 --first-rank 0      # a rank worker per GPU of this node

``run`` is :func:`dask_monarch.deployment.runner.run` (the contract with a
script and the exit statuses are documented there; 2 is a usage error,
found here); ``info`` is :mod:`dask_monarch.deployment.cluster_info`; ``debug``
is :mod:`dask_monarch.deployment.debug_shell`; the
progress line is :mod:`dask_monarch.observability.progress`. The module
imports nothing heavy at import time: ``dask`` loads every ``dask_cli``
entry point for each ``dask ...`` command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator

import click

from .options import DURATION, MEMORY_LIMIT

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

With --max-restarts N, a run that ends with DeviceException (a lost rank)
runs again once the cluster has its ranks back, up to N times: the script
resumes from its own checkpoint (dask_monarch.checkpoint) and reads the
restart count from DASK_MONARCH_RESTART (0 first).
"""


@click.group(name="monarch", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dask-monarch", prog_name="dask-monarch")
def cli() -> None:
    """dask_monarch: Monarch's single-controller tensor engine on Dask."""


# -- run -------------------------------------------------------------------------------------


@cli.command(
    help=RUN_HELP,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option(
    "--ranks",
    "-n",
    type=click.IntRange(min=1),
    default=None,
    help="Embedded cluster: the number of ranks [default: one per visible GPU, else "
    "dask_monarch.cli.cpu-ranks]. Existing cluster: wait for this many workers.",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="Embedded cluster: GPU ranks, CPU ranks, or GPUs if there are enough.",
)
@click.option(
    "--scheduler-address",
    default=None,
    metavar="ADDRESS",
    help="Use the running Dask cluster at ADDRESS (default: the dask config "
    "'scheduler-address', i.e. DASK_SCHEDULER_ADDRESS, if set).",
)
@click.option(
    "--scheduler-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="Use the running Dask cluster described by this scheduler file.",
)
@click.option(
    "--dashboard-address",
    default="127.0.0.1:0",
    show_default=True,
    help="Embedded cluster: where its dashboard listens ('' for none).",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Show a progress line on stderr [default: when stderr is a terminal].",
)
@click.option(
    "-m", "--module", "as_module", is_flag=True, help="SCRIPT is a module name, run like python -m."
)
@click.option(
    "--log-level",
    default=None,
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    help="Level of the dask_monarch loggers in this process (workers: the dask "
    "config 'logging', or dask_monarch.logs.forward_worker_logs).",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Run SCRIPT again, up to this many times, when its mesh breaks (DeviceException); "
    "it resumes from its own checkpoint. DASK_MONARCH_RESTART holds the count (0 first).",
)
@click.option("-q", "--quiet", is_flag=True, help="No information lines on stderr.")
@click.option(
    "--tls-ca-file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="TLS: the CA certificate (with --tls-cert and --tls-key): every comm of the "
    "embedded cluster, or to the existing one, is tls://.",
)
@click.option(
    "--tls-cert",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="TLS: this process's certificate (the embedded cluster's too).",
)
@click.option(
    "--tls-key",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="TLS: the private key of --tls-cert.",
)
@click.option(
    "--tls-temporary",
    is_flag=True,
    help="Embedded cluster: TLS with a throw-away certificate made now "
    "(distributed.Security.temporary(); needs the 'cryptography' package).",
)
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    ranks: int | None,
    device: str,
    scheduler_address: str | None,
    scheduler_file: str | None,
    dashboard_address: str,
    progress: bool | None,
    as_module: bool,
    log_level: str | None,
    max_restarts: int,
    quiet: bool,
    tls_ca_file: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_temporary: bool,
    script: str,
    args: tuple[str, ...],
) -> None:
    if scheduler_address and scheduler_file:
        raise click.UsageError("give --scheduler-address or --scheduler-file, not both")
    tls_files = (tls_ca_file, tls_cert, tls_key)
    if any(tls_files) and not all(tls_files):
        raise click.UsageError("give --tls-ca-file, --tls-cert and --tls-key together")
    if tls_temporary and any(tls_files):
        raise click.UsageError("give --tls-temporary or the --tls-* files, not both")
    if tls_temporary and (scheduler_address or scheduler_file):
        raise click.UsageError(
            "--tls-temporary makes a certificate that only an embedded "
            "cluster trusts: give the --tls-* files of the existing cluster"
        )
    if not as_module and not os.path.isfile(script):
        raise click.UsageError(f"no such script: {script}")
    if log_level:
        logging.getLogger("dask_monarch").setLevel(log_level.upper())
        _ensure_handler(logging.getLogger("dask_monarch"))
    import dask.config

    from . import runner

    scheduler_address = scheduler_address or dask.config.get("scheduler-address", None)
    say = (
        (lambda text: None)
        if quiet
        else (lambda text: click.echo(f"dask-monarch: {text}", err=True))
    )
    if progress is None:
        progress = sys.stderr.isatty()
    try:
        security = runner.security_for(tls_ca_file, tls_cert, tls_key, tls_temporary)
        code = runner.run(
            script,
            args,
            as_module=as_module,
            ranks=ranks,
            device=device,
            scheduler_address=scheduler_address,
            scheduler_file=scheduler_file,
            dashboard_address=dashboard_address or None,
            progress=progress,
            say=say,
            security=security,
            max_restarts=max_restarts,
        )
    except runner.SetupError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)


# -- info ------------------------------------------------------------------------------------


def _running_cluster(command: Callable) -> Callable:
    """The options naming a running cluster (``info``, ``debug``)."""
    return click.option(
        "--scheduler-address",
        default=None,
        metavar="ADDRESS",
        help="The cluster's scheduler (default: the dask config 'scheduler-address').",
    )(
        click.option(
            "--scheduler-file",
            default=None,
            type=click.Path(exists=True, dir_okay=False),
            help="The cluster's scheduler file.",
        )(command)
    )


def _address_or_file(scheduler_address: str | None, scheduler_file: str | None) -> str | None:
    """The scheduler address to use (the option, else Dask's config); one of the two needed."""
    import dask.config

    scheduler_address = scheduler_address or dask.config.get("scheduler-address", None)
    if not (scheduler_address or scheduler_file):
        raise click.UsageError("give --scheduler-address or --scheduler-file")
    return scheduler_address


@contextlib.contextmanager
def _unreachable_is_an_error(
    scheduler_address: str | None, scheduler_file: str | None
) -> Iterator[None]:
    """A scheduler that cannot be reached (refused, timed out, unresolvable) while connecting
    is one line saying what to check, not a traceback (``info`` and ``debug`` alike)."""
    try:
        yield
    except OSError as e:
        where = scheduler_address or f"the address in {scheduler_file}"
        raise click.ClickException(
            f"cannot reach the scheduler at {where}: {e}. Is the scheduler running there "
            "(dask scheduler, or the cluster's scheduler_address)?"
        ) from None


@cli.command()
@_running_cluster
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def info(scheduler_address: str | None, scheduler_file: str | None, as_json: bool) -> None:
    """Print the ranks of a running cluster: workers, resources, GPUs, meshes."""
    import json

    from .cluster_info import describe_cluster, table_lines

    scheduler_address = _address_or_file(scheduler_address, scheduler_file)
    with _unreachable_is_an_error(scheduler_address, scheduler_file):
        report = describe_cluster(scheduler_address, scheduler_file)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    for line in table_lines(report):
        click.echo(line)


# -- debug -----------------------------------------------------------------------------------


@cli.command()
@_running_cluster
def debug(scheduler_address: str | None, scheduler_file: str | None) -> None:
    """Ranks paused in breakpoint(): list them, attach to one's pdb, resume all (a shell)."""
    from .debug_shell import connect
    from .debug_shell import run as shell

    scheduler_address = _address_or_file(scheduler_address, scheduler_file)
    with _unreachable_is_an_error(scheduler_address, scheduler_file):
        client = connect(scheduler_address, scheduler_file)
    with client:
        sys.exit(shell(client))


# -- worker ----------------------------------------------------------------------------------


@cli.command()
@click.argument("scheduler", required=False)
@click.option(
    "--scheduler-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="The cluster's scheduler file (instead of SCHEDULER).",
)
@click.option(
    "--gpus",
    default=None,
    metavar="LIST",
    help="GPUs to start a rank worker for, indices or UUIDs, comma separated "
    "[default: every visible GPU, CUDA_VISIBLE_DEVICES if set].",
)
@click.option(
    "--first-rank",
    type=click.IntRange(min=0),
    default=None,
    help="Advertise the rank resources monarch-rank<N>, <N+1>, ... in GPU order, so "
    "controllers take these workers as those ranks (node k of 8-GPU nodes: 8k).",
)
@click.option(
    "--torch-threads",
    type=click.IntRange(min=1),
    default=None,
    help="Torch intra-op threads per worker [default: the cores divided among them].",
)
@click.option(
    "--memory-limit",
    type=MEMORY_LIMIT,
    default="auto",
    show_default=True,
    help="Per worker: bytes, '16GB', or 'auto' (the node's memory divided among them).",
)
@click.option(
    "--host",
    default=None,
    help="The address the workers listen on (and are reached at) [default: Dask's choice].",
)
@click.option(
    "--name",
    "name_prefix",
    default=None,
    help="Worker names are NAME-gpu<ID> [default: the host name].",
)
@click.option(
    "--batched-interval",
    type=DURATION,
    default=None,
    metavar="DURATION",
    envvar="MONARCH_BATCHED_INTERVAL",
    help="Lower the gap between the batches each worker sends the scheduler (Dask's "
    "default: 2 ms) to DURATION, e.g. 1ms, as LocalMeshCluster does; pair it with the "
    "scheduler's --preload dask_monarch.preload --monarch-batched-interval=1ms.",
)
def worker(
    scheduler: str | None,
    scheduler_file: str | None,
    gpus: str | None,
    first_rank: int | None,
    torch_threads: int | None,
    memory_limit: int | str | None,
    host: str | None,
    name_prefix: str | None,
    batched_interval: float | None,
) -> None:
    """Start one rank worker per GPU of this node, as `dask cuda worker` does.

    Each worker sees its own GPU as device 0 (a rotated CUDA_VISIBLE_DEVICES),
    has the dask_monarch plugin, torch threads and memory settings of
    LocalMeshCluster's ranks, and (with --first-rank) its rank resource.
    """
    import asyncio

    from .workers import parse_gpus, run_node, visible_gpus

    if not (scheduler or scheduler_file):
        raise click.UsageError("give the SCHEDULER address or --scheduler-file")
    try:
        devices = parse_gpus(gpus) if gpus is not None else visible_gpus()
        if not devices:
            raise ValueError(
                "no GPU is visible on this node; for CPU ranks use `dask worker "
                "SCHEDULER --preload dask_monarch.preload --monarch-rank=N`"
            )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    asyncio.run(
        run_node(
            scheduler,
            scheduler_file,
            devices,
            first_rank=first_rank,
            torch_threads=torch_threads,
            memory_limit=memory_limit,
            host=host,
            name_prefix=name_prefix,
            batched_interval=batched_interval,
        )
    )


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
