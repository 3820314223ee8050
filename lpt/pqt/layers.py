"""NNX side of PQT: apply GaussWS / DiffQ to a kernel, a ready linear layer, and layer-path assignment.

Two ways to use it from a model:

1. Your own layer keeps its kernel ``nnx.Param [in, out]`` and a bitwidth made by :func:`lpt.pqt.init_bitwidth`,
   and computes ``w_hat = apply_pqt(self.kernel, self.bitwidth, key, method="gaussws", path=self.pqt_path)``
   before its matmul.
2. :class:`GaussWSLinear` does exactly that for a dense layer.

``key`` is the *step key* (``lpt.pqt.step_key(root, step)``), the same for every layer in a step; ``path`` (a
stable string per layer) is folded in so layers get independent noise. ``key=None`` means evaluation: no noise,
ŵ = kernel cast to the compute dtype. When layers are stacked and run under ``nnx.scan``/``vmap``, each slice
must get its own path or key (e.g. fold the layer index in), otherwise all stacked layers share R.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from lpt.pqt.bitwidth import (
    DEFAULT_B_INIT,
    DEFAULT_B_TARGET,
    PQTBitwidth,
    effective_bitwidth,
    init_bitwidth,
)
from lpt.pqt.gaussws import METHODS, pqn_sample
from lpt.pqt.keys import layer_key

_DEFAULT_BLOCK = 32


def _value(x):
    return x[...] if isinstance(x, nnx.Variable) else x


def apply_pqt(
    kernel,
    bitwidth,
    key,
    *,
    method: str = "gaussws",
    path=None,
    compute_dtype=jnp.bfloat16,
    b_init: float | None = None,
    b_target: float | None = None,
    block: int | None = None,
) -> jax.Array:
    """ŵ = PQT-sampled ``kernel`` in ``compute_dtype`` (Eq. 3 with b_t from Eq. 11); differentiable.

    Args:
      kernel: ``nnx.Param`` or array ``[..., in, out]``.
      bitwidth: the :class:`PQTBitwidth` holding b_i (its metadata gives b_init, b_target, block), or a raw
        b_i array (then b_init / b_target / block default to 6 / 4 / 32).
      key: the step key, or an already per-layer key when ``path`` is None; ``None`` = no noise (evaluation).
      method: "gaussws" or "diffq".
      path: layer path folded into ``key`` (:func:`lpt.pqt.layer_key`).
      compute_dtype: dtype of ŵ and of the noise arithmetic (bf16 default).
      b_init, b_target, block: only for a raw b_i array; with a :class:`PQTBitwidth` they must be None or equal
        to its metadata (a mismatch raises ValueError).
    """
    if method not in METHODS:
        raise ValueError(f"unknown PQT method {method!r}; allowed: {METHODS}")
    w = _value(kernel)
    if key is None:
        return w.astype(compute_dtype)  # param dtype -> compute dtype (RNE), no noise
    if isinstance(bitwidth, PQTBitwidth):
        given = {"b_init": b_init, "b_target": b_target, "block": block}
        for name, val in given.items():
            if val is not None and val != getattr(bitwidth, name):
                raise ValueError(
                    f"{name}={val!r} conflicts with the PQTBitwidth metadata {name}={getattr(bitwidth, name)!r}"
                )
        if tuple(bitwidth.kernel_shape) != tuple(w.shape):
            raise ValueError(f"PQTBitwidth was made for kernel shape {bitwidth.kernel_shape}, got {w.shape}")
        b_init, b_target, block = bitwidth.b_init, bitwidth.b_target, bitwidth.block
    else:
        b_init = DEFAULT_B_INIT if b_init is None else b_init
        b_target = DEFAULT_B_TARGET if b_target is None else b_target
        block = _DEFAULT_BLOCK if block is None else block
    bt = effective_bitwidth(_value(bitwidth), b_init, b_target)
    if path is not None:
        key = layer_key(key, path)
    return pqn_sample(w, bt, key, method=method, block=block, compute_dtype=compute_dtype)


class GaussWSLinear(nnx.Module):
    """Dense layer ``y = x @ ŵ (+ b)`` with ŵ = GaussWS (or DiffQ) sample of the kernel; bf16 GEMM, f32 accumulation.

    Params: ``kernel`` ``nnx.Param [in, out]`` (``param_dtype``), ``bitwidth`` :class:`PQTBitwidth` (b_i, one per
    32×32 tile, init 1), optional ``bias [out]``. Call with ``key`` = the step key (None = evaluation, no noise).
    ``pqt_path`` (the string folded into the key) is given at construction or set by :func:`assign_pqt_paths`.

    Args:
      in_features, out_features: the kernel's shape ``[in, out]``.
      method: "gaussws" or "diffq".
      use_bias: add a bias (zeros at init).
      b_init, b_target: Eq. 11's, stored on the :class:`PQTBitwidth`.
      block: square tile size of the bitwidths.
      param_dtype: dtype of the kernel and the bias.
      compute_dtype: dtype of ŵ, of the GEMM inputs and of the output.
      kernel_init: the kernel's initializer; None: lecun normal.
      pqt_path: the string folded into the key; None: set later by :func:`assign_pqt_paths`.
      rngs: ``nnx.Rngs`` for the kernel's init.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        method: str = "gaussws",
        use_bias: bool = False,
        b_init: float = DEFAULT_B_INIT,
        b_target: float = DEFAULT_B_TARGET,
        block: int = _DEFAULT_BLOCK,
        param_dtype=jnp.float32,
        compute_dtype=jnp.bfloat16,
        kernel_init=None,
        pqt_path: str | None = None,
        rngs: nnx.Rngs,
    ):
        if method not in METHODS:
            raise ValueError(f"unknown PQT method {method!r}; allowed: {METHODS}")
        self.method = method
        self.compute_dtype = compute_dtype
        self.pqt_path = pqt_path
        if kernel_init is None:
            kernel_init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bitwidth = init_bitwidth((in_features, out_features), b_init=b_init, b_target=b_target, block=block)
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        if key is not None and not self.pqt_path:
            raise ValueError("GaussWSLinear.pqt_path is unset: pass pqt_path=... or call lpt.pqt.assign_pqt_paths")
        w_hat = apply_pqt(
            self.kernel, self.bitwidth, key, method=self.method, path=self.pqt_path, compute_dtype=self.compute_dtype
        )
        x_c = x.astype(self.compute_dtype)  # activation dtype -> compute dtype (RNE)
        y_f32 = jnp.dot(x_c, w_hat, preferred_element_type=jnp.float32)  # bf16 GEMM, f32 accumulation
        if self.bias is not None:
            y_f32 = y_f32 + self.bias[...].astype(jnp.float32)  # param dtype -> f32
        return y_f32.astype(self.compute_dtype)  # f32 -> compute dtype (RNE)


def assign_pqt_paths(model: nnx.Module) -> nnx.Module:
    """Set ``pqt_path`` of every :class:`GaussWSLinear` in ``model`` to its graph path ("blocks/0/mlp/down").

    Call once after building the model and before ``nnx.jit``; overwrites existing paths. Returns ``model``.
    """
    for path, node in nnx.iter_graph(model):
        if isinstance(node, GaussWSLinear):
            node.pqt_path = "/".join(str(p) for p in path) or "root"
    return model


__all__ = ["GaussWSLinear", "apply_pqt", "assign_pqt_paths"]
