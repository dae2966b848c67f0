"""Checked protocol data: built with checks, loaded without them.

A message is made once on the client and loaded on every rank it goes to, in
batches. So construction checks and normalises every field (``TypeError`` or
``ValueError`` naming the field), while unpickling rebuilds the object
directly (``tuple.__new__``/``int.__new__``), so a batch loads in C without a
Python call per message or per id.

* :class:`CheckedId`: a 64-bit id allocated by the client (base of ``Ref`` and
  ``StreamRef``).
* :func:`checked`: turns an annotated class into a named tuple whose
  ``__new__`` runs the check registered for each field's annotation
  (:data:`CHECKS`; value and message modules register their own with
  :func:`register_checks`).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterable
from typing import Any

# Reconstructors that skip the checks.
_tuple_new = tuple.__new__
_int_new = int.__new__


class CheckedId(int):
    """A 64-bit id allocated by the client; compares, orders and hashes by value.

    An ``int`` subclass so that batches of messages pickle and unpickle ids in
    C (no Python call per id): a batch of small messages is mostly ids. Ids of
    different kinds never compare equal.
    """

    __slots__ = ()

    def __new__(cls, id: int) -> CheckedId:
        # checked before int() sees it: Ref("a") names the field, not int()'s parsing
        if type(id) is not int:
            if isinstance(id, (bool, CheckedId)) or not isinstance(id, int):
                raise TypeError(f"{cls.__name__} id must be an int, got {id!r}")
        if not 0 <= id < 2**64:
            raise ValueError(f"{cls.__name__} id must fit in 64 unsigned bits, got {id}")
        return _int_new(cls, id)

    @property
    def id(self) -> int:
        return int(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CheckedId) and type(other) is not type(self):
            return False
        return int.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = int.__hash__

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_int_new, (type(self), int(self)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"

    __str__ = __repr__


# --------------------------------------------------------------------------- field checks
# A check takes the value and where it goes ("CallFunction.seq"), returns the value to
# store, or raises TypeError/ValueError naming the field.


def check_int(v: Any, where: str) -> int:
    """A non-negative plain int below 2**64 (ids and bools are refused)."""
    if type(v) is int and 0 <= v < _INT_LIMIT:
        return v
    if isinstance(v, (bool, CheckedId)) or not isinstance(v, int):
        raise TypeError(f"{where} must be an int, got {v!r}")
    if v < 0:
        raise ValueError(f"{where} must be non-negative, got {v}")
    if v >= _INT_LIMIT:
        raise ValueError(f"{where} must fit in 64 unsigned bits, got {v}")
    return int(v)


_INT_LIMIT = 2**64


def _bool(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise TypeError(f"{where} must be a bool, got {v!r}")
    return v


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{where} must be a str, got {v!r}")
    return v


def _any(v: Any, where: str) -> Any:
    return v


def optional(check: Callable) -> Callable:
    """``check``, letting ``None`` through."""

    def optional(v: Any, where: str) -> Any:
        return None if v is None else check(v, where)

    return optional


def list_of(check: Callable, fast_types: Iterable[type] = ()) -> Callable:
    """A list whose items pass ``check``; lists already of ``fast_types`` are kept as they are."""

    def checked_list(v: Any, where: str) -> list:
        if type(v) is list and all(type(x) in fast_types for x in v):
            return v
        if isinstance(v, (str, bytes, dict)) or not isinstance(v, Iterable):
            raise TypeError(f"{where} must be a list, got {v!r}")
        return [check(x, f"{where}[{i}]") for i, x in enumerate(v)]

    return checked_list


def instance_of(cls: type) -> Callable:
    """A value of type ``cls`` (or a subclass), kept as it is."""

    def instance(v: Any, where: str) -> Any:
        if type(v) is not cls and not isinstance(v, cls):
            raise TypeError(f"{where} must be a {cls.__name__}, got {v!r}")
        return v

    return instance


# Field annotation -> check. Annotations are compared by value (``Ref | None``).
CHECKS: dict[Any, Callable] = {
    int: check_int,
    bool: _bool,
    str: _str,
    Any: _any,
    str | None: optional(_str),
    list[str]: list_of(_str, {str}),
}


def register_checks(checks: dict[Any, Callable]) -> None:
    """Fields annotated with a key of ``checks`` get its check in classes made after this."""
    CHECKS.update(checks)


# --------------------------------------------------------------------------- checked tuples


def checked(cls: type) -> type:
    """Make ``cls`` protocol data: a named tuple whose fields are checked by annotation.

    Construction checks and normalises every field; unpickling rebuilds the
    tuple directly (``tuple.__new__``), so a batch of messages loads on the
    worker without re-running the checks. Class attributes become field
    defaults; equality also compares the type (two messages with the same
    fields differ).
    """
    annotations = cls.__dict__.get("__annotations__", {})
    names = tuple(annotations)
    defaults = {n: cls.__dict__[n] for n in names if n in cls.__dict__}
    base = namedtuple(cls.__name__, names, defaults=[defaults[n] for n in names if n in defaults],
                      module=cls.__module__)
    namespace = {"_tnew": _tuple_new}
    params = []
    for name in names:
        namespace[f"_check_{name}"] = CHECKS[annotations[name]]
        params.append(f"{name}={name}_default" if name in defaults else name)
        if name in defaults:
            namespace[f"{name}_default"] = defaults[name]
    body = "".join(f"    {n} = _check_{n}({n}, {cls.__name__ + '.' + n!r})\n" for n in names)
    source = (f"def __new__(cls, {', '.join(params)}):\n{body}"
              f"    return _tnew(cls, ({''.join(n + ', ' for n in names)}))\n")
    exec(source, namespace)
    namespace["__new__"].__qualname__ = f"{cls.__name__}.__new__"
    attrs = {k: v for k, v in cls.__dict__.items()
             if k not in ("__dict__", "__weakref__", "__annotations__") and k not in defaults}
    attrs.update(
        __slots__=(),
        __new__=namespace["__new__"],
        __reduce_ex__=_reduce,
        __repr__=_short_repr,
        __eq__=_eq,
        __ne__=_ne,
        __hash__=tuple.__hash__,
        __annotations__=annotations,
    )
    return type(cls.__name__, (base,), attrs)


def _reduce(self: tuple, protocol: int) -> tuple:
    return (_tuple_new, (type(self), tuple(self)))


def _eq(self: tuple, other: object) -> bool:
    return type(other) is type(self) and tuple.__eq__(self, other)


def _ne(self: tuple, other: object) -> bool:
    return not _eq(self, other)


def _short_repr(self: Any) -> str:
    parts = []
    for name, value in zip(self._fields, self):
        text = repr(value)
        if len(text) > 60:
            text = text[:57] + "..."
        parts.append(f"{name}={text}")
    return f"{type(self).__name__}({', '.join(parts)})"
