"""``python -m lpt.lab headline --quick``: the GPU headline run end to end at a tiny size on the CPU. Every recipe
trains on the same corpus (built from this Python's own files, a BPE trained on its training documents), the table
and the plot are written, and the nearest-rounding row is worse than the Kahan rows."""

import json
import os

import pytest

from lpt.lab import headline
from lpt.lab.__main__ import main


def test_lab_headline_quick(tmp_path):
    res = main(["headline", "--out", str(tmp_path), "--quick"])
    h = res["headline"]
    assert set(headline.RECIPES) <= h.keys()
    # lr 1e-3 late in the cosine: most bf16 updates fall below half an ulp (measured: nearest +0.9%, Kahan +0.01%)
    assert h["bf16_nearest"]["vs_f32"] > h["bf16_kahan"]["vs_f32"] + 0.004
    assert h["bf16_nearest"]["vs_f32"] > h["bf16_kahan8"]["vs_f32"] + 0.004
    assert h["bf16_kahan"]["met"] and h["bf16_kahan8"]["met"]
    assert h["f32"]["eval_loss"] < h["unigram"]
    # training state per parameter: f32 params + 2 f32 moments; bf16 params + 2 bf16 moments (+ bf16 compensation)
    want = {"f32": 12, "bf16_nearest": 6, "bf16_sr": 6, "bf16_kahan": 8, "fp8": 8}
    assert {n: round(h[n]["bytes_per_param"], 3) for n in want} == pytest.approx(want)
    assert 6.0 < h["bf16_kahan8"]["bytes_per_param"] < 6.2  # 8-bit moments + one f32 scale per 128
    text = open(res["report"]).read()
    for name in headline.RECIPES:
        assert f"| {name} |" in text
    assert os.path.getsize(tmp_path / "headline_loss.png") > 10_000
    corpus = json.loads((tmp_path / "headline_data" / "meta.json").read_text())
    assert corpus["documents"] > 10 and corpus["bytes"] >= headline.CORPUS_BYTES[True]
