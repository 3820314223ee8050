"""The README and docs/*.md name only things that exist: every ``lpt.x.y`` dotted name resolves (module import, then
getattr down the chain), every ``python -m lpt.x`` module can be found, and every relative Markdown link points to an
existing file."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `python -m lpt.train`: a runnable module (its __main__ must exist; importing it would run it)
_RUN = re.compile(r"python3? -m (lpt(?:\.[A-Za-z_]\w*)*)")
# lpt.a.b.c anywhere in the text; a trailing dot (end of a sentence) is not part of the name
_NAME = re.compile(r"(?<![\w./])lpt(?:\.[A-Za-z_]\w*)+")
# [text](target): relative targets only (no scheme, no pure #anchor)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _names(text: str) -> set[str]:
    runs = {m.end() for m in _RUN.finditer(text)}
    return {m.group(0) for m in _NAME.finditer(text) if m.end() not in runs}


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _cases():
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for name in sorted(_names(text)):
            yield pytest.param("name", doc, name, id=f"{doc.name}:{name}")
        for m in sorted({m.group(1) for m in _RUN.finditer(text)}):
            yield pytest.param("run", doc, m, id=f"{doc.name}:-m {m}")
        for target in sorted({m.group(1) for m in _LINK.finditer(text)}):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            yield pytest.param("link", doc, target, id=f"{doc.name}:->{target}")


@pytest.mark.parametrize(("kind", "doc", "ref"), list(_cases()))
def test_docs_reference_existing_things(kind, doc, ref):
    if kind == "name":
        assert _resolves(ref), f"{doc.relative_to(ROOT)} names {ref}, which does not resolve"
    elif kind == "run":
        assert importlib.util.find_spec(ref) is not None, f"{doc.relative_to(ROOT)}: no module {ref} for python -m"
        if importlib.util.find_spec(ref).submodule_search_locations is not None:  # a package runs its __main__
            assert importlib.util.find_spec(ref + ".__main__") is not None, f"{ref} has no __main__"
    else:
        path = (doc.parent / ref.split("#", 1)[0]).resolve()
        assert path.exists(), f"{doc.relative_to(ROOT)} links {ref}, which does not exist ({path})"


def test_the_docs_are_scanned():
    names = {n for doc in DOCS for n in _names(doc.read_text(encoding="utf-8"))}
    assert "lpt.optim.kahan_summation" in names and len(DOCS) >= 8
