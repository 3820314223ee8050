"""Block-scale health (lpt.fp8.microscaling.diagnostics) on planted blocks: exact saturated / underflow / clipped
counts for MXFP8 and NVFP4, the tie rule of the clip, the share of clipped MX blocks on log-uniform maxima, the
operand layouts against block_scaled_dot's forward GEMM, and the block formats' probe of the diagnostics pass
(lpt.models.matmul_formats)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED

from lpt.fp8 import block_scaled_dot, mx_dequantize, mx_quantize, nvfp4_dequantize, nvfp4_quantize
from lpt.fp8.microscaling import block_scale_health, gemm_block_health, operand_layout, quantize_dequantize
from lpt.models import matmul_formats, probes


def _blocks(amaxes, size: int, rng) -> np.ndarray:
    """One row of blocks of ``size`` elements: each block's entries uniform in (-amax/2, amax/2) with the block's
    maximum ``amax`` at a random position (a non-finite ``amax`` is put there alone; 0: an all-zero block)."""
    row = []
    for a in amaxes:
        b = np.zeros(size, np.float32) if a == 0 else (rng.uniform(-0.5, 0.5, size) * (a if np.isfinite(a) else 1))
        b[rng.integers(size)] = a
        row.append(b.astype(np.float32))
    return np.concatenate(row)[None]


def _counts(h):
    return int(h.saturated), int(h.underflow), int(h.clipped), int(h.blocks)


def test_mxfp8_planted_blocks():
    # amax / 2^e with e = floor(log2 amax) - 8: 1.0 -> 256; 1.875 -> 480 (> 464: clipped to 448); 14.5 -> 464 (the
    # midpoint between 448 and 480: ties to even 448, not clipped); 1.84375 -> 472 (clipped); 2^-121 -> e = -129 <
    # -127 (underflow); inf, nan (saturated); zeros (nothing)
    amaxes = [1.0, 1.875, 2.0**-121, np.inf, np.nan, 0.0, 14.5, 1.84375]
    x = _blocks(amaxes, 32, np.random.default_rng(0))
    assert _counts(block_scale_health(x, "mxfp8")) == (2, 1, 2, 8)
    shares = block_scale_health(x, "mxfp8").shares()
    assert {k: float(v) for k, v in shares.items()} == {"saturated": 0.25, "underflow": 0.125, "clipped": 0.25}
    # the quantizer agrees: the clipped blocks' maxima come back as 448 · 2^e (a power-of-two scale: exact)
    codes, scales = mx_quantize(x, jnp.float8_e4m3fn)
    back = np.asarray(mx_dequantize(codes, scales)).reshape(8, 32)
    assert np.max(np.abs(back[1])) == np.max(np.abs(back[7])) == 448 / 256
    # jitted, and along axis 0 (a weight's layout): the same counts
    assert _counts(jax.jit(lambda v: block_scale_health(v, "mxfp8", axis=0))(x.reshape(8, 32).T)) == (2, 1, 2, 8)


def test_nvfp4_planted_blocks():
    # tensor amax 2688 = 6 · 448, so S_enc = 1 and a block's unrounded scale is amax / 6: 2688 -> 448; 1 -> 1/6;
    # 0.05 -> 0.0083 (e4m3 subnormal 4 · 2^-9: underflow); 6e-4 -> 1e-4 (rounds to 0: underflow, flushed);
    # 0.01640625 -> 1.4 · 2^-9 (rounds to 2^-9: underflow, and amax / scale = 8.4 >= 7 clips at 6); zeros
    finite = [2688.0, 1.0, 0.05, 6e-4, 0.01640625, 0.0]
    x = _blocks(finite, 16, np.random.default_rng(1))
    assert _counts(block_scale_health(x, "nvfp4")) == (0, 3, 1, 6)
    codes, bs, ts = nvfp4_quantize(x)
    back = np.asarray(nvfp4_dequantize(codes, bs, ts)).reshape(6, 16)
    # the clipped block's maximum; exact: code · block scale · tensor scale are products only, IEEE on any CPU
    assert np.max(np.abs(back[4])) == 6 * 2.0**-9 < 0.01640625
    assert np.all(back[3] == 0)  # the flushed block
    # an inf in the tensor sets S_enc = 1 (TransformerEngine's rule): a block of amax 3000 needs 500 > 448
    x2 = _blocks([*finite, 3000.0, np.inf], 16, np.random.default_rng(1))
    assert _counts(block_scale_health(x2, "nvfp4")) == (2, 3, 1, 8)


def test_nvfp4_weight_tiles_and_shares_bounded():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(32, 48)).astype(np.float32)
    w[16:, 32:] *= 1e-6  # one 16x16 tile 1e-6 of the tensor's amax: its scale underflows
    h = block_scale_health(w, "nvfp4", **operand_layout("nvfp4", "w"))
    assert _counts(h) == (0, 1, 0, 6)
    hx = block_scale_health(rng.normal(size=(64, 48)).astype(np.float32), "nvfp4")
    assert _counts(hx)[:3] == (0, 0, 0) and hx.blocks == 64 * 3


def test_mx_clipped_share_on_log_uniform_maxima():
    """The OCP floor rule leaves amax / scale in [256, 512); with log-uniform mantissas log2(512 / 464) = 14.2%
    of the blocks lie above 464 and clip (8192 blocks: 3.9e-3 standard deviation)."""
    rng = np.random.default_rng(3)
    amaxes = 2.0 ** rng.uniform(-20, 20, 8192)
    x = (amaxes[:, None] * rng.uniform(-1, 1, (8192, 32))).astype(np.float32)
    x[:, 0] = amaxes.astype(np.float32)
    share = float(block_scale_health(x, "mxfp8").shares()["clipped"])
    assert share == pytest.approx(np.log2(512 / 464), abs=0.02)
    # NVFP4 on maxima within 2^10 of each other: every block scale is a normal e4m3, which never clips e2m1
    h = block_scale_health(x[np.abs(np.log2(amaxes)) < 5], "nvfp4")
    assert _counts(h)[:3] == (0, 0, 0) and h.blocks > 1000


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_layouts_match_block_scaled_dot(recipe):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(48, 64)).astype(np.float32)
    w = rng.normal(size=(64, 32)).astype(np.float32)

    # one program (the planted-block tests above run these functions eagerly), LLVM's optimizations off: the checks
    # are an error bound far above f32 round-off and integer block counts
    @functools.partial(jax.jit, compiler_options=UNOPTIMIZED)
    def layouts(x, w):
        xq = quantize_dequantize(x, recipe, **operand_layout(recipe, "x"))
        wq = quantize_dequantize(w, recipe, **operand_layout(recipe, "w"))
        hx, hw = gemm_block_health(x.reshape(6, 8, 64), w, recipe)
        return xq, wq, block_scaled_dot(x, w, recipe, impl="xla"), hx.blocks, hw.blocks

    xq, wq, y, hx_blocks, hw_blocks = layouts(x, w)
    y = np.asarray(y, np.float64)
    ref = np.asarray(xq, np.float64) @ np.asarray(wq, np.float64)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.max(np.abs(ref)))
    assert np.max(np.abs(np.asarray(xq) - x)) > 0  # quantized, not passed through
    want = (48 * 64 // 32, 64 * 32 // 32) if recipe == "mxfp8" else (48 * 4, 8)
    assert (int(hx_blocks), int(hw_blocks)) == want


def test_errors():
    x = np.ones((2, 32), np.float32)
    with pytest.raises(ValueError, match="recipe must be one of"):
        block_scale_health(x, "mxfp4")
    with pytest.raises(ValueError, match="operand must be one of"):
        operand_layout("nvfp4", "dy")
    with pytest.raises(ValueError, match="multiple of the block length"):
        block_scale_health(np.ones((2, 24), np.float32), "nvfp4")


def test_probe_pools_block_health_and_snr():
    rng = np.random.default_rng(5)
    x = _blocks([1.0, 1.875, 2.0**-121, 1.0], 32, rng)  # 4 MX blocks: 1 clipped, 1 underflow
    x = np.concatenate([x, _blocks([1.0, 0.5, 2.0, 0.25], 32, rng)])  # + 4 plain blocks
    w = rng.normal(size=(128, 64)).astype(np.float32)

    # LLVM's optimizations off: the checks are ratios of integer block counts (exact) and SNRs to within 0.01 dB
    @functools.partial(jax.jit, compiler_options=UNOPTIMIZED)
    def run(x, w):
        with probes.collecting() as c:
            for recipe, kind in (("mxfp8", "up"), ("mxfp8", "up"), ("nvfp4", "down")):
                y = block_scaled_dot(x, w, recipe, impl="xla")
                matmul_formats.get(recipe).probe(kind, x, w, y)
        return c.summary(), y

    stats, y = run(x, w)
    s = {k: float(v) for k, v in stats.items()}
    # pooled: 2/16 (ratios of integer block counts: exact)
    assert s["mxfp8/up/x_clipped_frac"] == 1 / 8 and s["mxfp8/up/x_scale_underflow_frac"] == 1 / 8
    assert s["mxfp8/up/x_scale_saturated_frac"] == 0.0
    assert s["mxfp8/up/w_scale_underflow_frac"] == 0.0 and 0 <= s["mxfp8/up/w_clipped_frac"] <= 1
    assert set(s) >= {"nvfp4/down/x_scale_underflow_frac", "nvfp4/down/w_clipped_frac", "fp8/down/snr_db"}
    ref = x.astype(np.float64) @ w.astype(np.float64)
    snr = 10 * np.log10(np.sum(ref**2) / np.sum((np.asarray(y, np.float64) - ref) ** 2))
    assert s["fp8/down/snr_db"] == pytest.approx(snr, abs=0.01)
    assert s["fp8/up/snr_db"] > s["fp8/down/snr_db"] + 6  # MXFP8's e4m3 keeps 2 more significand bits than e2m1
