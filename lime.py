"""
LIMe (Layer-Integrated Memory): a LLaMA-style decoder in which every attention layer
reads the keys and values of all earlier layers, not only its own.

A vanilla layer attends over the K/V it computes from its own residual stream. Here layer l computes its own K/V
(per kv-head, before RoPE), then attends over a learned mixture of the K/V of every (layer, head) pair up to and
including itself:

    kv~[l, h] = sum_{l' <= l} sum_{h'} R^(l)[h, l', h'] * kv[l', h']

R^(l), the "router", is (n_kv_head, l + 1, n_kv_head) numbers; all layers' together, 0.007% of the 150M model. (The
paper's Eq. 2 writes R^(l)_{l', h', h}, layers from 1; here layers count from 0, the index is [target head, source
layer, source head], over the n_kv_head K/V heads as in the paper's code with GQA. Its Appendix A trains R at lr
1e-2, no weight decay: train.py's --router-lr.) It starts as the identity on the layer's own heads and
Kaiming-uniform on earlier layers' (whose share then has about l/(l+1) of the own K/V's variance: a fresh LIMe model
is not LLaMA). Keys and values share one router; queries are untouched. Routing mixes vectors at one position, and
RoPE rotates every head at a position alike, so the two commute: we route before RoPE, and the KV cache
(generation.py) holds each layer's routed, rotated K/V, a normal cache's size. A past position's routed K/V never
changes.

What differs from nanoGPT, in reading order:
  * `route_reference`: the formula above in plain autograd, the specification.
  * `Router`: how a layer reads earlier layers' K/V; one subclass per --router value. Here `lime` (the paper's) and
    `none` (LLaMA); ablations.py, baselines.py and a fork (README "Fork it") add subclasses of Router or of
    `Residual` (the stream between sub-layers). methods.py registers them by name.
  * `Routing`: carries K/V from layer to layer. Most routers are *pushed*: once layer j has its K/V, one op (kernels.py,
    kept whole by torch.compile in its single graph) adds j's share R^(t)[:, j] kv[j] to the running sum, the
    *partial*, of every later layer t that reads j, and finishes kv~[j]. The op saves each layer's K/V once: O(L)
    memory, where autograd through a stack per layer (the paper's code) takes O(L^2). A few are *pulled*: layer l
    gathers its sources and routes them itself.
  * LLaMA blocks: RMSNorm, RoPE, SwiGLU, no biases, grouped-query attention.
  * `GPT.routing_weights()`, `num_params()`, `estimate_flops()` for analysis. GPT has no generate(): generation.py's
    `generate(model, ...)` runs it with a KV cache.
"""

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from cli import POSITIVE, SIZE, check_fields, option
from methods import (Method, check_registered, check_residual, check_router, parse_router, require_initialised,
                     router_forms)

# NOTE a checkpoint's block_size is held by no weight (RoPE is computed), so nothing else bounds it: a hand-edited
# 2**31 - 1 would have allocated its tables (tens of GB) before any check. A million is far past what one trains here
POSITIONS = ("in 1 .. 2**20", lambda x: 0 < x <= 2**20)


@dataclass
class GPTConfig:
    block_size: int = option(2048, "longest sequence; sizes the RoPE tables", rule=POSITIONS)
    vocab_size: int = option(50304, "vocabulary size (GPT-2's 50257 padded up to a multiple of 64 for speed)",
                             rule=SIZE)
    n_layer: int = option(12, "number of decoder blocks (L)", rule=SIZE)
    n_head: int = option(12, "query heads per layer", rule=SIZE)
    n_kv_head: int = option(12, "key/value heads per layer; divides n_head (fewer = GQA)", rule=SIZE)
    n_embd: int = option(768, "residual stream width (d)", rule=SIZE)
    mlp_hidden: int = option(3072, "SwiGLU hidden width", rule=SIZE)
    # a help that is a function is read late, once every router (a fork's too) is defined
    router: str = option("lime", lambda: f"cross-layer method, a router or a baseline: {router_forms()}")
    rope_theta: float = option(10000.0, "RoPE base frequency", rule=POSITIVE)
    norm_eps: float = option(1e-5, "RMSNorm epsilon", rule=POSITIVE)

    def __post_init__(self):
        check_fields(self)
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        parse_router(self.router)

    @classmethod
    def of(cls, config):
        """The model's fields of a larger config (train.py's, a checkpoint's dict); fields added since, defaults."""
        values = config if isinstance(config, dict) else vars(config)
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


# -----------------------------------------------------------------------------
# Routing


def route_reference(weight, kvs):
    """The routing as the paper writes it, in plain autograd: the specification the fast path (kernels.py)
    is tested against. Autograd saves the stack, a fresh (l + 1)-layer copy per layer: O(L^2) training memory.
    kvs: the K/V (B, T, n_kv, E) of the n_src layers read, in order; n_kv = n_kv_head, E = 2*head_dim
    ([keys | values]), or head_dim for the values alone.

        static:     kv~[h] = sum_{j, h'} weight[h, j, h'] * kvs[j][h']     weight (n_kv, n_src, n_kv)
        per token:  kv~[h] = sum_j weight[b, t, h, j] * kvs[j][h]          weight (B, T, n_kv, n_src)"""
    src = torch.stack(kvs, dim=2)  # (B, T, n_src, n_kv, E)
    if weight.dim() == 3:
        return torch.einsum("hjk,btjke->bthe", weight, src)
    return torch.einsum("bthj,btjhe->bthe", weight, src)


class Router(Method):
    """R^(l): how the heads of layer `layer` read the K/V of the layers in `sources`. A router is a
    subclass that says three things (and sets the flags below where they apply):

      name              its --router value, as methods.Method says (one ending in -J takes a number, J:
                        ablations.py's `last-J` is --router=last-4, the 4 most recent layers)
      source_layers()   the layers it reads: distinct, ascending, itself last (by default all up to itself)
      weights(x)        its weights, the one place they are stated (by default the tensor `weight`, which the
                        subclass then makes):
                          (n_kv, n_src, n_kv)  weight[h, j, h']: from head h' of source j into head h, or
                          (n_kv, n_src)        weight[h, j]: from head h of source j into head h (no mixing).
                        A `per_token` router (ablations.py's `dynamic`) returns (B, T, n_kv, n_src) for the
                        attention's input x (B, T, C), ln_1 of the stream, and its token-independent part
                        for x=None.

    The rest is derived from these: push or pull (`pulled`), the dense matrix that analysis reads
    (`dense`), whether top-p pruning applies (pruning.prunable), the FLOPs (GPT.estimate_flops) and the
    initial values (GPT.init_weights; then the class's own init_weights(), if any, may set them anew).
    A model builds the --router method's router at layers 1 and up: make_router puts `Own` at layer 0 (nothing
    earlier to read)."""
    per_token = False  # True: the weights depend on the input x, so its layer pulls its sources (see Routing)
    keys = True  # False: it routes the values only, the keys stay the layer's own (pulled too; as value-residual)
    starts_as_none = False  # True: given none's weights, a fresh model computes none's exactly (tested; value-residual)

    def __init__(self, config, layer, J=None):
        super().__init__()
        self.layer, self.n_kv = layer, config.n_kv_head
        self.sources = self.source_layers(layer, J)  # layer ids (route_reference's `kvs` are their K/V)

    def source_layers(self, layer, J):
        return list(range(layer + 1))

    def weights(self, x=None):
        return self.weight

    def matrix(self):
        """The token-independent weights as (n_kv, n_src, n_kv), within-head weights on the diagonal."""
        w = self.weights()
        if w.dim() == 3:
            return w
        # (n_kv, n_src, 1) * (n_kv, 1, n_kv): weight[h, j] lands at [h, j, h]
        return w[:, :, None] * torch.eye(self.n_kv, device=w.device, dtype=w.dtype)[:, None, :]

    def dense(self):
        """R^(l) as (n_kv, l + 1, n_kv), detached: zeros for the sources this router does not read."""
        R = self.matrix().detach()
        out = R.new_zeros(self.n_kv, self.layer + 1, self.n_kv)
        out[:, self.sources] = R
        return out

    @property
    def pulled(self):
        return self.per_token or not self.keys  # read by its layer (Routing.pull), not pushed by its sources

    def reference(self, kvs, x):
        """The routed K/V by route_reference, from the sources' K/V `kvs` in `self.sources` order."""
        return route_reference(self.weights(x) if self.per_token else self.matrix(), kvs)


class Own(Router):
    """The layer's own K/V alone, weight 1 in each head (kv~[l] = kv[l]): `none`, the LLaMA baseline (GPT skips
    routing for it), and layer 0 (nothing earlier to read) in every mode that routes. Written as equal weights
    within each head over its sources, so that ablations.py's `average` is this class reading every layer."""
    name = "none"

    def __init__(self, config, layer, J=None):
        super().__init__(config, layer, J)
        n_src = len(self.sources)
        self.register_buffer("weight", torch.full((self.n_kv, n_src), 1 / n_src), persistent=False)

    def source_layers(self, layer, J):
        return [layer]


class LIMe(Router):
    """The paper's router: every (layer <= l, head) pair, learned."""
    name = "lime"

    def __init__(self, config, layer, J=None):
        super().__init__(config, layer, J)
        # set in GPT.init_weights: the identity on its own heads, Kaiming-uniform elsewhere (which fills every method's
        # parameters with NaN first, so that one it leaves unset is an error: methods.require_initialised)
        self.weight = nn.Parameter(torch.empty(self.n_kv, len(self.sources), self.n_kv))


def make_router(config, layer):
    """The router of `layer`: None for `none` and a Residual (nothing to route); else --router's, `Own` at layer 0."""
    cls, J = parse_router(config.router)
    if cls is Own or not issubclass(cls, Router):
        return None
    router = cls(config, layer, J) if layer > 0 else Own(config, layer)
    check_router(router, config.n_embd, J)  # NOTE sources and weights() must agree: else a column trains unread
    return router


class Routing:
    """Carries K/V from layer to layer during one forward pass. Routers whose weights are the same at every
    token are pushed (see kernels.py): in one op, layer j finishes its own routed K/V and adds its share to
    the running sums of the later layers that read it. Two kinds are pulled by their layer instead (`pull`):
    a `per_token` router (its weights depend on the layer's input) and a router of the values alone (the op
    routes K and V together). With reference=True every router pulls through route_reference.

    Attention.forward calls it once per layer, in layer order: kv = routing(layer, kv, x). For `lime` at 3 layers,
    readers = [[1, 2], [2], []]: layer 0's op writes its own kv~_0 and starts the sums of kv~_1 and kv~_2, layer 1's
    adds its share to kv~_2 and finishes kv~_1, layer 2's finishes kv~_2."""

    def __init__(self, routers, readers, reference=False):
        self.routers, self.readers, self.reference = routers, readers, reference  # readers: see readers_of
        self.own = []  # every layer's own K/V so far, where a pulled layer reads it (else None: no slot held)
        self.pulled_from = {j for r in routers if reference or r.pulled for j in r.sources}
        self.partial = {}  # layer -> its routed K/V summed over the sources pushed so far

    def __call__(self, layer, kv, x):
        """kv (B, T, n_kv, E): the layer's own K/V, x (B, T, C) the attention's input -> the routed K/V, same shape."""
        router = self.routers[layer]
        # (None where no pulled layer reads it: held nowhere here, a pushed kv is freed after its push under no_grad)
        self.own.append(kv if layer in self.pulled_from else None)
        pulled = self.reference or router.pulled
        # the push reaches the later pushed layers that read this one, and this one if pushed (its own sum ends here).
        # NOTE a pulled layer still pushes into its readers (a fork's router may pull at some layers only): else their
        # sums would silently lack its share
        targets = [] if self.reference else self.readers[layer] + ([] if pulled else [layer])
        # three cases: pushed (lime, first-J, last-J, average): the op finishes this layer's sum, returned as is;
        # pulled (per-token, values only): push into the readers, then gather own[j] and route here (with
        # reference=True nothing is pushed: every layer pulls); layer 0 read by no pushed layer: its own K/V
        if targets == [layer] and type(router) is Own:  # (Own itself, not a subclass: it reads [layer] at weight 1)
            return kv  # layer 0 read by no pushed layer (dynamic, value-residual): its own K/V, no op, no copy
        outs = self.push(layer, kv, targets) if targets else {}
        if not pulled:
            return outs[layer]
        kvs = [self.own[j] for j in router.sources]
        if router.keys:
            return self.pull(router, kvs, x)
        # a K/V is (B, T, n_kv, 2*head_dim): [keys | values] in its last dimension
        v = self.pull(router, [src[..., src.shape[-1] // 2:] for src in kvs], x)  # values only: (B, T, n_kv, head_dim)
        return torch.cat([kv[..., :v.shape[-1]], v], dim=-1)  # the layer's own keys, the routed values

    def push(self, layer, kv, targets):
        """One op (kernels.route): this layer's share added to each target's running sum -> {target: the sum}."""
        # kernels.route adds partials[i] to output i: the targets that hold a running sum already go first
        targets = sorted(targets, key=lambda l: l not in self.partial)
        partials = [self.partial.pop(l) for l in targets if l in self.partial]
        w = torch.stack([self.routers[l].matrix()[:, self.routers[l].sources.index(layer)]
                         for l in targets])  # (n_targets, n_kv, n_kv): how each target reads this layer
        outs = dict(zip(targets, kernels.route(kv, w, partials)))
        self.partial.update((l, outs[l]) for l in self.readers[layer])  # later layers' sums; its own is done
        return outs

    @staticmethod
    def readers_of(routers):
        """Layer j -> the later layers that take its push: those that read it and are not pulled (ascending)."""
        readers = [[] for _ in routers]
        for r in routers:  # ascending, so each list is too
            for j in [] if r.pulled else r.sources[:-1]:  # (sources[-1]: the layer itself)
                readers[j].append(r.layer)
        return readers

    def pull(self, router, kvs, x):
        """kvs: the K/V (B, T, n_kv, E) of router.sources, in order -> the routed K/V of the router's layer."""
        if self.reference:
            return router.reference(kvs, x)
        w = router.weights(x if router.per_token else None)
        if w.dim() == 3:  # weights across heads: route_reference's stack
            return route_reference(w, kvs)
        # within each head, w (n_kv, n_src) or (B, T, n_kv, n_src): each source's K/V scaled per head, summed; autograd
        # saves the sources themselves, no stacked copy (.type_as: fp32 weights would promote bf16 K/V to fp32)
        return sum(w[..., i, None] * kv for i, kv in enumerate(kvs)).type_as(kvs[0])


# -----------------------------------------------------------------------------
# The decoder


def rope_tables(config):
    head_dim = config.n_embd // config.n_head
    inv_freq = config.rope_theta ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(config.block_size).float(), inv_freq)  # (block_size, head_dim/2)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x1[i], x2[i]) = (x[i], x[i + head_dim/2]) by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)  # each (B, heads, T, head_dim/2)
    # computed in the tables' dtype (bf16 x fp32 promotes to fp32; fp64 in a .double() model), then cast back
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.layer, self.n_head, self.n_kv_head = layer, config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, config.n_head * self.head_dim, bias=False)
        # one projection for keys and values: they are routed together, as one 2*head_dim vector
        self.c_kv = nn.Linear(config.n_embd, 2 * config.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.router = make_router(config, layer)  # None: nothing routed (`none`, or a method of the stream)

    def forward(self, x, routing, cos, sin, cache=None):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        kv = self.c_kv(x).view(B, T, self.n_kv_head, 2 * self.head_dim)  # (B, T, n_kv, 2*head_dim)
        if routing is not None:  # LIMe: kv~[l] = sum over sources j and heads h' of R^(l)[:, j, h'] kv[j][h']
            kv = routing(self.layer, kv, x)  # the routed K/V, same shape (x: a per-token router's input)
        # split before transposing, so the gradient that reaches the routing comes back contiguous
        k, v = (t.transpose(1, 2) for t in kv.split(self.head_dim, dim=-1))  # each (B, n_kv, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            assert cache.pos == 0 or T == 1, "after the prompt, the cache takes one token at a time"
            k, v = cache.update(self.layer, k, v)  # each (B, n_kv, pos + T, head_dim)
        # a single query sees every key (SDPA's causal mask is top-left aligned, wrong for 1 query, pos + 1 keys)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1,
                                           enable_gqa=self.n_kv_head != self.n_head)  # (B, n_head, T, head_dim)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # heads side by side: (B, T, n_head * head_dim)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 2 * config.mlp_hidden, bias=False)  # gate and up, fused
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)  # each (B, T, mlp_hidden)
        return self.c_proj(F.silu(gate) * up)


class Residual(Method):
    """The residual stream: what each sub-layer (attention, then the MLP, in every block) reads, and
    how its output joins the stream. Here the pre-norm residual, h + f(h). A method of the stream
    (baselines.py) is a subclass with a name, chosen by --router, that overrides what it changes; its
    model then routes no K/V. Sub-layer i of 2 * n_layer: 2l the attention of block l, 2l + 1 its MLP."""
    starts_as_none = True  # given none's weights, a fresh model computes none's exactly (tested); else say False

    def __init__(self, config=None, J=None):  # (the arguments every method of the stream is built with)
        super().__init__()

    def start(self, x):
        return x  # the embedding (B, T, C) -> the stream

    def add(self, i, h, f):
        return h + f(h)  # sub-layer i (2 per block): f, its norm included (Block), maps (B, T, C) to (B, T, C)

    def end(self, h):
        return h  # the stream -> what the final norm reads (B, T, C)

    def flops(self):
        return 0  # training FLOPs per token beyond the weights of Linear layers (GPT.estimate_flops): a subclass's > 0


class Block(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.layer = layer
        self.ln_1 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = Attention(config, layer)
        self.ln_2 = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, residual, routing, cos, sin, cache=None):
        h = residual.add(2 * self.layer, h, lambda x: self.attn(self.ln_1(x), routing, cos, sin, cache))
        return residual.add(2 * self.layer + 1, h, lambda x: self.mlp(self.ln_2(x)))


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
        method, J = parse_router(config.router)
        self.residual = method(config, J) if issubclass(method, Residual) else Residual()
        check_residual(self.residual, config)  # NOTE else a stream of the wrong shape fails deep in the forward
        # every layer's router, or none at all; a plain list (the modules are registered in their blocks)
        self.routers = [block.attn.router for block in self.transformer.h if block.attn.router is not None]
        self.readers = Routing.readers_of(self.routers)  # once: the routers do not change
        self.reference_routing = False  # True: route with route_reference (slow, O(L^2) memory), as in the tests
        cos, sin = rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Every initial value of the model, in one place:
          - the embedding (tied with the output head) and every Linear: normal, std 0.02, except
            the residual branches' outputs (`c_proj`): std 0.02 / sqrt(2 n_layer), as in GPT-2, and
            every Linear map of a per-token router (ablations.py's `dynamic`): zero, so that it starts static
            (NOTE so two in a row, Linear-Tanh-Linear, would never learn: such a router sets its own);
          - RMSNorm gains: one;
          - learned routers (weights() a Parameter, its own Linear's too): the identity on the layer's own
            heads, Kaiming-uniform U(-b, b), b = sqrt(3 / fan_in), elsewhere, fan_in the sources one head reads,
            (l + 1) n_kv for `lime` (n_src n_kv for first-J, last-J; n_src within each head) (NOTE the
            paper's Appendix E prints sqrt(3 / (l + 1) * n_kv), which Python would evaluate as sqrt(3 n_kv / (l + 1));
            we read it as the authors' public code does, the Kaiming bound over the (l + 1) n_kv sources);
          - last, each method's own init_weights() if any (baselines.py's, a fork's, a router's), over all that."""
        std = 0.02
        methods = [m for m in self.modules() if isinstance(m, Method)]
        check_registered(methods, self)  # a parameter in a plain list would silently never train
        with require_initialised(methods):  # NaN until set: a method's parameter that nothing sets is an error
            starts_static = {lin for m in methods if getattr(m, "per_token", False)
                             for lin in m.modules() if isinstance(lin, nn.Linear)}
            routed = {id(m.weights()) for m in methods if isinstance(m, Router)}  # a router's init, even in a Linear
            for name, module in self.named_modules():
                if isinstance(module, nn.RMSNorm):
                    nn.init.ones_(module.weight)
                elif module in starts_static:
                    for p in module.parameters():  # its bias too, if any: weights(x) starts as weights()
                        nn.init.zeros_(p)
                elif name.endswith("c_proj"):
                    nn.init.normal_(module.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
                elif isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in routed:
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                elif isinstance(module, Router) and isinstance(module.weights(), nn.Parameter):
                    w = module.weights()  # (n_kv, n_src, n_kv), or (n_kv, n_src) within each head
                    # a=1 makes the gain 1: U(-b, b), b = sqrt(3 / fan_in), fan_in = w[0].numel(), the (layer, head)
                    # sources one head reads
                    nn.init.kaiming_uniform_(w, a=1)
                    # source_layers() lists the layer itself last, so its own heads are w[:, -1]
                    w[:, -1] = torch.eye(w.shape[0]) if w.dim() == 3 else 1.0
            for module in methods:  # last, so that nothing above overwrites what it sets
                if hasattr(module, "init_weights"):
                    module.init_weights()

    def forward(self, idx, targets=None, cache=None):
        """idx (B, T) token ids -> (logits (B, T, vocab), loss or None); targets of -1 are ignored.
        With a generation.KVCache, idx continues what the cache holds (positions cache.pos onwards)."""
        B, T = idx.shape
        pos = cache.pos if cache is not None else 0
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence of {pos + T} tokens exceeds block_size={self.config.block_size}")
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]  # (T, head_dim/2)
        routing = Routing(self.routers, self.readers, self.reference_routing) if self.routers else None
        h = self.residual.start(self.transformer.wte(idx))  # the embedding (B, T, n_embd) -> the stream
        for block in self.transformer.h:
            h = block(h, self.residual, routing, cos, sin, cache)
        if cache is not None:
            cache.pos += T
        logits = self.lm_head(self.transformer.ln_f(self.residual.end(h)))
        loss = None
        if targets is not None:  # logits as (B*T, vocab) rows, in fp32 (bf16 goes up, fp64 stays); targets as (B*T,)
            rows = logits.view(-1, logits.size(-1))
            loss = F.cross_entropy(rows.to(torch.promote_types(rows.dtype, torch.float32)), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss

    # ---- analysis and accounting ---------------------------------------------------------

    def routing_weights(self):
        """Per layer l, (n_kv_head, l + 1, n_kv_head): [h, j, h'] the weight from head h' of layer j into head h.
        The identity on the layer's own heads where there is no router; a per-token router's token-independent part."""
        return [(block.attn.router or Own(self.config, layer).to(self.rope_cos.device)).dense()
                for layer, block in enumerate(self.transformer.h)]

    def num_params(self):
        """Parameter counts by part; the tied embedding is counted once."""
        # a method's parameters by the module that holds them, whatever their names (a router's names include "attn")
        methods = {id(p): part for part, modules in [("router", self.routers), ("residual", [self.residual])]
                   for m in modules for p in m.parameters()}
        parts = dict(wte="embedding", attn="attention", mlp="mlp")  # any other: the first key in its name, else norm
        counts = dict.fromkeys(["router", "residual", *parts.values(), "norm"], 0)
        for name, p in self.named_parameters():
            part = methods.get(id(p)) or next((part for key, part in parts.items() if key in name), "norm")
            counts[part] += p.numel()
        counts["total"] = sum(counts.values())
        return counts

    def estimate_flops(self, seq_len=None):
        """Training FLOPs (forward + backward) per token, in the usual 6N-style accounting:

            6 * (weights of every nn.Linear: the tied head counted once, the embedding lookup not)
          + 12 * n_layer * n_head * head_dim * T          (QK^T and AV, non-causal count, as nanoGPT)
          + 6 * sum_{l > 0} R^(l).weights().numel() * E   (the routing; E = 2 * head_dim for K and V,
                                                           head_dim for a router of the values alone)
          + Residual.flops()                              (what the residual stream adds; 0 for the plain one)

        The routing term is what LIMe adds (layer 0 copies its own K/V at most): each routed K/V element is a dot
        product over the allowed sources (within-head weights: the same head only); O(L^2) in depth for the routers
        that read every earlier layer (`lime`, `average`, `dynamic`), O(L J) for `first-J` and `last-J`."""
        c = self.config
        T = seq_len or c.block_size
        head_dim = c.n_embd // c.n_head
        # NOTE a footgun for forks: modules() yields a module once, so a Linear applied twice per token (weights
        # shared across layers) counts once here: each further use adds 6 * its weights
        dense = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        attention = 12 * c.n_layer * c.n_head * head_dim * T
        routing = sum(6 * r.weights().numel() * (2 if r.keys else 1) * head_dim for r in self.routers if r.layer > 0)
        return 6 * dense + attention + routing + self.residual.flops()
