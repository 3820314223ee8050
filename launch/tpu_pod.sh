#!/usr/bin/env bash
# TPU pod slice: run the same command on every worker VM. jax.distributed.initialize() auto-detects the slice
# (lpt.train sees TPU_WORKER_HOSTNAMES with more than one host); each host feeds its own slice of every batch.
#
#   launch/tpu_pod.sh my-v5p-64 us-east5-a configs/llama_1b.py gs://my-bucket/runs/llama_1b [--config.key=value ...]
#
# Assumes the repository is cloned at ~/lpt on every worker with `pip install -e 'lpt[gcs]'` done (see
# docs/training.md; `gcloud ... --worker=all --command "git clone ... && pip install -e 'lpt[gcs]'"` does it once; the
# gcs extra is gcsfs and google-cloud-storage). The workdir is one all hosts reach: a gs://BUCKET/PATH URL (orbax and
# TensorStore write the checkpoints there, every host its shards; process 0 writes the metrics and holds the
# workdir's lease, docs/training.md#object-storage-workdirs) or a directory mounted at the same path on every worker.
# The VMs' service account needs read and write access to the bucket. Re-running the command resumes from the newest
# checkpoint.
set -euo pipefail
TPU_NAME=${1:?TPU name}
ZONE=${2:?zone}
CONFIG=${3:?config file}
WORKDIR=${4:?workdir}
shift 4
ARGS=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
  "cd ~/lpt && python -m lpt.train --config $CONFIG --workdir $WORKDIR $ARGS 2>&1 | tee -a ~/lpt_train.log"
