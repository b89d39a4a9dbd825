"""The test suite: CPU only, no network. Run with `python -m pytest -q`."""

import ast
import contextlib
import dataclasses
import filecmp
import http.server
import json
import math
import operator
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch

if not torch.cuda.is_available():  # before lime imports kernels.py: Triton kernels then run on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the files under test, from the ground floor up
import kernels  # noqa: E402
import lime  # noqa: E402
import prepare_data as pd  # noqa: E402
import common  # noqa: E402
import analyze  # noqa: E402
import bench  # noqa: E402
import grid  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from bench import saved_bytes  # noqa: E402
from lime import GPT, GPTConfig  # noqa: E402

MODES = ["none", "lime", "average", "last-2", "first-2", "dynamic"]
LEARNED = ["lime", "last-2", "first-2", "dynamic"]
ROUTED = ["lime", "average", "last-2", "first-2", "dynamic"]


def small_config(router, **kw):
    base = dict(block_size=32, vocab_size=64, n_layer=6, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, router=router)
    return GPTConfig(**{**base, **kw})


def small_model(router, seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(small_config(router, **kw))


def tokens(B=2, T=16, vocab=64, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# ---- the model ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("mode", MODES)
def test_causal(mode):
    model = small_model(mode)
    idx = tokens()
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("mode", MODES)
def test_kv_cache_generation_equals_recomputation(mode):
    model = small_model(mode).eval()
    prompt = tokens(T=5)
    out = model.generate(prompt, 12, temperature=0)
    ref = prompt
    for _ in range(12):  # no cache: the whole sequence again at every step
        ref = torch.cat([ref, model(ref)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ref)
    # the cached logits themselves match, not only their argmax
    cache = lime.KVCache(model.config)
    model(ref[:, :5], cache=cache)
    stepped = model(ref[:, 5:6], cache=cache)[0][:, -1]
    torch.testing.assert_close(stepped, model(ref[:, :6])[0][:, -1], rtol=1e-5, atol=1e-5)


def test_generate_sampling_and_length_check():
    model = small_model("lime").eval()
    torch.manual_seed(3)
    a = model.generate(tokens(T=4), 8, temperature=1.0, top_k=5)
    torch.manual_seed(3)
    b = model.generate(tokens(T=4), 8, temperature=1.0, top_k=5)
    assert a.shape == (2, 12) and torch.equal(a, b)
    with pytest.raises(ValueError, match="block_size"):
        model.generate(tokens(T=30), 5)
    with pytest.raises(ValueError, match="top_k=0"):
        model.generate(tokens(T=4), 2, top_k=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        model.generate(tokens(T=4), 2, temperature=-1)


@pytest.mark.parametrize("mode", LEARNED)
def test_gradients_reach_router(mode):
    model = small_model(mode)
    idx = tokens()
    model(idx, idx)[1].backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "router" in n}
    assert len(grads) >= model.config.n_layer - 1
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())


def routed_model(mode, **kw):
    """A model whose routing matters everywhere: the dynamic routers' input maps start at zero."""
    model = small_model(mode, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router.proj" in name:
                p.normal_(0, 0.2)
    return model


def run_routing(model, idx, reference, autocast=False, block=None):
    """Logits and every parameter's gradient, through the fast or the reference routing; with
    `block`, the backward starts from that block's output instead of the loss."""
    model.reference_routing = reference
    model.zero_grad()
    out = {}
    hook = block is not None and model.transformer.h[block].register_forward_hook(lambda m, i, o: out.update(x=o))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, loss = model(idx, idx)
    (out["x"].square().sum() if hook else loss).backward()
    if hook:
        hook.remove()
    model.reference_routing = False
    return logits.float(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ROUTED)
def test_fast_routing_equals_the_reference(mode):
    """kernels.route (and dynamic's per-source sum) against route_reference: forward, every gradient, bf16."""
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


@pytest.mark.parametrize("mode", ["lime", "last-2", "dynamic"])
def test_backward_from_an_inner_block(mode):
    """Backward from block 2 of 6: the routed K/V pushed to later layers get no gradient."""
    model, idx = routed_model(mode), tokens()
    _, fast = run_routing(model, idx, reference=False, block=2)
    _, ref = run_routing(model, idx, reference=True, block=2)
    assert "transformer.h.3.attn.c_q.weight" not in ref and ref.keys() <= fast.keys()
    for name in fast:  # the fast path gives later routers a zero gradient where the reference gives none
        expected = ref.get(name, torch.zeros_like(fast[name]))
        torch.testing.assert_close(fast[name], expected, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_one_graph_without_breaks(mode):
    model = small_model(mode, n_layer=3)
    explanation = torch._dynamo.explain(model)(tokens(), tokens())
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons


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


@pytest.mark.parametrize("mode", LEARNED)
def test_identity_router_equals_none(mode):
    base = small_model("none", seed=0)
    routed = small_model(mode, seed=1)  # different weights everywhere, then overwritten
    missing, unexpected = routed.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all("router" in k for k in missing)
    with torch.no_grad():
        for name, p in routed.named_parameters():
            if name.endswith("router.weight"):
                p.zero_()
                p[:, -1] = 1.0 if mode == "dynamic" else torch.eye(p.shape[0])
            elif "router" in name:
                p.zero_()
    idx = tokens()
    torch.testing.assert_close(routed(idx)[0], base(idx)[0], rtol=0, atol=1e-6)


def test_route_ops_pass_opcheck():
    """Schema, fake (meta) kernels with the real strides, autograd registration: what torch.compile relies on."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 5, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 3, 3, generator=g, requires_grad=True)
    partials = [torch.randn(2, 5, 3, 8, generator=g, requires_grad=True)]
    torch.library.opcheck(kernels.route, (kv, w, partials))
    grads = [torch.randn(2, 5, 3, 8, generator=g) for _ in range(3)]
    torch.library.opcheck(kernels.route_backward, (grads, kv.detach(), w.detach(), True))


@pytest.mark.parametrize("n_out, n_partials, n_kv, E, dtype", [
    (3, 2, 3, 8, torch.float32),  # heads and positions that fill no block
    (11, 10, 4, 12, torch.float32),  # more outputs than one launch takes (kernels.NMAX); E not a power of 2
    (2, 0, 2, 16, torch.bfloat16),
])
def test_triton_kernels_equal_plain_pytorch(monkeypatch, n_out, n_partials, n_kv, E, dtype):
    """The Triton kernels, run by Triton's CPU interpreter, against the plain implementation."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    kv, w = torch.randn(2, 17, n_kv, E, generator=g).to(dtype), torch.randn(n_out, n_kv, n_kv, generator=g)
    partials = [torch.randn(kv.shape, generator=g).to(dtype) for _ in range(n_partials)]
    grads = [torch.randn(kv.shape, generator=g).to(dtype) for _ in range(n_out)]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.05)
    results = {}
    for impl in ("0", "1"):  # LIME_TRITON: plain PyTorch, then Triton
        monkeypatch.setattr(kernels, "USE_TRITON", impl)
        results[impl] = (kernels.route(kv, w, partials), kernels.route_backward(grads, kv, w, True),
                         kernels.route_backward(grads, kv, w, False))
    (plain_out, plain_grads, plain_no_w), (out, grads_, no_w) = results["0"], results["1"]
    assert len(out) == n_out and all(o.is_contiguous() and o.dtype == dtype for o in out)
    for a, b in zip(out + list(grads_) + list(no_w), plain_out + list(plain_grads) + list(plain_no_w)):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert not no_w[1].any()


@pytest.mark.parametrize("mode", ["lime", "first-2"])
def test_triton_routing_in_the_model_equals_the_reference(monkeypatch, mode):
    pytest.importorskip("triton")
    model, idx = routed_model(mode), tokens()
    ref_logits, ref = run_routing(model, idx, reference=True)
    monkeypatch.setattr(kernels, "USE_TRITON", "1")
    logits, fast = run_routing(model, idx, reference=False)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name in ref:
        torch.testing.assert_close(fast[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n_kv, dtype, low", [(12, torch.bfloat16, True), (8, torch.bfloat16, True),
                                               (12, torch.bfloat16, False), (12, torch.float32, False)])
def test_cuda_triton_kernels_match_float64(monkeypatch, n_kv, dtype, low):
    """On a GPU, at the 150M (12 kv heads) and 1B GQA (8) head counts: the compiled kernels, not the interpreter,
    with either choice of dot operands, and the plain path, each against the same sums in float64. They round
    bf16 differently, so they are held to the exact sums, not to each other."""
    monkeypatch.setattr(kernels, "LOW_PRECISION_DOTS", low)
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(4, 256, n_kv, 128, device="cuda", generator=g).to(dtype)
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
@pytest.mark.parametrize("mode", MODES)
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


@pytest.mark.parametrize("bad", ["first-0", "last-x", "lime2", "", "last-", "first--1", "LIME", "first-01"])
def test_bad_router_strings(bad):
    with pytest.raises(ValueError, match="expected none, lime, average, dynamic, last-J or first-J"):
        GPTConfig(router=bad)


def test_bad_shapes():
    with pytest.raises(ValueError, match="n_kv_head=5 must divide n_head=12"):
        GPTConfig(n_kv_head=5)
    with pytest.raises(ValueError, match="n_embd=100"):
        GPTConfig(n_embd=100)
    for field in ("n_layer", "n_head", "n_kv_head", "n_embd"):
        with pytest.raises(ValueError, match=f"{field}=0 must be at least 1"):
            GPTConfig(**{field: 0})


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


def test_flops_routing_term():
    none, routed = small_model("none"), small_model("lime")
    head_dim = 8
    extra = routed.estimate_flops(32) - none.estimate_flops(32)
    assert extra == 6 * routed.num_params()["router"] * 2 * head_dim
    # the dense term is the usual 6N with the tied head counted once and no embedding lookup
    n = none.num_params()
    assert none.estimate_flops(32) == 6 * (n["total"] - n["norm"]) + 12 * 6 * 4 * head_dim * 32


def test_compiled_equals_eager():
    model, idx = routed_model("lime", n_layer=3), tokens()
    ref_logits, ref = run_routing(model, idx, reference=False)
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # dynamo + AOT autograd, no C++ build
    logits, loss = compiled(idx, idx)
    loss.backward()
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-6, msg=name)


# ---- data -----------------------------------------------------------------------------



def error_of(main, argv, capsys, code=2):
    """A script's main(argv) that must fail: checks the exit code (2 for bad usage, 1 for a failure
    at run time) and that stderr is one line, and returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, (e.value.code, err)
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


class FileServer:
    """Serves bytes from 127.0.0.1 with HTTP Range; can cut a file's first response halfway."""

    def __init__(self, files, cut_once=()):
        self.files, self.cut_once, self.requests = dict(files), set(cut_once), []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                server.requests.append((name, self.headers.get("Range")))
                if name not in server.files:
                    self.send_error(404)
                    return
                data = server.files[name]
                start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-"))[1])
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if name in server.cut_once:  # announce everything, send half, hang up
                    server.cut_once.discard(name)
                    self.wfile.write(data[start:start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # a short poll: close() waits for the loop to see the shutdown, half a second per test by default
        threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.01), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def shard_bytes(tokens, magic=pd.MAGIC, count=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, 1, len(tokens) if count is None else count
    return header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()


@pytest.fixture
def serve():
    servers = []

    def start(files, cut_once=()):
        servers.append(FileServer(files, cut_once))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def fineweb_files(n_train=2):
    rng = np.random.default_rng(0)
    names = ["finewebedu_val_000000.bin"] + [f"finewebedu_train_{i:06d}.bin" for i in range(1, n_train + 1)]
    return {name: shard_bytes(rng.integers(0, 50257, 5000 + 100 * i)) for i, name in enumerate(names)}


def test_fineweb_download_then_nothing_to_do(serve, tmp_path):
    files = fineweb_files()
    server = serve(files)
    pd.prepare_fineweb(tmp_path, 2, server.url)
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data
    assert len(pd.load_tokens(tmp_path, "train")) == 2 and len(pd.load_tokens(tmp_path, "val")[0]) == 5000
    n = len(server.requests)
    pd.prepare_fineweb(tmp_path, 2, server.url)
    assert len(server.requests) == n  # complete files are not fetched again
    assert not list(tmp_path.glob("*.part"))


def test_fineweb_resumes_after_cut_connection(serve, tmp_path, monkeypatch):
    monkeypatch.setattr(pd.time, "sleep", lambda s: None)
    monkeypatch.setattr(pd, "CHUNK_BYTES", 1024)
    files = fineweb_files(1)
    server = serve(files, cut_once={"finewebedu_train_000001.bin"})
    pd.prepare_fineweb(tmp_path, 1, server.url)
    data = files["finewebedu_train_000001.bin"]
    assert (tmp_path / "finewebedu_train_000001.bin").read_bytes() == data
    ranges = [r for name, r in server.requests if name == "finewebedu_train_000001.bin"]
    assert len(ranges) == 2 and ranges[0] is None
    resumed_at = int(re.match(r"bytes=(\d+)-$", ranges[1])[1])  # the second request asked only for the rest
    assert 0 < resumed_at <= len(data) // 2


@pytest.mark.parametrize("bad, message", [
    (shard_bytes(range(100), magic=123), "bad magic"),
    (shard_bytes(range(100), count=500), "header announces 500 tokens"),
])
def test_corrupt_shard_is_reported_and_not_kept(serve, tmp_path, capsys, bad, message):
    files = fineweb_files(1)
    files["finewebedu_train_000001.bin"] = bad
    server = serve(files)
    err = error_of(pd.main, ["fineweb-edu", "--shards", "1", "--data-dir", str(tmp_path), "--base-url", server.url],
                   capsys, code=1)
    assert message in err and err.startswith("prepare_data.py: error: finewebedu_train_000001.bin")
    assert not (tmp_path / "finewebedu_train_000001.bin").exists()
    assert not (tmp_path / "finewebedu_train_000001.bin.part").exists()
    assert (tmp_path / "finewebedu_val_000000.bin").exists()  # the good file before it stays


def test_missing_file_is_one_line(serve, tmp_path, capsys):
    server = serve({})
    err = error_of(pd.main, ["fineweb-edu", "--shards", "1", "--data-dir", str(tmp_path), "--base-url", server.url],
                   capsys, code=1)
    assert re.match("prepare_data.py: error: .*HTTP 404", err)


def small_encoding():
    """A byte-level tiktoken Encoding with the GPT-2 split pattern: no download."""
    return tiktoken.Encoding(
        name="test-bytes",
        pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )


def test_shakespeare_tokenised_into_shards(serve, tmp_path):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20
    server = serve({"input.txt": text.encode()})
    enc = small_encoding()
    pd.prepare_shakespeare(tmp_path, f"{server.url}/input.txt", enc=enc)
    train, val = pd.load_tokens(tmp_path, "train")[0], pd.load_tokens(tmp_path, "val")[0]
    assert train[0] == val[0] == enc.eot_token
    assert enc.decode(list(train[1:])) + enc.decode(list(val[1:])) == text  # exact round trip
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15


def evaluate_text(text, modulus=None):
    """An independent evaluator for the task's text: precedence, and either exact division and no
    negatives, or arithmetic mod a prime with division by Fermat's inverse b^(P-2)."""
    tokens = text.split()
    pos = 0
    top = pd.ArithmeticTask().max_value if modulus is None else modulus - 1

    def expr(level):
        nonlocal pos
        if level == 3:
            tok = tokens[pos]
            pos += 1
            if tok == "(":
                value = expr(1)
                assert tokens[pos] == ")"
                pos += 1
                return value
            assert 0 <= int(tok) <= top, text
            return int(tok)
        value = expr(level + 1)
        while pos < len(tokens) and tokens[pos] in ({"+", "-"} if level == 1 else {"*", "/"}):
            op = tokens[pos]
            pos += 1
            rhs = expr(level + 1)
            if modulus:
                assert op != "/" or rhs != 0, f"division by 0 in {text}"
                rhs = pow(rhs, modulus - 2, modulus) if op == "/" else rhs
                op = "*" if op == "/" else op
            elif op == "/":
                assert rhs != 0 and value % rhs == 0, f"inexact division in {text}"
            value = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}[op](value, rhs)
            value = value % modulus if modulus else value
            assert 0 <= value <= top, text
        return value

    value = expr(1)
    assert pos == len(tokens)
    return value


def one_operation(before, after, modulus):
    """The (a, op, b, c) by which `after` is `before` with one operation `a op b` (or `( a op b )`)
    replaced by its value c, or None if no single operation turns one into the other."""
    s, t = before.split(), after.split()
    for p in range(len(t)):  # t = s[:p] + [c] + s[len(s) - k:]
        k = len(t) - p - 1
        if s[:p] == t[:p] and s[len(s) - k:] == t[len(t) - k:]:
            middle = s[p: len(s) - k]
            if middle[:1] == ["("] and middle[-1:] == [")"]:
                middle = middle[1:-1]
            if len(middle) == 3 and middle[1] in "+-*/" and middle[0].isdigit() and middle[2].isdigit():
                return int(middle[0]), middle[1], int(middle[2]), int(t[p])
    return None


def test_arithmetic_samples_are_correct_step_by_step():
    data = pd.generate_arithmetic(pd.ArithmeticTask(), seed=1, train_size=300, test_size=100)
    assert sorted(data) == ["test_4", "test_5", "test_6", "train", "val_4", "val_5", "val_6"]
    for name, lines in data.items():
        for line in lines:
            steps = line.split(" = ")
            answer = int(steps[-1])
            n_ops = [sum(t in pd.OPS for t in s.split()) for s in steps]
            assert n_ops[0] in (3, 4, 5) and n_ops[-1] == 0
            assert all(a - b == 1 for a, b in zip(n_ops, n_ops[1:]))  # one operation per step
            assert all(evaluate_text(s) == answer for s in steps)
            assert pd.split_sample(line) == (steps[0] + " =", answer)
    assert {sum(t in pd.OPS for t in l.split(" = ")[0].split()) + 1 for l in data["test_6"]} == {6}
    train = {l.split(" = ")[0] for l in data["train"]}
    tests = [l.split(" = ")[0] for n in (4, 5, 6) for split in ("test", "val") for l in data[f"{split}_{n}"]]
    assert not train & set(tests) and len(set(tests)) == len(tests)
    assert any("/" in l.split(" = ")[0] for l in data["train"]) and any("(" in l for l in data["train"])


def test_arithmetic_files_are_deterministic_and_load(tmp_path, capsys):
    pd.main(["arithmetic", "--data-dir", str(tmp_path / "a"), "--train-size", "200", "--test-size", "20", "--show", "3"])
    pd.main(["arithmetic", "--data-dir", str(tmp_path / "b"), "--train-size", "200", "--test-size", "20"])
    names = ["meta.json", "train.txt", "test_4.txt", "test_5.txt", "test_6.txt", "val_4.txt", "val_6.txt"]
    assert filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)[0] == names
    shown = [l for l in capsys.readouterr().out.splitlines() if " = " in l]
    vocab, splits, task = pd.load_arithmetic(tmp_path / "a")
    assert task == pd.ArithmeticTask(**pd.ARITH_DEFAULTS)
    modulus = task.modulus if task.field == "mod" else None
    assert len(shown) == 3 and all(evaluate_text(l.split(" = ")[0], modulus) == int(l.split()[-1]) for l in shown)
    line = splits["test_5"][0]
    assert vocab.decode(vocab.encode(line)) == line and len(splits["train"]) == 600
    with pytest.raises(pd.DataError, match="'1000' is not in the task vocabulary"):
        vocab.encode("1000 + 1")


@pytest.mark.parametrize("target", ["steps", "answer"])
def test_mod_samples_check_out_with_an_independent_evaluator(target):
    P = 11
    task = pd.ArithmeticTask(field="mod", modulus=P, count="operators", tiers=(1, 4, 6), target=target)
    data = pd.generate_arithmetic(task, seed=3, train_size=300, test_size=50)
    divisions = 0
    for name, lines in data.items():
        for line in lines:
            steps = line.split(" = ")
            answer = int(steps[-1])
            n_ops = [sum(t in "+-*/" for t in step.split()) for step in steps]
            assert n_ops[0] in (1, 4, 6) and (name == "train" or n_ops[0] == int(name[-1]))  # tiers count operators
            assert all(evaluate_text(step, P) == answer for step in steps)
            if target == "answer":
                assert len(steps) == 2 and n_ops[1] == 0
                continue
            assert n_ops == list(range(n_ops[0], -1, -1))
            for before, after in zip(steps, steps[1:]):  # each step carries out exactly one operation, right
                a, op, b, c = one_operation(before, after, P)
                assert c == {"+": (a + b) % P, "-": (a - b) % P, "*": a * b % P}[op] if op != "/" else c * b % P == a
                divisions += op == "/"
    assert target == "answer" or divisions > 100
    assert task.parse("3 / 4") == ("/", 3, 4) and task.evaluate(("/", 3, 4)) == 9  # 4 * 9 = 36 = 3 mod 11
    with pytest.raises(pd.DataError, match="divides by 0"):
        task.parse("3 / ( 2 - 2 )")
    with pytest.raises(pd.DataError, match="11 is out of the task's range 0..10"):
        task.parse("11 + 1")


def test_answer_target_loss_covers_only_the_answer(tmp_path):
    task = pd.ArithmeticTask(field="mod", count="operators", tiers=(2, 3), target="answer")
    pd.prepare_arithmetic(tmp_path, task, seed=0, train_size=40, test_size=5)
    data = pd.ArithmeticData(dict(data_dir=str(tmp_path), block_size=24, eval_samples=5, preset="arith"))
    assert data.max_new_tokens == 1 and sorted(data.vals) == [2, 3]
    lines = (tmp_path / "train.txt").read_text().splitlines()
    x, y = data.collate([data.encode_row(line) for line in lines])
    for line, xi, yi in zip(lines, x, y):
        expr, answer = line.split(" = ")
        n = len(expr.split()) + 1  # the prompt: the expression and '='
        assert yi.tolist() == [-1] * (n - 1) + [data.vocab.stoi[answer]] + [-1] * (24 - n)
        assert data.vocab.decode(xi[:n].tolist()) == expr + " ="
    steps = pd.ArithmeticData(dict(data_dir=str(tmp_path), block_size=24, eval_samples=5, preset="arith"))
    steps.task = dataclasses.replace(task, target="steps")  # the same rows as solutions end with <eos>, learned too
    assert [t for t in steps.collate([steps.encode_row(lines[0])])[1][0].tolist() if t >= 0][-1] == steps.vocab.eos


def test_a_data_folder_from_before_the_knobs_loads_as_it_was(tmp_path, capsys):
    """meta.json used to hold only the vocabulary, seed and sizes, and there was no validation split."""
    pd.main(["arithmetic", "--data-dir", str(tmp_path), "--field=int", "--count=operands", "--target=steps",
             "--tiers=4,5,6", "--train-size", "30", "--test-size", "4"])
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({k: meta[k] for k in ("vocab", "seed", "train_size", "test_size")}))
    for p in tmp_path.glob("val_*.txt"):
        p.unlink()
    cfg = dict(data_dir=str(tmp_path), block_size=64, eval_samples=4, preset="arith")
    data = pd.ArithmeticData(cfg)
    assert data.task == pd.ArithmeticTask() and data.task.name == "int-steps" and data.vals == {}
    assert data.val == [data.encode_row(line) for n in (4, 5, 6) for line in data.tests[n]]  # val loss on test
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=32, block_size=64, vocab_size=1024))
    metrics = common.evaluate(model, model, data, dict(micro_batch_size=8), "cpu", contextlib.nullcontext())
    assert sorted(metrics) == ["acc_4", "acc_5", "acc_6", "val_loss", "val_ppl"]


def test_final_answer_parsing():
    assert pd.final_answer("12 / 4 = 3 <eos> 5 = 7") == 3
    assert pd.final_answer("12 / 4 = 3") == 3
    assert pd.final_answer("12 / 4 = 3 + 1") is None
    assert pd.final_answer("12 / 4") is None and pd.final_answer("") is None


# ---- training -------------------------------------------------------------------------



@pytest.fixture(scope="session")
def arith_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("arith")
    pd.prepare_arithmetic(path, pd.ArithmeticTask(), seed=0, train_size=100, test_size=10)
    return path


def tiny_args(arith_dir, out_dir, *extra):
    return ["--preset=tiny", f"--data-dir={arith_dir}", f"--out-dir={out_dir}", "--n-layer=2", "--n-head=2",
            "--n-kv-head=2", "--n-embd=32", "--mlp-hidden=64", "--batch-size=8", "--micro-batch-size=4",
            "--max-steps=12", "--eval-interval=6", "--eval-samples=1", "--log-interval=1", "--warmup-steps=2", *extra]


def read_log(out_dir):
    return [json.loads(l) for l in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


def train_losses(out_dir):
    return {r["step"]: r["loss"] for r in read_log(out_dir) if "loss" in r}


def test_tiny_training_lowers_the_loss(arith_dir, tmp_path):
    out = tmp_path / "run"
    train.main(tiny_args(arith_dir, out, "--max-steps=40", "--eval-interval=20", "--lr=1e-2"))
    losses = list(train_losses(out).values())
    assert len(losses) == 40 and sum(losses[-5:]) < 0.8 * sum(losses[:5])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["router"] == "lime" and summary["steps"] == 40 and summary["tokens_seen"] == 40 * 8 * 64
    assert {"val_loss", "val_ppl", "acc_4", "acc_5", "acc_6", "val_acc_6", "tokens_per_s", "peak_memory_bytes"} <= set(summary)
    assert pd.ArithmeticTask.from_meta(summary["task"]) == pd.ArithmeticTask() and summary["seed"] == 1337
    evals = [r for r in read_log(out) if "val_loss" in r]
    assert [r["step"] for r in evals] == [20, 40] and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert "val_acc_6" in evals[0] and "acc_6" not in evals[0] and "acc_6" in evals[-1]  # the test split at the end
    config = json.loads((out / "config.json").read_text())
    assert config["router"] == "lime" and config["n_embd"] == 32 and config["lr"] == 1e-2


@pytest.fixture(scope="session")
def whole_run(arith_dir, tmp_path_factory):
    """tiny_args's 12 steps in one go: what every interrupted and resumed run must equal."""
    out = tmp_path_factory.mktemp("whole")
    train.main(tiny_args(arith_dir, out))
    return out


def assert_same_run(out, whole):
    assert train_losses(out) == train_losses(whole)  # exactly, on CPU
    a, b = (torch.load(d / "ckpt.pt", weights_only=True)["model"] for d in (whole, out))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("interrupt", ["stop-at", "ctrl-c"])
def test_resume_equals_uninterrupted(arith_dir, whole_run, tmp_path, monkeypatch, interrupt):
    parts = tmp_path / "parts"
    if interrupt == "stop-at":
        train.main(tiny_args(arith_dir, parts, "--stop-at=5"))
    else:  # Ctrl-C while fetching the batch of step 7: steps 1..7 are done and saved
        real_batch = pd.ArithmeticData.batch
        calls = []

        def batch(self, rng, n):
            calls.append(1)
            if len(calls) == 2 * 7 + 1:
                raise KeyboardInterrupt
            return real_batch(self, rng, n)

        monkeypatch.setattr(pd.ArithmeticData, "batch", batch)
        with pytest.raises(SystemExit) as e:
            train.main(tiny_args(arith_dir, parts))
        assert e.value.code == 130
        monkeypatch.setattr(pd.ArithmeticData, "batch", real_batch)
    stopped_at = torch.load(parts / "ckpt.pt", weights_only=True)["step"]
    assert stopped_at == (5 if interrupt == "stop-at" else 7)
    train.main(tiny_args(arith_dir, parts, "--resume"))
    assert_same_run(parts, whole_run)


@pytest.mark.parametrize("flags, message", [
    (["--preset=huge"], "unknown preset 'huge': choose from 150m, 1b, deep, arith, prosqa, tiny"),
    (["--router=first-0"], "unknown router 'first-0'"),
    (["--n-kv-head=3", "--n-head=2"], "n_kv_head=3 must divide n_head=2"),
    (["--micro-batch-size=3"], "--batch-size=8 is not a multiple of --micro-batch-size=3"),
    (["--resume"], "--resume: no checkpoint at"),
    (["--schedule=step"], "--schedule='step': choose from cosine, linear"),
    (["--max-steps=abc"], "argument --max-steps: invalid int value"),
])
def test_bad_input_is_one_line_and_writes_nothing(arith_dir, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    err = error_of(train.main, tiny_args(arith_dir, out, *flags), capsys)
    assert err.startswith("train.py: error: ") and message in err
    assert not out.exists()


def test_resume_with_an_incompatible_checkpoint(arith_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(tiny_args(arith_dir, out, "--stop-at=2"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "was trained with router='lime' (not 'none')" in error_of(
        train.main, tiny_args(arith_dir, out, "--router=none", "--resume"), capsys)
    (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    assert "--resume: cannot read" in error_of(train.main, tiny_args(arith_dir, out, "--resume"), capsys)
    assert {p.name for p in out.iterdir()} == set(before)
    assert all((out / n).read_bytes() == b for n, b in before.items() if n != "ckpt.pt")


def test_missing_language_data_says_how_to_prepare(tmp_path, capsys):
    msg = error_of(train.main, ["--preset=150m", f"--data-dir={tmp_path / 'nothing'}", f"--out-dir={tmp_path / 'run'}"],
                   capsys, code=1)
    assert "no val shards in" in msg and "python prepare_data.py fineweb-edu" in msg and "--preset=tiny" in msg
    assert not (tmp_path / "run").exists()


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(arith_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_forward = GPT.forward
    calls = []

    def forward(self, idx, targets=None, cache=None):
        logits, loss = real_forward(self, idx, targets, cache)
        if targets is not None and self.training:
            calls.append(1)
            if len(calls) > 2 * 8:  # from step 9 on, with 2 micro-steps per step
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(arith_dir, out))
    assert e.value.code == 1 and f"the checkpoint of step 6 stays in {out}" in capsys.readouterr().err
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 6
    assert not (out / "summary.json").exists()


def test_a_config_field_without_a_comment_and_a_bool_still_work():
    @dataclasses.dataclass
    class Fork:
        plain: int = 3
        switch: bool = True  # a documented switch

    p = train.build_parser((train.TrainConfig, GPTConfig, Fork))
    args = p.parse_args(["--plain=5", "--switch=off"])
    assert args.plain == 5 and args.switch is False and p.parse_args(["--switch=on"]).switch is True
    helps = {a.dest: a.help for a in p._actions}
    assert helps["plain"] == "plain [3]" and helps["switch"] == "a documented switch [True]"
    assert helps["router"].startswith("routing mode") and all(helps.values())
    with pytest.raises(common.UsageError, match="expected on or off, got 'maybe'"):
        p.parse_args(["--switch=maybe"])


def test_no_script_imports_another():
    """lime.py, kernels.py and prepare_data.py at the bottom, common.py above them, the scripts on top."""
    floors = {"lime": {"kernels"}, "kernels": set(), "prepare_data": set(), "common": {"lime", "prepare_data"},
              **dict.fromkeys(["train", "sample", "analyze", "grid"], {"lime", "prepare_data", "common"}),
              "bench": {"lime", "kernels", "prepare_data", "common"}}  # bench.py --kernels times the op alone
    for name, allowed in floors.items():
        tree = ast.parse((Path(__file__).parent / f"{name}.py").read_text())
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert imported & set(floors) <= allowed, (name, imported & set(floors) - allowed)


def test_param_groups_follow_the_spec():
    model = small_model("dynamic")
    cfg = dict(weight_decay=0.1, lr=1e-3, router_lr=1e-2)
    groups = train.param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = [(g["weight_decay"], g["lr_scale"] * cfg["lr"], {names[id(p)] for p in g["params"]}) for g in groups]
    (wd0, lr0, decay), (wd1, lr1, no_decay), (wd2, lr2, router) = by_group
    assert (wd0, lr0) == (0.1, 1e-3) and (wd1, lr1) == (0.0, 1e-3) and (wd2, lr2) == (0.0, 1e-2)
    assert router == {n for n in names.values() if "router" in n} and any("proj" in n for n in router)
    assert "transformer.wte.weight" in no_decay and all("ln" in n or "wte" in n for n in no_decay)
    assert all(n.endswith(("c_q.weight", "c_kv.weight", "c_proj.weight", "c_fc.weight")) for n in decay)
    assert len(decay | no_decay | router) == len(names)


def test_learning_rate_schedules():
    cfg = dict(lr=1e-3, min_lr=1e-6, warmup_steps=10, max_steps=110, schedule="cosine")
    assert train.learning_rate(0, cfg) == pytest.approx(1e-4) and train.learning_rate(9, cfg) == pytest.approx(1e-3)
    assert train.learning_rate(60, cfg) == pytest.approx((1e-3 + 1e-6) / 2)
    assert train.learning_rate(110, cfg) == pytest.approx(1e-6)
    cfg["schedule"] = "linear"
    assert train.learning_rate(35, cfg) == pytest.approx(1e-6 + 0.75 * (1e-3 - 1e-6))


def test_two_process_ddp_on_cpu(arith_dir, tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "train.py", *tiny_args(arith_dir, out, "--max-steps=4", "--eval-interval=4")]
    # the environment torchrun gives each process, set here: torchrun's own start (a third torch import) costs seconds
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    result = types.SimpleNamespace(returncode=max(p.returncode for p in procs), stdout=outputs[0][0] + outputs[1][0],
                                   stderr=outputs[0][1] + outputs[1][1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 process(es)" in result.stdout and result.stdout.count("step 4/4") == 1  # only rank 0 prints
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and math.isfinite(summary["val_loss"])
    # 2 processes x micro-batch 4 = the batch of 8 in a single micro-step each
    assert "1 micro-step(s) of 4" in result.stdout


# ---- sampling -------------------------------------------------------------------------



@pytest.fixture(scope="session")
def arith_run(arith_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("arith_run")
    train.main(tiny_args(arith_dir, out, "--max-steps=6"))
    return out


@pytest.fixture(scope="session")
def language_run(tmp_path_factory):
    """A few steps on GPT-2-format shards of text tokenised with the small test encoding."""
    data, out = tmp_path_factory.mktemp("lang_data"), tmp_path_factory.mktemp("lang_run")
    enc = small_encoding()
    text = "To be, or not to be, that is the question. " * 200
    pd.write_shard(data / "text_train_000000.bin", [enc.eot_token] + enc.encode_ordinary(text))
    pd.write_shard(data / "text_val_000000.bin", [enc.eot_token] + enc.encode_ordinary(text[:2000]))
    train.main(["--preset=tiny", "--data=shakespeare", f"--data-dir={data}", f"--out-dir={out}", "--vocab-size=320",
                "--block-size=32", "--n-layer=2", "--n-embd=32", "--n-head=2", "--n-kv-head=2", "--batch-size=8",
                "--micro-batch-size=8", "--max-steps=6", "--eval-interval=6", "--eval-tokens=512"])
    return out


def test_sample_arithmetic_greedy_equals_model_generate(arith_run, capsys):
    first = sample.main(["--out-dir", str(arith_run), "--num-samples", "4", "--seed", "5"])
    again = sample.main(["--out-dir", str(arith_run), "--num-samples", "4", "--seed", "5"])
    assert first == again and len(first) == 4
    model = common.load_checkpoint(arith_run, "cpu")[1]
    vocab = pd.load_arithmetic(json.loads((arith_run / "config.json").read_text())["data_dir"])[0]
    for ids in first:
        n_prompt = ids.index(vocab.stoi["="]) + 1
        ref = model.generate(torch.tensor([ids[:n_prompt]]), 64 - n_prompt, temperature=0, stop=vocab.eos)
        assert ref[0].tolist() == ids
    lines = [l for l in capsys.readouterr().out.splitlines() if "tokens/s" in l]
    assert len(lines) == 8 and all(("[right]" in l) or ("[wrong, the answer is" in l) for l in lines)


def test_sample_given_expression_reports_the_verdict(arith_run, capsys):
    sample.main(["--out-dir", str(arith_run), "--start", "( 7 + 5 ) / 3", "--num-samples", "1"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("( 7 + 5 ) / 3 = ") and ("[right]" in line or "the answer is 4]" in line)


def test_sample_eval_matches_train(arith_run, language_run, capsys):
    summary = json.loads((arith_run / "summary.json").read_text())
    metrics = sample.main(["--out-dir", str(arith_run), "--eval"])
    assert metrics == {k: summary[k] for k in ("val_loss", "val_ppl", "acc_4", "acc_5", "acc_6", "val_acc_4",
                                               "val_acc_5", "val_acc_6")}
    summary = json.loads((language_run / "summary.json").read_text())
    metrics = sample.main(["--out-dir", str(language_run), "--eval"])
    assert metrics == {k: summary[k] for k in ("val_loss", "val_ppl")}


def test_a_run_is_never_scored_on_another_regime(arith_run, tmp_path, capsys):
    """The regime is in the run's config (config.json and the checkpoint); data of another one is refused."""
    for config in (json.loads((arith_run / "config.json").read_text()), common.read_checkpoint(arith_run)["config"]):
        assert pd.ArithmeticTask.from_meta(config["task"]) == pd.ArithmeticTask()
    other = tmp_path / "other"
    pd.prepare_arithmetic(other, pd.ArithmeticTask(field="mod", target="answer"), seed=0, train_size=5, test_size=2)
    for flags in (["--eval"], ["--start", "1 + 2 + 3 + 4"]):
        err = error_of(sample.main, ["--out-dir", str(arith_run), "--data-dir", str(other), *flags], capsys, code=1)
        assert err == (f"sample.py: error: {other} holds the task mod11-answer, tiers 4,5,6 operands, but the run was "
                       "trained on int-steps, tiers 4,5,6 operands: give --data-dir the run's data")


def test_sample_language_checkpoint(language_run, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(pd, "gpt2_encoding", small_encoding)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("To be")
    outs = sample.main(["--out-dir", str(language_run), "--start", f"FILE:{prompt}", "--num-samples", "2",
                        "--max-new-tokens", "10", "--temperature", "0"])
    assert len(outs) == 1 and len(outs[0]) == len("To be") + 10  # greedy: the one answer, once
    assert capsys.readouterr().out.startswith("To be") and small_encoding().decode(outs[0][:5]) == "To be"
    outs = sample.main(["--out-dir", str(language_run), "--start", "To be", "--num-samples", "2",
                        "--max-new-tokens", "10", "--temperature", "1", "--top-k", "1"])
    assert len(outs) == 2 and outs[0] == outs[1]  # sampled, so two, though top-k 1 makes them equal


@pytest.mark.parametrize("args, message", [
    (["--start", ""], "--start is empty"),
    (["--start", "1 + " * 40 + "1"], "the prompt is 82 tokens; the model's block size is 64"),
    (["--start", "7 / 2"], "7 / 2 does not give a whole number"),
    (["--start", "7 + x"], "expected a number, got 'x'"),
    (["--start", "1000 - 1"], "1000 is out of the task's range 0..999"),
    (["--start", "FILE:/nonexistent/prompt.txt"], "No such file or directory"),
])
def test_sample_bad_input(arith_run, capsys, args, message):
    err = error_of(sample.main, ["--out-dir", str(arith_run), *args], capsys)
    assert err.startswith("sample.py: error: ") and message in err


def test_sample_missing_or_unreadable_checkpoint(tmp_path, capsys):
    assert "no checkpoint at" in error_of(sample.main, ["--out-dir", str(tmp_path)], capsys)
    (tmp_path / "ckpt.pt").write_text("garbage")
    assert "cannot read" in error_of(sample.main, ["--out-dir", str(tmp_path)], capsys)


# ---- benchmark ------------------------------------------------------------------------



def test_bench_runs_and_reports_ratios(tmp_path, capsys):
    path = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--routers", "none,lime,first-2", "--n-layer", "4", "--block-size", "16",
                "--batch-size", "1", "--steps", "1", "--warmup", "1", "--gen-tokens", "2", "--gen-repeats", "1",
                "--depths", "2", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["shape"]["n_layer"] == 4 and saved["shape"]["n_embd"] == 384
    assert [run["n_layer"] for run in saved["runs"]] == [4, 2]
    rows = {r["router"]: r for r in saved["runs"][0]["results"]}
    assert set(rows) == {"none", "lime", "first-2"}
    for r in rows.values():
        assert r["step_ratio"] == pytest.approx(r["ms_per_step"] / rows["none"]["ms_per_step"])
        assert r["memory_ratio"] == pytest.approx(r["memory_bytes"] / rows["none"]["memory_bytes"])
        assert r["mfu"] is None and r["gen_tokens_per_s"] > 0  # no MFU on a CPU
    assert rows["lime"]["flops_per_token"] > rows["first-2"]["flops_per_token"] > rows["none"]["flops_per_token"]
    assert rows["none"]["memory_bytes"] < rows["lime"]["memory_bytes"] < 1.15 * rows["none"]["memory_bytes"]
    assert "x none" in capsys.readouterr().out


def test_bench_fresh_process_per_mode(tmp_path, capsys, monkeypatch):
    """What CUDA does: each mode alone in a fresh process (here the process runs in this one, for time)."""
    commands = []

    def run_in_this_process(cmd):
        commands.append(cmd)
        bench.main(cmd[2:])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", run_in_this_process)
    path = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--routers", "lime,none", "--n-layer", "2", "--block-size", "8", "--batch-size", "1",
                "--steps", "1", "--gen-repeats", "0", "--fresh-processes", "--json", str(path)])
    assert [c[:2] for c in commands] == [[sys.executable, str(Path(bench.__file__).resolve())]] * 2
    assert [c[-6:-4] for c in commands] == [["--routers", "lime"], ["--routers", "none"]]
    rows = json.loads(path.read_text())["runs"][0]["results"]
    assert [r["router"] for r in rows] == ["lime", "none"]
    assert rows[0]["step_ratio"] == pytest.approx(rows[0]["ms_per_step"] / rows[1]["ms_per_step"])  # to none
    assert rows[0]["gen_tokens_per_s"] is None
    assert "lime: in a fresh process" in capsys.readouterr().out


def test_bench_kernels_times_the_routing_op(tmp_path, capsys):
    """--kernels: the op alone for lime's first, middle and last layer, with the slots each moves."""
    path = tmp_path / "kernels.json"
    bench.main(["--device", "cpu", "--kernels", "--n-layer", "4", "--block-size", "16", "--batch-size", "1",
                "--steps", "1", "--json", str(path)])
    saved = json.loads(path.read_text())
    assert saved["runs"] == []  # no models
    rows = saved["kernels"]
    assert [(r["op"], r["slots"]) for r in rows] == [
        ("copy", 2), ("forward, layer 0", 5), ("backward, layer 0", 6), ("forward, layer 2", 5),
        ("backward, layer 2", 4), ("forward, layer 3", 3), ("backward, layer 3", 3)]
    slot_bytes = 1 * 16 * 6 * 128 * 4  # (B, T, n_kv, 2 head_dim) of the cpu shape, float32
    for r in rows:
        assert r["ms"] > 0 and r["gb_per_s"] == pytest.approx(r["slots"] * slot_bytes / r["ms"] / 1e6)
    assert "backward, layer 0" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--routers", ""], "--routers names no router"),
    (["--routers", ","], "--routers names no router"),
    (["--routers", "none,lime2"], "unknown router 'lime2'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--gen-repeats", "-1"], "--gen-repeats must be 0 or more"),
    (["--block-size", "1"], "--block-size must be at least 2"),
    (["--device", "foo"], "--device='foo'"),
    (["--shape", "2b"], "unknown shape '2b'"),
    (["--depths", "12,x"], "--depths='12,x'"),
    (["--json", "/nonexistent/dir/b.json"], "no directory /nonexistent/dir"),
] + ([(["--device", "cuda"], "--device=cuda: ")] if not torch.cuda.is_available() else []))
def test_bench_bad_input_is_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("bench.py: error: ") and message in err and err.count("\n") == 1


# ---- analysis -------------------------------------------------------------------------



@pytest.mark.parametrize("mode", ["none", "lime", "first-2"])
def test_route_map_rows_sum_to_one(mode):
    M = analyze.route_map(small_model(mode))
    torch.testing.assert_close(M.sum(1), torch.ones(6))
    assert torch.all(M.triu(1) == 0)
    if mode == "none":
        assert torch.equal(M, torch.eye(6))
    if mode == "first-2":
        assert torch.all(M[5, 2:5] == 0) and torch.all(M[5, [0, 1, 5]] > 0)


def test_routes_command(arith_run, capsys):
    M = analyze.main(["routes", "--out-dir", str(arith_run)])
    torch.testing.assert_close(M.sum(1), torch.ones(2))
    out = capsys.readouterr().out
    assert "router lime" in out and "100" in out


def test_renyi_entropy_extremes():
    g = torch.Generator().manual_seed(0)
    T = 32
    rank1 = torch.randn(T, 1, generator=g) @ torch.randn(1, 64, generator=g)
    isotropic = torch.randn(T, 8192, generator=g)
    for alpha in (1.0, 2.0):
        assert abs(analyze.renyi_entropy(rank1, alpha)) < 1e-6
        # centring over tokens leaves T - 1 dimensions: the maximum is log(T - 1)
        assert 0.995 * math.log(T - 1) < analyze.renyi_entropy(isotropic, alpha) <= math.log(T - 1) + 1e-9


def test_entropy_command_two_runs(arith_run, tmp_path, arith_dir, capsys):
    base = tmp_path / "none"
    train.main(tiny_args(arith_dir, base, "--router=none", "--max-steps=2"))
    curves = analyze.main(["entropy", "--out-dir", str(arith_run), str(base), "--num-seqs", "4"])
    assert set(curves) == {"lime values", "lime hidden", "none values", "none hidden"}
    assert all(len(c) == 2 and all(0 <= v <= math.log(64) for v in c) for c in curves.values())
    assert "matrix-based Renyi entropy" in capsys.readouterr().out


def test_linear_probe_separates_what_is_separable():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 4
    X = torch.randn(200, 16, generator=g) * 0.3
    X[torch.arange(200), y] += 3.0  # class k lights up feature k
    assert analyze.linear_probe(X, y, 4) > 0.95
    noise = torch.randn(200, 16, generator=g)
    assert analyze.linear_probe(noise, y, 4) < 0.45  # chance is 0.25


def test_probe_command(arith_run, tmp_path, capsys):
    assert "arithmetic checkpoint; its task vocabulary has no ' is'" in error_of(
        analyze.main, ["probe", "--out-dir", str(arith_run)], capsys)
    data, out = tmp_path / "data", tmp_path / "run"
    g = np.random.default_rng(0)
    words = list(analyze.PROBE_WORDS.values())
    tokens = np.where(g.random(20000) < 0.2, g.choice(words, 20000), g.integers(0, 300, 20000))
    pd.write_shard(data / "w_train_000000.bin", tokens)
    pd.write_shard(data / "w_val_000000.bin", tokens[:4000])
    train.main(["--preset=tiny", "--data=shakespeare", f"--data-dir={data}", f"--out-dir={out}", "--vocab-size=576",
                "--block-size=64", "--n-layer=2", "--n-embd=32", "--n-head=2", "--n-kv-head=2", "--batch-size=4",
                "--micro-batch-size=4", "--max-steps=2", "--eval-interval=2", "--eval-tokens=256"])
    accs = analyze.main(["probe", "--out-dir", str(out), "--num-seqs", "8", "--seq-len", "64"])
    assert len(accs) == 2 and all(0 <= a <= 1 for a in accs)


def test_ablation_table(tmp_path, capsys):
    runs = {"none": 16.4611, "first-4": 15.9586, "lime": 15.9267}  # the paper's Table 7
    dirs = []
    for router, ppl in runs.items():
        d = tmp_path / router
        d.mkdir()
        (d / "summary.json").write_text(json.dumps(dict(router=router, val_ppl=ppl)))
        dirs.append(str(d))
    table = analyze.main(["table", *dirs])
    assert "| none | 16.4611 | +3.36% |" in table and "| first-4 | 15.9586 | +0.20% |" in table
    assert "| lime | 15.9267 | - |" in table and table.startswith("| router | perplexity | change to lime")
    assert re.match("analyze.py: error: no .*summary.json", error_of(analyze.main, ["table", str(tmp_path)], capsys))


def test_table_averages_over_seeds(tmp_path):
    dirs = []
    for regime, field in (("mod", "mod"), ("int", "int")):
        task = dataclasses.asdict(pd.ArithmeticTask(field=field, count="operators", target="answer"))
        for router, accs in (("lime", (0.50, 0.60, 0.70)), ("none", (0.20, 0.30, 0.40))):
            for seed, acc in enumerate(accs):
                d = tmp_path / regime / f"{router}-{seed}"
                d.mkdir(parents=True)
                summary = dict(router=router, task=task, seed=seed, acc_4=0.9, acc_5=0.8, acc_6=acc, val_acc_4=0.9,
                               val_acc_5=0.8, val_acc_6=acc - 0.1)
                (d / "summary.json").write_text(json.dumps(summary))
                dirs.append(str(d))
    table = analyze.main(["table", *dirs])
    assert table.splitlines()[0] == "| regime | router | seeds | acc_4 | acc_5 | acc_6 | lime ahead, last tier (pts) |"
    assert "| mod11-answer, operators | lime | 3 | 90.0 ± 0.0 | 80.0 ± 0.0 | 60.0 ± 10.0 | - |" in table
    assert "| int-answer, operators | none | 3 | 90.0 ± 0.0 | 80.0 ± 0.0 | 30.0 ± 10.0 | +30.0 |" in table
    assert "| mod11-answer, operators | none | 3 | 90.0 ± 0.0 | 80.0 ± 0.0 | 30.0 ± 10.0 | +30.0 |" in table
    val = analyze.main(["table", "--split", "val", *dirs])
    twice = analyze.main(["table", *dirs[:3], *dirs[:3]])  # a run given twice is one run
    assert "| mod11-answer, operators | lime | 3 |" in twice and "| 6 |" not in twice
    lang = []
    for preset, router, ppl in (("150m", "lime", 15.9), ("deep", "lime", 14.0), ("150m", "none", 16.4)):
        lang.append(tmp_path / f"{preset}-{router}")
        lang[-1].mkdir()
        (lang[-1] / "summary.json").write_text(json.dumps(dict(router=router, preset=preset, steps=6000, val_ppl=ppl)))
    table = analyze.main(["table", *map(str, lang)])  # other presets are not seeds of one run: Table 7's layout
    assert table.startswith("| router | perplexity |") and len(table.splitlines()) == 5
    assert "| int-answer, operators | lime | 3 | 90.0 ± 0.0 | 80.0 ± 0.0 | 50.0 ± 10.0 | - |" in val


def test_grid_trains_every_router_and_seed_and_keeps_finished_runs(tmp_path, capsys):
    args = ["--fields", "mod", "--targets", "answer", "--tiers", "2,3", "--routers", "lime,none", "--seeds", "1",
            "--train-size", "40", "--test-size", "6", "--epochs", "0.5", "--jobs", "2",
            "--out-dir", str(tmp_path / "out"), "--data-root", str(tmp_path / "data"),
            "--", "--n-layer=2", "--n-embd=16", "--n-head=2", "--n-kv-head=2", "--mlp-hidden=32", "--batch-size=8",
            "--micro-batch-size=8", "--log-interval=1"]
    tables = grid.main(args)
    out = capsys.readouterr().out
    runs = tmp_path / "out" / "mod11-answer-operators"
    assert sorted(p.name for p in runs.iterdir()) == ["lime-seed1", "none-seed1"]
    for run in runs.iterdir():
        config = json.loads((run / "config.json").read_text())
        assert (config["vocab_size"], config["max_steps"], config["block_size"] % 8) == (24, 5, 0)  # 80 samples / 8 / 2
        assert json.loads((run / "summary.json").read_text())["task"]["field"] == "mod"
        assert "done:" in (run / "train.out").read_text()
    assert "grid: 2 runs, 0 finished before; 2 to go" in out and "[2/2]" in out
    assert tables["val"].splitlines()[0] == "| router | val_acc_2 | val_acc_3 | change to lime (val_acc_2) | change to lime (val_acc_3) |"
    before = snapshot(runs)
    assert grid.main(args) == tables and snapshot(runs) == before  # finished runs are kept, not redone
    assert "2 finished before; 0 to go" in capsys.readouterr().out


def test_resume_after_a_cut_in_the_final_evaluation_only_evaluates(arith_dir, arith_run, tmp_path, capsys):
    run = tmp_path / "cut"
    shutil.copytree(arith_run, run)
    (run / "summary.json").unlink()  # as when a signal came during the last evaluation: ckpt at max_steps, no summary
    train.main(tiny_args(arith_dir, run, "--resume", "--max-steps=6"))
    old, new = (json.loads((d / "summary.json").read_text()) for d in (arith_run, run))
    assert {k: new[k] for k in ("steps", "val_loss", "acc_4", "val_acc_6")} == \
        {k: old[k] for k in ("steps", "val_loss", "acc_4", "val_acc_6")}
    assert "step 1/" not in capsys.readouterr().out  # no training step was taken
    err = error_of(train.main, tiny_args(arith_dir, run, "--resume", "--max-steps=6"), capsys)  # finished now
    assert "already at max_steps=6" in err


def test_grid_refuses_a_data_folder_of_another_regime(arith_dir, tmp_path, capsys):
    shutil.copytree(arith_dir, tmp_path / "int-steps-operands")  # 100 samples a tier, not the grid's 20000
    before = snapshot(tmp_path)
    err = error_of(grid.main, ["--fields", "int", "--targets", "steps", "--count", "operands", "--data-root",
                               str(tmp_path), "--out-dir", str(tmp_path / "out")], capsys)
    assert err.startswith("grid.py: error: ") and "holds other arithmetic data" in err and "--data-root" in err
    assert snapshot(tmp_path) == before


def test_peak_flops_only_for_known_devices(monkeypatch):
    names = {"cuda": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA H100 PCIe", "cuda:2": "NVIDIA GeForce GTX 1080"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[device])
    assert common.peak_flops("cuda", "bfloat16") == 989e12
    assert common.peak_flops("cuda:1", "bfloat16") == 756e12
    assert common.peak_flops("cuda:2", "bfloat16") is None  # unknown: no MFU rather than a wrong one
    assert common.peak_flops("cuda", "float32") is None and common.peak_flops("cpu", "bfloat16") is None


# ---- bad input and interruptions ------------------------------------------------------



def train_args(*flags):
    return lambda a, r, t: tiny_args(a, t / "run", *flags)


# Every bad input of issue 12, through the scripts' main(argv). In argv(a, r, t), a is the arithmetic
# data, r a finished run and t a scratch folder holding a file notes.md. Exit code 2: bad usage.
BAD_INPUTS = [
    ("train", train_args("--seed=-1"), 2, "--seed must be >= 0, got -1"),
    ("train", train_args("--n-embd=0"), 2, "--n-embd must be positive, got 0"),
    ("train", train_args("--n-head=0"), 2, "--n-head must be positive, got 0"),
    ("train", train_args("--n-kv-head=0"), 2, "--n-kv-head must be positive, got 0"),
    ("train", train_args("--n-layer=0"), 2, "--n-layer must be positive, got 0"),
    ("train", train_args("--device=cuda"), 2, "--device=cuda: this torch is a CPU-only build"),
    ("train", train_args("--device=foo"), 2, "--device='foo': choose from auto, cpu, cuda, cuda:N, mps"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={t / 'notes.md'}"), 2, "is a file, not a folder"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={t / 'notes.md' / 'run'}"), 2,
     "notes.md is a file, not a folder"),
    ("train", train_args("--stop-at=-1"), 2, "--stop-at must be >= 0, got -1"),
    ("train", train_args("--eval-samples=0"), 2, "--eval-samples must be positive, got 0"),
    ("train", train_args("--resume", "--overwrite"), 2, "give one of them"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={r}", "--max-steps=6", "--resume"), 2,
     "already at max_steps=6"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--top-k", "0", "--temperature", "1"], 2,
     "--top-k must be positive"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--top-k", "-3", "--temperature", "1"], 2, "got -3"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--device", "foo"], 2, "--device='foo'"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--data-dir", str(t / "missing")], 1, "no arithmetic data in"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--eval", "--data-dir", str(t / "missing")], 1,
     "no arithmetic data in"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "notes.md")], 2, "is a file, not a folder"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--show", "-1"], 2,
     "--show must be >= 0, got -1"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--field=mod", "--modulus=12"], 2,
     "--modulus must be a prime"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--tiers=4,x"], 2,
     "--tiers must be numbers separated by commas"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--target=both"], 2,
     "invalid choice: 'both'"),
    ("grid", lambda a, r, t: ["--fields", "real", "--out-dir", str(t / "g"), "--data-root", str(t / "d")], 2,
     "--field must be int or mod, got 'real'"),
    ("grid", lambda a, r, t: ["--seeds", "1,two", "--out-dir", str(t / "g"), "--data-root", str(t / "d")], 2,
     "--seeds and --tiers take numbers"),

    ("analyze", lambda a, r, t: ["entropy", "--out-dir", str(r), "--num-seqs", "0"], 2, "--num-seqs must be positive"),
    ("analyze", lambda a, r, t: ["entropy", "--out-dir", str(r), "--alpha", "-1"], 2, "--alpha must be > 0, got -1"),
    ("analyze", lambda a, r, t: ["prune", "--out-dir", str(r), "--top-p", "0"], 2, "--top-p must be in (0, 1], got 0"),
    ("analyze", lambda a, r, t: ["prune", "--out-dir", str(r), "--save", str(r)], 2, "--save names the run being"),
    ("train", train_args("--prune-at=3"), 2, "--prune-at says when to prune: give --router-top-p too"),
    ("train", train_args("--router-top-p=1.5"), 2, "--router-top-p must be in (0, 1]"),
    ("train", train_args("--router=dynamic", "--router-top-p=0.9"), 2, "prunes learned static routers"),
    ("train", train_args("--router-top-p=0.9", "--prune-at=12"), 2, "--prune-at=12 is not before the last step"),
    ("train", train_args("--init-from=/nonexistent/run"), 2, "--init-from: no checkpoint at /nonexistent/run/ckpt.pt"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--init-from={r}", "--n-layer=3"), 2,
     "ckpt.pt holds a model with n_layer=2 (not 3)"),
    ("train", lambda a, r, t: tiny_args(a, r, f"--init-from={r}", "--resume"), 2, "give one of them"),
    ("train", lambda a, r, t: ["--preset=prosqa", f"--data-dir={t / 'none'}", f"--out-dir={t / 'run'}",
                               f"--init-from={r}"], 1, "no ProsQA data in"),
]


def snapshot(*roots):
    """Every path under the roots, with the bytes of each file."""
    return {p: p.read_bytes() if p.is_file() else None for root in roots for p in [root, *root.rglob("*")]}


def bad_input_id(case):
    script, argv, _, _ = case
    args = argv(Path("a"), Path("r"), Path("t"))
    return " ".join([script, *(args[len(tiny_args("a", "r")):] if script == "train" else args)])


@pytest.mark.parametrize("script, argv, code, message", BAD_INPUTS, ids=map(bad_input_id, BAD_INPUTS))
def test_every_bad_input_is_one_line_and_changes_nothing(arith_dir, arith_run, tmp_path, capsys, monkeypatch,
                                                         script, argv, code, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)  # what a CPU-only build says, even on a GPU machine
    (tmp_path / "notes.md").write_text("not a folder")
    before = snapshot(arith_dir, arith_run, tmp_path)
    main = {"train": train.main, "sample": sample.main, "prepare_data": pd.main, "analyze": analyze.main,
            "grid": grid.main}[script]
    err = error_of(main, argv(arith_dir, arith_run, tmp_path), capsys, code)
    assert err.startswith(f"{script}.py: error: ") and message in err
    assert snapshot(arith_dir, arith_run, tmp_path) == before


def test_a_new_run_never_replaces_an_old_one(arith_dir, arith_run, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(arith_run, old)
    (old / "routes.png").write_bytes(b"a picture of the old run")
    before = snapshot(old)
    for run in (old, tmp_path / "log-only"):  # a log alone is a run too: one cut short before its first save
        if run.name == "log-only":
            run.mkdir()
            (run / "log.jsonl").write_text('{"step": 1, "loss": 6.9}\n')
        err = error_of(train.main, tiny_args(arith_dir, run, "--max-steps=6"), capsys)
        assert err.startswith(f"train.py: error: {run} already holds a run (")
        assert "--resume" in err and "--overwrite" in err
    assert snapshot(old) == before
    train.main(tiny_args(arith_dir, old, "--max-steps=2", "--eval-interval=2", "--eval-samples=1", "--overwrite"))
    # --overwrite starts over: only the new run's files, the old picture gone
    assert {p.name for p in old.iterdir()} == {"ckpt.pt", "log.jsonl", "summary.json", "config.json"}
    assert json.loads((old / "summary.json").read_text())["steps"] == 2 and sorted(train_losses(old)) == [1, 2]
    assert torch.load(old / "ckpt.pt", weights_only=True)["step"] == 2


def test_sigterm_saves_a_checkpoint_and_resume_is_exact(arith_dir, whole_run, tmp_path, monkeypatch, capsys):
    """In this process, as a subprocess would spend seconds importing torch: train.main is what
    `python train.py` runs, signal handler included, and its SystemExit code is the exit status."""
    real_batch, calls = pd.ArithmeticData.batch, []

    def batch(self, rng, n):
        calls.append(1)
        if len(calls) == 2 * 7 + 1:  # the first micro-batch of step 8: steps 1..7 are done
            os.kill(os.getpid(), signal.SIGTERM)  # what `kill` and a cluster scheduler send
        return real_batch(self, rng, n)

    monkeypatch.setattr(pd.ArithmeticData, "batch", batch)
    out = tmp_path / "run"

    def unhandled(signum, frame):  # rather than the default, which would end the test session
        pytest.fail("train.py did not handle SIGTERM")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as e:
            train.main(tiny_args(arith_dir, out))
        assert signal.getsignal(signal.SIGTERM) is unhandled  # train.py put the handler before it back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert e.value.code == 128 + signal.SIGTERM
    printed = capsys.readouterr()
    assert "SIGTERM: saving a checkpoint at step 7" in printed.out and "--resume" in printed.out
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 7
    monkeypatch.setattr(pd.ArithmeticData, "batch", real_batch)
    train.main(tiny_args(arith_dir, out, "--resume"))
    assert_same_run(out, whole_run)


@pytest.mark.parametrize("case", ["second signal during the save on the way out", "signal during a periodic save"])
def test_a_signal_during_a_save_waits_for_it(arith_dir, tmp_path, monkeypatch, capsys, case):
    second = case.startswith("second")
    real_save, real_batch, saves, batches = torch.save, pd.ArithmeticData.batch, [], []

    def save(obj, f):
        saves.append(obj["step"])
        os.kill(os.getpid(), signal.SIGINT)  # unless it waits, KeyboardInterrupt here, and no checkpoint
        real_save(obj, f)

    def batch(self, rng, n):
        batches.append(1)
        if second and len(batches) == 2 * 3 + 1:  # the first Ctrl-C, after step 3
            os.kill(os.getpid(), signal.SIGINT)
        return real_batch(self, rng, n)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(pd.ArithmeticData, "batch", batch)
    periodic = [] if second else ["--eval-interval=2", "--eval-samples=1"]  # the save after the evaluation of step 2
    ended = None
    try:
        train.main(tiny_args(arith_dir, tmp_path / "run", *periodic))
    except (SystemExit, KeyboardInterrupt) as e:  # a KeyboardInterrupt would otherwise stop the whole test session
        ended = e
    assert isinstance(ended, SystemExit) and ended.code == 128 + signal.SIGINT
    step = 3 if second else 2
    assert saves == [step]  # one save, whole; the signal during it did not start another
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["step"] == step
    out = capsys.readouterr()
    assert out.out.count("saving a checkpoint") == 1 and f"interrupted: checkpoint at step {step}" in out.out
    assert "Traceback" not in out.err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # train.py put the usual Ctrl-C back


def test_ablation_table_with_a_zero_reference(tmp_path):
    dirs = []
    for router, acc in (("lime", 0.0), ("none", 0.25)):  # two short runs: lime solved nothing at 6 operands
        dirs.append(tmp_path / router)
        dirs[-1].mkdir()
        (dirs[-1] / "summary.json").write_text(json.dumps(dict(router=router, acc_4=0.5, acc_5=0.5, acc_6=acc)))
    table = analyze.main(["table", *map(str, dirs)])
    assert "| none | 0.5000 | 0.5000 | 0.2500 | +0.00% | +0.00% | n/a |" in table


# ---- pruning, fine-tuning, ProsQA -----------------------------------------------------


def test_top_p_mask_keeps_the_smallest_set_that_reaches_p():
    # two target heads, each reading 2 source layers x 2 source heads; shares of |weight| in tenths
    w = torch.tensor([[[4.0, -3.0], [2.0, 1.0]],  # .4 .3 .2 .1: .4 + .3 < .9, so the .2 crosses p; the .1 goes
                      [[-8.0, 1.0], [0.5, 0.5]]])  # .8 .1 .05 .05: .8 + .1 reaches .9; both .05 go
    assert common.top_p_mask(w, 0.9).tolist() == [[[True, True], [True, False]], [[True, True], [False, False]]]
    assert common.top_p_mask(w, 0.1).sum(dim=(1, 2)).tolist() == [1, 1]  # the largest always stays
    ties = common.top_p_mask(torch.ones(1, 2, 2), 0.5)
    assert ties.flatten().tolist() == [True, True, False, False]  # equal weights: kept in order
    # in a model: the hand counts per layer, and only the dropped weights change (to zero)
    model = small_model("lime", n_layer=3)
    with torch.no_grad():
        model.routers[1].weight.copy_(w)
        model.routers[2].weight.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6]).view(2, 3, 2))
    before = {n: p.clone() for n, p in model.named_parameters()}
    mask = common.prune_routers(model, 0.9)
    # layer 2, head 0: 10 is everything; head 1: shares 1..6 / 21, and 6 + 5 + 4 + 3 = 18 < 0.9 * 21 <= 20
    assert common.pruned_counts(mask) == {1: (3, 8), 2: (5 + 1, 12)}
    for name, p in model.named_parameters():
        expected = before[name] * mask[name] if name in mask else before[name]
        assert torch.equal(p, expected), name
    with pytest.raises(common.UsageError, match="needs a learned static router"):
        common.prune_routers(small_model("dynamic"), 0.9)


@pytest.mark.parametrize("mode", ["lime", "first-2"])
def test_pruned_model_equals_the_dense_routing_with_its_zeros(mode):
    model, idx = small_model(mode), tokens()
    unpruned = model(idx)[0]
    mask = common.prune_routers(model, 0.6)
    assert sum(p for p, _ in common.pruned_counts(mask).values()) > 0
    for layer, R in enumerate(model.routing_weights()):  # the dense (n_kv, l + 1, n_kv) weights hold the zeros
        name = f"transformer.h.{layer}.attn.router.weight"
        if name in mask:
            sources = model.routers[layer].sources
            assert torch.equal(R[:, sources] != 0, mask[name])
    fast = model(idx)[0]  # kernels.route, pushing each layer's K/V to its readers
    model.reference_routing = True  # route_reference: the einsum over every source, zeros included
    torch.testing.assert_close(fast, model(idx)[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fast, unpruned, atol=1e-4)  # the zeros do change what the model computes


def router_state(ckpt, name):
    """The AdamW moments of one router weight in a saved checkpoint (the optimiser keys them by position)."""
    model = GPT(GPTConfig(**{k: ckpt["config"][k] for k in common.MODEL_FIELDS}))
    params = [n for g in train.param_groups(model, ckpt["config"]) for n, p in model.named_parameters()
              if any(p is q for q in g["params"])]
    return ckpt["optimizer"]["state"][params.index(name)]


def test_pruning_during_training_survives_resume(arith_dir, tmp_path):
    prune = ["--router-top-p=0.7", "--prune-at=2", "--max-steps=6", "--eval-interval=6", "--eval-samples=1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train.main(tiny_args(arith_dir, whole, *prune))
    train.main(tiny_args(arith_dir, parts, *prune, "--stop-at=4"))  # stopped after the pruning
    assert torch.load(parts / "ckpt.pt", weights_only=True)["router_mask"] is not None
    train.main(tiny_args(arith_dir, parts, *prune, "--resume"))
    assert_same_run(parts, whole)
    ckpt = torch.load(parts / "ckpt.pt", weights_only=True)
    name = "transformer.h.1.attn.router.weight"
    keep = ckpt["router_mask"][name]
    assert 0 < (~keep).sum() < keep.numel()
    assert torch.all(ckpt["model"][name][~keep] == 0) and torch.all(ckpt["model"][name][keep] != 0)
    state = router_state(ckpt, name)  # no gradient and no momentum reach a pruned weight
    assert torch.all(state["exp_avg"][~keep] == 0) and torch.all(state["exp_avg_sq"][~keep] == 0)
    assert json.loads((parts / "summary.json").read_text())["router_pruned"] == int((~keep).sum())
    assert [r["router_pruned"] for r in read_log(parts) if "router_pruned" in r] == [int((~keep).sum())]


def test_prune_command_saves_a_checkpoint_that_stays_pruned(arith_dir, arith_run, tmp_path, capsys):
    new, name = tmp_path / "pruned", "transformer.h.1.attn.router.weight"
    report = analyze.main(["prune", "--out-dir", str(arith_run), "--top-p", "0.7", "--save", str(new)])
    ckpt = torch.load(new / "ckpt.pt", weights_only=True)
    keep = ckpt["router_mask"][name]
    assert report["pruned"] == int((~keep).sum()) > 0 and report["weights"] == 8
    assert torch.all(ckpt["model"][name][~keep] == 0) and ckpt["config"]["out_dir"] == str(new)
    assert torch.isnan(report["survival"][0]).all()  # layer 0's router is a fixed identity
    assert report["survival"][1].tolist() == keep.float().mean(dim=(0, 2)).tolist()
    out = capsys.readouterr().out
    assert f"all:       {report['pruned']:>8,} of        8" in out and "unpruned" in out
    summary = json.loads((arith_run / "summary.json").read_text())
    assert report["unpruned_metrics"] == {k: summary[k] for k in report["unpruned_metrics"]}
    # sample.py loads it (and `train.py --resume` keeps the zeros, as in the test above: the mask is in ckpt.pt)
    assert common.load_checkpoint(new, "cpu")[1].routers[1].weight.count_nonzero() == keep.sum()
    assert len(sample.main(["--out-dir", str(new), "--num-samples", "1", "--max-new-tokens", "2"])) == 1
    before = snapshot(new)
    err = error_of(analyze.main, ["prune", "--out-dir", str(arith_run), "--save", str(new)], capsys)
    assert "already holds a run" in err and "--overwrite" in err and snapshot(new) == before


def prosqa_records(n, seed):
    """ProsQA's format, in miniature: a two-step proof of the answer."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        who, (a, b, c) = rng.choice(["Al", "Bo", "Cy"]), rng.sample(["wu", "yu", "zo", "ri", "le"], 3)
        records.append(dict(question=f"Every {a} is a {b}. {who} is a {a}. Is {who} a {b} or {c}?",
                            steps=[f"{who} is a {a}.", f"Every {a} is a {b}."], answer=f"{who} is a {b}."))
    return records


def prosqa_files(sizes=(32, 4, 4)):
    return {f"prosqa_{split}.json": json.dumps(prosqa_records(n, i)).encode()
            for i, (split, n) in enumerate(zip(pd.PROSQA_SPLITS, sizes))}


def test_prosqa_download_check_and_tokens(serve, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pd, "gpt2_encoding", small_encoding)
    files, enc = prosqa_files(), small_encoding()
    server = serve(files)
    pd.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url])
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data
    rows, eot = pd.load_prosqa(tmp_path, "train")
    assert eot == enc.eot_token and len(rows) == 32
    for (ids, n_prompt), r in zip(rows, json.loads(files["prosqa_train.json"])):
        ids = ids.tolist()
        assert enc.decode(ids[:n_prompt]) == f"<|endoftext|>{r['question']}\n"
        assert enc.decode(ids[n_prompt:]) == f"{r['steps'][0]}\n{r['steps'][1]}\n### {r['answer']}<|endoftext|>"
    n = len(server.requests)
    pd.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url])
    assert len(server.requests) == n and "(already there)" in capsys.readouterr().out


@pytest.mark.parametrize("bad, message", [
    (b'[{"question": "Is Al a wu?", "steps": []', "prosqa_valid.json: not valid JSON"),
    (json.dumps([dict(question="Is Al a wu?", steps=["Al is a wu."])]).encode(), "record 0 has no 'answer'"),
    (json.dumps([dict(question="Is Al a wu?", steps="Al is a wu.", answer="Al is a wu.")]).encode(),
     "record 0: 'steps' is not a list of texts"),
    (json.dumps({"question": "Is Al a wu?"}).encode(), "expected a non-empty JSON list"),
])
def test_corrupt_prosqa_file_is_reported_and_not_kept(serve, tmp_path, monkeypatch, capsys, bad, message):
    monkeypatch.setattr(pd, "gpt2_encoding", small_encoding)
    server = serve({**prosqa_files(), "prosqa_valid.json": bad})
    err = error_of(pd.main, ["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url], capsys, code=1)
    assert err.startswith("prepare_data.py: error: prosqa_valid.json") and message in err
    assert not list(tmp_path.glob("prosqa_valid.*")) and (tmp_path / "prosqa_train.npz").exists()


class ScriptedModel:
    """Stands in for a GPT in greedy_accuracy: continues each prompt with the tokens scripted for it."""

    def __init__(self, script, block_size):
        self.script, self.config, self.asked = script, dataclasses.make_dataclass("C", ["block_size"])(block_size), []

    def generate(self, idx, max_new_tokens, temperature, stop):
        self.asked.append((idx.shape, max_new_tokens, temperature, stop))
        return torch.tensor([row + self.script[tuple(row)][:max_new_tokens] for row in idx.tolist()])


def test_prosqa_accuracy_on_hand_made_generations(monkeypatch):
    right, answer = "Al is a wu.\nEvery wu is a yu.\n### Al  is a\nyu. ", "Al is a yu."
    assert pd.prosqa_correct(right, answer)  # whitespace runs and ends do not count
    assert not pd.prosqa_correct("Al is a wu.\n### Al is a yu", answer)  # punctuation does
    assert not pd.prosqa_correct("### al is a yu.", answer) and not pd.prosqa_correct("Al is a yu.", answer)
    assert not pd.prosqa_correct("### Al is a yu.\n### Al is a yu.", answer)  # everything after the first ###
    monkeypatch.setattr(pd, "gpt2_encoding", small_encoding)
    enc = small_encoding()
    eot, long_prompt = enc.eot_token, [enc.eot_token] + [3] * 48
    script = {(eot, 1, 2): enc.encode_ordinary(right) + [eot] + enc.encode_ordinary("### Bo is a zo."),  # cut at <eot>
              tuple(long_prompt): enc.encode_ordinary("### Cy is a ri. and more, never ended")}
    items = [([eot, 1, 2], answer), ([eot, 1, 2], "Bo is a zo."), (long_prompt, "Cy is a ri."),
             (long_prompt, "Cy is a ri. and more, never ended")]
    model = ScriptedModel(script, block_size=64)
    data = types.SimpleNamespace(tests=items, pad=eot, max_new_tokens=100)
    # right: the first (what follows <eot> does not count) and the third (the block ends after "### Cy is a ri.")
    assert common.prosqa_accuracy(model, data, "cpu") == 2 / 4
    assert model.asked == [((2, 3), 61, 0, eot), ((2, 49), 15, 0, eot)]  # prompts of one length share a batch
    assert pd.decode_tokens(enc, [72, 105, 999]) == "Hi\ufffd"  # an id past the vocabulary: no crash, no match


def test_prosqa_fine_tuning_from_a_checkpoint(serve, arith_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pd, "gpt2_encoding", small_encoding)
    data, out = tmp_path / "prosqa", tmp_path / "ft"
    pd.prepare_prosqa(data, serve(prosqa_files()).url)
    train.main(["--preset=prosqa", f"--data-dir={data}", f"--out-dir={out}", f"--init-from={arith_run}",
                "--block-size=128", "--batch-size=8", "--micro-batch-size=8", "--epochs=1", "--warmup-epochs=0.5",
                "--eval-samples=2", "--log-interval=1"])
    config = json.loads((out / "config.json").read_text())
    # the shape of the tiny arithmetic model, not the preset's 150M; the preset's schedule, in epochs of 32 samples
    assert (config["n_layer"], config["n_embd"], config["vocab_size"], config["block_size"]) == (2, 32, 1024, 128)
    assert (config["max_steps"], config["warmup_steps"], config["lr"], config["schedule"]) == (4, 2, 1e-4, "linear")
    assert config["init_from"] == str(arith_run) and "starting from the weights of" in capsys.readouterr().out
    # four small steps from the arithmetic run's weights: still close to them, unlike a fresh initialisation
    source, tuned = (torch.load(d / "ckpt.pt", weights_only=True)["model"] for d in (arith_run, out))
    torch.manual_seed(config["seed"])
    fresh = GPT(GPTConfig(**{k: config[k] for k in common.MODEL_FIELDS})).state_dict()
    w = "transformer.h.1.mlp.c_fc.weight"
    assert (tuned[w] - source[w]).abs().max() < 0.005 < (fresh[w] - source[w]).abs().max()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"] == "prosqa" and 0 <= summary["acc"] <= 1 and summary["steps"] == 4
    assert sample.main(["--out-dir", str(out), "--eval"]) == {k: summary[k] for k in ("val_loss", "val_ppl", "acc")}
    assert analyze.main(["table", str(out)]).startswith("| router | acc |")
    capsys.readouterr()
    sample.main(["--out-dir", str(out), "--num-samples", "1"])  # a test question, answered, with a verdict
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] in {r["question"] for r in prosqa_records(4, 2)} and "--- [" in shown[-1]
