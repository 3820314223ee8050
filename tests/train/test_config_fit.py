"""docs/results.md states what the pod configs compile to; this holds the numbers that need no compile.

docs/results.md lists, per shipped pod config and topology (``- llama_1b on v5e:2x4 (...): ...``), the per-chip memory
from ``python -m lpt.train.compile`` (rerun: ``benchmarks/configs_compile.py``). Recomputed here, on the topology's
compile-only devices: the train state's bytes per chip from the trainer's own shardings (a replicated state, or a
config change that moves it, fails), the model FLOPs per step, the chip's HBM, and that the stated total fits.
"""

import re
from pathlib import Path

import pytest

from lpt import models, targets
from lpt.train import config as config_lib
from lpt.train import loop
from lpt.train import state as state_lib
from lpt.train.compile import shard_bytes

GIB = 1 << 30
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results.md"
LINE = re.compile(
    r"^- (\w+) on (\S+) \([^)]*\): ([\d.]+) GiB per chip of ([\d.]+) \(state ([\d.]+) GiB, temps ([\d.]+) GiB\);\s+"
    r"([\d.]+e\d+) model\s+FLOPs\s+per step",
    re.M,
)
CASES = [(m.group(1), m.groups()[1:]) for m in LINE.finditer(RESULTS.read_text(encoding="utf-8"))]


def test_every_pod_config_states_a_compile():
    assert {name for name, _ in CASES} == {"gpt2_124m", "llama_1b"}
    assert ("llama_1b", "v5e:2x4") in {(name, g[0]) for name, g in CASES}


@pytest.mark.parametrize("name, stated", CASES, ids=[f"{n}-{g[0]}" for n, g in CASES])
def test_stated_compile_matches_the_config(name, stated):
    topology, total, hbm, state, temps, flops = stated
    cfg = config_lib.resolve(config_lib.load_config_file(name))
    mesh = loop.make_mesh(cfg, targets.devices(topology))
    prog = loop.program(cfg, mesh)
    per_chip = shard_bytes(state_lib.with_shardings(prog.abstract, prog.shardings))
    assert f"{per_chip / GIB:.2f}" == state, (name, topology, per_chip / GIB)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    assert f"{models.flops_per_token(cfg.model, cfg.data.seq_len) * tokens:.3e}".replace("+", "") == flops
    assert f"{targets.device_facts(topology).hbm_bytes / GIB:.2f}" == hbm
    assert float(total) <= float(hbm) and 0 <= float(total) - float(state) - float(temps) < 0.1  # + generated code
