"""The layering of docs/design.md holds: every import in lpt/ follows its dependency table, and what a user imports
pulls in nothing above it at import time.

``import lpt.optim`` (optax transforms) and ``import lpt.numerics`` must not load Pallas or Flax; the Pallas kernels
are imported only by the code paths that run them.
"""

import subprocess
import sys

import pytest

CHECK = (
    "import sys, importlib; importlib.import_module({mod!r}); "
    "print(sorted({{m.split('.')[0] + '.' + m.split('.')[2] if m.startswith('jax.experimental.pallas') "
    "else m.split('.')[0] for m in sys.modules if m.startswith(('jax.experimental.pallas', 'flax'))}}))"
)


@pytest.mark.parametrize("mod", ["lpt.numerics", "lpt.optim", "lpt.kernels.adamw_kahan.math"])
def test_import_pulls_in_no_pallas_and_no_flax(mod):
    out = subprocess.run([sys.executable, "-c", CHECK.format(mod=mod)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{mod} imports {out.stdout.strip()}"


def test_the_check_can_see_pallas():
    out = subprocess.run(
        [sys.executable, "-c", CHECK.format(mod="lpt.kernels.adamw_kahan.kernel")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "pallas" in out.stdout, out.stdout + out.stderr[-500:]


def _imports_of_lpt() -> dict[str, dict[str, set[str]]]:
    """{package: {imported lpt package: files}} of every ``import`` statement in lpt/ (also inside functions)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "lpt"
    graph: dict[str, dict[str, set[str]]] = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        src = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "lpt"
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "lpt" else [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "lpt" and len(parts) > 1 and parts[1] != src:
                    graph.setdefault(src, {}).setdefault(parts[1], set()).add(str(rel))
    return graph


def _design_table() -> dict[str, set[str] | None]:
    """{package: packages it may import (None: everything)} from the table in docs/design.md's Dependencies."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    table = text.split("| package | imports |", 1)[1].split("\n\n", 1)[0]
    allowed: dict[str, set[str] | None] = {}
    for row in table.strip().splitlines()[1:]:
        left, right = row.strip("|").split("|")
        targets = None if "everything" in right else set(re.findall(r"`(\w+)`", right))
        for pkg in re.findall(r"`(\w+)`", left):
            allowed[pkg] = targets
    return allowed


def test_every_import_follows_the_dependency_table_of_the_design():
    allowed, graph = _design_table(), _imports_of_lpt()
    assert {"models", "train", "optim", "numerics"} <= allowed.keys()
    bad = [
        f"{src} -> {dst} ({', '.join(sorted(files))})"
        for src, deps in graph.items()
        for dst, files in deps.items()
        if src != "lpt" and (src not in allowed or (allowed[src] is not None and dst not in allowed[src]))
    ]
    assert not bad, "imports that docs/design.md's dependency table does not allow: " + "; ".join(bad)
    assert "optim" in graph["train"] and "kernels" in graph["optim"]  # the scan sees real edges


def test_models_take_only_the_optimizers_vocabulary():
    """lpt.models runs no optimizer code: its one import of lpt.optim is the names the ``precision`` section's keys
    allow (update rules, moment dtypes and roundings, update impls), in lpt/models/config.py."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "lpt" / "models"
    found = {}
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import) and any(a.name.startswith("lpt.optim") for a in node.names):
                found.setdefault(f.name, []).append("import lpt.optim")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lpt.optim"):
                found.setdefault(f.name, []).extend(a.name for a in node.names)
    assert set(found) == {"config.py"}, found
    assert all(name.isupper() for name in found["config.py"]), found  # constants: names, no functions or classes


def test_the_fp8_recipes_share_only_the_recipe_module():
    """lpt.fp8's two subpackages import nothing of each other; lpt.fp8.recipe, which both use, imports neither."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "lpt" / "fp8"
    subpackages = {"blockwise", "microscaling"}
    assert subpackages <= {p.name for p in root.iterdir() if (p / "__init__.py").exists()}
    assert (root / "recipe.py").exists()
    found = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if rel.name == "__init__.py" and len(rel.parts) == 1:
            continue  # lpt.fp8 re-exports both
        own = rel.parts[0] if len(rel.parts) > 1 else None  # None: a module of lpt.fp8 itself (recipe.py)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[:2] == ["lpt", "fp8"] and len(parts) > 2 and parts[2] in subpackages - {own}:
                    found.setdefault(str(rel), []).append(name)
    assert found == {}, found


def _imports_in_functions(source: str) -> list[str]:
    """The lpt modules that a function body of ``source`` imports."""
    import ast

    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                found += [a.name for a in node.names if a.name.split(".")[0] == "lpt"]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "lpt":
                found.append(node.module)
    return found


def test_no_function_imports_an_lpt_module():
    """Every import of an lpt module stands at the top of its module: a kernel whose Pallas module must not load at
    import time is reached through ``lpt.kernels.dispatch.kernel`` (the one place that imports kernels late)."""
    from pathlib import Path

    assert _imports_in_functions("def f():\n    from lpt.fp8 import blockwise_dot\n") == ["lpt.fp8"]  # the check sees
    root = Path(__file__).resolve().parents[1] / "lpt"
    late = {str(f.relative_to(root)): m for f in root.rglob("*.py") if (m := _imports_in_functions(f.read_text()))}
    assert late == {}, late


def _design_modules() -> list[str]:
    """The paths of the module list in docs/design.md's Modules section ("lpt/x/y.py", "lpt/x/" for a package)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    block = text.split("## Modules", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    paths, stack = [], []
    for line in block.splitlines():
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip(" "))) // 2
        stack[depth:] = [name]
        paths.append("".join(stack))
    return paths


def _tree_modules() -> list[str]:
    """Every module of lpt/ (``__init__.py`` files aside) and every package directory, as ``_design_modules``
    writes them; ``lpt/configs/`` (the shipped configs, not modules) as one entry."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = ["lpt/"]
    for f in sorted((root / "lpt").rglob("*")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith("lpt/configs/") or "__pycache__" in rel:
            continue
        if f.is_dir():
            out.append(rel + "/")
        elif f.suffix == ".py" and f.name != "__init__.py" or rel == "lpt/__init__.py":
            out.append(rel)
    return out


def test_the_module_list_of_the_design_is_the_tree():
    listed, tree = _design_modules(), _tree_modules()
    assert len(listed) == len(set(listed)), "docs/design.md lists a module twice"
    assert not set(tree) - set(listed), f"modules missing from docs/design.md's list: {sorted(set(tree) - set(listed))}"
    assert not set(listed) - set(tree), f"docs/design.md lists what is not in lpt/: {sorted(set(listed) - set(tree))}"
    assert {"lpt/train/loop.py", "lpt/kernels/flash_attention/", "lpt/configs/"} <= set(listed)  # the parse sees them


def test_the_package_table_of_the_design_names_every_package():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    table = text.split("| package | the concept |", 1)[1].split("\n\n", 1)[0]
    rows = [row for row in table.splitlines() if row.startswith("|")]
    named = {m for row in rows for m in re.findall(r"`lpt\.(\w+)`", row.split("|")[1])}
    top = {p.split("/")[1].removesuffix(".py") for p in _tree_modules() if p.count("/") >= 1 and p != "lpt/"}
    assert top - {"__init__", "configs"} == named
