"""
Top-p pruning of router weights (the paper's first version, its Table 5): after training
(`analyze.py prune`) or once during it (`train.py --router-top-p P --prune-at STEP`).

A pruning is a mask, {parameter name: bool tensor of the weights' shape, True = kept}, stored in
checkpoints as `router_mask`, so that a resumed or fine-tuned run keeps the same weights at zero.
It applies to the routers that `prunable` accepts: weights() a learned Parameter, the same at every token.
"""

import torch
import torch.nn as nn

from cli import UsageError
from methods import router_forms


def top_p_mask(weight, p):
    """What top-p pruning keeps of one router: a bool mask of weight's shape, True = kept.
    weight (n_kv, n_src, n_kv) (target head, source layer, source head), or (n_kv, n_src).

    The paper does not publish its algorithm; this is our reading of it. For each target head
    h, the |weight[h]| over all its (source layer, source head) pairs are divided by their sum,
    and the smallest set of them whose share reaches p is kept: sorted from the largest down, a
    weight is kept while the share of the weights before it is below p, so the one that crosses
    p is kept too. A sum within 1e-9 of p counts as reaching it, so that rounding does not decide
    (.4 + .3 + .2 comes out just under .9 in floating point). Equal weights keep their order (a
    stable sort): the mask depends on the weights alone. Every target head keeps its largest weight.
    """
    share = weight.detach().abs().double().flatten(1)  # (n_kv, n_src * n_kv): each target head's sources
    share = share / share.sum(1, keepdim=True).clamp(min=1e-300)
    order = share.argsort(dim=1, descending=True, stable=True)
    ranked = share.gather(1, order)
    keep_ranked = ranked.cumsum(1) - ranked < p - 1e-9  # the share of the larger weights, before each one
    keep_ranked[:, 0] = True  # however small p is
    return torch.zeros_like(keep_ranked).scatter(1, order, keep_ranked).view(weight.shape)


def prunable(router):
    """Top-p pruning zeroes entries of a lime.Router's weights(): they must be a learned Parameter, the same
    at every token."""
    return not router.per_token and isinstance(router.weights(), nn.Parameter)


def prunable_forms():
    """What top-p pruning applies to, as the error messages say it."""
    forms = router_forms(prunable)
    return f"routers whose weights() is a learned Parameter itself, the same at every token ({forms})"


def prunable_routers(model):
    """{parameter name: router} of the routers that top-p pruning applies to; a UsageError if none."""
    names = {id(p): name for name, p in model.named_parameters()}
    found = {names[id(r.weights())]: r for r in model.routers if prunable(r)}
    if not found:
        raise UsageError(f"top-p pruning applies to {prunable_forms()}, not router={model.config.router!r}")
    return found


@torch.no_grad()
def prune_routers(model, p, mask=None):
    """Zero the router weights that top-p pruning drops; returns the mask. With an earlier `mask`,
    what it dropped stays dropped."""
    new = {}
    for name, router in prunable_routers(model).items():
        w = router.weights()
        new[name] = top_p_mask(w, p) & (mask[name].to(w.device) if mask else True)
        w.mul_(new[name])
    return new


@torch.no_grad()
def mask_routers(model, mask, optimizer=None):
    """Pruned router weights back to exactly zero, with their gradients and, given the optimizer,
    their AdamW moments: with no gradient and no momentum, an update leaves them at zero."""
    params = dict(model.named_parameters())
    for name, keep in mask.items():
        p = params[name]
        keep = keep.to(p.device)
        for t in [p, p.grad, *(optimizer.state.get(p, {}).values() if optimizer is not None else ())]:
            if torch.is_tensor(t) and t.shape == p.shape:  # not a missing gradient, nor AdamW's step count
                t.mul_(keep)


def pruned_counts(model, mask):
    """{layer: (pruned, total)} over the masked router weights, in layer order."""
    routers = prunable_routers(model)
    return {routers[name].layer: (int((~keep).sum()), keep.numel())
            for name, keep in sorted(mask.items(), key=lambda item: routers[item[0]].layer)}


def pruned_total(model, mask):
    """(pruned, total) over every masked router weight."""
    return tuple(map(sum, zip(*pruned_counts(model, mask).values())))
