#!/usr/bin/env bash
# Every GPU check of lpt in one go, on a machine with one CUDA GPU: the kernels compiled (Triton, Mosaic GPU) against
# their XLA twins, then the GPU benchmarks, each printing its ratios against a baseline measured in the same run:
# attention against cuDNN at T = 4096 and 16384 (D 128, causal, GQA 4:1), the FP8 recipe's GEMMs against bf16, the
# fused AdamW + Kahan step against a device copy of its bytes (500M parameters), gpt2_124m's train step against a
# plain float32 step, and a 1B-class step with FP8 matmuls and 8-bit moments against bf16 + Kahan (MFU printed; both
# train-step parts profile 3 steps of each run and print where the device time goes: benchmarks/trace_summary.py).
# Each part has its own time limit, so one that hangs leaves the others' numbers; the logs go to LOGDIR (default
# gpu_logs/), one file per part, and a summary prints last. The limits add up to 7.5 minutes (under 8 with the
# start); most of it is compiling. PARTS names the parts to run (default: all of them, in this order), KERNELS_K is
# a pytest -k filter for the kernel tests (run on 4 processes where pytest-xdist is installed) and ATTENTION_SEQ the
# attention lengths, e.g. PARTS="kernels attention" KERNELS_K=mosaic_gpu. The headline run is
# benchmarks/gpu_quality.sh.
#
#     bash benchmarks/gpu_all.sh [LOGDIR]
set -u
LOGDIR=${1:-gpu_logs}
mkdir -p "$LOGDIR"
PY=${PYTHON:-python3}
PARTS=${PARTS:-kernels attention fp8 optim train_step train_1b}
KERNELS_K=${KERNELS_K:-}
ATTENTION_SEQ=${ATTENTION_SEQ:-4096 16384}
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
if ! $PY -c "import jax" >/dev/null 2>&1; then
  echo "error: $PY cannot import jax; set PYTHON to the interpreter lpt is installed in" >&2
  exit 2
fi
if ! $PY -c "import jax; jax.devices('gpu')" >/dev/null 2>&1; then  # one line per part, then done
  for name in $PARTS; do echo "$name: skipped, no GPU here (jax finds no CUDA device)" | tee -a "$LOGDIR/summary.txt"; done
  exit 0
fi
export JAX_PLATFORMS=cuda  # the test session would otherwise run on the CPU

part() {  # part NAME SECONDS COMMAND...: run, log, and record its exit status
  local name=$1 limit=$2
  shift 2
  case " $PARTS " in *" $name "*) ;; *) return ;; esac
  local start=$SECONDS
  timeout "$limit" "$@" >"$LOGDIR/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$LOGDIR/summary.txt"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import jax, flax, optax, orbax.checkpoint as o, ml_dtypes; print('jax', jax.__version__, 'flax', \
flax.__version__, 'optax', optax.__version__, 'ml_dtypes', ml_dtypes.__version__); print(jax.devices())"
} >"$LOGDIR/machine.log" 2>&1

XDIST=$($PY -c "import xdist" >/dev/null 2>&1 && echo "-n 4")  # compiling dominates: 4 processes share the GPU
XLA_PYTHON_CLIENT_PREALLOCATE=false part kernels 120 $PY -m pytest -q -rfEP -p no:cacheprovider $XDIST --durations=25 \
  tests/kernels/test_kernels_on_gpu.py ${KERNELS_K:+-k "$KERNELS_K"}
part attention 55 $PY benchmarks/attention_gpu.py --batch 2 --seq $ATTENTION_SEQ --heads 16 --kv-heads 4 \
  --head-dim 128 --iters 10 --variants cudnn mosaic_gpu_ws:stable mosaic_gpu:stable mosaic_gpu_ws:standard \
  mosaic_gpu:standard
part fp8 60 $PY benchmarks/fp8_gpu.py --sizes 8192 --iters 10
part optim 65 $PY benchmarks/optim_step.py --params 500e6 --side 8192 --rounds 3 \
  --rows base,copy,fused:stochastic,pallas:stochastic,pallas8:stochastic
part train_step 70 $PY benchmarks/train_step.py --config configs/gpt2_124m.py --steps 6 \
  --config.data.source=embedded --config.train.global_batch=32 --profile "$LOGDIR/trace_step"
BF16=precision.matmul.qkv=bf16,precision.matmul.out=bf16,precision.matmul.up=bf16,precision.matmul.down=bf16
part train_1b 80 $PY benchmarks/train_step.py --config configs/llama_1b.py --steps 4 \
  --config.data.source=embedded --config.train.global_batch=8 --config.optim.microbatches=1 --profile "$LOGDIR/trace_1b" \
  --runs "bf16_kahan:$BF16" "fp8_8bit:precision.moment_dtype=float8_e4m3fn"

cat "$LOGDIR/machine.log"
for f in $PARTS; do
  echo "===== $f"
  grep -vE "^\s*$" "$LOGDIR/$f.log" | tail -n 40
done
cat "$LOGDIR/summary.txt"
