"""``python -m lpt.export --workdir RUN --out DIR [--step N]``: a trained lpt run as a Hugging Face model directory.

Reads the run's checkpoint (the newest, or ``--step``) with :func:`lpt.train.load_params` and its config (the one
recorded with the checkpoint, else ``RUN/config.json``) and writes ``DIR/{config.json, model.safetensors}`` with
:func:`lpt.models.hf.save_params`: GPT-2 or Llama, tensors in the parameters' stored dtype (float32, or bfloat16
for the bf16 recipes). If ``config.data.tokenizer`` is a tokenizer.json file it is copied to ``DIR/tokenizer.json``.
Exit codes: 0 written, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import ml_collections
import numpy as np


def export(workdir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the run ``workdir``'s checkpoint ``step`` (None: the newest) to ``out`` as a Hugging Face directory."""
    from lpt.models import hf
    from lpt.train import load_params

    params, cfg = load_params(workdir, step)
    if "model" not in cfg:  # a checkpoint saved without its config: the run's config.json
        file = Path(workdir) / "config.json"
        if not file.is_file():
            raise ValueError(f"{workdir}: the checkpoint records no config and there is no {file.name}")
        cfg = ml_collections.ConfigDict(json.loads(file.read_text()))
    model_cfg = cfg.model.to_dict()
    rows = int(np.shape(params["embed"]["embedding"])[0])
    # the trainer records the resolved vocab_size (config.resolve); 0 would be a run recorded before it did
    if model_cfg["vocab_size"] == 0:
        model_cfg["vocab_size"] = rows
    elif model_cfg["vocab_size"] != rows:
        raise ValueError(
            f"{workdir}: config model.vocab_size={model_cfg['vocab_size']} but the checkpoint's embedding has "
            f"{rows} rows"
        )
    tokenizer = str(cfg.get("data", {}).get("tokenizer", "bytes"))
    tokenizer_file = tokenizer if tokenizer.endswith(".json") else None
    if tokenizer_file is not None and not Path(tokenizer_file).is_file():
        raise ValueError(f"{workdir}: the run's data.tokenizer={tokenizer!r} does not exist any more")
    hf.save_params(out, params, model_cfg, tokenizer_file=tokenizer_file)
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lpt.export", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="the lpt run directory (holds checkpoints/)")
    parser.add_argument("--out", required=True, help="the Hugging Face model directory to write")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    args = parser.parse_args(argv)
    try:
        out = export(args.workdir, args.out, args.step)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
