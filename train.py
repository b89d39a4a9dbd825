"""
Trains a LIMe model (or an ablation of its router) on one CPU, one GPU, or several GPUs.

    python train.py --preset=tiny --router=lime        # offline quick start, a few CPU minutes
    python train.py --router=first-4                   # the 150M router ablation on one GPU
    python train.py --router-top-p=0.9 --prune-at=1000 # top-p pruning of the routers at step 1000, kept after it
    torchrun --standalone --nproc_per_node=8 train.py --preset=1b --router=lime
    python train.py --preset=prosqa --init-from=out/150m-lime   # fine-tune a pretrained run on ProsQA

A preset names a full set of defaults; every flag overrides one of them. The resolved
configuration is printed, saved as <out-dir>/config.json and kept in every checkpoint.
--resume continues a run where it stopped (its weights, optimiser state and step);
--init-from starts a new run, on any data, from the weights of another one: the model's
shape comes from that run (all but --block-size), the optimiser and the step start afresh.
Data batches are a pure function of (seed, step, rank), so a resumed run sees exactly
the batches an uninterrupted one would.
"""

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import resource
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from common import (MODEL_FIELDS, PRUNABLE, Parser, UsageError, autocast_for, clear_run, evaluate, fail,
                    mask_routers, peak_flops, pick_device, prune_routers, pruned_counts, read_checkpoint, run_files,
                    save_checkpoint, synchronize)
from lime import GPT, GPTConfig, parse_router
from prepare_data import TaskRows, batch_rng, load_data


@dataclass
class TrainConfig:
    preset: str = "150m"  # named set of defaults: 150m, 1b, deep, arith, prosqa, tiny
    data: str = "fineweb-edu"  # dataset: fineweb-edu, shakespeare, arithmetic or prosqa
    data_dir: str = ""  # where the dataset is (default data/<data>)
    out_dir: str = ""  # checkpoints and logs (default out/<preset>-<router>)
    batch_size: int = 256  # sequences per optimiser step, over all processes
    micro_batch_size: int = 16  # sequences per forward pass per process; the rest is gradient accumulation
    max_steps: int = 6000  # length of the run; the learning-rate schedule follows it
    epochs: float = 0.0  # arithmetic, prosqa: if > 0, sets max_steps to this many epochs (of len(train) samples)
    warmup_epochs: float = 0.0  # arithmetic, prosqa: if > 0, sets warmup_steps to this many epochs
    stop_at: int = 0  # end this session after this step with a checkpoint (0: run to max_steps)
    lr: float = 1e-3  # peak learning rate
    router_lr: float = 1e-2  # learning rate of the router parameters (no weight decay)
    min_lr: float = 1e-6  # learning rate at the end of the schedule
    warmup_steps: int = 200  # linear warm-up from 0
    schedule: str = "cosine"  # decay after warm-up: cosine or linear
    weight_decay: float = 0.1  # AdamW decay on matmul weights (not norms, embeddings, router)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: off)
    router_top_p: float = 0.0  # if > 0, prune the router weights once to this top-p, at step --prune-at (0: off)
    prune_at: int = 0  # with --router-top-p: the step at which to prune; pruned weights stay zero after it
    eval_interval: int = 500  # evaluate and save a checkpoint every this many steps
    eval_tokens: int = 2_097_152  # language data: validation tokens (fixed windows from the start of val)
    eval_samples: int = 1000  # arithmetic: expressions per tier scored (test, validation); prosqa: test questions
    log_interval: int = 10  # print a progress line every this many steps
    device: str = "auto"  # auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps
    dtype: str = "auto"  # autocast dtype: auto (bfloat16 on CUDA, else float32), bfloat16, float32
    compile: str = "auto"  # torch.compile: auto (on for CUDA), on, off
    seed: int = 1337  # seed of the initial weights and the data order
    init_from: str = ""  # a run folder: start from the weights in its ckpt.pt (a new run, step 0, fresh optimiser)


PRESETS = {
    # the paper's 150M ablation (Table 7): 256 x 2048 tokens a step, 6000 steps = 3.1B tokens
    "150m": dict(),
    # Tables 2-3: 1B with GQA; 1024 x 2048 tokens a step, 20k steps, several GPUs
    "1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, mlp_hidden=8192, batch_size=1024,
               micro_batch_size=8, max_steps=20000),
    # Section 5.5: 32 layers of 8 heads (use --n-layer 64 or 128 for the deeper runs); the width is ours
    "deep": dict(n_layer=32, n_head=8, n_kv_head=8, n_embd=512, mlp_hidden=2048, micro_batch_size=16),
    # Appendix A: 4 layers, 4 heads, d 32; 200 epochs over 3 x 50k samples, lr 1e-3 with linear decay
    "arith": dict(data="arithmetic", n_layer=4, n_head=4, n_kv_head=4, n_embd=32, mlp_hidden=128, block_size=64,
                  vocab_size=1024, batch_size=128, micro_batch_size=128, epochs=200, warmup_steps=0,
                  schedule="linear", eval_interval=5000, log_interval=100),
    # Appendix A: fine-tuning the pretrained 150M model (give --init-from) on ProsQA's ~18k training sequences for
    # 10 epochs, lr 1e-4 with linear decay (to 0: our reading) and warm-up over the first epoch, batch 128. Ours:
    # block 1024 (Coconut trains GPT-2, 1024 positions, on these files; a longer sample is refused, not cut) and
    # accuracy on the whole test split (500); weight decay and router lr, which the paper leaves out, as in pretraining
    "prosqa": dict(data="prosqa", block_size=1024, batch_size=128, micro_batch_size=32, epochs=10, warmup_epochs=1,
                   lr=1e-4, min_lr=0.0, schedule="linear", eval_interval=500, eval_samples=500, log_interval=10),
    # a CPU quick start on the arithmetic task: a few minutes on 2 cores, no download
    "tiny": dict(data="arithmetic", data_dir="data/arithmetic-quick", n_layer=4, n_head=4, n_kv_head=4, n_embd=64,
                 mlp_hidden=256, block_size=64, vocab_size=1024, batch_size=64, micro_batch_size=64, max_steps=1500,
                 lr=3e-3, warmup_steps=50, min_lr=1e-4, eval_interval=500, eval_samples=200, log_interval=50),
}
SESSION_FIELDS = ["stop_at", "device", "compile", "log_interval", "out_dir"]  # a resume may change these freely
POSITIVE = ["block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden", "rope_theta",
            "norm_eps", "batch_size", "micro_batch_size", "max_steps", "lr", "eval_interval", "eval_tokens",
            "eval_samples", "log_interval"]
NON_NEGATIVE = ["seed", "stop_at", "epochs", "warmup_epochs", "router_lr", "min_lr", "warmup_steps", "weight_decay",
                "eps", "grad_clip", "router_top_p", "prune_at"]


def flag(key):
    return "--" + key.replace("_", "-")


def field_help(cls):
    """Each field's help: the comment at the end of its line in the dataclass, so flags and fields
    share one text. A field without such a comment still gets a flag, helped by its name."""
    comments = dict(re.findall(r"^\s+(\w+): [\w\[\], ]+ = .*?  # (.*)$", inspect.getsource(cls), flags=re.M))
    return {f.name: comments.get(f.name, f.name.replace("_", " ")) for f in dataclasses.fields(cls)}


def parse_bool(text):
    """on/off, true/false, yes/no or 1/0, as `--flag=off` (argparse's type=bool would read 'off' as True)."""
    words = dict(on=True, true=True, yes=True, off=False, false=False, no=False)
    words.update({"1": True, "0": False})
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return words[text.lower()]


def build_parser(configs=(TrainConfig, GPTConfig)):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for cls in configs:
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            kind = parse_bool if f.type in (bool, "bool") else f.type
            p.add_argument(flag(f.name), type=kind, help=f"{helps[f.name]} [{f.default}]")
    p.add_argument("--resume", action="store_true", help="continue from <out-dir>/ckpt.pt with its saved config")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an <out-dir> that holds a run: its checkpoint, log and summary are deleted")
    return p


def resolve_config(argv):
    """Flags > the model shape of --init-from's run > preset > defaults; with --resume, flags > the
    checkpoint's saved config. Returns the config and the checkpoints of --resume and --init-from."""
    given = {k: v for k, v in vars(build_parser().parse_args(argv)).items() if v is not None}
    resume, overwrite = given.pop("resume"), given.pop("overwrite")
    if resume and overwrite:
        raise UsageError("--resume continues the run in --out-dir and --overwrite deletes it: give one of them")
    preset = given.get("preset", TrainConfig.preset)
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
    defaults = {**dataclasses.asdict(TrainConfig()), **dataclasses.asdict(GPTConfig())}
    cfg = {**defaults, **PRESETS[preset], **given}
    cfg["preset"] = preset
    init = None
    if cfg["init_from"]:
        if resume:
            raise UsageError("--resume continues the run in --out-dir and --init-from starts a new one from another "
                             "run's weights: give one of them")
        init = init_checkpoint(cfg, given)
    cfg["out_dir"] = cfg["out_dir"] or f"out/{preset}-{cfg['router']}"
    problem = prepare_data.folder_problem(cfg["out_dir"])
    if problem:
        raise UsageError(f"--out-dir={cfg['out_dir']}: {problem}")
    found = run_files(cfg["out_dir"])
    if found and not resume and not overwrite:
        raise UsageError(f"{cfg['out_dir']} already holds a run ({', '.join(found)}): continue it with --resume, "
                         "or start over with --overwrite")
    ckpt = None
    if resume:
        path = Path(cfg["out_dir"]) / "ckpt.pt"
        try:
            ckpt = read_checkpoint(cfg["out_dir"])
        except UsageError as e:
            raise UsageError(f"--resume: {e}") from None
        saved = {**defaults, **ckpt["config"]}  # a run from before a field existed had its default
        clash = [f"{k}={saved[k]!r} (not {v!r})" for k, v in given.items()
                 if k in saved and k not in SESSION_FIELDS and k != "max_steps" and v != saved[k]]
        if clash:
            raise UsageError(f"--resume: {path} was trained with {', '.join(clash)}")
        cfg = {**saved, **{k: v for k, v in given.items() if k in SESSION_FIELDS or k == "max_steps"}}
        cfg["stop_at"] = given.get("stop_at", 0)
        finished = (Path(cfg["out_dir"]) / "summary.json").exists()
        if ckpt["step"] > cfg["max_steps"] or (ckpt["step"] == cfg["max_steps"] and finished):
            raise UsageError(f"--resume: the checkpoint is already at max_steps={cfg['max_steps']}; raise --max-steps")
        if 0 < cfg["stop_at"] <= ckpt["step"]:
            raise UsageError(f"--stop-at={cfg['stop_at']}: the checkpoint is already at step {ckpt['step']}")
    cfg["data_dir"] = cfg["data_dir"] or f"data/{cfg['data']}"
    if "prune_at" in given and not cfg["router_top_p"] > 0:
        raise UsageError("--prune-at says when to prune: give --router-top-p too")
    check_config(cfg)
    return cfg, ckpt, init


def init_checkpoint(cfg, given):
    """--init-from: the other run's checkpoint. Its model's shape replaces the preset's, so that its
    weights fit; block_size may change (RoPE is computed, not stored). A flag that asks for another
    shape is an error, not a silent change."""
    try:
        init = read_checkpoint(cfg["init_from"])
    except UsageError as e:
        raise UsageError(f"--init-from: {e}") from None
    source = init["config"]
    shape = [k for k in MODEL_FIELDS if k != "block_size"]
    clash = [f"{k}={source[k]!r} (not {given[k]!r})" for k in shape if k in given and given[k] != source[k]]
    if clash:
        raise UsageError(f"--init-from: {Path(cfg['init_from']) / 'ckpt.pt'} holds a model with {', '.join(clash)}")
    cfg.update({k: source[k] for k in shape})
    return init


def check_config(cfg):
    # `not x > 0` rather than `x <= 0`: a NaN fails too
    for key in POSITIVE:
        if not cfg[key] > 0:
            raise UsageError(f"{flag(key)} must be positive, got {cfg[key]}")
    for key in NON_NEGATIVE:
        if not cfg[key] >= 0:
            raise UsageError(f"{flag(key)} must be >= 0, got {cfg[key]}")
    for key in ("beta1", "beta2"):
        if not 0 <= cfg[key] < 1:
            raise UsageError(f"{flag(key)} must be in [0, 1), got {cfg[key]}")
    if not cfg["router_top_p"] <= 1:
        raise UsageError(f"--router-top-p must be in (0, 1] (0: no pruning), got {cfg['router_top_p']}")
    try:
        GPTConfig(**{k: cfg[k] for k in MODEL_FIELDS})
    except ValueError as e:
        raise UsageError(str(e)) from None
    choices = dict(data=("fineweb-edu", "shakespeare", "arithmetic", "prosqa"),
                   schedule=("cosine", "linear"), dtype=("auto", "bfloat16", "float32"), compile=("auto", "on", "off"))
    for key, allowed in choices.items():
        if cfg[key] not in allowed:
            raise UsageError(f"{flag(key)}={cfg[key]!r}: choose from {', '.join(allowed)}")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if cfg["batch_size"] % (cfg["micro_batch_size"] * world):
        raise UsageError(f"--batch-size={cfg['batch_size']} is not a multiple of --micro-batch-size="
                         f"{cfg['micro_batch_size']} x {world} processes")
    if cfg["router_top_p"] > 0 and parse_router(cfg["router"])[0] not in PRUNABLE:
        raise UsageError(f"--router-top-p prunes learned static routers (lime, last-J, first-J), not "
                         f"--router={cfg['router']}")
    pick_device(cfg["device"])


# -----------------------------------------------------------------------------
# Optimiser and schedule


def param_groups(model, cfg):
    """Router: its own lr, no decay. Norms and the (tied) embedding: no decay. Matmul weights: decay."""
    router, no_decay, decay = [], [], []
    for name, p in model.named_parameters():
        (router if "router" in name else no_decay if p.dim() < 2 or "wte" in name else decay).append(p)
    groups = [dict(params=decay, weight_decay=cfg["weight_decay"], lr_scale=1.0),
              dict(params=no_decay, weight_decay=0.0, lr_scale=1.0),
              dict(params=router, weight_decay=0.0, lr_scale=cfg["router_lr"] / cfg["lr"])]
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters())), "every parameter in exactly one group"
    return [g for g in groups if g["params"]]


def learning_rate(step, cfg):
    """Linear warm-up, then cosine (or linear) decay to min_lr at max_steps."""
    if step < cfg["warmup_steps"]:
        return cfg["lr"] * (step + 1) / cfg["warmup_steps"]
    progress = min(1.0, (step - cfg["warmup_steps"]) / max(1, cfg["max_steps"] - cfg["warmup_steps"]))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg["schedule"] == "cosine" else 1 - progress
    return cfg["min_lr"] + decay * (cfg["lr"] - cfg["min_lr"])


# -----------------------------------------------------------------------------
# Checkpoints and logs


class Log:
    """<out-dir>/log.jsonl: one JSON object per logged step and per evaluation."""

    def __init__(self, out_dir, resume_step=None):
        self.path = Path(out_dir) / "log.jsonl"
        if resume_step is not None and self.path.exists():  # forget what came after the checkpoint
            keep = [l for l in self.path.read_text().splitlines() if json.loads(l)["step"] <= resume_step]
            prepare_data.atomic_write(self.path, lambda f: f.write("".join(l + "\n" for l in keep).encode()))

    def write(self, **record):
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def format_eta(seconds):
    return f"{seconds / 3600:.1f}h" if seconds > 5400 else f"{seconds / 60:.1f}m" if seconds > 90 else f"{seconds:.0f}s"


# -----------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM (`kill`, a cluster scheduler): save a checkpoint and exit 128 + the signal."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Signals:
    """While installed, SIGINT and SIGTERM raise Interrupted, except inside `with signals.hold():`
    (an optimiser update, a checkpoint save), which a signal waits for. Once stopping, every
    further signal waits: the checkpoint being saved on the way out must be written whole."""

    def __init__(self):
        self.held, self.pending, self.stopping = 0, None, False

    def __enter__(self):
        self.saved = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if self.held or self.stopping:
            self.pending = self.pending or signum
        else:
            self.stop(signum)

    def stop(self, signum):
        self.stopping = True
        raise Interrupted(signum)

    @contextmanager
    def hold(self):
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
        if self.pending and not self.held and not self.stopping:
            self.stop(self.pending)


class Checkpoints:
    """<out-dir>/ckpt.pt, written by rank 0 only, at most once per step, and whole even when a
    signal comes during the write. `step` is the step of the checkpoint on disk, or None.
    `router_mask` is the pruning mask (None until the routers are pruned), saved with the weights
    so that a resumed run keeps exactly the same weights at zero."""

    def __init__(self, out_dir, raw_model, optimizer, cfg, signals, master, step, router_mask):
        self.out_dir, self.model, self.optimizer, self.cfg = out_dir, raw_model, optimizer, cfg
        self.signals, self.master, self.step, self.router_mask = signals, master, step, router_mask

    def save(self, step):
        if self.master and step != self.step:
            with self.signals.hold():  # a signal now waits until the file is whole
                save_checkpoint(self.out_dir, self.model, self.optimizer, step, self.cfg, self.router_mask)
                self.step = step


def train(cfg, ckpt=None, signals=None, init=None):
    """Train from scratch, from another run's weights (`init`, a checkpoint of --init-from) or on from
    this run's checkpoint (`ckpt`, --resume)."""
    # processes: torchrun sets RANK and WORLD_SIZE; a plain run is rank 0 of 1
    ddp = "RANK" in os.environ
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = pick_device(cfg["device"])
    if ddp:
        if device.startswith("cuda"):
            device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    master = rank == 0
    say = print if master else (lambda *a, **k: None)
    device_type = device.split(":")[0]
    signals = signals or Signals()  # not installed: holds nothing, and Ctrl-C is a plain KeyboardInterrupt
    accum = cfg["batch_size"] // (cfg["micro_batch_size"] * world)
    dtype = cfg["dtype"] if cfg["dtype"] != "auto" else "bfloat16" if device_type == "cuda" else "float32"
    autocast = autocast_for(device, dtype)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    # data, model, optimiser
    data = load_data(cfg)
    if isinstance(data, TaskRows):  # the task has to fit the model
        if data.vocab_size > cfg["vocab_size"]:
            whose = f" (the model of --init-from={cfg['init_from']})" if cfg["init_from"] else ""
            raise UsageError(f"--vocab-size={cfg['vocab_size']}{whose} is smaller than the {cfg['data']} vocabulary "
                             f"({data.vocab_size})")
        if data.longest > cfg["block_size"] + 1:
            raise UsageError(f"a sample of {data.longest} tokens does not fit --block-size={cfg['block_size']}")
        # samples are drawn at random (with replacement): an epoch is len(train) samples, not each one once
        steps_per_epoch = len(data.train) / cfg["batch_size"]
        if cfg["epochs"] > 0 and ckpt is None:  # a resumed run has these in its saved config already
            cfg["max_steps"] = math.ceil(cfg["epochs"] * steps_per_epoch)
        if cfg["warmup_epochs"] > 0 and ckpt is None:
            cfg["warmup_steps"] = math.ceil(cfg["warmup_epochs"] * steps_per_epoch)
    if isinstance(data, prepare_data.ArithmeticData):  # the regime goes into config.json and every checkpoint,
        cfg["task"] = dataclasses.asdict(data.task)     # so that sample, analyze and --resume read the same task
    torch.manual_seed(cfg["seed"])
    raw_model = GPT(GPTConfig(**{k: cfg[k] for k in MODEL_FIELDS})).to(device)
    optimizer = torch.optim.AdamW(param_groups(raw_model, cfg), lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]),
                                  eps=cfg["eps"], fused=device_type == "cuda")
    step, mask = 0, None
    if init is not None:  # another run's weights (and its pruning mask, if any); our optimiser, step 0
        try:
            raw_model.load_state_dict(init["model"])
        except RuntimeError as e:
            raise UsageError(f"--init-from: {cfg['init_from']} does not fit: {str(e).splitlines()[0]}") from None
        mask = init.get("router_mask")
    if ckpt is not None:
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        step, mask = ckpt["step"], ckpt.get("router_mask")
    if mask is not None:  # a pruned model stays pruned
        mask = {name: keep.to(device) for name, keep in mask.items()}
        mask_routers(raw_model, mask, optimizer)
    if cfg["router_top_p"] > 0 and cfg["prune_at"] >= cfg["max_steps"]:
        raise UsageError(f"--prune-at={cfg['prune_at']} is not before the last step (max_steps={cfg['max_steps']})")
    compiled = cfg["compile"] == "on" or (cfg["compile"] == "auto" and device_type == "cuda")
    model = torch.compile(raw_model) if compiled else raw_model
    if ddp:
        model = DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])] if device_type == "cuda" else None)

    # the run's folder: written only now, once everything above has worked
    out_dir = Path(cfg["out_dir"])
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        if ckpt is None:
            clear_run(out_dir)
        prepare_data.atomic_write(out_dir / "config.json", lambda f: f.write(json.dumps(cfg, indent=2).encode()))
        log = Log(out_dir, step if ckpt is not None else None)
    counts = raw_model.num_params()
    flops_per_token = raw_model.estimate_flops(cfg["block_size"])
    tokens_per_step = cfg["batch_size"] * cfg["block_size"]
    peak = peak_flops(device, dtype)
    say("config: " + json.dumps(cfg))
    if isinstance(data, prepare_data.ArithmeticData):
        say(f"task: {data.task.label} ({cfg['data_dir']}/meta.json)")
    if init is not None:
        say(f"starting from the weights of {cfg['init_from']} (its step {init['step']})")
    say(f"{'resuming at step ' + str(step) if step else 'training'} on {device} ({world} process(es), {dtype}, "
        f"compile {compiled}): {counts['total'] / 1e6:.2f}M parameters, router {counts['router']:,}; "
        f"{accum} micro-step(s) of {cfg['micro_batch_size']} per step")

    last_step = min(cfg["max_steps"], cfg["stop_at"] or cfg["max_steps"])
    checkpoints = Checkpoints(out_dir, raw_model, optimizer, cfg, signals, master, step if ckpt is not None else None,
                              mask)

    def evaluate_and_save(step):
        """Validation (and at max_steps the test split too), its log line, a check and a checkpoint."""
        t = time.time()
        metrics = evaluate(model, raw_model, data, cfg, device, autocast, rank, world, final=step == cfg["max_steps"])
        if master:
            log.write(step=step, **metrics)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        say(f"eval step {step}: {shown} ({time.time() - t:.1f}s)")
        if not math.isfinite(metrics["val_loss"]):
            raise FloatingPointError(f"validation loss is {metrics['val_loss']} at step {step}")
        checkpoints.save(step)  # (not again for a checkpoint of this step)
        return metrics

    timed_steps, timed_seconds, metrics = 0, 0.0, {}
    synchronize(device)
    window_start, window_steps = time.time(), 0  # timing leaves evaluation out
    try:
        if step == cfg["max_steps"]:  # resumed after a cut in the final evaluation: that is all there is left to do
            metrics = evaluate_and_save(step)
        while step < last_step:
            if cfg["router_top_p"] > 0 and step == cfg["prune_at"]:
                with signals.hold():  # a checkpoint holds the whole pruned model and its mask, or neither
                    mask = checkpoints.router_mask = prune_routers(raw_model, cfg["router_top_p"], mask)
                    mask_routers(raw_model, mask, optimizer)
                pruned, total = map(sum, zip(*pruned_counts(mask).values()))
                say(f"step {step}: top-p {cfg['router_top_p']} pruning zeroed {pruned:,} of {total:,} router weights "
                    f"({100 * pruned / total:.1f}%); they stay zero from here on")
                if master:
                    log.write(step=step, router_pruned=pruned, router_weights=total)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, cfg) * group["lr_scale"]
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                x, y = data.batch(batch_rng(cfg["seed"], step, rank, micro), cfg["micro_batch_size"])
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                # DDP averages gradients over processes only on the last micro-step
                with nullcontext() if not ddp or micro == accum - 1 else model.no_sync():
                    with autocast:
                        loss = model(x, y)[1] / accum
                    loss.backward()
                loss_sum += loss.detach()
            if mask is not None:  # no gradient for a pruned weight, so it counts for nothing in the clipping either
                mask_routers(raw_model, mask)
            if cfg["grad_clip"] > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            with signals.hold():  # all of an update or none of it, so a checkpoint matches its step
                optimizer.step()
                if mask is not None:  # exactly zero, whatever the optimiser did
                    mask_routers(raw_model, mask)
                step += 1
            optimizer.zero_grad(set_to_none=True)
            window_steps += 1

            if step % cfg["log_interval"] == 0 or step == last_step:
                loss_value = loss_sum.item()  # waits for the device
                if not math.isfinite(loss_value):
                    raise FloatingPointError(f"training loss is {loss_value} at step {step}")
                synchronize(device)
                dt = time.time() - window_start
                timed_steps, timed_seconds = timed_steps + window_steps, timed_seconds + dt
                ms = 1000 * dt / window_steps
                tok_s = tokens_per_step * window_steps / dt
                mfu = f" | MFU {100 * flops_per_token * tok_s / (peak * world):.1f}%" if peak else ""
                lr = learning_rate(step - 1, cfg)
                say(f"step {step}/{cfg['max_steps']} | loss {loss_value:.4f} | lr {lr:.2e} | {ms:.0f} ms/step | "
                    f"{tok_s:,.0f} tok/s{mfu} | ETA {format_eta((last_step - step) * ms / 1000)}")
                if master:
                    log.write(step=step, loss=loss_value, lr=lr, ms_per_step=ms, tokens_per_s=tok_s)
                window_start, window_steps = time.time(), 0

            if step % cfg["eval_interval"] == 0 or step == cfg["max_steps"]:
                metrics = evaluate_and_save(step)
                synchronize(device)
                window_start, window_steps = time.time(), 0
    except KeyboardInterrupt as e:
        signals.stopping = True  # from here on a signal waits for the checkpoint below
        signum = getattr(e, "signum", signal.SIGINT)
        say(f"\n{signal.Signals(signum).name}: saving a checkpoint at step {step}", flush=True)
        checkpoints.save(step)
        say(f"interrupted: checkpoint at step {step} in {out_dir}; continue with --resume")
        raise SystemExit(128 + signum)
    except FloatingPointError as e:
        if master:
            kept = "no checkpoint was written" if checkpoints.step is None else \
                f"the checkpoint of step {checkpoints.step} stays in {out_dir}"
            print(f"train.py: error: {e}; stopping: {kept} (lower --lr?)", file=sys.stderr)
        raise SystemExit(1)

    if step != cfg["max_steps"]:
        checkpoints.save(step)
        say(f"stopped after step {step} (--stop-at); continue with --resume")
    elif master:
        peak_mem = torch.cuda.max_memory_allocated(device) if device_type == "cuda" else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        task = {"task": cfg["task"]} if "task" in cfg else {}  # the arithmetic regime, as the config holds it
        summary = dict(router=cfg["router"], preset=cfg["preset"], data=cfg["data"], **task, seed=cfg["seed"],
                       parameters=counts,
                       steps=step, tokens_seen=step * tokens_per_step, **metrics,
                       router_pruned=None if mask is None else sum(p for p, _ in pruned_counts(mask).values()),
                       tokens_per_s=tokens_per_step * timed_steps / max(timed_seconds, 1e-9),
                       peak_memory_bytes=peak_mem, device=device, world_size=world)
        prepare_data.atomic_write(out_dir / "summary.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))
        say(f"done: {out_dir / 'summary.json'}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    if ddp:
        dist.barrier()  # let rank 0 finish writing before the group goes away
        dist.destroy_process_group()
    return metrics


def main(argv=None):
    try:
        cfg, ckpt, init = resolve_config(argv)
        with Signals() as signals:
            return train(cfg, ckpt, signals, init)
    except UsageError as e:
        fail("train.py", f"error: {e}", 2)
    except prepare_data.DataError as e:
        how = "" if "prepare_data.py" in str(e) else (  # unless the message says how already
            f"; prepare it with `python prepare_data.py {cfg['data']}"
            f"{' --data-dir ' + cfg['data_dir'] if cfg['data_dir'] != 'data/' + cfg['data'] else ''}`")
        fail("train.py", f"error: {e}{how} (the offline --preset=tiny needs no download)", 1)
    except KeyboardInterrupt as e:  # outside the training loop, where there is nothing to save
        signum = getattr(e, "signum", signal.SIGINT)
        fail("train.py", f"interrupted ({signal.Signals(signum).name})", 128 + signum)


if __name__ == "__main__":
    main()
