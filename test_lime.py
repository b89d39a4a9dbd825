"""The model and its routing: lime.py, ablations.py and kernels.py, and what every method of the registry promises
(a fork's too). test_a_router_is_one_class: a router written in this file, trained, evaluated, pruned and
benchmarked through the scripts' own code; a fork's module has a test file of its own (README "Fork it")."""

import collections
import json
import math
import re
import sys
import weakref
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import ablations
import analyze
import bench
import cli
import kernels
import lime
import methods
import pruning
import runs
import sample
import train
from bench import saved_bytes
from conftest import (assert_same_run, error_of, methods_where, perturbed, small_config, small_model, tiny_args,
                      tokens)
from generation import KVCache, generate
from lime import GPT, GPTConfig

MODES = ["none", "lime", "average", "last-2", "first-2", "dynamic"]  # this repo's routers, their masks known here

EVERY = methods_where()  # every --router name there is, the baselines' too (baselines.py)
# those that route K/V (a Router's model routes nothing for `none`)
ROUTED = methods_where(lambda cls: methods.satisfies(cls, lambda r: type(r) is not lime.Own))
# whose weights() is a Parameter (dynamic's: its token-independent part), set to the identity below
STATED = methods_where(lambda cls: methods.satisfies(cls, lambda r: isinstance(r.weights(), torch.nn.Parameter)))
# those that start as `none` (starts_as_none): every method of the stream unless it says not, the routers that say so
AS_NONE = methods_where(lambda cls: cls.starts_as_none)


@pytest.mark.parametrize("mode", EVERY)
def test_shapes_loss_and_ignore_index(mode):
    model = small_model(mode)
    idx = tokens()
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 64) and torch.isfinite(loss)
    assert model(idx)[1] is None
    # targets of -1 do not count: masking half the positions equals the loss on the other half
    targets = idx.clone()
    targets[:, 8:] = -1
    half = torch.nn.functional.cross_entropy(logits[:, :8].reshape(-1, 64), idx[:, :8].reshape(-1))
    torch.testing.assert_close(model(idx, targets)[1], half)
    # the loss is fp32 at least: under bf16 autocast it is fp32, and a .double() model's is fp64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    assert (logits.dtype, loss.dtype) == (torch.bfloat16, torch.float32)
    assert model.double()(idx, idx)[1].dtype == torch.float64


@pytest.mark.parametrize("mode", EVERY)
def test_causal_within_its_own_row(mode):
    """Causal, and each row apart: a token changed at position 10 of the middle row of 3 changes that row from there
    on, and nothing before it, nor anything of the rows on either side (a method that normalised or averaged over the
    batch, or summed along it either way, would move them); and the row alone is what it is in the batch (one that
    read the batch's size would differ). Perturbed: a path that starts at zero (hc's gates, dynamic's map) would hide
    what it reads."""
    model, idx = perturbed(small_model(mode), 0.1), tokens(B=3)
    changed = idx.clone()
    changed[1, 10] = (changed[1, 10] + 1) % 64
    a, b = model(idx)[0], model(changed)[0]
    assert torch.equal(a[[0, 2]], b[[0, 2]]) and torch.equal(a[1, :10], b[1, :10])  # the same sums of the same numbers
    assert not torch.allclose(a[1, 10:], b[1, 10:])
    # (not bit for bit: another batch size may take another matmul kernel, which sums in another order)
    torch.testing.assert_close(model(idx[1:2])[0], a[1:2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", EVERY)
def test_kv_cache_generation_equals_recomputation(mode):
    """Greedy generation with the cache gives the tokens of recomputing the whole sequence at every step, and the
    cached logits are those of the whole sequence at every position. The model is perturbed: at its initial values
    a baseline computes `none`, and attention is so near uniform that a key off by 0.1% would not show."""
    model = perturbed(small_model(mode), 0.1).eval()
    prompt = tokens(T=5)
    out = generate(model, prompt, 12, temperature=0)
    ref = prompt
    for _ in range(12):  # no cache: the whole sequence again at every step
        ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    cache = KVCache(model.config)  # the prompt in one go, then one token at a time
    stepped = [model(ref[:, :5], cache=cache)[0]] + [model(ref[:, t:t + 1], cache=cache)[0] for t in range(5, 17)]
    torch.testing.assert_close(torch.cat(stepped, dim=1), model(ref)[0], rtol=1e-5, atol=1e-5)  # (B, 17, vocab)


def test_after_the_prompt_the_cache_takes_one_token_at_a_time():
    """SDPA's causal mask is top-left aligned: 2 new tokens after a cached prompt would read the wrong keys, so the
    cache refuses them (the prompt itself, at position 0, may be any length)."""
    model = small_model("lime")
    cache = KVCache(model.config)
    model(tokens(T=5), cache=cache)
    with pytest.raises(AssertionError, match="after the prompt, the cache takes one token at a time"):
        model(tokens(T=2), cache=cache)


@pytest.mark.parametrize("mode", ROUTED)
def test_under_autocast_the_routed_kv_stay_bf16(mode, monkeypatch):
    """Under bf16 autocast, every layer's routed K/V is bf16 as its own K/V is (fp32 router weights times bf16 K/V
    would be fp32): what attention reads, and what the KV cache holds, at a vanilla cache's size."""
    dtypes, route = [], lime.Routing.__call__

    def routed(self, *args):
        kv = route(self, *args)
        dtypes.append(kv.dtype)
        return kv

    monkeypatch.setattr(lime.Routing, "__call__", routed)
    model = perturbed(small_model(mode), 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens())
    assert dtypes == [torch.bfloat16] * model.config.n_layer


@pytest.mark.parametrize("mode", EVERY)
def test_every_parameter_of_a_method_learns_and_a_checkpoint_keeps_it(mode):
    """Each parameter of the method (its routers', its residual stream's) moves in two SGD steps (a gate that starts
    at zero has no gradient for its scale until it opens), and the state_dict holds all it learned: a model of
    another seed that loads it gives the same logits (what --resume, sample.py and analyze.py rebuild a run from)."""
    model, idx = small_model(mode), tokens()
    ids = {id(p) for m in model.modules() if isinstance(m, methods.Method) for p in m.parameters()}
    own = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in ids}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(idx, idx)[1].backward()
        opt.step()
    assert [n for n, p in model.named_parameters() if n in own and not torch.equal(p, own[n])] == list(own)
    copy = small_model(mode, seed=1)
    copy.load_state_dict(model.state_dict())
    assert torch.equal(copy(idx)[0], model(idx)[0])


@pytest.mark.parametrize("mode", EVERY)
def test_resume_is_exact(mode, answer_dir, tmp_path, capsys):
    """train.py's 2 steps in one go equal 1 step, a stop and 1 step resumed: losses, log rows and weights, bit for bit
    (the method's parameters, their optimiser state and anything else it keeps). The run states the method's parameters
    where they are: a Residual's as the residual stream's, a Router's as the router's."""
    args = ("--router=" + mode, "--n-layer=3", "--max-steps=2", "--eval-interval=2")  # 3 layers: last-2 is not lime
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train.main(tiny_args(answer_dir, whole, *args))
    train.main(tiny_args(answer_dir, parts, *args, "--stop-at=1"))
    train.main(tiny_args(answer_dir, parts, *args, "--resume"))
    assert_same_run(parts, whole)
    summary = json.loads((whole / "summary.json").read_text())
    part = "residual" if issubclass(methods.parse_router(mode)[0], lime.Residual) else "router"
    assert summary["router"] == mode and f"M parameters, {part.replace('residual', 'residual stream')} " \
        f"{summary['parameters'][part]:,};" in capsys.readouterr().out


def test_a_method_that_draws_random_numbers_resumes_exactly(answer_dir, tmp_path, scratch_registry):
    """A fork's method may draw while it trains (dropout, stochastic depth): train.py seeds torch at every micro-step
    from (seed, step, micro-batch), as it draws the batches: a resumed run draws what an uninterrupted one would."""

    class Noisy(lime.Residual):
        name = "test-noisy"

        def __init__(self, config=None, J=None):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.empty(()))

        def init_weights(self):
            self.scale.fill_(0.1)

        def add(self, i, h, f):
            out = h + f(h)
            return out + self.scale * torch.randn_like(out) if self.training else out

    args = ("--router=test-noisy", "--max-steps=2", "--eval-interval=2")
    train.main(tiny_args(answer_dir, tmp_path / "whole", *args))
    train.main(tiny_args(answer_dir, tmp_path / "parts", *args, "--stop-at=1"))
    train.main(tiny_args(answer_dir, tmp_path / "parts", *args, "--resume"))
    assert_same_run(tmp_path / "parts", tmp_path / "whole")


def test_a_method_that_keeps_buffers_resumes_and_reads_back(answer_dir, tmp_path, scratch_registry):
    """A method's persistent buffers go into the checkpoint with its weights, whatever they hold: a step count (int64)
    and a mask of -inf are no damage. Checked against the model, not the file alone (where every tensor had to be a
    finite float, as a weight: no --resume, sample.py or analyze.py for such a run), --resume goes on from them."""

    class Counted(lime.Residual):
        name = "test-counted"

        def __init__(self, config=None, J=None):
            super().__init__()
            n = 2 * config.n_layer
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
            self.register_buffer("mask", torch.full((n, n), -math.inf).triu(1))  # sub-layer i reads 0..i
            self.gain = torch.nn.Parameter(torch.empty(n))

        @torch.no_grad()
        def init_weights(self):
            self.gain.zero_()

        def add(self, i, h, f):
            if self.training and i == 0:
                self.calls += 1
            return h + (1 + (self.gain + self.mask[i]).softmax(0)[i] * (self.calls % 3)) * f(h)

    args = ("--router=test-counted", "--max-steps=2", "--eval-interval=2")
    train.main(tiny_args(answer_dir, tmp_path / "run", *args, "--stop-at=1"))
    train.main(tiny_args(answer_dir, tmp_path / "run", *args, "--resume"))
    model = runs.load_checkpoint(tmp_path / "run", "cpu")[1]
    assert model.residual.calls == 2 * 2 and model.residual.mask[0, 1] == -math.inf  # 2 steps of 2 micro-steps


def routed_model(mode, **kw):
    """A model whose routing matters everywhere: a per-token router's input maps (dynamic's) start at zero."""
    model = small_model(mode, **kw)
    with torch.no_grad():
        for router in model.routers:
            for m in router.modules() if router.per_token else ():
                if isinstance(m, torch.nn.Linear):
                    m.weight.normal_(0, 0.2)
    return model


def run_routing(model, idx, reference, autocast=False, block=None):
    """Logits and every parameter's gradient, through the fast or the reference routing; with
    `block`, the backward starts from that block's output instead of the loss. The reference routing routes every
    layer through route_reference itself (not the fast path's own per-source sums, which it would then equal)."""
    model.reference_routing = reference
    model.zero_grad()
    out, specified, spec = [], [], lime.route_reference
    hook = block is not None and model.transformer.h[block].register_forward_hook(lambda m, i, o: out.append(o))
    lime.route_reference = lambda *args: specified.append(None) or spec(*args)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits, loss = model(idx, idx)
    finally:
        lime.route_reference = spec
    assert not reference or len(specified) == len(model.routers)
    (out[0].square().sum() if hook else loss).backward()
    if hook:
        hook.remove()
    model.reference_routing = False
    # clones: NOTE model.cuda() moves each .grad in place, so a returned .grad itself would follow the model
    return logits.float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ROUTED)
def test_fast_routing_equals_the_reference(mode):
    """kernels.route (and dynamic's per-source sum) against route_reference: forward, every gradient; fp32, bf16 and
    fp64."""
    model, idx = routed_model(mode), tokens()
    fast_logits, fast = run_routing(model, idx, reference=False)
    ref_logits, ref = run_routing(model, idx, reference=True)
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert fast.keys() == ref.keys() == {n for n, p in model.named_parameters()}
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    fast_logits, fast = run_routing(model, idx, reference=False, autocast=True)
    ref_logits, ref = run_routing(model, idx, reference=True, autocast=True)
    torch.testing.assert_close(fast_logits, ref_logits, rtol=0, atol=0.05)
    for name in ref:
        assert (fast[name] - ref[name]).norm() <= 0.05 * ref[name].norm() + 1e-6, name
    model.double()  # in float64 the two agree to its rounding: the fast path computes the same sums, in another order
    fast_logits, fast = run_routing(model, idx, reference=False)
    ref_logits, ref = run_routing(model, idx, reference=True)
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-12, atol=1e-12)
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=1e-10, atol=1e-13, msg=name)


def test_a_forks_own_reading_itself_alone_is_routed_by_its_weights(scratch_registry):
    """Layer 0 (Own, weight 1 on itself) read by no pushed layer is its own K/V, no route op; a fork's subclass of
    Own that reads its layer alone at another weight is routed still (it was skipped as layer 0: a scale unapplied)."""
    class Halved(lime.Own):
        name = "test-halved"

        def weights(self, x=None):
            return self.weight / 2

    test_fast_routing_equals_the_reference("test-halved")


def test_a_router_pulled_at_some_layers_only_still_pushes_to_the_others():
    """A fork's router may pull at some layers and be pushed at others: a pulled layer's K/V still reaches the
    running sums of the pushed layers that read it."""
    class PulledAtOddLayers(lime.LIMe):
        name = None  # (not a --router value)

        @property
        def pulled(self):
            return self.layer % 2 == 1

    model, idx = routed_model("lime"), tokens()  # 6 layers
    for router in model.routers[1:]:
        router.__class__ = PulledAtOddLayers
    model.readers = lime.Routing.readers_of(model.routers)
    assert model.readers[1] == [2, 4]  # layer 1, pulled, is read by the pushed layers 2 and 4
    fast_logits, fast = run_routing(model, idx, reference=False)
    ref_logits, ref = run_routing(model, idx, reference=True)
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ROUTED)  # (a fork's router too)
def test_backward_from_an_inner_block(mode):
    """Backward from block 2 of 6: the routed K/V pushed to later layers get no gradient."""
    model, idx = routed_model(mode), tokens()
    _, fast = run_routing(model, idx, reference=False, block=2)
    _, ref = run_routing(model, idx, reference=True, block=2)
    assert "transformer.h.3.attn.c_q.weight" not in ref and ref.keys() <= fast.keys()
    for name in fast:  # the fast path gives later routers a zero gradient where the reference gives none
        expected = ref.get(name, torch.zeros_like(fast[name]))
        torch.testing.assert_close(fast[name], expected, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", EVERY)
def test_one_graph_without_breaks(mode):
    # layer 0 pushes into layer 1's partial sum: every path of the routing; 3 layers, as the probe, for a fork's J 2
    model = small_model(mode, n_layer=3)
    explanation = torch._dynamo.explain(model)(tokens(), tokens())
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


def test_routing_copies_no_kv_around_its_op():
    """The graphs torch.compile's AOT autograd hands the compiler, forward and backward: the static routing adds its
    ops and small tensors (the router weights each push stacks, their gradients), and nothing of a layer's K/V's size
    but the op's own outputs. No copy, cat or transpose of K/V before or after `lime::route` (a step's extra time on a
    GPU is in the kernels, or in what the compiler makes of the graph, not in a copy here)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def large_values(mode):  # the ops of the graphs' values that are at least one layer's K/V in size, counted
        config = small_config(mode, n_layer=3)  # layer 0 pushes into layer 1's partial sum: every path
        slot = 2 * 16 * config.n_kv_head * 2 * config.n_embd // config.n_head  # (B, T, n_kv, 2 * head_dim)
        counts = {}

        def backend(gm, inputs):
            def capture(name):
                def compiler(graph, _):
                    counts[name] = collections.Counter(
                        str(n.target) for n in graph.graph.nodes if n.op == "call_function"
                        and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() >= slot)
                    return make_boxed_func(graph.forward)
                return compiler
            return aot_module_simplified(gm, inputs, fw_compiler=capture("forward"), bw_compiler=capture("backward"))

        torch._dynamo.reset()
        torch.manual_seed(0)
        _, loss = torch.compile(GPT(config), backend=backend, fullgraph=True)(tokens(), tokens())
        loss.backward()
        return counts

    base, routed = large_values("none"), large_values("lime")
    # each route and route_backward call returns a list: its outputs are the getitems (3 layers: 3 + 2 + 1 forward,
    # one grad kv a layer backward)
    assert routed["forward"] - base["forward"] == {"<built-in function getitem>": 6}, routed["forward"]
    assert routed["backward"] - base["backward"] == {"<built-in function getitem>": 3}, routed["backward"]
    assert not base["forward"] - routed["forward"] and not base["backward"] - routed["backward"]


@pytest.mark.parametrize("mode", MODES)
def test_routing_weights_init_and_masks(mode):
    torch.manual_seed(0)  # fixed draws: the statistical checks below cannot flake
    model = GPT(small_config(mode, n_layer=8, n_kv_head=4))
    R = model.routing_weights()
    assert [r.shape for r in R] == [(4, l + 1, 4) for l in range(8)]
    l = 7  # a deep layer, where every mode's mask differs
    r = R[l]
    eye = torch.eye(4)
    allowed = {"none": [7], "lime": range(8), "average": range(8), "last-2": [6, 7],
               "first-2": [0, 1, 7], "dynamic": range(8)}[mode]
    excluded = [j for j in range(8) if j not in allowed]
    assert torch.all(r[:, excluded] == 0)
    if mode != "none":  # the router's weights themselves, at the layers they read (signs and all)
        assert torch.equal(r[:, list(allowed)], model.routers[l].matrix())
    if mode == "average":
        torch.testing.assert_close(r, eye[:, None, :].expand(4, 8, 4) / 8)
        return
    assert torch.equal(r[:, l], eye)  # own layer: identity
    others = [j for j in allowed if j != l]
    if mode == "none":
        return
    off = r[:, others]
    if mode == "dynamic":  # within-head only: off-diagonal head pairs are zero
        assert torch.all(off * (1 - eye[:, None, :]) == 0)
        off, fan_in = torch.diagonal(off, dim1=0, dim2=2), len(allowed)
    else:
        fan_in = len(allowed) * 4
    bound = math.sqrt(3 / fan_in)
    assert off.abs().max() <= bound and off.abs().max() > bound / 2  # Kaiming-uniform, not zero
    assert 0.3 < off.abs().mean() / bound < 0.7  # U(-b, b) has mean |w| = b / 2


def test_dynamic_starts_static_and_counts_its_maps():
    """A fresh `dynamic` router's weights at any input are its static part (its map has no bias to start it off);
    its parameters and FLOPs by hand: 6 layers, d 32, 2 kv heads of 8 (K and V: 16), layer l > 0 reads l + 1."""
    model, none = small_model("dynamic"), small_model("none")
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(r.weights(x), r.weight.expand(2, 3, -1, -1)) for r in model.routers[1:])
    weights = sum(2 * (l + 1) for l in range(1, 6))  # (n_kv, n_src) a layer, and a map of d to each
    counts = model.num_params()
    assert counts["router"] == weights * (1 + 32) == counts["total"] - none.num_params()["total"]
    assert model.estimate_flops(32) - none.estimate_flops(32) == 6 * weights * 32 + 6 * weights * 16


def test_excluded_sources_stay_zero_through_training():
    model = small_model("first-2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    idx = tokens()
    for _ in range(3):
        opt.zero_grad()
        model(idx, idx)[1].backward()
        opt.step()
    r = model.routing_weights()[5]
    assert torch.all(r[:, 2:5] == 0) and r[:, [0, 1]].abs().sum() > 0


@pytest.mark.parametrize("mode", STATED)
def test_identity_router_equals_none(mode):
    base = small_model("none", seed=0)
    routed = small_model(mode, seed=1)  # different weights everywhere, then overwritten
    missing, unexpected = routed.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all("router" in k for k in missing)
    with torch.no_grad():
        for router in routed.routers[1:]:
            for p in router.parameters():  # (a per-token router's input maps too)
                p.zero_()
            w = router.weights()
            w[:, -1] = 1.0 if w.dim() == 2 else torch.eye(w.shape[0])  # within each head, or across heads
    idx = tokens()
    torch.testing.assert_close(routed(idx)[0], base(idx)[0], rtol=0, atol=1e-6)


def reads(model, idx):
    """What each sub-layer and then the final norm read in a forward (their norms' inputs), the logits and the loss.
    The model's own norms alone: a method may hold norms of its own."""
    seen = []
    norms = [norm for block in model.transformer.h for norm in (block.ln_1, block.ln_2)] + [model.transformer.ln_f]
    hooks = [norm.register_forward_pre_hook(lambda m, args: seen.append(args[0])) for norm in norms]
    logits, loss = model(idx, idx)
    for h in hooks:
        h.remove()
    return [*seen, logits, loss]


@pytest.mark.parametrize("mode", AS_NONE)
def test_a_fresh_model_is_none(mode):
    """A method that starts as `none`, given none's weights, computes exactly what none computes: what every sub-layer
    and the final norm read, the logits and the loss. Under bf16 autocast too: a stream stays fp32, as none's does."""
    base, model = small_model("none"), small_model(mode, seed=1)  # (seed 1: other weights, until none's load)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("residual.") or ".router." in k for k in missing)  # the method's own
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            want, got = reads(base, tokens()), reads(model, tokens())
        differ = [i for i, (a, b) in enumerate(zip(got, want)) if a.dtype != b.dtype or not torch.equal(a, b)]
        assert len(got) == len(want) and not differ, \
            f"{methods.parse_router(mode)[0].__qualname__}: a fresh model is not none at {differ} of the inputs of " \
            f"sub-layers 0..{len(want) - 4}, the final norm's, the logits, the loss (bf16 autocast: {autocast}); a " \
            "method that does not start as none says starts_as_none = False"


@pytest.mark.parametrize("mode", EVERY)
def test_under_autocast_the_stream_stays_fp32(mode):
    """Under bf16 autocast, what every sub-layer and the final norm read is fp32, as none's stream is: a method whose
    mixing went through a matmul (autocast's bf16) would round the stream at every block. Perturbed, so that no gate
    or map that starts at zero leaves a path out."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        *inputs, logits, loss = reads(perturbed(small_model(mode), 0.1), tokens())
    assert [x.dtype for x in inputs] == [torch.float32] * (2 * 6 + 1) and loss.dtype == torch.float32  # (6 layers)


def test_route_ops_pass_opcheck():
    """Schema, fake (meta) kernels with the real strides, autograd registration: what torch.compile relies on."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 5, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 3, 3, generator=g, requires_grad=True)
    partials = [torch.randn(2, 5, 3, 8, generator=g, requires_grad=True)]
    torch.library.opcheck(kernels.route, (kv, w, partials))
    grads = [torch.randn(2, 5, 3, 8, generator=g) for _ in range(3)]
    torch.library.opcheck(kernels.route_backward, (grads, kv.detach(), w.detach(), True))
    # grad w unneeded: zeros, contiguous as the fake says, whatever the strides of w (here transposed)
    torch.library.opcheck(kernels.route_backward, (grads, kv.detach(), w.detach().transpose(1, 2), False))
    # under bf16 autocast: bf16 K/V, fp32 weights; the outputs and grad kv are bf16, grad w fp32 (the fakes say so too)
    kv, partials = kv.detach().bfloat16(), [p.detach().bfloat16() for p in partials]
    grads = [t.bfloat16() for t in grads]
    torch.library.opcheck(kernels.route, (kv, w.detach(), partials), test_utils="test_faketensor")
    torch.library.opcheck(kernels.route_backward, (grads, kv, w.detach(), True), test_utils="test_faketensor")


def laid_out(t, layout):
    """t's values as a tensor that is either `strided` (not contiguous: its last two dimensions swapped in memory) or
    `guarded` (contiguous, with NaN right after its last element: a kernel that reads one element past the end of
    its K/V, its weights, a partial or a gradient turns an output NaN)."""
    if layout == "strided":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    guard = torch.full((t.numel() + 64,), float("nan"), dtype=t.dtype)
    guard[:t.numel()] = t.flatten()
    return guard[:t.numel()].view(t.shape)


# NOTE Triton's CPU interpreter runs a loop of a runtime count (kernels.NMAX = 0) from Triton 3.7 on, and 3.6's (which
# CUDA builds of torch 2.11 bring) under numpy 1 (it fails under numpy 2). The GPU compiles it with either
LOOPS_INTERPRETED = kernels.triton is None or tuple(map(int, kernels.triton.__version__.split(".")[:2])) >= (3, 7) \
    or int(np.__version__.split(".")[0]) < 2


@pytest.mark.parametrize("n_out, n_partials, n_kv, E, dtype, columns, nmax, split, G, layout", [
    (3, 2, 3, 8, torch.float32, 256, 8, 1, 1, "guarded"),  # heads and positions that fill no block
    (3, 2, 3, 8, torch.float32, 32, 8, 1, 1, "guarded"),  # tiles of 4 positions: many programs, the last partly filled
    (11, 10, 4, 12, torch.float32, 256, 8, 1, 1, "strided"),  # more outputs than one launch takes (kernels.NMAX); E
    # not a power of 2
    (17, 16, 4, 12, torch.float32, 256, 16, 1, 1, "strided"),  # 16 outputs a launch: two launches
    (2, 0, 2, 16, torch.bfloat16, 256, 8, 1, 1, "guarded"),
    (2, 1, 17, 12, torch.float32, 8, 8, 1, 1, "guarded"),  # heads padded to 32, not 16; E over a tile: a position a
    # tile
    (11, 10, 4, 12, torch.float32, 32, 0, 1, 1, "strided"),  # NMAX = 0: one launch loops over tables of addresses
    (3, 0, 3, 8, torch.bfloat16, 256, 0, 4, 1, "guarded"),  # grad w's product in 4 shares of the tile's 256 columns
    (11, 10, 4, 12, torch.float32, 64, 8, 8, 1, "strided"),  # 8 asked, 4 taken: a share is 16 columns or more
    # PACK: G = 16 / n_kv positions taken as one (kernels.packing), of 2 x 24 positions
    (3, 2, 8, 8, torch.float32, 128, 8, 1, 2, "guarded"),  # the 1B GQA shape's 8 heads: 24 pairs, 16 a tile
    (11, 10, 4, 12, torch.float32, 64, 8, 4, 4, "strided"),  # two launches; grad w's product in shares
    (3, 0, 2, 16, torch.bfloat16, 128, 0, 4, 8, "strided"),  # NMAX 0
    (2, 1, 1, 8, torch.float32, 16, 8, 1, 16, "guarded"),  # 3 groups of 16, 2 a tile
])
def test_triton_kernels_equal_plain_pytorch(monkeypatch, n_out, n_partials, n_kv, E, dtype, columns, nmax, split, G,
                                            layout):
    """The Triton kernels, run by Triton's CPU interpreter, against the plain implementation, on inputs laid out in
    memory as `laid_out` says; grad w against its sums in float64 (both accumulate in fp32, bf16 K/V too). LIME_TRITON
    picks the implementation: 0 plain PyTorch, 1 Triton (here in the interpreter), auto Triton for CUDA tensors only;
    float64 K/V always go to the plain path."""
    pytest.importorskip("triton")
    if nmax == 0 and not LOOPS_INTERPRETED:
        pytest.skip(f"Triton {kernels.triton.__version__}'s interpreter cannot run a loop of a runtime count")
    for name, value in zip(kernels.KNOBS, (columns, 4, nmax, split, int(G > 1))):
        monkeypatch.setattr(kernels, name, value)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 24 if G > 1 else 17, n_kv, E, generator=g).to(dtype)
    w = torch.randn(n_out, n_kv, n_kv, generator=g)
    assert kernels.packing(kv) == G
    partials = [torch.randn(kv.shape, generator=g).to(dtype) for _ in range(n_partials)]
    grads = [torch.randn(kv.shape, generator=g).to(dtype) for _ in range(n_out)]
    exact_w = torch.stack([torch.einsum("bthe,btke->hk", gi.double(), kv.double()) for gi in grads])
    kv, w = laid_out(kv, layout), laid_out(w, layout)
    partials, grads = [laid_out(p, layout) for p in partials], [laid_out(gi, layout) for gi in grads]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.05)
    results = {}
    for impl in ("0", "1"):  # LIME_TRITON: plain PyTorch, then Triton
        monkeypatch.setattr(kernels, "USE_TRITON", impl)
        assert kernels.use_triton(kv) == (impl == "1") and not kernels.use_triton(kv.double())
        results[impl] = (kernels.route(kv, w, partials), kernels.route_backward(grads, kv, w, True),
                         kernels.route_backward(grads, kv, w, False))
        torch.testing.assert_close(results[impl][1][1].double(), exact_w, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(kernels, "USE_TRITON", "auto")
    assert not kernels.use_triton(kv)  # a CPU tensor; a CUDA one (its dtype and is_cuda are all that is read):
    assert kernels.use_triton(type("CUDA", (), dict(dtype=kv.dtype, is_cuda=True))) == (kernels.triton is not None)
    (plain_out, plain_grads, plain_no_w), (out, grads_, no_w) = results["0"], results["1"]
    assert len(out) == n_out and all(o.is_contiguous() and o.dtype == dtype for o in out)
    for a, b in zip(out + list(grads_) + list(no_w), plain_out + list(plain_grads) + list(plain_no_w)):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert not no_w[1].any()


def test_launches_shares_and_alignment(monkeypatch):
    """What the interpreter cannot check of a launch: that NMAX = 0 takes every output at once (_chunks; the results
    are the same either way); that grad w's product is split in shares of 16 columns or more (_split), as tl.dot takes
    on a GPU (the interpreter takes a share of 8); and that the addresses of a table are said to start on 16 bytes only
    where they do (ALIGNED: a GPU faults on a wrong promise, the interpreter ignores it); where PACK takes several
    positions as one."""
    monkeypatch.setattr(kernels, "NMAX", 8)
    assert kernels._chunks(17) == [(0, 8), (8, 16), (16, 17)] and kernels._chunks(8) == [(0, 8)]
    monkeypatch.setattr(kernels, "NMAX", 0)
    assert kernels._chunks(17) == [(0, 17)] and kernels._chunks(1) == [(0, 1)]
    pytest.importorskip("triton")
    kv = torch.empty(2, 3, 4, 12)  # E 12: 16 columns a position
    for columns, split, taken in [(256, 4, 4), (64, 8, 4), (16, 4, 1), (512, 1, 1)]:
        monkeypatch.setattr(kernels, "COLUMNS", columns)
        monkeypatch.setattr(kernels, "SPLIT", split)
        assert kernels._split(kernels._launch_shape(kv, [kv])) == taken, (columns, split)
    assert kernels._launch_shape(kv, [kv, torch.empty(20)[4:]])["ALIGNED"]  # 16 bytes in
    assert not kernels._launch_shape(kv, [kv, torch.empty(20)[1:]])["ALIGNED"]  # 4 bytes in
    # PACK: G positions as one of G * n_kv heads, 16 rows with no padding, where n_kv divides 16 and G the positions
    for positions, n_kv, G in [(8192, 8, 2), (8192, 4, 4), (8192, 1, 16), (8192, 12, 1), (8192, 16, 1), (8192, 32, 1),
                               (33, 8, 1), (36, 4, 4), (36, 2, 1), (36, 6, 1), (8192, 3, 1)]:
        kv = torch.empty(positions, n_kv, 128, device="meta")
        assert kernels.packing(kv, pack=0) == 1 and kernels.packing(kv, pack=1) == G, (positions, n_kv)
        for pack in (0, 1):
            monkeypatch.setattr(kernels, "PACK", pack)
            shape = kernels._launch_shape(kv, [])
            g = G if pack else 1
            assert (shape["G"], shape["NKV"], shape["KP"]) == (g, g * n_kv, max(16, 1 << (g * n_kv - 1).bit_length()))
    assert kernels.packing(torch.empty(4, 2048, 8, 128, device="meta")) == 2  # PACK 1 at the 1B GQA shape's slot


@pytest.mark.parametrize("mode", ROUTED)  # a fork's router too: CPU runs the kernels interpreted
def test_triton_routing_in_the_model_equals_the_reference(monkeypatch, mode):
    pytest.importorskip("triton")
    model, idx = routed_model(mode), tokens()
    ref_logits, ref = run_routing(model, idx, reference=True)
    monkeypatch.setattr(kernels, "USE_TRITON", "1")
    packed, packing = [], kernels.packing
    monkeypatch.setattr(kernels, "packing", lambda kv, pack=None: packed.append(packing(kv, pack)) or packed[-1])
    for pack in (0, 1):  # PACK 1: 2 kv heads, so 8 positions as one
        monkeypatch.setattr(kernels, "PACK", pack)
        logits, fast = run_routing(model, idx, reference=False)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        for name in ref:
            torch.testing.assert_close(fast[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
        assert set(packed) == ({8 if pack else 1} if any(not r.pulled for r in model.routers[1:]) else set()), mode
        packed.clear()
    model.double()  # float64 K/V go to the plain path, which sums in float64: Triton's dots take fp32 at most
    ref_logits, ref = run_routing(model, idx, reference=True)
    logits, fast = run_routing(model, idx, reference=False)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-12, atol=1e-12)
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=1e-10, atol=1e-13, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n_kv, dtype, low, tile", [
    (12, torch.bfloat16, True, None), (8, torch.bfloat16, True, None), (12, torch.bfloat16, False, None),
    (12, torch.float32, False, None), (12, torch.bfloat16, True, (128, 4, 8, 1)),
    (8, torch.bfloat16, True, (512, 8, 16, 1)), (12, torch.bfloat16, True, (256, 4, 16, 1)),
    (12, torch.bfloat16, True, (256, 4, 0, 1)), (8, torch.bfloat16, True, (128, 8, 0, 4)),
    (12, torch.bfloat16, True, (256, 8, 8, 4)), (12, torch.float32, False, (512, 8, 0, 4)),
    (8, torch.bfloat16, True, (256, 4, 8, 1, 1)), (8, torch.bfloat16, True, (128, 8, 0, 4, 1))])
def test_cuda_triton_kernels_match_float64(monkeypatch, n_kv, dtype, low, tile):
    """On a GPU, at the 150M (12 kv heads) and 1B GQA (8) head counts: the compiled kernels, not the interpreter,
    with either choice of dot operands, at tiles from 128 to 512 columns and 4 or 8 warps (8 or 16 outputs a launch,
    unrolled: 10 outputs here take two launches, then one; or 0: all in one launch, looping over tables of addresses;
    grad w's product whole or in 4 shares; 8 heads packed, two positions as one, or not), and the plain path, each
    against the same sums in float64. They round bf16 differently, so they are held to the exact sums, not to each
    other."""
    monkeypatch.setattr(kernels, "LOW_PRECISION_DOTS", low)
    for name, value in zip(kernels.KNOBS, tile or ()):  # (PACK 0 where a tile names four)
        monkeypatch.setattr(kernels, name, value)
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(4, 256, n_kv, 128, device="cuda", generator=g).to(dtype)
    assert kernels.packing(kv) == (2 if tile and tile[4:] == (1,) else 1)
    w = torch.randn(10, n_kv, n_kv, device="cuda", generator=g) / n_kv**0.5
    partials = [torch.randn(kv.shape, device="cuda", generator=g).to(dtype) for _ in range(9)]
    grads = [torch.randn(kv.shape, device="cuda", generator=g).to(dtype) for _ in range(10)]
    x, w64, g64 = kv.double(), w.double(), [t.double() for t in grads]
    exact = [torch.einsum("hk,btke->bthe", w64[i], x) + (partials[i].double() if i < 9 else 0) for i in range(10)]
    exact += [sum(torch.einsum("hk,bthe->btke", w64[i], g64[i]) for i in range(10)),
              torch.stack([torch.einsum("bthe,btke->hk", g64[i], x) for i in range(10)])]
    for impl in ("0", "auto"):
        monkeypatch.setattr(kernels, "USE_TRITON", impl)
        got = [*kernels.route(kv, w, partials), *kernels.route_backward(grads, kv, w, True)]
        for i, (a, b) in enumerate(zip(got, exact)):
            err = ((a.double() - b).norm() / b.norm()).item()
            assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (impl, i, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", EVERY)
def test_cuda_compiled_bf16_equals_cpu_reference(mode):
    model, idx = routed_model(mode), tokens()
    ref_logits, ref = run_routing(model, idx, reference=True)
    model.cuda().zero_grad()
    compiled = torch.compile(model)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, loss = compiled(idx.cuda(), idx.cuda())
    loss.backward()
    torch.testing.assert_close(logits.float().cpu(), ref_logits, rtol=0, atol=0.05)
    for name, p in model.named_parameters():
        assert (p.grad.cpu() - ref[name]).norm() <= 0.05 * ref[name].norm() + 1e-6, name


def test_routing_saves_each_layer_once():
    shape = dict(block_size=64, vocab_size=64, n_layer=12, n_head=4, n_kv_head=4, n_embd=64, mlp_hidden=256)
    idx = tokens(T=64)
    none = saved_bytes(small_model("none", **shape), idx)
    for mode in ("lime", "dynamic"):
        routed_bytes = saved_bytes(small_model(mode, **shape), idx)
        assert routed_bytes <= 1.15 * none, (mode, routed_bytes / none)
    # the same measurement catches autograd through a stack of the sources per layer (the reference)
    model = small_model("lime", **shape)
    model.reference_routing = True
    assert saved_bytes(model, idx) > 1.3 * none


def test_the_op_moves_what_kernels_py_counts(monkeypatch):
    """kernels.py's count of lime's memory traffic, in slots (one layer's K/V), behind the README's "about 290 passes"
    at 12 layers, here from the op's calls in a 12-layer model: forward, layer j reads kv_j and its partial sums and
    writes its outputs (156 slots); backward, it reads its outputs' gradients and kv_j and writes grad kv_j (102); the
    Triton kernels' second launch where a layer has over NMAX outputs (4 layers: 4 + 12); and the Triton backward's
    grad w shares, written and summed, about 0.19 slot an output at the 150M shape (none for fixed weights:
    `average`'s, layer 0's alone). A partial
    sum lives only until its layer has run; a pulled layer (dynamic's), a layer 0 that no pushed layer reads (it is its
    own routed K/V) and the reference routing move nothing."""
    route, route_backward = kernels.route, kernels.route_backward
    moved, outputs = dict(forward=0, backward=0, grad_w=0, relaunched=0), []  # grad_w: the outputs whose grad w
    # shares are moved; relaunched: the layers whose outputs take two launches of each Triton kernel (NMAX)

    def counted_route(kv, w, partials):
        outs = route(kv, w, partials)
        moved["forward"] += 1 + len(partials) + len(outs)
        moved["relaunched"] += len(kernels._chunks(len(outs))) - 1
        outputs.extend(weakref.ref(o) for o in outs)
        return outs

    def counted_backward(grads, kv, w, need_w):
        moved["backward"] += len(grads) + 2
        moved["grad_w"] += len(grads) * need_w
        return route_backward(grads, kv, w, need_w)

    monkeypatch.setattr(kernels, "route", counted_route)
    monkeypatch.setattr(kernels, "route_backward", counted_backward)
    L, idx = 12, tokens(T=4)
    model = small_model("lime", n_layer=L)
    model(idx, idx)[1].backward()
    assert moved == dict(forward=L + 1 + sum(2 * (L - j) + 1 for j in range(1, L)),
                         backward=sum(L - j + 2 for j in range(L)), grad_w=78,
                         relaunched=sum(L - j > kernels.NMAX for j in range(L))) == \
        dict(forward=156, backward=102, grad_w=78, relaunched=4)
    assert all(f"= {n} at L = 12" in kernels.__doc__ for n in (156, 102, 16))
    if kernels.triton is not None:  # a tile's (n_kv, n_kv) fp32 share of grad w per output, next to its bf16 slot
        tile = kernels._launch_shape(torch.empty(16, 2048, 12, 128, dtype=torch.bfloat16, device="meta"), [])
        share = 2 * tile["NKV"] ** 2 * 4 / (tile["BP"] * tile["NKV"] * tile["E"] * 2)
        total = 156 + 102 + (1 + 3) * 4 + share * sum(L - j for j in range(L))
        slot = 16 * 2048 * 12 * 128 * 2  # bytes: one layer's bf16 K/V at the 150M shape
        assert round(share, 2) == 0.19 and round(total, -1) == 290 and round(total * slot / 1e9) == 29
    # inference: at layer m, the partial sums alive are layers m..L-1's (each reads layer 0); none outlives its layer,
    # and no earlier layer's own K/V outlives its push (the routing held every one: L slots more)
    alive, own, call = [], [], lime.Routing.__call__

    def routed(self, layer, kv, x):
        alive.append((sum(ref() is not None for ref in outputs), sum(ref() is not None for ref in own)))
        own.append(weakref.ref(kv))
        return call(self, layer, kv, x)

    monkeypatch.setattr(lime.Routing, "__call__", routed)
    with torch.no_grad():
        model(idx)
    assert alive == [(0, 0)] + [(L - m, 0) for m in range(1, L)]
    moved.update(forward=0, backward=0, grad_w=0, relaunched=0)
    model.reference_routing = True
    model(idx, idx)[1].backward()
    assert moved == dict(forward=0, backward=0, grad_w=0, relaunched=0)
    for router in ("dynamic", "value-residual"):  # layers 1..5 pull; layer 0 (Own), which no pushed layer reads, is
        small_model(router)(idx, idx)[1].backward()  # its own K/V: no op, no copy
        assert moved == dict(forward=0, backward=0, grad_w=0, relaunched=0)
    small_model("average")(idx, idx)[1].backward()  # fixed weights: no grad w to move
    assert moved["grad_w"] == 0 and moved["backward"] == sum(6 - j + 2 for j in range(6))


OWN = "a method of your own joins them once its module is in methods.MODULES and its class states a name of its own"


@pytest.mark.parametrize("bad, why", [  # (the forms as router_forms writes them, last-J, are not values)
    ("first-0", "e.g. first-4"), ("last-x", "e.g. last-4"), ("lime2", "did you mean lime?"), ("", OWN),
    ("last-", "e.g. last-4"), ("first--1", "did you mean first-1?"), ("LIME", "did you mean lime?"),
    ("lst", "did you mean last-4?"), ("hcc", "did you mean hc?"), ("hc_static-2", "did you mean hc-static-2?"),
    ("hcc-2", "did you mean hc-2?"),
    ("previous", OWN), ("first-01", "e.g. first-4"), ("last-J", "e.g. last-4"), ("hc-J", "e.g. hc-4"),
    ("lime-4", "lime takes no -J"), ("dwa-2", "dwa takes no -J"), ("last", "e.g. last-4"),
    ("hc-static-0", "e.g. hc-static-4")])
def test_bad_router_strings(bad, why):
    # every method of this repo is a form, in the order defined (a fork's own may be among them, where it defines them)
    ours = ["none", "lime", "average", "dynamic", "last-J", "first-J", "hc[-J]", "hc-static[-J]", "dwa",
            "value-residual"]
    with set_aside("previous"):  # (a fork that wrote the README's `Previous` has one: here, a name not yet joined)
        forms = methods.router_forms()
        assert [form for form in re.split(", | or ", forms) if form in ours] == ours
        with pytest.raises(ValueError, match=re.escape(f"expected {forms} (J a positive integer); {why}")):
            GPTConfig(router=bad)


def test_a_module_of_methods_that_is_not_there_is_named(monkeypatch):
    """A misspelt module in methods.MODULES is named as such (not only Python's 'No module named ...')."""
    monkeypatch.setattr(methods, "MODULES", (*methods.MODULES, "my_fork"))
    with pytest.raises(ModuleNotFoundError, match=re.escape("methods.MODULES names 'my_fork', but Python finds no "
                                                            "module of that name (a my_fork.py beside methods.py)")):
        methods.registry()
    monkeypatch.setattr(methods, "MODULES", (*methods.MODULES[:-1], "forks.mine"))  # a package's module: its folder
    with pytest.raises(ModuleNotFoundError, match=re.escape("names 'forks.mine', but Python finds no module of that "
                                                            "name (a forks/mine.py beside methods.py)")):
        methods.registry()


def test_a_method_whose_module_is_not_in_modules_is_named(scratch_registry):
    """A fork's module imported by its own test, and missing from methods.MODULES: an error that says so, not a method
    that its test knows and no script does (the tests of every method would take it or not, by their order)."""
    type("Stray", (lime.LIMe,), {"name": "test-stray-J", "__module__": "my_fork"})
    with pytest.raises(TypeError, match=re.escape("my_fork.Stray is a method, but methods.MODULES lacks 'my_fork': "
                                                  "add it there, or no script knows --router=test-stray")):
        methods.registry()
    for module in ("test_my_fork", "tests.test_mine", "mine_test", "conftest", "tests.conftest", "__main__",
                   "__mp_main__"):  # (a test's method, or a session's own: __mp_main__ in a spawned process)
        methods.ROUTERS["test-stray-J"].__module__ = module
        assert "test-stray-J" in methods.registry()
    methods.ROUTERS["test-stray-J"].__module__ = "testbed"  # (a fork's module, whose name begins as a test's)
    with pytest.raises(TypeError, match="methods.MODULES lacks 'testbed'"):
        methods.registry()


def test_the_registry_is_in_the_order_of_its_modules():
    """lime.py's methods, then ablations.py's, then baselines.py's, however the modules were imported: a process
    that imports baselines.py first (which imports lime.py, not ablations.py) registers the baselines before the
    ablations."""
    ours = ["none", "lime", "average", "dynamic", "last-J", "first-J", "hc-J", "hc-static-J", "dwa", "value-residual"]
    held = dict(methods.ROUTERS)
    try:
        for baselines_first in (False, True):
            methods.ROUTERS.clear()
            methods.ROUTERS.update(sorted(held.items(), key=lambda item: (item[1].__module__ == "baselines")
                                          != baselines_first))
            assert [name for name in methods.registry() if name in ours] == ours
    finally:
        methods.ROUTERS.clear()
        methods.ROUTERS.update(held)


def test_bad_shapes():
    with pytest.raises(ValueError, match="n_kv_head=5 must divide n_head=12"):
        GPTConfig(n_kv_head=5)
    with pytest.raises(ValueError, match="n_embd=100"):
        GPTConfig(n_embd=100)
    for field in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "mlp_hidden"):
        for bad in (0, 2**31):  # (a size torch cannot hold in a dimension: an OverflowError deep inside torch)
            rule = "in 1 .. 2**20" if field == "block_size" else "in 1 .. 2**31 - 1"  # (RoPE's tables: lime.POSITIONS)
            with pytest.raises(ValueError, match=re.escape(f"{field} must be {rule}, got {bad}")):
                GPTConfig(**{field: bad})
    GPTConfig(block_size=2**20)  # the most it takes


def test_150m_parameter_count_and_flops():
    counts = {}
    for mode in ("none", "lime"):
        with torch.device("meta"):
            model = GPT(GPTConfig(router=mode))
        counts[mode] = model.num_params()
        assert counts[mode]["total"] == sum(p.numel() for p in model.parameters())  # the tied embedding once
    assert counts["lime"]["total"] == 151_909_968
    assert 0 < counts["lime"]["router"] < 0.0005 * counts["lime"]["total"]
    assert counts["lime"]["total"] - counts["none"]["total"] == counts["lime"]["router"] == 144 * sum(range(2, 13))
    L, C, V = 12, 768, 50304  # each part: q, kv and the output projection; SwiGLU's gate, up and down; the tied table
    assert {k: v for k, v in counts["none"].items() if k not in ("router", "residual", "total")} == dict(
        embedding=V * C, attention=L * (C * C + 2 * C * C + C * C), mlp=L * 3 * C * 3072, norm=(2 * L + 1) * C)


def test_a_sequence_past_the_block_is_refused():
    """Past block_size the RoPE tables end: the forward says so, from the start or after what a cache holds."""
    model = small_model("lime", block_size=16)
    with pytest.raises(ValueError, match="sequence of 17 tokens exceeds block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    cache = KVCache(model.config)
    model(torch.zeros(1, 16, dtype=torch.long), cache=cache)  # (a full block fits)
    with pytest.raises(ValueError, match="sequence of 17 tokens exceeds block_size=16"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_flops_routing_term():
    none, routed = small_model("none"), small_model("lime")
    head_dim = 8
    extra = routed.estimate_flops(32) - none.estimate_flops(32)
    assert extra == 6 * routed.num_params()["router"] * 2 * head_dim
    # the dense term is the usual 6N with the tied head counted once and no embedding lookup
    n = none.num_params()
    assert none.estimate_flops(32) == 6 * (n["total"] - n["norm"]) + 12 * 6 * 4 * head_dim * 32
    # the attention term at the sequence length asked for, block_size by default
    assert none.estimate_flops() == none.estimate_flops(32) == none.estimate_flops(8) + 12 * 6 * 4 * head_dim * 24
    short = small_model("none", block_size=16)
    assert short.estimate_flops() == short.estimate_flops(16) == none.estimate_flops(16)


@pytest.mark.parametrize("mode", EVERY)
def test_a_method_is_counted_in_its_part(mode):
    """num_params() counts every parameter once, a method's own as its part (router, residual): all that it adds to
    none; estimate_flops() counts more for every method than for none (what its FLOPs are is for the method's own
    test). The same on the meta device, where train.py --dry-run builds the model (as
    test_150m_parameter_count_and_flops counts it)."""
    model, none = small_model(mode), small_model("none")
    counts = model.num_params()
    with torch.device("meta"):
        assert GPT(small_config(mode)).num_params() == counts
    own = sum(p.numel() for m in model.modules() if isinstance(m, methods.Method) for p in m.parameters())
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["router"] + counts["residual"] == own == counts["total"] - none.num_params()["total"]
    method = methods.parse_router(mode)[0].__qualname__
    assert model.estimate_flops(32) > none.estimate_flops(32) or mode == "none", \
        f"{method}.flops() counts nothing: a method of the stream states there the FLOPs of its work outside " \
        "nn.Linear layers"  # every method costs some FLOPs (a router's are derived from its weights)


@pytest.mark.parametrize("mode", EVERY)
def test_a_benchmark_row(mode, monkeypatch):
    """bench.py trains, generates with and measures the method's model, and gives its row with the model's figures
    (at a tiny shape of 3 layers, as the probe's, for a fork's J 2)."""
    shape = dict(n_layer=3, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=16, vocab_size=32, block_size=8)
    monkeypatch.setitem(bench.SHAPES, "tiny", dict(shape, batch_size=1))
    [row] = bench.main(["--device", "cpu", "--shape", "tiny", "--routers", mode, "--steps", "1", "--gen-tokens", "2",
                        "--gen-repeats", "1"])["runs"][0]["results"]
    model = GPT(GPTConfig(router=mode, **shape))
    assert (row["router"], row["params"], row["flops_per_token"]) == (mode, model.num_params()["total"],
                                                                      model.estimate_flops())
    assert row["ms_per_step"] > 0 and row["memory_bytes"] > 0 and row["gen_tokens_per_s"] > 0


def test_a_methods_part_is_its_module_not_its_names(scratch_registry):
    """A parameter of a method of the stream whose name says "router" is still the stream's: counted so, and trained
    at the base rate without decay (when names decided, it was a router's, at --router-lr)."""
    class Gain(lime.Residual):
        name = "test-gain"

        def __init__(self, config=None, J=None):
            super().__init__(config, J)
            self.router_gain = torch.nn.Parameter(torch.empty(2 * config.n_layer, config.n_embd))

        def add(self, i, h, f):
            return h + self.router_gain[i] * f(h)

        @torch.no_grad()
        def init_weights(self):
            self.router_gain.fill_(1.0)

    model = small_model("test-gain")
    assert model.num_params()["residual"] == 12 * 32 and model.num_params()["router"] == 0
    groups = train.param_groups(model, train.TrainConfig(lr=1e-3, router_lr=1e-2))
    gain = model.residual.router_gain
    assert [(g["weight_decay"], g["lr_scale"]) for g in groups if any(p is gain for p in g["params"])] == [(0, 1)]


def test_compiled_equals_eager():
    model, idx = routed_model("lime", n_layer=2), tokens()
    ref_logits, ref = run_routing(model, idx, reference=False)
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # dynamo + AOT autograd, no C++ build
    logits, loss = compiled(idx, idx)
    loss.backward()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def scratch_registry(monkeypatch):
    """methods.ROUTERS as a copy for the test: the methods it defines register there, and are gone after it."""
    monkeypatch.setattr(methods, "ROUTERS", dict(methods.ROUTERS))


@contextmanager
def set_aside(name):
    """methods.ROUTERS without the method `name` inside (a copy: what is defined there is gone after), and afterwards
    the same dict as before, in its order (a method popped and put back would go last)."""
    held = methods.ROUTERS
    methods.ROUTERS = {k: cls for k, cls in held.items() if k != name}
    try:
        yield
    finally:
        methods.ROUTERS = held


def test_a_forks_own_previous_is_set_aside_and_put_back_in_its_place(scratch_registry):
    """Where a fork has written the README's `Previous` and then methods of its own, the test of `previous` below
    leaves them in their order: else conftest's PRUNABLE (read before) no longer matches the errors' lists."""
    methods.ROUTERS.pop("previous", None)  # (a fork's own, in the copy: this test defines one)

    class Previous(lime.Own):
        name = "previous"

    class After(lime.Own):
        name = "test-after"

    before = list(methods.registry())
    with set_aside("previous"):
        assert "previous" not in methods.registry()
    assert list(methods.registry()) == before


@pytest.fixture
def previous_router():
    """A fork's router, written in this file alone (the README's "Fork it"); afterwards the registry is as it
    was (where a fork has pasted the README's `Previous` into ablations.py or a module of its own, it keeps
    that one: set aside meanwhile, since a name is one class's)."""
    with set_aside("previous"):
        class Previous(lime.Router):
            """Each head reads its own K/V and the same head's in the layer before, mixed by two learned numbers."""
            name = "previous"

            def source_layers(self, layer, J):
                return [layer - 1, layer]

            def __init__(self, config, layer, J=None):
                super().__init__(config, layer, J)
                self.weight = torch.nn.Parameter(torch.empty(self.n_kv, 2))  # (n_kv, n_src): within each head

            def weights(self, x=None):
                return self.weight

        yield Previous


def test_the_registry_imports_the_modules_that_define_methods(monkeypatch):
    """A script that never imports baselines.py still takes its methods by name (methods.registry)."""
    saved = dict(methods.ROUTERS)
    monkeypatch.delitem(sys.modules, "baselines")  # as if never imported; put back after the test
    for name, cls in saved.items():
        if cls.__module__ == "baselines":
            del methods.ROUTERS[name]
    try:
        assert "hc" not in methods.ROUTERS
        forms = re.split(", | or ", methods.router_forms())  # (a fork's module may come after baselines.py)
        assert forms[forms.index("hc[-J]"):][:4] == ["hc[-J]", "hc-static[-J]", "dwa", "value-residual"]
        assert methods.parse_router("hc")[1] == 4
    finally:
        methods.ROUTERS.clear()
        methods.ROUTERS.update(saved)  # the classes the other tests hold, in their order


def test_a_default_j_is_the_methods_own(scratch_registry):
    """A fork's method whose J defaults to 3 (this repo's all default to 4): its bare name parses to J 3, the probe
    builds it with J 3, its form is 'name[-J]', and the registry lists it after this repo's modules' methods."""

    class Recent(ablations.Last):
        name, J = "test-recent-J", 3

    assert methods.parse_router("test-recent") == (Recent, 3) and methods.parse_router("test-recent-5") == (Recent, 5)
    assert Recent.probe().sources == [0, 1, 2]  # layer 2's last 3 layers (J 2 would give [1, 2])
    assert re.split(", | or ", methods.router_forms())[-1] == "test-recent[-J]"
    assert list(methods.registry())[-1] == "test-recent-J"  # (defined after baselines.py's, and outside MODULES)


def test_a_name_is_one_method():
    """A class that states a name another class holds is an error where it is defined: else it would replace that one
    (here the paper's first-J) in every script. A subclass that states no name of its own is no --router value."""
    First = methods.parse_router("first-2")[0]
    with pytest.raises(TypeError, match=re.escape("two methods are named 'first-J': ablations.First and test_lime.")):
        class Mine(lime.LIMe):
            name = "first-J"

    class Base(First):  # (a base for a fork's routers, say)
        pass

    assert methods.parse_router("first-2")[0] is First and Base not in methods.registry().values()


def test_the_tests_of_every_method_build_a_j_below_the_depth(scratch_registry):
    """A fork's -J router refuses a J its model cannot take (README "Fork it"): one that reads layer l - J, J at or
    above the depth. The tests of every method build it at J 2 (its default aside) in 3 layers at least, so they
    test it rather than fail on its refusal."""
    class Skip(lime.LIMe):
        name = "test-skip-J"

        def __init__(self, config, layer, J=None):
            if J >= config.n_layer:
                raise cli.UsageError(f"--router=test-skip-{J}: J must be below n_layer={config.n_layer}")
            super().__init__(config, layer, J)

        def source_layers(self, layer, J):
            return sorted({max(0, layer - J), layer})

    test_one_graph_without_breaks("test-skip-2")  # (the one that built 2 layers)


@pytest.fixture
def gate(scratch_registry):
    """A fork's method of the stream, `test-gate`: h + g_i f(h), its gates at 1; it counts no FLOPs."""
    class Gate(lime.Residual):
        name = "test-gate"

        def __init__(self, config, J=None):
            super().__init__(config, J)
            self.g = torch.nn.Parameter(torch.empty(2 * config.n_layer))

        def init_weights(self):
            self.g.fill_(1.0)  # h + f(h): the plain residual

        def add(self, i, h, f):
            return h + self.g[i] * f(h)

    return Gate


def test_a_forks_method_is_held_to_none_and_benchmarked(gate, monkeypatch):
    """The tests of every method take a fork's method of the stream as this repo's: a fresh one is none, unless it
    says not (gates at 0.5: an error that names it), and it has a benchmark row."""
    assert "test-gate" in methods_where(lambda cls: cls.starts_as_none)  # (as AS_NONE reads it, for a fork's module)
    test_a_fresh_model_is_none("test-gate")
    test_a_benchmark_row("test-gate", monkeypatch)
    gate.init_weights = lambda self: self.g.fill_(0.5)
    with pytest.raises(AssertionError, match=re.escape("Gate: a fresh model is not none at [1, 2, 3,")):
        test_a_fresh_model_is_none("test-gate")
    gate.starts_as_none = False
    assert "test-gate" not in methods_where(lambda cls: cls.starts_as_none)


def test_a_method_of_the_stream_that_counts_no_flops_is_told_where_they_go(gate):
    """A method of the stream whose work is outside nn.Linear layers states its FLOPs in flops(): the test of every
    method says so, naming the class (not only that one number is not above another)."""
    with pytest.raises(AssertionError, match=re.escape("Gate.flops() counts nothing: a method of the stream states "
                                                       "there the FLOPs of its work outside nn.Linear layers")):
        test_a_method_is_counted_in_its_part("test-gate")


@pytest.mark.parametrize("name, why", [("gpt-2", "not ending in '-<digits>'"), ("a,b", "no ','"),
                                       ("hc", "--router=hc would name both baselines.HyperConnections and")])
def test_a_name_no_command_can_select_alone_is_an_error(scratch_registry, name, why):
    """'gpt-2' would parse as gpt-J with J 2, 'a,b' as two routers in --routers, and 'hc' would take over hc-J's
    default (hc-4) in every script: each an error where the class is defined."""
    with pytest.raises(TypeError, match=re.escape(why)):
        type("Named", (lime.Residual,), {"name": name})


def test_a_j_name_with_a_default_after_its_plain_name_is_an_error(scratch_registry):
    """The other order: 'test-x' first, then 'test-x-J' with a default J, which --router=test-x would also name."""
    type("Plain", (lime.LIMe,), {"name": "test-x"})
    with pytest.raises(TypeError, match=re.escape("--router=test-x would name both ")):
        type("WithJ", (lime.LIMe,), {"name": "test-x-J", "J": 4})


def test_a_router_is_one_class(previous_router, answer_dir, tmp_path, capsys):
    """Everything the class does not say is derived from what it says, and the scripts' own code
    trains, evaluates, prunes and benchmarks it."""
    assert "previous" in methods.router_forms(pruning.prunable)
    assert "previous" in re.split(", | or ", methods.router_forms())
    model = small_model("previous")  # 6 layers, 2 kv heads, head_dim 8
    assert isinstance(model.routers[3], previous_router) and model.routers[3].sources == [2, 3]
    R, eye = model.routing_weights()[3], torch.eye(2)  # (n_kv, 4, n_kv)
    assert torch.equal(R[:, 3], eye) and not R[:, :2].any() and not (R[:, 2] * (1 - eye)).any()
    assert 0 < R[:, 2].abs().max() <= math.sqrt(3 / 2)  # Kaiming-uniform over the 2 sources, as lime's
    extra = model.estimate_flops(32) - small_model("none").estimate_flops(32)
    assert extra == 6 * (5 * 2 * 2) * 2 * 8  # layers 1..5, 2 heads x 2 sources, K and V of 8 each
    model, idx = routed_model("previous"), tokens()
    logits, fast = run_routing(model, idx, reference=False)
    ref_logits, ref = run_routing(model, idx, reference=True)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)

    run = tmp_path / "run"
    train.main(tiny_args(answer_dir, run, "--router=previous", "--n-layer=3", "--max-steps=4", "--eval-interval=4",
                         "--router-top-p=0.6", "--prune-at=2"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["router"] == "previous" and summary["router_pruned"] > 0
    assert sample.main(["--out-dir", str(run), "--eval"]) == {k: v for k, v in summary.items() if "val_" in k or
                                                              k.startswith("acc_")}
    report = analyze.main(["prune", "--out-dir", str(run), "--top-p", "0.5"])
    assert report["weights"] == 2 * 2 * 2 and report["pruned"] >= summary["router_pruned"]  # layers 1, 2
    path = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--routers", "none,previous", "--n-layer", "3", "--block-size", "16",
                "--batch-size", "1", "--steps", "1", "--gen-repeats", "0", "--json", str(path)])
    assert [r["router"] for r in json.loads(path.read_text())["runs"][0]["results"]] == ["none", "previous"]


def test_a_router_that_sets_its_own_initial_values_keeps_them(scratch_registry):
    """GPT.init_weights gives a learned router the identity and Kaiming-uniform only when it says nothing itself."""
    class Halves(lime.LIMe):
        name = "test-halves"

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            self.gate = torch.nn.Linear(config.n_embd, 1, bias=False)  # (a Linear, which the model initialises too)

        @torch.no_grad()
        def init_weights(self):
            self.weight.fill_(0.5)
            self.gate.weight.zero_()

    model = small_model("test-halves")
    assert [type(r) for r in model.routers] == [lime.Own] + [Halves] * 5  # layer 0 reads only itself
    assert all(torch.equal(r.weight, torch.full_like(r.weight, 0.5)) for r in model.routers[1:])
    assert not any(r.gate.weight.any() for r in model.routers[1:])


def test_a_router_whose_weights_are_its_linears_starts_as_a_learned_router(scratch_registry):
    """weights() may be the weight of the router's own nn.Linear: it starts as lime's do (the identity on the layer's
    own heads, Kaiming-uniform elsewhere), not as the model's Linear layers (normal, std 0.02)."""
    class Mixer(lime.Router):
        name = "test-mixer"

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            self.mix = torch.nn.Linear(len(self.sources), self.n_kv, bias=False)  # weight (n_kv, n_src)

        def weights(self, x=None):
            return self.mix.weight

    for r in small_model("test-mixer").routers[1:]:  # 2 kv heads
        w = r.mix.weight
        assert torch.equal(w[:, -1], torch.ones(2)) and w[:, :-1].abs().max() > 0.1  # (std 0.02: 0.1 is 5 sd)
        assert w[:, :-1].abs().max() <= math.sqrt(3 / len(r.sources))


def test_what_the_defaults_cannot_reach(scratch_registry, answer_dir, tmp_path):
    """A per-token router's Linear maps start at zero, biases too, whatever their name (so it starts static);
    a weight the defaults cannot reach (weights() is an expand of it, or it is in an nn.ParameterList) that the class
    leaves unset, or sets in part, is an error: in train.py --dry-run already, although it builds the model on the
    meta device, where nothing has a value to check."""
    class Gated(lime.Router):
        name, per_token = "test-gated", True

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            self.weight = torch.nn.Parameter(torch.empty(self.n_kv, len(self.sources)))
            self.mix = torch.nn.Linear(config.n_embd, self.weight.numel())  # (with a bias)

        def weights(self, x=None):
            return self.weight if x is None else self.mix(x).view(*x.shape[:2], *self.weight.shape) + self.weight

    class Shared(lime.Router):
        name = "test-shared"

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            self.weight = torch.nn.Parameter(torch.empty(len(self.sources)))  # one weight a source, every head

        def weights(self, x=None):
            return self.weight.expand(self.n_kv, -1)

    class Partly(Shared):
        name = "test-partly"

        @torch.no_grad()
        def init_weights(self):
            self.weight[-1] = 1.0  # its own layer's weight only

    model = small_model("test-gated")
    assert all(not r.mix.weight.any() and not r.mix.bias.any() and torch.equal(r.weight[:, -1], torch.ones(2))
               for r in model.routers[1:])
    with pytest.raises(ValueError, match=re.escape("nothing gives Shared.weight an initial value: define "
                                                   "Shared.init_weights() (a value given in __init__ is not kept: the "
                                                   "model's init_weights sets every weight anew)")):
        small_model("test-shared")
    with pytest.raises(ValueError, match=re.escape("nothing gives Partly.weight an initial value")):
        small_model("test-partly")  # the weights of the other layers it reads are still unset
    with pytest.raises(ValueError, match=re.escape("nothing gives Shared.weight an initial value")):
        train.main(tiny_args(answer_dir, tmp_path / "run", "--router=test-shared", "--dry-run"))

    class Listed(lime.Residual):  # bare parameters in a container (as baselines.py's dwa holds its own): checked too
        name = "test-listed"

        def __init__(self, config=None, J=None):
            super().__init__()
            self.gains = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(1)) for _ in range(2))

        @torch.no_grad()
        def init_weights(self):
            self.gains[0].fill_(1.0)  # and gains[1] forgotten

    with pytest.raises(ValueError, match=re.escape("nothing gives Listed.gains.1 an initial value")):
        small_model("test-listed")


def test_a_parameter_torch_cannot_see_is_an_error(scratch_registry):
    """A method's parameter in a plain list or dict (where an nn.ParameterList was meant), or a module in one, would
    get gradients but no optimiser step, no place in a checkpoint or in num_params(): silently never trained (a
    router's weights() froze at their initial values). An error that names it as the model is built (on the meta
    device too, where train.py --dry-run builds it); a plain list of what torch sees elsewhere is none."""
    class Listed(lime.Router):
        name = "test-plain-list"

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            self.ws = [torch.nn.Parameter(torch.empty(self.n_kv, len(self.sources), self.n_kv))]

        def weights(self, x=None):
            return self.ws[0]

    class Gains(lime.Residual):
        name = "test-plain-gains"

        def __init__(self, config=None, J=None):
            super().__init__()
            self.gains = torch.nn.Parameter(torch.ones(2 * config.n_layer))
            self.both = (self.gains, torch.nn.RMSNorm(config.n_embd))  # the RMSNorm only here

        @torch.no_grad()
        def init_weights(self):
            self.gains.fill_(1.0)

    with pytest.raises(ValueError, match=re.escape("Listed.ws holds a parameter that torch does not see, in a list: "
                                                   "it would not train, nor be saved or counted; hold it in an "
                                                   "nn.ParameterList")):
        small_model("test-plain-list")
    with pytest.raises(ValueError, match=re.escape("Gains.both holds a parameter that torch does not see, in a tuple")):
        with torch.device("meta"):
            GPT(small_config("test-plain-gains"))

    class Seen(Gains):
        name = "test-seen-gains"

        def __init__(self, config=None, J=None):
            lime.Residual.__init__(self)
            self.gains = torch.nn.Parameter(torch.ones(2 * config.n_layer))
            self.both = [self.gains]  # (registered as gains)

    assert small_model("test-seen-gains").num_params()["residual"] == 12

    class Bare(lime.Residual):  # a tensor that requires grad, held as an attribute: no nn.Parameter, so no state
        name = "test-bare-tensor"

        def __init__(self, config=None, J=None):
            super().__init__()
            self.scale = torch.ones((), requires_grad=True)

    with pytest.raises(ValueError, match=re.escape("Bare.scale holds a parameter that torch does not see, in a "
                                                   "Tensor")):
        small_model("test-bare-tensor")


def test_a_torch_layer_in_a_method_keeps_its_own_initial_values(scratch_registry):
    """nn.MultiheadAttention sets its weights as it is built, as nn.Linear does, but in _reset_parameters (no
    reset_parameters): its in_proj_weight is not a bare parameter that nothing sets (it was an error)."""
    class DepthAttention(lime.Residual):
        name = "test-depth-attention"

        def __init__(self, config=None, J=None):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(config.n_embd, 1, batch_first=True)

    w = small_model("test-depth-attention").residual.attn.in_proj_weight  # (3 * 32, 32): torch's Xavier-uniform
    bound = math.sqrt(6 / (32 + 3 * 32))
    assert w.isfinite().all() and bound / 2 < w.abs().max() <= bound


def test_what_a_router_can_do_is_read_from_a_shape_it_takes(scratch_registry):
    """methods.satisfies reads what a router can do (prunable, ...) from methods.Method.probe's instance, of every
    method wherever the forms that can are listed (errors, conftest's PRUNABLE): a router that needs 2 kv heads and a J
    of 2 takes the probe's shape; one that refuses it is named in the error, with what to do."""

    class Pairs(lime.LIMe):
        name = "test-pairs-J"

        def __init__(self, config, layer, J=None):
            assert config.n_kv_head >= 2 and J >= 2, "pairs of heads, J of at least 2"
            super().__init__(config, layer, J)

    assert "test-pairs-J" in re.split(", | or ", methods.router_forms(pruning.prunable))

    class Quads(lime.LIMe):
        name = "test-quads"

        def __init__(self, config, layer, J=None):
            if config.n_kv_head % 4:
                raise ValueError("groups of 4 heads")
            super().__init__(config, layer, J)

    with pytest.raises(TypeError, match=r"test_lime\.test_.*\.Quads cannot be built at layer 2 with 2 kv heads and "
                                        r"J=None \(ValueError: groups of 4 heads\): give it a probe\(\)"):
        methods.router_forms(pruning.prunable)
    Quads.probe = classmethod(lambda cls: cls(small_config("none", n_kv_head=4), 2))  # what the error asks for
    assert "test-quads" in re.split(", | or ", methods.router_forms(pruning.prunable))
    # the probe's J is a name's default, else 2: last-J's probe reads the 2 most recent layers of 3
    assert ablations.Last.probe().sources == [1, 2] and lime.LIMe.probe().sources == [0, 1, 2]


def test_a_forks_usual_slips_are_errors_that_name_its_class(scratch_registry):
    """What a fork gets wrong first, each an error naming its class and what to do, not a traceback from deep inside:
    an __init__ without J (for the probe, it asked for a probe() before), a router that never sets self.weight (an
    AttributeError, "did you mean 'weights'"), and a stream whose sub-layers or final norm would read another shape
    than (B, T, n_embd) (a ValueError of unpacking in Attention, or a batch size mismatch in the loss)."""

    class NoJ(lime.LIMe):
        name = "test-no-j"

        def __init__(self, config, layer):
            super().__init__(config, layer)

    with pytest.raises(TypeError, match=re.escape("NoJ.__init__ cannot take (config, layer, J), which every router is "
                                                  "built with (too many positional arguments)")):
        methods.router_forms(pruning.prunable)
    del methods.ROUTERS["test-no-j"]

    type("Unset", (lime.Router,), {"name": "test-unset"})
    with pytest.raises(ValueError, match=re.escape("Unset.weights() failed ('Unset' object has no attribute 'weight'): "
                                                   "a router sets self.weight (a Parameter, or a buffer) in its "
                                                   "__init__, or defines weights()")):
        small_model("test-unset")

    class Tall(lime.Residual):  # a sub-layer's output joins the stream as a new last dimension
        name = "test-tall"

        def add(self, i, h, f):
            return (h + f(h))[..., None]

    class Streams(lime.Residual):  # two streams, each sub-layer reads their sum: and no end() to sum them at the end
        name = "test-streams"

        def start(self, x):
            return torch.stack([x, x])

        def add(self, i, h, f):
            return h + f(h.sum(0))

    with pytest.raises(ValueError, match=re.escape("Tall.add(1, h, f) gives f (2, 3, 32, 1) for a batch of 2 x 3 "
                                                   "tokens: it must be (2, 3, 32), (B, T, n_embd)")):
        small_model("test-tall")
    with pytest.raises(ValueError, match=re.escape("Streams.end(h) is (2, 2, 3, 32) for a batch of 2 x 3 tokens: it "
                                                   "must be (2, 3, 32), (B, T, n_embd)")):
        small_model("test-streams")
    Streams.end = lambda self, h: h.sum(0)
    idx = tokens()
    assert small_model("test-streams")(idx, idx)[0].shape == (*idx.shape, 64)


def test_the_check_of_a_stream_leaves_its_method_as_built(scratch_registry):
    """The build's forward through the stream alone (methods.check_residual) runs on a copy: what the method counts,
    holds or keeps in eval mode is as its __init__ left it; and its tokens are no more than the block's."""

    class Keeper(lime.Residual):
        name = "test-keeper"

        def __init__(self, config=None, J=None):
            super().__init__()
            self.block_size, self.seen = config.block_size, []
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
            self.frozen = torch.nn.Dropout(0.5).eval()

        def start(self, x):
            assert x.shape[1] <= self.block_size, "a table of positions would end there"
            self.calls += 1
            self.seen.append(x)
            return x

    for block_size in (16, 2):
        residual = small_model("test-keeper", block_size=block_size).residual
        assert (residual.calls, residual.seen, residual.training, residual.frozen.training) == (0, [], True, False)


def test_a_router_whose_sources_break_the_rule_is_named_by_a_dry_run(scratch_registry, answer_dir, tmp_path):
    """source_layers() that lists a layer twice (layer 0, then the last J, at layer 1) is listed as a router (the
    probe, at layer 2, reads its flags alone); the model it cannot build is an error that names the router and what
    it gave, in train.py --dry-run already (so grid.py refuses it before it writes anything), not in every run."""

    class Twice(lime.LIMe):
        name = "test-twice-J"

        def source_layers(self, layer, J):
            return [0] + list(range(max(0, layer - J + 1), layer + 1))

    assert "test-twice-J" in re.split(", | or ", methods.router_forms(pruning.prunable))
    message = re.escape("Twice.source_layers(1, 2) gave [0, 0, 1]: it must list distinct layers of 0..1, ascending, "
                        "the layer itself last")
    with pytest.raises(ValueError, match=message):
        train.main(tiny_args(answer_dir, tmp_path / "run", "--router=test-twice-2", "--dry-run"))
    assert not (tmp_path / "run").exists()
    Twice.source_layers = lambda self, layer, J: [layer - J, layer]  # a layer before 0
    with pytest.raises(ValueError, match=re.escape("Twice.source_layers(1, 2) gave [-1, 1]: it must list distinct")):
        small_model("test-twice-2")
    Twice.source_layers = lambda self, layer, J: list(range(layer))  # the layers before it, not itself
    with pytest.raises(ValueError, match=re.escape("Twice.source_layers(1, 2) gave [0]: it must list distinct")):
        small_model("test-twice-2")


def test_a_j_that_a_method_refuses_is_one_line(scratch_registry, answer_dir, tmp_path, capsys):
    """A J a method cannot take at this shape: a cli.UsageError as it is built, one line, exit 2, in train.py --dry-run
    already, with nothing written; a Residual's the same. Any other exception there is a bug: its traceback stays."""
    class Strict(lime.LIMe):
        name = "test-strict-J"

        def __init__(self, config, layer, J=None):
            if J > config.n_layer:
                raise cli.UsageError(f"--router={config.router}: J={J} is more than the model's "
                                     f"{config.n_layer} layers")
            super().__init__(config, layer, J)

    class Wide(lime.Residual):
        name = "test-wide-J"

        def __init__(self, config=None, J=None):
            super().__init__()
            if J > config.n_layer:
                raise cli.UsageError(f"--router={config.router}: J={J} is more than the model's "
                                     f"{config.n_layer} layers")

    class Buggy(lime.LIMe):
        name = "test-buggy"

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            torch.nn.init.kaiming_uniform_(torch.nn.Parameter(torch.empty(self.n_kv)))  # (a ValueError inside torch)

    for name in ("test-strict-3", "test-wide-3"):
        assert error_of(train.main, tiny_args(answer_dir, tmp_path / "run", f"--router={name}", "--dry-run"),
                        capsys) == f"train.py: error: --router={name}: J=3 is more than the model's 2 layers"
        assert not (tmp_path / "run").exists()
    assert small_model("test-strict-2").routers[-1].sources == list(range(6))  # (6 layers: a J it takes)
    with pytest.raises(ValueError, match="Fan in and fan out") as e:
        train.main(tiny_args(answer_dir, tmp_path / "run", "--router=test-buggy", "--dry-run"))
    assert not isinstance(e.value, cli.UsageError)


def test_a_name_any_command_selects_is_taken(scratch_registry):
    """--router=MUDD selects a class named 'MUDD' (parse_router matches names exactly), so the name rule takes it;
    a plain name whose class inherits a default J ('foo', from hc-J) is no clash with a 'foo-J' that has none."""
    mudd = type("Mudd", (lime.LIMe,), {"name": "MUDD"})
    assert methods.parse_router("MUDD") == (mudd, None)
    foo_j = type("FooJ", (lime.LIMe,), {"name": "test-foo-J"})
    foo = type("Foo", (lime.LIMe,), {"name": "test-foo", "J": 4})
    assert methods.parse_router("test-foo") == (foo, None) and methods.parse_router("test-foo-3") == (foo_j, 3)


def test_weights_that_do_not_fit_the_sources_are_an_error(scratch_registry):
    """weights() with a column per source, or else an error as the model is built: a source too many would otherwise
    train, unread (the routing takes each source's own column), and one too few fail deep in the routing. The same
    for a per-token router's weights(x), on the meta device too (where train.py --dry-run builds it)."""
    class Wide(lime.LIMe):
        name, extra = "test-wide", 1

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            self.weight = torch.nn.Parameter(torch.empty(self.n_kv, len(self.sources) + self.extra))

    for Wide.extra, shape in [(1, (2, 3)), (-1, (2, 1))]:
        with pytest.raises(ValueError, match=re.escape(f"Wide.weights() is {shape} at layer 1: for 2 source layer(s) "
                                                       "and 2 kv heads, it must be (2, 2, 2) or (2, 2)")):
            small_model("test-wide")
    Wide.extra = 0
    assert small_model("test-wide").routers[1].weights().shape == (2, 2)

    class Gate(lime.Router):  # the weight of each source, per token: its last column one too many
        name, per_token = "test-gate", True

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            self.weight = torch.nn.Parameter(torch.empty(self.n_kv, len(self.sources)))
            self.mix = torch.nn.Linear(config.n_embd, self.n_kv * (len(self.sources) + 1), bias=False)

        def weights(self, x=None):
            return self.weight if x is None else self.mix(x).view(*x.shape[:2], self.n_kv, -1)

    with pytest.raises(ValueError, match=re.escape("Gate.weights(x) is (2, 3, 2, 3) at layer 1: for 2 source layer(s) "
                                                   "and 2 kv heads, it must be (2, 3, 2, 2)")):
        with torch.device("meta"):  # (as --dry-run builds it)
            small_model("test-gate")

    class PerSequence(lime.Router):  # a weight per sequence (its mean: the future too), broadcast over T, silently
        name, per_token = "test-per-sequence", True

        def __init__(self, config, layer, J=None):
            super().__init__(config, layer, J)
            self.weight = torch.nn.Parameter(torch.empty(self.n_kv, len(self.sources)))
            self.mix = torch.nn.Linear(config.n_embd, self.n_kv * len(self.sources), bias=False)

        def weights(self, x=None):
            return self.weight if x is None else self.mix(x.mean(1, keepdim=True)).view(x.shape[0], 1, self.n_kv, -1)

    with pytest.raises(ValueError, match=re.escape("PerSequence.weights(x) is (2, 1, 2, 2) at layer 1")):
        small_model("test-per-sequence")


@pytest.mark.parametrize("J", ["x", 2.5, 0, -1, True])
def test_a_default_j_that_is_no_j_is_an_error_where_the_class_is_defined(scratch_registry, J):
    """A fork's default J of another kind (a string, 2.5) failed deep in the build in a traceback, and one out of
    range (0, -1) was told to the user as if the command had given it."""
    with pytest.raises(TypeError, match=re.escape(f"Skip.J = {J!r}: a default J is a whole number from 1, or None")):
        type("Skip", (lime.LIMe,), {"name": "test-skip-J", "J": J})


def test_initial_weights_have_the_stated_scales():
    """GPT-2's init (GPT.init_weights): the embedding and every Linear N(0, 0.02), the residual branches' outputs
    (c_proj) N(0, 0.02 / sqrt(2 n_layer)), RMSNorm gains one. Over thousands of draws each, the sample sd is
    within a few % of its std (seeded)."""
    model = small_model("lime")  # 6 layers: c_proj's std 0.02 / sqrt(12) = 0.00577
    proj = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("c_proj.weight")])
    rest = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith(("c_q.weight", "c_kv.weight",
                                                                                      "c_fc.weight", "wte.weight"))])
    assert proj.numel() == 6 * (32 * 32 + 64 * 32) and rest.numel() == 64 * 32 + 6 * (32 * 32 + 32 * 32 + 128 * 32)
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(12), rel=0.03)
    assert rest.std().item() == pytest.approx(0.02, rel=0.03)
    assert abs(proj.mean()) < 0.1 * proj.std() and abs(rest.mean()) < 0.1 * rest.std()
    norms = [p for n, p in model.named_parameters() if "ln_" in n]
    assert len(norms) == 2 * 6 + 1 and all(torch.equal(p, torch.ones_like(p)) for p in norms)


def test_rope_rotates_each_pair_by_position_times_its_frequency():
    """RoPE in complex numbers: the pair (x[i], x[i + head_dim/2]) as x[i] + 1j x[i + head_dim/2], times
    exp(1j * position * theta^(-2i / head_dim)). Here head_dim 4 and theta 10000: frequencies 1 and 0.01."""
    config = GPTConfig(block_size=8, vocab_size=8, n_layer=1, n_head=2, n_kv_head=2, n_embd=8, mlp_hidden=8)
    cos, sin = lime.rope_tables(config)
    x = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))  # (B, heads, T, head_dim)
    z = torch.complex(x[..., :2].double(), x[..., 2:].double())
    angles = torch.arange(8.0, dtype=torch.float64)[:, None] * torch.tensor([1.0, 0.01], dtype=torch.float64)
    z = z * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(lime.apply_rope(x, cos, sin), torch.cat([z.real, z.imag], -1).float())


@pytest.mark.parametrize("mode", ["none", "lime"])
def test_only_relative_positions_matter(mode):
    """RoPE rotates queries and keys alike, so attention sees only how far apart two positions are: a sequence
    placed 7 positions later (its RoPE tables shifted) gives the same logits. Without RoPE they differ. Two modes
    stand for every method: Attention rotates K/V after any routing, and no method reads the tables."""
    model, idx = small_model(mode), tokens()
    want = model(idx)[0]
    cos, sin = lime.rope_tables(small_config(mode, block_size=32 + 7))
    model.rope_cos, model.rope_sin = cos[7:], sin[7:]
    torch.testing.assert_close(model(idx)[0], want, rtol=1e-4, atol=1e-5)
    model.rope_cos, model.rope_sin = torch.ones_like(cos[7:]), torch.zeros_like(sin[7:])  # no rotation at all
    assert not torch.allclose(model(idx)[0], want, rtol=1e-4, atol=1e-5)


def as_written(model, idx):
    """The logits of a `none` or `lime` model by the formulas themselves, head by head in float64: RMSNorm, each
    kv-head's [keys | values] in c_kv, routed before RoPE (kv~[l, h] = sum_{l' <= l, h'} R^(l)[h, l', h'] kv[l', h']),
    query head i reading kv-head i // (n_head / n_kv_head) as LLaMA's repeat_kv does, softmax(q k^T / sqrt(head_dim))
    under the causal mask, SwiGLU with the gate first in c_fc, the head tied to the embedding."""
    c, (B, T) = model.config, idx.shape
    hd, group = c.n_embd // c.n_head, c.n_head // c.n_kv_head
    rms = lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps) * g
    angles = torch.arange(T, dtype=torch.float64)[:, None] * c.rope_theta ** (
        -torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    turn = torch.polar(torch.ones_like(angles), angles)[:, None]  # (T, 1, hd/2)

    def rope(x):  # each pair (x[i], x[i + hd/2]) as a complex number, turned by its position's angle
        z = torch.complex(x[..., :hd // 2], x[..., hd // 2:]) * turn
        return torch.cat([z.real, z.imag], -1)

    causal = torch.ones(T, T, dtype=torch.bool).tril()
    h, kvs = model.transformer.wte.weight[idx], []
    for layer, (block, R) in enumerate(zip(model.transformer.h, model.routing_weights())):
        attn, x = block.attn, rms(h, block.ln_1.weight)
        q = rope((x @ attn.c_q.weight.T).view(B, T, c.n_head, hd))
        kvs.append((x @ attn.c_kv.weight.T).view(B, T, c.n_kv_head, 2 * hd))
        kv = sum(R[:, j, k, None] * kvs[j][:, :, k, None] for j in range(layer + 1) for k in range(c.n_kv_head))
        k, v = rope(kv[..., :hd]), kv[..., hd:]
        heads = []
        for i in range(c.n_head):
            scores = torch.einsum("btd,bsd->bts", q[:, :, i], k[:, :, i // group]) / math.sqrt(hd)
            heads.append(scores.masked_fill(~causal, -math.inf).softmax(-1) @ v[:, :, i // group])
        h = h + torch.cat(heads, -1) @ attn.c_proj.weight.T
        gate, up = (rms(h, block.ln_2.weight) @ block.mlp.c_fc.weight.T).split(c.mlp_hidden, dim=-1)
        h = h + (torch.nn.functional.silu(gate) * up) @ block.mlp.c_proj.weight.T
    return rms(h, model.transformer.ln_f.weight) @ model.transformer.wte.weight.T


@pytest.mark.parametrize("mode", ["none", "lime"])
def test_the_model_is_the_formulas_as_written(mode):
    """The whole forward against as_written: what the tests that compare the model with itself (fast against
    reference routing, cache against recomputation, a fresh method against `none`) cannot see, a convention of the
    weights' layout (gate and up, keys and values, which kv-head a query head reads) or attention's scale. The
    formulas are LIMe's (`none` its identity router): another router's routing is held to route_reference, the same
    formula in code, by the tests of every method; a method of the stream writes its own (test_baselines.py)."""
    model, idx = perturbed(small_model(mode).double(), 0.1), tokens()  # 4 query heads on 2 kv-heads; every gain moved
    with torch.no_grad():  # (the model's RoPE tables are float32 numbers, also in a .double() model: 3e-8 apart here)
        torch.testing.assert_close(model(idx)[0], as_written(model, idx), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", EVERY)
def test_gradients_are_the_derivative(mode):
    """Autograd's gradient against a central difference of the output, along a random direction in every parameter
    (float64): what a stray .detach() or a wrong backward anywhere would break, in the routing and outside it."""
    model, idx = small_model(mode).double(), tokens(T=8)
    g = torch.Generator().manual_seed(0)
    perturbed(model, 0.02, g)  # no path starts at zero
    params = list(model.parameters())
    probe = torch.randn(2, 8, 64, generator=g, dtype=torch.float64)  # the output: a random sum of the logits
    direction = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
    (model(idx)[0] * probe).sum().backward()
    along = sum((p.grad * d).sum() for p, d in zip(params, direction))
    eps, value = 1e-6, {}
    with torch.no_grad():
        for step, sign in ((eps, "+"), (-2 * eps, "-")):
            for p, d in zip(params, direction):
                p.add_(step * d)
            value[sign] = (model(idx)[0] * probe).sum()
    torch.testing.assert_close(along, (value["+"] - value["-"]) / (2 * eps), rtol=1e-6, atol=0)  # 2e-8 at most here
