"""What the tests share besides the fixtures of ``tests/conftest.py`` (the shared clusters,
and ``throwaway_cluster`` for a cluster of a test's own).

``tests/`` is on ``sys.path`` (pytest puts the rootdir conftest's folder there) and the
rank workers inherit it (``LocalMeshCluster`` passes the client's ``sys.path`` on; the CLI
tests set ``PYTHONPATH``), so the workers import these modules by the same names the tests
do: ``"helpers.remote_fns.boom"`` is a remote function's path. Keep this file free of
imports: every worker that resolves such a path imports it.

- ``waiting``: ``wait_until``, the tests' one polling loop, with a timeout naming what it awaited.
- ``raw``: short builders for raw protocol messages (``call``, ``fetch``, ``create_streams``).
- ``remote_fns``: functions and actors the workers call by path.
- ``gates``: remote functions that hold a lane until the test creates a file.
- ``workers``: acting on a rank's worker process (freezing it, counting inlined segments).
- ``task_stream``: waiting for Dask's task stream to record a controller's segments.
- ``terminal``: a command run on a pseudo-terminal, and what a terminal shows of it.
- ``gpus``: the GPUs the tests see, a skip for tests that need more, raw CUDA messages.
- ``debug_fns``: remote functions that stop in the debugger (their line numbers are asserted).
- ``long_job``: a training job the kill tests run with ``dask-monarch run`` (by path).
- ``threads``: ``race``, a test's functions run in threads at once to bring out a race.
- ``custom_ops``: ``torch.library`` custom ops of a user's, which the workers import by path.
- ``tiny_configs``: tiny transformers configurations (``DECODER``, a Llama-style decoder).
"""
