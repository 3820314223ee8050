"""A few-step tiny_cpu run for tests of what reads a finished run (generate, eval, export)."""

import logging
from pathlib import Path

from lpt.train import config as config_lib
from lpt.train.loop import train

ROOT = Path(__file__).resolve().parents[1]

# a one-layer d_model-32 Llama with GQA 2:1 and 32-token sequences: seconds to train on a CPU
OVERRIDES = {
    "model.d_model": "32",
    "model.n_layers": "1",
    "model.n_heads": "2",
    "model.n_kv_heads": "1",
    "model.d_ff": "64",
    "model.max_seq_len": "32",
    "data.seq_len": "32",
    "train.global_batch": "4",
    "train.steps": "3",  # one program (the schedule spans train.steps) for test_eval, test_generate, test_tool_errors
    "train.eval_every": "3",
    "train.eval_batches": "1",
    "train.log_every": "1",
    "train.diagnostics_every": "0",
    "train.checkpoint_every": "2",
    "optim.warmup_steps": "1",
}

# ``python -m lpt.train --config tiny_cpu`` flags of a one-layer d_model-32 model on 8 x 32 tokens, a checkpoint every
# 2 steps: with --config.train.steps=6 the one program of test_train_faults, test_object_storage and test_console
# (compiled once into the shared cache)
TRAIN_FLAGS = [
    "--config.model.d_model=32",
    "--config.model.n_layers=1",
    "--config.model.d_ff=64",
    "--config.train.global_batch=8",
    "--config.data.seq_len=32",
    "--config.train.checkpoint_every=2",
    "--config.train.keep_checkpoints=5",
    "--config.train.eval_batches=1",
    "--config.train.log_every=1",
    "--config.train.diagnostics_every=0",
]


def tiny_config(overrides: dict[str, str] | None = None, config: str = "tiny_cpu"):
    """``configs/<config>.py`` with :data:`OVERRIDES`, then ``overrides``."""
    keys = {**OVERRIDES, **(overrides or {})}
    return config_lib.apply_overrides(config_lib.load_config_file(ROOT / "configs" / f"{config}.py"), keys)


def train_tiny(workdir: Path, overrides: dict[str, str] | None = None, hooks=()) -> dict:
    """Train configs/tiny_cpu.py with :data:`OVERRIDES`, then ``overrides`` (``{"train.steps": "3"}``), into
    ``workdir`` (``hooks`` as :func:`lpt.train.loop.train` takes them); returns the run's summary."""
    logging.getLogger("lpt.train").setLevel(logging.WARNING)
    return train(tiny_config(overrides), workdir, hooks=hooks)
