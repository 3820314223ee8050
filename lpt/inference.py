"""Loading a trained model for inference, and the device mesh it runs on: shared by ``lpt.generate`` and ``lpt.eval``.

:func:`load_model` reads a run's checkpoint (its params, config and tokenizer; the model built with the run's
``precision`` section) or a Hugging Face directory;
:func:`inference_mesh` picks the mesh (the run's own when this machine has its devices, else FSDP over all of them);
:func:`model_arguments` starts a command line that names the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax

from lpt.data.tokenizer import ByteTokenizer, load_tokenizer
from lpt.models import from_pretrained
from lpt.models.hf import model_from_params
from lpt.train import config as config_lib
from lpt.train import load_params
from lpt.train import mesh as mesh_lib
from lpt.train.config import MeshConfig

DTYPES = ("float32", "bfloat16")  # the compute dtypes a loaded model may run in


def hf_tokenizer(hf, vocab_size: int) -> str:
    """The tokenizer of the Hugging Face directory ``hf``: its ``tokenizer.json``, else ``"bytes"`` (said on stderr)
    for a model of 256 ids; ValueError for any other vocabulary, which bytes would feed the wrong ids."""
    tok_file = Path(hf) / "tokenizer.json"
    if tok_file.is_file():
        return str(tok_file)
    if vocab_size != 256:
        raise ValueError(
            f"{hf} has no tokenizer.json and a vocabulary of {vocab_size} ids, not the 256 of bytes: put the model's "
            f"tokenizer.json there"
        )
    print(f"note: {hf} has no tokenizer.json; its 256 ids are read as bytes", file=sys.stderr)
    return "bytes"


def model_arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the arguments of :func:`load_model`: ``--workdir`` or ``--hf`` (one is required), ``--step``
    and ``--dtype``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="an lpt run directory (holds checkpoints/), local or gs://BUCKET/PATH")
    src.add_argument("--hf", help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--step", type=int, default=None, help="--workdir: checkpoint step (default: the newest)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="compute dtype (default: the run's)")
    return parser


def load_model(workdir=None, hf=None, *, step: int | None = None, dtype: str | None = None):
    """``(model, tokenizer, config)`` from a run (``workdir``; ``config`` is the run's) or a Hugging Face directory
    (``hf``; ``config`` is None). ``dtype`` (float32 | bfloat16): the compute dtype for a run (default its own), the
    ``param_dtype`` of :func:`lpt.models.from_pretrained` for ``hf`` (default float32)."""
    if (workdir is None) == (hf is None):
        raise ValueError("give exactly one of --workdir RUN and --hf PATH")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {list(DTYPES)}")
    if hf is not None:
        if step is not None:
            raise ValueError("--step applies to --workdir runs only")
        model, _ = from_pretrained(hf, param_dtype=dtype or "float32")
        tokenizer = hf_tokenizer(hf, model.spec.vocab_size)
        return model, ByteTokenizer() if tokenizer == "bytes" else load_tokenizer(tokenizer), None
    params, cfg = load_params(workdir, step)
    precision = cfg.precision if dtype is None else dataclasses.replace(cfg.precision, compute_dtype=dtype)
    model = model_from_params(cfg.model, precision, params)
    return model, load_tokenizer(cfg.data.tokenizer), cfg


def inference_mesh(cfg: config_lib.Config | None = None):
    """The device mesh for evaluating or sampling a model over all devices of this process: a run's own
    ``train.mesh`` (``cfg``, a run's config) when this machine has the devices it names, else (a run trained on
    more devices than there are here, or a Hugging Face model, ``cfg=None``) FSDP over every device, so the
    parameters are split across them; a run's own mesh that does not fit is said on stderr. The numbers do not
    depend on the mesh beyond float32 summation order. ValueError when the run's attention heads do not split over
    its tensor axis, or when jax runs several processes (the batches are built on one host)."""
    if jax.process_count() > 1:
        raise ValueError(
            f"evaluation and generation run in one process, not {jax.process_count()}; run them on one host (its "
            "devices form the mesh)"
        )
    fsdp = MeshConfig(data=1, fsdp=-1, tensor=1)
    if cfg is None:
        return mesh_lib.make_mesh(fsdp)
    try:
        mesh = mesh_lib.make_mesh(cfg.train.mesh)
    except ValueError:  # the run's mesh names more devices than this machine has
        sizes = cfg.train.mesh.to_dict()
        n = jax.device_count()
        print(
            f"note: the run's train.mesh {sizes} does not fit the {n} device(s) here; using FSDP over them",
            file=sys.stderr,
        )
        return mesh_lib.make_mesh(fsdp)
    config_lib.check_heads(cfg.model, mesh.shape["tensor"])
    return mesh
