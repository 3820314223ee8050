"""MX (OCP Microscaling v1.0) and NVFP4 quantizers against an independent numpy reference, bit for bit.

The references below are written from the rules (docs/fp8.md, "Block formats"), with numpy float64 (MX) or numpy
float32 (NVFP4: the recipe is defined as f32 arithmetic) and ml_dtypes casts; they do not call lpt. numpy keeps f32
subnormals, so every agreement below also shows that the jitted XLA code never loses one to flush-to-zero.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED

from lpt.fp8 import mx_dequantize, mx_quantize, nvfp4_dequantize, nvfp4_quantize

E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
E2M1 = ml_dtypes.float4_e2m1fn
# element format -> (emax_elem, max normal, explicit mantissa bits, exponent of the smallest normal): the spec's table
MX_ELEMS = {
    "float8_e4m3fn": (E4M3, 8, 448.0, 3, -6),
    "float8_e5m2": (E5M2, 15, 57344.0, 2, -14),
    "float4_e2m1fn": (E2M1, 2, 6.0, 1, 0),
}
ELEM_NAMES = list(MX_ELEMS)
F32_TINY = np.float32(2.0**-126)


def _jit(f):
    """``jax.jit`` with LLVM's optimizations off: the quantizers and dequantizers are products, quotients, roundings
    and bit operations, each correctly rounded where it is written (no sums), so their bits are the same under any
    compile, as the agreement with numpy shows."""
    return jax.jit(f, compiler_options=UNOPTIMIZED)


# ---------------------------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------------------------


def _blocks(x, axis, block):
    """Move ``axis`` last and split it into (n/block, block)."""
    xm = np.moveaxis(np.asarray(x), axis, -1)
    return xm.reshape(xm.shape[:-1] + (xm.shape[-1] // block, block))


def _unblocks(xb, axis):
    xm = xb.reshape(xb.shape[:-2] + (xb.shape[-2] * xb.shape[-1],))
    return np.moveaxis(xm, -1, axis)


def _tiles2d(x, r, c):
    m, n = x.shape[-2:]
    return np.asarray(x).reshape(x.shape[:-2] + (m // r, r, n // c, c))


def ref_mx_blocks(xb, name, reduce_axes):
    """OCP MX v1.0 on blocks of ``xb`` (reduced over ``reduce_axes``, kept as size-1 dims): (codes, scale bytes)."""
    dt, emax, fmax, _, _ = MX_ELEMS[name]
    x64 = np.asarray(xb, np.float64)
    with np.errstate(invalid="ignore"):
        amax = np.max(np.abs(x64), axis=reduce_axes, keepdims=True)  # NaN propagates
    finite = np.isfinite(amax)
    safe = np.where(finite & (amax > 0), amax, 1.0)
    _, ex = np.frexp(safe)  # safe = m · 2^ex, m in [0.5, 1): floor(log2 safe) = ex - 1, exactly
    e = np.where(amax > 0, ex - 1 - emax, -127)  # all-zero block: the smallest e8m0 scale
    e = np.clip(e, -127, 127)
    e = np.where(finite, e, 0)
    y = np.ldexp(x64, -e)  # x / 2^e, exact in f64
    with np.errstate(invalid="ignore"):
        codes = np.clip(y, -fmax, fmax).astype(dt)  # f64 -> element format, RNE
    nan_code = np.array(np.nan).astype(dt) if name != "float4_e2m1fn" else np.array(0.0).astype(dt)
    codes = np.where(finite, codes, nan_code).astype(dt)
    sbytes = np.where(finite, e + 127, 255).astype(np.uint8)
    return codes, sbytes


def ref_mx(x, name, block=32, axis=-1):
    xb = _blocks(x, axis, block)
    codes, sb = ref_mx_blocks(xb, name, (-1,))
    return _unblocks(codes, axis), np.moveaxis(sb[..., 0], -1, axis)


def ref_mx_2d(x, name, r, c):
    codes, sb = ref_mx_blocks(_tiles2d(x, r, c), name, (-3, -1))
    return codes.reshape(x.shape), sb[..., 0, :, 0]


def ref_mx_dequantize(codes, sbytes_full):
    """code · 2^(byte - 127) in f64, cast to f32 (exact: the product is always an f32, subnormal or not)."""
    c = np.asarray(codes).astype(np.float64)
    v = np.ldexp(c, sbytes_full.astype(np.int64) - 127)
    v = np.where(sbytes_full == 255, np.nan, v)
    return v.astype(np.float32)


def ref_nvfp4_blocks(x, xb, reduce_axes):
    """NVFP4 in f32 arithmetic (TransformerEngine's order). ``xb``: blocked view of x. (codes, e4m3 scales, ts)."""
    f32 = np.float32
    flush = lambda a: np.where(np.abs(a) < F32_TINY, np.copysign(f32(0), a), a).astype(f32)
    x = flush(np.asarray(x, f32))
    xb = flush(np.asarray(xb, f32))
    with np.errstate(invalid="ignore"):
        amax = f32(np.max(np.abs(x)))
    if not np.isfinite(amax):
        s_enc, ts = f32(1), f32(np.nan)
    elif amax == 0:
        s_enc, ts = f32(1), f32(1)
    else:
        s_enc = f32(2688) / np.maximum(amax, f32(2688 * 2.0**-116))
        ts = f32(1) / s_enc
    s_dec = f32(1) / s_enc
    with np.errstate(invalid="ignore"):
        bamax = np.max(np.abs(xb), axis=reduce_axes, keepdims=True).astype(f32)
    finite = np.isfinite(bamax)
    bamax = np.where(finite, bamax, f32(0))
    bs = (bamax * (s_enc * (f32(1) / f32(6)))).astype(f32)
    bs8 = np.clip(bs, 0, 448).astype(E4M3)  # f32 -> e4m3, RNE, saturating
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        enc = np.minimum(f32(1) / (bs8.astype(f32) * s_dec), np.finfo(f32).max).astype(f32)
        y = (xb * enc).astype(f32)
        codes = np.clip(y, -6, 6).astype(E2M1)  # f32 -> e2m1, RNE, saturating
    codes = np.where(finite, codes, np.array(0.0).astype(E2M1)).astype(E2M1)
    bs8 = np.where(finite, bs8, np.array(np.nan).astype(E4M3)).astype(E4M3)
    return codes, bs8, ts


def ref_nvfp4(x, axis=-1):
    codes, bs, ts = ref_nvfp4_blocks(x, _blocks(x, axis, 16), (-1,))
    return _unblocks(codes, axis), np.moveaxis(bs[..., 0], -1, axis), ts


def ref_nvfp4_2d(x):
    codes, bs, ts = ref_nvfp4_blocks(x, _tiles2d(x, 16, 16), (-3, -1))
    return codes.reshape(x.shape), bs[..., 0, :, 0], ts


def _u8(a):
    return np.asarray(a).view(np.uint8)


def _u32(a):
    return np.asarray(a, np.float32).view(np.uint32)


def _grid(dt):
    """All finite values of a narrow format, sorted."""
    n = 16 if dt == E2M1 else 256
    v = np.arange(n, dtype=np.uint8).view(dt).astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def _random_mx_input(seed, shape, axis=-1):
    """Normals with a random power-of-two magnitude per block (2^-140 .. 2^100: f32 subnormal blocks included)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    xb = _blocks(x, axis, 32)
    mag = 2.0 ** rng.integers(-140, 100, size=xb.shape[:-1] + (1,))
    spread = 2.0 ** rng.integers(-12, 1, size=xb.shape)  # elements spread over 12 binades within a block
    return _unblocks(xb * mag * spread, axis).astype(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# MX
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ELEM_NAMES)
@pytest.mark.parametrize("shape,axis", [((16, 128), -1), ((64, 3, 4), 0), ((2, 96, 5), 1)])
def test_mx_matches_reference_on_random_tensors(name, shape, axis):
    x = _random_mx_input(hash((name, shape)) % 1000, shape, axis)
    codes, scales = _jit(lambda v: mx_quantize(v, name, axis=axis))(x)
    rc, rs = ref_mx(x, name, axis=axis)
    assert codes.dtype == MX_ELEMS[name][0] and scales.dtype == jnp.float8_e8m0fnu
    exp_scale_shape = list(shape)
    exp_scale_shape[axis] //= 32
    assert scales.shape == tuple(exp_scale_shape)
    np.testing.assert_array_equal(_u8(codes), _u8(rc))
    np.testing.assert_array_equal(_u8(scales), rs)
    assert np.count_nonzero(_u8(rc) & 0x7F) > x.size // 2  # the comparison is not between two arrays of zeros


def _mx_edge_blocks(name):
    """One 32-element block per row: every edge case of the spec."""
    _, emax, fmax, _, _ = MX_ELEMS[name]
    rng = np.random.default_rng(7)
    base = rng.uniform(-1, 1, 32)
    rows = {
        "zeros": np.zeros(32),
        "neg_zeros": -np.zeros(32),
        "amax_at_max": np.concatenate([[fmax], base[1:] * fmax]),
        "amax_at_neg_max_scaled": np.concatenate([[-fmax * 2.0**-20], base[1:] * fmax * 2.0**-20]),
        "amax_pow2": np.concatenate([[2.0**5], base[1:] * 2.0**5]),
        "amax_below_pow2": np.concatenate([[np.nextafter(np.float32(2.0**5), 0)], base[1:]]),
        "saturating": np.concatenate([[fmax * 1.1], [fmax * 1.14], base[2:] * fmax]),  # y in (max, 2^(emax+1))
        "f32_max": np.concatenate([[np.finfo(np.float32).max], base[1:] * 1e38]),
        "subnormal_only": np.concatenate([[2.0**-149, -(2.0**-140)], base[2:] * 2.0**-127]),
        "subnormal_and_tiny_normal": np.concatenate([[2.0**-125], base[1:] * 2.0**-130]),
        "tiny_vs_big": np.concatenate([[1.0], [2.0**-100], [-(2.0**-149)], base[3:] * 2.0**-20]),
        "pos_inf": np.concatenate([[np.inf], base[1:]]),
        "neg_inf": np.concatenate([base[:5], [-np.inf], base[6:]]),
        "nan": np.concatenate([base[:9], [np.nan], base[10:]]),
    }
    assert 2.0 ** (emax + 1) > fmax * 1.14  # the "saturating" row stays inside one binade above max
    return list(rows), np.stack([r.astype(np.float32) for r in rows.values()])


@pytest.mark.parametrize("name", ELEM_NAMES)
def test_mx_edge_cases_match_reference_and_spec(name):
    dt, emax, fmax, _, _ = MX_ELEMS[name]
    labels, x = _mx_edge_blocks(name)
    codes, scales = _jit(lambda v: mx_quantize(v, name))(x)
    rc, rs = ref_mx(x, name)
    np.testing.assert_array_equal(_u8(codes), _u8(rc))
    np.testing.assert_array_equal(_u8(scales), rs)
    row = {lab: i for i, lab in enumerate(labels)}
    sb = _u8(scales)[:, 0]
    c = np.asarray(codes).astype(np.float64)
    # all-zero blocks: the smallest scale, 2^-127 (byte 0x00), zero codes keeping their sign
    assert sb[row["zeros"]] == 0 and sb[row["neg_zeros"]] == 0
    assert np.all(c[row["zeros"]] == 0) and np.all(np.signbit(c[row["neg_zeros"]]))
    # amax exactly at the element max: scale 1 and the max code; scaled by 2^-20 the same codes
    assert sb[row["amax_at_max"]] == 127 and c[row["amax_at_max"], 0] == fmax
    assert sb[row["amax_at_neg_max_scaled"]] == 127 - 20 and c[row["amax_at_neg_max_scaled"], 0] == -fmax
    # amax a power of two: 2^(5 - emax); one ulp below it: the binade below
    assert sb[row["amax_pow2"]] == 127 + 5 - emax and sb[row["amax_below_pow2"]] == 127 + 4 - emax
    # "clamp to max normal": values above max in the block's top binade saturate
    assert np.all(c[row["saturating"], :2] == fmax)
    assert sb[row["f32_max"]] == 127 + 127 - emax
    # f32 subnormals: the scale reaches 2^-127 and the codes are not flushed
    assert sb[row["subnormal_only"]] == 0 and np.count_nonzero(c[row["subnormal_only"]]) >= 16
    # inf or NaN anywhere in a block: scale NaN (0xFF); codes NaN (float8) or 0 (e2m1, no NaN)
    for lab in ("pos_inf", "neg_inf", "nan"):
        assert sb[row[lab]] == 255
        if name == "float4_e2m1fn":
            assert np.all(c[row[lab]] == 0)
        else:
            assert np.all(np.isnan(c[row[lab]]))


@pytest.mark.parametrize("name", ELEM_NAMES)
def test_mx_dequantize_is_exact(name):
    labels, edge = _mx_edge_blocks(name)
    x = np.concatenate([_random_mx_input(3, (12, 32 * 4)).reshape(-1, 32), edge]).reshape(-1, 64)
    codes, scales = mx_quantize(x, name)
    out = _jit(mx_dequantize)(codes, scales)
    assert out.dtype == jnp.float32
    ref = ref_mx_dequantize(codes, np.repeat(_u8(scales), 32, axis=-1))
    np.testing.assert_array_equal(_u32(out), _u32(ref))  # bit for bit, subnormal results and NaN blocks included
    sub = (np.abs(ref) < F32_TINY) & (ref != 0)
    assert sub.any()  # some results are f32 subnormals, and they came back exactly
    bf = _jit(lambda c, s: mx_dequantize(c, s, dtype=jnp.bfloat16))(codes, scales)
    assert bf.dtype == jnp.bfloat16
    fin = np.isfinite(ref) & (np.abs(ref) >= F32_TINY)
    np.testing.assert_array_equal(
        np.asarray(bf, np.float32)[fin], ref.astype(ml_dtypes.bfloat16).astype(np.float32)[fin]
    )


@pytest.mark.parametrize("name", ELEM_NAMES)
def test_mx_roundtrip_error_is_half_an_element_ulp_of_the_block_scale(name):
    dt, emax, fmax, p, emin = MX_ELEMS[name]
    x = _random_mx_input(11, (32, 256))
    codes, scales = _jit(lambda v: mx_quantize(v, name))(x)
    xd = np.asarray(_jit(mx_dequantize)(codes, scales), np.float64)
    scale = np.ldexp(1.0, np.repeat(_u8(scales).astype(np.int64) - 127, 32, axis=-1))
    y = np.abs(x.astype(np.float64)) / scale
    ulp = np.ldexp(1.0, np.maximum(np.floor(np.log2(np.maximum(y, 2.0**-300))), emin).astype(np.int64) - p)
    bound = np.where(y > fmax, y - fmax, 0.5 * ulp) * scale
    err = np.abs(xd - x)
    assert np.all(err <= bound * (1 + 1e-12))
    assert np.any(err > 0.25 * bound)  # the bound is not loose by more than a factor of 4 everywhere
    assert np.all(y < 2.0 ** (emax + 1))  # the floor rule keeps every element below the next binade


@pytest.mark.parametrize("name", ELEM_NAMES)
def test_mx_2d_tiles(name):
    w = _random_mx_input(5, (64, 96))
    codes, scales = _jit(lambda v: mx_quantize(v, name, block_shape=(32, 32)))(w)
    rc, rs = ref_mx_2d(w, name, 32, 32)
    assert scales.shape == (2, 3)
    np.testing.assert_array_equal(_u8(codes), _u8(rc))
    np.testing.assert_array_equal(_u8(scales), rs)
    # square tiles are transpose-invariant: the transposed weight has the transposed codes and scales
    ct, st = mx_quantize(w.T, name, block_shape=(32, 32))
    np.testing.assert_array_equal(_u8(ct), _u8(codes).T)
    np.testing.assert_array_equal(_u8(st), _u8(scales).T)
    xd = _jit(lambda c, s: mx_dequantize(c, s, block_shape=(32, 32)))(codes, scales)
    full = np.repeat(np.repeat(_u8(scales), 32, axis=0), 32, axis=1)
    np.testing.assert_array_equal(_u32(xd), _u32(ref_mx_dequantize(codes, full)))


def _neighbours(y, dt):
    """The grid values just below and just above y (equal when y is on the grid), with the format's sign symmetry."""
    g = _grid(dt)
    a = np.abs(y)
    hi = g[np.clip(np.searchsorted(g, a, side="left"), 0, len(g) - 1)]
    lo = g[np.clip(np.searchsorted(g, a, side="right") - 1, 0, len(g) - 1)]
    s = np.sign(y)
    return s * lo, s * hi


@pytest.mark.parametrize("name", ELEM_NAMES)
def test_mx_stochastic_rounding_is_unbiased_and_picks_a_neighbour(name):
    dt, _, fmax, _, _ = MX_ELEMS[name]
    rng = np.random.default_rng(2)
    x = (rng.uniform(-1, 1, (2, 64)) * np.array([[3.0], [2.0**-70]])).astype(np.float32)
    n = 512
    keys = jax.random.split(jax.random.key(42), n)
    q = _jit(jax.vmap(lambda k: mx_quantize(x, name, rounding="stochastic", key=k)))
    codes, scales = q(keys)
    _, s_near = mx_quantize(x, name)
    np.testing.assert_array_equal(_u8(scales), np.broadcast_to(_u8(s_near), _u8(scales).shape))  # scales: no SR
    scale = np.ldexp(1.0, np.repeat(_u8(s_near).astype(np.int64) - 127, 32, axis=-1))
    y = x.astype(np.float64) / scale
    lo, hi = _neighbours(y, dt)
    c = np.asarray(codes).astype(np.float64)
    assert np.all((c == lo) | (c == hi))  # always one of the two neighbours
    inside = np.abs(y) <= fmax  # above max, codes saturate (both neighbours are ±max)
    assert np.all(np.abs(c[:, ~inside]) == fmax)
    mean = c.mean(axis=0)
    tol = 5 * np.abs(hi - lo) / (2 * np.sqrt(n)) + 1e-12
    assert np.all((np.abs(mean - y) <= tol)[inside])  # unbiased within 5 sigma
    frac = np.abs(y - lo) / np.where(hi != lo, np.abs(hi - lo), 1.0)
    between = inside & (frac > 0.05) & (frac < 0.95)  # both neighbours seen, but for p <= 0.95^512
    assert np.all((c[:, between] == lo[between]).any(axis=0) & (c[:, between] == hi[between]).any(axis=0))


# ---------------------------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------------------------


def _random_nvfp4_input(seed, shape, axis=-1, spread=8):
    """Normals, a random tensor magnitude, and per-block magnitudes spread over 2^±spread."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    xb = _blocks(x, axis, 16)
    xb = xb * 2.0 ** rng.integers(-spread, spread + 1, size=xb.shape[:-1] + (1,))
    return (_unblocks(xb, axis) * 2.0 ** rng.integers(-100, 100)).astype(np.float32)


def _check_nvfp4(out, ref):
    codes, bs, ts = out
    rc, rbs, rts = ref
    assert codes.dtype == E2M1 and bs.dtype == E4M3 and ts.dtype == np.float32 and ts.shape == ()
    np.testing.assert_array_equal(_u8(codes), _u8(rc))
    np.testing.assert_array_equal(_u8(bs), _u8(rbs))
    np.testing.assert_array_equal(_u32(ts), _u32(rts))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape,axis", [((32, 128), -1), ((64, 3, 2), 0)])
def test_nvfp4_matches_reference_on_random_tensors(seed, shape, axis):
    x = _random_nvfp4_input(seed, shape, axis, spread=4 + 4 * seed)  # wide spreads give e4m3-subnormal and 0 scales
    out = _jit(lambda v: nvfp4_quantize(v, axis=axis))(x)
    ref = ref_nvfp4(x, axis)
    _check_nvfp4(out, ref)
    assert np.count_nonzero(_u8(ref[0]) & 0x7) > x.size // 3


def test_nvfp4_edge_cases():
    rng = np.random.default_rng(9)
    base = rng.standard_normal(16).astype(np.float32)
    q = _jit(nvfp4_quantize)

    # zero tensor: tensor scale 1, block scales 0, codes 0
    z = np.zeros((2, 32), np.float32)
    codes, bs, ts = q(z)
    _check_nvfp4((codes, bs, ts), ref_nvfp4(z))
    assert float(ts) == 1.0 and np.all(np.asarray(bs, np.float32) == 0) and np.all(np.asarray(codes, np.float32) == 0)

    # zero blocks, a block of f32 subnormals (treated as zeros), amax at 2688 · 2^k, and a block 2^-30 below the rest
    # (its scale rounds to e4m3 zero: codes saturate at ±6 as in TransformerEngine, and decode to 0)
    x = np.stack(
        [
            np.zeros(16),
            base * 2.0**-135,
            np.concatenate([[2688.0 * 2.0**-3], base[1:]]),
            base * 2.0**-30,
            -np.zeros(16),
        ]
    ).astype(np.float32)
    codes, bs, ts = q(x)
    _check_nvfp4((codes, bs, ts), ref_nvfp4(x))
    bsf, cf = np.asarray(bs, np.float64), np.asarray(codes, np.float64)
    assert float(ts) == np.float32(1) / (np.float32(2688) / np.float32(336.0))
    assert bsf[0, 0] == 0 and bsf[1, 0] == 0 and bsf[3, 0] == 0 and bsf[2, 0] == 448.0 and cf[2, 0] == 6.0
    assert np.all(cf[1] == 0) and np.all(np.abs(cf[3]) == 6)
    assert np.all(np.asarray(nvfp4_dequantize(codes, bs, ts))[[0, 1, 3, 4]] == 0)

    # a tensor below the amax floor: tensor scale 2^-116, everything normal
    t = (base * 1e-36).astype(np.float32)[None]
    codes, bs, ts = q(t)
    _check_nvfp4((codes, bs, ts), ref_nvfp4(t))
    assert float(ts) == 2.0**-116 and np.count_nonzero(np.asarray(codes, np.float32)) > 8

    # inf / NaN: tensor scale NaN, the block's scale NaN, its codes 0; other blocks as if S_enc = 1
    for bad in (np.inf, -np.inf, np.nan):
        y = np.stack([base, base * 4]).astype(np.float32)
        y[1, 3] = bad
        codes, bs, ts = q(y)
        _check_nvfp4((codes, bs, ts), ref_nvfp4(y))
        assert np.isnan(float(ts)) and np.isnan(np.asarray(bs, np.float32)[1, 0])
        assert np.all(np.asarray(codes, np.float32)[1] == 0)
        assert np.all(np.isnan(np.asarray(nvfp4_dequantize(codes, bs, ts))))


def test_nvfp4_follows_the_recipe_order_of_operations():
    """Blocks whose f32 block scale lands on e4m3 rounding ties, and elements on e2m1 ties: there the last bit of each
    f32 step decides the result, so the reference's order (TransformerEngine's) is pinned, not just approximated."""
    f32 = np.float32
    g = _grid(E4M3)
    g = g[g > 0]
    mids = (g[:-1] + g[1:]) / 2  # e4m3 rounding ties
    e2m1_ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rng = np.random.default_rng(5)
    q = _jit(nvfp4_quantize)
    moved_scales = moved_codes = 0
    for _ in range(4):
        amax = f32(rng.uniform(1, 2) * 2.0 ** rng.integers(-20, 20))
        s_enc = f32(2688) / amax
        s_dec = f32(1) / s_enc
        x = np.zeros((len(mids) + 1, 16), f32)
        x[0, 0] = amax
        x[1:, 0] = (6 * mids / np.float64(s_enc)).astype(f32)  # block amax whose scale is an e4m3 tie
        bs = np.asarray(ref_nvfp4(x)[1], np.float64)[:, 0]
        signs = np.where(np.arange(7) % 2, -1.0, 1.0)
        x[1:, 1:8] = (signs * e2m1_ties * bs[1:, None] * np.float64(s_dec)).astype(f32)  # elements on e2m1 ties
        ref = ref_nvfp4(x)
        _check_nvfp4(q(x), ref)
        # the same rules in another f32 order move some results: the comparison above can tell the orders apart
        alt_bs = np.clip(((x[:, 0] / f32(6)) * s_enc).astype(f32), 0, 448).astype(E4M3)
        moved_scales += np.count_nonzero(_u8(alt_bs) != _u8(ref[1])[:, 0])
        enc_alt = (s_enc / np.asarray(ref[1], f32))[:, None]
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            alt_codes = np.clip(x * enc_alt, -6, 6).astype(E2M1)
        moved_codes += np.count_nonzero(_u8(alt_codes) != _u8(ref[0]))
    assert moved_scales > 10 and moved_codes > 10


def test_nvfp4_dequantize_is_one_rounding_of_the_exact_product():
    x = _random_nvfp4_input(4, (64, 64))
    codes, bs, ts = nvfp4_quantize(x)
    out = np.asarray(_jit(nvfp4_dequantize)(codes, bs, ts))
    c = np.asarray(codes).astype(np.float64)
    s = np.repeat(np.asarray(bs).astype(np.float64), 16, axis=-1)
    exact = c * s * np.float64(ts)  # exact in f64 (2 + 4 + 24 significant bits)
    np.testing.assert_array_equal(_u32(out), _u32(exact.astype(np.float32)))


def test_nvfp4_roundtrip_error_bound():
    x = _random_nvfp4_input(8, (64, 256), spread=3)
    codes, bs, ts = _jit(nvfp4_quantize)(x)
    xd = np.asarray(nvfp4_dequantize(codes, bs, ts), np.float64)
    eff = np.repeat(np.asarray(bs, np.float64), 16, axis=-1) * np.float64(ts)  # block scale · tensor scale
    assert np.all(np.repeat(np.asarray(bs, np.float64), 16, axis=-1) >= 2.0**-6)  # normal e4m3 block scales
    y = np.abs(x.astype(np.float64)) / eff
    ulp = np.where(y < 1, 0.5, np.ldexp(1.0, np.floor(np.log2(np.maximum(y, 1))).astype(np.int64) - 1))
    eps = 2.0**-21 * np.abs(x)  # f32 round-off of the encode scale and of x · encode
    bound = np.where(y > 6, (y - 6) * eff, 0.5 * ulp * eff) + eps
    err = np.abs(xd - x)
    assert np.all(err <= bound)
    assert np.all(y <= 6 * (1 + 2.0**-4) * (1 + 2.0**-20))  # e4m3 rounding of the block scale: at most 2^-4 over 6
    assert np.any(err > 0.25 * bound)


def test_nvfp4_2d_tiles():
    w = _random_nvfp4_input(6, (64, 48))
    out = _jit(lambda v: nvfp4_quantize(v, block_shape=(16, 16)))(w)
    _check_nvfp4(out, ref_nvfp4_2d(w))
    codes, bs, ts = out
    assert bs.shape == (4, 3)
    ct, bst, tst = nvfp4_quantize(w.T, block_shape=(16, 16))
    np.testing.assert_array_equal(_u8(ct), _u8(codes).T)
    np.testing.assert_array_equal(_u8(bst), _u8(bs).T)
    xd = _jit(lambda c, s, t: nvfp4_dequantize(c, s, t, block_shape=(16, 16)))(codes, bs, ts)
    s = np.repeat(np.repeat(np.asarray(bs).astype(np.float64), 16, axis=0), 16, axis=1)
    exact = np.asarray(codes).astype(np.float64) * s * np.float64(ts)
    np.testing.assert_array_equal(_u32(xd), _u32(exact.astype(np.float32)))


def test_nvfp4_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    rng = np.random.default_rng(12)
    x = (rng.uniform(-1, 1, (4, 32)) * 5.0).astype(np.float32)
    n = 512
    keys = jax.random.split(jax.random.key(3), n)
    codes, bs, ts = _jit(jax.vmap(lambda k: nvfp4_quantize(x, rounding="stochastic", key=k)))(keys)
    _, bs_n, ts_n = nvfp4_quantize(x)
    np.testing.assert_array_equal(_u8(bs), np.broadcast_to(_u8(bs_n), _u8(bs).shape))
    np.testing.assert_array_equal(_u32(ts), np.broadcast_to(_u32(ts_n), (n,)))
    # the value being rounded: x times the f32 encode scale, computed as the reference does
    f32 = np.float32
    enc = np.minimum(
        f32(1) / (np.repeat(np.asarray(bs_n).astype(f32), 16, axis=-1) * (f32(1) / (f32(2688) / f32(np.abs(x).max())))),
        np.finfo(f32).max,
    )
    y = (x * enc).astype(np.float64)
    lo, hi = _neighbours(y, E2M1)
    c = np.asarray(codes).astype(np.float64)
    assert np.all((c == lo) | (c == hi))
    inside = np.abs(y) <= 6
    assert np.all(np.abs(c[:, ~inside]) == 6)
    tol = 5 * np.abs(hi - lo) / (2 * np.sqrt(n)) + 1e-12
    assert np.all((np.abs(c.mean(axis=0) - y) <= tol)[inside])
    frac = np.abs(y - lo) / np.where(hi != lo, np.abs(hi - lo), 1.0)
    between = inside & (frac > 0.05) & (frac < 0.95)  # both neighbours seen, but for p <= 0.95^512
    assert between.sum() > 100
    assert np.all((c[:, between] == lo[between]).any(axis=0) & (c[:, between] == hi[between]).any(axis=0))


# ---------------------------------------------------------------------------------------------------------------
# Both: jit, errors
# ---------------------------------------------------------------------------------------------------------------


def test_jit_and_eager_agree():
    x = _random_mx_input(21, (4, 64))
    for name in ELEM_NAMES:
        a = mx_quantize(x, name)
        b = _jit(lambda v, n=name: mx_quantize(v, n))(x)  # unoptimized: the same bits under any compile
        for u, v in zip(a, b, strict=True):
            np.testing.assert_array_equal(_u8(u), _u8(v))
    y = _random_nvfp4_input(21, (4, 64))
    for u, v in zip(nvfp4_quantize(y), _jit(nvfp4_quantize)(y), strict=True):
        assert np.asarray(u).tobytes() == np.asarray(v).tobytes()


def test_bf16_input():
    x = _random_mx_input(30, (4, 64)).astype(ml_dtypes.bfloat16)
    codes, scales = mx_quantize(jnp.asarray(x), "float8_e4m3fn")
    rc, rs = ref_mx(x.astype(np.float32), "float8_e4m3fn")
    np.testing.assert_array_equal(_u8(codes), _u8(rc))
    np.testing.assert_array_equal(_u8(scales), rs)


def _one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_bad_inputs_raise_one_line_value_errors():
    x = np.zeros((4, 48), np.float32)
    _one_line_error(lambda: mx_quantize(x, "float8_e4m3fn"), r"x.shape\[1\]=48 .* multiple of the block length 32")
    _one_line_error(lambda: nvfp4_quantize(np.zeros((4, 40), np.float32)), r"x.shape\[1\]=40 .* block length 16")
    _one_line_error(lambda: mx_quantize(np.zeros((4, 32), np.int32), "float8_e4m3fn"), "floating-point .* int32")
    _one_line_error(lambda: nvfp4_quantize(np.zeros((4, 32), np.int8)), "floating-point .* int8")
    for bad in ("float16", jnp.bfloat16, "int8", "nope", 3):
        _one_line_error(
            lambda b=bad: mx_quantize(np.zeros((1, 32), np.float32), b),
            "elem_dtype must be float8_e4m3fn or float8_e5m2 or float4_e2m1fn",
        )
    z = np.zeros((32, 32), np.float32)
    _one_line_error(lambda: mx_quantize(z, "float8_e5m2", rounding="up"), "rounding must be one of")
    _one_line_error(lambda: mx_quantize(z, "float8_e5m2", rounding="stochastic"), "needs a key")
    _one_line_error(lambda: nvfp4_quantize(z, block_shape=(32, 32)), r"block_shape must be None .* \(16, 16\)")
    _one_line_error(lambda: mx_quantize(z, "float8_e5m2", block_size=0), "block_size must be a positive int")
    _one_line_error(lambda: mx_quantize(z, "float8_e5m2", axis=2), "axis=2 is out of range")
    _one_line_error(lambda: mx_quantize(z, "float8_e5m2", axis=0, block_shape=(32, 32)), "axis must be -1")
    _one_line_error(lambda: mx_quantize(np.float32(1.0), "float8_e5m2"), "at least one axis")
    codes, scales = mx_quantize(z, "float8_e4m3fn")
    _one_line_error(lambda: mx_dequantize(codes, scales[:, :0]), r"scales has shape \(32, 0\); .* need \(32, 1\)")
    _one_line_error(lambda: mx_dequantize(codes, np.zeros((32, 1), np.float32)), "float8_e8m0fnu or uint8")
    _one_line_error(lambda: mx_dequantize(z, scales), "codes must be one of .* got dtype float32")
    _one_line_error(lambda: mx_dequantize(codes, scales, dtype=jnp.int8), "dtype must be a floating-point dtype")
    c4, bs, ts = nvfp4_quantize(z)
    _one_line_error(lambda: nvfp4_dequantize(c4, bs, np.ones(2, np.float32)), "tensor_scale must be one float")
    _one_line_error(lambda: nvfp4_dequantize(codes, bs, ts), "codes must be float4_e2m1fn")


def test_uint8_scale_bytes_dequantize_like_e8m0():
    x = _random_mx_input(31, (2, 64))
    codes, scales = mx_quantize(x, "float8_e5m2")
    a = mx_dequantize(codes, scales)
    b = mx_dequantize(codes, jnp.asarray(_u8(scales)))
    np.testing.assert_array_equal(_u32(a), _u32(b))
