"""Typed option trees: frozen dataclasses whose fields carry a type, a default, the allowed values and a doc line.

Each config section (``model``, ``precision``, ``data``, ``optim``, ``train``, ``init_from``) is a class decorated
with :func:`section` (a frozen dataclass that knows its key path, ``"model"`` or ``"precision.attention"``) whose
fields are made with :func:`option`. Everything a config needs is derived from those classes, so each key is written
once:

- :func:`build`: an instance from a (partial) mapping or ConfigDict; a missing key takes its default; an unknown
  key, a wrong type, a value outside the allowed set or outside the key's :class:`Range` raises a one-line
  ``ValueError`` naming the key, the value and what is allowed.
- construction: the same checks for an instance built directly, then the section's own ``check()`` (what only it
  knows: divisible heads, an even RoPE head dim).
- :func:`leaves`: every key of a tree with its type, default, allowed values, range and doc (``--help``, the parser).
- :func:`to_dict`: the instance as nested plain dicts (``config.json``); :func:`flatten`: nested mappings as
  ``{"a.b": leaf}``.
- :func:`parse`: a command-line string as a value of a key's type.

Leaf types are ``bool``, ``int``, ``float``, ``str`` and ``tuple[str, ...]`` (written ``a,b`` on the command line);
a field whose type is another section class nests it. An int or float key states its allowed numbers with a
:class:`Range` (``at_least(1)``, ``above(0)``, ``Range(0, 1, high_open=True)``); a float key refuses NaN and ±inf
(``finite=False`` allows ±inf), with or without a range. A key's allowed values are a tuple, or a
:class:`LiveChoices` read from a registry each time (values that other modules register later are allowed).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

_TUPLE = tuple[str, ...]


@typing.dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def section(path: str):
    """Make the decorated class a frozen dataclass for the config section at key path ``path``: construction checks
    every field (:func:`_check_fields`), then calls the class's ``check()`` if it defines one; ``obj.to_dict()`` is
    :func:`to_dict`."""

    def make(cls):
        cls.PATH = path
        own_check = cls.__dict__.get("check")

        def __post_init__(self):
            _check_fields(self)
            if own_check is not None:
                own_check(self)

        cls.__post_init__ = __post_init__
        cls.to_dict = to_dict
        return dataclasses.dataclass(frozen=True)(cls)

    return make


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers an int or float key allows: ``low <= x`` (``<`` with ``low_open``) and ``x <= high`` (``<`` with
    ``high_open``), a None bound being no bound; ``also``: values allowed besides (``-1`` for "all" or "the newest");
    ``finite``: ±inf refused (float keys; NaN always is). ``what`` names the kind of number in errors ("a seed");
    ``note`` says what a special value means ("0 = off"), in errors after the range."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()
    finite: bool = True
    what: str = ""
    note: str = ""

    def __contains__(self, x) -> bool:
        if x in self.also:
            return True
        if isinstance(x, float) and not math.isfinite(x) and (self.finite or math.isnan(x)):
            return False
        low_ok = self.low is None or (x > self.low if self.low_open else x >= self.low)
        return low_ok and (self.high is None or (x < self.high if self.high_open else x <= self.high))

    def __str__(self) -> str:
        """The bounds alone: ``>= 1``, ``> 0``, ``in [0, 1)``, ``>= 0 or -1`` (``finite`` when unbounded)."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_bound(self.low)}, {_bound(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_bound(self.low)}"
        elif self.high is not None:
            text = f"{'<' if self.high_open else '<='} {_bound(self.high)}"
        else:
            text = "finite" if self.finite else "any number"
        return " or ".join([text, *map(str, self.also)])

    def message(self, value) -> str:
        """What ``value`` (outside the range) must be: ``a seed in [0, 2**63)``, ``finite and > 0``, ``>= 0 (0 =
        off)``."""
        text = f"{self.what} {self}" if self.what else str(self)
        if isinstance(value, float) and not math.isfinite(value) and self.finite and text != "finite":
            text = f"finite and {text}"
        return f"{text} ({self.note})" if self.note else text


def _bound(x) -> str:
    """A bound as written in a range: ``2**63`` for a large power of two, else the number itself."""
    if isinstance(x, int) and x >= 2**32 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    return str(x)


def at_least(low, **kwargs) -> Range:
    """``x >= low`` (``Range``'s other fields as keywords: ``also``, ``note``, ...)."""
    return Range(low, **kwargs)


def above(low, **kwargs) -> Range:
    """``x > low``."""
    return Range(low, low_open=True, **kwargs)


SEED = Range(0, 2**63, high_open=True, what="a seed")  # what jax, numpy and grain all take


class LiveChoices(Sequence):
    """Allowed values read from a registry each time they are asked for: ``names()`` returns them in order. For a key
    whose values other modules may add at run time (``precision.matmul.<kind>``: the registered matmul formats)."""

    def __init__(self, names: Callable[[], tuple[str, ...]]):
        self._names = names

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, value) -> bool:
        return value in self._names()

    def __iter__(self):
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


def option(default: Any, doc: str, choices: Sequence | None = None, bounds: Range | None = None) -> Any:
    """A dataclass field with its ``default``, a one-line ``doc`` and, optionally, the allowed values ``choices``
    (for a tuple field: the values its entries are drawn from; a :class:`LiveChoices` stays live, anything else is
    copied to a tuple) or, for an int or float field, the :class:`Range` ``bounds`` of its allowed numbers (a float
    field without one allows every finite number)."""
    if choices is not None and not isinstance(choices, LiveChoices):
        choices = tuple(choices)
    metadata = {"doc": doc, "choices": choices, "bounds": bounds}
    return dataclasses.field(default=default, metadata=metadata)


class Leaf(NamedTuple):
    key: str  # the full dotted path, "model.d_model"
    type: Any  # bool, int, float, str or tuple[str, ...]
    default: Any
    choices: Sequence | None  # a tuple, or a LiveChoices
    doc: str
    bounds: Range | None = None  # an int or float key's allowed numbers (a float key without one: finite ones)


def _is_section(typ: Any) -> bool:
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
        if _is_section(typ):
            yield from leaves(typ, key)
        else:
            meta = f.metadata
            yield Leaf(key, typ, f.default, meta.get("choices"), meta.get("doc", ""), meta.get("bounds"))


def _coerce(key: str, value: Any, typ: Any, choices: Sequence | None, bounds: Range | None = None) -> Any:
    """``value`` checked against ``typ``, ``choices`` and ``bounds`` (an int is taken as a float; a list as a
    tuple)."""
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
    if typ is float and bounds is None:
        bounds = Range()  # every finite number
    if bounds is not None and value not in bounds:
        raise ValueError(f"config key {key}={value!r} must be {bounds.message(value)}")
    return value


def _check_fields(obj: Any) -> None:
    """Check (and normalize: int -> float, list -> tuple) every field of the section instance ``obj`` in place."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        typ, value, key = hints[f.name], getattr(obj, f.name), _join(obj.PATH, f.name)
        if _is_section(typ):
            if not isinstance(value, typ):
                raise ValueError(f"config key {key} must be a {typ.__name__} section, got {type(value).__name__}")
            continue
        meta = f.metadata
        object.__setattr__(obj, f.name, _coerce(key, value, typ, meta.get("choices"), meta.get("bounds")))


def _as_mapping(value: Any, key: str) -> Mapping:
    if hasattr(value, "to_dict"):  # a section, or an ml_collections.ConfigDict
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
    """An instance of section ``cls`` from ``values`` (a mapping, a ConfigDict, None, or an instance of ``cls``,
    returned as is): missing keys take their defaults; unknown keys, wrong types and values outside the allowed set
    raise ValueError naming the key."""
    if isinstance(values, cls):
        return values
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
        kwargs[name] = build(typ, value, _join(path, name)) if _is_section(typ) else value
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """The section instance ``obj`` as nested plain dicts."""
    return {
        f.name: to_dict(getattr(obj, f.name))
        if dataclasses.is_dataclass(getattr(obj, f.name))
        else getattr(obj, f.name)
        for f in dataclasses.fields(obj)
    }


def flatten(tree: Mapping, sep: str = ".", prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` of nested mappings (``sep`` joins the keys, ints as their digits): a config as its dotted
    keys, a parameter tree as its ``blocks/0/attn/q/kernel`` paths."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, sep, path + sep))
        else:
            out[path] = value
    return out


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
