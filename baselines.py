"""
The paper's comparison baseline (Hyper-Connections, dynamic and static) and two cheaper cross-layer
controls, written as a fork would write its own idea: each is one class on lime.py's extension points,
named for --router.

    python train.py --router=hc              # Hyper-Connections, dynamic, expansion rate 4 (hc-2: rate 2)
    python train.py --router=hc-static       # ... its static variant
    python train.py --router=dwa             # DenseFormer's depth-weighted averaging
    python train.py --router=value-residual  # ResFormer's value residual

Each starts as exactly the LLaMA baseline (`none`) with the same weights (Hyper-Connections: up to its
final norm's epsilon, so its starts_as_none is False), so what it learns is what it adds. Hyper-Connections
and depth-weighted averaging act on the residual stream (a lime.Residual), the value residual on the values
attention reads (a lime.Router).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from cli import UsageError
from lime import Residual, Router


class HyperConnections(Residual):
    """Hyper-Connections (Zhu et al. 2024), the LIMe paper's baseline: n copies of the residual
    stream (n = J, the expansion rate, 4 by default as in its source) and, around each sub-layer,
    learned width connections (what the sub-layer reads, and how the streams mix as they go on) and
    depth connections (how much of the sub-layer's output each stream takes). `hc` is the dynamic
    variant, which the paper's public code uses: the connections also depend on the token, through
    tanh gates of the normalised streams that start at zero. `hc-static` has the static part alone."""
    name, J = "hc-J", 4
    dynamic = True
    # every sub-layer reads none's stream, but the final norm reads the sum of n equal streams, n times it: the same
    # up to the norm's epsilon (8e-3 in the small test model's logits), not exactly (test_baselines.py holds the rest)
    starts_as_none = False

    def __init__(self, config, J):
        super().__init__()
        n, C, subs = J, config.n_embd, 2 * config.n_layer  # subs: a connection around every sub-layer
        if n > 64:  # (its source tries 1 to 8: each stream is a copy of the residual stream, per token)
            raise UsageError(f"--router={self.name.removesuffix('-J')}-{n}: at most 64 streams (J), each a copy of "
                             "the residual stream at every token")
        self.n, self.C, self.eps = n, C, config.norm_eps
        # alpha[i] (n, n + 1): column 0 weighs the streams into sub-layer i's input, columns 1..n mix the
        # streams that go on; beta[i] (n): how much of the sub-layer's output each stream takes
        self.alpha, self.beta = nn.Parameter(torch.empty(subs, n, n + 1)), nn.Parameter(torch.empty(subs, n))
        if self.dynamic:  # alpha += s_a tanh(norm(H) W_a), beta += s_b tanh(norm(H) w_b), per stream and token
            self.alpha_fn, self.beta_fn = nn.Parameter(torch.empty(subs, C, n + 1)), nn.Parameter(torch.empty(subs, C))
            self.alpha_scale, self.beta_scale = nn.Parameter(torch.empty(subs)), nn.Parameter(torch.empty(subs))

    @torch.no_grad()
    def init_weights(self):
        """Every stream is the plain residual stream: sub-layer i reads stream i mod n, each stream goes on
        as it is and takes the whole output. The dynamic part is zero, behind gates of 0.01."""
        subs = self.alpha.shape[0]
        self.alpha.zero_()
        self.alpha[:, :, 1:] = torch.eye(self.n)
        self.alpha[torch.arange(subs), torch.arange(subs) % self.n, 0] = 1.0
        self.beta.fill_(1.0)
        if self.dynamic:
            self.alpha_fn.zero_(), self.beta_fn.zero_()
            self.alpha_scale.fill_(0.01), self.beta_scale.fill_(0.01)

    def start(self, x):
        return x.unsqueeze(2).expand(-1, -1, self.n, -1)  # (B, T, n, C): n copies of the embedding

    def add(self, i, H, f):
        alpha, beta = self.alpha[i], self.beta[i]  # (n, n + 1), (n)
        if self.dynamic:
            Hn = F.rms_norm(H, H.shape[-1:], eps=self.eps)  # no learned gain
            alpha = alpha + self.alpha_scale[i] * torch.tanh(Hn @ self.alpha_fn[i])  # (B, T, n, n + 1)
            beta = beta + self.beta_scale[i] * torch.tanh(Hn @ self.beta_fn[i])  # (B, T, n)
        # NOTE a footgun: as a matmul, alpha^T @ H would round every stream at every sub-layer, to bf16 under autocast
        # and to tf32 on a GPU (train.py allows it), where the plain residual stream stays fp32. So: n multiply-adds
        mixed = sum(alpha[..., j, :, None] * H[..., j, None, :] for j in range(self.n))  # (B, T, n + 1, C)
        # row 0 of `mixed` is the sub-layer's input, rows 1..n the streams that go on
        out = f(mixed[..., 0, :])  # (B, T, C)
        return beta[..., None] * out[..., None, :] + mixed[..., 1:, :]  # (B, T, n, C)

    def end(self, H):
        return H.sum(dim=2)  # the final norm reads the sum of the streams

    def flops(self):
        """Per sub-layer and token, in multiply-adds: the width connection n (n + 1) C, the depth
        connection n C; the dynamic part as much again (norm(H) W_a and norm(H) w_b). x 6 for training."""
        subs, n = self.alpha.shape[:2]
        return 6 * subs * (n * (n + 1) * self.C + n * self.C) * (2 if self.dynamic else 1)


class StaticHyperConnections(HyperConnections):
    name = "hc-static-J"
    dynamic = False


class DepthWeightedAverage(Residual):
    """DenseFormer's depth-weighted averaging (Pagliardini et al. 2024): after block l, the stream is a
    learned weighted sum of the embedding and the outputs of blocks 0..l, at first 1 on the newest and
    0 elsewhere (the plain residual stream). The same kind of static learned weighting as LIMe, placed
    on the hidden state after each block instead of on each head's K/V."""
    name = "dwa"

    def __init__(self, config, J=None):
        super().__init__()
        self.C = config.n_embd
        self.alphas = nn.ParameterList(nn.Parameter(torch.empty(l + 2)) for l in range(config.n_layer))

    @torch.no_grad()
    def init_weights(self):
        for a in self.alphas:
            a.zero_()
            a[-1] = 1.0

    def start(self, x):
        return x, [x]  # the stream, and what the averages read: the embedding, then each block's output

    def add(self, i, state, f):
        x, outputs = state
        x = x + f(x)
        if i % 2:  # the end of block i // 2: its output joins, and the stream becomes their weighted sum
            outputs = outputs + [x]
            x = sum(a * h for a, h in zip(self.alphas[i // 2], outputs))  # no stack: each output saved once
        return x, outputs

    def end(self, state):
        return state[0]

    def flops(self):
        return 6 * self.C * sum(len(a) for a in self.alphas)  # a multiply-add per weight and channel


class ValueResidual(Router):
    """ResFormer's value residual (Zhou et al. 2024): each layer's values plus a learned weight per
    head times layer 0's values; the keys are the layer's own. It is LIMe restricted to {layer 0,
    its own} on the values, within each head, its own weight fixed at 1 and layer 0's starting at 0."""
    name = "value-residual"
    keys = False
    starts_as_none = True  # layer 0's weight starts at 0 (init_weights)

    def __init__(self, config, layer, J=None):
        super().__init__(config, layer, J)
        self.lam = nn.Parameter(torch.empty(self.n_kv, 1))
        self.register_buffer("own", torch.ones(self.n_kv, 1), persistent=False)

    def source_layers(self, layer, J):
        return [0, layer]

    def weights(self, x=None):
        return torch.cat([self.lam, self.own], dim=1)  # (n_kv, 2) within each head: layer 0, its own

    @torch.no_grad()
    def init_weights(self):
        # NOTE a footgun: at 0 a fresh model is exactly `none`, and on the quick start it stays on `none`'s track far
        # longer than with a drawn start, which costs it most of its gain there (README "Baselines")
        self.lam.zero_()
