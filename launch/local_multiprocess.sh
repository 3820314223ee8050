#!/usr/bin/env bash
# Run N training processes on this machine, joined by jax.distributed (coordinator on localhost).
# Each process gets DEVICES_PER_PROCESS CPU devices (forced host devices), or its share of local GPUs if you set
# CUDA_VISIBLE_DEVICES per process. Useful to test multi-host code paths (per-process data, checkpoint merging)
# on a laptop.
#
#   launch/local_multiprocess.sh 2 configs/tiny_cpu.py runs/tiny_2proc [--config.key=value ...]
#
# Process 0's output goes to the terminal; the others' to <workdir>/process_<i>.log. PYTHON=.venv/bin/python selects
# the interpreter (default: python on PATH).
set -euo pipefail
NUM_PROCESSES=${1:?number of processes}
CONFIG=${2:?config file}
WORKDIR=${3:?workdir}
shift 3
PORT=${PORT:-$((20000 + RANDOM % 20000))}
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-1}
PYTHON=${PYTHON:-python}
mkdir -p "$WORKDIR"
pids=()
for ((i = NUM_PROCESSES - 1; i >= 0; i--)); do
  cmd=(env JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
       XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES_PER_PROCESS} ${XLA_FLAGS:-}"
       "$PYTHON" -m lpt.train --config "$CONFIG" --workdir "$WORKDIR"
       --coordinator "localhost:${PORT}" --num_processes "$NUM_PROCESSES" --process_id "$i" "$@")
  if ((i == 0)); then
    "${cmd[@]}" &
  else
    "${cmd[@]}" > "$WORKDIR/process_${i}.log" 2>&1 &
  fi
  pids+=($!)
done
# Forward Ctrl-C / SIGTERM to every process: each saves a checkpoint and exits cleanly.
trap 'kill -TERM "${pids[@]}" 2>/dev/null' INT TERM
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
