"""A declared API: every public function in lpt/ with five or more parameters has a Google-style ``Args:`` section
that names each of its parameters.

Scanned from the source (``ast``, nothing imported): module-level functions whose name does not start with ``_``,
and the public methods and ``__init__`` of public classes (``self`` / ``cls`` not counted). A class documents its
``__init__`` in its own docstring or in the method's. A method that overrides one of the same name in a base class of
the same module takes that method's documentation (as ``inspect.getdoc`` does) and is not checked (``__init__``
always is). An ``Args:``
entry is ``name: text`` or ``a, b, c: text`` (``*args`` / ``**kwargs`` with or without their stars).
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_PARAMS = 5

# Functions skipped, with the reason. Each entry must still exist and still lack a complete Args section
# (test_exempt_list_is_current), so the list only shrinks.
EXEMPT: dict[str, str] = {}

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
_ENTRY = re.compile(r"^(\**\w+(?:\s*,\s*\**\w+)*)\s*:")


def _params(fn: ast.FunctionDef, method: bool) -> list[str]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    if method and names and names[0] in ("self", "cls"):
        names = names[1:]
    return names


def documented(doc: str | None) -> set[str] | None:
    """The parameter names of the docstring's ``Args:`` section (stars dropped), None without one."""
    lines = (doc or "").expandtabs().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    if start is None:
        return None
    names, indent = set(), None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:  # the section ended (Returns:, Raises:, prose)
            break
        m = _ENTRY.match(line.strip()) if depth == indent else None
        if m:
            names |= {n.strip().lstrip("*") for n in m.group(1).split(",")}
    return names


def _overrides(cls: ast.ClassDef, name: str, classes: dict[str, ast.ClassDef]) -> bool:
    """Whether a base class of ``cls`` defined in the same module (or one of its bases) defines ``name``."""
    for base in cls.bases:
        parent = classes.get(base.id) if isinstance(base, ast.Name) else None
        if parent is not None and (
            any(isinstance(n, _FUNCS) and n.name == name for n in parent.body) or _overrides(parent, name, classes)
        ):
            return True
    return False


def undocumented(source: str, path: str) -> dict[str, str]:
    """``{"path::qualname": what is missing}`` for each public function of ``source`` with >= MIN_PARAMS
    parameters whose ``Args:`` section is missing or leaves out a parameter."""
    tree = ast.parse(source)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    todo = [(n.name, n, False, None) for n in tree.body if isinstance(n, _FUNCS) and not n.name.startswith("_")]
    for cls in classes.values():
        if cls.name.startswith("_"):
            continue
        for m in cls.body:
            public = not m.name.startswith("_") or m.name == "__init__" if isinstance(m, _FUNCS) else False
            if public and (m.name == "__init__" or not _overrides(cls, m.name, classes)):
                todo.append((f"{cls.name}.{m.name}", m, True, cls))
    out = {}
    for qualname, fn, method, cls in todo:
        params = _params(fn, method)
        if len(params) < MIN_PARAMS:
            continue
        names = documented(ast.get_docstring(fn))
        if names is None and cls is not None and fn.name == "__init__":
            names = documented(ast.get_docstring(cls))  # the class documents its constructor
        if names is None:
            out[f"{path}::{qualname}"] = f"no Args: section ({len(params)} parameters)"
        elif missing := [p for p in params if p not in names]:
            out[f"{path}::{qualname}"] = f"Args: leaves out {', '.join(missing)}"
    return out


def _scan() -> dict[str, str]:
    out = {}
    for f in sorted((ROOT / "lpt").rglob("*.py")):
        out.update(undocumented(f.read_text(), f.relative_to(ROOT).as_posix()))
    return out


def test_public_functions_with_five_or_more_parameters_declare_them():
    bad = {k: v for k, v in _scan().items() if k not in EXEMPT}
    assert not bad, "public functions without a complete Args: section:\n" + "\n".join(
        f"  {k}: {v}" for k, v in sorted(bad.items())
    )


def test_exempt_list_is_current():
    stale = sorted(set(EXEMPT) - set(_scan()))
    assert not stale, f"documented (or gone) now, remove from EXEMPT: {stale}"


def test_the_check_catches_a_missing_or_incomplete_args_section():
    source = '''
def no_args(a, b, c, d, e):
    """Prose only: a, b, c, d and e are described here but not declared."""


def incomplete(a, b, *, c=0, d=1, **kw):
    """Declares most.

    Args:
      a, b: the operands.
      c: a count.
        d: indented deeper, so a continuation line, not an entry.

    Returns:
      kw: a Returns entry, not an argument.
    """


def complete(a, b, *rest, c=0, d=1, **kw):
    """Declares all.

    Args:
      a, b: the operands.
      *rest: more operands.
      c, d: counts.
      **kw: options.
    """


def four(a, b, c, d):
    """Below the threshold."""


def _private(a, b, c, d, e):
    """Not public."""


class Layer:
    """A layer.

    Args:
      a, b, c, d, e: its sizes.
    """

    def __init__(self, a, b, c, d, e):
        pass

    def call(self, a, b, c, d, e):
        """Undeclared."""


class Wide(Layer):
    """No Args here."""

    def __init__(self, a, b, c, d, e, f):
        pass

    def call(self, a, b, c, d, e):
        pass
'''
    assert undocumented(source, "x.py") == {
        "x.py::no_args": "no Args: section (5 parameters)",
        "x.py::incomplete": "Args: leaves out d, kw",
        "x.py::Layer.call": "no Args: section (5 parameters)",
        "x.py::Wide.__init__": "no Args: section (6 parameters)",
    }


# Public functions of ten or more parameters whose positional parameters mirror an outside library's function of the
# same name: {"path::qualname": "module.function"}; their positional names must be that function's.
MIRRORS = {"lpt/optim/recipes.py::adamw": "optax.adamw"}
MAX_POSITIONAL = 3  # the operands (q, k, v; x, w; a model, a tokenizer and the prompts)


def wide_functions(source: str, path: str) -> dict[str, list[str]]:
    """``{"path::qualname": positional parameter names}`` for each public function of ``source`` with ten or more
    parameters that takes more than MAX_POSITIONAL of them by position."""
    tree = ast.parse(source)
    todo = [(n.name, n, False) for n in tree.body if isinstance(n, _FUNCS) and not n.name.startswith("_")]
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and not cls.name.startswith("_"):
            todo += [
                (f"{cls.name}.{m.name}", m, True)
                for m in cls.body
                if isinstance(m, _FUNCS) and (not m.name.startswith("_") or m.name == "__init__")
            ]
    out = {}
    for qualname, fn, method in todo:
        positional = [x.arg for x in (*fn.args.posonlyargs, *fn.args.args)]
        if method and positional and positional[0] in ("self", "cls"):
            positional = positional[1:]
        if len(_params(fn, method)) >= 10 and len(positional) > MAX_POSITIONAL:
            out[f"{path}::{qualname}"] = positional
    return out


def test_functions_of_ten_or_more_parameters_take_options_by_keyword():
    """A public function takes at most nine parameters (kernel entry points take an options object, as
    ``lpt.kernels.adamw_kahan.StepOptions``), or its operands by position and every option by keyword, as
    ``jax.nn.dot_product_attention``, ``nnx.Linear`` and ``transformers``' ``generate`` do; a mirror of an outside
    function keeps that function's positional parameters."""
    import importlib
    import inspect

    found = {}
    for f in sorted((ROOT / "lpt").rglob("*.py")):
        found.update(wide_functions(f.read_text(), f.relative_to(ROOT).as_posix()))
    for name, target in MIRRORS.items():
        module, attr = target.rsplit(".", 1)
        theirs = [
            p.name
            for p in inspect.signature(getattr(importlib.import_module(module), attr)).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        assert found.pop(name, None) == theirs, f"{name} no longer mirrors {target}'s positional parameters {theirs}"
    assert not found, "public functions with >= 10 parameters and more than 3 positional ones:\n" + "\n".join(
        f"  {k}: {', '.join(v)}" for k, v in sorted(found.items())
    )


def test_the_width_check_sees_positional_options():
    source = """
def wide(q, k, v, q_seg, kv_seg, *, a=0, b=0, c=0, d=0, e=0):
    pass


def keyword(q, k, v, *, a=0, b=0, c=0, d=0, e=0, f=0, g=0):
    pass


class Layer:
    def __init__(self, m, n, *, a=0, b=0, c=0, d=0, e=0, f=0, g=0, h=0):
        pass
"""
    assert wide_functions(source, "m.py") == {"m.py::wide": ["q", "k", "v", "q_seg", "kv_seg"]}
