#!/usr/bin/env bash
# The headline run on one GPU: every precision recipe trains a GPT-2-small model (configs/gpt2_124m.py with a BPE of
# 24576 ids, 104.7M parameters) on a corpus built on the machine from this Python's own sources and docs, the same
# batches for the same 5.9M tokens each, and the table (loss vs f32, goal met or missed, bytes per parameter, tokens/s and speed-up) and
# the loss plot go to OUT/REPORT.md and OUT/headline_loss.png (python -m lpt.lab headline; docs/lab.md). Sized to
# finish in about 8 minutes on one H100 with the data preparation and six compiles; a rerun with the same OUT
# re-reads finished runs. Extra arguments go to the lab, e.g. --set train.steps=200. XLA's GPU reductions run
# deterministically (--xla_gpu_deterministic_ops): without it the same recipe ends 0.06-0.24% apart from run to run
# on an H200, with it bit for bit the same, at about 7% of the step's speed (docs/results.md).
#
#     bash benchmarks/gpu_quality.sh [OUT] [--set KEY=VALUE ...]
set -eu
OUT=${1:-gpu_quality}
shift || true
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_deterministic_ops=true"
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
} | tee "$OUT/machine.log"
start=$SECONDS
$PY -m lpt.lab headline --out "$OUT" "$@"
echo "headline: $((SECONDS - start)) s" | tee -a "$OUT/machine.log"
