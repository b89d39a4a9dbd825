"""
LIMe (Layer-Integrated Memory): a LLaMA-style decoder in which every attention layer
reads the keys and values of all earlier layers, not only its own.

A vanilla decoder layer l computes K_l, V_l from its own residual stream and attends
over them. Here layer l first writes its own K/V (per kv-head, before RoPE) to a buffer
shared by all layers, then builds the K/V it attends over as a learned mixture of every buffered
(layer, head) pair up to and including itself:

    kv~[l, h] = sum_{l' <= l} sum_{h'} R^(l)[h, l', h'] * kv[l', h']

R^(l) is the "router": (n_kv_head, l + 1, n_kv_head) numbers per layer, about 0.01%
of the parameters. It starts as the identity on the layer's own heads, so a fresh
LIMe model begins close to LLaMA; everything else is Kaiming-uniform. Keys and values
share one router. Queries are untouched. Routing mixes vectors at one position only,
and RoPE rotates every head at a position alike, so we route before RoPE and the KV
cache holds the routed, rotated K/V: exactly the size of a normal cache.

What differs from nanoGPT, in reading order:
  * LLaMA blocks: RMSNorm, RoPE, SwiGLU, no biases, grouped-query attention.
  * `KVBuffer`, `Route`, `Router`: the routing, with the ablation modes of the paper
    (`none`, `lime`, `average`, `last-J`, `first-J`, `dynamic`). `Route` is an autograd
    Function with a hand-written backward over one preallocated buffer: each layer's K/V
    is stored once, so training memory stays O(L) (the official code saves a freshly
    concatenated buffer per layer, O(L^2)), and routing a layer is one matrix product.
  * `GPT.routing_weights()`, `num_params()` and `estimate_flops()` for analysis.
"""

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ROUTER_FORMS = "none, lime, average, dynamic, last-J or first-J (J a positive integer)"


@dataclass
class GPTConfig:
    block_size: int = 2048  # longest sequence; sizes the RoPE table and the KV cache
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12  # number of decoder blocks (L)
    n_head: int = 12  # query heads per layer
    n_kv_head: int = 12  # key/value heads per layer; divides n_head (fewer = GQA)
    n_embd: int = 768  # residual stream width (d)
    mlp_hidden: int = 3072  # SwiGLU hidden width
    router: str = "lime"  # routing mode: none, lime, average, last-J, first-J, dynamic
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon

    def __post_init__(self):
        parse_router(self.router)
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")


def parse_router(spec):
    """'first-4' -> ('first', 4); 'lime' -> ('lime', 0). Anything else is a ValueError."""
    m = re.fullmatch(r"(none|lime|average|dynamic)|(last|first)-([1-9][0-9]*)", str(spec))
    if m is None:
        raise ValueError(f"unknown router {spec!r}: expected {ROUTER_FORMS}")
    return (m[1], 0) if m[1] else (m[2], int(m[3]))


def source_layers(mode, J, layer):
    """The earlier layers (ascending, the layer itself last) that `layer` may read."""
    if mode == "last":
        return list(range(max(0, layer - J + 1), layer + 1))
    if mode == "first":
        return sorted(set(range(min(layer + 1, J))) | {layer})
    return list(range(layer + 1)) if mode != "none" else [layer]


# -----------------------------------------------------------------------------
# Routing


class KVBuffer:
    """Every layer's K/V for one forward pass, in one tensor laid out slot-major: row
    `layer * n_kv_head + head` holds that head's B*T*2*head_dim numbers. Routing layer l is
    then a single matrix product R^(l) @ rows[:(l+1) * n_kv_head], with no copies."""

    def __init__(self, n_layer, n_kv_head):
        self.n_slots, self.n_kv = n_layer * n_kv_head, n_kv_head
        self.data = self.grad = None  # (n_slots, B*T*2*head_dim), made on first use in the K/V's dtype

    def rows(self, t, first_layer, end_layer):
        return t[first_layer * self.n_kv: end_layer * self.n_kv]


class Route(torch.autograd.Function):
    """Writes layer `layer`'s K/V (B, T, n_kv, D) into the buffer, returns the routed K/V
    (n_kv, B, T, D) mixed from the source layers `runs` (contiguous (first, end) ranges).

    Memory: the buffer holds each layer's K/V once, and it is the only thing saved for
    backward (one storage for all layers). Autograd through torch.cat or torch.stack would
    save a fresh (l+1)-layer copy per layer, O(L^2). Writes go through `.data`, so later
    layers' writes do not trip autograd's version check on what earlier layers saved: a
    layer only reads rows that are final before it runs.

    Backward runs from the last layer down; each layer adds its share into `grad` rows in
    place. When layer l's turn comes every later layer has already sent its share to slot
    l, so the gradient of layer l's own K/V is complete and goes back to autograd.
    """

    @staticmethod
    def forward(ctx, weight, kv, buf, layer, runs, dynamic):
        B, T, n_kv, D = kv.shape
        if buf.data is None:
            buf.data = kv.new_empty(buf.n_slots, B * T * D)
        buf.rows(buf.data.data, layer, layer + 1).view(n_kv, B, T, D).copy_(kv.permute(2, 0, 1, 3))
        w = weight.to(kv.dtype)
        if dynamic:  # w (n_src, n_kv, B*T): per-token weights over layers 0..l, within each head
            out = (w.unsqueeze(-1) * buf.rows(buf.data, 0, layer + 1).view(*w.shape, D)).sum(0)
        else:  # w (n_kv, n_src, n_kv): one product per contiguous run of source layers
            out, col = 0, 0
            for first, end in runs:
                out = out + w[:, col: col + end - first].flatten(1) @ buf.rows(buf.data, first, end)
                col += end - first
        ctx.save_for_backward(weight, buf.data)
        ctx.buf, ctx.layer, ctx.runs, ctx.dynamic, ctx.shape = buf, layer, runs, dynamic, kv.shape
        return out.view(n_kv, B, T, D)

    @staticmethod
    def backward(ctx, grad):
        weight, data = ctx.saved_tensors
        buf, (B, T, n_kv, D) = ctx.buf, ctx.shape
        if ctx.layer == buf.n_slots // buf.n_kv - 1:  # the last layer's backward comes first
            buf.grad = torch.zeros_like(data)  # (again, if a retained graph is run backward twice)
        g = grad.reshape(n_kv, B * T * D).to(data.dtype)
        w = weight.to(data.dtype)
        need_w = ctx.needs_input_grad[0]  # not for the fixed weights of `average` and layer 0
        grad_w = None
        if ctx.dynamic:
            rows = buf.rows(data, 0, ctx.layer + 1).view(*w.shape, D)  # (n_src, n_kv, B*T, D)
            grad_w = (rows * g.view(n_kv, B * T, D)).sum(-1)
            buf.rows(buf.grad, 0, ctx.layer + 1).view_as(rows).add_(w.unsqueeze(-1) * g.view(n_kv, B * T, D))
        else:
            parts, col = [], 0
            for first, end in ctx.runs:
                if need_w:
                    parts.append(g @ buf.rows(data, first, end).t())
                buf.rows(buf.grad, first, end).addmm_(w[:, col: col + end - first].flatten(1).t(), g)
                col += end - first
            grad_w = torch.cat(parts, dim=1).view_as(w) if need_w else None
        grad_kv = buf.rows(buf.grad, ctx.layer, ctx.layer + 1).view(n_kv, B, T, D).permute(1, 2, 0, 3)
        return grad_w if grad_w is None else grad_w.to(weight.dtype), grad_kv, None, None, None, None


class Router(nn.Module):
    """Builds layer `layer`'s K/V from the buffered K/V of the layers it may read.

    Static modes hold R as (n_kv_head, n_src, n_kv_head) for the allowed source layers
    only, so excluded sources are zero by construction and stay zero in training.
    `dynamic` mixes layers within each head with per-token weights: a static part plus
    a zero-initialised linear map of the (normalised) attention input. Layer 0 and
    `average` have a fixed weight (the identity at layer 0) and no parameters.
    """

    def __init__(self, config, layer):
        super().__init__()
        self.mode, J = parse_router(config.router)
        self.layer, self.sources = layer, source_layers(self.mode, J, layer)
        self.runs = []  # the sources as contiguous (first, end) ranges: one matrix product each
        for j in self.sources:
            if self.runs and self.runs[-1][1] == j:
                self.runs[-1] = (self.runs[-1][0], j + 1)
            else:
                self.runs.append((j, j + 1))
        self.dynamic = self.mode == "dynamic" and layer > 0
        n_kv, n_src = config.n_kv_head, len(self.sources)
        if self.mode == "average" or layer == 0:  # fixed: same head, uniform over layers 0..l
            w = torch.eye(n_kv).unsqueeze(1).expand(n_kv, n_src, n_kv) / n_src
            self.register_buffer("weight", w.contiguous(), persistent=False)
        elif self.dynamic:
            self.weight = nn.Parameter(torch.empty(n_kv, n_src))
            self.proj = nn.Linear(config.n_embd, n_kv * n_src, bias=False)
        else:
            self.weight = nn.Parameter(torch.empty(n_kv, n_src, n_kv))

    # torch.compile cannot follow the buffer that is kept outside autograd's view, so the
    # routing runs eagerly: one graph break per layer, attention and MLP compile around it
    @torch.compiler.disable
    def forward(self, kv, x, buf):
        """kv (B, T, n_kv, D) this layer's own K/V, x (B, T, C) its input -> (n_kv, B, T, D)."""
        w = self.weight
        if self.dynamic:
            B, T, _ = x.shape
            # (B*T, n_kv, n_src) -> (n_src, n_kv, B*T), plus the static part
            w = self.proj(x).view(B * T, *w.shape).permute(2, 1, 0) + w.t().unsqueeze(-1)
        return Route.apply(w, kv, buf, self.layer, self.runs, self.dynamic)

    def dense_weight(self):
        """R as (n_kv, l + 1, n_kv): zeros for sources this router cannot read."""
        n_kv = self.weight.shape[0]
        R = self.weight.new_zeros(n_kv, self.layer + 1, n_kv)
        w = self.weight.detach()
        if self.dynamic:  # (n_kv, n_src) within-head weights -> (n_kv, n_src, n_kv)
            w = w[:, :, None] * torch.eye(n_kv, device=w.device)[:, None, :]
        R[:, self.sources] = w
        return R


# -----------------------------------------------------------------------------
# The decoder


def rope_tables(config):
    head_dim = config.n_embd // config.n_head
    inv_freq = config.rope_theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(config.block_size).float(), inv_freq)  # (block_size, head_dim/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x1[i], x2[i]) = (x[i], x[i + head_dim/2]) by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)  # each (B, heads, T, head_dim/2)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class KVCache:
    """Routed, rotated K/V of every layer for generation: the size of a vanilla cache."""

    def __init__(self, config):
        self.n_layer, self.block_size = config.n_layer, config.block_size
        self.k = self.v = None  # allocated at the first update, in the K/V's own dtype
        self.pos = 0  # number of positions already filled

    def update(self, layer, k, v):
        B, n_kv, T, head_dim = k.shape
        if self.k is None:
            shape = (self.n_layer, B, n_kv, self.block_size, head_dim)
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        self.k[layer, :, :, self.pos:self.pos + T] = k
        self.v[layer, :, :, self.pos:self.pos + T] = v
        return self.k[layer, :, :, :self.pos + T], self.v[layer, :, :, :self.pos + T]


class Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.layer, self.n_head, self.n_kv_head = layer, config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        # one projection for keys and values: they are routed together, as one 2*head_dim vector
        self.c_kv = nn.Linear(config.n_embd, 2 * config.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        # `none` is the LLaMA baseline: no buffer, no router
        self.router = Router(config, layer) if config.router != "none" else None

    def forward(self, x, buf, cos, sin, cache=None):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        kv = self.c_kv(x).view(B, T, self.n_kv_head, 2 * self.head_dim)  # (B, T, n_kv, 2*head_dim)
        if self.router is None:
            kv = kv.transpose(1, 2)  # (B, n_kv, T, 2*head_dim)
        else:
            kv = self.router(kv, x, buf).transpose(0, 1)  # (n_kv, B, T, 2*head_dim) -> (B, n_kv, T, 2*head_dim)
        k, v = kv.split(self.head_dim, dim=-1)  # each (B, n_kv, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        causal = True
        if cache is not None:
            assert cache.pos == 0 or T == 1, "after the prompt, the cache takes one token at a time"
            causal = cache.pos == 0
            k, v = cache.update(self.layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal and T > 1,
                                           enable_gqa=self.n_kv_head != self.n_head)  # (B, n_head, T, head_dim)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 2 * config.mlp_hidden, bias=False)  # gate and up, fused
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = Attention(config, layer)
        self.ln_2 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, buf, cos, sin, cache=None):
        x = x + self.attn(self.ln_1(x), buf, cos, sin, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config, layer) for layer in range(config.n_layer)),
            ln_f=nn.RMSNorm(config.n_embd, eps=config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied input/output embeddings
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Every initial value of the model, in one place."""
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                # residual-branch outputs shrink with depth (GPT-2); the dynamic router starts at zero
                scale = 0.0 if "router" in name else 1 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj") else 1.0
                nn.init.normal_(module.weight, mean=0.0, std=std * scale)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, Router) and isinstance(module.weight, nn.Parameter):
                # own-layer heads: identity, so training starts from LLaMA's information flow;
                # other allowed sources: Kaiming-uniform over the (layer, head) sources a head reads
                w = module.weight  # (n_kv, n_src, n_kv), or (n_kv, n_src) within-head for `dynamic`
                fan_in = w[0].numel()
                w.uniform_(-math.sqrt(3 / fan_in), math.sqrt(3 / fan_in))
                w[:, -1] = 1.0 if module.dynamic else torch.eye(w.shape[0])

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) token ids -> (logits (B, T, vocab), loss or None); targets of -1 are ignored."""
        B, T = idx.shape
        pos = cache.pos if cache is not None else 0
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence of {pos + T} tokens exceeds block_size={self.config.block_size}")
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]  # (T, head_dim/2)
        buf = KVBuffer(self.config.n_layer, self.config.n_kv_head) if self.config.router != "none" else None
        x = self.transformer.wte(idx)  # (B, T, n_embd)
        for block in self.transformer.h:
            x = block(x, buf, cos, sin, cache)
        if cache is not None:
            cache.pos += T
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, stop=None):
        """Continue idx (B, T) by max_new_tokens with a KV cache; temperature 0 is greedy.
        With `stop` (a token id), ends early once every row has produced it."""
        if idx.shape[1] + max_new_tokens > self.config.block_size:
            raise ValueError(f"prompt of {idx.shape[1]} + {max_new_tokens} new tokens exceeds "
                             f"block_size={self.config.block_size}")
        cache = KVCache(self.config)
        step, done = idx, torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            logits = self(step, cache=cache)[0][:, -1].float()  # (B, vocab)
            if temperature == 0:
                step = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                step = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, step], dim=1)
            if stop is not None:
                done |= step[:, 0] == stop
                if done.all():
                    break
        return idx

    # ---- analysis and accounting ---------------------------------------------------------

    def routing_weights(self):
        """Per layer l, (n_kv_head, l + 1, n_kv_head): weight from (source layer, source head)
        into each target head. Identity on the own layer where there is no router; for
        `dynamic`, the token-independent part."""
        out = []
        for layer, block in enumerate(self.transformer.h):
            router = block.attn.router
            if router is None:
                n_kv = self.config.n_kv_head
                R = torch.zeros(n_kv, layer + 1, n_kv, device=self.rope_cos.device)
                R[:, layer] = torch.eye(n_kv)
            else:
                R = router.dense_weight()
            out.append(R)
        return out

    def num_params(self):
        """Parameter counts by part; the tied embedding is counted once."""
        parts = dict(router="router", wte="embedding", attn="attention", mlp="mlp")  # name fragment -> part
        counts = dict.fromkeys([*parts.values(), "norm"], 0)
        for name, p in self.named_parameters():
            counts[next((part for key, part in parts.items() if key in name), "norm")] += p.numel()
        counts["total"] = sum(counts.values())
        assert counts["total"] == sum(p.numel() for p in self.parameters())
        return counts

    def estimate_flops(self, seq_len=None):
        """Training FLOPs (forward + backward) per token, in the usual 6N-style accounting:

            6 * (weights used in matmuls, the tied head included once, the embedding lookup not)
          + 12 * n_layer * n_head * head_dim * T      (QK^T and AV, non-causal count, as nanoGPT)
          + 6 * sum_l (non-zero routing coefficients of R^(l)) * 2 * head_dim   (the routing)

        The routing term is what LIMe adds: each routed K/V element is a dot product over the
        allowed sources; it grows as O(L^2) with depth in `lime` and `average`.
        """
        c = self.config
        T = seq_len or c.block_size
        head_dim = c.n_embd // c.n_head
        dense = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        attention = 12 * c.n_layer * c.n_head * head_dim * T
        routing = 0
        for block in self.transformer.h:
            router = block.attn.router
            if router is not None and router.layer > 0:  # layer 0 only copies its own K/V
                n_coef = router.weight.numel() if router.mode != "average" else c.n_kv_head * len(router.sources)
                routing += 6 * n_coef * 2 * head_dim
        return 6 * dense + attention + routing
