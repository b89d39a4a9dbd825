"""
Trains a LIMe model (or an ablation of its router, or a baseline) on one CPU, one GPU, or several GPUs.

    python train.py --preset=tiny --router=lime        # offline quick start, a few CPU minutes
    python train.py --router=first-4                   # the 150M router ablation on one GPU
    python train.py --router-top-p=0.9 --prune-at=1000 --out-dir=out/150m-lime-p90   # top-p pruning at step 1000
    torchrun --standalone --nproc_per_node=8 train.py --preset=1b --router=lime
    python train.py --preset=prosqa --init-from=out/150m-lime   # fine-tune a pretrained run on ProsQA

A preset names a full set of defaults; every flag overrides one of them. The resolved
configuration is printed, saved as <out-dir>/config.json and kept in every checkpoint.
--resume continues a run where it stopped (its weights, optimiser state and step);
--init-from starts a new run, on any data, from the weights of another one: the model's
shape comes from that run (all but --block-size), the optimiser and the step start afresh.
Data batches, and torch's random numbers during a step, are a pure function of (seed, step,
micro-batch), so a resumed run sees exactly the batches and draws an uninterrupted one would, and
one process with 8 micro-steps the rows that 8 processes (torchrun) with one each see.
The plumbing around this recipe (flags, resume, signals, checkpoints, the run's folder) is in runs.py.
"""

# cli first: from then on a Ctrl-C is one line, even while torch (seconds to load) is still loading
from cli import (COMPILE, DEVICES, NON_NEGATIVE, POSITIVE, SEED, SIZE, autocast_for, check_fields, compiles,
                 dtype_for, lost_peer, option, output_failed, peak_flops, peak_memory, pick_device, seed_draws,
                 show_metrics, synchronize)

import json
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import arithmetic
import runs
from data import TaskRows, batch_rng, evaluate
from lime import GPT, GPTConfig
from methods import parse_router, satisfies
from pruning import mask_routers, prunable, prunable_forms, prune_routers, pruned_total

UNIT = ("in [0, 1)", lambda x: 0 <= x < 1)
FREE = dict(resume="may change")  # where and how long a session runs: --resume may give it anew


@dataclass
class TrainConfig(runs.EvalConfig):
    """Everything a run is: the model, its data and evaluation (runs.EvalConfig's fields) and how it is trained.
    Each field is a flag."""
    preset: str = option("150m", lambda: f"named set of defaults: {', '.join(PRESETS)}")  # (read once defined)
    out_dir: str = option("", "checkpoints and logs (default out/<preset>-<router>)", path=True, **FREE)
    batch_size: int = option(256, "sequences per optimiser step, over all processes", rule=SIZE)
    max_steps: int = option(6000, "length of the run; the learning-rate schedule follows it", rule=POSITIVE, **FREE)
    epochs: float = option(0.0, "tasks: if > 0, sets max_steps to this many epochs (of len(train) samples); "
                                "a --max-steps given instead overrides a preset's", rule=NON_NEGATIVE, data=TaskRows)
    warmup_epochs: float = option(0.0, "tasks: if > 0, sets warmup_steps to this many epochs; a --warmup-steps "
                                       "given instead overrides a preset's", rule=NON_NEGATIVE, data=TaskRows)
    stop_at: int = option(0, "end this session after this step with a checkpoint (0: run to max_steps)",
                          rule=NON_NEGATIVE, **FREE)
    lr: float = option(1e-3, "peak learning rate", rule=POSITIVE)
    router_lr: float = option(1e-2, "peak learning rate of the router parameters, on the same schedule scaled by "
                                     "router_lr / lr (no weight decay)", rule=NON_NEGATIVE)
    min_lr: float = option(1e-6, "learning rate at the end of the schedule", rule=NON_NEGATIVE)
    warmup_steps: int = option(200, "linear warm-up from 0", rule=NON_NEGATIVE)
    schedule: str = option("cosine", "decay after warm-up", choices=("cosine", "linear"))
    weight_decay: float = option(0.1, "AdamW decay on matmul weights (not norms, embeddings, a router's or a "
                                      "residual stream method's)", rule=NON_NEGATIVE)
    beta1: float = option(0.9, "AdamW beta1", rule=UNIT)
    beta2: float = option(0.95, "AdamW beta2", rule=UNIT)
    eps: float = option(1e-8, "AdamW epsilon", rule=NON_NEGATIVE)
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)", rule=NON_NEGATIVE)
    router_top_p: float = option(0.0, "if > 0, prune the router weights once to this top-p, at step --prune-at",
                                 rule=("in (0, 1] (0: no pruning)", lambda x: 0 <= x <= 1))
    prune_at: int = option(0, "with --router-top-p: the step at which to prune (0: the weights the run starts from, "
                              "drawn or --init-from's); pruned weights stay zero after it", rule=NON_NEGATIVE)
    eval_interval: int = option(500, "evaluate and save a checkpoint every this many steps", rule=POSITIVE)
    log_interval: int = option(10, "print a progress line every this many steps", rule=POSITIVE, **FREE)
    device: str = option("auto", DEVICES, **FREE)
    dtype: str = option("auto", "autocast dtype (auto: bfloat16 on CUDA, else float32)",
                        choices=("auto", "bfloat16", "float32"), **FREE)
    compile: str = option("auto", "torch.compile (auto: on for CUDA)", choices=COMPILE, **FREE)
    seed: int = option(1337, "seed of the initial weights and the data order", rule=SEED)
    init_from: str = option("", "a run folder: start from the weights in its ckpt.pt (a new run, step 0, "
                                "fresh optimiser)", path=True)
    # not flags: with --init-from, the setting of the run it starts from (runs.setting) and its checkpoint's step,
    # recorded as the flags are read (runs.resolve); and the prunings of analyze.py prune --save, [{"top_p": p,
    # "step": s}, ...]. Each is part of the run's setting: a table never takes two runs that differ in them for seeds
    init_source: dict = None
    prunings: list = None

    def __post_init__(self):
        check_fields(self, runs.flag)  # "--lr must be positive, got 0"
        if self.min_lr > self.lr:  # (the schedule would climb to it: --lr is the peak)
            raise ValueError(f"--min-lr={self.min_lr:g} is above --lr={self.lr:g}, the schedule's peak")
        for name, lr in [("lr", self.lr), ("router_lr", self.router_lr)]:
            # AdamW's first update moves a weight by up to lr / (1 - beta1), a number it applies in float32: past
            # float32's largest, torch's traceback ("cannot be converted to type float without overflow")
            first = lr / (1 - self.beta1)
            if first > torch.finfo(torch.float32).max:
                raise ValueError(f"{runs.flag(name)}={lr:g} is too large: AdamW's first step, lr / (1 - beta1) = "
                                 f"{first:g}, overflows float32")
        if not issubclass(runs.DATASETS[self.data], TaskRows) and self.eval_tokens < self.block_size:
            raise ValueError(f"--eval-tokens={self.eval_tokens} is less than one window of --block-size="
                             f"{self.block_size}: nothing to evaluate on")
        super().__post_init__()
        if self.router_top_p > 0 and not satisfies(parse_router(self.router)[0], prunable):
            raise ValueError(f"--router-top-p applies to {prunable_forms()}, not --router={self.router}")


PRESETS = {
    # the paper's 150M router ablation (Table 7). The paper states no shape or budget for it: GPT-2 small's shape
    # in LLaMA blocks, and 256 x 2048 tokens a step for 6000 steps (3.1B tokens) are this repo's choice
    "150m": dict(),
    # Tables 2-3: 1B with GQA; 1024 x 2048 tokens a step, 20k steps, several GPUs
    "1b": dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, mlp_hidden=8192, batch_size=1024,
               micro_batch_size=8, max_steps=20000),
    # Section 5.5: 32 layers of 8 heads (use --n-layer 64 or 128 for the deeper runs); the width is ours
    "deep": dict(n_layer=32, n_head=8, n_kv_head=8, n_embd=512, mlp_hidden=2048, micro_batch_size=16),
    # Appendix A: 4 layers, 4 heads, d 32; 200 epochs over 50k samples of a tier, lr 1e-3 with linear decay. Ours:
    # one model per tier and batch 1024 (9,766 steps), where LIMe's lead at 6 operators showed on a GPU (README).
    # Block 96: a step-by-step solution of 6 operators takes up to 86 tokens
    "arith": dict(data="arithmetic", n_layer=4, n_head=4, n_kv_head=4, n_embd=32, mlp_hidden=128, block_size=96,
                  vocab_size=1024, batch_size=1024, micro_batch_size=1024, epochs=200, warmup_steps=0,
                  schedule="linear", eval_interval=500, log_interval=100),
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
# The presets that make their data here, offline, the first time their own folder is missing (and only
# there: a --data-dir mistyped is an error, not a new data set): the task each generates
GENERATES = {"tiny": arithmetic.QUICK_START, "arith": arithmetic.Task(**arithmetic.DEFAULTS)}


# -----------------------------------------------------------------------------
# Optimiser and schedule


def param_groups(model, cfg):
    """Router: its own lr, no decay. Norms, the (tied) embedding and a method of the residual stream
    (baselines.py): no decay. Matmul weights: decay."""
    router, no_decay, decay = [], [], []
    routers = {id(p) for r in model.routers for p in r.parameters()}  # (by module: a method's names may say anything)
    for name, p in model.named_parameters():
        stay = p.dim() < 2 or "wte" in name or name.startswith("residual.")
        (router if id(p) in routers else no_decay if stay else decay).append(p)
    groups = [dict(params=decay, weight_decay=cfg.weight_decay, lr_scale=1.0),
              dict(params=no_decay, weight_decay=0.0, lr_scale=1.0),
              dict(params=router, weight_decay=0.0, lr_scale=cfg.router_lr / cfg.lr)]
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters())), "every parameter in exactly one group"
    return [g for g in groups if g["params"]]


def learning_rate(step, cfg):
    """Linear warm-up, then cosine (or linear) decay to min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr + decay * (cfg.lr - cfg.min_lr)


# -----------------------------------------------------------------------------
# Training


def training_data(cfg, run, dry_run=False):
    """The run's data, checked against the model's vocabulary and block size (an offline preset generates its task
    first; a dry run makes nothing, and finds None where there is no data yet). A task (samples, not token shards)
    may give the run's length in epochs of len(train) samples: --stop-at and --prune-at are checked against it."""
    data = runs.training_data(cfg, run, GENERATES.get(cfg.preset), runs.data_folder(PRESETS, cfg.preset, cfg.data),
                              dry_run)
    if data is None:
        return None
    if data.train_size and run.resume is None:  # a resumed run has these in its saved config already
        # samples are drawn at random (with replacement): an epoch is len(train) samples, not each one once
        runs.steps_of_epochs(cfg, data.train_size / cfg.batch_size)
    runs.check_last_step(cfg)  # (a length in epochs is known in steps only now)
    # a task's regime (arithmetic), or the token shards read, go into config.json and every checkpoint: sample,
    # analyze and --resume read them
    cfg.task, cfg.shards = data.regime, data.shards
    return data


def train(cfg, run):
    """Train from scratch, from another run's weights (--init-from) or on from this run's checkpoint
    (--resume); `run` (runs.Run) keeps the folder: config, log, checkpoints, summary."""
    # processes: torchrun sets RANK and WORLD_SIZE; a plain run is rank 0 of 1
    ddp = "RANK" in os.environ
    rank, world = runs.processes()
    device = pick_device(cfg.device)
    if ddp:
        if device.startswith("cuda"):
            device = f"cuda:{os.environ['LOCAL_RANK']}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    device_type = device.split(":")[0]
    accum = cfg.batch_size // (cfg.micro_batch_size * world)  # micro-steps per process (runs.py: it divides exactly)
    dtype = dtype_for(device, cfg.dtype)
    autocast = autocast_for(device, dtype)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    else:  # NOTE a CPU takes a slow path for subnormal floats (under 1.2e-38), which the tiny gradients of a run
        torch.set_flush_denormal(True)  # late in training become: here they are zeros (README, the arithmetic task)

    data = training_data(cfg, run)

    # model and optimiser
    torch.manual_seed(cfg.seed)
    raw_model = GPT(GPTConfig.of(cfg)).to(device)
    optimizer = torch.optim.AdamW(param_groups(raw_model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  eps=cfg.eps, fused=device_type == "cuda")
    step, mask = run.restore(raw_model, optimizer)  # --resume's weights and step, or --init-from's weights
    if mask is not None:  # a pruned model stays pruned (the run saves the mask with its checkpoints)
        mask = run.router_mask = {name: keep.to(device) for name, keep in mask.items()}
        mask_routers(raw_model, mask, optimizer)
    compiled = compiles(cfg.compile, device)
    model = torch.compile(raw_model) if compiled else raw_model
    if ddp:
        model = DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])] if device_type == "cuda" else None)

    run.begin()  # the run's folder: written only now, once everything above has worked
    counts = raw_model.num_params()
    method_params = f"residual stream {counts['residual']:,}" if counts["residual"] else f"router {counts['router']:,}"
    flops_per_token = raw_model.estimate_flops(cfg.block_size)
    tokens_per_step = cfg.batch_size * cfg.block_size
    peak = peak_flops(device, dtype)
    say = run.say
    say("config: " + json.dumps(asdict(cfg)))
    if data.label:
        say(f"task: {data.label}, from {cfg.data_dir}/meta.json")
    if run.init is not None:
        say(f"starting from the weights of {cfg.init_from} (its step {run.init['step']})")
    if mask is not None:  # pruned before this session: by this run (--resume), or the one it starts from
        say("{:,} of {:,} router weights were pruned: they stay zero".format(*pruned_total(raw_model, mask)))
    say(f"{'resuming at step ' + str(step) if step else 'training'} on {device} ({world} process(es), {dtype}, "
        f"compile {compiled}): {counts['total'] / 1e6:.2f}M parameters, {method_params}; "
        f"{accum} micro-step(s) of {cfg.micro_batch_size} per step")
    if note := run.session(step, device=device, dtype=dtype, compile=compiled, world_size=world):
        say(note)  # resumed on another kind of device (a CPU after a GPU) or --dtype: its arithmetic changes here

    def evaluate_and_save(step):
        """Validation (and at max_steps the test split too), its log line, a check and a checkpoint."""
        t = time.time()
        metrics = evaluate(model, raw_model, data, cfg.micro_batch_size, device, autocast, rank, world,
                           final=step == cfg.max_steps)
        run.log(step=step, **metrics)
        say(f"eval step {step}: {show_metrics(metrics)} ({time.time() - t:.1f}s)")
        if not math.isfinite(metrics["val_loss"]):
            raise FloatingPointError(f"validation loss is {metrics['val_loss']} at step {step}")
        run.save(step)
        return metrics

    last_step = min(cfg.max_steps, cfg.stop_at or cfg.max_steps)
    timed_steps, timed_seconds, metrics = 0, 0.0, {}
    synchronize(device)
    window_start, window_steps = time.time(), 0  # timing leaves evaluation out
    try:
        if step and (step % cfg.eval_interval == 0 or step == cfg.max_steps):  # resumed at an evaluation's step:
            metrics = run.logged_evaluation(step) or evaluate_and_save(step)  # its row, or itself if it was cut
        while step < last_step:
            # once: not again in a run resumed from a checkpoint of this step that holds it (see Run.pruned_at)
            if cfg.router_top_p > 0 and step == cfg.prune_at and run.pruned_at != step:
                with run.signals.hold():  # the pruned model, its mask and its log row, or none of them
                    mask = prune_routers(raw_model, cfg.router_top_p, mask)
                    mask_routers(raw_model, mask, optimizer)
                    pruned, total = pruned_total(raw_model, mask)
                    run.pruned(step, mask, pruned, total)
                say(f"step {step}: top-p {cfg.router_top_p} pruning zeroed {pruned:,} of {total:,} router weights "
                    f"({100 * pruned / total:.1f}%); they stay zero from here on")
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, cfg) * group["lr_scale"]
            loss_sum = torch.zeros((), device=device)
            for micro in range(accum):
                rng = batch_rng(cfg.seed, step, rank * accum + micro)  # its place in the step, over every process
                x, y = data.batch(rng, cfg.micro_batch_size)
                seed_draws(device, int(rng.integers(2**63)))  # a method's own draws (a fork's dropout): resumed alike
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                # DDP averages gradients over processes only on the last micro-step
                with nullcontext() if not ddp or micro == accum - 1 else model.no_sync():
                    with autocast:  # NOTE with ignored targets (a task's prompt), a micro-batch's mean is over its
                        loss = model(x, y)[1] / accum  # own tokens: the step's loss is a mean of those means
                    loss.backward()
                loss_sum += loss.detach()
            if mask is not None:  # no gradient for a pruned weight, so it counts for nothing in the clipping either
                mask_routers(raw_model, mask)
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            # the step about to be taken's row: on the interval, and the run's last step. NOTE not a session's last
            # (--stop-at), as a signal's is not: else a resumed run's log would hold a row the uninterrupted one lacks
            logged = (step + 1) % cfg.log_interval == 0 or step + 1 == cfg.max_steps
            if ddp and logged:  # the step's loss over every process's rows, as one process drawing them all logs it
                dist.all_reduce(loss_sum)  # (not rank 0's rows alone: the log would change with the world size); on a
                loss_sum /= world  # logged step only, and before the update: a process gone fails it, step not taken
            # NOTE an update and its log row, whole or neither: a signal between them left a checkpoint of the step
            # and no row of it, missing from the log for good once resumed (more likely on a GPU, where .item() waits);
            # so no collective in here either (a process gone would fail it between them: run.lost_peer)
            with run.signals.hold():
                optimizer.step()
                if mask is not None:  # exactly zero, whatever the optimiser did
                    mask_routers(raw_model, mask)
                step += 1
                optimizer.zero_grad(set_to_none=True)
                window_steps += 1
                if logged:
                    loss_value = loss_sum.item()  # waits for the device
                    if not math.isfinite(loss_value):
                        raise FloatingPointError(f"training loss is {loss_value} at step {step}")
                    synchronize(device)
                    dt = time.time() - window_start
                    timed_steps, timed_seconds = timed_steps + window_steps, timed_seconds + dt
                    ms = 1000 * dt / window_steps
                    tok_s = tokens_per_step * window_steps / dt
                    lr = learning_rate(step - 1, cfg)  # the step just taken's
                    # the row first: the line may find its reader gone (`| head`: BrokenPipeError), the step done
                    run.log(step=step, loss=loss_value, lr=lr, ms_per_step=ms, tokens_per_s=tok_s)
                    mfu = f" | MFU {100 * flops_per_token * tok_s / (peak * world):.1f}%" if peak else ""
                    eta = (last_step - step) * timed_seconds / timed_steps  # at the mean pace of the session so far
                    say(f"step {step}/{cfg.max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | {ms:.0f} ms/step | "
                        f"{tok_s:,.0f} tok/s{mfu} | ETA {runs.format_eta(eta)}")
                    window_start, window_steps = time.time(), 0

            if step % cfg.eval_interval == 0 or step == cfg.max_steps:
                metrics = evaluate_and_save(step)
                synchronize(device)
                window_start, window_steps = time.time(), 0
    except KeyboardInterrupt as e:
        run.interrupted(e, step)  # a checkpoint of the last whole step, and exit 128 + the signal
    except BrokenPipeError:  # what reads the output closed it (`| head`): a checkpoint as for a signal, then exit 141
        run.output_closed(step)
        raise
    except OSError as e:  # the output cannot be written (`> log`, its disk full): a checkpoint as for a signal, a line
        if not (what := output_failed(e)):
            raise
        run.output_closed(step)
        raise run.unwritten(what) from None
    except FloatingPointError as e:
        run.diverged(e)  # exit 1; the last checkpoint, which was good, stays
    except RuntimeError as e:  # torchrun: another process is gone (killed, say), and a collective failed mid-step
        if not (ddp and (why := lost_peer(e))):
            raise
        run.lost_peer(why, step)  # a checkpoint of the last whole step, which every process holds; exit 1

    if step != cfg.max_steps:
        run.save(step)
        say(f"stopped after step {step} (--stop-at); continue with --resume")
    else:
        task = {"task": cfg.task} if cfg.task else {}  # the arithmetic regime, as the config holds it
        pruned = None if mask is None else pruned_total(raw_model, mask)[0]
        run.finish(dict(router=cfg.router, preset=cfg.preset, data=cfg.data, **task, seed=cfg.seed,
                        parameters=counts, steps=step, tokens_seen=step * tokens_per_step, **metrics,
                        router_pruned=pruned,
                        tokens_per_s=tokens_per_step * timed_steps / max(timed_seconds, 1e-9),
                        peak_memory_bytes=peak_memory(device), device=device, world_size=world,
                        sessions=run.sessions(), config=asdict(cfg)))
        say(f"done: {run.out_dir / 'summary.json'}: {show_metrics(metrics)}")
    if ddp:
        dist.barrier()  # let rank 0 finish writing before the group goes away
        dist.destroy_process_group()
    return metrics


def main(argv=None):
    return runs.main("train.py", argv, TrainConfig, PRESETS, train, training_data, __doc__)


if __name__ == "__main__":
    main()
