"""Training state as paths: a pytree of dicts, lists and tuples, seen leaf by leaf.

``model.state_dict()``, ``optimizer.state_dict()`` (whose ``state`` is keyed
by ints), a step counter and an RNG state, nested in dicts: what
``dm.checkpoint`` saves and loads and ``dm.run_steps`` snapshots. A leaf is
anything that is not a dict, list or tuple; its path is the keys from the
root. Keys join with dots into one string (``"optim.state.0.exp_avg"``), the
name a leaf has in a torch.distributed.checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Path = tuple  # the dict keys and sequence indices from the root to a leaf


def entries(state: Any) -> list[tuple[Path, Any]]:
    """Every leaf of ``state`` with its path, depth first in insertion order.

    Two paths that join into the same key (``{"a.b": x, "a": {"b": y}}``) are
    refused: a checkpoint could not tell them apart.
    """
    found = list(_walk(state, ()))
    seen: dict[str, Path] = {}
    for path, _ in found:
        name = key(path)
        if name in seen:
            raise ValueError(
                f"the state's entries {seen[name]!r} and {path!r} are both named {name!r}; "
                "rename one of them"
            )
        seen[name] = path
    return found


def _walk(node: Any, path: Path) -> Iterator[tuple[Path, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"state keys must be str or int, got {k!r} at {path!r}")
            yield from _walk(v, (*path, k))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _walk(v, (*path, i))
    else:
        yield path, node


def containers(state: Any) -> list[tuple[Path, str, int]]:
    """Every dict, list and tuple of ``state`` (the root and empty ones included) as (path,
    kind, length), parents before children: what a load needs to make the containers a
    state lacks as they were saved (leaf paths alone cannot tell a list from a dict)."""
    found: list[tuple[Path, str, int]] = []

    def walk(node: Any, path: Path) -> None:
        if isinstance(node, dict):
            found.append((path, "dict", len(node)))
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, (list, tuple)):
            found.append((path, "list" if isinstance(node, list) else "tuple", len(node)))
            for i, v in enumerate(node):
                walk(v, (*path, i))

    walk(state, ())
    return found


MISSING = object()  # what :func:`get` finds where the state has nothing


def get(state: Any, path: Path) -> Any:
    """The node at ``path`` (a leaf or a container), or :data:`MISSING`."""
    for head in path:
        if isinstance(state, dict) and head in state:
            state = state[head]
        elif isinstance(state, (list, tuple)) and isinstance(head, int) and head < len(state):
            state = state[head]
        else:
            return MISSING
    return state


def kind(node: Any) -> str | None:
    """``"dict"``, ``"list"`` or ``"tuple"`` for a container, None for a leaf."""
    if isinstance(node, dict):
        return "dict"
    if isinstance(node, (list, tuple)):
        return "list" if isinstance(node, list) else "tuple"
    return None


def key(path: Path) -> str:
    """The leaf's name: its path joined with dots (the root itself is ``""``)."""
    return ".".join(str(p) for p in path)


def put(state: Any, path: Path, value: Any) -> Any:
    """Set the leaf at ``path`` to ``value``; returns the root (a new one if a list or tuple
    on the way changed).

    Dicts change in place, and a missing dict entry on the way is made (an empty
    optimizer state gains its parameters' entries). A list is copied, never
    changed: a state dict's lists are often its owner's own (a scheduler's
    ``state_dict()`` shares ``_last_lr`` with the scheduler, which a load
    would have changed before ``load_state_dict``, as torch never does).
    """
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(state, dict):
        child = state.get(head, {} if rest else None)
        state[head] = put(child, rest, value)
        return state
    if isinstance(state, list) and isinstance(head, int) and head < len(state):
        items = list(state)
        items[head] = put(items[head], rest, value)
        return items
    if isinstance(state, tuple) and isinstance(head, int) and head < len(state):
        items = list(state)
        items[head] = put(items[head], rest, value)
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    raise KeyError(f"the state has no place for {key(path)!r} (at {head!r} in {type(state)})")
