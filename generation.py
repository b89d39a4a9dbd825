"""
Generation with a KV cache: generate() calls lime.GPT's forward with a KVCache, which each layer fills.

LIMe's cache is a vanilla one: routing mixes K/V at one position only (lime.py), so each layer's
routed, rotated K/V at a position is fixed once that position has run, the same for every later query.
The cache holds exactly that, one K and one V per (layer, kv-head, position), as LLaMA's does.
"""

import torch
import torch.nn.functional as F


class KVCache:
    """Routed, rotated K/V of every layer for generation: the size of a vanilla cache."""

    def __init__(self, config, length=None):
        self.n_layer = config.n_layer
        self.length = length or config.block_size  # positions it holds: generate() asks for the ones it will fill
        self.k = self.v = None  # allocated at the first update, in the K/V's own dtype
        self.pos = 0  # number of positions already filled (GPT.forward moves it on)

    def update(self, layer, k, v):
        """k, v (B, n_kv, T, head_dim) of `layer` at positions pos..pos + T -> its K, V at 0..pos + T."""
        B, n_kv, T, head_dim = k.shape
        if self.pos + T > self.length:
            raise ValueError(f"the cache holds {self.length} positions, not {self.pos + T}")
        if self.k is None:
            shape = (self.n_layer, B, n_kv, self.length, head_dim)
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        self.k[layer, :, :, self.pos:self.pos + T] = k
        self.v[layer, :, :, self.pos:self.pos + T] = v
        return self.k[layer, :, :, :self.pos + T], self.v[layer, :, :, :self.pos + T]


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, stop=None, lengths=None):
    """Continue idx (B, T) by max_new_tokens with a KV cache; temperature 0 is greedy.
    With `stop` (a token id), ends early once every row has produced it.
    With `lengths` (B,), the rows are prompts of different lengths, padded on the right: row i's
    prompt is idx[i, :lengths[i]], and its continuation starts there. No padding enters the cache:
    all rows run their first min(lengths) tokens together, then one token at a time, and a row takes
    its prompt's next token, not the model's, until its own prompt ends. So each row computes what
    it would alone."""
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature}: 0 (greedy) or more")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: keep at least one token (top_k >= 1), or None for no cut")
    B, T = idx.shape
    if T + max_new_tokens > model.config.block_size:
        raise ValueError(f"prompt of {T} + {max_new_tokens} new tokens exceeds block_size={model.config.block_size}")
    lengths = torch.full((B,), T) if lengths is None else torch.as_tensor(lengths)
    lengths, start = lengths.to(idx.device), int(lengths.min())
    out = torch.cat([idx, idx.new_zeros(B, max_new_tokens)], dim=1)  # (B, T + max_new_tokens)
    # the last token generated is never fed back: the cache holds the positions before it
    cache, step, end = KVCache(model.config, max(T + max_new_tokens - 1, 1)), idx[:, :start], start
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)
    for t in range(start, T + max_new_tokens):
        logits = model(step, cache=cache)[0][:, -1].float()  # (B, vocab)
        if temperature == 0:
            new = logits.argmax(dim=-1)
        else:
            # largest logit shifted to 0, temperature kept nonzero in float32: a tiny one gives greedy, not NaN
            logits = (logits - logits.max(dim=-1, keepdim=True).values) / max(temperature, torch.finfo().tiny)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1): each row's k-th
                logits = logits.masked_fill(logits < kth, -float("inf"))
            new = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)[:, 0]  # (B,)
        generating = t >= lengths  # (B,): the rows past their prompt
        out[:, t] = torch.where(generating, new, out[:, t])
        step, end = out[:, t:t + 1], t + 1  # (B, 1)
        if stop is not None:
            done |= generating & (new == stop)
            if done.all():
                break
    return out[:, :end]
