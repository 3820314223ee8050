"""tiny_cpu: the embedded default. A byte-level Llama-style model that visibly learns in a few minutes on 2 CPU cores.

Command (the README's main job):

    python -m lpt.train --config configs/tiny_cpu.py --workdir runs/tiny_cpu

It writes runs/tiny_cpu/{checkpoints/, metrics.jsonl, tensorboard/, loss.png, summary.json, config.json}; the last
log line and summary.json give the validation loss against the unigram baseline of the validation split. Every rerun
on one machine gives the same loss; the last digits depend on the CPU's vector extensions. Measured: docs/results.md,
"Trainer runs and recipes".

Data: the English text CPython ships in ``pydoc_data.topics`` (no download), bytes as tokens (vocab 256).
Recipe: float32 params and compute: the reference that the low-precision recipes (the other configs/tiny_cpu_*.py
files, which change only config.precision) are compared with.
"""

from lpt.train.config import defaults


def get_config():
    c = defaults()
    c.model.d_model = 128  # residual stream width
    c.model.n_layers = 2  # transformer blocks
    c.model.n_heads = 4  # query heads (head_dim = d_model / n_heads = 32)
    c.model.n_kv_heads = 2  # key/value heads (GQA: 2 query heads share one KV head)
    c.model.d_ff = 384  # SwiGLU hidden width
    c.model.max_seq_len = 64  # longest sequence the model accepts (RoPE table / position embedding size)

    c.train.steps = 600  # optimizer steps
    return c
