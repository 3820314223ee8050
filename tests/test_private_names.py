"""A declared API: every public top-level name in lpt/ is used outside the module that defines it; a name that only
its own module uses is private (a leading ``_``).

Scanned from the source (``ast`` and text, nothing imported). The names checked: the ``def``, ``class`` and
assignment targets (``x = ...``, ``x: T = ...``, the names of a tuple target) at the top level of each module of lpt/
(lpt/configs, a link to configs/, included), also those inside a top-level ``if`` or ``try``, whose name does not
start with ``_``. Not checked: dunder names (``__all__``, ``__version__``) and the ``main`` of a ``__main__.py``,
which ``python -m`` runs.

A use is the name as a whole word (``\\bname\\b``: code, strings and prose alike, so ``module.name``, a
``getattr``/registry lookup by the name's string and a docs mention all count) in a file other than the module
itself, among lpt/**/*.py (a package ``__init__`` that re-exports it included), tests/**/*.py, benchmarks/,
launch/, configs/, README.md and docs/**/*.md. The module's own text is no use, its ``__all__`` included: a name
exported and used nowhere else is still its module's own (and a package's ``from .module import *`` names nothing).
A file reached by two paths (lpt/configs/x.py and configs/x.py) is one file.

Exceptions (:data:`EXEMPT`): none. Names that callers reach only as attributes (optax's ``init`` / ``update``,
dataclass and Flax module fields, methods) are not top-level names; a top-level name looked up elsewhere by string
or attribute (``dispatch.kernel(module, name)``, the config files' ``get_config``, the lab sections' ``configs`` and
``run``) has its name in the file that looks it up.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (folder, glob) of the files whose text counts as a use; README.md besides
_USERS = (
    ("lpt", "**/*.py"),
    ("tests", "**/*.py"),
    ("benchmarks", "**/*"),
    ("launch", "**/*"),
    ("configs", "**/*"),
    ("docs", "**/*.md"),
)

# "path/of/module.py name" -> why it stays public though only its module uses it. Each entry must still be flagged
# (test_exempt_list_is_current), so the list only shrinks.
EXEMPT: dict[str, str] = {}


def _modules(root: Path) -> list[Path]:
    """The .py files of ``root``/lpt, through links to folders (lpt/configs), each resolved file once."""
    seen, out = set(), []
    stack = [root / "lpt"]
    while stack:
        folder = stack.pop()
        for p in sorted(folder.iterdir()):
            if p.is_dir() and p.name != "__pycache__":
                stack.append(p)
            elif p.suffix == ".py" and p.resolve() not in seen:
                seen.add(p.resolve())
                out.append(p)
    return out


def _targets(node: ast.expr):
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Tuple | ast.List):
        for elt in node.elts:
            yield from _targets(elt)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


def _defined(body: list[ast.stmt]):
    """(name, line) of every name the statements ``body`` bind at their level (and inside an ``if`` or ``try``)."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.name, node.lineno
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                yield from ((name, node.lineno) for name in _targets(target))
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            yield from ((name, node.lineno) for name in _targets(node.target))
        elif isinstance(node, ast.If):
            yield from _defined(node.body)
            yield from _defined(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _defined(part)


def _words(root: Path) -> dict[str, set[Path]]:
    """{word: the resolved files whose text has it} over the files of :data:`_USERS` and README.md."""
    files = {f.resolve() for folder, pattern in _USERS for f in (root / folder).glob(pattern) if f.is_file()}
    files.add((root / "README.md").resolve())
    words: dict[str, set[Path]] = {}
    for f in files:
        if "__pycache__" in f.parts or not f.exists():
            continue
        for word in set(re.findall(r"\w+", f.read_text(errors="replace"))):
            words.setdefault(word, set()).add(f)
    return words


def module_only(root: Path) -> list[str]:
    """``"lpt/path.py:line name"`` for each public top-level name of ``root``/lpt that no other file uses."""
    words = _words(root)
    found = []
    for module in _modules(root):
        own = module.resolve()
        for name, line in _defined(ast.parse(module.read_text()).body):
            if name.startswith("_") or (module.name == "__main__.py" and name == "main"):
                continue
            if not words.get(name, set()) - {own}:
                found.append(f"{module.relative_to(root).as_posix()}:{line} {name}")
    return found


def _key(entry: str) -> str:
    where, name = entry.split(" ")
    return f"{where.split(':')[0]} {name}"


def test_every_public_name_is_used_outside_its_module():
    flagged = [e for e in module_only(ROOT) if _key(e) not in EXEMPT]
    assert not flagged, "public names only their own module uses (make them private: _name):\n" + "\n".join(flagged)


def test_exempt_list_is_current():
    flagged = {_key(e) for e in module_only(ROOT)}
    assert not set(EXEMPT) - flagged, f"no longer module-only, drop from EXEMPT: {sorted(set(EXEMPT) - flagged)}"


def test_the_check_flags_a_module_only_name(tmp_path):
    (tmp_path / "lpt" / "pkg").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Call `lpt.pkg.mod.documented`.\n")
    (tmp_path / "lpt" / "pkg" / "__init__.py").write_text("from lpt.pkg.mod import reexported\n")
    (tmp_path / "lpt" / "pkg" / "__main__.py").write_text("def main():\n    pass\n")
    (tmp_path / "lpt" / "pkg" / "mod.py").write_text(
        '__all__ = ["exported"]\n'
        "__version__ = '1'\n"
        "LONELY, TESTED = 1, 2\n"
        "_private = 3\n"
        "if True:\n"
        "    GUARDED = 4\n"
        "def exported():\n    return lonely_helper()\n"  # in __all__ only; lonely_helper is another word
        "def lonely_helper():\n    return LONELY + _private + GUARDED\n"
        "def documented():\n    pass\n"
        "def reexported():\n    pass\n"  # the __main__.py's main, used nowhere else, is not flagged
    )
    (tmp_path / "tests" / "test_mod.py").write_text("from lpt.pkg import mod\n\nassert mod.TESTED\n")
    (tmp_path / "docs" / "mod.md").write_text("Call `exported()`.\n")
    flagged = {_key(e) for e in module_only(tmp_path)}
    assert flagged == {
        "lpt/pkg/mod.py LONELY",
        "lpt/pkg/mod.py GUARDED",
        "lpt/pkg/mod.py lonely_helper",
    }
    (tmp_path / "docs" / "mod.md").write_text("`exported_twice` only.\n")
    assert "lpt/pkg/mod.py exported" in {_key(e) for e in module_only(tmp_path)}
