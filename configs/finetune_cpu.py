"""finetune_cpu: fine-tune the tiny_cpu result on held-out text (Python source) with pure bf16 params and Kahan updates.

Commands (the first trains the model that the second fine-tunes; run them from the repository root):

    python -m lpt.train --config configs/tiny_cpu.py --workdir runs/tiny_cpu
    python -m lpt.train --config configs/finetune_cpu.py --workdir runs/finetune_cpu

The log names the source run and step (``initialised N parameters from init_from.workdir=...``). It writes
runs/finetune_cpu/{checkpoints/, metrics.jsonl, tensorboard/, loss.png, summary.json, config.json}; summary.json and
every checkpoint's metadata record ``init_from`` (the source run and step). ``python -m lpt.lab finetune`` runs the
same fine-tune in f32 and with bf16 nearest, Kahan and stochastic rounding. Measured: docs/results.md, "Fine-tuning
at a small learning rate".

Data: the ``.py`` files of CPython's ``email`` package from the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``; ships with Python, no download), one file per document, the last 10% of each
file held out for validation. tiny_cpu was trained on English prose (the embedded ``pydoc_data.topics``), so this is
a domain shift from prose to code. Other Python versions ship a slightly different ``email`` package.

Recipe: the params of runs/tiny_cpu (float32) rounded to bf16 (round to nearest even); the bits that rounding drops
go into the Kahan compensation (lpt.train.init_from), so the fine-tune starts from the f32 values. bf16 compute,
lpt.optim.kahan_adamw, a small constant learning rate: the regime where most updates are below half an ulp of their
weight and round-to-nearest would cancel them (compare ``--config.precision.update_rule=nearest``, or
``python -m lpt.lab finetune``).
"""

import os
import sysconfig

from tiny_cpu import get_config as base


def get_config():
    c = base()
    c.precision.param_dtype = "bfloat16"  # params stored in bf16 (no f32 master copy)
    c.precision.compute_dtype = "bfloat16"  # matmul inputs and activations in bf16
    c.precision.update_rule = "kahan"  # lpt.optim.kahan_adamw; the compensation starts with the f32 source's low bits

    c.data.source = "text"  # every file matching data.paths is one document
    c.data.paths = os.path.join(sysconfig.get_paths()["stdlib"], "email", "*.py")  # held out: not in tiny_cpu's corpus

    c.optim.lr = 1e-4  # small: a fine-tune, most Adam updates fall below half a bf16 ulp of their weight
    c.optim.warmup_steps = 10  # short warmup of the fresh Adam moments
    c.optim.schedule = "constant"  # no decay over the short run

    c.train.steps = 300  # optimizer steps (600k tokens)
    c.train.eval_every = 50  # validation every 50 steps

    c.init_from.workdir = "runs/tiny_cpu"  # the run to fine-tune (train configs/tiny_cpu.py there first)
    c.init_from.step = -1  # -1: the newest checkpoint of init_from.workdir
    return c
