"""lpt.train: the trainer behind ``python -m lpt.train --config configs/<name>.py --workdir DIR``.

Modules, in the order the recipe (``lpt/train/loop.py``) uses them:

* ``config``: the typed config tree (``Config``: every key's type, default, allowed values and doc), config files
  (``get_config()`` from ``defaults()``), ``--config.a.b=value`` overrides and validation (unknown keys rejected with
  the valid ones listed).
* ``distributed``: ``jax.distributed`` start-up (explicit, SLURM, TPU pod) and the SIGTERM flag.
* ``mesh``: the ("data", "fsdp", "tensor") mesh and the logical-axis rules -> shardings.
* ``optimizer``: ``clip -> adamw(schedule) -> lpt.optim update rule`` from the config.
* ``state``: ``TrainState`` (params / other variables as plain dicts + optimizer state), sharded init.
* ``step``: jitted train step (donated state, explicit shardings, microbatching) and eval step.
* ``checkpoint``: orbax CheckpointManager (state + JSON metadata; the data position is the step), fallback on a
  corrupt latest step, a one-line error for a checkpoint of another model, recipe or data position.
* ``metrics``: JSONL + TensorBoard, loss-curve PNG, MFU.

* ``loop``: the recipe itself, ``train(cfg, workdir, hooks=())``, and ``program(cfg, mesh)`` (the jitted steps and
  the train-state layout, also what ``lpt.train.compile`` compiles ahead of time).

``python -m lpt.train`` (``__main__``) parses the command line and calls ``lpt.train.loop.train``. See
docs/training.md.
"""

from lpt.train.checkpoint import load_params
from lpt.train.config import SCHEMA, apply_overrides, load_config_file, parse_args

__all__ = ["SCHEMA", "apply_overrides", "load_config_file", "load_params", "parse_args"]
