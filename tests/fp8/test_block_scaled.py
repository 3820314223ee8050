"""block_scaled_dot (MXFP8 / NVFP4 GEMMs, emulated) and the random Hadamard transform.

The reference composes lpt's quantizers the straightforward way: quantize each operand along its contraction axis,
dequantize it fully in f32 (tensor scale included), multiply in float64. The GEMM under test multiplies bf16
``codes · block scales`` with f32 accumulation and applies the tensor scales afterwards, so the two agree to f32
round-off: ``|y - ref| <= (K + 4) · eps32 · (|a| @ |b|)``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_compile import UNOPTIMIZED

from lpt.fp8 import block_hadamard, block_scaled_dot, hadamard_matrix, random_hadamard
from lpt.fp8.microscaling.formats import mx_dequantize, mx_quantize, nvfp4_dequantize, nvfp4_quantize

EPS32 = float(np.finfo(np.float32).eps)
KEY = jax.random.key(7)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


def _dq(a, recipe, axis, *, tiles=False, key=None):
    """``a`` quantized along ``axis`` (NVFP4 16x16 tiles when ``tiles``) and dequantized in f32 (traced)."""
    rounding = "nearest" if key is None else "stochastic"
    if recipe == "mxfp8":
        c, s = mx_quantize(a, jnp.float8_e4m3fn, 32, axis, rounding=rounding, key=key)
        return mx_dequantize(c, s, 32, axis)
    if tiles:
        c, bs, ts = nvfp4_quantize(a, block_shape=(16, 16), rounding=rounding, key=key)
        return nvfp4_dequantize(c, bs, ts, block_shape=(16, 16))
    c, bs, ts = nvfp4_quantize(a, axis, rounding=rounding, key=key)
    return nvfp4_dequantize(c, bs, ts, axis)


def _ref_operands(x, w, g, recipe, key, hadamard, sr):
    """The dequantized f32 operands of the recipe's three GEMMs, from the quantizers (traced): name -> (a, b)."""
    nv = recipe == "nvfp4"
    keys = [jax.random.fold_in(key, i) for i in (1, 2, 3)]
    xq, wq = _dq(x, recipe, 1), _dq(w, recipe, 0, tiles=nv)
    gq, wqt = _dq(g, recipe, 1, key=keys[0] if sr else None), _dq(w, recipe, 1, tiles=nv)
    pad = (-x.shape[0]) % (16 if nv else 32)
    xt, gt = jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(g, ((0, pad), (0, 0)))
    if hadamard:
        r = random_hadamard(keys[2])
        xt, gt = block_hadamard(xt, r, 0), block_hadamard(gt, r, 0)
    xtq, gtq = _dq(xt, recipe, 0), _dq(gt, recipe, 0, key=keys[1] if sr else None)
    return {"y": (xq, wq), "dx": (gq, wqt.T), "dw": (xtq.T, gtq)}


def ref_dot(operands):
    """(y, dx, dw) of the recipe from its dequantized operands: float64 products, plus the bounds' |a| @ |b| terms
    and the contraction length."""
    out = {}
    for k, (a, b) in operands.items():
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        out[k] = (a @ b, np.abs(a) @ np.abs(b), a.shape[1])
    return out


def _inputs(m, k, n, seed=0):
    r = np.random.default_rng(seed)
    x = r.standard_normal((m, k)).astype(np.float32) * np.exp(r.standard_normal((m, 1))).astype(np.float32)
    w = (0.05 * r.standard_normal((k, n))).astype(np.float32)
    g = (1e-3 * r.standard_normal((m, n))).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(g)


@functools.partial(jax.jit, static_argnums=(3,), static_argnames=("hadamard", "stochastic_grads", "impl"))
def _vjp(x, w, g, recipe, key=None, **kw):
    y, vjp = jax.vjp(lambda x, w: block_scaled_dot(x, w, recipe, key=key, **kw), x, w)
    dx, dw = vjp(g)
    return {"y": y, "dx": dx, "dw": dw}


def _run(x, w, g, recipe, **kw):
    """y, dx, dw (jitted) as numpy arrays."""
    return {k: np.asarray(v) for k, v in _vjp(x, w, g, recipe, **kw).items()}


# ---------------------------------------------------------------------------------------------------------------
# The GEMMs against the reference
# ---------------------------------------------------------------------------------------------------------------


def _scaled_matmul_as_documented(a, b, a_scales, b_scales, preferred_element_type=jnp.float32):
    """jax.nn.scaled_matmul's definition from its docstring (it lowers for CUDA and ROCm only), in f32."""

    def scaled(c, s):
        s32 = jnp.repeat(s.astype(jnp.float32), c.shape[-1] // s.shape[-1], axis=-1)  # scales -> f32 (exact)
        return c.astype(jnp.float32) * s32  # codes -> f32 (exact); the product is exact

    y = jnp.einsum("bmk,bnk->bmn", scaled(a, a_scales), scaled(b, b_scales), precision=jax.lax.Precision.HIGHEST)
    return y.astype(preferred_element_type)


_CASES = [  # recipe, hadamard, stochastic gradients, impl
    ("mxfp8", False, False, "xla"),
    ("mxfp8", True, True, "xla"),
    ("nvfp4", False, False, "xla"),
    ("nvfp4", True, True, "xla"),
    ("mxfp8", False, False, "scaled_matmul"),
    ("nvfp4", True, True, "scaled_matmul"),
]


@pytest.fixture(scope="module")
def equal_reference():
    """case -> (y, dx, dw of block_scaled_dot, the reference's dequantized operands) on 40 x 64 x 96 inputs, every
    case of _CASES in one program (it compiles in about two thirds of the time of a program per case; no value
    crosses between cases), compiled with LLVM's optimizations off: the bound holds for any order and contraction
    of the f32 operations, and the program runs once on tiny inputs. jax.nn.scaled_matmul is its documented math
    while this traces (it lowers for GPUs only); impl="xla" never calls it."""
    x, w, g = _inputs(40, 64, 96)  # 40 tokens: dw pads them to a multiple of the block

    def all_cases(x, w, g, key):
        out = []
        for recipe, hadamard, sr, impl in _CASES:
            kw = dict(key=key, hadamard=hadamard, stochastic_grads=sr, impl=impl)
            y, vjp = jax.vjp(lambda x, w, recipe=recipe, kw=kw: block_scaled_dot(x, w, recipe, **kw), x, w)
            dx, dw = vjp(g)
            out.append(({"y": y, "dx": dx, "dw": dw}, _ref_operands(x, w, g, recipe, key, hadamard, sr)))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax.nn, "scaled_matmul", _scaled_matmul_as_documented)
        compiled = jax.jit(all_cases).lower(x, w, g, KEY).compile(UNOPTIMIZED)
    return dict(zip(_CASES, compiled(x, w, g, KEY), strict=True))


@pytest.mark.parametrize("recipe,hadamard,sr,impl", _CASES)
def test_forward_and_backward_equal_reference(recipe, hadamard, sr, impl, equal_reference):
    """Both impls: the emulation, and the codes and block scales handed to jax.nn.scaled_matmul (here its documented
    math, since it lowers for GPUs only), which checks their layout (contraction axis last, 16x16 tile scales
    repeated along the other axis)."""
    got, operands = equal_reference[recipe, hadamard, sr, impl]
    for name, (want, mag, k) in ref_dot(operands).items():
        err = np.abs(np.asarray(got[name]) - want)
        bound = (k + 4) * EPS32 * mag + 1e-37
        assert np.all(err <= bound), (name, float(np.max(err / bound)))
        assert np.linalg.norm(want) > 0


def test_defaults_are_the_recipes():
    """nvfp4 defaults to Hadamard + SR (so it needs a key to differentiate), mxfp8 to neither."""
    x, w, g = _inputs(32, 64, 32)
    on = _run(x, w, g, "nvfp4", key=KEY)
    explicit = _run(x, w, g, "nvfp4", key=KEY, hadamard=True, stochastic_grads=True)
    off = _run(x, w, g, "nvfp4", key=KEY, hadamard=False, stochastic_grads=False)
    emulated = _run(x, w, g, "nvfp4", key=KEY, impl="xla")  # impl="auto" is the emulation off CUDA
    for name in ("y", "dx", "dw"):
        np.testing.assert_array_equal(on[name], explicit[name])
        np.testing.assert_array_equal(on[name], emulated[name])
    assert not np.array_equal(on["dw"], off["dw"])
    mx = _run(x, w, g, "mxfp8")  # no key needed
    np.testing.assert_array_equal(mx["dw"], _run(x, w, g, "mxfp8", key=KEY, hadamard=False)["dw"])
    with pytest.raises(ValueError, match="needs a key"):
        _run(x, w, g, "nvfp4")


def test_keys_make_runs_reproducible():
    x, w, g = _inputs(32, 64, 32)

    def y_dx_dw(x, w, g, key):
        y, vjp = jax.vjp(lambda x, w: block_scaled_dot(x, w, "nvfp4", key=key), x, w)
        return dict(zip(("y", "dx", "dw"), (y, *vjp(g)), strict=True))

    def run(key):  # one executable per key type, LLVM's optimizations off: the runs compared share it
        return jax.jit(y_dx_dw).lower(x, w, g, key).compile(UNOPTIMIZED)

    typed = run(KEY)
    a, b, c = (typed(x, w, g, k) for k in (KEY, jax.random.key(7), jax.random.key(8)))
    for name in ("dx", "dw"):
        np.testing.assert_array_equal(a[name], b[name])
        assert not np.array_equal(a[name], c[name])
    np.testing.assert_array_equal(a["y"], c["y"])  # the forward is deterministic
    raw = run(jax.random.PRNGKey(3))(x, w, g, jax.random.PRNGKey(3))  # raw uint32[2] keys work as well
    assert np.all(np.isfinite(raw["dw"]))


def test_dtypes_and_leading_axes():
    x, w, g = _inputs(32, 64, 32)
    x3 = x.reshape(2, 16, 64).astype(jnp.bfloat16)
    out = _vjp(x3, w, jnp.ones((2, 16, 32), jnp.bfloat16), "mxfp8")
    assert [out[k].dtype for k in ("y", "dx", "dw")] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
    flat = _run(x3.reshape(32, 64), w, jnp.ones((32, 32), jnp.bfloat16), "mxfp8")
    np.testing.assert_array_equal(np.asarray(out["y"].reshape(32, 32), np.float32), np.asarray(flat["y"], np.float32))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(recipe="fp4"), "recipe must be one of"),
        (dict(recipe="mxfp8", impl="cudnn"), "impl must be one of"),
        (dict(recipe="nvfp4", hadamard="yes"), "hadamard must be True, False or None"),
        (dict(recipe="mxfp8", w=jnp.ones((48, 32))), "multiples of 32"),
        (dict(recipe="nvfp4", w=jnp.ones((64, 24))), "multiples of 16"),
        (dict(recipe="nvfp4", w=jnp.ones((32, 32))), "disagree on K"),
    ],
)
def test_errors(kwargs, match):
    w = kwargs.pop("w", jnp.ones((64, 32)))
    x = kwargs.pop("x", jnp.ones((4, w.shape[0] if "disagree" not in match else 64)))
    with pytest.raises(ValueError, match=match):
        block_scaled_dot(x, w, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Hadamard transform
# ---------------------------------------------------------------------------------------------------------------


def test_hadamard_is_orthogonal_and_cancels():
    h = hadamard_matrix(16)
    assert set(np.unique(h)) == {-0.25, 0.25}
    r1, r2 = np.asarray(random_hadamard(KEY)), np.asarray(random_hadamard(jax.random.key(8)))
    for r in (r1, r2):
        np.testing.assert_allclose(r @ r.T, np.eye(16), atol=4 * EPS32)
    assert not np.array_equal(r1, r2)  # the signs depend on the key
    signs = np.round(r1[0] / h[0])
    assert set(np.unique(signs)) == {-1.0, 1.0}  # R = H diag(s), s in {±1}, both signs drawn
    np.testing.assert_array_equal(r1, h * signs[None, :])

    x, _, g = _inputs(48, 64, 32)  # (R x)ᵀ (R g) = xᵀ g along tokens, blocks of 16
    xh, gh = np.asarray(block_hadamard(x, r1, 0), np.float64), np.asarray(block_hadamard(g, r1, 0), np.float64)
    explicit = np.kron(np.eye(3), r1.astype(np.float64))
    np.testing.assert_allclose(xh, explicit @ np.asarray(x, np.float64), rtol=0, atol=32 * EPS32 * np.abs(x).max())
    exact = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
    scale = np.abs(np.asarray(x, np.float64)).T @ np.abs(np.asarray(g, np.float64))
    assert np.all(np.abs(xh.T @ gh - exact) <= 64 * EPS32 * scale)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
    with pytest.raises(ValueError, match="not a multiple of the Hadamard block"):
        block_hadamard(jnp.ones((24, 4)), r1, 0)


# ---------------------------------------------------------------------------------------------------------------
# Stochastic rounding and the size of the error
# ---------------------------------------------------------------------------------------------------------------


def _nvfp4_expected(g, bs, ts):
    """E[SR dequantized g] for NVFP4 1x16 blocks along the last axis, from g's block and tensor scales (which do not
    depend on the rounding): the scaled value clipped to ±6, unscaled."""
    dec = np.repeat(np.asarray(bs, np.float64), 16, axis=-1) * float(ts)
    y = np.asarray(g, np.float64) / np.where(dec > 0, dec, 1.0)
    return np.clip(y, -6.0, 6.0) * dec


def test_stochastic_gradients_are_unbiased():
    """Over 512 keys the mean dx is within 6 standard errors of E[Q(g)] @ Q(w)ᵀ for every element (any machine:
    the bits are lpt's keyed hash), and the rounding really is random (non-zero spread)."""
    x, w, g = _inputs(32, 64, 32, seed=2)
    n = 512

    def draws(x, w, g, keys):
        def dx_of(key, stochastic_grads=True):
            # impl="xla": jax.nn.scaled_matmul (impl="auto"'s CUDA branch) batches only all four operands together
            kw = dict(key=key, hadamard=False, stochastic_grads=stochastic_grads, impl="xla")
            _, vjp = jax.vjp(lambda x: block_scaled_dot(x, w, "nvfp4", **kw), x)
            return vjp(g)[0]

        _, bs, ts = nvfp4_quantize(g)
        return jax.vmap(dx_of)(keys), bs, ts, _dq(w, "nvfp4", 1, tiles=True), dx_of(KEY, stochastic_grads=False)

    # one program, LLVM's optimizations off: the checks are statistical bounds, far above f32 round-off
    args = (x, w, g, jax.random.split(KEY, n))
    dxs, bs, ts, wq, nearest = jax.jit(draws).lower(*args).compile(UNOPTIMIZED)(*args)
    dxs = np.asarray(dxs, np.float64)
    want = _nvfp4_expected(g, bs, ts) @ np.asarray(wq, np.float64).T
    mean, sem = dxs.mean(0), dxs.std(0, ddof=1) / np.sqrt(n)
    assert np.all(sem > 0)
    assert np.all(np.abs(mean - want) <= 6 * sem + 1e-9 * np.abs(want).max())
    assert np.max(np.abs(np.asarray(nearest) - want) / sem) > 6  # round-to-nearest's bias is visible at this size


def test_product_error_is_the_formats():
    """Gaussian operands, K = 256: each operand's relative error is within its element format's half-ulp bound
    (e4m3: 2^-4; e2m1: 2^-2), the product's error is sqrt(e_x^2 + e_w^2) within 10% (independent errors), and MXFP8
    is more than twice as accurate as NVFP4."""
    r = np.random.default_rng(3)
    x = jnp.asarray(r.standard_normal((128, 256)), jnp.float32)
    w = jnp.asarray(r.standard_normal((256, 128)), jnp.float32)
    recipes = (("mxfp8", 2.0**-6, 2.0**-4), ("nvfp4", 2.0**-4, 2.0**-2))

    def products(x, w):  # per recipe: x and w quantized as the GEMM does, and the GEMM's output
        return {
            recipe: (
                _dq(x, recipe, 1),
                _dq(w, recipe, 0, tiles=recipe == "nvfp4"),
                block_scaled_dot(x, w, recipe, key=KEY),
            )
            for recipe, _, _ in recipes
        }

    # one program, LLVM's optimizations off: the checks are relative errors of 2^-6 and more, far above f32 round-off
    out = jax.jit(products).lower(x, w).compile(UNOPTIMIZED)(x, w)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    rel = lambda a, b: np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b)
    errs = {}
    for recipe, lo, hi in recipes:
        xq, wq, y = out[recipe]
        ex, ew = rel(xq, np.asarray(x)), rel(wq, np.asarray(w))
        assert lo < ex < hi and lo < ew < hi, (recipe, ex, ew)
        errs[recipe] = rel(y, exact)
        assert abs(errs[recipe] / np.hypot(ex, ew) - 1) < 0.1, (recipe, errs[recipe], np.hypot(ex, ew))
    assert errs["mxfp8"] < errs["nvfp4"] / 2
