"""gpt2_124m: GPT-2 small shape (12 layers, d=768, 12 heads) on your text files, bf16 params + Kahan, for GPUs/TPUs.

Command (one host; it writes the files tiny_cpu.py lists, to its --workdir; see launch/ for SLURM and TPU pods):

    python -m lpt.train --config configs/gpt2_124m.py --workdir runs/gpt2_124m \
        --config.data.paths='/data/openwebtext/*.txt'

Byte-level tokens (vocab 256), so the model sees ~4x more tokens per word than GPT-2's BPE: 1024-byte contexts. About
86M parameters (no BPE embedding). Compare a bf16+nearest run (--config.precision.update_rule=nearest) to see the
nearest-rounding floor of Zamirai et al. (Revisiting BFloat16 Training). ``python benchmarks/configs_compile.py``
compiles it for a TPU v5e-4 (``python -m lpt.train.compile --config gpt2_124m --topology v5e:2x2``). Measured:
docs/results.md, "Pod configs compiled for TPU" (memory, FLOPs, collectives; checked by
tests/train/test_config_fit.py).
"""

from lpt.train.config import defaults


def get_config():
    c = defaults()
    c.model.kind = "gpt2"  # LayerNorm, learned positions, GELU, biases
    c.model.d_model = 768  # residual width
    c.model.n_layers = 12  # transformer blocks
    c.model.n_heads = 12  # attention heads (head_dim 64)
    c.model.n_kv_heads = 12  # gpt2 has no GQA: equal to n_heads
    c.model.d_ff = 3072  # MLP hidden width (4 d_model)
    c.model.max_seq_len = 1024  # learned position table size
    c.model.tie_embeddings = True  # GPT-2 ties input and output embeddings
    c.model.remat = True  # recompute block activations in the backward pass (128 sequences per v5e chip need it)
    c.model.scan_layers = True  # stack the blocks and nnx.scan over them (compile once per block, not 12 times)

    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs / activations in bf16
    c.precision.update_rule = "kahan"  # Kahan-compensated bf16 updates (no f32 master copy)

    c.data.source = "text"  # UTF-8 text files, bytes as tokens
    c.data.paths = "/data/openwebtext/*.txt"  # glob of the corpus files (override on the command line)
    c.data.seq_len = 1024  # tokens per sequence
    c.data.validation_fraction = 0.005  # held-out share of the corpus
    c.data.worker_count = 4  # grain worker processes per host

    c.optim.lr = 6e-4  # GPT-2 small peak lr
    c.optim.warmup_steps = 200  # linear warmup

    c.train.steps = 4000  # optimizer steps (~2.1B tokens)
    c.train.global_batch = 512  # sequences per step over all devices
    c.train.eval_every = 250  # validation interval
    c.train.eval_batches = 20  # validation batches per evaluation
    c.train.diagnostics_every = 100  # forward pass logging FP8 underflow / attention repeated max; 0 = off
    c.train.checkpoint_every = 500  # checkpoint interval
    return c
