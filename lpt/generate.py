"""``python -m lpt.generate (--workdir RUN | --hf PATH) --prompt TEXT [--prompt TEXT ...]``: sample text from a model.

Options: ``--max-new-tokens N`` (default: fill the context, ``max_seq_len − longest prompt + 1``), ``--temperature T``
(default 1.0; 0 = greedy), ``--top-k K`` (0 = off), ``--top-p P`` (nucleus, in (0, 1]; 1 = off), ``--seed S``
(default 0; the same seed and prompts give the same text), ``--dtype float32|bfloat16`` (compute dtype; default the
run's own, float32 for ``--hf``), ``--step N`` (``--workdir``: the checkpoint step, default the newest).

``--workdir RUN`` reads the run's checkpoint (:func:`lpt.train.load_params`) and its config, builds the model with
the run's ``config.model`` and ``config.precision`` and decodes text with the run's tokenizer
(``config.data.tokenizer``). ``--hf PATH`` loads a Hugging Face directory with :func:`lpt.models.from_pretrained`
(``--dtype`` is its ``param_dtype``) and uses ``PATH/tokenizer.json`` if there is one, else bytes for a model of 256
ids (said on stderr; another vocabulary is refused: :func:`lpt.inference.hf_tokenizer`).

Output: one prompt: the prompt, then each new token's text as soon as it is decoded (text that ends inside a UTF-8
character waits for the next token). Several prompts: they are decoded as one batch, and when it is done each is
printed as ``[i] prompt+completion``, in the order given. Generation stops at ``--max-new-tokens`` or at the
tokenizer's separator (end-of-text) token, which is not printed. A summary (tokens; seconds in all, compilation
included; tokens/s after the first step, compilation excluded) goes to stderr. Exit codes: 0 done, 2 bad input
(one line on stderr).

Devices: every device of the machine, on the run's own ``train.mesh`` (FSDP over all devices for ``--hf``, or when
the run's mesh needs more devices than there are), the parameters and the KV cache split as the trainer splits them
(:func:`lpt.inference.inference_mesh`); the model is loaded by :func:`lpt.inference.load_model`.

From Python: :func:`generate` (text in, text out) and :func:`generate_tokens` (token ids); both prefill the
left-padded prompts once and then run one jitted decode step per token with the KV cache
(:mod:`lpt.models.decode`); sampling is :func:`sample`. See docs/generation.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lpt.inference import inference_mesh, load_model, model_arguments
from lpt.models.decode import decode_step, init_cache, left_pad
from lpt.models.partitioning import place
from lpt.train import console
from lpt.train.step import on_mesh


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits (static: part of the jitted step's key)."""

    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # keep the k largest logits (0: all)
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches p (1: all)
    vocab: int = 0  # ids >= vocab are never drawn (a model vocabulary padded beyond the tokenizer's); 0: all

    def check(self, model_vocab: int) -> None:
        """ValueError (one line) for a value outside its allowed range."""
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        if not 0 <= self.vocab <= model_vocab:
            raise ValueError(f"vocab={self.vocab!r} must be in [0, {model_vocab}] (the model's vocabulary)")
        n = self.vocab or model_vocab
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= n:
            raise ValueError(f"top_k={self.top_k!r} must be an int in [0, {n}] (0 = off; {n} = the vocabulary)")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1] (1 = off)")


def sample(logits_BV: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """int32[B]: the next token of every row from float32 ``logits_BV``.

    Greedy if ``s.temperature == 0`` (argmax; ties to the lowest id). Otherwise ``z = logits / temperature``; top-k
    keeps the k largest ``z`` (ties with the k-th kept too); top-p sorts the rest by probability and keeps the
    shortest prefix whose probability mass reaches ``top_p`` (at least one token; ties with the last kept too);
    the token is drawn from ``softmax(z)`` over the kept ids with ``jax.random.categorical(key, ·)``."""
    z_BV = logits_BV if not s.vocab else logits_BV[:, : s.vocab]
    if s.temperature == 0:
        return jnp.argmax(z_BV, axis=-1).astype(jnp.int32)  # int -> int32
    z_BV = z_BV.astype(jnp.float32) / s.temperature  # f32 logits -> f32
    if s.top_k:
        kth_B1 = jax.lax.top_k(z_BV, s.top_k)[0][:, -1:]
        z_BV = jnp.where(z_BV < kth_B1, -jnp.inf, z_BV)
    if s.top_p < 1.0:
        sorted_BV = -jnp.sort(-z_BV, axis=-1)  # descending
        p_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(p_BV, axis=-1) - p_BV  # mass of the more likely tokens
        cut_B1 = jnp.min(jnp.where(before_BV < s.top_p, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        z_BV = jnp.where(z_BV < cut_B1, -jnp.inf, z_BV)
    return jax.random.categorical(key, z_BV, axis=-1).astype(jnp.int32)  # int -> int32


def _rules(mesh):
    """The trainer's trace-time sharding rules on ``mesh`` (:func:`lpt.train.step.on_mesh`); none without a mesh."""
    return contextlib.nullcontext() if mesh is None else on_mesh(mesh)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "length", "mesh"))
def _prefill(state, tokens_BP, start_B, key, *, graphdef, sampling: Sampling, length: int, mesh):
    with _rules(mesh):
        model = nnx.merge(graphdef, state)
        cache = init_cache(model, tokens_BP.shape[0], length, start=start_B)
        logits_B1V, cache = model.decode(tokens_BP, cache, last_only=True)
        return sample(logits_B1V[:, 0], jax.random.fold_in(key, 0), sampling), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "mesh"), donate_argnames=("cache",))
def _step(state, tokens_B, cache, key, i, *, graphdef, sampling: Sampling, mesh):
    with _rules(mesh):
        logits_BV, cache = decode_step(nnx.merge(graphdef, state), tokens_B, cache)
        return sample(logits_BV, jax.random.fold_in(key, i), sampling), cache


def generate_tokens(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_tokens: Sequence[int] = (),
    vocab: int = 0,
    on_token: Callable[[int, int], None] | None = None,
    mesh: Mesh | None = None,
) -> list[list[int]]:
    """The new token ids of every prompt (a list of token ids), without the stop token.

    The prompts are left-padded into one batch and prefilled once into a KV cache of ``P + N − 1`` slots (P the
    longest prompt, N = ``max_new_tokens``; default ``max_seq_len − P + 1``, the most the context holds); then one
    jitted decode step per token. Token i (0-based) is drawn with ``fold_in(PRNGKey(seed), i)`` (:func:`sample`).
    A row stops at its first token in ``stop_tokens``; generation ends when every row has stopped or after N
    tokens. ``on_token(row, token)`` is called for every kept token as soon as it is on the host. ``vocab`` > 0
    restricts sampling to ids below it.

    ``mesh``: the variables are placed on it as the trainer shards them (:func:`lpt.models.partitioning.place`)
    and the steps are traced under the trainer's rules, so the batch and the KV cache split over the data and fsdp
    axes and the heads over tensor. The batch is filled up to a multiple of data*fsdp with copies of the last prompt,
    whose tokens are dropped; the other rows draw the same tokens as without a mesh.

    Args:
      model: an lpt model with ``decode`` (``model.spec`` gives ``vocab_size`` and ``max_seq_len``).
      prompts: one list of token ids per row, each id in ``[0, vocab_size)``, at most ``max_seq_len`` long.
      max_new_tokens: N, a positive int up to ``max_seq_len − P + 1``; None: that most.
      temperature: 0 draws greedily (argmax); > 0 divides the logits (:class:`Sampling`).
      top_k: keep the k largest logits, in ``[0, vocab or the model's vocabulary]``; 0: off.
      top_p: nucleus mass in (0, 1]; 1: off.
      seed: the sampling key's seed.
      stop_tokens: token ids that end a row.
      vocab: sample only ids below it, at most the model's vocabulary; 0: all.
      on_token: ``on_token(row, token)`` per kept token, or None.
      mesh: a device mesh with ``data``, ``fsdp`` and ``tensor`` axes, or None: no mesh.
    """
    spec = model.spec
    sampling = Sampling(float(temperature), top_k, float(top_p), vocab)
    sampling.check(spec.vocab_size)
    tokens_BP, start_B = left_pad(prompts)
    bad = [int(t) for t in tokens_BP.ravel() if not 0 <= t < spec.vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the model's vocabulary [0, {spec.vocab_size})")
    B, P = tokens_BP.shape
    if P > spec.max_seq_len:
        raise ValueError(f"a prompt of {P} tokens is longer than config.model.max_seq_len={spec.max_seq_len}")
    room = spec.max_seq_len - P + 1
    n = room if max_new_tokens is None else max_new_tokens
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if n > room:
        raise ValueError(
            f"max_new_tokens={n} does not fit: the longest prompt has {P} tokens and the model sees at most "
            f"max_seq_len={spec.max_seq_len} (prompt + new tokens - 1); use at most {room}"
        )
    if mesh is None:
        graphdef, state = nnx.split(model)
    else:
        graphdef, state = place(model, mesh)
        fill = -B % (mesh.shape["data"] * mesh.shape["fsdp"])  # extra rows: copies of the last prompt
        tokens_BP = np.concatenate([tokens_BP, np.repeat(tokens_BP[-1:], fill, axis=0)])
        start_B = np.concatenate([start_B, np.repeat(start_B[-1:], fill)])
    key = jax.random.PRNGKey(seed)
    stop = {int(t) for t in stop_tokens}
    static = dict(graphdef=graphdef, sampling=sampling, mesh=mesh)
    tok_B, cache = _prefill(state, tokens_BP, start_B, key, length=P + n - 1, **static)
    out: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for i in range(n):
        nxt = None
        if i + 1 < n:  # dispatch the next step before fetching this token: the device keeps busy
            nxt, cache = _step(state, tok_B, cache, key, i + 1, **static)
        for b, t in enumerate(np.asarray(tok_B)[:B].tolist()):
            if done[b]:
                continue
            if t in stop:
                done[b] = True
                continue
            out[b].append(t)
            if on_token is not None:
                on_token(b, t)
        if all(done):
            break
        tok_B = nxt
    return out


class TextStream:
    """Incremental decoding of one row: :meth:`add` a token, get the text it completes (possibly "").

    The text is ``decode(prompt + new)`` past ``decode(prompt)``, so tokenizers whose pieces depend on their left
    neighbour (a leading space) decode as in the full text; text ending in U+FFFD (a UTF-8 character cut between
    tokens) is held back until the next token completes it, or until :meth:`flush`."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int]):
        self.tokenizer, self.ids = tokenizer, list(prompt_ids)
        self.prefix = tokenizer.decode(self.ids)
        self.printed = len(self.prefix)

    def text(self) -> str:
        """The completion so far."""
        full = self.tokenizer.decode(self.ids)
        return full[len(self.prefix) :] if full.startswith(self.prefix) else full[self.printed :]

    def add(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        new, self.printed = full[self.printed :], max(self.printed, len(full))
        return new

    def flush(self) -> str:
        full = self.tokenizer.decode(self.ids)
        new, self.printed = full[self.printed :], max(self.printed, len(full))
        return new


def _encode_prompts(tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt (an empty prompt is the separator token alone: the start of a document)."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    return [tokenizer.encode(p) or [tokenizer.separator] for p in prompts]


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    on_text: Callable[[int, str], None] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    mesh: Mesh | None = None,
) -> list[str]:
    """The completion of every prompt (text; :func:`generate_tokens` on the tokenizer's ids).

    Stops at the tokenizer's separator (end-of-text) token; samples only ids the tokenizer has.
    ``on_text(row, text)`` receives each row's new text as soon as it is decoded (:class:`TextStream`),
    ``on_token(row, token)`` each new token id; ``mesh`` as for :func:`generate_tokens`.

    Args:
      model: an lpt model with ``decode``, whose vocabulary holds the tokenizer's.
      tokenizer: a tokenizer of :mod:`lpt.data.tokenizer` (``encode``, ``decode``, ``separator``, ``vocab_size``).
      prompts: the prompt texts, a non-empty list; an empty prompt is the separator alone.
      max_new_tokens, temperature, top_k, top_p, seed: as :func:`generate_tokens` (here ``temperature`` 1.0 by
        default).
      on_text: ``on_text(row, text)`` per piece of new text, or None.
      on_token: ``on_token(row, token)`` per new token id, or None.
      mesh: as :func:`generate_tokens`.
    """
    ids = _encode_prompts(tokenizer, prompts)
    if tokenizer.vocab_size > model.spec.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model.spec.vocab_size}; "
            "use the tokenizer the model was trained with"
        )
    streams = [TextStream(tokenizer, p) for p in ids]

    def on_row_token(row: int, token: int) -> None:
        if on_token is not None:
            on_token(row, token)
        text = streams[row].add(token)
        if on_text is not None and text:
            on_text(row, text)

    generate_tokens(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_tokens=(tokenizer.separator,),
        vocab=tokenizer.vocab_size,
        on_token=on_row_token,
        mesh=mesh,
    )
    for row, s in enumerate(streams):
        rest = s.flush()
        if on_text is not None and rest:
            on_text(row, rest)
    return [s.text() for s in streams]


def main(argv: list[str] | None = None) -> int:
    console.setup()
    parser = model_arguments("python -m lpt.generate", __doc__.split("\n\n")[0])
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: fill the model's context")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    args = parser.parse_args(argv)
    try:
        model, tokenizer, cfg = load_model(args.workdir, args.hf, step=args.step, dtype=args.dtype)
        mesh = inference_mesh(cfg)
        single = len(args.prompt) == 1
        counts = [0] * len(args.prompt)
        shown = [False]  # the prompt is echoed with the first new text, once the inputs were accepted
        first = {}  # the time the first step's tokens arrived (after the prefill and the decode step compiled)

        def on_token(row: int, token: int) -> None:
            counts[row] += 1
            if "time" not in first:
                first["time"], first["tokens"] = time.time(), len(args.prompt)

        def on_text(row: int, text: str) -> None:
            if single:
                print(("" if shown[0] else args.prompt[0]) + text, end="", flush=True)
                shown[0] = True

        t0 = time.time()
        kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        completions = generate(
            model,
            tokenizer,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            on_text=on_text,
            on_token=on_token,
            mesh=mesh,
            **kw,
        )
        seconds = time.time() - t0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if single:
        print("" if shown[0] else args.prompt[0], flush=True)
    else:
        for row, (p, c) in enumerate(zip(args.prompt, completions, strict=True)):
            print(f"[{row}] {p}{c}", flush=True)
    n = sum(counts)
    steady = n - first.get("tokens", n)  # the tokens after the first step: compiled programs only
    elapsed = t0 + seconds - first["time"] if first else 0.0
    rate = f"; {steady / elapsed:.1f} tokens/s after the first step (compilation excluded)" if steady > 0 else ""
    print(f"generated {n} tokens in {seconds:.2f} s{rate}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
