"""
What the scripts share: one-line errors, the device, peak FLOPs for MFU, checkpoints, top-p
pruning of router weights, and the evaluation that train.py runs and sample.py repeats.

The imports form two floors: lime.py (the model, with kernels.py) and prepare_data.py (the
data) at the bottom, this file above them, and train.py, sample.py, bench.py and analyze.py
side by side on top. No script imports another.
"""

import argparse
import math
import re
import statistics
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import prepare_data
from lime import GPT, GPTConfig, parse_router

MODEL_FIELDS = list(GPTConfig.__dataclass_fields__)
RUN_FILES = ["ckpt.pt", "log.jsonl", "summary.json"]  # a folder with any of these holds a run
PRUNABLE = ("lime", "last", "first")  # router modes with learned static weights: what top-p pruning applies to


class UsageError(ValueError):
    """Bad input: printed as one line, exit code 2, nothing written."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input, not argparse's usage block
        raise UsageError(message)


def fail(script, message, code):
    """One line on stderr, then exit. The codes, as in every script here: 2 for bad usage
    (argparse's convention), 1 for a failure at run time, 128 + the signal for an interruption."""
    print(f"{script}: {message}", file=sys.stderr)
    sys.exit(code)


@contextmanager
def one_line_errors(script):
    """Bad usage, a data problem or Ctrl-C inside ends the script with one line and its exit code."""
    try:
        yield
    except UsageError as e:
        fail(script, f"error: {e}", 2)
    except prepare_data.DataError as e:
        fail(script, f"error: {e}", 1)
    except KeyboardInterrupt:
        fail(script, "interrupted", 130)


def pick_device(name):
    """auto: cuda, then mps, then cpu. A device this machine does not have is a UsageError."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    m = re.fullmatch(r"cpu|mps|cuda(?::(\d+))?", name)
    if m is None:
        raise UsageError(f"--device={name!r}: choose from auto, cpu, cuda, cuda:N, mps")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device={name}: " + ("this torch is a CPU-only build" if torch.version.cuda is None
                                                   else "no CUDA device is visible"))
    if m[1] and int(m[1]) >= torch.cuda.device_count():
        raise UsageError(f"--device={name}: there are {torch.cuda.device_count()} CUDA devices, numbered from 0")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device=mps: MPS is not available on this machine")
    return name


def autocast_for(device, dtype=None):
    """bf16 autocast if dtype is "bfloat16" (by default on CUDA, as training there uses); else full precision."""
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()


def synchronize(device):
    """Wait for the device, so that a timer read next sees finished work (a CPU never lags)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# dense bf16 peak of known accelerators, by a fragment of torch.cuda.get_device_name(); others show no MFU
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12)]


def peak_flops(device, dtype):
    """Dense bf16 peak FLOP/s of a known CUDA device; None (no MFU shown) for anything else."""
    if not device.startswith("cuda") or dtype != "bfloat16":
        return None
    return next((f for key, f in PEAK_FLOPS if key in torch.cuda.get_device_name(device)), None)


# -----------------------------------------------------------------------------
# Checkpoints: the uncompiled model's state_dict with the run's whole config, and the
# router mask of a pruned model (None if unpruned)


def save_checkpoint(out_dir, model, optimizer, step, cfg, router_mask=None):
    optimizer = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    ckpt = dict(model=model.state_dict(), optimizer=optimizer, step=step, config=cfg, router_mask=router_mask)
    prepare_data.atomic_write(Path(out_dir) / "ckpt.pt", lambda f: torch.save(ckpt, f))


def run_files(out_dir):
    """The files in out_dir that make it hold a run (empty if none)."""
    return [name for name in RUN_FILES if (Path(out_dir) / name).exists()]


def clear_run(out_dir):
    """--overwrite: the old run's files go, so that nothing in the folder describes it any more."""
    for name in (*RUN_FILES, "config.json", "prune.json", "routes.png", "entropy.png", "probe.png", "prune.png"):
        (Path(out_dir) / name).unlink(missing_ok=True)


def read_checkpoint(out_dir):
    """<out-dir>/ckpt.pt as a dict; a UsageError if it is missing or unreadable."""
    path = Path(out_dir) / "ckpt.pt"
    if not path.exists():
        raise UsageError(f"no checkpoint at {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UsageError(f"cannot read {path}: {str(e).splitlines()[0]}") from None


def model_from(ckpt, out_dir):
    """The model of a checkpoint read from out_dir, rebuilt from its config, on the CPU."""
    try:
        model = GPT(GPTConfig(**{k: ckpt["config"][k] for k in MODEL_FIELDS}))
        model.load_state_dict(ckpt["model"])
    except Exception as e:  # a file of the right format with the wrong contents
        raise UsageError(f"cannot read {Path(out_dir) / 'ckpt.pt'}: {str(e).splitlines()[0]}") from None
    return model


def load_checkpoint(out_dir, device):
    """A run's config and its model, rebuilt from that config, in eval mode on `device`."""
    ckpt = read_checkpoint(out_dir)
    return ckpt["config"], model_from(ckpt, out_dir).to(device).eval()


# -----------------------------------------------------------------------------
# Top-p pruning of router weights (the paper's first version, its Table 5)


def top_p_mask(weight, p):
    """What top-p pruning keeps of one router: a bool mask of weight's shape, True = kept.
    weight (n_kv, n_src, n_kv): target head, source layer, source head.

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


def prunable_weights(model):
    """{parameter name: weight} of the routers top-p pruning applies to: the learned static ones
    (lime, last-J, first-J; layer 0's fixed identity is no parameter). A UsageError otherwise."""
    mode = parse_router(model.config.router)[0]
    if mode not in PRUNABLE:
        raise UsageError(f"top-p pruning needs a learned static router (lime, last-J or first-J), "
                         f"not router={model.config.router!r}")
    return {name: p for name, p in model.named_parameters() if name.endswith("router.weight")}


@torch.no_grad()
def prune_routers(model, p, mask=None):
    """Zero the router weights that top-p pruning drops; returns the mask {parameter name: bool
    tensor, True = kept}. With an earlier `mask`, what it dropped stays dropped."""
    new = {}
    for name, w in prunable_weights(model).items():
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


def pruned_counts(mask):
    """{layer: (pruned, total)} over the masked router weights, in layer order."""
    counts = {}
    for name, keep in mask.items():
        layer = int(re.search(r"\.h\.(\d+)\.", name)[1])
        counts[layer] = (int((~keep).sum()), keep.numel())
    return dict(sorted(counts.items()))


# -----------------------------------------------------------------------------
# Evaluation: the same fixed validation set for every run, so router modes compare exactly


@torch.no_grad()
def evaluate_loss(model, data, micro_batch_size, device, autocast, rank=0, world=1):
    """Mean cross-entropy over the fixed validation set (summed over processes)."""
    total = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of losses, number of tokens)
    for x, y in data.val_batches(micro_batch_size, rank, world):
        x, y = x.to(device), y.to(device)
        with autocast:
            logits = model(x)[0]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1,
                                                 reduction="sum")
        total += torch.stack([loss.double(), (y != -1).sum().double()])
    if world > 1:
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


@torch.no_grad()
def greedy_accuracy(model, items, judge, stop, max_new_tokens, device, batch_size=256, rank=0, world=1):
    """Share of items (prompt ids, reference) for which judge(generated ids, reference) holds. The
    generation is greedy and open-ended: it ends at the `stop` token (cut off before judging) or after
    max_new_tokens. Prompts of equal length share a batch, so the KV cache needs no padding."""
    by_length = {}
    for prompt, reference in items[rank::world]:
        by_length.setdefault(len(prompt), []).append((prompt, reference))
    correct = torch.zeros(2, device=device)  # (right answers, items)
    for length, group in by_length.items():
        n_new = min(max_new_tokens, model.config.block_size - length)
        for i in range(0, len(group), batch_size):
            chunk = group[i: i + batch_size]
            idx = torch.tensor([ids for ids, _ in chunk], device=device)  # (len(chunk), length)
            out = model.generate(idx, n_new, temperature=0, stop=stop)
            for row, (_, reference) in zip(out[:, length:].tolist(), chunk):
                correct[0] += bool(judge(row[: row.index(stop)] if stop in row else row, reference))
            correct[1] += len(chunk)
    if world > 1:
        dist.all_reduce(correct)
    return (correct[0] / correct[1].clamp(min=1)).item()


def arithmetic_accuracy(model, data, lines, device, rank=0, world=1):
    """Share of expressions whose greedy, open-ended solution (or answer) ends in the right answer."""
    vocab = data.vocab
    items = [(vocab.encode(prompt), answer) for prompt, answer in map(prepare_data.split_sample, lines)]
    return greedy_accuracy(model, items, lambda ids, answer: prepare_data.final_answer(vocab.decode(ids)) == answer,
                           vocab.eos, data.max_new_tokens, device, rank=rank, world=world)


def prosqa_accuracy(model, data, device, rank=0, world=1):
    """Share of test questions whose greedy completion ends in the right answer (prepare_data.prosqa_correct)."""
    enc = prepare_data.gpt2_encoding()
    return greedy_accuracy(model, data.tests,
                           lambda ids, answer: prepare_data.prosqa_correct(prepare_data.decode_tokens(enc, ids), answer),
                           data.pad, data.max_new_tokens, device, rank=rank, world=world)


def evaluate(model, raw_model, data, cfg, device, autocast, rank=0, world=1, final=True):
    """Validation loss and perplexity, plus accuracy: per tier on the arithmetic task (val_acc_4, ...
    on the validation split; acc_4, acc_5, acc_6 on the test split), on the test questions of ProsQA
    (acc). A run looks at its validation split at every evaluation and at its test split only at the
    end (`final`), so the test is not what it is steered by (a folder without a validation split,
    made before there was one, reports the test every time). `model` may be compiled or wrapped;
    generation runs on the plain `raw_model`."""
    model.eval()
    # NOTE a DDP forward syncs buffers across processes, so one process with no validation batch (fewer rows
    # than processes x micro-batch) would hang the rest: evaluate through the module it wraps
    plain = model.module if isinstance(model, DistributedDataParallel) else model
    loss = evaluate_loss(plain, data, cfg["micro_batch_size"], device, autocast, rank, world)
    out = dict(val_loss=loss, val_ppl=math.exp(min(loss, 50)))
    if isinstance(data, prepare_data.ArithmeticData):
        splits = [("val_", data.vals)] if data.vals else []
        splits += [("", data.tests)] if final or not data.vals else []
        for prefix, split in splits:
            for n, lines in split.items():
                with autocast:
                    out[f"{prefix}acc_{n}"] = arithmetic_accuracy(raw_model, data, lines, device, rank, world)
    if isinstance(data, prepare_data.ProsQAData):
        with autocast:
            out["acc"] = prosqa_accuracy(raw_model, data, device, rank=rank, world=world)
    model.train()
    return out


# -----------------------------------------------------------------------------
# Tables of finished runs (their summary.json): analyze.py table and grid.py print them


def relative_change(value, base):
    return f"{100 * (value - base) / base:+.2f}%" if base else "n/a"  # nothing is relative to 0


def results_table(summaries, split="test"):
    """Markdown. Runs of one regime and router that differ only in their seed form one row: the metric's
    mean ± sample standard deviation over them. The metric: accuracy per tier on arithmetic (in %, on the
    test or the validation split), acc on ProsQA, perplexity on language. With one run per row, Table 7's
    layout instead: the metric and its change relative to the `lime` run."""
    prefix = "val_" if split == "val" else ""
    acc = re.compile(rf"{prefix}acc_(\d+)")
    tiers = set.intersection(*({int(m[1]) for k in s if (m := acc.fullmatch(k))} for s in summaries))
    metrics = [f"{prefix}acc_{n}" for n in sorted(tiers)] or \
        (["acc"] if all("acc" in s for s in summaries) else ["val_ppl"])
    if split == "val" and not metrics[0].startswith("val_acc"):
        raise UsageError("--split val: these runs have no validation accuracy (arithmetic data made before "
                         "the validation split existed, or not arithmetic)")
    rows = {}
    for s in summaries:
        task = s.get("task")
        regime = f"{prepare_data.ArithmeticTask.from_meta(task).name}, {task['count']}" if task else ""
        # runs that differ in anything but the seed are not averaged: not in preset, length or tiers
        rows.setdefault((regime, s["router"], s.get("preset"), s.get("steps")), []).append(s)
    if all(len(runs) == 1 for runs in rows.values()) and len({key[0] for key in rows}) == 1:
        return single_run_table(summaries, metrics)
    accuracy = metrics[0] != "val_ppl"
    scale = 100 if accuracy else 1  # accuracies in %
    head = ["regime", "router", "seeds", *(m.replace("val_", "val ") for m in metrics)]
    head += ["lime ahead, last tier (pts)"] if accuracy else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    digits = 1 if accuracy else 3
    means = {key: [statistics.mean(scale * s[m] for s in runs) for m in metrics] for key, runs in rows.items()}
    for (regime, router, *rest), runs in rows.items():
        mean = means[regime, router, *rest]
        cells = [regime, router, str(len(runs))]
        for m, mu in zip(metrics, mean):
            sd = f" ± {statistics.stdev(scale * s[m] for s in runs):.{digits}f}" if len(runs) > 1 else ""
            cells.append(f"{mu:.{digits}f}{sd}")
        lime = means.get((regime, "lime", *rest))
        if accuracy:
            cells.append("-" if lime is None or router == "lime" else f"{lime[-1] - mean[-1]:+.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def single_run_table(summaries, metrics):
    base = next((s for s in summaries if s["router"] == "lime"), None)
    head = ["router", *(m.replace("val_ppl", "perplexity") for m in metrics)]
    if base:
        head += [f"change to lime ({m})" for m in metrics]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        cells = [s["router"], *(f"{s[m]:.4f}" for m in metrics)]
        if base:
            cells += ["-" if s is base else relative_change(s[m], base[m]) for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
