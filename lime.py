"""
LIMe (Layer-Integrated Memory): a LLaMA-style decoder in which every attention layer
reads the keys and values of all earlier layers, not only its own.

A vanilla decoder layer l computes K_l, V_l from its own residual stream and attends
over them. Here layer l computes its own K/V (per kv-head, before RoPE) and then attends
over a learned mixture of the K/V of every (layer, head) pair up to and including itself:

    kv~[l, h] = sum_{l' <= l} sum_{h'} R^(l)[h, l', h'] * kv[l', h']

R^(l) is the "router": (n_kv_head, l + 1, n_kv_head) numbers per layer, about 0.01%
of the parameters. It starts as the identity on the layer's own heads, so a fresh
LIMe model begins close to LLaMA; everything else is Kaiming-uniform. Keys and values
share one router. Queries are untouched. Routing mixes vectors at one position only,
and RoPE rotates every head at a position alike, so we route before RoPE and the KV
cache holds the routed, rotated K/V: exactly the size of a normal cache.

What differs from nanoGPT, in reading order:
  * LLaMA blocks: RMSNorm, RoPE, SwiGLU, no biases, grouped-query attention.
  * `route_reference`, `Router`, `Routing`: the routing, with the ablation modes of the paper
    (`none`, `lime`, `average`, `last-J`, `first-J`, `dynamic`). `route_reference` is the
    formula above in plain autograd, the specification. Training uses the fast path in
    kernels.py: one op per layer that torch.compile keeps in a single graph, which stores
    each layer's K/V once (training memory O(L); autograd through a stack per layer, as in
    the paper's code, is O(L^2)) and moves each K/V slot as few times as it can.
  * `GPT.routing_weights()`, `num_params()` and `estimate_flops()` for analysis.
"""

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

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
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
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


def route_reference(weight, sources):
    """The routing as the paper writes it, in plain autograd: the specification the fast path
    (kernels.py) is tested against. sources: the K/V (B, T, n_kv, E) of the layers read, in order.

        static:   kv~[h] = sum_{j, h'} weight[h, j, h'] * sources[j][h']     weight (n_kv, n_src, n_kv)
        dynamic:  kv~[h] = sum_j weight[b, t, h, j] * sources[j][h]          weight (B, T, n_kv, n_src)

    Autograd saves the stack, a fresh (l + 1)-layer copy per layer: O(L^2) training memory."""
    src = torch.stack(sources, dim=2)  # (B, T, n_src, n_kv, E)
    if weight.dim() == 3:
        return torch.einsum("hjk,btjke->bthe", weight, src)
    return torch.einsum("bthj,btjhe->bthe", weight, src)


class Router(nn.Module):
    """R^(l) of one layer, over the source layers it may read.

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
        self.readers = []  # the later layers that read this one (ascending), filled in by GPT
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

    def weights(self, x):
        """R for input x (B, T, C): (n_kv, n_src, n_kv), or (B, T, n_kv, n_src) per token for `dynamic`."""
        if not self.dynamic:
            return self.weight
        B, T, _ = x.shape
        return self.proj(x).view(B, T, *self.weight.shape) + self.weight

    def weight_from(self, layer):
        """(n_kv, n_kv): how this layer's heads read the heads of source `layer` (static modes)."""
        return self.weight[:, self.sources.index(layer)]

    def dense_weight(self):
        """R as (n_kv, l + 1, n_kv): zeros for sources this router cannot read."""
        n_kv = self.weight.shape[0]
        R = self.weight.new_zeros(n_kv, self.layer + 1, n_kv)
        w = self.weight.detach()
        if self.dynamic:  # (n_kv, n_src) within-head weights -> (n_kv, n_src, n_kv)
            w = w[:, :, None] * torch.eye(n_kv, device=w.device)[:, None, :]
        R[:, self.sources] = w
        return R


class Routing:
    """Carries K/V from layer to layer during one forward pass.

    Static modes push (see kernels.py): layer j finishes its own routed K/V and adds its share
    to the running sums of the later layers that read it, in one op. `dynamic` weights depend
    on the reading layer's input, so it pulls, one product per source, which autograd saves
    once for every layer that reads it. With reference=True every mode uses route_reference.
    """

    def __init__(self, routers, reference=False):
        self.routers, self.reference = routers, reference
        self.kvs = []  # every layer's own K/V so far (pulling)
        self.partial = {}  # layer -> its routed K/V summed over the sources pushed so far

    def __call__(self, layer, kv, x):
        """kv (B, T, n_kv, E): the layer's own K/V, x (B, T, C) its input -> the routed K/V, same shape."""
        router = self.routers[layer]
        if self.reference or router.mode == "dynamic":
            self.kvs.append(kv)
            w, sources = router.weights(x), [self.kvs[j] for j in router.sources]
            if self.reference or not router.dynamic:  # (dynamic's layer 0 has a fixed identity router)
                return route_reference(w, sources)
            # w (B, T, n_kv, n_src): each source's (B, T, n_kv, E) K/V scaled per token and head, summed
            return sum(w[..., i, None] * src for i, src in enumerate(sources)).type_as(kv)
        targets = [layer] + router.readers
        # the op adds partials to its first outputs: those targets that have a sum already come first
        # (pop raises if they did not), because every mode's readers of a layer are consecutive layers
        partials = [self.partial.pop(l) for l in targets[:sum(l in self.partial for l in targets)]]
        w = torch.stack([self.routers[l].weight_from(layer) for l in targets])  # (n_targets, n_kv, n_kv)
        out, *pushed = kernels.route(kv, w, partials)
        self.partial.update(zip(router.readers, pushed))
        return out


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
        # `none` is the LLaMA baseline: no router
        self.router = Router(config, layer) if config.router != "none" else None

    def forward(self, x, routing, cos, sin, cache=None):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        kv = self.c_kv(x).view(B, T, self.n_kv_head, 2 * self.head_dim)  # (B, T, n_kv, 2*head_dim)
        if routing is not None:
            kv = routing(self.layer, kv, x)  # the routed K/V, same shape
        # split before transposing, so the gradient that reaches the routing comes back contiguous
        k, v = (t.transpose(1, 2) for t in kv.split(self.head_dim, dim=-1))  # each (B, n_kv, T, head_dim)
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

    def forward(self, x, routing, cos, sin, cache=None):
        x = x + self.attn(self.ln_1(x), routing, cos, sin, cache)
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
        # a plain list (the modules are registered in their blocks); each learns who reads it
        self.routers = [block.attn.router for block in self.transformer.h if block.attn.router is not None]
        for r in self.routers:
            r.readers = [later.layer for later in self.routers[r.layer + 1:] if r.layer in later.sources]
        self.reference_routing = False  # True: route with route_reference (slow, O(L^2) memory), as in the tests
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Every initial value of the model, in one place:
          - the embedding (tied with the output head) and every Linear: normal, std 0.02;
          - except the residual branches' outputs (`c_proj`): std 0.02 / sqrt(2 n_layer), as in GPT-2,
          - and the dynamic routers' input maps (`router.proj`): zero, so that they start static;
          - RMSNorm gains: one;
          - learned routers: the identity on the layer's own heads, so that training starts from
            LLaMA's information flow, and Kaiming-uniform U(-b, b), b = sqrt(3 / fan_in), on every
            other allowed source, fan_in being the number of (layer, head) sources a head reads.
        """
        std = 0.02
        for name, module in self.named_modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif name.endswith("router.proj"):
                nn.init.zeros_(module.weight)
            elif name.endswith("c_proj"):
                nn.init.normal_(module.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, Router) and isinstance(module.weight, nn.Parameter):
                w = module.weight  # (n_kv, n_src, n_kv), or (n_kv, n_src) within each head for `dynamic`
                fan_in = w[0].numel()
                w.uniform_(-math.sqrt(3 / fan_in), math.sqrt(3 / fan_in))
                # source_layers() lists the layer itself last, so its own heads are w[:, -1]
                w[:, -1] = 1.0 if module.dynamic else torch.eye(w.shape[0])

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) token ids -> (logits (B, T, vocab), loss or None); targets of -1 are ignored."""
        B, T = idx.shape
        pos = cache.pos if cache is not None else 0
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence of {pos + T} tokens exceeds block_size={self.config.block_size}")
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]  # (T, head_dim/2)
        routing = Routing(self.routers, self.reference_routing) if self.routers else None
        x = self.transformer.wte(idx)  # (B, T, n_embd)
        for block in self.transformer.h:
            x = block(x, routing, cos, sin, cache)
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
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature}: 0 (greedy) or more")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k}: keep at least one token (top_k >= 1), or None for no cut")
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
