"""What ``dask-monarch info`` reports about a running cluster: its workers seen as ranks.

Per worker: its rank resource, threads, memory limit, visible GPUs, whether
the dask_monarch plugin is installed and which meshes hold a rank there.
The facts come from the scheduler and from each worker (``Client.run``), so
this works on any deployment, not only on clusters dask_monarch started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Worker


def dashboard_note(link: str) -> str:
    """``", dashboard <the /monarch/ page>"`` for an information line ("" without a dashboard)."""
    return f", dashboard {link.rsplit('/', 1)[0]}/monarch/" if link else ""


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
        scheduler = client.scheduler.address
    return {"scheduler": scheduler, "dashboard": link, "workers": rows}


def table_lines(report: dict) -> list[str]:
    """:func:`describe_cluster`'s report as a heading line and an aligned table."""
    from dask.utils import format_bytes

    rows = report["workers"]
    lines = [
        f"scheduler {report['scheduler']}, {len(rows)} workers"
        + dashboard_note(report["dashboard"])
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
