"""finetune_hf: fine-tune a Hugging Face GPT-2 or Llama directory with bf16 params and Kahan updates.

Command (DIR: a directory with config.json, model.safetensors and, if the model's vocabulary is not bytes,
tokenizer.json; it writes the files tiny_cpu.py lists, to its --workdir):

    python -m lpt.train --config configs/finetune_hf.py --config.init_from.hf=DIR --workdir runs/finetune_hf

The model section comes from DIR/config.json and the tokenizer from DIR/tokenizer.json (lpt.train.config.from_hf);
override only what you mean to change (e.g. ``--config.model.max_seq_len=256``, ``--config.data.seq_len=256``). The
params start from DIR's in bf16, their f32 low bits in the Kahan compensation. Measured (DIR exported from a
tiny_cpu run with ``python -m lpt.export``): docs/results.md, "Fine-tuning a Hugging Face directory".
"""

from lpt.train.config import defaults


def get_config():
    c = defaults()  # no model keys: they come from init_from.hf
    c.precision.param_dtype = "bfloat16"  # params stored in bf16 (no f32 master copy)
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "kahan"  # lpt.optim.kahan_adamw; the compensation starts with the source's low bits
    c.optim.lr = 1e-4  # a fine-tune: small and constant
    c.optim.warmup_steps = 10
    c.optim.schedule = "constant"
    c.train.steps = 200
    c.train.eval_every = 50
    return c
