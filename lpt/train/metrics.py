"""Metrics: JSONL + TensorBoard event files, the loss-curve PNG, throughput, FLOPs and MFU.

Only process 0 writes. On object storage (a ``gs://`` workdir, :mod:`lpt.train.paths`), which cannot append to an
object, both are written in a local staging directory and uploaded as whole objects (:meth:`MetricsWriter.sync`).
``metrics.jsonl`` holds one JSON object per line: ``{"step": s, "loss": ..., ...}`` for
training logs and ``{"step": s, "eval_loss": ...}`` for evaluations; TensorBoard gets the same scalars under
``train/`` and ``eval/``. MFU = (tokens/s * FLOPs per token) / (devices * peak FLOP/s per device), reported only when
the device's peak is known (:func:`lpt.targets.peak_flops`, dense bf16 numbers from the vendors' data sheets).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax

from lpt import targets
from lpt.train import paths
from lpt.train import workdir as workdir_lib

log = logging.getLogger("lpt.train")

SYNC_SECONDS = 60.0  # on object storage, :meth:`MetricsWriter.write` uploads the files at most this often


def device_peak_flops(device: jax.Device | None = None) -> float | None:
    """Peak bf16 FLOP/s of one device, or None if unknown (e.g. CPU): :func:`lpt.targets.peak_flops`."""
    return targets.peak_flops((device or jax.devices()[0]).device_kind)


def _tensorboard_writer():
    """tensorboardX's ``SummaryWriter``, imported without torch: ``tensorboardX.writer`` imports torch at module level
    when it is installed (about 2 s of a process's start, for its tensor type alone), and lpt writes scalars and text
    only. ``import torch`` fails while tensorboardX loads and works again afterwards."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # None in sys.modules: `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends scalars to ``<workdir>/metrics.jsonl`` and TensorBoard event files in ``<workdir>/tensorboard``.

    On object storage the two are appended to in a local staging directory, and :meth:`sync` uploads every file of it
    that changed as a whole object: :meth:`write` at most every :data:`SYNC_SECONDS`, the trainer before every
    checkpoint (so the records of the steps a checkpoint holds are stored before it is), and :meth:`close`.
    ``jsonl_path`` is the file appended to (the staging copy on object storage); :meth:`sync` is a no-op locally,
    where every record is flushed as it is written.
    """

    def __init__(self, workdir: str | Path, *, enabled: bool = True, drop_after: int | None = None):
        """``drop_after``: on resume from step r, records with step > r (written before a crash) are removed."""
        self.enabled = enabled
        self.workdir = paths.run_path(workdir)
        self.remote = paths.is_remote(self.workdir)
        self.jsonl_path = self.workdir / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._staging: Path | None = None
        self._uploaded: dict[Path, int] = {}  # staged file -> its size when it was last uploaded
        self._synced = time.time()
        if enabled:
            SummaryWriter = _tensorboard_writer()

            local = self.workdir
            if self.remote:
                local = self._staging = _staging_dir(self.workdir)
                stored = read_jsonl(self.jsonl_path)  # [] when there is none
                self.jsonl_path = local / "metrics.jsonl"
                rewrite_jsonl(self.jsonl_path, [r for r in stored if drop_after is None or r["step"] <= drop_after])
            else:
                self.workdir.mkdir(parents=True, exist_ok=True)
                if drop_after is not None and self.jsonl_path.exists():
                    kept = [r for r in read_jsonl(self.jsonl_path) if r["step"] <= drop_after]
                    rewrite_jsonl(self.jsonl_path, kept)
            self._file = self.jsonl_path.open("a")
            self._tb = SummaryWriter(str(local / "tensorboard"))

    def write(self, step: int, scalars: dict, *, prefix: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _py(v) for k, v in scalars.items()}, "wall_time": round(time.time(), 3)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for k, v in record.items():
            if k not in ("step", "wall_time") and isinstance(v, int | float) and math.isfinite(v):
                self._tb.add_scalar(f"{prefix}/{k}", v, int(step))
        self._tb.flush()
        if self.remote and time.time() - self._synced >= SYNC_SECONDS:
            self.sync()

    def text(self, tag: str, text: str, step: int) -> None:
        """A text summary in TensorBoard (e.g. the resolved config), as Markdown code."""
        if self.enabled:
            self._tb.add_text(tag, "```\n" + text + "\n```", int(step))
            self._tb.flush()

    def sync(self) -> None:
        """On object storage: upload every staged file that changed since its last upload (whole objects)."""
        if not (self.enabled and self.remote):
            return
        self._file.flush()
        self._tb.flush()
        self._upload()

    def _upload(self) -> None:
        for f in sorted(self._staging.rglob("*")):
            size = f.stat().st_size if f.is_file() else None
            if size is None or self._uploaded.get(f) == size:
                continue
            target = self.workdir / f.relative_to(self._staging).as_posix()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(f.read_bytes())
            self._uploaded[f] = size
        self._synced = time.time()

    def close(self) -> None:
        if self.enabled:
            try:
                self._file.close()
                self._tb.close()
                if self.remote:
                    self._upload()
            finally:
                if self._staging is not None:
                    shutil.rmtree(self._staging, ignore_errors=True)


def _staging_dir(workdir) -> Path:
    """A new local directory where the metrics of the object-storage run ``workdir`` are staged:
    ``<tmp>/lpt-metrics-<digest of workdir>-<pid>``. The ones that earlier trainers of the same workdir left on this
    machine (killed before they could remove them; their records are stored up to their last checkpoint, and the
    resumed run writes the rest again) are removed first."""
    tag = hashlib.sha256(str(workdir).encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir())
    for old in root.glob(f"lpt-metrics-{tag}-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not workdir_lib.pid_alive(int(pid))):
            shutil.rmtree(old, ignore_errors=True)
    path = root / f"lpt-metrics-{tag}-{os.getpid()}"
    path.mkdir()
    return path


def _py(v):
    """A Python number for the JSONL record; a non-finite float (the loss of a skipped step) is written as null."""
    if hasattr(v, "item"):
        v = v.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a metrics file (local, or a URL of :mod:`lpt.train.paths`). A torn last line (a crash mid-write)
    is skipped with a warning; a damaged line elsewhere raises ValueError naming the file and the line."""
    path = paths.run_path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                log.warning("%s: skipping its torn last line %d (%d bytes)", path, i + 1, len(line))
                continue
            raise ValueError(f"{path}: line {i + 1} is not a JSON record: {line[:80]!r}") from None
    return records


def rewrite_jsonl(path: str | Path, records: list[dict]) -> None:
    """Replace ``path`` with ``records`` atomically (a temp file, fsync, rename): a crash leaves the old or the new
    file, never a partial one. On object storage one whole-object write, which is atomic there."""
    path = paths.run_path(path)
    if paths.is_remote(path):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def plot_losses(jsonl_path: str | Path, png_path: str | Path, *, baseline: float | None = None, title: str = ""):
    """Training and validation loss vs step (log-y) as a PNG; ``baseline`` draws the unigram loss."""
    from matplotlib.figure import Figure  # no pyplot: the process's matplotlib backend is left alone

    records = read_jsonl(jsonl_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig = Figure(figsize=(7, 4.2), dpi=110)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="validation loss", lw=1.5)
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if paths.is_remote(png_path):  # one whole-object write
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        paths.run_path(png_path).write_bytes(buffer.getvalue())
    else:
        fig.savefig(png_path)
