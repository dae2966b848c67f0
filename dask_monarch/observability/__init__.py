"""Observability: what a user sees of the ranks besides values.

``dashboard`` (the ``/monarch/`` page and the worker metrics), ``logs``
(worker log records shown on the client), ``progress`` (the progress line of
``dask-monarch run``) and ``chrome_trace`` (``dm.trace``'s records as a
Chrome/Perfetto trace).
"""
