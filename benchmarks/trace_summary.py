"""Where a profiled program's time goes: the device kernels of a ``jax.profiler`` trace, summed by name and by kind.

    python benchmarks/trace_summary.py LOG_DIR [--steps N] [--top 15]

Reads the newest ``perfetto_trace.json.gz`` under ``LOG_DIR`` (what ``jax.profiler.trace(LOG_DIR,
create_perfetto_trace=True)`` writes), keeps the complete events ("X") of the device processes' kernel lines
(``/device:GPU:0``'s streams, ``/device:TPU:0``'s XLA ops; on a CPU, the host's XLA threads), and prints per step
(the totals divided by ``--steps``): the device's busy time, its share by kind (GEMM, attention, optimizer, FP8
GEMMs, collectives, other fusions, the rest), and the ``--top`` kernels by total time. The kinds come from kernel
names (:data:`KINDS`, first match wins), so they are a reading aid, not an accounting: a fused elementwise op that
XLA names ``loop_fusion`` is "fusion" whatever it computes.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

# (kind, pattern of kernel names): the first that matches names the kind
KINDS = (
    ("attention", r"flash|fmha|attention|cudnn"),
    ("optimizer", r"adamw|kahan"),
    ("fp8 gemm", r"fp8_blockwise|blockwise_matmul"),
    ("gemm", r"gemm|xmma|cutlass|cublas|matmul|dot|wgmma|sm90"),
    ("collective", r"nccl|all-reduce|all-gather|reduce-scatter|collective"),
    ("fusion", r"fusion"),
)


def load(log_dir: str | Path) -> list[dict]:
    """The trace events of the newest perfetto trace under ``log_dir``; FileNotFoundError if there is none."""
    traces = sorted(Path(log_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}: profile with create_perfetto_trace=True")
    with gzip.open(traces[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_events(events: list[dict]) -> list[dict]:
    """The complete events of the device processes' kernel lines (a GPU's "Stream" threads, else a TPU's "XLA Ops":
    the derived "XLA Modules" and "Steps" lines span the same time), or, where there is no device (a CPU), of the
    host's XLA threads without their executor spans (which contain the ops)."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {pid for pid, name in procs.items() if name.startswith("/device:")}
    if devices:
        lines = {key: name for key, name in threads.items() if key[0] in devices}
        for prefix in ("Stream", "XLA Ops"):
            chosen = {key for key, name in lines.items() if name.startswith(prefix)}
            if chosen:
                return [e for e in complete if (e["pid"], e.get("tid")) in chosen]
        return [e for e in complete if e["pid"] in devices]
    xla = {key for key, name in threads.items() if "XLA" in name}
    return [e for e in complete if (e["pid"], e.get("tid")) in xla and "ThunkExecutor" not in e["name"]]


def kind(name: str) -> str:
    """The :data:`KINDS` entry whose pattern the kernel name matches first, else "other"."""
    for label, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def summarize(log_dir: str | Path, steps: int = 1, top: int = 15) -> str:
    """The report of the module doc, as text."""
    if steps < 1:
        raise ValueError(f"steps={steps}: the number of profiled steps must be >= 1")
    events = device_events(load(log_dir))
    by_name = collections.Counter()
    for e in events:
        by_name[e["name"]] += float(e["dur"])  # microseconds
    total = sum(by_name.values())
    if not total:
        return f"{log_dir}: no device events in the trace"
    by_kind = collections.Counter()
    for name, us in by_name.items():
        by_kind[kind(name)] += us
    lines = [f"device busy {total / steps / 1e3:.2f} ms per step ({len(by_name)} kernels, {steps} steps)"]
    lines.append("  by kind: " + ", ".join(f"{k} {v / total:.0%}" for k, v in by_kind.most_common()))
    for name, us in by_name.most_common(top):
        lines.append(f"  {us / steps / 1e3:8.3f} ms {us / total:6.1%}  {kind(name):10s} {name[:90]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log_dir")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps: the totals are divided by it")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    print(summarize(args.log_dir, args.steps, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
