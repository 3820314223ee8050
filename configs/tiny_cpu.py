"""tiny_cpu: the embedded default. A byte-level Llama-style model that visibly learns in a few minutes on 2 CPU cores.

Command (the README's main job):

    python -m lpt.train --config configs/tiny_cpu.py --workdir runs/tiny_cpu

Expected result (2 CPU cores, XLA:CPU, AMD EPYC Zen 4 with AVX-512, 2026-11-23): validation loss 1.3834 nats/token
after 600 steps (1.2M tokens; evaluations at steps 100..600: 2.273, 1.796, 1.609, 1.503, 1.415, 1.383) against the
unigram baseline 3.367 of the validation split, in about 1-3 minutes (75 s wall there). Deterministic on one machine:
every rerun gives the same loss; the f32 round-off, and so the last digits, depend on the CPU's vector extensions.
It writes runs/tiny_cpu/{checkpoints/, metrics.jsonl, tensorboard/, loss.png, summary.json, config.json}.

Data: the English text CPython ships in ``pydoc_data.topics`` (no download), bytes as tokens (vocab 256).
Recipe: float32 params and compute: the reference that the low-precision recipes (the other configs/tiny_cpu_*.py
files, which change only config.precision) are compared with.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.kind = "llama"  # "llama" (RMSNorm, RoPE, SwiGLU, GQA) or "gpt2" (LayerNorm, learned positions, GELU)
    c.model.vocab_size = 0  # 0: the tokenizer's vocabulary size (256 for data.tokenizer="bytes")
    c.model.d_model = 128  # residual stream width
    c.model.n_layers = 2  # transformer blocks
    c.model.n_heads = 4  # query heads (head_dim = d_model / n_heads = 32)
    c.model.n_kv_heads = 2  # key/value heads (GQA: 2 query heads share one KV head)
    c.model.d_ff = 384  # SwiGLU hidden width
    c.model.max_seq_len = 64  # longest sequence the model accepts (RoPE table / position embedding size)
    c.model.rope_theta = 10000.0  # RoPE base frequency (llama only)
    c.model.rope_scaling = ml_collections.ConfigDict()
    c.model.rope_scaling.type = "none"  # RoPE frequency scaling: "none" | "linear" | "llama3" (Llama 3.1)
    c.model.rope_scaling.factor = 1.0  # linear / llama3: context extension factor
    c.model.rope_scaling.low_freq_factor = 1.0  # llama3: wavelengths above original_max_len / this are scaled
    c.model.rope_scaling.high_freq_factor = 4.0  # llama3: wavelengths below original_max_len / this are kept
    c.model.rope_scaling.original_max_len = 8192  # llama3: the pretraining context length
    c.model.norm_eps = 1e-5  # epsilon of RMSNorm / LayerNorm
    c.model.tie_embeddings = False  # share the input embedding with the output projection
    c.model.init_std = 0.02  # std of the normal init of weight matrices
    c.model.remat = False  # recompute block activations in the backward pass (less memory, ~1/3 more compute)
    c.model.scan_layers = False  # nnx.scan over stacked blocks (one compiled block: faster compiles when deep)

    c.precision = ml_collections.ConfigDict()
    c.precision.param_dtype = "float32"  # dtype params are stored in (f32_master: the dtype layers view them in)
    c.precision.compute_dtype = "float32"  # dtype of matmul inputs/activations (loss, softmax, norms: always f32)
    c.precision.update_rule = "f32_master"  # f32_master | nearest | kahan | stochastic | norm_preserving
    c.precision.moment_rounding = "stochastic"  # 16-bit Adam moments: "stochastic" (unbiased) | "nearest"
    c.precision.update_impl = "xla"  # kahan only: fused step in "xla" or the "pallas" kernel (GPU/TPU)
    c.precision.matmul = ml_collections.ConfigDict()
    c.precision.matmul.qkv = "bf16"  # "bf16": matmul in compute_dtype; "fp8": blockwise FP8 (lpt.fp8)
    c.precision.matmul.out = "bf16"  # attention output projection
    c.precision.matmul.up = "bf16"  # MLP up (and gate) projection
    c.precision.matmul.down = "bf16"  # MLP down projection
    c.precision.matmul.lm_head = "bf16"  # output projection to the vocabulary
    c.precision.attention = ml_collections.ConfigDict()
    c.precision.attention.impl = "xla"  # "xla" reference or "pallas" flash kernel
    c.precision.attention.stable = True  # Qiu & Yao's fix for repeated row maxima in low-precision softmax
    c.precision.attention.beta = 7.0  # the fix's beta (rows with repeated max use beta*m or 0 as offset)
    c.precision.pqt = ml_collections.ConfigDict()
    c.precision.pqt.method = "none"  # pseudo-quantisation training: "none" | "gaussws" | "diffq"
    c.precision.pqt.layers = ()  # which layer kinds get PQT, e.g. ("out", "down")
    c.precision.pqt.b_init = 6.0  # initial learnable bitwidth
    c.precision.pqt.b_target = 4.0  # bitwidth the aux loss pulls towards
    c.precision.pqt.loss_weight = 0.0  # weight of the bitwidth aux loss

    c.data = ml_collections.ConfigDict()
    c.data.source = "embedded"  # "embedded" (pydoc_data.topics) | "text" (files) | "arrayrecord"
    c.data.paths = ""  # glob of input files for "text" / "arrayrecord" (unused for "embedded")
    c.data.seq_len = 64  # tokens per training sequence
    c.data.validation_fraction = 0.1  # share of the corpus held out for validation
    c.data.worker_count = 0  # grain worker processes (0 = in-process; recorded in checkpoints)
    c.data.shuffle_seed = 0  # seed of the training data order
    c.data.cache_dir = ""  # tokenized-corpus cache; "" = $LPT_DATA_CACHE, else ~/.cache/lpt/data
    c.data.tokenizer = "bytes"  # "bytes" (vocab 256) | path to a tokenizer.json (tokenizers) | a SentencePiece .model

    c.optim = ml_collections.ConfigDict()
    c.optim.lr = 3e-3  # peak learning rate
    c.optim.warmup_steps = 30  # linear warmup from 0
    c.optim.schedule = "cosine"  # "cosine" (decay to lr/10 at train.steps) | "constant"
    c.optim.b1 = 0.9  # Adam beta1
    c.optim.b2 = 0.95  # Adam beta2
    c.optim.eps = 1e-8  # Adam epsilon
    c.optim.weight_decay = 0.1  # decoupled weight decay (matrices only)
    c.optim.grad_clip = 1.0  # clip the global gradient norm (0 = off)
    c.optim.microbatches = 1  # gradient accumulation steps per optimizer step

    c.train = ml_collections.ConfigDict()
    c.train.steps = 600  # optimizer steps
    c.train.global_batch = 32  # sequences per step, summed over all devices and processes
    c.train.seed = 0  # model init and per-step randomness: key = fold_in(PRNGKey(seed), step)
    c.train.eval_every = 100  # validation every N steps (and at the end)
    c.train.eval_batches = 4  # validation batches per evaluation
    c.train.log_every = 10  # JSONL/TensorBoard logging interval
    c.train.diagnostics_every = 50  # forward pass logging FP8 underflow / attention repeated max; 0 = off
    c.train.profile_steps = ""  # "FIRST,LAST" writes a jax.profiler trace of those steps to workdir/profile
    c.train.checkpoint_every = 200  # checkpoint interval (and at the end, and on SIGTERM)
    c.train.keep_checkpoints = 3  # newest checkpoints to keep
    c.train.mesh = ml_collections.ConfigDict()
    c.train.mesh.data = -1  # data-parallel axis (-1: all devices not used by the other axes)
    c.train.mesh.fsdp = 1  # fully-sharded data parallel axis (params sharded on "embed")
    c.train.mesh.tensor = 1  # tensor-parallel axis (heads / mlp / vocab)

    c.init_from = ml_collections.ConfigDict()
    c.init_from.hf = ""  # a Hugging Face model directory (config.json + *.safetensors) to fine-tune; "" = none
    c.init_from.workdir = ""  # an lpt run directory to fine-tune from; "" = none (fresh init)
    c.init_from.step = -1  # with init_from.workdir: the checkpoint step to take (-1 = the newest)
    return c
