"""``python -m lpt.eval (--workdir RUN | --hf PATH) [--step N] [--config.data.KEY=VALUE ...] [--batches N]``: the
validation loss of a model as one JSON line.

Reports ``loss`` (mean next-token cross entropy, nats/token), ``perplexity`` (``exp(loss)``), ``bits_per_byte``
(``loss / ln 2 / bytes_per_token`` with :func:`lpt.data.bytes_per_token` of the split: text bytes per token, 1.0
for the bytes tokenizer), and what they were measured on: ``data`` (the text: ``"embedded"``, or the source and its
paths, e.g. ``"text:docs/*.txt"``), ``tokenizer`` (``config.data.tokenizer``: ``"bytes"`` or the file),
``seq_len`` (the window, in tokens), ``split``, ``bytes_per_token``, ``tokens``, ``batches``, ``batch_size``, and
``step`` for a run.

Data: for ``--workdir`` the run's own ``config.data``, its ``train.global_batch`` rows per batch and
``train.eval_batches`` batches, so that the loss equals the run's final ``eval_loss`` (the trainer's evaluation
reads the same batches, :func:`lpt.data.make_eval_batches`); for ``--hf`` the ``config.data`` of
configs/tiny_cpu.py (the embedded corpus) with ``PATH/tokenizer.json`` as the tokenizer if there is one (else
bytes for a model of 256 ids, said on stderr; another vocabulary is refused), 8 rows per batch (rounded up to a
multiple of the mesh's data × fsdp) and 4 batches.
``--config.data.KEY=VALUE`` (or ``--config.data.KEY VALUE``) overrides
data keys as the trainer does (:func:`lpt.train.config.parse_overrides`), e.g. another corpus or ``seq_len``;
``--batches N``, ``--batch-size B``, ``--split validation|train`` and ``--dtype float32|bfloat16`` (compute dtype;
default the run's own, float32 for ``--hf``) change the rest. Exit codes: 0 done, 2 bad input (one line on stderr).
Devices: every device of the machine, sharded as :func:`lpt.inference.inference_mesh` says (the JSON line names the
``mesh``).

From Python: :func:`evaluate` on any :class:`lpt.models.Transformer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lpt import data as data_lib
from lpt.data import DataConfig
from lpt.data.tokenizer import ByteTokenizer
from lpt.inference import inference_mesh, load_model, model_arguments
from lpt.models.partitioning import place
from lpt.train import checkpoint, console
from lpt.train import config as config_lib
from lpt.train import mesh as mesh_lib
from lpt.train.step import cross_entropy, on_mesh

SPLITS = ("validation", "train")


def evaluate(
    model, data_cfg: DataConfig, *, batch: int, num_batches: int, split: str = "validation", mesh: Mesh | None = None
) -> dict:
    """Loss (nats/token), perplexity and bits per byte of ``model`` on the first ``num_batches`` batches of
    ``batch`` windows of ``data_cfg.seq_len`` tokens of ``split`` (:func:`lpt.data.make_eval_batches`), no weight
    noise. The loss is the mean over batches of each batch's mean cross entropy (float32 per batch, the mean in
    float64), as the trainer computes ``eval_loss``. The dict names what was measured too (``data``, ``tokenizer``,
    ``seq_len``, ``split``, ...: the keys of the module docstring).

    ``mesh``: the variables are placed on it by their logical axes as the trainer shards them
    (:func:`lpt.models.partitioning.place`), each batch is split over its data and fsdp axes and the forward is
    traced under the trainer's rules (:func:`lpt.train.step.on_mesh`), so the kernels run per shard; None: the
    default device.

    Args:
      model: an lpt model (``model.spec`` gives ``max_seq_len`` and ``vocab_size``), e.g. from
        :func:`lpt.inference.load_model`.
      data_cfg: a :class:`lpt.data.DataConfig` or a partial mapping of its keys; its ``seq_len`` is the window length.
      batch: windows per batch, a positive int (with ``mesh``, a multiple of its data × fsdp devices).
      num_batches: batches evaluated, a positive int.
      split: ``"validation"`` or ``"train"``.
      mesh: a device mesh with ``data`` and ``fsdp`` axes, or None.
    """
    data_cfg = data_lib.data_options(data_cfg)
    seq_len = data_cfg.seq_len
    if seq_len > model.spec.max_seq_len:
        raise ValueError(f"data.seq_len={seq_len} exceeds the model's max_seq_len={model.spec.max_seq_len}")
    vocab = data_lib.load_tokenizer(data_cfg.tokenizer).vocab_size
    if vocab > model.spec.vocab_size:
        raise ValueError(
            f"data.tokenizer={data_cfg.tokenizer!r} has {vocab} tokens but the model only {model.spec.vocab_size}"
        )
    for name, value in (("batches", num_batches), ("batch size", batch)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if mesh is not None and batch % (rows := mesh.shape["data"] * mesh.shape["fsdp"]):
        raise ValueError(f"batch size {batch} does not split over the mesh's data*fsdp = {rows} devices")
    batches = data_lib.make_eval_batches(data_cfg, seq_len=seq_len, batch=batch, num_batches=num_batches, split=split)
    if mesh is None:
        graphdef, state = nnx.split(model)
        put, rules = jax.device_put, contextlib.nullcontext
    else:
        graphdef, state = place(model, mesh)
        put = functools.partial(jax.device_put, device=mesh_lib.batch_sharding(mesh))
        rules = functools.partial(on_mesh, mesh)

    @jax.jit
    def loss_fn(st, x_BT, y_BT):
        with rules():
            return cross_entropy(nnx.merge(graphdef, st)(x_BT, key=None), y_BT)

    loss = float(np.mean([float(loss_fn(state, put(b["inputs"]), put(b["targets"]))) for b in batches]))
    bpt = data_lib.bytes_per_token(data_cfg, split)
    source = data_cfg.source
    return {
        "data": source if source == "embedded" else f"{source}:{data_cfg.paths}",
        "tokenizer": str(data_cfg.tokenizer),
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": loss / math.log(2) / bpt,
        "bytes_per_token": bpt,
        "tokens": batch * seq_len * num_batches,
        "batches": num_batches,
        "batch_size": batch,
        "seq_len": seq_len,
        "split": split,
    }


def data_config(base: DataConfig, overrides: list[str]) -> DataConfig:
    """``base`` (a ``config.data``) with ``--config.data.KEY=VALUE`` overrides parsed by the trainer's schema."""
    data = base.to_dict()
    for key, text in config_lib.parse_overrides(overrides).items():
        if not key.startswith("data."):
            raise ValueError(f"--config.{key}: only config.data keys can be overridden here (--config.data.KEY=VALUE)")
        leaf = key[len("data.") :]
        if leaf not in data:
            raise ValueError(f"unknown config key {key!r}; config.data keys: {sorted(data)}")
        data[leaf] = config_lib.parse_value(key, text)
    return data_lib.data_options(data)


def main(argv: list[str] | None = None) -> int:
    console.setup()
    parser = model_arguments("python -m lpt.eval", __doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=None, help="batches (default: the run's train.eval_batches)")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per batch (default: train.global_batch)")
    parser.add_argument("--split", choices=SPLITS, default="validation", help="data split (default validation)")
    args, rest = parser.parse_known_args(argv)
    try:
        model, tokenizer, cfg = load_model(args.workdir, args.hf, step=args.step, dtype=args.dtype)
        mesh = inference_mesh(cfg)
        if cfg is not None:
            base, batch, batches = cfg.data, int(cfg.train.global_batch), int(cfg.train.eval_batches)
        else:
            base = config_lib.load_config_file(config_lib.resolve_config("tiny_cpu")).data
            bytes_ids = isinstance(tokenizer, ByteTokenizer)  # lpt.inference.hf_tokenizer chose (and said so)
            base = dataclasses.replace(
                base,
                tokenizer="bytes" if bytes_ids else str(Path(args.hf) / "tokenizer.json"),
                seq_len=min(base.seq_len, model.spec.max_seq_len),
            )
            rows = mesh.shape["data"] * mesh.shape["fsdp"]
            batch, batches = -(-8 // rows) * rows, 4  # at least 8 rows, a multiple of the devices
        data = data_config(base, rest)
        result = evaluate(
            model,
            data,
            batch=batch if args.batch_size is None else args.batch_size,
            num_batches=batches if args.batches is None else args.batches,
            split=args.split,
            mesh=mesh,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.workdir is not None:
        result["step"] = args.step if args.step is not None else checkpoint.steps(args.workdir)[-1]
    result["mesh"] = dict(mesh.shape)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
