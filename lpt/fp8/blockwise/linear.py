"""NNX layer and ``dot_general`` hook computing with :func:`lpt.fp8.blockwise_dot`.

Both are stateless: block scales are recomputed from the current activations, weights and gradients on every call,
so there is no amax history to carry (nothing breaks under ``nnx.scan``, remat or gradient accumulation, unlike
delayed-scaling FP8 layers). The parameters stay in ``param_dtype`` (f32 master weights by default); the weight is
quantized to FP8 inside the matmul, and its gradient arrives in ``param_dtype``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lpt.fp8.blockwise.dot import blockwise_config, blockwise_dot

__all__ = ["Fp8Linear", "make_fp8_dot_general"]

_default_kernel_init = nnx.initializers.lecun_normal()
_default_bias_init = nnx.initializers.zeros_init()


class Fp8Linear(nnx.Module):
    """``y = blockwise_dot(x, kernel) (+ bias)`` with ``kernel[in_features, out_features]``.

    Args:
      in_features, out_features: multiples of ``block`` (checked here, ValueError otherwise).
      rngs: ``nnx.Rngs`` for the initializers.
      use_bias: add a bias (kept in ``param_dtype``, added in the output dtype after the FP8 GEMM).
      param_dtype: dtype of the stored parameters.
      kernel_init, bias_init: initializers (lecun normal / zeros, as ``nnx.Linear``).
      impl: ``"xla"``, ``"pallas"`` or ``"mosaic_gpu"`` (see :func:`lpt.fp8.blockwise_dot`).
      grad_dtype: FP8 format of output gradients (float8_e5m2; float8_e4m3fn for e4m3 everywhere).
      fwd_dtype, block, scale_format: forwarded to :func:`lpt.fp8.blockwise_dot`.
      dtype: if set, inputs are cast to it before the GEMM (and the output has it); None keeps the input dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        param_dtype=jnp.float32,
        kernel_init=_default_kernel_init,
        bias_init=_default_bias_init,
        impl: str = "xla",
        grad_dtype=jnp.float8_e5m2,
        fwd_dtype=jnp.float8_e4m3fn,
        block: int = 128,
        scale_format: str = "f32",
        dtype=None,
    ):
        if in_features % block or out_features % block:
            raise ValueError(
                f"Fp8Linear({in_features}, {out_features}): both features must be multiples of block={block}"
            )
        self.opts = dict(impl=impl, block=block, fwd_dtype=fwd_dtype, grad_dtype=grad_dtype, scale_format=scale_format)
        blockwise_config(**self.opts)  # one-line errors at construction
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else None
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.dtype is not None:
            x = x.astype(self.dtype)  # input dtype -> compute dtype
        y = blockwise_dot(x, self.kernel[...], **self.opts)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)  # param dtype -> output dtype
        return y


def make_fp8_dot_general(**options):
    """A ``lax.dot_general``-compatible function routing ``x[..., K] . w[K, N]`` through ``blockwise_dot``.

    Use it wherever a module accepts ``dot_general=`` (e.g. ``nnx.Linear(..., dot_general=hook)``). Only the
    dense-layer contraction (last dim of lhs with the first dim of a 2-D rhs, no batch dims) is supported; any other
    dimension_numbers raise ValueError. ``precision`` is ignored (the GEMM is FP8 by construction);
    ``preferred_element_type``, if given, sets the output dtype. ``options`` are :func:`blockwise_dot`'s static
    options (``impl``, ``block``, ``fwd_dtype``, ``grad_dtype``, ``scale_format``, ``interpret``), checked here.
    """
    blockwise_config(**options)  # one-line errors when the hook is made, not at its first call
    opts = dict(options)

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        del precision
        if kwargs.get("out_sharding") is not None:
            raise ValueError("fp8 dot_general does not take out_sharding; shard the inputs instead")
        (lc, rc), (lb, rb) = dimension_numbers
        if tuple(lb) or tuple(rb) or jnp.ndim(rhs) != 2 or tuple(lc) != (jnp.ndim(lhs) - 1,) or tuple(rc) != (0,):
            raise ValueError(
                "fp8 dot_general supports only x[..., K] . w[K, N] (contract lhs's last dim with rhs dim 0, no "
                f"batch dims); got dimension_numbers={dimension_numbers} for shapes "
                f"{jnp.shape(lhs)} and {jnp.shape(rhs)}"
            )
        y = blockwise_dot(lhs, rhs, **opts)
        if preferred_element_type is not None:
            y = y.astype(preferred_element_type)  # lhs dtype -> requested dtype
        return y

    return dot_general
