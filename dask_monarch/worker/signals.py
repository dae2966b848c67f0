"""Rank workers survive SIGINT: a rank is never lost to a Ctrl-C meant for someone else.

A terminal's Ctrl-C reaches every process of its foreground process group, so
the rank workers of ``dask-monarch run`` (children of the client process) get
the SIGINT meant for the script; a remote function calling
``_thread.interrupt_main()`` raises the same signal in its worker. Python's
default handler turns it into a KeyboardInterrupt in the worker's main
thread, which runs the event loop: the worker process ends and its nanny,
seeing a clean exit, does not start another one.

A worker process that a nanny started is stopped by its nanny (a message,
then SIGTERM/SIGKILL), never by SIGINT, so there the plugin replaces the
handler with one that only logs. A worker without a nanny (``dask worker
--no-nanny``, an in-process worker) keeps SIGINT: it is how its owner stops
it. A KeyboardInterrupt raised inside a remote function is that call's error
(a RemoteException), like any other exception (:mod:`.handlers`).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger("dask_monarch.worker")


def ignore_sigint(worker: Worker) -> bool:
    """Log SIGINT instead of dying, in a worker process a nanny started; True if installed.

    Must run on the process's main thread (the worker's event loop thread in
    a nanny's worker process), where Python runs signal handlers.
    """
    if worker.nanny is None or threading.current_thread() is not threading.main_thread():
        return False
    loop = worker.loop.asyncio_loop
    name = worker.name

    def on_sigint(signum: int, frame: Any) -> None:
        # nothing that takes a lock here (logging does): the loop logs it
        loop.call_soon_threadsafe(logger.info, "rank worker %s ignored SIGINT (a terminal's "
                                  "Ctrl-C or _thread.interrupt_main); its nanny or the "
                                  "scheduler stops it", name)

    signal.signal(signal.SIGINT, on_sigint)
    return True
