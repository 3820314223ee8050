"""llama_1b: a ~1B-parameter Llama-style model (16 layers, d=2048, GQA 32/8) with FSDP, bf16 + Kahan, for GPU/TPU.

Command (per host; launch/slurm_gpu.sbatch and launch/tpu_pod.sh run it on every host; it writes the files
tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/llama_1b.py --workdir /mnt/shared/runs/llama_1b \
        --config.data.source=arrayrecord --config.data.paths='/data/corpus/*.array_record'

0.97B parameters with byte-level vocab; 8 bytes per parameter of param+optimizer state under bf16+Kahan (~7.8 GB)
sharded over the fsdp axis, activations over data. FLOPs per token = 6N + attention (lpt.models.flops_per_token). MFU
is logged when the device peak is known. ``python benchmarks/configs_compile.py`` compiles it for a TPU v5e-8 and
v5p-8 (``python -m lpt.train.compile --config llama_1b --topology TOPO``). Measured: docs/results.md, "FP8 weights
gathered as codes" (memory, FLOPs, collectives; checked by tests/train/test_config_fit.py).
"""

from lpt.train.config import defaults


def get_config():
    c = defaults()
    c.model.d_model = 2048  # residual width
    c.model.n_layers = 16  # transformer blocks
    c.model.n_heads = 32  # query heads (head_dim 64)
    c.model.n_kv_heads = 8  # key/value heads (GQA 4:1)
    c.model.d_ff = 8192  # SwiGLU hidden width
    c.model.max_seq_len = 2048  # longest sequence
    c.model.rope_theta = 500000.0  # RoPE base (Llama 3)
    c.model.remat = True  # recompute block activations in the backward pass (2048-token sequences)
    c.model.scan_layers = True  # stack the blocks and nnx.scan over them (params get a replicated 'layers' axis)

    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs / activations in bf16
    c.precision.update_rule = "kahan"  # Kahan-compensated bf16 updates
    c.precision.update_impl = "pallas"  # kahan only: the fused AdamW + Kahan Pallas kernel, per shard (GPU/TPU)
    c.precision.matmul.qkv = "fp8"  # blockwise FP8 (1x128 / 128x128 scales, f32 promotion every 128 of K)
    c.precision.matmul.out = "fp8"  # attention output projection
    c.precision.matmul.up = "fp8"  # MLP up/gate
    c.precision.matmul.down = "fp8"  # MLP down

    c.data.source = "arrayrecord"  # ArrayRecord files of byte documents
    c.data.paths = "/data/corpus/*.array_record"  # glob (override on the command line)
    c.data.seq_len = 2048  # tokens per sequence
    c.data.validation_fraction = 0.001  # held-out share
    c.data.worker_count = 8  # grain worker processes per host

    c.optim.lr = 3e-4  # peak lr
    c.optim.warmup_steps = 2000  # linear warmup
    c.optim.microbatches = 4  # gradient accumulation passes per step (a v5e-8 chip fits 4, not 2: docs/results.md)

    c.train.steps = 50000  # optimizer steps (~26B tokens)
    c.train.global_batch = 256  # sequences per step (512K tokens)
    c.train.eval_every = 1000  # validation interval
    c.train.eval_batches = 50  # validation batches per evaluation
    c.train.log_every = 20  # logging interval
    c.train.diagnostics_every = 100  # forward pass logging FP8 underflow / attention repeated max; 0 = off
    c.train.checkpoint_every = 1000  # checkpoint interval
    c.train.mesh.data = 1  # replicas (raise for multi-pod / DCN data parallelism)
    c.train.mesh.fsdp = -1  # shard params and optimizer state over all devices
    return c
