"""The dask_monarch page of the Dask dashboard: what every mesh, rank and stream is doing.

The scheduler's HTTP server serves (docs/dask.md §5):

* ``/monarch/`` — an HTML page that polls the JSON below with plain
  JavaScript (no CDN, works offline): per controller (mesh) and rank, the
  streams and what each runs or waits on (e.g. a borrow, or the peers of a
  collective that are not there, in the words of a ``LivenessWarning``:
  :mod:`dask_monarch.protocol.liveness`), refs and tensor
  memory, the last completed seq, messages per second, recent errors with
  their tracebacks;
* ``/monarch/state.json`` — one snapshot, gathered from the rank workers
  through the plugin's ``dask_monarch_state`` comm handler, plus rates
  computed here from successive snapshots (the worker's own clock, so
  polling jitter does not skew them);
* ``/monarch/trace.json`` — the latest trace a ``dm.trace`` block handed
  to this scheduler (:func:`publish_trace`), a Chrome/Perfetto trace the page
  links to (404 until there is one);
* ``/individual-monarch`` — the same page, listed in the dashboard's
  "More..." menu (the entry is made in distributed's internal table of
  Bokeh pages, so it is best effort; the page itself is a plain route).

Installing it: :class:`~dask_monarch.LocalMeshCluster` preloads this module
into its scheduler; on other deployments use ``dask scheduler --preload
dask_monarch.dashboard`` (or ``plugins/dask_monarch_scheduler.py``), or list
``dask_monarch.dashboard`` in ``distributed.scheduler.http.routes``.
Settings: ``dask_monarch.dashboard.*``.

What it publishes: anyone who can open the dashboard can read it. A mesh is
named by its id (:func:`~dask_monarch.protocol.names.mesh_id`, a hash of its
controller's token, which lets a client act on its ranks), the id every
message of the client names it by. Error texts keep their tracebacks; their
exception messages, which may quote argument values, are shown where only
this host can open the page (every address the dashboard listens on is a
loopback address: a ``LocalMeshCluster``'s) and replaced by a note saying how
to show them elsewhere (:func:`redact`), unless
``dask_monarch.dashboard.show-details`` (in the scheduler's config) says
``true`` or ``false``.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import os
import re
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.http.utils import RequestHandler, get_handlers, redirect

from .. import config
from ..protocol.liveness import explain, from_snapshot
from ..protocol.names import RESOURCE_PREFIX, STATE_HANDLER, mesh_id

if TYPE_CHECKING:
    from bokeh.document import Document
    from distributed import Scheduler

logger = logging.getLogger("dask_monarch.dashboard")

PAGE_PATH = "/individual-monarch"
_HTML = os.path.join(os.path.dirname(__file__), "dashboard.html")
_FORGET_AFTER_S = 120.0  # rate history of a rank or lane not seen for this long is dropped
_MAX_SAMPLES = 64


class Rates:
    """Counts per second from successive (time, count) samples of one key each.

    The rate spans about the last ``window`` seconds of samples (more when
    samples are sparse), so a page that polls fast or slow shows much the
    same figure; ``None`` until a key has two samples.
    """

    def __init__(self) -> None:
        self.samples: dict[tuple, deque] = {}
        self.seen: dict[tuple, float] = {}

    def rate(self, key: tuple, t: float, count: int, window: float) -> float | None:
        samples = self.samples.get(key)
        if samples is None:
            samples = self.samples[key] = deque()
        self.seen[key] = time.monotonic()
        if samples and count < samples[-1][1]:  # a counter that went back: a new lane
            samples.clear()
        if not samples or t > samples[-1][0]:
            samples.append((t, count))
        while len(samples) > 2 and (t - samples[1][0] >= window or len(samples) > _MAX_SAMPLES):
            samples.popleft()
        if len(samples) < 2:
            return None
        t0, c0 = samples[0]
        return (count - c0) / (t - t0) if t > t0 else None

    def forget_old(self) -> None:
        cutoff = time.monotonic() - _FORGET_AFTER_S
        for key in [k for k, seen in self.seen.items() if seen < cutoff]:
            self.samples.pop(key, None)
            self.seen.pop(key, None)


_rates = Rates()  # one per process: a process holds one scheduler outside tests


_TRACEBACK_LINE = re.compile(
    r"^(\s|Traceback \(most recent call last\):$|During handling of "
    r"the above exception|The above exception was the direct cause|$)"
)
_EXCEPTION_NAME = re.compile(r"^([A-Za-z_][\w.]*)(:|$)")
HIDDEN = (
    "<message hidden: the dashboard is reachable from other hosts; to show messages set "
    "dask_monarch.dashboard.show-details: true where the scheduler starts "
    "(DASK_MONARCH__DASHBOARD__SHOW_DETAILS=true), see docs/security.md>"
)


def redact(text: str | None) -> str | None:
    """``text`` (a traceback) with every exception message replaced by :data:`HIDDEN`.

    Frames and source lines stay (they show where); the messages, which may
    quote argument values, go. A message of several lines goes entirely.
    """
    if not text:
        return text
    out: list[str] = []
    for line in text.splitlines():
        if _TRACEBACK_LINE.match(line):
            out.append(line)
            continue
        name = _EXCEPTION_NAME.match(line)
        head = f"{name.group(1)}: {HIDDEN}" if name else HIDDEN
        if not out or out[-1] != head and not out[-1].endswith(HIDDEN):
            out.append(head)
    return "\n".join(out)


def show_details(scheduler: Scheduler) -> bool:
    """``dashboard.show-details``: true, false, or ``auto`` (null too): only when every address
    the scheduler's dashboard listens on is a loopback address (only this host opens it).
    Any other value is refused (ValueError naming the setting), not read as false: a
    misspelt ``true`` hid every message without a word."""
    setting = config.flag("dashboard.show-details", auto=True)
    if setting is None:
        return _loopback_only(scheduler)
    return setting


def _loopback_only(scheduler: Scheduler) -> bool:
    from distributed.comm.utils import get_tcp_server_addresses

    try:
        hosts = [address[0] for address in get_tcp_server_addresses(scheduler.http_server)]
    except (AttributeError, TypeError, ValueError, RuntimeError):  # no HTTP server, not TCP
        return False
    return all_loopback(hosts)


def all_loopback(hosts: list[str]) -> bool:
    """Whether every one of ``hosts`` (listening addresses) is a loopback address; a wildcard
    (``0.0.0.0``, ``::``) listens on every interface, so it is not."""
    try:
        return bool(hosts) and all(ipaddress.ip_address(h.split("%")[0]).is_loopback for h in hosts)
    except ValueError:  # a host name
        return False


def _hide_details(rank: dict) -> None:
    if isinstance(rank.get("failed"), str):
        rank["failed"] = redact(rank["failed"])
    for error in rank.get("errors", ()):
        error["error"] = redact(error["error"])


def rank_workers(scheduler: Scheduler) -> list[str]:
    """Addresses of the workers that advertise a dask_monarch rank resource."""
    return [
        address
        for address, ws in scheduler.workers.items()
        if any(name.startswith(RESOURCE_PREFIX) for name in ws.resources)
    ]


NO_PLUGIN = (
    "no dask_monarch plugin on this worker yet (it advertises a rank resource; a controller "
    "installs the plugin when it claims the worker, --preload dask_monarch.preload before)"
)


async def _ask(scheduler: Scheduler, address: str, timeout: float) -> tuple[str, Any, str | None]:
    try:
        reply = await asyncio.wait_for(
            scheduler.broadcast(msg={"op": STATE_HANDLER}, workers=[address]), timeout
        )
        ranks = reply.get(address)
        if ranks is None:  # no handler: the worker logged it and answered nothing
            return address, [], NO_PLUGIN
        return address, list(ranks), None
    except asyncio.TimeoutError:
        return address, [], f"no answer within {timeout:g}s (its event loop is busy or blocked)"
    except Exception as e:
        return address, [], f"{type(e).__name__}: {e}"


async def collect(scheduler: Scheduler) -> dict:
    """One snapshot of every rank of every controller on ``scheduler``'s rank workers.

    Runs on the scheduler's event loop; each worker answers from its own
    event loop (never from a lane), so a lane blocked in a borrow or a
    collective still shows up, as ``waiting``.
    """
    timeout = config.seconds("dashboard.worker-timeout") or 5.0
    window = config.seconds("dashboard.rate-window") or 5.0
    addresses = rank_workers(scheduler)
    details = show_details(scheduler)
    answers = await asyncio.gather(*(_ask(scheduler, a, timeout) for a in addresses))
    controllers: dict[str, dict] = {}
    workers = []
    for address, ranks, error in answers:
        ws = scheduler.workers.get(address)
        name = str(ws.name) if ws is not None else address
        workers.append(
            {
                "address": address,
                "name": name,
                "error": error,
                "ranks": len(ranks),
                "resources": dict(ws.resources) if ws is not None else {},
                "nthreads": ws.nthreads if ws is not None else None,
            }
        )
        for rank in ranks:
            if not details:
                _hide_details(rank)
            mesh = rank["mesh"] = mesh_id(rank.pop("token"))
            rank["worker"], rank["worker_name"] = address, name
            rank["rate"] = _rates.rate(
                (address, mesh, rank["rank"]), rank["time"], rank["messages"], window
            )
            for lane in rank["lanes"]:
                lane["rate"] = _rates.rate(
                    (address, mesh, rank["rank"], lane["stream"]),
                    rank["time"],
                    lane["steps"],
                    window,
                )
            entry = controllers.setdefault(
                mesh, {"mesh": mesh, "world_size": rank["world_size"], "ranks": []}
            )
            entry["ranks"].append(rank)
    _rates.forget_old()
    for entry in controllers.values():
        _describe_lanes(entry["ranks"])
        ranks = sorted(entry["ranks"], key=lambda r: r["rank"])
        rates = [r["rate"] for r in ranks if r["rate"] is not None]
        entry.update(
            ranks=ranks,
            state=(
                "failed"
                if any(r["failed"] for r in ranks)
                else "released"
                if all(r["released"] for r in ranks)
                else "running"
            ),
            messages=sum(r["messages"] for r in ranks),
            rate=sum(rates) if rates else None,
            last_done_seq=max(r["last_done_seq"] for r in ranks),
            tensor_bytes=sum(r["tensor_bytes"] for r in ranks),
            refs=sum(r["refs"] for r in ranks),
            errors=sum(len(r["errors"]) for r in ranks),
            missing_ranks=sorted(set(range(entry["world_size"])) - {r["rank"] for r in ranks}),
        )
    latest = _traces.get(scheduler)
    return {
        "time": time.time(),
        "trace": None if latest is None else latest["info"],
        "scheduler": scheduler.address,
        "n_workers": len(scheduler.workers),
        "workers": sorted(workers, key=lambda w: w["name"]),
        "details_hidden": not details,
        "controllers": sorted(controllers.values(), key=lambda c: c["mesh"]),
    }


def _describe_lanes(ranks: list[dict]) -> None:
    """Give every busy lane of one mesh its ``status``: what a LivenessWarning would say."""
    progress = {
        r["rank"]: {lane["stream"]: from_snapshot(lane) for lane in r["lanes"]} for r in ranks
    }
    for r in ranks:
        for lane in r["lanes"]:
            p = progress[r["rank"]][lane["stream"]]
            lane["status"] = explain(r["rank"], p, progress.get) if p.state != "idle" else ""


class StateJSON(RequestHandler):
    """``/monarch/state.json``: :func:`collect` as JSON."""

    async def get(self) -> None:
        body = await collect(self.server)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(body, default=str))


# scheduler -> {"body": the latest trace's JSON text, "info": what the page shows of it}
_traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def publish_trace(body: str, info: dict, dask_scheduler: Scheduler | None = None) -> None:
    """Keep ``body`` (a trace's JSON text) as the latest trace of this scheduler (``Client.
    run_on_scheduler``): ``/monarch/trace.json`` serves it, the page links it. One is kept."""
    _traces[dask_scheduler] = {"body": body, "info": {**info, "url": "trace.json"}}


class TraceJSON(RequestHandler):
    """``/monarch/trace.json``: the latest published trace (open it in ui.perfetto.dev)."""

    def get(self) -> None:
        latest = _traces.get(self.server)
        if latest is None:
            self.set_status(404)
            self.write("no trace yet: run a program inside dask_monarch.trace(path)")
            return
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.set_header("Content-Disposition", 'inline; filename="monarch-trace.json"')
        self.write(latest["body"])


_page_cache: dict[str, str] = {}


def page_html(root: str = "../") -> str:
    """The page, with the poll interval and ``root`` (the dashboard's root, relative) filled in."""
    if "page" not in _page_cache:  # read once
        with open(_HTML, encoding="utf-8") as f:
            _page_cache["page"] = f.read()
    interval_ms = int(1000 * (config.seconds("dashboard.interval") or 1.0))
    return (
        _page_cache["page"]
        .replace("__INTERVAL_MS__", str(max(100, interval_ms)))
        .replace("__ROOT__", root)
    )


class Page(RequestHandler):
    """``/monarch/`` (and ``/individual-monarch``): the HTML page."""

    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.write(page_html(self.extra.get("root", "../")))


# Read by distributed when this module is listed in distributed.scheduler.http.routes.
# The HTTP server's own routes win over Bokeh's pages, so /individual-monarch serves the
# plain page too; the Bokeh entry below only puts it into the "More..." menu.
routes: list[tuple] = [
    (r"monarch", redirect("monarch/"), {}),
    (r"monarch/", Page, {"extra": {"root": "../"}}),
    (r"monarch/state\.json", StateJSON, {}),
    (r"monarch/trace\.json", TraceJSON, {}),
    (PAGE_PATH.lstrip("/"), Page, {"extra": {"root": ""}}),
]


def _more_menu_page(scheduler: Scheduler, extra: dict, doc: Document) -> None:
    """The Bokeh page registered for the "More..." menu (a frame around ``/monarch/``).

    Served only where our HTTP routes are missing; normally the plain page wins.
    """
    from bokeh.models import Div

    doc.title = "Dask: Monarch"
    doc.add_root(
        Div(
            text='<iframe src="monarch/" title="dask_monarch" '
            'style="border:0;width:100%;height:calc(100vh - 16px)"></iframe>',
            sizing_mode="stretch_both",
        )
    )


def _register_more_menu_page() -> None:
    """Add ``/individual-monarch`` to distributed's page table (before the scheduler starts).

    The table is internal (docs/dask.md §5 item 3); a distributed without it
    just loses the menu entry, never the page.
    """
    try:
        from distributed.dashboard import scheduler as pages
    except Exception as e:  # no bokeh, or the internal module moved
        logger.debug("no 'More...' menu entry for the Monarch page: %r", e)
        return
    applications = getattr(pages, "applications", None)
    if isinstance(applications, dict):
        applications.setdefault(PAGE_PATH, _more_menu_page)


def install(scheduler: Scheduler) -> None:
    """Serve the page on ``scheduler``'s HTTP server (a no-op without one, or if listed)."""
    application = getattr(scheduler, "http_application", None)
    if application is None:
        return
    listed = dask.config.get("distributed.scheduler.http.routes", [])
    if __name__ in listed or "dask_monarch.dashboard" in listed:
        return  # distributed already serves our routes
    application.add_handlers(r".*", get_handlers(server=scheduler, modules=[__name__]))
    logger.debug("dask_monarch dashboard page at /monarch/")


def dask_setup(scheduler: Scheduler) -> None:
    """Preload hook: ``dask scheduler --preload dask_monarch.dashboard``."""
    from distributed import Scheduler

    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"dask_monarch.dashboard is a scheduler preload, not one for {scheduler!r}")
    install(scheduler)


# Worker metrics in bytes: the Workers table formats them as it formats its own memory columns.
BYTE_METRICS = ("monarch_tensor_bytes",)


def format_byte_columns(root: Any) -> None:
    """Give the :data:`BYTE_METRICS` columns of the Bokeh tables under ``root`` a bytes
    formatter (``1.5 MiB``, not ``1572864``)."""
    from bokeh.models import DataTable, NumberFormatter

    for table in root.select({"type": DataTable}):
        for column in table.columns:
            if column.field in BYTE_METRICS:
                column.formatter = NumberFormatter(format="0.0 b")


def _format_worker_table() -> None:
    """Make distributed's Workers table show :data:`BYTE_METRICS` as bytes.

    It formats only the metrics it knows (its formatters are fixed in
    ``WorkerTable.__init__``), so each new table gets ours after it is built;
    best effort, as the menu entry is: without it the figures stay plain numbers.
    """
    try:
        from distributed.dashboard.components.scheduler import WorkerTable
    except Exception as e:  # no bokeh, or the internal module moved
        logger.debug("Workers table left unformatted: %r", e)
        return
    original = WorkerTable.__init__
    if getattr(original, "_dask_monarch", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            format_byte_columns(self.root)
        except Exception as e:  # only cosmetic
            logger.debug("Workers table left unformatted: %r", e)

    __init__._dask_monarch = True  # type: ignore[attr-defined]
    WorkerTable.__init__ = __init__


# Imported by a scheduler preload inside Scheduler.__init__, before the dashboard starts:
# the "More..." entry must be in the table by then.
_register_more_menu_page()
_format_worker_table()
