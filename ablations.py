"""
The paper's router ablations (its Table 7, and the per-token router of its first version): which
layers a head reads, and whether its weights are learned, static or per token. Each is one class on
lime.Router, named for --router, as a fork would write its own (README "Fork it").

    python train.py --router=first-4    # `lime` over the first 4 layers plus its own
    python train.py --router=last-4     # ... over the 4 most recent
    python train.py --router=average    # a fixed uniform average over layers 0..l
    python train.py --router=dynamic    # per-token weights over layers 0..l
"""

import torch
import torch.nn as nn

from lime import LIMe, Own, Router


class Average(Own):
    """Layers 0..l of the same head, uniformly (Own's equal weights, over more sources): fixed, nothing learned."""
    name = "average"

    source_layers = Router.source_layers  # every layer up to its own, as a Router reads by default


class Dynamic(Router):
    """Layers 0..l of the same head with per-token weights: a static part plus a zero-initialised
    linear map of the (normalised) attention input (the paper's first version)."""
    name = "dynamic"
    per_token = True

    def __init__(self, config, layer, J=None):
        super().__init__(config, layer, J)
        self.weight = nn.Parameter(torch.empty(self.n_kv, len(self.sources)))
        self.proj = nn.Linear(config.n_embd, self.weight.numel(), bias=False)

    def weights(self, x=None):
        if x is None:
            return self.weight
        B, T, _ = x.shape
        return self.proj(x).view(B, T, *self.weight.shape) + self.weight  # (B, T, n_kv, n_src)


class Last(LIMe):
    """`lime` over the min(l + 1, J) most recent layers, its own included."""
    name = "last-J"

    def source_layers(self, layer, J):
        return list(range(max(0, layer - J + 1), layer + 1))


class First(LIMe):
    """`lime` over the first min(l + 1, J) layers, plus its own."""
    name = "first-J"

    def source_layers(self, layer, J):
        return sorted(set(range(min(layer + 1, J))) | {layer})
