"""``python -m lpt.lab [all|updates|...] --out DIR [--quick]``: reproduce the papers' results as tables and plots.

Writes ``DIR/REPORT.md`` (and PNGs beside it); each section states what the source document claims beside what was
measured on this machine. ``--quick`` finishes in a few minutes on 2 CPU cores (what the tests run).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from typing import NoReturn

from lpt.lab.report import Report
from lpt.lab.runs import RECIPES
from lpt.train import config as config_lib

# section name -> module with ``run(report, quick)`` (the recipe sections also take ``recipes=``)
_SECTIONS = {
    "updates": "lpt.lab.updates",
    "gemm": "lpt.lab.gemm",
    "attention": "lpt.lab.attention",
    "pqt": "lpt.lab.pqt",
    "recipes": "lpt.lab.recipes",
    "cost": "lpt.lab.cost",
    "finetune": "lpt.lab.finetune",
    "states": "lpt.lab.states",
    "formats": "lpt.lab.formats",
    "headline": "lpt.lab.headline",
}
_RECIPE_SECTIONS = ("recipes", "cost")  # take --recipes and --set
_SET_SECTIONS = (*_RECIPE_SECTIONS, "headline")  # take --set
_ALL = tuple(s for s in _SECTIONS if s != "headline")  # "all": the headline is a GPU run (benchmarks/gpu_quality.sh)


def fail(message: str) -> NoReturn:
    """Bad input: one ``error:`` line on stderr and exit code 2 (nothing written)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _parse_sets(items: list[str]) -> dict[str, str]:
    """``{"train.seed": "1"}`` from ``--set KEY=VALUE`` arguments, each key known and its value of the key's type."""
    overrides = {}
    for item in items:
        if "=" not in item:
            fail(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.seed=1")
        key, value = item.split("=", 1)
        try:
            config_lib.parse_value(key, value)
        except ValueError as e:
            fail(f"--set {item}: {e}")
        overrides[key] = value
    return overrides


def _check_configs(names: list[str], quick: bool, recipes, overrides: dict[str, str]) -> None:
    """Build every config the recipe sections among ``names`` will run, so that a value outside its key's range (or
    one that does not fit the recipe) is one error line before ``--out`` is made."""
    for name in names:
        if name in _SET_SECTIONS:
            try:
                subset = recipes if name in _RECIPE_SECTIONS else None
                importlib.import_module(_SECTIONS[name]).configs(quick, recipes=subset, overrides=overrides)
            except ValueError as e:
                fail(f"--set {' '.join(f'{k}={v}' for k, v in overrides.items())} (section {name}): {e}")


def main(argv=None) -> dict:
    """Run the sections; return ``{"report": path, <section>: headline numbers}``. Bad input (an unknown section,
    recipe or key, a value outside its key's range, ``--set``/``--recipes`` without a section that uses them) is
    one ``error:`` line and exit code 2, before anything is written."""
    import matplotlib

    matplotlib.use("Agg")  # the command writes files only; importing lpt.lab leaves the backend alone
    ap = argparse.ArgumentParser(prog="python -m lpt.lab", description=__doc__)
    ap.add_argument(
        "sections", nargs="*", default=["all"], help=f"all (every one but headline) or any of {sorted(_SECTIONS)}"
    )
    ap.add_argument("--out", required=True, help="output directory for REPORT.md and the plots")
    ap.add_argument("--quick", action="store_true", help="small sizes: a few minutes on 2 CPU cores")
    ap.add_argument(
        "--recipes",
        default=None,
        help=f"comma-separated subset for the recipes/cost sections (default: all of {', '.join(RECIPES)})",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for every recipe run, e.g. --set train.seed=1 (repeatable; recipes/cost sections)",
    )
    args = ap.parse_args(argv)
    names = list(_ALL) if "all" in args.sections else args.sections
    for name in names:
        if name not in _SECTIONS:
            fail(f"section {name!r} is unknown; available: all, {', '.join(_SECTIONS)}")
    recipes = args.recipes.split(",") if args.recipes else None
    for r in recipes or ():
        if r not in RECIPES:
            fail(f"--recipes: {r!r} is not a recipe; available: {', '.join(RECIPES)}")
    overrides = _parse_sets(args.set)
    if (overrides or recipes) and not set(names) & set(_SET_SECTIONS if not recipes else _RECIPE_SECTIONS):
        uses = " and ".join(_RECIPE_SECTIONS)
        fail(
            f"--set and --recipes apply to the {uses} sections only (--set to headline too); the sections given: "
            f"{', '.join(names)}"
        )
    _check_configs(names, args.quick, recipes, overrides)
    report = Report(args.out)
    results = {}
    for name in names:
        t = time.perf_counter()
        print(f"[lab] {name} ...", flush=True)
        kwargs = {"recipes": recipes if name in _RECIPE_SECTIONS else None, "overrides": overrides}
        kwargs = kwargs if name in _SET_SECTIONS else {}
        results[name] = importlib.import_module(_SECTIONS[name]).run(report, quick=args.quick, **kwargs)
        print(f"[lab] {name} done in {time.perf_counter() - t:.0f}s", flush=True)
    results["report"] = report.write()
    print(f"[lab] wrote {results['report']}")
    return results


if __name__ == "__main__":
    main()
