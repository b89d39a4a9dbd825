"""
Speed and memory of every router mode and baseline against the LLaMA baseline (`none`).

    python bench.py                                   # CPU: a small 12-layer shape, a few minutes on 2 cores
    python bench.py --device cuda                     # the 150M shape, bf16 + torch.compile
    python bench.py --device cuda --shape 1b          # Table 3's 1B shape with GQA (32 heads, 8 kv heads)
    python bench.py --depths 12,32,64                 # how the routing cost grows with depth
    python bench.py --routers none,lime --json out.json
    python bench.py --device cuda --kernels           # the routing op alone, in GB/s against a plain copy
    python bench.py --device cuda --kernels --sweep   # the same at every tile of TILES (its knobs: kernels.KNOBS)
    python bench.py --device cuda --routers none,lime --profile   # where a step's milliseconds go
    python bench.py --device cuda --suite --sweep --profile --json suite.json   # every GPU figure of the README

A training step is forward + backward + AdamW (fused on CUDA), timed from a synchronised
device to a synchronised device. The median step is reported with its ratio to `none` (or
to the first router listed) from the same run.

On CUDA, or wherever the models are compiled, every mode runs alone in a fresh process:
torch.compile state shared between models in one process distorted both time and memory
(a compiled `none` model read 34 GB beside the others and 19 GB alone). Memory there is the
allocator's peak over the timed steps, every allocation counted: weights and optimiser
state too. On a CPU, where nothing is compiled, the modes share one process and take turns
(A B C A B C ...), so slow drifts of the machine hit all of them alike. A CPU has no
allocator peak, so memory there is the bytes autograd saves for backward.
"""

# cli first: from then on a Ctrl-C is one line, even while torch (seconds to load) is still loading
from cli import (COMPILE, DEVICES, SIZE, DataError, Parser, UsageError, a_path, atomic_write, autocast_for, compiles,
                 fail, file_state, first_line, folder_problem, one_line_errors, peak_flops, pick_device, read_json,
                 synchronize)

import argparse
import collections
import hashlib
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

import kernels
from generation import generate
from lime import GPT, POSITIONS, GPTConfig
from methods import MODULES, distinct, registry

SHAPES = {
    # small enough for 2 CPU cores, deep enough (12 layers) for the routing to show
    "cpu": dict(n_layer=12, n_head=6, n_kv_head=6, n_embd=384, mlp_hidden=1536, vocab_size=512, block_size=256,
                batch_size=2),
    # the 150M router ablation (train.py's default preset) at its micro-batch of 16 x 2048
    "150m": dict(n_layer=12, n_head=12, n_kv_head=12, n_embd=768, mlp_hidden=3072, vocab_size=50304,
                 block_size=2048, batch_size=16),
    # Table 3's 1B with grouped-query attention, micro-batch 4 x 2048
    "1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, mlp_hidden=8192, vocab_size=50304,
               block_size=2048, batch_size=4),
    # the deep preset (Section 5.5's 32 layers): routing grows as O(L^2), so here its design is tested
    "deep": dict(n_layer=32, n_head=8, n_kv_head=8, n_embd=512, mlp_hidden=2048, vocab_size=50304,
                 block_size=2048, batch_size=16),
}
# --kernels --sweep: the tiles tried, (columns, warps, outputs per launch, grad-w split, pack): kernels.KNOBS; a
# column is one (position, value) of a slot. 0 outputs: one launch for all, its loop over tables of addresses. Pack 1
# only where it packs (kernels.packing: 8 kv heads, not 12), so the 1B GQA sweep times twice the tiles of the 150M
# one. Not tried: 1024 columns, whose backward spills some 50 KB of registers a thread (ptxas for sm_90, run
# offline), 2 warps, which spill from 256 columns, or 16 outputs, which the 0 outputs' one launch covers
TILES = [(columns, warps, n, split, pack) for columns in (128, 256, 512) for warps in (4, 8) for n in (8, 0)
         for split in (1, 4) for pack in (0, 1)]
# --suite: the figures the README's Performance section reports, in one run: (shape, the routing op alone or the
# routers, each compiled model alone in its own process). `lime` against `none` first, the figures most wanted (a GPU
# lent for minutes may reach no further); then the routing op's tiles, which decide the kernels' design, at 1B GQA
# first (the nearer target, and PACK's shape). Every part of models has its own `none` for its ratios, and only a few
# models: a part cut short on one machine is measured anew on another
SUITE = [("150m", "none,lime"), ("1b", "none,lime"), ("1b", "kernels"), ("150m", "kernels"),
         ("150m", "none,first-4,last-4,dynamic"), ("150m", "none,hc,dwa,value-residual"),
         ("1b", "none,hc,dwa,value-residual"), ("deep", "none,lime,first-4,last-4")]


# --profile: a step's time by kind of work, the first kind whose pattern is found in a name. An op's own time
# (on CUDA: the kernels it launched) goes to the kind of its outermost caller that has one, so the bmm inside
# lime::route is routing; where no caller has a kind, the op's or the kernel's own name decides
KINDS = [("routing", r"route"), ("attention", r"flash|fmha|sdpa|attention|cudnn"),
         ("optimizer", r"optimizer|adam|multi_tensor"),
         ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|linear|matmul|aten::b?mm|addb?mm|MmBackward|triton_tem"),
         ("copies", r"memcpy|memset|clone|contiguous|(?<![a-z])cat|stack")]
REST = "the rest"  # norms, RoPE, activations, the loss, casts: on CUDA mostly the compiler's fused kernels
FIGURES = ("device", "torch", "dtype")  # what every --json file of bench.py holds: where and how it measured


def kind_of(name):
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), None)


def saved_bytes(model, idx):
    """Bytes of the distinct storages autograd keeps for backward in one training forward."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(storages.values())


class Runner:
    """One router mode: a model, its optimiser and its timings."""

    def __init__(self, router, shape, device, compile_model):
        torch.manual_seed(0)
        cfg = GPTConfig(router=router, **{k: v for k, v in shape.items() if k != "batch_size"})
        self.router, self.model = router, GPT(cfg).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.startswith("cuda"))
        self.step_fn = torch.compile(self.model) if compile_model else self.model
        self.times, self.gen_times = [], []

    def train_step(self, idx, autocast):
        with autocast:
            loss = self.step_fn(idx, idx)[1]
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def profile_steps(runner, idx, autocast, device, steps=3):
    """Where `steps` training steps spend their time: by_kind of the profiler's events."""
    on_gpu = device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * on_gpu
    synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            runner.train_step(idx, autocast)
        synchronize(device)
    return by_kind(prof.events(), on_gpu, steps)


def by_kind(events, on_gpu, steps):
    """Per step, milliseconds and launches (on a CPU, op calls) by kind (see KINDS), the busy total, and the ten
    longest kernels (ops). On CUDA the times are the GPU's, so the step's time minus `busy_ms` is the GPU waiting:
    launches, synchronisation."""
    # NOTE a footgun of the profiler on CUDA: each record_function region (Optimizer.step#AdamW.step, a compiled
    # graph's call) is also a span on the GPU's timeline, as long as the kernels inside it, and may be handed to its
    # CPU event as a kernel of its own: counted, it would count those kernels twice (torch's own table leaves it out)
    spans = collections.Counter((e.name, e.time_range.elapsed_us()) for e in events
                                if e.device_type == DeviceType.CUDA and e.is_user_annotation)
    kinds, names = {}, {}
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async:
            continue
        outermost, caller = None, e
        while caller is not None:
            outermost, caller = kind_of(caller.name) or outermost, caller.cpu_parent
        own = [(k.name, k.duration) for k in e.kernels] if on_gpu else [(e.name, e.self_cpu_time_total)]
        for name, us in own:
            if spans[name, us] > 0:  # a region's span, not a kernel
                spans[name, us] -= 1
                continue
            for table, key in ((kinds, outermost or kind_of(name) or REST), (names, name[:200])):
                table.setdefault(key, []).append(us)
    per_step = {table: {key: (sum(us) / 1000 / steps, len(us) // steps) for key, us in found.items()}
                for table, found in (("kinds", kinds), ("names", names))}
    kinds, attributed = per_step["kinds"], sum(ms for ms, _ in per_step["kinds"].values())
    busy = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA and
               not e.is_user_annotation) / 1000 / steps if on_gpu else attributed
    if busy > 1.001 * attributed:  # kernels the profiler tied to no op
        kinds["unattributed"] = (busy - attributed, 0)
    top = sorted(per_step["names"].items(), key=lambda item: -item[1][0])[:10]
    return dict(steps=steps, busy_ms=busy, kinds=kinds, top=[[name, ms, n] for name, (ms, n) in top])


def print_profile(results, base):
    """The profiles in `results` side by side: by kind, ms (launches) per step and the change from `base`;
    then each mode's longest kernels (ops on a CPU)."""
    ref = next((x for x in results if x["router"] == base), None)  # (a --suite part whose `none` failed: no change)
    print(f"where a step's time goes ({results[0]['profile']['steps']} steps profiled): ms per step (kernel launches; "
          f"on a CPU, op calls), and the change from {base}")
    print(f"{'':>14}" + "".join(f"{x['router']:>17}{'vs ' + base:>10}" for x in results))

    def row(label, get):  # get(a mode's results) -> (ms, launches or None)
        cells = [f"{get(x)[0]:10.2f}" + (f" ({get(x)[1]:4.0f})" if get(x)[1] is not None else " " * 7) +
                 (f"{get(x)[0] - get(ref)[0]:+10.2f}" if ref else f"{'-':>10}") for x in results]
        print(f"{label:>14}" + "".join(cells))

    for kind in [k for k, _ in KINDS] + [REST, "unattributed"]:
        if any(kind in x["profile"]["kinds"] for x in results):
            row(kind, lambda x: x["profile"]["kinds"].get(kind, (0.0, 0)))
    row("busy", lambda x: (x["profile"]["busy_ms"], None))
    row("step (timed)", lambda x: (x["ms_per_step"], None))
    for x in results:
        print(f"  {x['router']}'s longest: " + "; ".join(f"{ms:.2f} ms x{n:.0f} {name[:60]}"
                                                        for name, ms, n in x["profile"]["top"][:5]))


def measure(routers, shape, args, device):
    """Every router in `routers`, in this process, taking turns; one dict of figures per router."""
    is_cuda = device.startswith("cuda")
    autocast = autocast_for(device, args.dtype if is_cuda else "float32")
    B, T = shape["batch_size"], shape["block_size"]
    idx = torch.randint(0, shape["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0)).to(device)
    # what it is doing, in a run of several modes in this process (the table comes minutes later on a CPU)
    say = (lambda what: None) if getattr(args, "worker", None) else (lambda what: print(f"  {what} ...", flush=True))
    say(f"{len(routers)} mode(s) at {shape['n_layer']} layers: building them, {args.warmup} warm-up step(s) each")
    runners = [Runner(r, shape, device, args.compile == "on") for r in routers]
    for r in runners:  # warm-up: compilation, autotuning, the allocator's caches
        for _ in range(args.warmup):
            r.train_step(idx, autocast)
    synchronize(device)
    if is_cuda:  # from here on, the peak counts every allocation: weights, optimiser state, the step
        torch.cuda.reset_peak_memory_stats(device)
    say(f"{args.steps} timed step(s) each, taking turns")
    for _ in range(args.steps):
        for r in runners:  # taking turns: A B C A B C ...
            t = time.perf_counter()
            r.train_step(idx, autocast)
            synchronize(device)
            r.times.append(time.perf_counter() - t)
    memory = {r.router: torch.cuda.max_memory_allocated(device) for r in runners} if is_cuda else \
        {r.router: saved_bytes(r.model, idx) for r in runners}
    if args.profile:
        say("profiling each")
    profiles = {r.router: profile_steps(r, idx, autocast, device) for r in runners} if args.profile else {}
    if args.gen_repeats:
        say(f"generation, {args.gen_repeats} timing(s) each")
    for _ in range(args.gen_repeats):
        for r in runners:
            r.model.eval()
            t = time.perf_counter()
            with autocast:
                generate(r.model, idx[:, : T // 2], args.gen_tokens, temperature=0)
            synchronize(device)
            r.gen_times.append(time.perf_counter() - t)
            r.model.train()
    peak = peak_flops(device, args.dtype if is_cuda else "float32")
    results = []
    for r in runners:
        ms = 1000 * statistics.median(r.times)
        tok_s = B * T / (ms / 1000)
        gen = B * args.gen_tokens / statistics.median(r.gen_times) if r.gen_times else None
        results.append(dict(router=r.router, ms_per_step=ms, tokens_per_s=tok_s, memory_bytes=memory[r.router],
                            gen_tokens_per_s=gen, params=r.model.num_params()["total"],
                            mfu=r.model.estimate_flops(T) * tok_s / peak if peak else None,
                            flops_per_token=r.model.estimate_flops(T), measured=measured_as(args)))
        if args.profile:
            results[-1]["profile"] = profiles[r.router]
    return results


# what a figure depends on beyond the flags: the code it times (with every module of methods.MODULES: a --suite part
# times ablations.py's routers, and a fork's part its own), and the environment variables that change how that
# is compiled or which kernels run (TORCHINDUCTOR_MAX_AUTOTUNE, LIME_TRITON, ...; not a folder, file or cache's
# place: inductor itself sets TRITON_PTXAS_PATH as it compiles)
TIMED_CODE = ("kernels.py", "methods.py", "generation.py", *(f"{m.replace('.', '/')}.py" for m in MODULES))
TUNING = re.compile(r"(?!\w*(_DIR|_PATH|_HOME|CACHE_MANAGER)$)(TORCHINDUCTOR|TORCH_COMPILE|TRITON|LIME)_\w*")
# NOTE bench.py's own timing (Runner, measure) is not hashed, so that an edit of its flags or output keeps the figures:
# raise this where a change to it changes what a figure means
TIMING = 1


def measured_as(args, kernels=False):
    """How a model (or the routing op alone) was timed: --suite keeps a figure only where it was timed as this run
    times, so that a part resumed with other flags, other code (a kernel changed between two GPU sessions) or
    another compiler setting does not set figures of one beside figures of the other."""
    code = hashlib.sha256(b"".join((Path(__file__).parent / name).read_bytes() for name in TIMED_CODE))
    how = dict(code=code.hexdigest()[:12], timing=TIMING,
               env={k: v for k, v in sorted(os.environ.items()) if TUNING.fullmatch(k)})
    return dict(steps=args.steps, **how) if kernels else \
        dict(steps=args.steps, warmup=args.warmup, gen_tokens=args.gen_tokens, gen_repeats=args.gen_repeats,
             profile=args.profile, **how)


def measure_alone(router, shape, args, argv):
    """measure() for one router in a fresh Python process (this script, with --worker)."""
    print(f"  {router}: in a fresh process ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--routers", router,
               "--n-layer", str(shape["n_layer"]), "--worker", str(out)]
        done = subprocess.run(cmd)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"the {router} process failed (exit code {done.returncode}); its output is above")
        # how it was timed as this process sees it: the worker's own view comes after it compiled (see TUNING)
        return {**json.loads(out.read_text())[0], "measured": measured_as(args)}


def usable(device):
    """Whether the device still runs work: a kernel's illegal address leaves a CUDA context in error for good."""
    try:
        torch.ones(1, device=device).add_(1).item()
        return True
    except Exception:  # (torch's AcceleratorError, a RuntimeError)
        return False


def time_op(fn, device, repeats):
    """Median milliseconds of fn() over `repeats` calls, after three untimed ones."""
    times = []
    for _ in range(3 + repeats):
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[3:])


def sweep_tiles(kv):
    """The tiles of TILES that --sweep times for the routing op of `kv`: one that packs only where that packs (else it
    is its unpacked twin)."""
    return [tile for tile in TILES if not tile[-1] or kernels.packing(kv, pack=1) > 1]


def measure_kernels(shape, args, device, held=(), measured=lambda rows: None, failed=None):
    """The routing op alone, forward and backward, for `lime`'s first, middle and last layer at the
    shape's slot (one layer's K/V), in slot passes per second next to a plain copy. Bytes counted:
    forward kv, partials and outputs; backward the outputs' gradients, kv and grad kv (the small
    grad-w partials of the Triton backward not counted). `held`: rows of an earlier run, on this machine, taken
    where they time the same layer and tile; `measured(rows)` after each layer at each tile (a sweep saved as it
    goes: a long one cut short goes on from its last tile). `failed`: {tile: why} of a sweep's tiles that failed
    before, timed by the same code (on any machine), not tried again; one that fails now joins them."""
    failed = {} if failed is None else failed
    L, n_kv, E = shape["n_layer"], shape["n_kv_head"], 2 * shape["n_embd"] // shape["n_head"]
    dtype = torch.bfloat16 if device.startswith("cuda") and args.dtype == "bfloat16" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)

    def slot():  # random, never zeros: zeros can run faster than real data
        return torch.randn(shape["batch_size"], shape["block_size"], n_kv, E, device=device, generator=gen).to(dtype)

    kv = slot()

    def row(op, how, slots, ms):
        return dict(op=op, **how, slots=slots, ms=ms, gb_per_s=slots * kv.numel() * kv.element_size() / ms / 1e6)

    rows = [row("copy", dict(dots="-", tile="-"), 2, time_op(kv.clone, device, args.steps))]
    earlier = {(r["op"], r["dots"], r["tile"]): r for r in held}
    triton_kernels = kernels.use_triton(kv)
    # on a GPU in bf16, the kernels' two choices of dot operands (kernels.LOW_PRECISION_DOTS); with --sweep,
    # every tile of TILES (kernels.KNOBS), with the chosen operands
    knobs = ("LOW_PRECISION_DOTS", *kernels.KNOBS)
    chosen = tuple(getattr(kernels, name) for name in knobs)
    choices = [(low, *chosen[1:]) for low in (True, False)] if triton_kernels and dtype == torch.bfloat16 else [chosen]
    if args.sweep and triton_kernels:
        choices = [(chosen[0], *tile) for tile in sweep_tiles(kv)]
    try:
        for layer in sorted({0, L // 2, L - 1}):  # (each once: a 2-layer model has L // 2 == L - 1)
            n_out = L - layer  # lime: the layer itself and every later one; each has a partial sum unless layer 0
            n_part = n_out if layer else 0
            w = torch.randn(n_out, n_kv, n_kv, device=device, generator=gen) / n_kv**0.5
            partials, grads = [slot() for _ in range(n_part)], [slot() for _ in range(n_out)]
            for choice in choices:
                for name, value in zip(knobs, choice):
                    setattr(kernels, name, value)
                dots = ("bf16" if choice[0] else "fp32") if dtype == torch.bfloat16 and triton_kernels else "-"
                # the tile as it acts on this slot: PACK 0 where nothing packs (LIME_TILE's 1 at 12 kv heads)
                tile = (*choice[1:-1], int(kernels.packing(kv) > 1))
                how = dict(dots=dots, tile="/".join(map(str, tile)) if triton_kernels else "-")
                ops = [f"{op}, layer {layer}" for op in ("forward", "backward")]
                if all((op, how["dots"], how["tile"]) in earlier for op in ops):
                    rows += [earlier[op, how["dots"], how["tile"]] for op in ops]
                    continue
                if how["tile"] in failed:  # (after its rows of the layers before, kept)
                    continue
                try:
                    fwd = time_op(lambda: kernels.route(kv, w, partials), device, args.steps)
                    bwd = time_op(lambda: kernels.route_backward(grads, kv, w, True), device, args.steps)
                except Exception as e:  # (Triton's, compiling a tile: in a sweep, the other tiles are still timed)
                    if not args.sweep:
                        raise
                    print(f"layer {layer}, tile {how['tile']}: failed ({first_line(e)})")
                    failed[how["tile"]] = first_line(e)
                    measured(rows)  # (saved as failed)
                    if not usable(device):  # NOTE (an illegal address, say) every later tile would fail too, and the
                        # next run would try this one first again: saved as failed, the run ends
                        raise RuntimeError(f"tile {how['tile']} left the GPU in error ({first_line(e)}): run the same "
                                           "command again to go on past it") from e
                    continue
                rows += [row(ops[0], how, 1 + n_part + n_out, fwd), row(ops[1], how, n_out + 2, bwd)]
                measured(rows)
    finally:  # the kernels' own choices, as they were, whatever happened
        for name, value in zip(knobs, chosen):
            setattr(kernels, name, value)
    print(f"the routing op alone, {L} layers, a slot is {tuple(kv.shape)} {str(dtype)[6:]} "
          f"({kv.numel() * kv.element_size() / 2**20:.1f} MB); median of {args.steps}; tile: columns/warps/outputs a "
          "launch/grad-w split/pack")
    print(f"{'op':>20} {'dots':>5} {'tile':>12} {'slots':>6} {'ms':>9} {'GB/s':>8}")
    for r in rows:
        print(f"{r['op']:>20} {r['dots']:>5} {r['tile']:>12} {r['slots']:6d} {r['ms']:9.3f} {r['gb_per_s']:8.0f}")
    return rows


def add_ratios(results, base=None):
    """Each mode's step and memory over those of `base` (by default `none`, else the first mode), and its name; a
    `base` not in `results`: no ratios (None), and None."""
    ref = next((x for x in results if x["router"] == (base or "none")), None if base else results[0])
    for x in results:
        x["step_ratio"] = ref and x["ms_per_step"] / ref["ms_per_step"]
        x["memory_ratio"] = ref and x["memory_bytes"] / ref["memory_bytes"]
    return ref and ref["router"]


def report(results, title, profile=False, base=None):
    """The modes' figures with their ratios to `base` (by default `none`, else the first mode), as a table; with
    --profile, where each step's time goes too. A `base` that failed: no ratios, and a line that says so."""
    ref = add_ratios(results, base)
    base = ref or base
    print(title)
    ratio, w = f"x {base}", max(9, *(len(x["router"]) for x in results))
    print(f"{'router':>{w}} {'ms/step':>9} {ratio:>9} {'tok/s':>9} {'MFU':>6} {'memory MB':>10} {ratio:>9} "
          f"{'gen tok/s':>10}")
    for x in results:
        mfu = f"{100 * x['mfu']:.1f}%" if x["mfu"] else "-"
        gen = f"{x['gen_tokens_per_s']:,.0f}" if x["gen_tokens_per_s"] else "-"
        step, memory = (f"{x[k]:9.3f}" if ref else f"{'-':>9}" for k in ("step_ratio", "memory_ratio"))
        print(f"{x['router']:>{w}} {x['ms_per_step']:9.1f} {step} {x['tokens_per_s']:9,.0f} {mfu:>6} "
              f"{x['memory_bytes'] / 2**20:10.1f} {memory} {gen:>10}")
    if not ref:
        print(f"no ratios: {base} failed (above), and a ratio to another model would read as one to {base}: run "
              "again to measure it")
    if profile:
        print_profile(results, base)


def parse_args(argv):
    p = Parser(description=__doc__)
    p.add_argument("--device", default="auto", help=DEVICES)
    p.add_argument("--shape", default=None, help=f"model shape and micro-batch: {', '.join(SHAPES)} "
                                                  "(default: cpu on a CPU, 150m on CUDA)")
    # every method; J its default, or 4
    every = ",".join(name.replace("-J", "" if cls.J else "-4") for name, cls in registry().items())
    p.add_argument("--routers", default=every,
                   help="comma-separated router modes; ratios are to none, or to the first listed")
    p.add_argument("--n-layer", type=int, help="override the shape's depth")
    p.add_argument("--batch-size", type=int, help="override the shape's sequences per step")
    p.add_argument("--block-size", type=int, help="override the shape's sequence length")
    p.add_argument("--depths", help="also run a depth sweep at the shape's width, e.g. 12,32,64")
    p.add_argument("--steps", type=int, default=None, help="timed training steps per mode (default: 5, 10 on CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per mode first (default: 1, 3 compiled)")
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens generated per generation timing")
    p.add_argument("--gen-repeats", type=int, default=3, help="generation timings per mode (0: none)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="CUDA autocast dtype (a CPU always runs float32)")
    p.add_argument("--compile", default="auto", choices=COMPILE, help="torch.compile: auto (on for CUDA)")
    p.add_argument("--fresh-processes", action="store_true",
                   help="run each mode alone in a fresh process on a CPU too (always so on CUDA or compiled)")
    p.add_argument("--kernels", action="store_true",
                   help="time the routing op alone (forward, backward, a copy for the bandwidth) instead of models")
    p.add_argument("--sweep", action="store_true",
                   help="with --kernels on CUDA: time the Triton kernels at every tile of TILES (columns, warps, "
                        "outputs a launch takes, grad-w split, packing)")
    p.add_argument("--suite", action="store_true",
                   help="every GPU figure of the README's Performance section, each model alone, in parts (shape: "
                        "routers, or the routing op): " + "; ".join(f"{shape}: {what}" for shape, what in SUITE) +
                        "; with --json, run it again to go on after a cut: the models that file holds are kept")
    p.add_argument("--profile", action="store_true",
                   help="also profile 3 steps of each mode: where the time goes, by kind of work (routing, attention, "
                        "matmuls, ...), side by side with the first mode's")
    p.add_argument("--json", type=a_path, help="also write the figures to this file as JSON")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the --json file if it exists (without it: an error, except that --suite goes on "
                        "from the models a file of its own holds)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one router measured, its figures written there
    args, given = p.parse_args(argv), p.given(argv)

    args.device = pick_device(args.device)
    # the flags of the models' timing, which --kernels would ignore
    models_only = [flag for flag in ("warmup", "gen_tokens", "gen_repeats", "compile", "fresh_processes")
                   if flag in given]
    is_cuda = args.device.startswith("cuda")
    args.compile = "on" if compiles(args.compile, args.device) else "off"
    args.steps = args.steps if args.steps is not None else 10 if is_cuda else 5
    args.warmup = args.warmup if args.warmup is not None else 3 if args.compile == "on" else 1
    chosen = [flag for flag in ("shape", "routers", "depths", "n_layer", "batch_size", "block_size")
              if flag in given]  # the models measured, which --suite and --kernels fix
    args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if not args.routers:
        raise UsageError("--routers names no router")
    for r in args.routers:
        try:
            GPTConfig(router=r)
        except ValueError as e:
            raise UsageError(str(e)) from None
    args.routers = distinct(args.routers)  # each method once (lime,lime or hc,hc-4: timed once)
    args.shape = args.shape or ("150m" if is_cuda else "cpu")
    if args.shape not in SHAPES:
        raise UsageError(f"unknown shape {args.shape!r}: choose from {', '.join(SHAPES)}")
    shape = dict(SHAPES[args.shape])
    for key in ("n_layer", "batch_size", "block_size"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    try:
        args.depths = [int(d) for d in args.depths.split(",")] if args.depths else []
    except ValueError:
        raise UsageError(f"--depths={args.depths!r}: expected comma-separated integers, e.g. 12,32,64")
    checks = [(args.steps >= 1, "--steps must be at least 1"), (args.warmup >= 0, "--warmup must be 0 or more"),
              (args.gen_repeats >= 0, "--gen-repeats must be 0 or more"),
              (args.gen_tokens >= 1, "--gen-tokens must be at least 1"),
              (not (args.kernels and args.profile), "--profile profiles training steps: not with --kernels"),
              (not (args.kernels and args.suite), "--suite times the routing op itself: not with --kernels"),
              (args.kernels or args.suite or not args.sweep, "--sweep times the routing op: give --kernels too"),
              (not args.sweep or kernels.use_triton(torch.empty(0, device=args.device)),
               f"--sweep times the Triton kernels, which do not run on {args.device} (CUDA; or the CPU interpreter: "
               "LIME_TRITON=1 TRITON_INTERPRET=1)"),
              (args.worker or not args.suite or not chosen,
               "--suite measures the shapes and routers of SUITE: not with "
               + ", ".join("--" + c.replace("_", "-") for c in chosen)),
              (not args.kernels or not {"routers", "depths"} & set(chosen),
               "--kernels times the op at lime's layers: not with --routers or --depths"),
              (not args.kernels or not models_only, "--kernels times the op alone, no model: not with "
               + ", ".join("--" + f.replace("_", "-") for f in models_only)),
              (min([shape["n_layer"], shape["batch_size"], *args.depths]) >= 1,
               "--n-layer, --batch-size and --depths must be at least 1"),
              (shape["block_size"] >= 2, "--block-size must be at least 2 (generation starts from its first half)"),
              (POSITIONS[1](shape["block_size"]), f"--block-size must be {POSITIONS[0]}"),
              (all(SIZE[1](n) for n in [shape["n_layer"], shape["batch_size"], *args.depths]),
               f"--n-layer, --batch-size and --depths must be {SIZE[0]}"),
              (args.kernels or args.gen_repeats == 0
               or shape["block_size"] // 2 + args.gen_tokens <= shape["block_size"],
               f"--gen-tokens={args.gen_tokens} does not fit after a prompt of half the block of "
               f"{shape['block_size']}")]
    for ok, message in checks:
        if not ok:
            raise UsageError(message)
    if args.json:  # checked before the benchmark runs, not after
        folder = Path(args.json).resolve().parent
        problem = f"no directory {folder}" if not folder.exists() else folder_problem(folder) or \
            (Path(args.json).exists() and not Path(args.json).is_file() and f"{args.json} is not a file") or \
            (args.json.endswith(("/", os.sep)) and "a folder's name, not a file's")  # (Path drops the slash)
        if problem:
            raise UsageError(f"--json={args.json}: {problem}")
        if Path(args.json).exists() and not args.worker:
            # NOTE --overwrite replaces bench.py's own figures only: not a run's summary.json named by mistake
            # (--suite without it reads the file, and says what is wrong with one of its own)
            if args.overwrite or not args.suite:
                try:
                    read_json(args.json, keys=FIGURES)
                except DataError:  # (damaged, or another file)
                    raise UsageError(f"--json={args.json} holds no figures of bench.py (a run's summary.json?), and it "
                                     "replaces only its own: give another file, or move it away") from None
            if not (args.overwrite or args.suite):
                raise UsageError(f"--json={args.json} already holds figures: give another file, or --overwrite to "
                                 "replace them")
    args.json_state = args.json and file_state(args.json)  # as checked: write_json compares it again
    return args, shape


def write_json(args, out):
    """--json's file, unless another process wrote it after this one checked it (or last wrote it: --suite writes it
    after every part): two benchmarks at once into one file kept the figures of the last to end, without a word."""
    if file_state(args.json) != args.json_state:
        raise UsageError(f"--json={args.json} was written by another process while this one ran: it keeps that one's "
                         "figures (this one's are above); give another file")
    atomic_write(args.json, lambda f: f.write(json.dumps(out, indent=2).encode()))
    args.json_state = file_state(args.json)


def whole(result, routers, args):
    """Whether a model's figures in a --suite file are what measure() writes for one of `routers`, timed as this
    run times them (steps, warm-up, generation, profile): else (cut short, damaged, or measured otherwise) the model
    is measured again."""
    return isinstance(result, dict) and result.get("router") in routers and result.get("measured") == \
        measured_as(args) and ("profile" in result) == args.profile and \
        (not args.profile or profiled(result["profile"])) and \
        (result.get("gen_tokens_per_s") is None) == (args.gen_repeats == 0) and \
        all(number(result.get(k)) for k in ("ms_per_step", "tokens_per_s", "memory_bytes", "params")) and \
        all(result.get(k) is None or number(result[k]) for k in ("gen_tokens_per_s", "mfu"))


def number(x, zero=False):
    """Whether x is a figure as bench.py writes it: a finite number (not a bool) above 0, or with `zero` from 0."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (x >= 0 if zero else x > 0) and x < math.inf


def profiled(p):
    """Whether p is what profile_steps returns, as a --suite file holds it."""
    def figures(*xs):  # (a kind of work with no time or no launches in a step: 0)
        return all(number(x, zero=True) for x in xs)
    return isinstance(p, dict) and number(p.get("steps")) and figures(p.get("busy_ms")) and \
        isinstance(p.get("kinds"), dict) and all(isinstance(v, list) and len(v) == 2 and figures(*v)
                                                 for v in p["kinds"].values()) and \
        isinstance(p.get("top"), list) and all(isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) and
                                               figures(*t[1:]) for t in p["top"])


def kernel_rows(rows):
    """Whether rows are what measure_kernels returns, as a --suite file holds them."""
    return isinstance(rows, list) and all(isinstance(r, dict) and all(isinstance(r.get(k), str) for k in
                                                                       ("op", "dots", "tile")) and
                                          all(number(r.get(k)) for k in ("slots", "ms", "gb_per_s")) for r in rows)


def machine_of(device):
    """The machine a --suite part is measured on: on CUDA its GPU, by the UUID no other GPU has (not the host's name
    too: a container's changes from one start to the next, on the same GPU); on a CPU the host."""
    uuid = device.startswith("cuda") and getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"GPU-{uuid}" if uuid else socket.gethostname()


def run_suite(args, argv, out):
    """SUITE, part by part. With --json, the file is written after every part and every model, and the parts and
    models it already holds (from this device, torch, dtype and compile setting: another's is an error) are kept,
    not measured again: a command cut short by a time limit goes on from its last model. A part's models are kept
    only from this very GPU (or host), so that its ratios come from one machine."""
    kept, others, names = {}, [], [f"{shape}: {what}" for shape, what in SUITE]
    if args.json and Path(args.json).exists() and not args.overwrite:
        old = read_json(args.json, keys=FIGURES)
        if "suite" not in old:
            raise UsageError(f"--json={args.json} holds figures that are not a suite's: give another file, or "
                             "--overwrite to replace them")
        if not isinstance(old["suite"], list) or not all(isinstance(part, dict) and isinstance(part.get("part"), str)
                                                         for part in old["suite"]):
            raise DataError(f"{args.json} is not what this repo writes: its 'suite' is not a list of parts")
        held = old["device"], old["torch"], old["dtype"], old.get("compile")
        if held != (out["device"], out["torch"], out["dtype"], out["compile"]):  # figures from elsewhere: never lost
            raise UsageError(f"--json={args.json} holds the suite of {held[0]}, torch {held[1]}, {held[2]}, compile "
                             f"{held[3]}: give another file, or --overwrite to replace it")
        kept = {part["part"]: part for part in old["suite"]}
        # the parts of an earlier SUITE (its routers grouped otherwise): not measured here, nor lost from the file
        others = [part for name, part in kept.items() if name not in names]
    if not args.device.startswith("cuda") and any(name not in kept for name in names):  # (tests: small shapes)
        print(f"note: --suite on {args.device} times the GPU shapes ({', '.join(dict.fromkeys(s for s, _ in SUITE))}), "
              "which take hours there: it is meant for --device cuda (`python bench.py` times a CPU-sized shape)",
              file=sys.stderr)
    machine = machine_of(args.device)  # (several GPUs of one kind may take turns: a part's ratios come from one)
    out["suite"], failures = [], []

    def save(what):
        if args.json:  # NOTE with the parts of the file not reached yet: a run cut short before them keeps them
            reached = {part["part"] for part in out["suite"]}
            ahead = [kept[name] for name in names if name in kept and name not in reached]
            write_json(args, {**out, "suite": out["suite"] + ahead + others})
            print(f"wrote {args.json} ({what})")

    for name, (shape_name, what) in zip(names, SUITE):
        shape = SHAPES[shape_name]
        tiles = json.loads(json.dumps(TILES)) if args.sweep and what == "kernels" else None  # (as the JSON holds it)
        old, routers = kept.get(name, {}), what.split(",")
        results = old.get("results") if isinstance(old.get("results"), list) else []
        done = {r["router"]: r for r in results if whole(r, routers, args)}
        # the routing op's rows, timed as this run times them (a sweep over other tiles, or none, is timed again)
        timed = what == "kernels" and kernel_rows(old.get("kernels")) and \
            (old.get("tiles"), old.get("measured")) == (tiles, measured_as(args, True))
        if timed and old.get("finished") or len(done) == len(routers):
            print(f"{name}: kept from {args.json}")
            out["suite"].append(old)
        elif what == "kernels":  # saved after each tile: a sweep cut short goes on on the same machine
            here = timed and old.get("machine") == machine  # (its rows: on this machine only)
            # the tiles that failed, as this run times them: on any machine (a kernel's fault would be there too)
            failed = dict(old["failed"]) if timed and isinstance(old.get("failed"), dict) else {}
            part = dict(part=name, machine=machine, tiles=tiles, measured=measured_as(args, True), kernels=[],
                        failed=failed)
            out["suite"].append(part)
            part["kernels"] = measure_kernels(
                shape, args, args.device, old["kernels"] if here else (),
                lambda rows: part.update(kernels=rows) or save(f"{len(out['suite']) - 1} of {len(SUITE)} parts; of "
                                                               f"the last, {len(rows) - 1} rows"), failed)
            part["finished"] = True
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()  # the models' processes get the whole GPU
        else:
            part = dict(part=name, machine=machine, results=[])
            out["suite"].append(part)
            for i, router in enumerate(routers):
                if router in done and old.get("machine") == machine:  # (cut short elsewhere: all its models anew)
                    print(f"  {router}: kept from {args.json}")
                    part["results"].append(done[router])
                else:
                    try:
                        part["results"].append(measure_alone(router, shape, args, [*argv, "--shape", shape_name]))
                    except RuntimeError as e:  # NOTE (out of memory, say) the suite goes on: its other parts
                        failures.append(f"{name}: {router}")  # are not held up behind this one
                        print(f"bench.py: {name}: {router}: {first_line(e)}; the suite goes on", file=sys.stderr)
                        continue
                    if i + 1 < len(routers):  # (after its last, the part's own write below)
                        save(f"{len(out['suite'])} of {len(SUITE)} parts; of the last, {i + 1} of {len(routers)} "
                             "models")
            if part["results"]:
                report(part["results"], f"{name}: training step (median of {args.steps}) and generation", args.profile,
                       "none")  # (to its own none alone: a ratio to another model would read as one to none)
        save(f"{len(out['suite'])} of {len(SUITE)} parts")
    out["suite"] += others
    if failures:
        raise RuntimeError(f"{len(failures)} model(s) failed (above), the rest measured and saved; run again to "
                           f"measure them: {', '.join(failures)}")
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    with one_line_errors("bench.py"):
        args, shape = parse_args(argv)
        if args.worker:
            result = json.dumps(measure(args.routers, shape, args, args.device)).encode()
            atomic_write(args.worker, lambda f: f.write(result))  # (a full disk: one line that names the file)
            return None
        is_cuda = args.device.startswith("cuda")
        name = torch.cuda.get_device_name(args.device) if is_cuda else f"cpu ({torch.get_num_threads()} threads)"
        dtype = args.dtype if is_cuda else "float32"
        alone = is_cuda or args.compile == "on" or args.fresh_processes
        how = "" if args.kernels else "; each mode in its own process" if alone else \
            "; modes taking turns in one process"
        print(f"device {name}, torch {torch.__version__}, {dtype}, compile {args.compile}, shape {args.shape} "
              f"{shape}{how}")
        out = dict(device=name, torch=torch.__version__, dtype=dtype, compile=args.compile, shape=shape, runs=[])
        if args.kernels:
            out["kernels"] = measure_kernels(shape, args, args.device)
        try:
            if args.suite:
                return run_suite(args, argv, out)
            for depth in [shape["n_layer"], *args.depths] if not args.kernels else []:
                depth_shape = {**shape, "n_layer": depth}
                results = [measure_alone(r, depth_shape, args, argv) for r in args.routers] if alone else \
                    measure(args.routers, depth_shape, args, args.device)
                report(results, f"{depth} layers: training step (median of {args.steps}) and generation", args.profile)
                out["runs"].append(dict(n_layer=depth, results=results))
        except RuntimeError as e:  # a mode's process that failed (its output is above), or torch in this one
            fail("bench.py", f"error: {first_line(e)}", 1)
        if args.json:
            write_json(args, out)
            print(f"wrote {args.json}")
        return out


if __name__ == "__main__":
    main()
