"""Typed option trees: frozen dataclasses whose fields carry a type, a default, the allowed values and a doc line.

Each config section (``model``, ``precision``, ``data``, ``optim``, ``train``, ``init_from``) is a class decorated
with :func:`section` (a frozen dataclass that knows its key path, ``"model"`` or ``"precision.attention"``) whose
fields are made with :func:`option`. Everything a config needs is derived from those classes, so each key is written
once:

- :func:`build`: an instance from a (partial) mapping or ConfigDict; a missing key takes its default; an unknown
  key, a wrong type or a value outside the allowed set raises a one-line ``ValueError`` naming the key.
- construction: the same checks for an instance built directly, then the section's own ``check()`` (what only it
  knows: divisible heads, a worker count >= 0).
- :func:`leaves`: every key of a tree with its type, default, allowed values and doc (``--help``, the parser).
- :func:`to_dict`: the instance as nested plain dicts (``config.json``).
- :func:`parse`: a command-line string as a value of a key's type.

Leaf types are ``bool``, ``int``, ``float``, ``str`` and ``tuple[str, ...]`` (written ``a,b`` on the command line);
a field whose type is another section class nests it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

_TUPLE = tuple[str, ...]


@typing.dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def section(path: str):
    """Make the decorated class a frozen dataclass for the config section at key path ``path``: construction checks
    every field (:func:`check_fields`), then calls the class's ``check()`` if it defines one."""

    def make(cls):
        cls.PATH = path
        own_check = cls.__dict__.get("check")

        def __post_init__(self):
            check_fields(self)
            if own_check is not None:
                own_check(self)

        cls.__post_init__ = __post_init__
        return dataclasses.dataclass(frozen=True)(cls)

    return make


def option(default: Any, doc: str, choices: tuple | None = None) -> Any:
    """A dataclass field with its ``default``, a one-line ``doc`` and, optionally, the allowed values ``choices``
    (for a tuple field: the values its entries are drawn from)."""
    return dataclasses.field(
        default=default, metadata={"doc": doc, "choices": None if choices is None else tuple(choices)}
    )


class Leaf(NamedTuple):
    key: str  # the full dotted path, "model.d_model"
    type: Any  # bool, int, float, str or tuple[str, ...]
    default: Any
    choices: tuple | None
    doc: str


def is_section(typ: Any) -> bool:
    return isinstance(typ, type) and dataclasses.is_dataclass(typ)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def type_name(typ: Any) -> str:
    return "tuple" if typ == _TUPLE else typ.__name__


def leaves(cls: type, path: str | None = None) -> Iterator[Leaf]:
    """Every leaf key of section ``cls`` (depth first, in field order)."""
    path = cls.PATH if path is None else path
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        typ, key = hints[f.name], _join(path, f.name)
        if is_section(typ):
            yield from leaves(typ, key)
        else:
            yield Leaf(key, typ, f.default, f.metadata.get("choices"), f.metadata.get("doc", ""))


def _coerce(key: str, value: Any, typ: Any, choices: tuple | None) -> Any:
    """``value`` checked against ``typ`` and ``choices`` (an int is taken as a float; a list as a tuple)."""
    if typ == _TUPLE:
        if isinstance(value, str) or not isinstance(value, tuple | list):
            raise ValueError(f"config key {key}={value!r}: must be a tuple drawn from {choices}")
        value = tuple(value)
        if any(not isinstance(v, str) or (choices is not None and v not in choices) for v in value):
            raise ValueError(f"config key {key}={value!r}: must be a tuple drawn from {choices}")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ValueError(f"config key {key}={value!r} has type {type(value).__name__}; expected {type_name(typ)}")
    if choices is not None and value not in choices:
        raise ValueError(f"config key {key}={value!r} is not allowed; valid values: {', '.join(map(str, choices))}")
    return value


def check_seed(key: str, value: int) -> None:
    """ValueError unless ``value`` is a seed that jax, numpy and grain all take: an int in [0, 2**63)."""
    if not 0 <= value < 2**63:
        raise ValueError(f"config key {key}={value!r} must be a seed in [0, 2**63)")


def check_fields(obj: Any) -> None:
    """Check (and normalize: int -> float, list -> tuple) every field of the section instance ``obj`` in place."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        typ, value, key = hints[f.name], getattr(obj, f.name), _join(obj.PATH, f.name)
        if is_section(typ):
            if not isinstance(value, typ):
                raise ValueError(f"config key {key} must be a {typ.__name__} section, got {type(value).__name__}")
            continue
        object.__setattr__(obj, f.name, _coerce(key, value, typ, f.metadata.get("choices")))


def _as_mapping(value: Any, key: str) -> Mapping:
    if hasattr(value, "to_dict"):  # ml_collections.ConfigDict
        return value.to_dict()
    if isinstance(value, Mapping):
        return value
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    raise ValueError(f"config key {key} must be a section (a mapping of keys), got {value!r}")


def unknown_key_error(keys: str | list[str], known: list[str]) -> ValueError:
    """'unknown config key K; did you mean X? valid keys in that section: ...' (for several keys: 'key(s) [...]')."""
    first = keys if isinstance(keys, str) else keys[0]
    what = f"key {first!r}" if isinstance(keys, str) else f"key(s) {keys}"
    section = first.rsplit(".", 1)[0] + "." if "." in first else ""
    same_section = sorted(k for k in known if k.startswith(section))
    guess = difflib.get_close_matches(first, known, n=1)
    hint = f"did you mean {guess[0]!r}? " if guess else ""
    return ValueError(
        f"unknown config {what}; {hint}valid keys in that section: {', '.join(same_section or sorted(known))}"
    )


def build(cls: type, values: Any = None, path: str | None = None) -> Any:
    """An instance of section ``cls`` from ``values`` (a mapping, a ConfigDict or None): missing keys take their
    defaults; unknown keys, wrong types and values outside the allowed set raise ValueError naming the key."""
    path = cls.PATH if path is None else path
    given = dict(_as_mapping(values, path)) if values is not None else {}
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise unknown_key_error([_join(path, k) for k in unknown], [leaf.key for leaf in leaves(cls, path)])
    kwargs = {}
    for name, value in given.items():
        typ = hints[name]
        kwargs[name] = build(typ, value, _join(path, name)) if is_section(typ) else value
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """The section instance ``obj`` as nested plain dicts."""
    return {
        f.name: to_dict(getattr(obj, f.name))
        if dataclasses.is_dataclass(getattr(obj, f.name))
        else getattr(obj, f.name)
        for f in dataclasses.fields(obj)
    }


def parse(key: str, text: str, typ: Any) -> Any:
    """The command-line string ``text`` for ``key`` as a value of type ``typ`` (bools: true/false/1/0; tuples: a,b)."""
    if typ is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"config key {key}: {text!r} is not a bool (use true/false)")
        return text.lower() in ("true", "1")
    if typ == _TUPLE:
        return tuple(t for t in text.split(",") if t)
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"config key {key}: cannot parse {text!r} as {type_name(typ)}") from None
