"""Greedy decoding tokens/s with the KV cache relative to recomputing the full forward for every token, in one run.

    python benchmarks/decode.py [--config configs/tiny_cpu.py] [--batch 1] [--prompt-len 8] [--new-tokens 56]
        [--rounds 3] [--config.model.KEY=VALUE ...] [--config.precision.KEY=VALUE ...]

Both decoders use the same randomly initialised model (``config.model``, ``config.precision``), the same random
prompts (``--batch`` rows of ``--prompt-len`` tokens) and make ``--new-tokens`` greedy tokens per row:

* with cache: :func:`lpt.generate.generate_tokens` (prefill once, then one jitted decode step per token, each token
  fetched to the host as the generator does);
* without cache (the baseline): one jitted step per token that runs the model's ordinary forward over the whole
  token buffer ``[batch, prompt_len + new_tokens − 1]`` (fixed shape: one compilation; the slots after the current
  token are zeros the causal mask ignores), takes the argmax at the current position and writes it into the buffer.

Each is timed over the whole generation after one untimed warm-up generation (compilation), best of ``--rounds``
interleaved rounds. Prints the tokens/s of both (``batch · new_tokens / seconds``), the ratio cache / no cache,
and checks that both produced the same tokens (float32 compute; in bfloat16 they may part ways at a near tie).
"""

from __future__ import annotations

import argparse
import sys
import time

from lpt import targets

targets.compile_only_environment()  # CPU computation unless a GPU/TPU is attached; before jax initialises

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from lpt import generate as gen  # noqa: E402
from lpt import models  # noqa: E402
from lpt.train import config as config_lib  # noqa: E402
from lpt.train.machine import describe  # noqa: E402


def no_cache_decoder(model, prompts_BP: np.ndarray, new: int):
    """``run() -> tokens[B, new]``: greedy decoding that recomputes the full forward for every token."""
    graphdef, state = nnx.split(model)
    B, P = prompts_BP.shape

    @jax.jit
    def step(st, buf_BT, pos):
        logits_BTV = nnx.merge(graphdef, st)(buf_BT)
        tok_B = jnp.argmax(jax.lax.dynamic_index_in_dim(logits_BTV, pos - 1, axis=1, keepdims=False), -1)
        tok_B = tok_B.astype(jnp.int32)  # int -> int32
        return jax.lax.dynamic_update_index_in_dim(buf_BT, tok_B, jnp.minimum(pos, buf_BT.shape[1] - 1), axis=1), tok_B

    def run():
        buf = jnp.zeros((B, P + new - 1), jnp.int32).at[:, :P].set(prompts_BP)
        toks = []
        for i in range(new):
            buf, tok_B = step(state, buf, P + i)
            toks.append(tok_B)
        return np.stack([np.asarray(t) for t in toks], 1)

    return run


def cache_decoder(model, prompts_BP: np.ndarray, new: int):
    def run():
        return np.array(gen.generate_tokens(model, prompts_BP.tolist(), max_new_tokens=new, temperature=0.0))

    return run


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny_cpu.py")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=56)
    p.add_argument("--rounds", type=int, default=3)
    args, rest = p.parse_known_args(argv)
    cfg = config_lib.apply_overrides(config_lib.load_config_file(args.config), config_lib.parse_overrides(rest))
    model = models.build_model(cfg.model, cfg.precision, rngs=nnx.Rngs(cfg.train.seed))
    rng = np.random.default_rng(0)
    prompts_BP = rng.integers(1, cfg.model.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
    new = args.new_tokens
    runs = {"no cache": no_cache_decoder(model, prompts_BP, new), "cache": cache_decoder(model, prompts_BP, new)}
    tokens = {name: run() for name, run in runs.items()}  # warm-up: compilation
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            tokens[name] = run()
            best[name] = min(best[name], time.perf_counter() - t0)
    n_params = models.param_count(cfg.model)
    print(f"machine: {describe()}")
    print(
        f"model: {cfg.model.kind} d_model={cfg.model.d_model} n_layers={cfg.model.n_layers} "
        f"heads={cfg.model.n_heads}/{cfg.model.n_kv_heads} d_ff={cfg.model.d_ff} scan_layers={cfg.model.scan_layers} "
        f"({n_params / 1e6:.1f}M params), "
        f"compute {cfg.precision.compute_dtype}; batch {args.batch}, prompt {args.prompt_len}, {new} new tokens"
    )
    rate = {name: args.batch * new / s for name, s in best.items()}
    for name in runs:
        print(f"{name:>9}: {rate[name]:9.1f} tokens/s ({best[name]:.3f} s)")
    print(f"ratio cache / no cache: {rate['cache'] / rate['no cache']:.2f}x")
    same = np.array_equal(tokens["cache"], tokens["no cache"])
    print(f"same tokens: {same}")
    return 0 if same or cfg.precision.compute_dtype != "float32" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
