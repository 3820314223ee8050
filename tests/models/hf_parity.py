"""What the Hugging Face parity tests compare: logits of lpt and transformers on a padded batch, and greedy tokens
from both, one prompt at a time and as one left-padded batch."""

import jax
import numpy as np
import torch
from flax import nnx

from lpt.generate import generate_tokens


def padded_batch(T: int, vocab: int, seed: int = 0):
    """tokens int32[3, T], right-padded (pad id 0) to lengths T, T - 5, T // 2, and the attention mask."""
    tokens = np.random.RandomState(seed).randint(1, vocab, (3, T)).astype(np.int32)
    mask = (np.arange(T)[None, :] < np.array([[T], [T - 5], [T // 2]])).astype(np.int64)
    return tokens * mask.astype(np.int32), mask


def torch_logits(model, tokens, mask):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask))
    return out.logits.float().numpy()


def lpt_logits(model, tokens):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens))


def max_diff(a, b, mask) -> float:
    return float(np.abs(a - b)[mask.astype(bool)].max())


def greedy_both(tm, model, prompts, n: int):
    """``(lpt batched, lpt single, transformers batched, transformers single)``: n greedy tokens per prompt, the
    batch left-padded with id 0 for transformers."""
    batched = generate_tokens(model, prompts, max_new_tokens=n, temperature=0.0)
    single = [generate_tokens(model, [p], max_new_tokens=n, temperature=0.0)[0] for p in prompts]
    P = max(map(len, prompts))
    ids, attn = np.zeros((len(prompts), P), np.int64), np.zeros((len(prompts), P), np.int64)
    for row, p in enumerate(prompts):
        ids[row, P - len(p) :], attn[row, P - len(p) :] = p, 1
    kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref_batched = tm.generate(torch.tensor(ids), attention_mask=torch.tensor(attn), **kw)[:, P:].tolist()
        ref_single = [tm.generate(torch.tensor([p]), **kw)[0, len(p) :].tolist() for p in prompts]
    return batched, single, ref_batched, ref_single
