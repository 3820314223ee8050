"""The typed ``model`` and ``precision`` sections of a config: what the model is built from.

Each section is a frozen dataclass whose fields carry their type, default, allowed values and doc (``lpt.options``);
the trainer's config (``lpt.train.config``) is made of them, so ``--help``, the command-line parser and validation
come from these definitions. :func:`model_spec` builds the model section from a (partial) mapping, and
``lpt.options.build(Precision, mapping)`` the precision one; the checks that only a section knows (divisible heads,
an even RoPE head dim, an update rule that fits the param dtype) run on construction, so users who build models
without the trainer get the same one-line errors.

:class:`Precision` is the whole precision recipe of a run, one section: the layers read its dtypes, each
projection's matmul format (``qkv``, ``out``, ``up``, ``down``, ``lm_head``: :data:`PROJECTIONS`), attention and PQT;
the optimizer (:mod:`lpt.train.optimizer`) reads its update rule and Adam's moment storage. Where the parameters are
stored follows from the update rule (:attr:`Precision.store_dtype`): ``"f32_master"`` stores every parameter in
float32 and each layer views it through ``param_dtype`` (round-to-nearest-even, straight-through gradient) and then
``compute_dtype``; every other rule rounds each update into parameters stored in ``param_dtype`` itself. GaussWS
bitwidth parameters are always float32. The names of the update rules, moment roundings and moment dtypes are
:mod:`lpt.optim`'s. ``model.kind`` is the model family ("llama" or "gpt2").
"""

from __future__ import annotations

import jax.numpy as jnp

from lpt.fp8.blockwise import IMPLS as FP8_IMPLS
from lpt.fp8.blockwise import auto_impl, wgmma_takes
from lpt.kernels.flash_attention.mosaic_gpu import BACKWARD_HEAD_DIMS
from lpt.models import matmul_formats
from lpt.optim.adam import MOMENT_DTYPES, MOMENT_ROUNDINGS
from lpt.optim.fused_adamw import IMPLS as UPDATE_IMPLS
from lpt.optim.moments8 import MOMENT8
from lpt.optim.recipes import UPDATE_RULES as ROUNDING_RULES
from lpt.options import above, at_least, build, option, section

_PARAM_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
}
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
KINDS = ("llama", "gpt2")  # model.kind: the model family
PROJECTIONS = ("qkv", "out", "up", "down", "lm_head")  # the model's matmuls: each has its format in precision.matmul
_BLOCK_PROJECTIONS = PROJECTIONS[:4]  # the matmuls inside a transformer block (precision.bf16_layers applies to them)
_ATTENTION_IMPLS = ("auto", "xla", "pallas", "softmax", "mosaic_gpu", "cudnn")  # lpt.attention's impls
_PQT_METHODS = ("none", "gaussws", "diffq")
_PQT_PROJECTIONS = ("qkv", "out", "up", "down")
UPDATE_RULES = ("f32_master", *ROUNDING_RULES)  # f32 master weights, or a rule of lpt.optim that rounds into params
_ROPE_SCALINGS = ("none", "linear", "llama3")
# the model keys that shape the parameters: a fine-tune (init_from) must keep the source's values
SHAPE_KEYS = (
    "kind",
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "tie_embeddings",
    "head_dim",
    "qkv_bias",
    "qk_norm",
)


@section("model.rope_scaling")
class RopeScaling:
    """RoPE frequency scaling (see :func:`lpt.models.layers.rope_inv_freq`); Hugging Face's ``rope_scaling``."""

    type: str = option("none", 'RoPE frequency scaling: "none" | "linear" | "llama3" (Llama 3.1)', _ROPE_SCALINGS)
    factor: float = option(1.0, "linear / llama3: context extension factor", bounds=above(0))
    low_freq_factor: float = option(
        1.0, "llama3: wavelengths above original_max_len / this are scaled", bounds=above(0)
    )
    high_freq_factor: float = option(4.0, "llama3: wavelengths below original_max_len / this are kept", bounds=above(0))
    original_max_len: int = option(8192, "llama3: the pretraining context length", bounds=at_least(1))

    def check(self):
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"config key model.rope_scaling: high_freq_factor={self.high_freq_factor!r} must exceed "
                f"low_freq_factor={self.low_freq_factor!r}"
            )


@section("model")
class ModelSpec:
    """The ``model`` section: architecture and size. Defaults are the embedded default run (``tiny_cpu``)."""

    kind: str = option(
        "llama", '"llama" (RMSNorm, RoPE, SwiGLU, GQA) or "gpt2" (LayerNorm, learned positions, GELU)', KINDS
    )
    vocab_size: int = option(
        0,
        "0: the tokenizer's vocabulary size (256 for data.tokenizer=bytes)",
        bounds=at_least(0, note="0 = the tokenizer's size"),
    )
    d_model: int = option(128, "residual stream width", bounds=at_least(1))
    n_layers: int = option(2, "transformer blocks", bounds=at_least(1))
    n_heads: int = option(4, "query heads", bounds=at_least(1))
    n_kv_heads: int = option(0, "key/value heads (GQA); 0: n_heads", bounds=at_least(0, note="0 = n_heads"))
    head_dim: int = option(
        0,
        "width of each q, k, v head; 0: d_model / n_heads (llama may set another, e.g. Qwen3)",
        bounds=at_least(0, note="0 = d_model / n_heads"),
    )
    qkv_bias: bool = option(False, "llama: biases on the q, k, v projections, none on the output one (Qwen2)")
    qk_norm: bool = option(False, "llama: RMSNorm over each head of q and k, before RoPE (Qwen3)")
    sliding_window: int = option(
        0,
        "llama: each query attends only its own and the sliding_window - 1 previous keys (Mistral); 0: no window",
        bounds=at_least(0, note="0 = no window"),
    )
    d_ff: int = option(384, "MLP hidden width (SwiGLU for llama, GELU for gpt2)", bounds=at_least(1))
    max_seq_len: int = option(
        64, "longest sequence the model accepts (RoPE table / position embedding size)", bounds=at_least(1)
    )
    rope_theta: float = option(10000.0, "RoPE base frequency (llama only)", bounds=above(0))
    norm_eps: float = option(1e-5, "epsilon of RMSNorm / LayerNorm (added to the variance)", bounds=above(0))
    tie_embeddings: bool = option(False, "share the input embedding with the output projection")
    init_std: float = option(0.02, "std of the normal init of weight matrices", bounds=above(0))
    remat: bool = option(False, "recompute block activations in the backward pass (less memory, ~1/3 more compute)")
    scan_layers: bool = option(False, "nnx.scan over stacked blocks (one compiled block: faster compiles when deep)")
    rope_scaling: RopeScaling = option(RopeScaling(), "RoPE frequency scaling")

    def check(self):
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.kind == "gpt2" and self.n_kv_heads != self.n_heads:
            raise ValueError(f"gpt2 has no GQA: n_kv_heads={self.n_kv_heads} must equal n_heads={self.n_heads}")
        for k, plain in (("qkv_bias", False), ("qk_norm", False), ("head_dim", 0), ("sliding_window", 0)):
            if self.kind == "gpt2" and getattr(self, k) != plain:
                raise ValueError(f"config key model.{k}={getattr(self, k)!r} is a llama option; gpt2 allows {plain!r}")
        if not self.head_dim and self.d_model % self.n_heads:
            hint = " (or set model.head_dim)" if self.kind == "llama" else ""
            raise ValueError(
                f"config key model.d_model={self.d_model} is not divisible by n_heads={self.n_heads}{hint}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"config key model.n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.kind == "llama" and self.head_width % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_width}")

    @property
    def head_width(self) -> int:
        """The width of each q, k, v head: ``head_dim``, or ``d_model / n_heads`` when it is 0."""
        return self.head_dim or self.d_model // self.n_heads


@section("precision.matmul")
class Matmul:
    """``precision.matmul``: the matmul format of each projection (:mod:`lpt.models.matmul_formats`)."""

    qkv: str = option(
        "bf16",
        '"bf16": matmul in compute_dtype; "fp8": blockwise FP8 (lpt.fp8); "mxfp8" | "nvfp4": block-scaled GEMMs '
        "(lpt.fp8.block_scaled_dot, emulated); or a format registered with lpt.models.matmul_formats.register",
        matmul_formats.NAMES,
    )
    out: str = option("bf16", "attention output projection", matmul_formats.NAMES)
    up: str = option("bf16", "MLP up (and gate) projection", matmul_formats.NAMES)
    down: str = option("bf16", "MLP down projection", matmul_formats.NAMES)
    lm_head: str = option("bf16", "output projection to the vocabulary", matmul_formats.NAMES)


@section("precision.attention")
class AttentionConfig:
    """``precision.attention``: the attention implementation and its numerics."""

    impl: str = option(
        "auto",
        '"auto" (by the mesh\'s devices: on a GPU cuDNN for the standard policy (stable=false) of a head width of 64 '
        "or 128, Mosaic GPU kernels on Hopper where they train, else the Pallas kernel on a GPU or TPU, the XLA twin "
        'on CPU), "xla" reference, "pallas" flash kernel, "softmax" (plain), "mosaic_gpu" (Hopper flash kernels, CUDA '
        'only: needs compute_dtype bfloat16 and a head width of 64 or 128) or "cudnn" (cuDNN, CUDA only: stable=false)',
        _ATTENTION_IMPLS,
    )
    stable: bool = option(True, "Qiu & Yao's fix for repeated row maxima in low-precision softmax")
    beta: float = option(7.0, "the fix's beta (rows with a repeated max use beta*m or 0 as offset)", bounds=above(1))


@section("precision.pqt")
class _Pqt:
    """``precision.pqt``: pseudo-quantization training."""

    method: str = option("none", 'pseudo-quantization training: "none" | "gaussws" | "diffq"', _PQT_METHODS)
    layers: tuple[str, ...] = option((), 'projections that get PQT, e.g. "out,down"', _PQT_PROJECTIONS)
    b_init: float = option(6.0, "initial learnable bitwidth", bounds=above(0))
    b_target: float = option(4.0, "bitwidth the aux loss and weight decay pull towards; != b_init", bounds=above(0))
    loss_weight: float = option(0.0, "weight of the bitwidth aux loss (0 = none)", bounds=at_least(0))

    def check(self):
        if self.method != "none" and self.layers and self.b_init == self.b_target:
            raise ValueError(
                f"config key precision.pqt.b_target={self.b_target!r} equals b_init: the learnable bitwidth "
                "b_t = b_target + b_i * (b_init - b_target) would not depend on b_i; choose another b_target"
            )


@section("precision")
class Precision:
    """The ``precision`` section: the layers' numerics (view and compute dtypes, each projection's matmul format,
    attention, PQT) and how the optimizer's update reaches the parameters (see the module docstring)."""

    param_dtype: str = option(
        "float32", "dtype the layers see the weights in (and store them in, unless stored as f32)", tuple(_PARAM_DTYPES)
    )
    compute_dtype: str = option(
        "float32", "dtype of matmul inputs/activations (loss, softmax, norms: always f32)", tuple(COMPUTE_DTYPES)
    )
    matmul: Matmul = option(Matmul(), "per-layer matmuls")
    nvfp4_hadamard: bool = option(True, '"nvfp4" matmuls: random Hadamard transform of the dW GEMM\'s inputs')
    nvfp4_stochastic_grads: bool = option(True, '"nvfp4" matmuls: stochastic rounding of the output gradient')
    fp8_impl: str = option(
        "auto",
        '"fp8" matmuls\' GEMMs: "auto" (by the mesh\'s devices: "mosaic_gpu" on a Hopper GPU, "pallas" on a TPU, '
        '"xla" elsewhere), "xla" (any platform), "pallas" (Triton / Mosaic TPU kernel) or "mosaic_gpu" (Hopper '
        "wgmma kernel, CUDA only; gradients in e4m3 as DeepSeek-V3's)",
        FP8_IMPLS,
    )
    bf16_layers: tuple[str, ...] = option(
        (),
        'blocks whose low-precision ("fp8", "mxfp8", "nvfp4", ...) matmuls run as "bf16": indices, negative from the '
        'end ("-2,-1")',
    )
    attention: AttentionConfig = option(AttentionConfig(), "attention")
    pqt: _Pqt = option(_Pqt(), "pseudo-quantization training")
    update_rule: str = option("f32_master", "f32_master | nearest | kahan | stochastic | norm_preserving", UPDATE_RULES)
    moment_rounding: str = option(
        "stochastic", '16-bit Adam moments: "stochastic" (unbiased) | "nearest"', MOMENT_ROUNDINGS
    )
    update_impl: str = option("xla", 'kahan only: the fused step in "xla" or the "pallas" kernel', UPDATE_IMPLS)
    moment_dtype: str = option(
        "auto",
        'Adam moments: "auto" (16-bit params: their dtype; else float32), a 16/32-bit float, or 8 bits with a '
        "block scale (float8_e4m3fn: m and sqrt(v) in e4m3 with an f32 scale per 128; lpt.optim.moments8)",
        ("auto", *MOMENT_DTYPES, *MOMENT8),
    )

    def check(self):
        if self.update_impl == "pallas" and (self.update_rule != "kahan" or self.param_dtype != "bfloat16"):
            raise ValueError(
                f"precision.update_impl='pallas' runs the fused bf16 AdamW + Kahan kernel: it needs "
                f"precision.update_rule='kahan' and precision.param_dtype='bfloat16', got {self.update_rule!r} and "
                f"{self.param_dtype!r} (use precision.update_impl='xla')"
            )
        if self.update_rule != "f32_master" and self.param_dtype == "float32":
            raise ValueError(
                f"precision.update_rule={self.update_rule!r} rounds each update into low-precision params, but "
                f"precision.param_dtype='float32'; set precision.param_dtype=bfloat16 (or float16, float8_*) with it, "
                f"or use precision.update_rule=f32_master for f32 params"
            )
        lpt_adamw = self.update_rule != "f32_master" and not self.param_dtype.startswith("float8")
        if self.moment_dtype not in ("auto", "float32") and not lpt_adamw:
            raise ValueError(
                f"config key precision.moment_dtype={self.moment_dtype!r} needs 16-bit params with a rounding update "
                f"rule; with update_rule={self.update_rule!r} and param_dtype={self.param_dtype!r} the moments are "
                "float32 (use 'auto' or 'float32')"
            )

    @property
    def store_dtype(self):
        """dtype the parameters are stored in: float32 masters under ``update_rule="f32_master"``, else
        ``param_dtype`` (the update rule rounds into them)."""
        return jnp.float32 if self.update_rule == "f32_master" else _PARAM_DTYPES[self.param_dtype]

    @property
    def view_dtype(self):
        """dtype the layers see the weights in before casting to compute dtype."""
        return _PARAM_DTYPES[self.param_dtype]

    @property
    def compute(self):
        return COMPUTE_DTYPES[self.compute_dtype]

    def matmul_for(self, projection: str) -> str:
        """The matmul format of ``projection`` (one of :data:`PROJECTIONS`)."""
        return getattr(self.matmul, projection)

    def pqt_for(self, projection: str) -> str:
        """The PQT method of ``projection``: ``pqt.method`` when it is one of ``pqt.layers``, else "none"."""
        return self.pqt.method if projection in self.pqt.layers else "none"

    def fp8_options(self) -> dict:
        """``lpt.fp8.blockwise_dot``'s options for this recipe's "fp8" matmuls: the GEMM implementation ("auto"
        resolved for the device being traced for: :func:`lpt.fp8.blockwise.auto_impl`, which picks the wgmma kernel
        on Hopper) and, where the wgmma kernel cannot mix FP8 formats (jax 0.10:
        :func:`lpt.fp8.blockwise.wgmma_takes`), e4m3 output gradients for it; elsewhere the recipe's e5m2."""
        impl = self.fp8_impl
        if impl == "auto":
            impl = auto_impl(jnp.float8_e4m3fn, jnp.float8_e4m3fn)
        mix = wgmma_takes(jnp.float8_e4m3fn, jnp.float8_e5m2)
        grads = {"grad_dtype": jnp.float8_e4m3fn} if impl == "mosaic_gpu" and not mix else {}
        return {"impl": impl, **grads}

    def bf16_blocks(self, n_layers: int) -> tuple[int, ...]:
        """The sorted block indices in ``[0, n_layers)`` of :attr:`bf16_layers` (negative ones counted from the end);
        ValueError for an entry that is not an integer in ``[-n_layers, n_layers)``."""
        out = set()
        for entry in self.bf16_layers:
            try:
                i = int(entry)
            except ValueError:
                i = None
            if i is None or not -n_layers <= i < n_layers:
                raise ValueError(
                    f"precision.bf16_layers entry {entry!r} is not a block index of a {n_layers}-block model; allowed: "
                    f"integers in [{-n_layers}, {n_layers - 1}] (negative from the end)"
                )
            out.add(i % n_layers)
        return tuple(sorted(out))


def _matmul_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, int], ...]]:
    """The ``(K, N)`` of every weight of each projection's matmuls; lm_head only when ``vocab_size`` is known."""
    D, F, Dh = spec.d_model, spec.d_ff, spec.head_width
    return {
        "qkv": ((D, spec.n_heads * Dh), (D, spec.n_kv_heads * Dh)),
        "out": ((spec.n_heads * Dh, D),),
        "up": ((D, F),),
        "down": ((F, D),),
        "lm_head": ((D, spec.vocab_size),) if spec.vocab_size > 0 else (),
    }


def check_matmul_blocks(spec: ModelSpec, numerics: Precision) -> None:
    """Raise ValueError for a projection whose matmul format refuses the shape of one of its weights (a K or N that
    is not a multiple of the format's block: :meth:`lpt.models.matmul_formats.MatmulFormat.check_shape`), naming
    the key and the layer, and for ``bf16_layers`` that are not block indices or that name blocks without a
    low-precision matmul."""
    formats = {k: matmul_formats.get(numerics.matmul_for(k)) for k in PROJECTIONS}
    numerics.bf16_blocks(spec.n_layers)
    if numerics.bf16_layers and not any(formats[k].low_precision for k in _BLOCK_PROJECTIONS):
        low = tuple(n for n in matmul_formats.names() if matmul_formats.get(n).low_precision)
        raise ValueError(
            f"precision.bf16_layers={','.join(numerics.bf16_layers)} keeps blocks in bf16, but no block matmul is "
            f"low-precision (precision.matmul.{{{','.join(_BLOCK_PROJECTIONS)}}} are all bf16); set one to one of "
            f"{low} or leave bf16_layers empty"
        )
    for projection, shapes in _matmul_shapes(spec).items():
        for k, n in shapes:
            formats[projection].check_shape(projection, k, n, numerics)


def check_attention(spec: ModelSpec, numerics: Precision) -> None:
    """Raise ValueError, naming the key, when ``precision.attention.impl="mosaic_gpu"`` cannot train this model: the
    Hopper kernels take 16-bit q, k, v (``compute_dtype="bfloat16"``) and, for the backward, a head width in
    :data:`lpt.kernels.flash_attention.mosaic_gpu.BACKWARD_HEAD_DIMS`."""
    if numerics.attention.impl != "mosaic_gpu":
        return

    if numerics.compute_dtype != "bfloat16":
        raise ValueError(
            f"config key precision.attention.impl='mosaic_gpu' takes 16-bit q, k, v (wgmma), but "
            f"precision.compute_dtype={numerics.compute_dtype!r}; set precision.compute_dtype=bfloat16 or use 'xla'"
        )
    if spec.head_width not in BACKWARD_HEAD_DIMS:
        raise ValueError(
            f"config key precision.attention.impl='mosaic_gpu' trains head widths {BACKWARD_HEAD_DIMS} only, but the "
            f"model's head width is {spec.head_width} (model.d_model / n_heads or model.head_dim); use 'xla' or "
            "'pallas'"
        )


def model_spec(model_cfg: ModelSpec | None = None) -> ModelSpec:
    """The model section (a ModelSpec, returned as is, or a partial mapping of its keys); the vocabulary size must be
    known (> 0)."""
    spec = build(ModelSpec, model_cfg)
    if spec.vocab_size <= 0:
        raise ValueError(f"config key model.vocab_size={spec.vocab_size!r} must be a positive int to build a model")
    return spec
