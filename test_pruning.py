"""Top-p pruning of the router weights (pruning.py)."""

import re

import pytest
import torch

import cli
import methods
import pruning
from conftest import PRUNABLE, methods_where, small_model, tokens

def test_top_p_mask_keeps_the_smallest_set_that_reaches_p():
    # two target heads, each reading 2 source layers x 2 source heads; shares of |weight| in tenths
    w = torch.tensor([[[4.0, -3.0], [2.0, 1.0]],  # .4 .3 .2 .1: .4 + .3 < .9, so the .2 crosses p; the .1 goes
                      [[-8.0, 1.0], [0.5, 0.5]]])  # .8 .1 .05 .05: .8 + .1 reaches .9; both .05 go
    assert pruning.top_p_mask(w, 0.9).tolist() == [[[True, True], [True, False]], [[True, True], [False, False]]]
    assert pruning.top_p_mask(w, 0.1).sum(dim=(1, 2)).tolist() == [1, 1]  # the largest always stays
    # the mask is of the weights where they are, not in their ranked order: shares .1 .2 .3 .4, the .4 and .3 kept
    mask = pruning.top_p_mask(torch.tensor([[[1.0, 2.0], [3.0, 4.0]]]), 0.5)
    assert mask.tolist() == [[[False, False], [True, True]]]
    ties = pruning.top_p_mask(torch.ones(1, 2, 2), 0.5)
    assert ties.flatten().tolist() == [True, True, False, False]  # equal weights: kept in order
    # in a model: the hand counts per layer, and only the dropped weights change (to zero)
    model = small_model("lime", n_layer=3)
    with torch.no_grad():
        model.routers[1].weight.copy_(w)
        model.routers[2].weight.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6]).view(2, 3, 2))
    before = {n: p.clone() for n, p in model.named_parameters()}
    mask = pruning.prune_routers(model, 0.9)
    # layer 2, head 0: 10 is everything; head 1: shares 1..6 / 21, and 6 + 5 + 4 + 3 = 18 < 0.9 * 21 <= 20
    assert pruning.pruned_counts(model, mask) == {1: (3, 8), 2: (5 + 1, 12)}
    assert list(pruning.pruned_counts(model, dict(reversed(mask.items())))) == [1, 2]  # in layer order, as printed
    for name, p in model.named_parameters():
        expected = before[name] * mask[name] if name in mask else before[name]
        assert torch.equal(p, expected), name
    assert [r for r in PRUNABLE.replace(" or ", ", ").split(", ") if r in ("lime", "last-J", "first-J")] == [
        "lime", "last-J", "first-J"]  # (a fork's own may be among them)
    with pytest.raises(cli.UsageError, match=re.escape("top-p pruning applies to routers whose weights() is a learned "
                                                       f"Parameter itself, the same at every token ({PRUNABLE}), "
                                                       "not router='dynamic'")):
        pruning.prune_routers(small_model("dynamic"), 0.9)


@pytest.mark.parametrize("mode", methods_where(lambda cls: methods.satisfies(cls, pruning.prunable)))  # a fork's too
def test_pruned_model_equals_the_dense_routing_with_its_zeros(mode):
    model, idx = small_model(mode), tokens()
    unpruned = model(idx)[0]
    mask = pruning.prune_routers(model, 0.6)
    assert sum(p for p, _ in pruning.pruned_counts(model, mask).values()) > 0
    R = model.routing_weights()
    for name, router in pruning.prunable_routers(model).items():  # the dense (n_kv, l + 1, n_kv) weights hold the zeros
        keep = mask[name] if mask[name].dim() == 3 else \
            mask[name][:, :, None] & torch.eye(router.n_kv, dtype=torch.bool)[:, None]  # within each head: its diagonal
        assert torch.equal(R[router.layer][:, router.sources] != 0, keep)
    fast = model(idx)[0]  # kernels.route, pushing each layer's K/V to its readers
    model.reference_routing = True  # route_reference: the einsum over every source, zeros included
    torch.testing.assert_close(fast, model(idx)[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fast, unpruned, atol=1e-4)  # the zeros do change what the model computes


def test_top_p_at_its_edges():
    """However small p is, a target head keeps its largest weight; ties keep their order however many there are
    (an unstable sort reorders 17 or more); an earlier mask's drops stay dropped, whatever the weight."""
    w = torch.tensor([[[4.0, -3.0], [2.0, 1.0]], [[-8.0, 1.0], [0.5, 0.5]]])
    assert pruning.top_p_mask(w, 1e-12).tolist() == [[[True, False], [False, False]], [[True, False], [False, False]]]
    ties = pruning.top_p_mask(torch.ones(2, 5, 4), 0.5)  # 20 equal weights per target head: the first 10
    assert ties.flatten(1).tolist() == [[True] * 10 + [False] * 10] * 2
    # a target head whose weights are all 0 has no share to rank (not 0/0 = NaN): nothing of it is pruned
    assert pruning.top_p_mask(torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 3.0]]), 0.5).tolist() == [
        [True, True, True], [False, False, True]]
    model = small_model("lime", n_layer=2)
    name = "transformer.h.1.attn.router.weight"
    with torch.no_grad():
        model.routers[1].weight.copy_(w)
    earlier = {name: torch.ones(2, 2, 2, dtype=torch.bool)}
    earlier[name][0, 0, 0] = False  # the largest weight of head 0, dropped before
    mask = pruning.prune_routers(model, 1.0, earlier)  # p = 1 alone keeps every weight
    assert mask[name].flatten().tolist() == [False] + [True] * 7
    assert torch.equal(model.routers[1].weight, w * mask[name])


def test_masking_zeroes_a_pruned_weight_its_gradient_and_its_moments():
    """mask_routers, as train.py calls it after a pruning: each dropped weight, its gradient and its AdamW moments
    back to exactly zero, so that the next step leaves it at zero (AdamW's step count, no tensor of the weight's
    shape, stays)."""
    model, idx = small_model("lime", n_layer=2), tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(idx, idx)[1].backward()
    opt.step()  # AdamW's moments
    model(idx, idx)[1].backward()  # and a gradient not yet stepped
    w = model.routers[1].weight
    mask = pruning.prune_routers(model, 0.5)
    dropped = ~mask["transformer.h.1.attn.router.weight"]
    assert dropped.any() and w.grad[dropped].all()
    pruning.mask_routers(model, mask, opt)
    for t in (w, w.grad, opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]):
        assert not t[dropped].any()
    assert opt.state[w]["step"] == 1
    opt.step()
    assert not w[dropped].any() and w[~dropped].all()
