"""A Markdown report with tables and PNG plots, written to ``DIR/REPORT.md``."""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib.pyplot as plt


class Report:
    """Collects sections (claim from the source beside what was measured here), tables and plots."""

    def __init__(self, out_dir: str, title: str = "lpt numerics lab"):
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.lines: list[str] = [f"# {title}", ""]

    def section(self, title: str, claim: str, source: str) -> None:
        self.lines += [f"## {title}", "", f"**Claim** ({source}): {claim}", ""]

    def text(self, s: str) -> None:
        self.lines += [s, ""]

    def table(self, headers: Sequence[str], rows: Sequence[Sequence]) -> None:
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
        self.lines.append("| " + " | ".join(headers) + " |")
        self.lines.append("|" + "---|" * len(headers))
        self.lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
        self.lines.append("")

    def figure(self, fig, name: str, caption: str) -> str:
        path = os.path.join(self.out_dir, f"{name}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        self.lines += [f"![{caption}]({name}.png)", "", f"*{caption}*", ""]
        return path

    def write(self) -> str:
        path = os.path.join(self.out_dir, "REPORT.md")
        with open(path, "w") as f:
            f.write("\n".join(self.lines))
        return path
