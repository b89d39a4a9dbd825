"""The baselines (baselines.py): each counts its parameters and FLOPs right, Hyper-Connections start as the LLaMA
baseline up to the final norm, and each computes what its paper writes. Shapes, causality, the KV cache, one compiled
graph, that every parameter learns, that a run resumes bit-exactly, that a fresh model is exactly `none` (where the
method says it starts so) and a benchmark row are test_lime.py's, which run over every method there is."""

import pytest
import torch

import bench
import lime
from cli import UsageError
from conftest import small_model, tokens


def outputs_per_block(model, idx):
    """The logits, and the stream after each block as the final norm would read it (the sum of
    Hyper-Connections' streams), with the raw output of each block."""
    raw = []
    hooks = [b.register_forward_hook(lambda m, i, out: raw.append(out)) for b in model.transformer.h]
    logits = model(idx)[0]
    for h in hooks:
        h.remove()
    return logits, raw


@pytest.mark.parametrize("method", ["hc", "hc-static"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_a_fresh_model_is_the_baseline_up_to_its_final_norm(method, autocast):
    """Given none's weights, each of the n streams after every block is exactly none's residual stream, and the
    logits are none's up to the final norm's epsilon: it reads the sum of the n streams, which it scales back (held to
    rounding with a tiny one; so starts_as_none is False, and test_lime.py's exact test leaves it out). Under bf16
    autocast too: the streams stay in fp32, as none's does (a matmul would have rounded them to bf16)."""
    base, model = small_model("none", seed=0, norm_eps=1e-12), small_model(method, seed=1, norm_eps=1e-12)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("residual.") for k in missing)
    idx = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want_logits, want = outputs_per_block(base, idx)
        logits, got = outputs_per_block(model, idx)
    for x, h in zip(want, got):  # (B, T, C) against the streams (B, T, n, C): n identical copies
        assert h.shape[2] == 4 and torch.equal(h, x[:, :, None].expand_as(h))
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)


def test_hyper_connections_take_up_to_64_streams():
    assert small_model("hc-64").residual.n == 64
    with pytest.raises(UsageError, match="--router=hc-65: at most 64 streams"):
        small_model("hc-65")


def test_parameters_and_flops():
    """By hand, for the small model: 6 layers, d 32, 2 kv heads of 8 dimensions (K and V: 16)."""
    none = small_model("none")
    base_params, base_flops = none.num_params()["total"], none.estimate_flops(32)
    subs, C, n = 12, 32, 4  # a hyper-connection around every sub-layer, 2 per block
    static = subs * (n * (n + 1) + n)
    dynamic = subs * (C * (n + 1) + C + 2)
    expected = {  # method: (parameters it adds, training FLOPs per token it adds)
        "hc": (static + dynamic, 6 * subs * (n * (n + 1) * C + n * C) * 2),
        "hc-static": (static, 6 * subs * (n * (n + 1) * C + n * C)),
        "hc-2": (subs * (2 * 3 + 2) + subs * (C * 3 + C + 2), 6 * subs * (2 * 3 * C + 2 * C) * 2),
        "dwa": (sum(l + 2 for l in range(6)), 6 * C * sum(l + 2 for l in range(6))),
        "value-residual": (5 * 2, 6 * 5 * (2 * 2) * 8),  # layers 1..5: a weight per head; 2 sources, V only
    }
    for method, (params, flops) in expected.items():
        model = small_model(method)  # (each counted once, in its part: test_lime.py's test of every method)
        assert model.num_params()["total"] - base_params == params, method
        assert model.estimate_flops(32) - base_flops == flops, method


def test_the_memory_a_baseline_keeps_for_the_backward():
    """Hyper-Connections keep n = 4 copies of the stream for the backward; depth-weighted averaging about none's
    activations. (Every method's benchmark row: test_lime.py's.)"""
    out = bench.main(["--device", "cpu", "--routers", "none,hc,hc-static,dwa", "--n-layer", "2", "--block-size", "16",
                      "--batch-size", "1", "--steps", "1", "--gen-repeats", "0"])
    memory = {r["router"]: r["memory_bytes"] for r in out["runs"][0]["results"]}
    assert memory["hc"] > memory["hc-static"] > memory["none"] and memory["dwa"] < 1.05 * memory["none"]


def test_value_residual_adds_layer_0s_values_to_the_values_alone():
    """Layer l > 0 attends with its own keys and with values v_l + lam * v_0 (per head): by hand, on K/V given to
    the routing; and in the model, its attention output is linear in lam (the softmax of its own keys stays). A
    checkpoint holds lam alone (its own weight, fixed at 1, is no state: checkpoints load without it)."""
    model = small_model("value-residual")  # 6 layers, 2 kv heads of head_dim 8: a K/V is [keys | values], 16 wide
    lams = [f"transformer.h.{l}.attn.router.lam" for l in range(1, 6)]
    assert [k for k in model.state_dict() if ".router." in k] == lams
    lam = torch.tensor([[0.5], [-2.0]])
    with torch.no_grad():
        for router in model.routers[1:]:
            router.lam.copy_(lam)
    routing = lime.Routing(model.routers, model.readers)
    g = torch.Generator().manual_seed(0)
    kvs = [torch.randn(2, 3, 2, 16, generator=g) for _ in range(6)]
    for layer, kv in enumerate(kvs):
        expected = kv.clone()
        if layer > 0:
            expected[..., 8:] += lam * kvs[0][..., 8:]  # lam (n_kv, 1) against (B, T, n_kv, head_dim)
        torch.testing.assert_close(routing(layer, kv, None), expected, rtol=0, atol=1e-6)
    outs, idx = [], tokens()
    hook = model.transformer.h[2].attn.register_forward_hook(lambda m, i, out: outs.append(out))
    for value in (0.0, 1.0, 3.0):
        with torch.no_grad():
            model.routers[2].lam.fill_(value)
            model(idx)
    hook.remove()
    torch.testing.assert_close(outs[2] - outs[0], 3 * (outs[1] - outs[0]), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(outs[1], outs[0])


def test_hyper_connections_start_as_the_paper_says():
    """The initial values, by hand: sub-layer i reads stream i mod n, each stream goes on as it is (the identity) and
    takes the whole output (beta 1); the dynamic part is zero behind gates of 0.01."""
    hc = small_model("hc").residual  # 12 sub-layers, n = 4
    alpha = torch.zeros(12, 4, 5)
    for i in range(12):
        alpha[i, i % 4, 0] = 1.0
        alpha[i, :, 1:] = torch.eye(4)
    assert torch.equal(hc.alpha, alpha) and torch.equal(hc.beta, torch.ones(12, 4))
    assert not hc.alpha_fn.any() and not hc.beta_fn.any()
    assert torch.equal(hc.alpha_scale, torch.full((12,), 0.01)) and torch.equal(hc.beta_scale, torch.full((12,), 0.01))


def test_a_hyper_connection_as_the_paper_writes_it():
    """One sub-layer of `hc`, by the paper's formulas, one token and stream at a time, with random connections:
    Hn = H / sqrt(mean H^2 + eps) per stream (eps the model's norm_eps), A = alpha + s_a tanh(Hn W_a),
    B = beta + s_b tanh(Hn w_b); the sub-layer reads sum_j A[j, 0] H[j], and stream k goes on as
    B[k] f(that) + sum_j A[j, 1 + k] H[j]; at the end, the sum of the streams."""
    hc = small_model("hc", n_embd=8, n_head=2, n_kv_head=2, norm_eps=0.5).residual  # n = 4 streams of 8
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hc.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    H = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    W = torch.randn(8, 8, generator=g, dtype=torch.float64)

    def f(x):  # the sub-layer: any map of (B, T, C)
        return torch.tanh(x @ W)

    i = 5
    out = hc.double().add(i, H, f)
    A0, B0, Wa, wb = hc.alpha[i], hc.beta[i], hc.alpha_fn[i], hc.beta_fn[i]
    for b in range(2):
        for t in range(3):
            h = H[b, t]  # (n, C)
            Hn = h / (h.square().mean(-1, keepdim=True) + 0.5).sqrt()
            A = A0 + hc.alpha_scale[i] * torch.tanh(Hn @ Wa)  # (n, n + 1)
            B = B0 + hc.beta_scale[i] * torch.tanh(Hn @ wb)  # (n)
            y = f(sum(A[j, 0] * h[j] for j in range(4)))
            for k in range(4):
                want = B[k] * y + sum(A[j, 1 + k] * h[j] for j in range(4))
                torch.testing.assert_close(out[b, t, k], want, msg=f"{b} {t} {k}")
    # and the final norm reads the sum of the n streams (not their mean, not one of them)
    torch.testing.assert_close(hc.end(out), out[:, :, 0] + out[:, :, 1] + out[:, :, 2] + out[:, :, 3])


def test_depth_weighted_averaging_as_the_paper_writes_it():
    """DenseFormer, by hand: each block is h + attn(h), then + mlp(h); after block l the stream becomes
    sum_j alpha_l[j] X_j over X_0 = the embedding and X_1..X_{l+1} the outputs of blocks 0..l (random alphas)."""
    dwa = small_model("dwa", n_layer=3).residual
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a in dwa.alphas:
            a.copy_(torch.randn(a.shape, generator=g))
    Ws = [torch.randn(32, 32, generator=g) / 32**0.5 for _ in range(6)]
    fs = [lambda x, W=W: torch.tanh(x @ W) for W in Ws]  # sub-layer i: attention (even i) or MLP (odd i)
    x = torch.randn(2, 3, 32, generator=g)
    state = dwa.start(x)
    for i, f in enumerate(fs):
        state = dwa.add(i, state, f)
    h, X = x, [x]
    for l in range(3):
        h = h + fs[2 * l](h)
        h = h + fs[2 * l + 1](h)
        X.append(h)
        h = sum(dwa.alphas[l][j] * X[j] for j in range(l + 2))
    torch.testing.assert_close(dwa.end(state), h)
