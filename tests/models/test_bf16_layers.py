"""``precision.bf16_layers``: chosen blocks run their low-precision matmuls in bf16 (NVIDIA's NVFP4 recipe keeps a
few blocks in BF16), by index, negative from the end, with scanned and unrolled blocks.

With every block chosen the NVFP4 model computes what the bf16-matmul model computes, logits and gradients (the
same einsums; a ``lax.cond`` in the scan is another XLA program, so within f32 round-off); with none chosen it is the
NVFP4 model; with the last block chosen it differs from both."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_run import tiny_config

import lpt.models as M
from lpt.train import config as config_lib

CFG = dict(kind="llama", vocab_size=256, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16)
NVFP4 = {"matmul": {k: "nvfp4" for k in ("qkv", "out", "up", "down")}, "nvfp4_hadamard": False}
NVFP4["nvfp4_stochastic_grads"] = False  # no step key here: nearest rounding everywhere
TOKENS = np.array([[3, 17, 200, 5, 9, 9, 1, 0], [255, 4, 8, 15, 16, 23, 42, 7]], np.int32)


def _run(prec: dict, scan: bool, grads: bool = False):
    """(logits, grads of the logits' sum or None) of the model with ``prec``, the same weights for every ``prec``;
    with ``grads`` both come from one program (the backward pass runs the forward anyway)."""
    model = M.build_model({**CFG, "scan_layers": scan}, prec, rngs=nnx.Rngs(0))
    g, st = nnx.split(model)
    f = lambda s: nnx.merge(g, s)(TOKENS).astype(jnp.float32)
    if not grads:
        return np.asarray(jax.jit(f)(st)), None

    def loss(s):
        y = f(s)
        return y.sum(), y

    (_, logits), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(st)
    return np.asarray(logits), [np.asarray(x) for x in jax.tree.leaves(grad)]


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "loop"])
def test_chosen_blocks_run_in_bf16(scan):
    bf16, bf16_grads = _run({}, scan, grads=True)
    nv, _ = _run(NVFP4, scan)
    every, every_grads = _run({**NVFP4, "bf16_layers": ("0", "1", "-1")}, scan, grads=True)
    last, _ = _run({**NVFP4, "bf16_layers": ("-1",)}, scan)
    assert _rel(nv, bf16) > 1e-2  # NVFP4's error: 1 mantissa bit
    assert _rel(every, bf16) < 1e-6  # every block chosen: the bf16 model (f32 round-off of another program)
    for a, b in zip(every_grads, bf16_grads, strict=True):
        assert _rel(a, b) < 1e-5 if np.any(b) else not np.any(a)
    assert 1e-4 < _rel(last, bf16) and 1e-4 < _rel(last, nv)  # one block of three in bf16: neither model


def test_bad_bf16_layers_are_one_line_errors():
    base = {"precision.matmul.qkv": "nvfp4", "model.d_model": "32", "model.n_layers": "2"}
    with pytest.raises(ValueError, match=r"bf16_layers entry '2' is not a block index of a 2-block model.*\[-2, 1\]"):
        config_lib.build(tiny_config({**base, "precision.bf16_layers": "0,2"}))
    with pytest.raises(ValueError, match=r"bf16_layers entry 'last'"):
        config_lib.build(tiny_config({**base, "precision.bf16_layers": "last"}))
    with pytest.raises(ValueError, match=r"bf16_layers=-1 keeps blocks in bf16, but no block matmul is low-precision"):
        config_lib.build(tiny_config({"precision.bf16_layers": "-1"}))
    config_lib.build(tiny_config({**base, "precision.bf16_layers": "-2,1"}))  # both blocks, from either end
