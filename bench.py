"""
Speed and memory of every router mode against the LLaMA baseline (`none`), in one run.

    python bench.py                                   # CPU default shape, under a minute on 2 cores
    python bench.py --device cuda --preset 150m       # the 150M shape, bf16 + torch.compile
    python bench.py --depths 12,32,64                 # how the routing cost grows with depth
    python bench.py --routers none,lime --json out.json

Each mode gets its own model (same seed) and optimiser. After warm-up, the modes are
timed in turn (A B C A B C ...), so slow drifts of the machine hit all of them alike,
and the median step is reported with its ratio to `none` from the same run. A training
step is forward + backward + AdamW. Memory: on CUDA the allocator's peak during a step
(plus the model's own weights and optimiser state); on CPU, where no allocator peak
exists, the bytes autograd saves for backward.
"""

import argparse
import json
import statistics
import sys
import time
from contextlib import nullcontext

import torch

import train
from lime import GPT, GPTConfig

# the CPU default: small enough for 2 cores, deep enough (12 layers) for the routing to show
CPU_SHAPE = dict(n_layer=12, n_head=6, n_kv_head=6, n_embd=384, mlp_hidden=1536, vocab_size=512, block_size=256,
                 batch_size=2)


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


def bench_shape(args):
    if args.preset == "cpu":
        shape = dict(CPU_SHAPE)
    else:
        p = {**{k: getattr(GPTConfig, k) for k in train.MODEL_FIELDS}, **train.PRESETS[args.preset]}
        shape = {k: p[k] for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "vocab_size",
                                   "block_size")}
        shape["batch_size"] = p.get("micro_batch_size", train.TrainConfig.micro_batch_size)
    for key in ("n_layer", "batch_size", "block_size"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return shape


class Runner:
    """One router mode: a model, its optimiser and its timings."""

    def __init__(self, router, shape, device, compile_model):
        torch.manual_seed(0)
        cfg = GPTConfig(router=router, **{k: v for k, v in shape.items() if k != "batch_size"})
        self.router, self.model = router, GPT(cfg).to(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.startswith("cuda"))
        self.step_fn = torch.compile(self.model) if compile_model else self.model
        self.times, self.gen_times, self.peak = [], [], 0

    def train_step(self, idx, autocast):
        with autocast:
            loss = self.step_fn(idx, idx)[1]
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def run(args, shape, device):
    is_cuda = device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if is_cuda and args.dtype == "bfloat16" else nullcontext()
    sync = (lambda: torch.cuda.synchronize(device)) if is_cuda else (lambda: None)
    compile_model = args.compile == "on" or (args.compile == "auto" and is_cuda)
    B, T = shape["batch_size"], shape["block_size"]
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, shape["vocab_size"], (B, T), generator=gen).to(device)
    prompt = idx[:, : T // 2]
    runners = [Runner(r, shape, device, compile_model) for r in args.routers]
    for r in runners:  # warm-up: compilation, allocator, caches
        for _ in range(args.warmup):
            r.train_step(idx, autocast)
    sync()
    for _ in range(args.steps):
        for r in runners:  # interleaved: A B C A B C ...
            if is_cuda:
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t = time.perf_counter()
            r.train_step(idx, autocast)
            sync()
            r.times.append(time.perf_counter() - t)
            if is_cuda:
                r.peak = max(r.peak, torch.cuda.max_memory_allocated(device) - before)
    for _ in range(args.gen_repeats):
        for r in runners:
            r.model.eval()
            t = time.perf_counter()
            with autocast:
                r.model.generate(prompt, args.gen_tokens, temperature=0)
            sync()
            r.gen_times.append(time.perf_counter() - t)
            r.model.train()
    if not is_cuda:
        for r in runners:
            r.peak = saved_bytes(r.model, idx)
    else:  # add what each model holds between steps: weights and AdamW state
        for r in runners:
            r.peak += sum(t.numel() * t.element_size() for t in r.model.parameters())
            r.peak += sum(t.numel() * t.element_size() for s in r.optimizer.state.values() for t in s.values())

    peak_flops = train.peak_flops(device, args.dtype)
    results = []
    for r in runners:
        ms = 1000 * statistics.median(r.times)
        tok_s = B * T / (ms / 1000)
        results.append(dict(router=r.router, ms_per_step=ms, tokens_per_s=tok_s, memory_bytes=r.peak,
                            gen_tokens_per_s=B * args.gen_tokens / statistics.median(r.gen_times),
                            mfu=r.model.estimate_flops(T) * tok_s / peak_flops if peak_flops else None,
                            params=r.model.num_params()["total"], flops_per_token=r.model.estimate_flops(T)))
    base = next((x for x in results if x["router"] == "none"), results[0])
    for x in results:
        x["step_ratio"] = x["ms_per_step"] / base["ms_per_step"]
        x["memory_ratio"] = x["memory_bytes"] / base["memory_bytes"]
    return results


def print_table(results, title):
    print(title)
    print(f"{'router':>9} {'ms/step':>9} {'x none':>7} {'tok/s':>9} {'MFU':>6} {'memory MB':>10} {'x none':>7} "
          f"{'gen tok/s':>10}")
    for x in results:
        mfu = f"{100 * x['mfu']:.1f}%" if x["mfu"] else "-"
        print(f"{x['router']:>9} {x['ms_per_step']:9.1f} {x['step_ratio']:7.3f} {x['tokens_per_s']:9,.0f} {mfu:>6} "
              f"{x['memory_bytes'] / 2**20:10.1f} {x['memory_ratio']:7.3f} {x['gen_tokens_per_s']:10,.0f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda, then mps, then cpu), cpu, cuda or cuda:N")
    p.add_argument("--preset", default=None, help="model shape: cpu (the CPU default) or a train.py preset "
                                                  "(150m, 1b, deep, ...); default: cpu on CPU, 150m on CUDA")
    p.add_argument("--routers", default="none,lime,average,last-4,first-4,dynamic",
                   help="comma-separated router modes; ratios are relative to none")
    p.add_argument("--n-layer", type=int, help="override the shape's depth")
    p.add_argument("--batch-size", type=int, help="override the shape's sequences per step")
    p.add_argument("--block-size", type=int, help="override the shape's sequence length")
    p.add_argument("--depths", help="also run a depth sweep at the shape's width, e.g. 12,32,64")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens generated per generation timing")
    p.add_argument("--gen-repeats", type=int, default=3, help="generation timings per mode")
    p.add_argument("--dtype", default="bfloat16", help="CUDA autocast dtype: bfloat16 or float32 (CPU: float32)")
    p.add_argument("--compile", default="auto", help="torch.compile: auto (on for CUDA), on, off")
    p.add_argument("--json", help="write the figures to this file as JSON")
    args = p.parse_args(argv)
    try:
        device = train.pick_device(args.device)
        args.routers = [r.strip() for r in args.routers.split(",") if r.strip()]
        for r in args.routers:
            GPTConfig(router=r)  # a clear error for a bad mode, before any work
        args.preset = args.preset or ("150m" if device.startswith("cuda") else "cpu")
        if args.preset != "cpu" and args.preset not in train.PRESETS:
            raise ValueError(f"unknown preset {args.preset!r}: choose from cpu, {', '.join(train.PRESETS)}")
        depths = [int(d) for d in args.depths.split(",")] if args.depths else []
    except ValueError as e:
        sys.exit(f"bench.py: error: {e}")
    shape = bench_shape(args)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    dtype = args.dtype if device.startswith("cuda") else "float32"
    print(f"device {name}, torch {torch.__version__}, {dtype}, shape {shape}")
    results = run(args, shape, device)
    print_table(results, f"training step and generation, median of {args.steps} interleaved steps")
    out = dict(device=name, torch=torch.__version__, dtype=dtype, shape=shape, results=results)
    if depths:
        out["depth_sweep"] = []
        for depth in depths:
            sweep_shape = {**shape, "n_layer": depth}
            sweep = run(args, sweep_shape, device)
            print_table(sweep, f"\n{depth} layers")
            out["depth_sweep"].append(dict(n_layer=depth, results=sweep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
