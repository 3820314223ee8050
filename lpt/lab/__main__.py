"""``python -m lpt.lab [all|updates|...] --out DIR [--quick]``: reproduce the papers' results as tables and plots.

Writes ``DIR/REPORT.md`` (and PNGs beside it); each section states what the source document claims beside what was
measured on this machine. ``--quick`` finishes in a few minutes on 2 CPU cores (what the tests run).
"""

from __future__ import annotations

import argparse
import importlib
import time

from lpt.lab.report import Report
from lpt.lab.runs import RECIPES

# section name -> module with ``run(report, quick)`` (the recipe sections also take ``recipes=``)
SECTIONS = {
    "updates": "lpt.lab.updates",
    "gemm": "lpt.lab.gemm",
    "attention": "lpt.lab.attention",
    "pqt": "lpt.lab.pqt",
    "recipes": "lpt.lab.recipes",
    "cost": "lpt.lab.cost",
    "finetune": "lpt.lab.finetune",
    "states": "lpt.lab.states",
    "formats": "lpt.lab.formats",
}
RECIPE_SECTIONS = ("recipes", "cost")


def main(argv=None) -> dict:
    """Run the sections; return ``{"report": path, <section>: headline numbers}``."""
    import matplotlib

    matplotlib.use("Agg")  # the command writes files only; importing lpt.lab leaves the backend alone
    ap = argparse.ArgumentParser(prog="python -m lpt.lab", description=__doc__)
    ap.add_argument("sections", nargs="*", default=["all"], help=f"all or any of {sorted(SECTIONS)}")
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
    recipes = args.recipes.split(",") if args.recipes else None
    overrides = {}
    for item in args.set:
        if "=" not in item:
            ap.error(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.seed=1")
        key, value = item.split("=", 1)
        overrides[key] = value
    for r in recipes or ():
        if r not in RECIPES:
            ap.error(f"--recipes: {r!r} is not a recipe; available: {', '.join(RECIPES)}")
    names = list(SECTIONS) if "all" in args.sections else args.sections
    for name in names:
        if name not in SECTIONS:
            ap.error(f"section {name!r} is unknown; available: all, {', '.join(SECTIONS)}")
    report = Report(args.out)
    results = {}
    for name in names:
        t = time.perf_counter()
        print(f"[lab] {name} ...", flush=True)
        kwargs = {"recipes": recipes, "overrides": overrides} if name in RECIPE_SECTIONS else {}
        results[name] = importlib.import_module(SECTIONS[name]).run(report, quick=args.quick, **kwargs)
        print(f"[lab] {name} done in {time.perf_counter() - t:.0f}s", flush=True)
    results["report"] = report.write()
    print(f"[lab] wrote {results['report']}")
    return results


if __name__ == "__main__":
    main()
