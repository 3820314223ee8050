"""benchmarks/trace_summary.py reads a profiler trace the way a GPU writes it: only the device's stream lines count
(the derived "XLA Modules" line spans the same kernels and would double the busy time), kernels are summed by name
and kind, and the totals are per step."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_summary  # noqa: E402


def _trace(tmp_path):
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Modules"}},
    ]
    kernels = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 3000),
        ("lpt_flash_attention_fwd_mgpu", 2000),
        ("loop_fusion_3", 500),
        ("lpt_adamw_kahan_mgpu", 500),
    ]
    events = []
    for step in range(2):
        for name, dur in kernels:
            events.append({"ph": "X", "pid": 2, "tid": 7, "name": name, "ts": step * 10**4, "dur": dur})
        events.append({"ph": "X", "pid": 2, "tid": 8, "name": "jit_train_step", "ts": step * 10**4, "dur": 6000})
        events.append({"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction", "ts": step * 10**4, "dur": 9000})
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_counts_the_stream_kernels_per_step_by_kind(tmp_path):
    _trace(tmp_path)
    text = trace_summary.summarize(tmp_path, steps=2, top=3)
    lines = text.splitlines()
    assert lines[0].startswith("device busy 6.00 ms per step (4 kernels, 2 steps)"), text
    assert lines[1] == "  by kind: gemm 50%, attention 33%, fusion 8%, optimizer 8%", text
    assert len(lines) == 5 and "sm90_xmma_gemm" in lines[2] and "3.000 ms" in lines[2], text


def test_no_trace_and_bad_steps_say_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz under"):
        trace_summary.summarize(tmp_path)
    _trace(tmp_path)
    with pytest.raises(ValueError, match="steps=0"):
        trace_summary.summarize(tmp_path, steps=0)
