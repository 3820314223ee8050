"""The decoder-only transformer: Llama-style (RMSNorm, RoPE, SwiGLU, GQA) or GPT-2-style (LayerNorm, learned
positions, GELU, biases), pre-norm residual blocks, float32 logits.

``x_0 = E[tokens] (+ P[positions])``; per block ``x += Attn(Norm(x))``, ``x += MLP(Norm(x))``;
``logits = Norm(x) @ W_head`` (``W_head = Eᵀ`` if tied). The residual stream is in the compute dtype.
The blocks run through one function, :func:`run_blocks` (a scan over stacked blocks or a loop; remat and the
diagnostics collectors there); the forward pass and KV-cache decoding are two per-layer functions of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lpt.models import layers, pqt_wiring, probes
from lpt.models.attention_block import Attention
from lpt.models.config import ModelSpec, Precision, model_spec
from lpt.models.decode import KVCache
from lpt.models.layers import Embed, LayerNorm, Linear, RMSNorm, block_linears, init_state, matmul, view_weight
from lpt.options import build
from lpt.sharding import constrain

_BTD = ("batch", "length", "embed")
_BTF = ("batch", "length", "mlp")


class MLP(nnx.Module):
    """Llama: ``down(silu(gate(x)) * up(x))``; GPT-2: ``down(gelu_tanh(up(x)))``. Nonlinearity in float32."""

    def __init__(self, spec: ModelSpec, prec: Precision, *, block: int | str, rngs: nnx.Rngs):
        D, F = spec.d_model, spec.d_ff
        self.kind, self.prec = spec.kind, prec
        mk = block_linears(spec, prec, path=f"blocks/{block}/mlp", rngs=rngs)
        self.up = mk(D, F, ("embed", "mlp"), "up", "up")
        self.gate = mk(D, F, ("embed", "mlp"), "up", "gate") if spec.kind == "llama" else None
        self.down = mk(F, D, ("mlp", "embed"), "down", "down", residual=True)

    def __call__(self, x_BTD: jax.Array, *, key: jax.Array | None) -> jax.Array:
        up_f32 = self.up(x_BTD, key=key).astype(jnp.float32)  # compute -> f32
        if self.gate is not None:
            gate_f32 = self.gate(x_BTD, key=key).astype(jnp.float32)  # compute -> f32
            h_f32 = jax.nn.silu(gate_f32) * up_f32
        else:
            h_f32 = jax.nn.gelu(up_f32, approximate=True)
        h_BTF = constrain(h_f32.astype(self.prec.compute), _BTF)  # f32 -> compute
        return self.down(h_BTF, key=key)


class Block(nnx.Module):
    def __init__(self, spec: ModelSpec, prec: Precision, *, block: int | str, rngs: nnx.Rngs):
        Norm = RMSNorm if spec.kind == "llama" else LayerNorm
        self.norm1 = Norm(spec.d_model, eps=spec.norm_eps, prec=prec)
        self.attn = Attention(spec, prec, block=block, rngs=rngs)
        self.norm2 = Norm(spec.d_model, eps=spec.norm_eps, prec=prec)
        self.mlp = MLP(spec, prec, block=block, rngs=rngs)

    def __call__(self, x_BTD: jax.Array, *, key: jax.Array | None) -> jax.Array:
        x_BTD = constrain(x_BTD + self.attn(self.norm1(x_BTD), key=key), _BTD)
        return constrain(x_BTD + self.mlp(self.norm2(x_BTD), key=key), _BTD)

    def decode(self, x_BTD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array, **kw):
        """The block over T new tokens with this layer's KV cache (:meth:`Attention.decode`); no weight noise.
        Returns ``(x_BTD, k_BSKD, v_BSKD)``."""
        a_BTD, k_BSKD, v_BSKD = self.attn.decode(self.norm1(x_BTD), k_BSKD, v_BSKD, **kw)
        x_BTD = x_BTD + a_BTD
        return x_BTD + self.mlp(self.norm2(x_BTD), key=None), k_BSKD, v_BSKD


def _layers_metadata(spec: ModelSpec) -> dict:
    # the stacked axis is named "layers" in every parameter's logical axes; PQT bitwidths also record it in their
    # kernel_shape metadata, so lpt.pqt's statistics see the stacked kernel and each scanned slice its own
    return {nnx.PARTITION_NAME: "layers", "kernel_shape": spec.n_layers}


def _stacked_blocks(spec: ModelSpec, prec: Precision, rngs: nnx.Rngs) -> Block:
    """One :class:`Block` whose parameters carry a leading ``n_layers`` axis (logical name "layers")."""

    @nnx.split_rngs(splits=spec.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_layers_metadata(spec))
    def make(r: nnx.Rngs) -> Block:
        return Block(spec, prec, block="scan", rngs=r)

    return make(rngs)


def run_blocks(blocks, x, layer, xs=(), *, key: jax.Array | None, spec: ModelSpec, remat: bool = False):
    """``x, y_i = layer(block_i, x, key_i, xs_i)`` for i < n_layers; returns ``(x, ys)``, ``ys`` (a pytree, may be
    empty) stacked on a leading layer axis, ``xs`` sliced along one.

    With ``spec.scan_layers`` the blocks are one stacked :class:`Block` run by ``nnx.scan`` (one traced body); else
    an ``nnx.List`` run by a Python loop. Layer i's weight-noise key ``key_i`` is ``fold_in(key, i)`` in a scan (its
    layers share one layer path) and ``key`` itself in a loop (each layer folds in its own path); ``None`` stays
    ``None``. ``remat`` recomputes each layer's activations in the backward pass (``nnx.remat`` around ``layer``).

    In a diagnostics pass (:func:`lpt.models.probes.active`) there is no remat (no backward). In a scan each layer
    collects its statistics into its own collector, returned as a scan output and reduced over the layers into the
    caller's (no tracer leaves the scan); in a loop the layers record into the caller's collector directly.

    Args:
      blocks: the model's blocks: one stacked :class:`Block` (``spec.scan_layers``) or an ``nnx.List``.
      x: the carried activations.
      layer: ``layer(block, x, key_i, xs_i) -> (x, y_i)``.
      xs: a pytree with a leading layer axis, sliced per layer.
      key: the weight-noise step key, or None.
      spec: the :class:`lpt.models.config.ModelSpec` (``scan_layers``, ``n_layers``).
      remat: recompute each layer's activations in the backward pass.
    """
    probed = probes.active()
    remat = remat and not probed
    if not spec.scan_layers:
        step = nnx.remat(layer) if remat else layer
        ys = []
        for i, block in enumerate(blocks):
            with layers.in_block(i, spec.n_layers):
                x, y = step(block, x, key, jax.tree.map(lambda a, i=i: a[i], xs))
            ys.append(y)
        return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)

    hows: dict[str, str] = {}

    def body(x, block, i, xs_i):
        k = None if key is None else jax.random.fold_in(key, i)
        with layers.in_block(i, spec.n_layers):
            if not probed:
                return layer(block, x, k, xs_i)
            with probes.collecting() as c:
                x, y = layer(block, x, k, xs_i)
        layer_hows, raw = c.raw()
        hows.update(layer_hows)  # static: the same names and rules for every layer
        return x, (y, raw)

    scan = nnx.scan(
        nnx.remat(body) if remat else body,
        in_axes=(nnx.Carry, 0, 0, 0),
        out_axes=(nnx.Carry, 0),
        transform_metadata=_layers_metadata(spec),
    )
    layer_ids = jnp.arange(spec.n_layers, dtype=jnp.int32)  # each block's index: its key, its bf16_layers choice
    x, ys = scan(x, blocks, layer_ids, xs)
    if probed:
        ys, stacked = ys
        probes.current().add_stacked(hows, stacked)
    return x, ys


def _forward_layer(block: Block, x_BTD: jax.Array, key: jax.Array | None, _) -> tuple[jax.Array, tuple]:
    return block(x_BTD, key=key), ()


class Transformer(nnx.Module):
    """``model(tokens_BT, *, key=None) -> logits_BTV`` (float32).

    ``key`` is the per-step key (the trainer passes ``fold_in(seed_key, step)``); only GaussWS/DiffQ layers use it,
    folding in their layer path (and, with ``scan_layers``, the layer index). ``key=None`` means evaluation: no
    weight noise.

    ``model.decode(tokens_BT, cache, *, last_only=False) -> (logits_BTV, cache)``: the same network over T new
    tokens per row with a :class:`lpt.models.decode.KVCache` (generation; no weight noise).
    """

    def __init__(self, spec: ModelSpec, prec: Precision, *, rngs: nnx.Rngs):
        self.spec, self.prec = spec, prec
        D, V = spec.d_model, spec.vocab_size
        self.embed = Embed(V, D, axes=("vocab", "embed"), std=spec.init_std, prec=prec, rngs=rngs)
        self.pos_embed = (
            Embed(spec.max_seq_len, D, axes=(None, "embed"), std=spec.init_std, prec=prec, rngs=rngs)
            if spec.kind == "gpt2"
            else None
        )
        if spec.scan_layers:
            self.blocks = _stacked_blocks(spec, prec, rngs)
        else:
            self.blocks = nnx.List([Block(spec, prec, block=i, rngs=rngs) for i in range(spec.n_layers)])
        Norm = RMSNorm if spec.kind == "llama" else LayerNorm
        self.final_norm = Norm(D, eps=spec.norm_eps, prec=prec)
        self.lm_head = (
            None
            if spec.tie_embeddings
            else Linear(
                D,
                V,
                axes=("embed", "vocab"),
                projection="lm_head",
                std=spec.init_std,
                prec=prec,
                path="lm_head",
                rngs=rngs,
            )
        )

    def __call__(self, tokens_BT: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        if tokens_BT.ndim != 2:
            raise ValueError(f"tokens must be int[B, T], got shape {tokens_BT.shape}")
        T = tokens_BT.shape[1]
        if T > self.spec.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds config.model.max_seq_len={self.spec.max_seq_len}")
        if not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
            raise ValueError(f"tokens must be integers, got dtype {tokens_BT.dtype}")
        x_BTD = self.embed(tokens_BT)
        if self.pos_embed is not None:
            x_BTD = x_BTD + self.pos_embed(jnp.arange(T))[None]
        x_BTD = constrain(x_BTD, _BTD)
        x_BTD, _ = run_blocks(self.blocks, x_BTD, _forward_layer, key=key, spec=self.spec, remat=self.spec.remat)
        return self._logits(self.final_norm(x_BTD), key)

    def _logits(self, h_BTD: jax.Array, key: jax.Array | None) -> jax.Array:
        """float32 ``h @ W_head`` (``W_head = Eᵀ`` if tied)."""
        if self.lm_head is None:
            w_DV = view_weight(self.embed.embedding[...], self.prec).T
            kind = self.prec.matmul_for("lm_head")
            logits = matmul(h_BTD, w_DV, kind, jnp.float32, name="lm_head", key=key, path="lm_head", prec=self.prec)
        else:
            logits = self.lm_head(h_BTD, key=key, out_dtype=jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))

    def decode(self, tokens_BT: jax.Array, cache: KVCache, *, last_only: bool = False) -> tuple[jax.Array, KVCache]:
        """``(logits_BTV, cache)``: the T new tokens of every row written at slots ``cache.index …`` (positions
        ``cache.positions(T)``, attending ``cache.mask(T)``; see :mod:`lpt.models.decode`), float32 logits, and the
        cache advanced by T. ``last_only`` returns the logits of the last new token only (``[B, 1, V]``). The caller
        keeps ``cache.index + T ≤ cache.length`` (:func:`lpt.models.decode.prefill` and the generator check it)."""
        if tokens_BT.ndim != 2 or not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
            raise ValueError(f"tokens must be int[B, T], got shape {tokens_BT.shape} dtype {tokens_BT.dtype}")
        B, T = tokens_BT.shape
        if cache.k.shape[1] != B or T > cache.length:
            raise ValueError(
                f"tokens of shape {(B, T)} do not fit a cache of {cache.k.shape[1]} rows x {cache.length} slots"
            )
        positions_BT = cache.positions(T)
        x_BTD = self.embed(tokens_BT)
        if self.pos_embed is not None:
            x_BTD = x_BTD + self.pos_embed(positions_BT)
        mask_BTS = cache.mask(T, self.spec.sliding_window)

        def decode_layer(block: Block, x_BTD, _, kv):
            x_BTD, k_BSKD, v_BSKD = block.decode(
                x_BTD, *kv, index=cache.index, positions_BT=positions_BT, mask_BTS=mask_BTS
            )
            return x_BTD, (k_BSKD, v_BSKD)

        x_BTD, (k_LBSKD, v_LBSKD) = run_blocks(
            self.blocks, x_BTD, decode_layer, (cache.k, cache.v), key=None, spec=self.spec
        )
        if last_only:
            x_BTD = x_BTD[:, -1:]
        logits_BTV = self._logits(self.final_norm(x_BTD), None)
        return logits_BTV, cache.replace(k=k_LBSKD, v=v_LBSKD, index=cache.index + T)

    def aux_loss(self) -> jax.Array:
        """The PQT bitwidth loss ``λ Σ_layers mean_tiles |b_t − b_target|`` (Ahn & Yoo (GaussWS), Eq. 12; float32 0
        without PQT).

        Add it to the training loss."""
        return pqt_wiring.aux_loss(self)


def build_model(model_cfg: ModelSpec, precision_cfg: Precision, *, rngs: nnx.Rngs) -> Transformer:
    """Build the transformer of ``config.model`` with the recipe ``config.precision`` (see lpt.models.config).

    Weights: N(0, init_std²); the "out" and "down" projections N(0, init_std² / (2 n_layers)) (GPT-2); norm scales
    1, biases 0; drawn from ``rngs.params()`` by :func:`lpt.models.layers.init_state` (one flat draw). Works
    inside ``jax.jit`` (e.g. with ``out_shardings`` for a sharded init) and under ``nnx.eval_shape``.
    """
    spec, prec = model_spec(model_cfg), build(Precision, precision_cfg)
    key = rngs.params()
    abstract = nnx.eval_shape(lambda: Transformer(spec, prec, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    state = jax.jit(init_state)(abstract_state, key)
    return nnx.merge(graphdef, state)
