"""Compile the shipped pod configs for the topologies below, and print each report.

    python benchmarks/configs_compile.py [--only llama_1b]

Runs ``python -m lpt.train.compile`` (the trainer's own step, real XLA:TPU/Mosaic or XLA:GPU/Triton compilers, no
accelerator needed) once per (config, topology) below, one subprocess each, and prints one summary line per run plus
the full JSON. The numbers in docs/results.md ("Pod configs compiled for TPU", "FP8 weights gathered as codes") come
from this script; ``tests/train/test_config_fit.py`` holds the parts that need no compile (state bytes per device,
model FLOPs per step). Each llama_1b compile takes minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

RUNS = (  # (config, topology, overrides)
    ("gpt2_124m", "v5e:2x2", ()),
    ("llama_1b", "v5e:2x4", ()),
    ("llama_1b", "v5p:2x2x1", ()),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="run only this config")
    args = parser.parse_args()
    worst = 0
    for config, topology, overrides in RUNS:
        if args.only and config != args.only:
            continue
        cmd = [sys.executable, "-m", "lpt.train.compile", "--config", config, "--topology", topology, *overrides]
        p = subprocess.run(cmd, capture_output=True, text=True)
        worst = max(worst, p.returncode)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "{}"
        r = json.loads(line)
        gib = lambda n: f"{n / 2**30:.2f}" if n is not None else "?"
        print(
            f"{config} on {topology}: rc={p.returncode} fits={r.get('fits')} total {gib(r.get('total_bytes'))} GiB "
            f"(state {gib(r.get('state_bytes'))}, temps {gib(r.get('temp_bytes'))}) of {gib(r.get('hbm_bytes'))}; "
            f"model FLOPs/step {r.get('model_flops', 0):.3e}; kernels {r.get('kernels', {}).get('tpu_custom_call', 0)} "
            f"Mosaic; compile {r.get('compile_seconds')} s"
        )
        print(line)
        if p.returncode:
            print(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "", file=sys.stderr)
    return worst


if __name__ == "__main__":
    sys.exit(main())
