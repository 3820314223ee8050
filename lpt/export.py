"""``python -m lpt.export --workdir RUN --out DIR [--step N] [--overwrite] [--check]``: a trained lpt run as a
Hugging Face model directory.

Reads the run's checkpoint (the newest, or ``--step``) with :func:`lpt.train.load_params` and its config (the one
recorded with the checkpoint, else ``RUN/config.json``) and writes ``DIR/{config.json, model.safetensors}`` with
:func:`lpt.models.hf.save_params`: GPT-2, Llama, Qwen2 or Qwen3 (by the model's options), tensors in the
parameters' stored dtype (float32, or bfloat16 for the bf16 recipes). If ``config.data.tokenizer`` is a
tokenizer.json file it is copied to ``DIR/tokenizer.json``.
``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` go into config.json and ``DIR/generation_config.json``
(:func:`token_ids`), so that ``transformers.generate`` stops where lpt's generation stops: at the separator the run
packed between documents, or the ids of the ``init_from.hf`` directory the run started from.

``DIR`` may be missing or an empty directory. A non-empty directory is refused (exit 2, nothing touched) unless
``--overwrite`` is given; a file is always refused, and so is the run's own directory, one inside it or one holding
it (symlinks followed), with or without ``--overwrite``. The export is written to a new sibling directory
(``.DIR.new-*``) and then put in place as a unit: an existing ``DIR`` is renamed aside (``.DIR.old-*``), the new
one renamed to ``DIR`` and the old one deleted, so no file of an older export (a stale tokenizer.json, say)
survives beside new weights, and an export that fails halfway leaves ``DIR`` as it was.

``--check`` then loads ``DIR`` with ``transformers.AutoModelForCausalLM`` (float32, eager attention) and compares
its logits with those of the run's own parameters in lpt (float32, :func:`check`) on 2 rows of random token ids
(seed 0) as long as the model's context, up to 64: it prints the max abs difference and fails if it exceeds
``1e-4 · max(1, max |logit|)``. It needs ``transformers`` and ``torch`` (the ``dev`` extras), which lpt itself
never imports.
Exit codes: 0 written (and, with ``--check``, equal), 1 the check failed, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
from pathlib import Path

import numpy as np

from lpt.data import load_tokenizer
from lpt.models import hf
from lpt.models.config import ModelSpec
from lpt.train import console, load_params, paths
from lpt.train.config import Config


def token_ids(cfg: Config) -> dict:
    """``{bos_token_id, eos_token_id, pad_token_id}`` of an export of the run whose config is ``cfg``: all three the
    run's separator (the token :func:`lpt.data.load_tokenizer` packs between documents: the tokenizer's end-of-text
    token, id 0 for bytes), which lpt's generation stops at. A run started from ``init_from.hf`` with that
    directory's tokenizer (the same file content; bytes when it has no tokenizer.json) takes the ids the directory
    sets instead (:func:`lpt.models.hf.read_token_ids`; eos may be a list), when its config.json is still there."""
    tok = load_tokenizer(cfg.data.tokenizer)
    ids = dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"), tok.separator)
    source = cfg.init_from.hf
    directory = Path(source).expanduser()
    if source and (directory / "config.json").is_file():
        source_tok = directory / "tokenizer.json"
        if tok.identity == (load_tokenizer(source_tok).identity if source_tok.is_file() else "bytes"):
            ids.update(hf.read_token_ids(directory))
    return ids


def run_params(workdir: str | Path, step: int | None = None) -> tuple[dict, ModelSpec, str | None, dict]:
    """``(params, model, tokenizer_file, token_ids)`` of the run ``workdir``'s checkpoint ``step`` (None: the
    newest): verified params and ``config.model`` (:func:`lpt.train.load_params`), the run's tokenizer.json (None
    for other tokenizers) and the special token ids of its export (:func:`token_ids`)."""
    params, cfg = load_params(workdir, step)
    tokenizer = cfg.data.tokenizer
    tokenizer_file = tokenizer if tokenizer.endswith(".json") else None
    if tokenizer != "bytes" and not Path(tokenizer).expanduser().is_file():
        raise ValueError(f"{workdir}: the run's data.tokenizer={tokenizer!r} does not exist any more")
    return params, cfg.model, tokenizer_file, token_ids(cfg)


def _check_out(out: str | Path, overwrite: bool = False, workdir: str | Path | None = None) -> Path:
    """``out`` (symlinks resolved) if an export may be written there: missing, an empty directory, or with
    ``overwrite`` a non-empty one, and neither the run ``workdir`` nor inside it nor holding it (replacing ``out``
    would delete the run); else a ValueError naming it."""
    path = Path(out).expanduser().resolve()
    relation = paths.overlap(path, workdir) if workdir is not None and str(workdir).strip() else None
    if relation is not None:
        raise ValueError(
            f"--out {str(out)!r} {relation} the run's --workdir {str(workdir)!r}; an export replaces --out as a "
            f"whole, so it must lie outside the run: give another directory"
        )
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; give a directory (created if missing)")
    if not overwrite and path.is_dir() and any(path.iterdir()):
        raise ValueError(f"--out {str(out)!r} is not empty; pass --overwrite to replace it with the export")
    return path


def write(
    out: str | Path,
    params: dict,
    model_cfg: ModelSpec,
    tokenizer_file: str | None,
    token_ids: dict | None = None,
    *,
    overwrite: bool = False,
    workdir: str | Path | None = None,
) -> Path:
    """Write ``params`` as a Hugging Face directory (:func:`lpt.models.hf.save_params` with ``tokenizer_file`` and
    ``token_ids``) to a new sibling of ``out``, then swap it in for ``out`` (see the module docstring); ``out`` as
    :func:`_check_out` allows it (outside the run ``workdir``, when given).

    Args:
      out: the export directory.
      params: an lpt pure dict of parameters for ``model_cfg``.
      model_cfg: the :class:`lpt.models.config.ModelSpec` (``config.model``) of ``params``.
      tokenizer_file: a tokenizer.json copied into the export, or None.
      token_ids: ``{bos_token_id, eos_token_id, pad_token_id}`` (:func:`token_ids`), or None.
      overwrite: replace a non-empty ``out``.
      workdir: the run directory, which ``out`` must lie outside; None: not checked.
    """
    out = _check_out(out, overwrite, workdir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    new, old = out.with_name(f".{out.name}.new-{tag}"), out.with_name(f".{out.name}.old-{tag}")
    try:
        hf.save_params(new, params, model_cfg, tokenizer_file=tokenizer_file, token_ids=token_ids)
        if out.exists():
            out.rename(old)
        new.rename(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)  # put the previous export back
        shutil.rmtree(new, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return out


def export(workdir: str | Path, out: str | Path, step: int | None = None, *, overwrite: bool = False) -> Path:
    """Write the run ``workdir``'s checkpoint ``step`` (None: the newest) to ``out`` as a Hugging Face directory
    (:func:`write`)."""
    _check_out(out, overwrite, workdir)  # before reading the checkpoint
    return write(out, *run_params(workdir, step), overwrite=overwrite, workdir=workdir)


def check(
    out: str | Path, params: dict, model_cfg: ModelSpec, *, rows: int = 2, max_len: int = 64
) -> tuple[float, float]:
    """``(max |lpt − transformers|, max |logit|)``: float32 logits of the lpt model of ``model_cfg`` with ``params``
    (a run's) against those of the Hugging Face directory ``out`` in transformers, on ``rows`` rows of random ids
    (seed 0) of ``min(max_seq_len, max_len)`` tokens. ValueError if transformers or torch is not installed.

    Args:
      out: the Hugging Face directory written by :func:`write`.
      params: the lpt pure dict of parameters written there.
      model_cfg: the :class:`lpt.models.config.ModelSpec` of ``params``.
      rows: rows of random ids.
      max_len: the most tokens per row.
    """
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ValueError(
            f"--check loads the export in transformers, which cannot be imported ({e}); pip install transformers "
            "torch, or lpt's dev extras"
        ) from None
    import jax
    from flax import nnx

    f32 = {"attention": {"impl": "xla", "stable": True}}  # float32 params and compute (the defaults)
    model = hf.model_from_params(model_cfg, f32, params)
    length = min(int(model.spec.max_seq_len), max_len)
    tokens = np.random.RandomState(0).randint(0, model.spec.vocab_size, (rows, length)).astype(np.int32)
    graphdef, state = nnx.split(model)
    ours = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens), np.float64)
    transformers.utils.logging.disable_progress_bar()  # its "Loading weights" bar: the check prints one result line
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        theirs = hf_model.eval()(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy().astype(np.float64)
    return float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())


def main(argv: list[str] | None = None) -> int:
    console.setup()
    parser = argparse.ArgumentParser(prog="python -m lpt.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workdir", required=True, help="the lpt run directory (holds checkpoints/), local or gs://BUCKET/PATH"
    )
    parser.add_argument("--out", required=True, help="the Hugging Face model directory to write")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (as a whole)")
    parser.add_argument("--check", action="store_true", help="compare logits with transformers' (needs transformers)")
    args = parser.parse_args(argv)
    try:
        _check_out(args.out, args.overwrite, args.workdir)  # before reading the checkpoint
        params, model_cfg, tokenizer_file, ids = run_params(args.workdir, args.step)  # read once, for both
        write(args.out, params, model_cfg, tokenizer_file, ids, overwrite=args.overwrite, workdir=args.workdir)
        print(f"wrote {args.out} (eos_token_id {ids['eos_token_id']})", flush=True)
        if not args.check:
            return 0
        diff, scale = check(args.out, params, model_cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok = diff <= 1e-4 * max(1.0, scale)
    print(
        f"check: max |lpt - transformers| = {diff:.3g} on float32 logits (max |logit| {scale:.3g}): "
        f"{'equal' if ok else 'NOT equal'} within 1e-4 * max(1, max |logit|)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
