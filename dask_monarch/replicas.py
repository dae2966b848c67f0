"""In-job recovery for data-parallel meshes: ``dm.run_steps`` (docs/recovery.md).

``dm.run_steps(step, range(n), mesh=..., setup=..., state=...)`` runs
``step(job, i)`` for each step, and after each takes a snapshot of the
replicated state on every rank (a copy in host memory, on the ``snapshot``
stream, kept by the worker outside the controller: worker/snapshots.py).
When a rank is lost, the broken mesh is closed, a new one made once the
cluster has its ranks again, the newest snapshot any survivor holds is
broadcast from it to every rank of the new mesh, and the steps after it run
again: the job loses a step, not its process. What cannot be recovered this
way (state that is not replicated, no survivor) raises ``DeviceException``,
which ``dask-monarch run --max-restarts`` turns into a restart from the job's
checkpoint.
"""

from __future__ import annotations

import collections
import copy
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import checkpoint, random, state_tree
from .controller.session import MeshFuture, Session, live_sessions
from .deployment import restarts
from .exceptions import DeviceException, RemoteException
from .fetch import fetch_shard
from .mesh import DeviceMesh
from .remote_function import remote
from .stream import Stream
from .tensor import Tensor

__all__ = ["run_steps", "StepRun", "Recovery"]

_RANKS = "dask_monarch.worker.snapshots."
STREAM = Stream("snapshot")
CHECK_EVERY = 100  # the state before the first step, snapshot 0 and every this many are checked
_int = lambda *a, **k: torch.empty((), dtype=torch.int64)  # noqa: E731


def _fill(key: str, number: int, tensors: list[torch.Tensor], group: Any) -> None:
    for t in tensors:
        t.zero_()  # every target is changed by the restore


_take = remote(_RANKS + "take", propagate=_int)
_differing = remote(
    _RANKS + "differing", propagate=lambda tensors, group: torch.empty(len(tensors), dtype=bool)
)
_newest = remote(_RANKS + "newest", propagate=_int)
_restore = remote(_RANKS + "restore", propagate=_fill)


@dataclass
class Recovery:
    """A lost rank the job survived: the step where it was noticed, the first step that ran
    again, and the cause (the DeviceException's text)."""

    step: Any
    resumed: Any
    cause: str


@dataclass
class StepRun:
    """What ``run_steps`` returns: the job and mesh it ended on, and the recoveries."""

    job: Any
    mesh: DeviceMesh
    recoveries: list[Recovery] = field(default_factory=list)


@dataclass
class _Snapshot:
    """The client's half of a snapshot: the layout and the plain values (the ranks hold the
    tensors) and the future that resolves once every rank took it."""

    info: dict
    taken: MeshFuture | None = None


class _Job:
    """One ``run_steps`` call: its key on the workers, its mesh and job, its snapshots."""

    def __init__(self, make_mesh: Callable, setup: Callable, state: Callable, load: Callable):
        self.key = f"run_steps-{uuid.uuid4().hex}"
        self.make_mesh, self.setup, self.state, self.load = make_mesh, setup, state, load
        self.snapshots: dict[int, _Snapshot] = {}
        self.pending: collections.deque[int] = collections.deque()
        self.mesh: DeviceMesh | None = None
        self.job: Any = None
        self.sessions: list[Session] = []
        self.with_generators = True  # False once they differ across the ranks (check_replicated)

    def start(self) -> None:
        before = set(live_sessions())
        self.mesh = self.make_mesh()
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"run_steps: mesh() must return a DeviceMesh, got {self.mesh!r}")
        self.sessions = [s for s in live_sessions() if s not in before] or [self.mesh._session]
        self.client = self.mesh._session.controller.client  # the mesh's Dask client
        self.job = self.setup(self.mesh)
        self.group = self.mesh.process_group(self.mesh.dims)

    def tree(self) -> dict:
        with self.mesh.activate():
            tree = {"state": self.state(self.job)}
            if self.with_generators:
                tree["rng"] = random.get_state()
            return tree

    def check_replicated(self) -> None:
        """Before the first step: every entry of the state must be equal on every rank. The
        generators may differ (never seeded alike): they are left out then, with a warning."""
        items = [(p, v) for p, v in state_tree.entries(self.tree()) if isinstance(v, Tensor)]
        with self.mesh.activate():
            mask = _differing([t for _, t in items], self.group)
        differ = [state_tree.key(p) for (p, _), d in zip(items, fetch_shard(mask).result()) if d]
        if "rng" in differ:
            differ.remove("rng")
            self.with_generators = False
            warnings.warn(
                "run_steps: the ranks' random generators differ (they were not seeded alike, "
                "e.g. with dm.random.manual_seed): a replacement rank cannot get its own back, "
                "so a replayed step that draws random numbers will draw others",
                RuntimeWarning,
                stacklevel=4,
            )
        if differ:
            raise ValueError(
                f"run_steps: the state is not replicated: {differ} differ across the ranks of "
                f"{self.mesh!r}; a lost rank's state is copied from a peer, so every rank must "
                "hold the same state (docs/recovery.md)"
            )

    def take(self, number: int) -> None:
        """Snapshot ``number``: the state after the step at that position (-1: before any)."""
        tree = self.tree()
        items = state_tree.entries(tree)
        tensors = [(p, v) for p, v in items if isinstance(v, Tensor)]
        _one_mesh([t for _, t in tensors], self.mesh)
        info = {
            "directory": f"snapshot {number}",
            "record": {
                "entries": [(p, state_tree.key(p), isinstance(v, Tensor)) for p, v in items],
                "containers": state_tree.containers(tree),
                "per_rank": [],
                "ranks": self.mesh.size(),
            },
            "tensors": {state_tree.key(p): (tuple(t.shape), t.dtype) for p, t in tensors},
            "values": {
                state_tree.key(p): copy.deepcopy(v) for p, v in items if not isinstance(v, Tensor)
            },
        }
        lent = [STREAM.borrow(t) for _, t in tensors]  # immutably: the next step reads them
        check = {}
        if number == 0 or number % CHECK_EVERY == 0:  # the ranks compare their copies
            check = {"group": self.group, "names": [state_tree.key(p) for p, _ in tensors]}
        with self.mesh.activate(), STREAM.activate():
            done = _take(self.key, number, [b for b, _ in lent], **check)
            for _, borrow in lent:
                borrow.drop()
            self.snapshots[number] = _Snapshot(info, fetch_shard(done))
        self.pending.append(number)

    def settle(self, ahead: int) -> None:
        """Wait until at most ``ahead`` snapshots are not yet taken on every rank; forget the
        snapshots older than the newest one every rank holds."""
        while len(self.pending) > ahead:
            number = self.pending.popleft()
            self.snapshots[number].taken.result()
            for old in [n for n in self.snapshots if n < number]:
                del self.snapshots[old]

    def recover(self, cause: DeviceException) -> int:
        """A new mesh and job restored from the newest snapshot a survivor holds; returns the
        position to go on from."""
        restarts.close_sessions(self.sessions)
        restarts.wait_for_ranks(self.client, self.mesh.size(), lambda text: None)
        self.pending.clear()
        self.start()
        with self.mesh.activate(), STREAM.activate():
            number = int(fetch_shard(_newest(self.key, self.group)).result().item())
        snapshot = self.snapshots.get(number)
        if snapshot is None:
            raise _Unrecoverable(
                "run_steps cannot recover in the job: no rank of the new mesh holds a snapshot "
                f"of its state (the ranks that held one were lost too); after: {cause}"
            ) from cause
        info = {**snapshot.info, "values": copy.deepcopy(snapshot.info["values"])}
        tree, targets = checkpoint.fill(self.tree(), info, self.mesh)
        try:
            with self.mesh.activate():
                _restore(self.key, number, [t for _, t in targets], self.group)
                if self.with_generators:
                    random.set_state(tree["rng"])
            if self.load is not None:
                self.load(self.job, tree["state"])
            self.take(number)  # the new ranks hold it too from now on
            self.settle(0)
        except RemoteException as e:  # the state is not replicated: a restart's to handle
            raise _Unrecoverable(
                f"run_steps cannot recover in the job: {e.args[0]}; after: {cause}"
            ) from e
        for old in [n for n in self.snapshots if n < number]:
            del self.snapshots[old]
        return number + 1

    def drop_snapshots(self) -> None:
        """Forget the job's snapshots on every worker of the cluster."""
        from .worker import drop_snapshots

        try:
            self.client.run(drop_snapshots, self.key)
        except Exception as e:  # a worker gone with the job's failure: nothing to free there
            warnings.warn(
                f"run_steps: could not drop every snapshot: {e!r}", RuntimeWarning, stacklevel=3
            )


class _Unrecoverable(DeviceException):
    """The job cannot be recovered in place (docs/recovery.md): a restart's to handle."""


def _one_mesh(tensors: list[Tensor], mesh: DeviceMesh) -> None:
    for t in tensors:
        if t._mesh is not mesh and t._mesh != mesh:
            raise ValueError(
                f"run_steps: the state holds {t!r} of {t._mesh._label()}, not of the job's "
                f"mesh {mesh._label()}"
            )


def run_steps(
    step: Callable[[Any, Any], Any],
    steps: Iterable | int,
    *,
    mesh: Callable[[], DeviceMesh],
    setup: Callable[[DeviceMesh], Any],
    state: Callable[[Any], Any],
    load: Callable[[Any, Any], Any] | None = None,
    max_recoveries: int = 3,
) -> StepRun:
    """Run ``step(job, i)`` for each ``i`` of ``steps``, surviving lost ranks (docs/recovery.md).

    ``mesh()`` makes the mesh and ``setup(mesh)`` the job on it (again after a
    loss); ``state(job)`` is its replicated state (a pytree as
    ``dm.checkpoint`` takes it, equal on every rank: checked), snapshotted after
    every step with the ranks' random generators (when they are seeded alike;
    else without, and a warning); ``load(job, state)`` finishes a restore (an optimizer's
    ``load_state_dict``). A step must depend only on the state and ``i``: after a
    lost rank the job is rebuilt on a new mesh, restored from a survivor's
    snapshot and the steps since run again, with a ``RuntimeWarning``.
    ``DeviceException`` when that cannot be done (docs/recovery.md) or after
    ``max_recoveries`` losses; other failures are raised at once.
    """
    numbers = list(range(steps)) if isinstance(steps, int) else list(steps)
    if type(max_recoveries) is not int or max_recoveries < 0:
        raise ValueError(f"max_recoveries must be an int of at least 0, got {max_recoveries!r}")
    run = _Job(mesh, setup, state, load)
    run.start()
    recoveries: list[Recovery] = []
    try:
        position = 0
        run.check_replicated()
        run.take(-1)
        while position < len(numbers):
            try:
                step(run.job, numbers[position])
                run.take(position)
                run.settle(1)
                position += 1
            except BaseException as e:
                cause = restarts.restart_cause(e)
                if cause is None or isinstance(cause, _Unrecoverable):
                    raise
                if len(recoveries) >= max_recoveries:
                    raise
                failed = numbers[position]
                position = _recover(run, cause, max_recoveries - len(recoveries))
                resumed = numbers[position] if position < len(numbers) else None
                recoveries.append(Recovery(failed, resumed, restarts.describe(cause)))
                warnings.warn(
                    f"run_steps: the mesh broke in step {failed!r} ({restarts.describe(cause)}); "
                    f"a new mesh was restored from a replica's snapshot and runs again from step "
                    f"{resumed!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        run.settle(0)
    except BaseException:
        restarts.close_sessions(run.sessions)  # the caller never gets this mesh
        raise
    finally:
        run.drop_snapshots()
    return StepRun(run.job, run.mesh, recoveries)


def _recover(run: _Job, cause: DeviceException, tries: int) -> int:
    """Recover; again if the new mesh breaks during the restore itself, up to ``tries``."""
    while True:
        try:
            return run.recover(cause)
        except _Unrecoverable:
            raise
        except DeviceException as e:
            tries -= 1
            if tries <= 0:
                raise
            cause = e
