"""A run's history: the files of its workdir besides the checkpoints, checked before the trainer writes anything.

The trainer writes ``config.json``, ``metrics.jsonl``, ``summary.json``, ``loss.png`` (files) and ``tensorboard/``
(a directory) beside ``checkpoints/`` and ``checkpoints_damaged/`` (directories). Before it creates or writes any of
them (:func:`check`):

* each one that exists must be of its kind: a directory where the run writes a file, or a file where it keeps a
  directory, is one ValueError naming it (nothing is written);
* a history without the checkpoints it came from is refused: ``checkpoints/`` gone while the history is there (the
  trainer creates ``checkpoints/`` before it writes any history file; a local workdir only, as object storage has
  no empty directories), or a ``summary.json`` (a finished run, whose final step is always saved) beside no
  checkpoint. Training from step 0 would overwrite the record of the lost
  run; the error says to use a new workdir or to move the history away. A run killed before its first checkpoint
  keeps an empty ``checkpoints/`` and no summary: it starts again from step 0, which re-runs the steps its records
  describe.

When every checkpoint of a run is damaged and moved to ``checkpoints_damaged/``, its history goes with them
(:func:`move_aside`, into ``checkpoints_damaged/history-<time>/``), so the next run starts from step 0 in a clean
workdir and no record of the old run is truncated.
"""

from __future__ import annotations

import time
from pathlib import Path

from lpt.train import paths

# what the trainer keeps in a workdir, and whether it is a file or a directory
KINDS = {
    "config.json": "file",
    "metrics.jsonl": "file",
    "summary.json": "file",
    "loss.png": "file",
    "tensorboard": "directory",
    "checkpoints": "directory",
    "checkpoints_damaged": "directory",
}
_HISTORY = ("config.json", "metrics.jsonl", "summary.json", "loss.png", "tensorboard")  # the record of a run


def present(workdir: Path) -> list[str]:
    """The history entries (:data:`_HISTORY`) that exist in ``workdir``."""
    return [name for name in _HISTORY if (workdir / name).exists()]


def check(workdir: Path, steps: list[int]) -> None:
    """ValueError (one line) if an entry of ``workdir`` is of the wrong kind (:data:`KINDS`) or its history lost the
    checkpoints it came from (module docstring); ``steps`` are the workdir's checkpoint steps."""
    for name, kind in KINDS.items():
        path = workdir / name
        if path.exists() and (path.is_dir() if kind == "file" else not path.is_dir()):
            raise ValueError(
                f"{path} is not a {kind} (it is a {'directory' if path.is_dir() else 'file'}); the run keeps its "
                f"{name} there: move it away, or use a new --workdir"
            )
    history = present(workdir)
    if not history:
        return
    if not paths.is_remote(workdir) and not (workdir / "checkpoints").exists():
        lost = "no checkpoints/ directory"
    elif not steps and (workdir / "summary.json").exists():
        lost = "a summary.json of a finished run but no checkpoint"
    else:
        return
    raise ValueError(
        f"--workdir {str(workdir)!r} holds a run's history ({', '.join(history)}) and {lost}: the checkpoints it "
        f"came from are gone, so it cannot resume, and training from step 0 would overwrite that history; use a new "
        f"--workdir, or move {', '.join(history)} away to train from step 0 here"
    )


def move_aside(workdir: Path) -> Path | None:
    """Move the history of ``workdir`` into ``checkpoints_damaged/history-<time>/`` (kept); the directory, or None
    when there is none."""
    history = present(workdir)
    if not history:
        return None
    target = workdir / "checkpoints_damaged" / f"history-{time.strftime('%Y%m%dT%H%M%S')}"
    target.mkdir(parents=True, exist_ok=True)
    for name in history:
        (workdir / name).rename(target / name)
    return target
