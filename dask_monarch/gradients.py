"""Gradients as backward produces them: ``dm.grad_generator`` and ``dm.ddp_hooks``.

Autograd runs on the client over mesh handles (``tensor.py``), so backward is a
stream of messages the client sends as the engine walks the graph. Two ways to
act on a gradient as soon as it exists, instead of after the whole backward:

* :func:`grad_generator` (Monarch's ``monarch.gradient_generator`` idea) yields
  ``(param, grad)`` in the order the engine produces them. The engine runs in a
  helper thread that pauses at each gradient until the caller asks for the
  next one, so the caller's messages and backward's interleave in one
  deterministic order, as if backward were a generator.
* :func:`ddp_hooks` hooks a module's parameters: when every gradient of a
  bucket has been accumulated, the bucket is lent to a communication stream
  and averaged there over the data-parallel mesh dims, so the ranks reduce it
  on that stream's lane while the main lane runs the rest of backward. If the
  ranks are idle the messages so far are flushed at once, so that they start;
  while they are busy the next flush takes them (a flush costs Dask far more
  than a message: a flush per bucket doubled a small model's step time). At
  the end of backward the borrows are dropped: the main stream's next use of a
  gradient waits for its reduction. Under ``dm.compile`` the hooks are traced
  with the step, and the whole step is one recording.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from .protocol import messages as m
from .protocol.names import rank_function
from .remote_function import Spec, bind_outputs
from .stream import Stream
from .tensor import Tensor, contiguous

_GRAD, _DONE, _ERROR = "grad", "done", "error"


def grad_generator(
    loss: Tensor, params: Iterable[Tensor], *, retain_graph: bool = False
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(param, grad)`` for each of ``params`` as backward of ``loss`` produces it.

    The gradients are those of ``torch.autograd.grad(loss, params)`` (mesh
    tensors on the loss's stream; ``.grad`` is not touched). Treat them as read-only:
    like autograd's, two of them may share storage. Work issued between two
    steps of the loop goes to the ranks before the rest of backward, so a
    reduction started there overlaps it. A parameter that ``loss`` does not
    depend on is an error, as in ``torch.autograd.grad``. Closing the loop early
    finishes backward without pausing.
    """
    params = list(dict.fromkeys(params))  # each once, in the given order
    if not isinstance(loss, Tensor):
        raise TypeError(f"grad_generator needs a mesh tensor loss, got {type(loss).__name__}")
    for p in params:
        if not isinstance(p, Tensor) or not p.requires_grad:
            raise TypeError(f"grad_generator needs mesh tensors that require grad, got {p!r}")
    return _generate(loss, params, retain_graph)


def _generate(loss: Tensor, params: list[Tensor], retain_graph: bool) -> Iterator:
    handoff: queue.Queue = queue.Queue()
    resume = threading.Semaphore(0)
    closed = threading.Event()

    def hook(param: Tensor) -> Any:
        def on_grad(grad: Tensor) -> None:
            if not closed.is_set():
                handoff.put((_GRAD, param, grad))
                resume.acquire()  # backward waits here until the caller asks for the next

        return on_grad

    def backward() -> None:
        handles = [p.register_hook(hook(p)) for p in params]
        try:
            grads = torch.autograd.grad(loss, params, retain_graph=retain_graph)
            handoff.put((_DONE, grads, None))
        except BaseException as e:  # handed to the caller, raised there
            handoff.put((_ERROR, e, None))
        finally:
            for h in handles:
                h.remove()

    context = contextvars.copy_context()  # the caller's active mesh and stream
    thread = threading.Thread(
        target=context.run, args=(backward,), name="dm-grad-generator", daemon=True
    )
    thread.start()
    given: set[int] = set()
    try:
        while True:
            kind, a, b = handoff.get()
            if kind == _GRAD:
                given.add(id(a))
                yield a, b
                resume.release()
            elif kind == _ERROR:
                raise a
            else:
                for p, g in zip(params, a):  # any gradient no hook saw, from the final answer
                    if id(p) not in given:
                        yield p, g
                return
    finally:
        closed.set()
        resume.release()
        thread.join()


class DDPHooks:
    """What :func:`ddp_hooks` installed; ``remove()`` (or leaving ``with``) takes it out."""

    def __init__(
        self,
        params: Sequence[Tensor],
        dims: tuple[str, ...],
        stream: Stream,
        bucket_bytes: int,
        reduction: str,
    ) -> None:
        self.dims = dims
        self.stream = stream
        self.reduction = reduction
        self.buckets = _buckets(params, bucket_bytes)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._ready: list[list[Tensor]] = [[] for _ in self.buckets]
        self._borrows: list = []
        self._flats: list[tuple[list[Tensor], Tensor]] = []  # (bucket, its lent flat copy)
        self._pending = False  # an end-of-backward callback is queued
        self._sync = True
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]

    def _accumulated(self, param: Tensor) -> None:
        if not self._sync:
            return
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        index = self._bucket_of[id(param)]
        ready = self._ready[index]
        ready.append(param)
        if len(ready) == len(self.buckets[index]):
            self._reduce(index)

    def _reduce(self, index: int) -> None:
        """Lend the bucket's gradients to the stream and average them there, now.

        A bucket of several gradients is copied into one flat tensor on the
        gradients' stream (as DDP copies into its bucket), and only that is
        lent: one borrow per bucket, not per gradient (each borrow is two
        hand-offs between the ranks' lane threads). ``_finish`` makes each
        gradient a view of the averaged bucket (DDP's ``gradient_as_bucket_view``):
        one message per gradient, no copy back.
        """
        params, self._ready[index] = self._ready[index], []
        if not params:
            return
        if len(params) == 1:
            lent, borrow = self.stream.borrow(params[0].grad, mutable=True)
        else:
            flat = _flatten([p.grad for p in params])
            lent, borrow = self.stream.borrow(flat, mutable=True)
            self._flats.append((params, flat))
        self._borrows.append(borrow)
        with self.stream.activate():
            lent.reduce_(self.dims, self.reduction)
        session = lent._session
        if session.capture is None and session.controller.ranks_idle():
            session.controller.flush()  # idle ranks start on it while backward goes on

    def _finish(self) -> None:
        """End of backward: reduce what is left (parameters without a gradient stay out),
        give the gradients back to their stream, point them at the flat buckets' averages."""
        self._pending = False
        for index in range(len(self.buckets)):
            self._reduce(index)
        borrows, self._borrows = self._borrows, []
        for borrow in borrows:
            borrow.drop()
        flats, self._flats = self._flats, []
        for params, flat in flats:  # each gradient becomes a view of its bucket's average
            for p, view in zip(params, _views(flat, [p.grad.shape for p in params])):
                p.grad = view

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without reducing them (gradient
        accumulation: the first backward outside reduces the sum)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> DDPHooks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (
            f"<DDPHooks {len(self.buckets)} buckets, {self.reduction} over {self.dims} "
            f"on stream {self.stream.name!r}>"
        )


def _buckets(params: Sequence[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """Parameters in reverse order (roughly the order backward reaches them), in buckets
    of about ``bucket_bytes``, each of one dtype (as DDP's: a bucket is one flat tensor)."""
    buckets: list[list[Tensor]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or (size + nbytes > bucket_bytes or buckets[-1][0].dtype != p.dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _flatten(grads: list[Tensor]) -> Tensor:
    """One flat copy of a bucket's gradients, in order: one message (``aten._chunk_cat``,
    which FSDP2 copies its buckets with; shape ``[1, n]``) where it applies, else a reshape
    per gradient and a ``cat`` (a 0-d or empty gradient)."""
    if all(g.dim() and g.numel() for g in grads):
        return torch._chunk_cat(grads, 0, 1)
    return torch.cat([g.reshape(-1) for g in grads])


def _views(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """Contiguous views of ``shapes``, one after the other, of a bucket's flat tensor: one
    message for the whole bucket (:func:`bucket_views`), where a view per gradient was a
    message each (28 of a tiny GPT-2 step's 326)."""
    layout, offset = [], flat._mkey.offset
    for shape in shapes:
        layout.append((tuple(shape), contiguous(tuple(shape)), offset))
        offset += shape.numel()
    dtype, device = flat._mkey.dtype, flat._mkey.device
    spec = [Spec((*view, dtype, device, flat)) for view in layout]

    def call(seq: int, results: list, mutates: list[int], stream_ref: m.StreamRef) -> Any:
        args = m.ArgsKwargs.from_python((flat, tuple(layout)))  # a constant: no walk on a rank
        return m.CallFunction(seq, results, [], _BUCKET_VIEWS, args, stream_ref, [])

    return bind_outputs(spec, flat._mesh, flat._stream, [flat], call)


@rank_function
def bucket_views(flat: torch.Tensor, layout: tuple[tuple, ...]) -> list[torch.Tensor]:
    """On a rank: the views ``(shape, stride, offset)`` of a bucket's flat tensor."""
    return [flat.as_strided(shape, stride, offset) for shape, stride, offset in layout]


_BUCKET_VIEWS = m.FunctionPath(f"{__name__}.bucket_views")


def ddp_hooks(
    model: torch.nn.Module | Iterable[Tensor],
    mesh_dim: str | Sequence[str],
    *,
    stream: Stream | None = None,
    bucket_bytes: int = 25 << 20,
    reduction: str = "avg",
) -> DDPHooks:
    """Average gradients over ``mesh_dim`` during ``loss.backward()``, bucket by bucket.

    Each bucket (about ``bucket_bytes`` of parameters, in reverse parameter
    order) is lent to ``stream`` (default: a new ``dm.Stream("ddp")``) and
    all-reduced there as soon as its last gradient has been accumulated, so
    the reduction overlaps the rest of backward on the ranks. When backward
    ends the gradients are given back: ``optimizer.step()`` sees the averages.
    Every backward reduces the accumulated ``.grad``; accumulate over several
    backward passes inside ``hooks.no_sync()``. Parameters must be mesh tensors
    that require grad.

    Parameters
    ----------
    model
        A module (its parameters that require grad) or the parameters themselves.
    mesh_dim
        The data-parallel mesh dimension(s) the gradients are reduced over.
    stream
        The communication stream (default: ``dm.Stream("ddp")``).
    bucket_bytes
        About how many bytes of parameters one collective carries.
    reduction
        ``"avg"`` (the default, as DDP) or any reduction of :func:`reduce`.

    Returns
    -------
    DDPHooks
        ``.remove()`` (or leaving ``with``) takes the hooks out; ``.no_sync()``
        skips the reduction for the backward passes inside it.
    """
    params = list(model.parameters() if isinstance(model, torch.nn.Module) else model)
    params = [p for p in dict.fromkeys(params) if p.requires_grad]
    if not params:
        raise ValueError("ddp_hooks: no parameter requires grad")
    for p in params:
        if not isinstance(p, Tensor):
            raise TypeError(f"ddp_hooks needs parameters that are mesh tensors, got {p!r}")
    dims = (mesh_dim,) if isinstance(mesh_dim, str) else tuple(mesh_dim)
    missing = [d for d in dims if d not in params[0].mesh.dims]
    if missing:
        raise KeyError(f"ddp_hooks: {missing} are not dimensions of {params[0].mesh!r}")
    return DDPHooks(params, dims, stream or Stream("ddp"), bucket_bytes, reduction)
