"""gpt2_124m: GPT-2 small shape (12 layers, d=768, 12 heads) on your text files, bf16 params + Kahan, for GPUs/TPUs.

Command (one host; see launch/ for SLURM and TPU pods):

    python -m lpt.train --config configs/gpt2_124m.py --workdir runs/gpt2_124m \
        --config.data.paths='/data/openwebtext/*.txt'

Expected result: not measured here (this repository is developed on CPUs). Byte-level tokens (vocab 256), so the
model sees ~4x more tokens per word than GPT-2's BPE: 1024-byte contexts. About 86M parameters (no BPE embedding);
6N+attention ~ 0.6 GFLOP per token, ~1.3e18 FLOPs for the 2B tokens of 4000 steps x 512 x 1024: hours on one 8-GPU
node. Compare a bf16+nearest run (--config.precision.update_rule=nearest) to see the nearest-rounding floor of Zamirai
et al. (Revisiting BFloat16 Training).

Compiled with `python -m lpt.train.compile --config gpt2_124m --topology TOPO` (2026-11-23):
- v5e:2x2 (v5e-4, data parallel): 12.27 GiB per chip of 15.75 (state 0.64 GiB, temps 11.59 GiB); 3.272e14 model
  FLOPs per step; 4 Mosaic kernels (flash attention); collectives: the gradients' all-reduce only (26 per step,
  172 MB), no all-gather; 81 s to compile on 2 CPU cores. Rerun: `python benchmarks/configs_compile.py`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.kind = "gpt2"  # LayerNorm, learned positions, GELU, biases
    c.model.vocab_size = 0  # 0: the tokenizer's vocabulary size (256 for data.tokenizer="bytes")
    c.model.d_model = 768  # residual width
    c.model.n_layers = 12  # transformer blocks
    c.model.n_heads = 12  # attention heads (head_dim 64)
    c.model.n_kv_heads = 12  # gpt2 has no GQA: equal to n_heads
    c.model.d_ff = 3072  # MLP hidden width (4 d_model)
    c.model.max_seq_len = 1024  # learned position table size
    c.model.rope_theta = 10000.0  # unused by gpt2 (no RoPE)
    c.model.rope_scaling = ml_collections.ConfigDict()
    c.model.rope_scaling.type = "none"  # RoPE frequency scaling: "none" | "linear" | "llama3" (Llama 3.1)
    c.model.rope_scaling.factor = 1.0  # linear / llama3: context extension factor
    c.model.rope_scaling.low_freq_factor = 1.0  # llama3: wavelengths above original_max_len / this are scaled
    c.model.rope_scaling.high_freq_factor = 4.0  # llama3: wavelengths below original_max_len / this are kept
    c.model.rope_scaling.original_max_len = 8192  # llama3: the pretraining context length
    c.model.norm_eps = 1e-5  # LayerNorm epsilon
    c.model.tie_embeddings = True  # GPT-2 ties input and output embeddings
    c.model.init_std = 0.02  # GPT-2 init
    c.model.remat = True  # recompute block activations in the backward pass (128 sequences per v5e chip need it)
    c.model.scan_layers = True  # stack the blocks and nnx.scan over them (compile once per block, not 12 times)

    c.precision = ml_collections.ConfigDict()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16
    c.precision.compute_dtype = "bfloat16"  # matmul inputs / activations in bf16
    c.precision.update_rule = "kahan"  # Kahan-compensated bf16 updates (no f32 master copy)
    c.precision.moment_rounding = "stochastic"  # 16-bit Adam moments: "stochastic" (unbiased) | "nearest"
    c.precision.update_impl = "xla"  # kahan only: fused step in "xla" or the "pallas" kernel (GPU/TPU)
    c.precision.matmul = ml_collections.ConfigDict()
    c.precision.matmul.qkv = "bf16"  # q/k/v projection
    c.precision.matmul.out = "bf16"  # attention output projection
    c.precision.matmul.up = "bf16"  # MLP up projection
    c.precision.matmul.down = "bf16"  # MLP down projection
    c.precision.matmul.lm_head = "bf16"  # vocabulary projection
    c.precision.attention = ml_collections.ConfigDict()
    c.precision.attention.impl = "pallas"  # the flash kernel (GPU/TPU; interpreted, and slow, on a CPU)
    c.precision.attention.stable = True  # Qiu & Yao's fix for repeated row maxima
    c.precision.attention.beta = 7.0  # the fix's beta
    c.precision.pqt = ml_collections.ConfigDict()
    c.precision.pqt.method = "none"  # no pseudo-quantisation training
    c.precision.pqt.layers = ()  # layer kinds with PQT
    c.precision.pqt.b_init = 6.0  # initial bitwidth (PQT only)
    c.precision.pqt.b_target = 4.0  # target bitwidth (PQT only)
    c.precision.pqt.loss_weight = 0.0  # bitwidth loss weight (PQT only)

    c.data = ml_collections.ConfigDict()
    c.data.source = "text"  # UTF-8 text files, bytes as tokens
    c.data.paths = "/data/openwebtext/*.txt"  # glob of the corpus files (override on the command line)
    c.data.seq_len = 1024  # tokens per sequence
    c.data.validation_fraction = 0.005  # held-out share of the corpus
    c.data.worker_count = 4  # grain worker processes per host
    c.data.shuffle_seed = 0  # data order seed
    c.data.cache_dir = ""  # tokenized-corpus cache; "" = $LPT_DATA_CACHE, else ~/.cache/lpt/data
    c.data.tokenizer = "bytes"  # "bytes" (vocab 256) | path to a tokenizer.json (tokenizers) | a SentencePiece .model

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 6e-4  # GPT-2 small peak lr
    c.optim.warmup_steps = 200  # linear warmup
    c.optim.schedule = "cosine"  # cosine decay to lr/10
    c.optim.b1 = 0.9  # Adam beta1
    c.optim.b2 = 0.95  # Adam beta2
    c.optim.eps = 1e-8  # Adam epsilon
    c.optim.weight_decay = 0.1  # decoupled weight decay on matrices
    c.optim.grad_clip = 1.0  # global-norm clipping
    c.optim.microbatches = 1  # raise if a device runs out of memory (same global batch, more passes)

    c.train = ml_collections.ConfigDict()
    c.train.steps = 4000  # optimizer steps (~2.1B tokens)
    c.train.global_batch = 512  # sequences per step over all devices
    c.train.seed = 0  # init and per-step randomness
    c.train.eval_every = 250  # validation interval
    c.train.eval_batches = 20  # validation batches per evaluation
    c.train.log_every = 10  # logging interval
    c.train.diagnostics_every = 100  # forward pass logging FP8 underflow / attention repeated max; 0 = off
    c.train.profile_steps = ""  # "FIRST,LAST" writes a jax.profiler trace of those steps to workdir/profile
    c.train.checkpoint_every = 500  # checkpoint interval
    c.train.keep_checkpoints = 3  # checkpoints kept
    c.train.mesh = ml_collections.ConfigDict()
    c.train.mesh.data = -1  # pure data parallelism over all devices (124M fits on any accelerator)
    c.train.mesh.fsdp = 1  # no parameter sharding needed at this size
    c.train.mesh.tensor = 1  # no tensor parallelism

    c.init_from = ml_collections.ConfigDict()
    c.init_from.hf = ""  # a Hugging Face model directory (config.json + *.safetensors) to fine-tune; "" = none
    c.init_from.workdir = ""  # an lpt run directory to fine-tune from; "" = none (fresh init)
    c.init_from.step = -1  # with init_from.workdir: the checkpoint step to take (-1 = the newest)
    return c
