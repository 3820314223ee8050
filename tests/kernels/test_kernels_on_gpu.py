"""Every Pallas kernel compiled for a real GPU (Triton; Mosaic GPU for the Hopper FP8 and attention variants) against
its XLA twin on the same GPU, at sizes where each kernel runs many programs. Skipped on a machine without a CUDA
device: the interpreted tests beside this file prove the numbers on any CPU; these prove that the compiled kernel
computes the same function.

Tolerances. The two programs multiply the same rounded operands and add the products in another order, on other
units: the kernels' dots run on tensor cores, XLA:GPU's through cuBLAS or its own emitters. Each comparison says
which error it allows:

* flash attention: O, dQ, dK, dV within 2^-10 of the largest |reference| and a relative Frobenius error under 1e-4
  (the f32 sums differ in order; P̃ is rounded to bf16 in both, and an f32 difference of one ulp in a logit flips
  about one in 2^15 of those roundings, each moving O by at most 2^-8·P·|v|). A wrong mask, block index or
  rescaling is O(1). lse: :func:`_lse_close`.
* FP8 GEMM: within 2·γ_n(u)·Σ|terms| with n = 128 + K/128 + 2 and u = 2^-13, not f32's 2^-24: Hopper's FP8
  tensor cores keep about 14 bits while they accumulate inside one K-chunk (DeepSeek-AI, "DeepSeek-V3 Technical
  Report", §3.3.2), which is why the kernel promotes every 128 terms. The measured error is printed.
* adamw_kahan: bit for bit against the XLA twin, as on CPU (the kernel's elementwise math is written so that no
  compiler may contract or reassociate it); a failure prints how many elements differ and by how many ulps.

Run with ``-s`` to see the measured errors.
"""

import dataclasses
import faulthandler
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_bounds import assert_within, gamma
from test_adamw_kahan import HP, _leaf, kahan_adamw_steps
from test_adamw_kahan_8bit import random_state8
from test_fp8_blockwise_matmul import _operands

from lpt.attention import dot_product_attention
from lpt.fp8 import blockwise, blockwise_dot
from lpt.kernels.adamw_kahan import StepOptions
from lpt.kernels.adamw_kahan import math as K
from lpt.kernels.adamw_kahan.kernel import adamw_kahan
from lpt.kernels.flash_attention import kernel as fk
from lpt.kernels.flash_attention import math as fm
from lpt.kernels.flash_attention import reference as fr
from lpt.kernels.flash_attention.options import FlashOptions
from lpt.kernels.flash_attention.tiles import tiles
from lpt.kernels.fp8_blockwise_matmul.kernel import fp8_blockwise_matmul, fp8_blockwise_matmul_reference
from lpt.kernels.fp8_blockwise_matmul.mosaic_gpu import fp8_blockwise_matmul_mgpu
from lpt.optim import moments8 as M8

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (compiled kernels)")


def _hopper() -> bool:
    return jax.default_backend() == "gpu" and float(getattr(jax.devices()[0], "compute_capability", "0")) >= 9.0


def _close(x, ref, what):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    scale = np.max(np.abs(ref))
    err = np.abs(x - ref)
    rel = np.linalg.norm(x - ref) / np.linalg.norm(ref)
    print(
        f"{what}: max|x-ref|/max|ref| = {err.max() / scale:.2e} ({err.max() / scale / 2**-24:.0f} f32 ulps), "
        f"relative Frobenius {rel:.2e}"
    )
    assert scale > 0 and np.all(np.isfinite(x))
    assert err.max() <= 2.0**-10 * scale, what
    assert rel < 1e-4, what


def _lse_close(lse, lse_r, policy, what):
    """lse of a kernel vs its twin's. Where ℓ sums f32 weights under the max shift (the standard policy) lse is a
    smooth function of the logits: every row within 2^-16 relative. Under the stable policy ℓ sums the bf16-rounded
    weights P̃ = round(exp(s − c)) and the shift c depends on a count of near-maximal logits, so where the kernel's
    logits differ from the twin's by f32 round-off a weight can round to the neighbouring bf16 value, or a row count
    one more near-tie. Each P̃ is still within a bf16 unit roundoff u = 2^-8 of the same exact weight in both, so
    ℓ·e^c differs by at most a factor (1 + u)/(1 − u) and lse by at most 2u/(1 − u) < 2^-7 + 2^-14: every row within
    that, and at least 99% of the rows within 2^-16 relative (a wrong mask, shift or block moves most rows; the
    flips are rare: 28 of 16,384 rows beyond 1e-5 in the Mosaic GPU interpreter at D = 128, one of them 1.8e-3)."""
    lse, lse_r = np.asarray(lse, np.float64), np.asarray(lse_r, np.float64)
    seen = np.isfinite(lse_r)
    assert (lse[~seen] == lse_r[~seen]).all(), what  # rows without a key: −inf in both
    lse, lse_r = lse[seen], lse_r[seen]
    tight = np.abs(lse - lse_r) <= 2.0**-16 * np.abs(lse_r)
    print(f"{what} lse: max |Δ| = {np.max(np.abs(lse - lse_r)):.2e}, {np.sum(~tight)} of {lse.size} rows beyond 2^-16")
    if policy.denominator == "f32" and policy.shift == "max":
        assert tight.all(), what
    else:
        assert np.all(np.abs(lse - lse_r) <= 2.0**-7 + 2.0**-14 + 2.0**-16 * np.abs(lse_r)), what
        assert np.mean(tight) >= 0.99, what


def _attention_inputs(b, h, hkv, t, d, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, h, t, d)).astype(jnp.bfloat16)  # f32 -> bf16
    k = jax.random.normal(ks[1], (b, hkv, t, d)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, hkv, t, d)).astype(jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, h, t, d)).astype(jnp.bfloat16)
    q_seg = jnp.zeros((b, t), jnp.int32).at[-1, t // 3 :].set(1)  # the last row: two packed sequences
    kv_seg = q_seg.at[0, 7].set(-1)  # row 0: key 7 is padding
    return q, k, v, do, q_seg, kv_seg


def _forward_close(o, lse, o_r, lse_r, policy, case):
    """A kernel's forward (O, lse) vs the twin's: O by :func:`_close` (f32 O) or within that plus one bf16 rounding
    (O rounded to bf16 in the kernel: the standard policy), lse by :func:`_lse_close`."""
    if o.dtype == jnp.float32:
        _close(o, o_r, f"o {case}")
    else:  # the standard policy rounds O to bf16 in the kernel: the f32 differences plus one bf16 rounding
        err = np.abs(np.asarray(o, np.float64) - np.asarray(o_r, np.float64))
        bound = 2.0**-10 * float(jnp.max(jnp.abs(o_r))) + 2.0**-8 * np.abs(np.asarray(o_r, np.float64))
        print(f"o {case}: max |o - twin| / bound = {np.max(err / bound):.2f}")
        assert np.all(err <= bound)
    _lse_close(lse, lse_r, policy, case)


def _kernels_vs_twin(forward, backward, bk, d, causal, window, name, label):
    """``forward(q, k, v, q_seg, kv_seg, options) -> (o, lse)`` and ``backward(q, k, v, q_seg, kv_seg, lse, do,
    delta, options) -> (dq, dk, dv)`` (``options``: the twin's :class:`FlashOptions`, which each kernel adapts to its
    blocks) against the blockwise XLA twin with key blocks of ``bk``, GQA 4:1, T = 1024, with packed sequences and a
    padded key."""
    policy = fm.default_policy() if name == "default" else fm.standard_policy()
    q, k, v, do, q_seg, kv_seg = _attention_inputs(2, 8, 2, 1024, d)
    options = FlashOptions(causal=causal, scale=d**-0.5, policy=policy, window=window, block_k=bk)
    case = f"{label} d={d} {name} causal={causal} window={window}"
    o, lse = jax.jit(lambda: forward(q, k, v, q_seg, kv_seg, options))()
    o_r, lse_r = jax.jit(lambda: fr.reference_forward(q, k, v, q_seg, kv_seg, options=options))()
    _forward_close(o, lse, o_r, lse_r, policy, case)
    delta = jnp.sum(do.astype(jnp.float32) * o_r, axis=-1)  # bf16 -> f32 (exact products)
    grads = jax.jit(lambda: backward(q, k, v, q_seg, kv_seg, lse_r, do, delta, options))()
    refs = jax.jit(lambda: fr.reference_backward(q, k, v, q_seg, kv_seg, lse_r, do, delta, options=options))()
    for what, g, g_r in zip(("dq", "dk", "dv"), grads, refs, strict=True):
        _close(g, g_r, f"{what} {case}")


def _api_vs_xla(impl: str, d: int, seed: int, **options):
    """``dot_product_attention(impl=impl, **options)`` vs ``impl="xla"``: forward and the three gradients through
    ``jax.vjp``, [B, T, H, D] layout, T = 2048, causal, GQA 4:1; bf16 outputs, each within a bf16 rounding of the
    other on top of the f32 differences."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (2, 2048, 8, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 2048, 2, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 2048, 2, d), jnp.bfloat16)
    do = jax.random.normal(ks[3], (2, 2048, 8, d), jnp.bfloat16)

    @functools.partial(jax.jit, static_argnames="impl")
    def run(q, k, v, impl):
        attend = lambda q, k, v: dot_product_attention(q, k, v, impl=impl, causal=True, **options)
        o, vjp = jax.vjp(attend, q, k, v)
        return (o, *vjp(do))

    for what, a, b in zip(("o", "dq", "dk", "dv"), run(q, k, v, impl), run(q, k, v, "xla"), strict=True):
        x, r = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(x - r)) / np.max(np.abs(r))
        print(f"api {what}: max|{impl}-xla|/max|xla| = {err:.2e}")
        assert err <= 2.0**-7, what
        assert np.linalg.norm(x - r) / np.linalg.norm(r) < 4e-3, what


ATTENTION_CASES = [
    pytest.mark.parametrize("d", [64, 128]),
    pytest.mark.parametrize("causal,window", [(True, 0), (False, 0), (True, 256)], ids=["causal", "full", "window"]),
    pytest.mark.parametrize("name", ["default", "standard"]),
]


def _cases(f):
    for mark in reversed(ATTENTION_CASES):
        f = mark(f)
    return f


@_cases
def test_flash_attention_triton_equals_twin(d, causal, window, name):
    """The Triton forward, dQ and dK/dV kernels (blocks 128 x 128) vs the twin with the kernel's key-block size."""
    blocks = lambda options: dataclasses.replace(options, block_q=128, block_k=128)
    _, bk = tiles("triton", 1024, 1024, d, 128, 128)
    forward = lambda *a: fk.forward(*a[:5], options=blocks(a[5]))
    backward = lambda *a: fk.backward(*a[:8], options=blocks(a[8]))
    _kernels_vs_twin(forward, backward, bk, d, causal, window, name, "triton")


def test_attention_api_pallas_equals_xla_with_grads():
    """The user-facing ``dot_product_attention(impl="pallas")`` vs ``impl="xla"`` on the GPU, D = 64."""
    _api_vs_xla("pallas", 64, seed=1)


@_cases
def test_flash_attention_mosaic_gpu_equals_twin(d, causal, window, name):
    """The Mosaic GPU (Hopper, wgmma) forward, dQ and dK/dV kernels vs the twin with the kernel's key-block size; the
    tolerances of the Triton test."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    from lpt.kernels.flash_attention import mosaic_gpu as mg

    bk = mg.BLOCK_KS[0]
    compiled = lambda options: dataclasses.replace(options, interpret=False)
    forward = lambda *a: mg.forward(*a[:5], options=compiled(a[5]))
    backward = lambda *a: mg.backward(*a[:8], options=compiled(a[8]))
    _kernels_vs_twin(forward, backward, bk, d, causal, window, name, "mgpu")


@_cases
def test_flash_attention_mosaic_gpu_ws_forward_equals_twin(d, causal, window, name):
    """The warp-specialized Mosaic GPU forward (a TMA producer and two consumer warpgroups; no segment ids) vs the twin
    with one segment, GQA 4:1, T = 1024, block_k = 64 (stable) or 128 (standard, O in bf16): the tolerances of the
    forward above. Prints whether it equals the single-warpgroup forward bit for bit (the same per-block code).

    The kernel has not run on a GPU before; the Mosaic GPU interpreter hung on some window cases with GQA (cause
    unknown). A case still running after 45 s ends its process with the stacks printed: pytest-xdist reports it as a
    crashed test and goes on with a new worker, so a deadlock costs this case, not the other tests."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    faulthandler.dump_traceback_later(45, exit=True)
    try:
        _ws_forward_case(d, causal, window, name)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _ws_forward_case(d, causal, window, name):
    from lpt.kernels.flash_attention import mosaic_gpu as mg
    from lpt.kernels.flash_attention import mosaic_gpu_ws as ws

    policy = fm.default_policy() if name == "default" else fm.standard_policy()
    q, k, v, *_ = _attention_inputs(2, 8, 2, 1024, d)
    segs = (jnp.zeros((2, 1024), jnp.int32),) * 2  # one segment
    block_k = 64 if name == "default" else 128
    options = FlashOptions(causal=causal, scale=d**-0.5, policy=policy, window=window, block_k=block_k, interpret=False)
    case = f"mgpu-ws d={d} {name} causal={causal} window={window}"
    o, lse = jax.jit(lambda: ws.forward(q, k, v, options=options))()
    o_r, lse_r = jax.jit(lambda: fr.reference_forward(q, k, v, *segs, options=options))()
    _forward_close(o, lse, o_r, lse_r, policy, case)
    o_1, lse_1 = jax.jit(lambda: mg.forward(q, k, v, options=options))()
    same = bool(jnp.array_equal(o, o_1) & jnp.array_equal(lse, lse_1))
    print(f"{case}: equal to the single-warpgroup forward bit for bit: {same}")


def test_attention_api_mosaic_gpu_equals_xla_with_grads():
    """``dot_product_attention(impl="mosaic_gpu")`` vs ``impl="xla"`` on a Hopper GPU, D = 128: the tolerance of the
    Pallas API test."""
    if not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    _api_vs_xla("mosaic_gpu", 128, seed=2)


@pytest.mark.parametrize("window", [0, 256])
def test_attention_api_cudnn_equals_xla_with_grads(window):
    """``dot_product_attention(impl="cudnn")``, what ``"auto"`` runs on a GPU for the standard policy, vs the twin
    with the standard policy, D = 128, causal and a window of 256 keys (cuDNN's ``local_window_size``): the
    tolerance of the Pallas API test."""
    _api_vs_xla("cudnn", 128, seed=3, stable=False, sliding_window=window)


def _fp8_magnitude(args):
    a, sa, b, sb = (np.asarray(x, np.float64) for x in args)  # fp8 / f32 -> f64, exact
    k = a.shape[1]
    return sum(
        np.abs(a[:, c : c + 128]) @ np.abs(b[c : c + 128]) * sa[:, i, None] * sb[i]
        for i, c in enumerate(range(0, k, 128))
    )


def _fp8_check(out, args, what):
    ref = jax.jit(fp8_blockwise_matmul_reference)(*args)
    mag = _fp8_magnitude(args)
    k = args[0].shape[1]
    err = np.abs(np.asarray(out, np.float64) - np.asarray(ref, np.float64))
    print(f"{what}: max |kernel - twin| / Σ|terms| = {np.max(err / mag):.2e} (2^-24 = {2.0**-24:.1e})")
    assert_within(out, ref, 2 * gamma(128 + k // 128 + 2, u=2.0**-13) * mag, what)


@pytest.mark.parametrize(
    "m,k,n,da,db",
    [
        (1000, 2048, 1024, jnp.float8_e4m3fn, jnp.float8_e4m3fn),  # M not a multiple of the tile
        (512, 1024, 768, jnp.float8_e5m2, jnp.float8_e4m3fn),  # mixed formats (the backward GEMMs)
    ],
)
def test_fp8_blockwise_triton_equals_twin(m, k, n, da, db):
    args = _operands(m, k, n, da, db)
    _fp8_check(jax.jit(fp8_blockwise_matmul)(*args), args, f"triton {m}x{k}x{n} {jnp.dtype(da).name}")


@pytest.mark.skipif(not _hopper(), reason="wgmma needs compute capability 9.0")
@pytest.mark.parametrize("da", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3", "e5m2-x-e4m3"])
def test_fp8_blockwise_mosaic_gpu_equals_twin(da):
    if not blockwise.wgmma_takes(da, jnp.float8_e4m3fn):
        pytest.skip(f"jax {jax.__version__}'s wgmma cannot mix FP8 formats")
    args = _operands(1000, 2048, 1024, da, jnp.float8_e4m3fn)
    _fp8_check(jax.jit(fp8_blockwise_matmul_mgpu)(*args), args, f"mosaic_gpu 1000x2048x1024 {jnp.dtype(da).name}")


@pytest.mark.parametrize("impl", ["pallas", "mosaic_gpu"])
def test_blockwise_dot_kernels_equal_xla_with_grads(impl):
    """``blockwise_dot(impl=...)`` vs ``impl="xla"``: forward, dX and dW, with the recipe's e5m2 output gradients
    (the mosaic_gpu path: e4m3 gradients where jax's wgmma cannot mix formats, jax 0.10)."""
    if impl == "mosaic_gpu" and not _hopper():
        pytest.skip("wgmma needs compute capability 9.0")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1024, 2048)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2048, 1024)) / 32, jnp.float32)
    g = jnp.asarray(rng.standard_normal((1024, 1024)), jnp.float32)
    mix = blockwise.wgmma_takes(jnp.float8_e4m3fn, jnp.float8_e5m2)
    grad_dtype = jnp.float8_e4m3fn if impl == "mosaic_gpu" and not mix else jnp.float8_e5m2

    @functools.partial(jax.jit, static_argnames="impl")
    def run(x, w, impl):
        y, vjp = jax.vjp(lambda x, w: blockwise_dot(x, w, impl=impl, grad_dtype=grad_dtype), x, w)
        return (y, *vjp(g))

    for what, a, b in zip(("y", "dx", "dw"), run(x, w, impl), run(x, w, "xla"), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        print(f"blockwise_dot {impl} {what}: relative Frobenius vs xla {rel:.2e}")
        # about 14 accumulation bits inside each 128-term chunk: a few 2^-14 relative, far from a wrong block (~1)
        assert rel < 2.0**-10, what


def _bits_equal(a, b, what):
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    ia, ib = a.view(bits).astype(np.int64), b.view(bits).astype(np.int64)
    bad = int(np.sum(ia != ib))
    print(
        f"{what}: {bad} of {a.size} differ" + (f", at most {np.max(np.abs(ia - ib))} in the last bits" if bad else "")
    )
    assert bad == 0, what


@pytest.mark.parametrize("shape", [(1000, 4099), (1024, 4096)], ids=["flattened", "grid2d"])
@pytest.mark.parametrize("stochastic", [False, True])
def test_adamw_kahan_equals_twin(stochastic, shape):
    """(1000, 4099): flattened into rows of 128, the last block padded; (1024, 4096): tiled in place on a 2-D grid.
    The kernel the GPU runs: Mosaic GPU on Hopper, Triton on other GPUs (Blackwell included)."""
    g, p, c, mv = _leaf(shape, seed=0)
    scalars = jnp.asarray([1 / 0.19, 1 / 0.002, -1e-2, 0.0], jnp.float32)
    words = jnp.asarray([1, 2], jnp.uint32)
    options = StepOptions(**HP, stochastic=stochastic)
    kernel = jax.jit(functools.partial(adamw_kahan, options=options))(g, p, c, mv, scalars, words)
    twin = jax.jit(functools.partial(K.adamw_kahan_reference, options=options))(g, p, c, mv, scalars, words)
    for what, a, b in zip(("p", "c", "mv"), kernel, twin, strict=True):
        _bits_equal(a, b, f"adamw_kahan {shape} stochastic={stochastic} {what}")
    assert np.mean(np.asarray(kernel[0]) != np.asarray(p)) > 0.5


@pytest.mark.parametrize("spec", sorted(M8.MOMENT8))
def test_adamw_kahan_8bit_triton_equals_twin(spec):
    g, p, c, codes, scales, scalars, words, moments8 = random_state8((512, 2048), spec, seed=2)
    options = StepOptions(**HP, stochastic=True, moments8=moments8)
    kernel = jax.jit(lambda *a: adamw_kahan(*a, scales, options=options))(g, p, c, codes, scalars, words)
    twin = jax.jit(lambda *a: K.adamw_kahan_reference(*a, scales, options=options))(g, p, c, codes, scalars, words)
    for what, a, b in zip(("p", "c", "codes", "scales"), kernel, twin, strict=True):
        _bits_equal(a, b, f"adamw_kahan 8-bit {spec} {what}")


def test_kahan_adamw_pallas_equals_xla_over_steps():
    """Five steps of ``kahan_adamw(impl="pallas")`` and ``impl="xla"`` on one GPU: the same params and state."""
    rng = np.random.default_rng(1)
    p = {"w": jnp.asarray(rng.standard_normal((1024, 1536)), jnp.bfloat16), "b": jnp.zeros(1536, jnp.float32)}
    out = {impl: kahan_adamw_steps(impl, p, 5) for impl in ("xla", "pallas")}
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(out["xla"]), jax.tree.leaves(out["pallas"]), strict=True
    ):
        _bits_equal(a, b, f"kahan_adamw 5 steps {jax.tree_util.keystr(path)}")
