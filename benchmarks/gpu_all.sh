#!/usr/bin/env bash
# Every GPU check of lpt in one go, on a machine with one CUDA GPU: the kernels compiled (Triton, Mosaic GPU) against
# their XLA twins, then the GPU benchmarks. Each part has its own time limit, so one that hangs leaves the others'
# numbers; the logs go to LOGDIR (default gpu_logs/), one file per part, and a summary prints last. The limits add up
# to 7.5 minutes (with the start, under 8); most of it is compiling. PARTS names the parts to run (default: all of
# them, in this order), KERNELS_K is a pytest -k filter for the kernel tests and ATTENTION_SEQ the attention lengths,
# e.g. PARTS="kernels attention" KERNELS_K=mosaic_gpu. The headline run is benchmarks/gpu_quality.sh.
#
#     bash benchmarks/gpu_all.sh [LOGDIR]
set -u
LOGDIR=${1:-gpu_logs}
mkdir -p "$LOGDIR"
PY=${PYTHON:-python3}
PARTS=${PARTS:-kernels attention fp8 optim train_step}
KERNELS_K=${KERNELS_K:-}
ATTENTION_SEQ=${ATTENTION_SEQ:-8192}
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

part kernels 220 $PY -m pytest -q -s -p no:cacheprovider --durations=25 tests/kernels/test_kernels_on_gpu.py ${KERNELS_K:+-k "$KERNELS_K"}
part attention 55 $PY benchmarks/attention_gpu.py --batch 2 --seq $ATTENTION_SEQ --heads 16 --kv-heads 4 --head-dim 128
part fp8 45 $PY benchmarks/fp8_gpu.py --sizes 8192
part optim 60 $PY benchmarks/optim_step.py --params 200e6 --rounds 3 \
  --rows base,copy,fused:stochastic,fused8:stochastic,pallas:stochastic,pallas8:stochastic
part train_step 70 $PY benchmarks/train_step.py --config configs/gpt2_124m.py --steps 8 \
  --config.data.source=embedded --config.train.global_batch=16

cat "$LOGDIR/machine.log"
for f in $PARTS; do
  echo "===== $f"
  grep -vE "^\s*$" "$LOGDIR/$f.log" | tail -n 40
done
cat "$LOGDIR/summary.txt"
