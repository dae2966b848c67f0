"""What ``dask-monarch info`` reports about a running cluster: its workers seen as ranks.

Per worker: its rank resource, threads, memory limit, visible GPUs, whether
the dask_monarch plugin is installed and which meshes hold a rank there.
The facts come from the scheduler and from each worker (``Client.run``), so
this works on any deployment, not only on clusters dask_monarch started.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Client, Worker


def dashboard_note(link: str | None, page: str | None) -> str:
    """``", dashboard <the /monarch/ page>"`` for an information line; Dask's own ``link`` and
    how to add the page where the scheduler serves none ("" without a dashboard)."""
    if page:
        return f", dashboard {page}"
    if link:
        return f", dashboard {link} (without a /monarch/ page: --preload dask_monarch.dashboard)"
    return ""


def monarch_page(client: Client) -> str | None:
    """The URL of the ``/monarch/`` page of ``client``'s scheduler, None where it serves none.

    Dask's ``dashboard_link`` exists whenever the scheduler listens for HTTP,
    which it does without the page (a scheduler started without the preload),
    and even without a dashboard: a link made from it answered 404.
    """
    link = client.dashboard_link
    if not link:
        return None
    try:
        served = client.run_on_scheduler(_serves_monarch_page())
    except Exception:  # a scheduler that cannot run it (no tornado app) serves no page
        served = False
    return f"{link.rsplit('/', 1)[0]}/monarch/" if served else None


def _serves_monarch_page() -> Callable:
    """A function that tells whether a scheduler routes ``/monarch/state.json`` to a handler.

    Made inside this function so that cloudpickle sends it by value: the
    scheduler needs neither dask_monarch nor torch to answer.
    """

    def serves(dask_scheduler: Any) -> bool:
        from tornado.httputil import HTTPServerRequest
        from tornado.web import ErrorHandler

        application = getattr(dask_scheduler, "http_application", None)
        if application is None:
            return False
        request = HTTPServerRequest(method="GET", uri="/monarch/state.json", host="localhost")
        handler = application.find_handler(request)
        return handler is not None and not issubclass(handler.handler_class, ErrorHandler)

    return serves


def describe_cluster(scheduler_address: str | None, scheduler_file: str | None) -> dict:
    """The scheduler, its dashboard link and one row per worker, rank workers first, in order."""
    from distributed import Client

    from ..controller.placement import rank_order, registered_workers
    from ..worker import describe_worker

    if scheduler_file:
        client = Client(scheduler_file=scheduler_file, set_as_default=False)
    else:
        client = Client(scheduler_address, set_as_default=False)
    with client:
        workers = registered_workers(client)
        described = client.run(describe_worker)
        meshes = client.run(_meshes_held)
        rows = []
        for address, w in workers.items():
            d = described.get(address, {})
            rows.append(
                {
                    "name": str(w.get("name")),
                    "address": address,
                    "resource": d.get("resource"),
                    "nthreads": w.get("nthreads"),
                    "memory_limit": w.get("memory_limit"),
                    "gpus": d.get("gpus"),
                    "plugin": d.get("has_plugin", False),
                    "meshes": meshes.get(address, []),
                    "resources": w.get("resources", {}),
                }
            )
        rows.sort(key=lambda r: rank_order(r["address"], r))  # the order controllers take
        link = client.dashboard_link
        page = monarch_page(client)
        scheduler = client.scheduler.address
    return {"scheduler": scheduler, "dashboard": link, "monarch_page": page, "workers": rows}


def table_lines(report: dict) -> list[str]:
    """:func:`describe_cluster`'s report as a heading line and an aligned table."""
    from dask.utils import format_bytes

    rows = report["workers"]
    lines = [
        f"scheduler {report['scheduler']}, {len(rows)} workers"
        + dashboard_note(report["dashboard"], report.get("monarch_page"))
    ]
    header = ("worker", "address", "rank resource", "threads", "memory", "GPUs", "plugin", "meshes")
    table = [header] + [
        (
            r["name"],
            r["address"],
            r["resource"] or "-",
            str(r["nthreads"]),
            format_bytes(r["memory_limit"]) if r["memory_limit"] else "-",
            str(r["gpus"]),
            "yes" if r["plugin"] else "no",
            ", ".join(r["meshes"]) or "-",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table
    ]
    return lines


def _meshes_held(dask_worker: Worker | None = None) -> list[str]:
    from ..protocol.names import mesh_id

    plugin = dask_worker.plugins.get("dask_monarch")
    ranks = getattr(plugin, "ranks", {}) if plugin is not None else {}
    return [f"{mesh_id(token)} (rank {state.rank})" for token, state in list(ranks.items())]
