"""The protocol: plain data that crosses between the controller and its ranks.

``messages`` (Monarch's worker messages and the controller-bound replies),
``ndslice`` (slices of global ranks), ``wire`` (dask_monarch's own internal
steps), ``names`` (executor, plugin and resource names and the output
description that both sides build alike), ``rules`` (which lanes run each
message, which refs it touches, borrow steps, recording chunks: what the
compiler, the worker and the tracer all check alike), ``liveness`` (a lane's
progress in words, for warnings, timeouts and the dashboard alike), ``source``
(functions sent by value keep their file name and source lines), ``tensor_bytes``
(tensors pickled as their bytes, not torch.save's archive). Only ``rules`` decides
anything; the compiler routes these messages by it, the worker runs them.
"""
