"""dask_monarch's configuration: defaults in ``dask_monarch.yaml``, read through dask.config."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import dask.config
import yaml
from dask.utils import parse_timedelta

_fn = os.path.join(os.path.dirname(__file__), "dask_monarch.yaml")
with open(_fn) as f:
    dask.config.update_defaults(yaml.safe_load(f))


def _read_env_alias() -> None:
    """Apply ``DASK_MONARCH__...`` environment variables to the ``dask_monarch`` settings.

    Dask strips ``DASK_`` from a variable's name, so ``DASK_MONARCH__FLUSH__IDLE``
    lands at ``monarch.flush.idle``; the documented spelling must still win over
    the defaults (``DASK_DASK_MONARCH__...`` reaches ``dask_monarch`` directly).
    Runs at import, in every process that imports dask_monarch.
    """
    alias = dask.config.config.get("monarch")
    if isinstance(alias, dict) and alias:
        dask.config.update(dask.config.config, {"dask_monarch": alias}, priority="new")


_read_env_alias()


def get(key: str, default: Any = None) -> Any:
    """``dask.config.get("dask_monarch." + key)``."""
    return dask.config.get(f"dask_monarch.{key}", default)


def seconds(key: str) -> float | None:
    """A duration setting in seconds (``None`` stays ``None``)."""
    value = get(key)
    if value is None:
        return None
    try:
        return parse_timedelta(value, default="s")
    except (KeyError, ValueError, TypeError):
        raise ValueError(
            f"{_setting(key)} is {value!r}, which is not a duration: give seconds (0.5) or a "
            "duration with a unit ('5ms', '2s', '1 minute'), or null where the setting allows it"
        ) from None


def timeout(value: Any, where: str) -> float:
    """A ``timeout=`` argument: a number of seconds, zero or more (refused before anything
    is sent or waited for)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: timeout must be a number of seconds, got {value!r}")
    if not value >= 0:  # NaN too
        raise ValueError(f"{where}: timeout must be zero or more seconds, got {value!r}")
    return float(value)


def integer(key: str, minimum: int | None = None) -> int:
    """A whole-number setting (``flush.size``), from YAML or an environment variable's text."""
    value = get(key)
    number = None
    if type(value) is int or (type(value) is float and value.is_integer()):
        number = int(value)
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        number = int(value)
    if number is None or (minimum is not None and number < minimum):
        least = f" of at least {minimum}" if minimum is not None else ""
        raise ValueError(f"{_setting(key)} is {value!r}, which is not a whole number{least}")
    return number


_TRUE = frozenset({"true", "yes", "on", "1", 1})
_FALSE = frozenset({"false", "no", "off", "0", 0})


def flag(key: str, auto: bool = False) -> bool | None:
    """A true/false setting, from YAML or an environment variable's text; with ``auto``, also
    ``auto`` or null (None: the caller decides). Anything else is refused: a misspelt value
    ("ture") would otherwise read as one or the other without a word."""
    value = get(key)
    if isinstance(value, bool):
        return value
    text = value.strip().lower() if isinstance(value, str) else value
    if isinstance(text, (str, int)) and (text in _TRUE or text in _FALSE):  # an env var's 1: int
        return text in _TRUE
    if auto and text in (None, "auto"):
        return None
    accepted = (
        "true, false (yes/no, on/off, 1/0), or auto (null too)"
        if auto
        else "true or false (yes/no, on/off, 1/0)"
    )
    raise ValueError(f"{_setting(key)} is {value!r}, which is not one of: {accepted}")


def _setting(key: str) -> str:
    """How an error names setting ``key``: its name and its environment variable."""
    variable = f"DASK_MONARCH__{key.upper().replace('.', '__').replace('-', '_')}"
    return f"the setting dask_monarch.{key} (environment: {variable})"


_frozen = False
_tuned = False  # freeze_gc ran in this process
_modules_frozen = 0  # len(sys.modules) when the GC was last frozen


def freeze_gc() -> None:
    """Move every object alive now out of the cyclic GC's reach, and collect less often
    (once per process).

    A process that imported torch tracks ~200 000 objects, and every full
    collection walks them all: on a worker running small ops that was 75 % of
    the time (50-80 us per message instead of 10-20). Objects made later are
    still collected. Off with ``dask_monarch.gc-freeze: false``.

    A training step makes and drops thousands of small containers (handles,
    messages, their arguments), on the client and on every rank: at Python's
    thresholds (700, 10, 10) a tiny GPT-2 step ran 3 young collections and,
    every 40 steps, a full one of 25 ms on the client; 1.3-1.8 ms per step there
    and 0.6-0.8 on each rank. ``dask_monarch.gc-threshold`` (10 000, 10, 10)
    makes that 0.2 on each (benchmarks/RESULTS.md); null keeps Python's.
    """
    global _frozen, _tuned
    if _tuned:
        return
    thresholds = get("gc-threshold", None)
    if thresholds is not None:
        if not (
            isinstance(thresholds, (list, tuple))
            and 1 <= len(thresholds) <= 3
            and all(type(t) is int and t >= 0 for t in thresholds)
        ):
            raise ValueError(
                f"{_setting('gc-threshold')} is {thresholds!r}: give up to three whole numbers "
                "(gc.set_threshold's), or null to keep Python's"
            )
        gc.set_threshold(*thresholds)
    _tuned = True
    if get("gc-freeze", True):
        _freeze()
        _frozen = True


def freeze_new_imports() -> None:
    """Freeze again if modules were imported since the GC was frozen.

    The first fake-tensor propagation in a process imports torch's lazy stack
    (dynamo, sympy: some 800 modules, 117 000 objects); on a worker that
    freezes nothing else, each full collection after it walked them all
    (44 ms each), and plain dispatch ran half as fast for seconds.

    Not done on the client after it started: everything alive then would be
    frozen too, and a model dropped later whose tensors sit in a reference
    cycle (``ddp_hooks``' hooks make one) would never be collected, its
    tensors never deleted on the ranks.
    """
    if _frozen and len(sys.modules) != _modules_frozen and not GCState.collecting:
        _freeze()


def _freeze() -> None:
    global _modules_frozen
    gc.collect()
    gc.freeze()
    _modules_frozen = len(sys.modules)


class GCState:
    """Whether a cyclic collection is running: its finalizers may send messages (and flush),
    and nothing may freeze the GC in the middle of one."""

    collecting = False

    @classmethod
    def track(cls, phase: str, info: dict) -> None:
        cls.collecting = phase == "start"


gc.callbacks.append(GCState.track)
