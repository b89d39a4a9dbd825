"""
What a trained LIMe learned, as the paper's figures, for your own runs.

    python analyze.py routes  --out-dir out/150m-lime                 # router heatmap (Figure 5)
    python analyze.py entropy --out-dir out/150m-lime out/150m-none   # value entropy per layer (Figure 2a)
    python analyze.py probe   --out-dir out/150m-lime                 # is/are/was/were probe (Figures 2b, 7b)
    python analyze.py table   out/150m-*                               # the ablation table (Table 7)
    python analyze.py table   out/grid/*/*                             # accuracy per tier, mean ± sd over seeds
    python analyze.py curves  out/grid/*/*                             # validation accuracy and loss against step
    python analyze.py prune   --out-dir out/deep-lime --top-p 0.9      # top-p pruning of the routers (v1, Table 5)

Each command prints a table; with matplotlib installed, routes, entropy, probe and prune also save
a PNG next to the (first) checkpoint, and curves one in the folder that holds the runs. "Values" are
what each layer's attention reads: the routed values in LIMe, the layer's own values in the baseline
(--values own: each layer's own, what its W_V computes, in every model).
"""

# cli first: from then on a Ctrl-C is one line, even while torch (seconds to load) is still loading
from cli import (DEVICES, POSITIVE, DataError, Parser, UsageError, a_path, atomic_write, autocast_for, folder_problem,
                 holding, is_accuracy, one_line_errors, pick_device, same_folder, show_value)

import json
import os
import re
import sys
from pathlib import Path

import torch

import runs
import tables
from data import evaluate
from pruning import prunable_routers, prune_routers, pruned_counts, pruned_total

PROBE_WORDS = {" is": 318, " are": 389, " was": 373, " were": 547}  # their GPT-2 token ids


def load(out_dir, args):
    """A checkpoint's config and model (on the CPU), reading data from --data-dir if given."""
    return runs.load_checkpoint(out_dir, "cpu", getattr(args, "data_dir", None))


def pyplot():
    """matplotlib's pyplot, drawing to files; None (and a line on how to get it) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no picture: `pip install matplotlib` to get one)")
        return None
    return plt


def write_png(plt, fig, path):
    fig.tight_layout()
    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
        print(f"saved {path}")
    except DataError as e:  # the table is printed already: a picture that cannot be written costs no traceback
        print(f"(no picture: {e})")
    plt.close(fig)


def save_plot(path, curves, xlabel, ylabel, title, image=None):
    """Line plot of {label: ys} per layer (or a heatmap of `image`), if matplotlib is there."""
    plt = pyplot()
    if plt is None:
        return
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4.5))
    if image is not None:
        im = ax.imshow(image, cmap="viridis", origin="lower")
        fig.colorbar(im, ax=ax)
    for label, ys in curves.items():
        ax.plot(range(len(ys)), ys, marker="o", label=label)
    if curves:
        ax.legend()
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    if image is not None:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    write_png(plt, fig, path)


# -----------------------------------------------------------------------------
# routes: Figure 5


def route_map(model):
    """(L, L): row l = mean |R^(l)| per source layer (over target and source heads), summing to 1."""
    L = model.config.n_layer
    M = torch.zeros(L, L)
    for l, R in enumerate(model.routing_weights()):  # R (n_kv, l + 1, n_kv)
        row = R.abs().float().mean(dim=(0, 2)).cpu()
        M[l, : l + 1] = row / row.sum()
    return M


def sources_read(model):
    """(L, L) bools: whether layer l reads source layer j (its router's sources; its own layer alone without one)."""
    L = model.config.n_layer
    read = torch.zeros(L, L, dtype=torch.bool)
    for l, block in enumerate(model.transformer.h):
        read[l, block.attn.router.sources if block.attn.router is not None else [l]] = True
    return read


def print_layer_map(M):
    """An (L, L) map of shares as whole percentages, row = layer, column = source layer; NaN shows as '.'."""
    print("      " + "".join(f"{j:>4}" for j in range(len(M))))
    for l, row in enumerate(M.tolist()):
        print(f"{l:>4}: " + "".join("   ." if v != v else f"{100 * v:4.0f}" for v in row))


def cmd_routes(args):
    cfg, model = load(args.out_dir[0], args)
    if not model.routers and cfg.router != "none":
        raise UsageError(f"--router={cfg.router} works on the residual stream and routes no K/V: there is no map")
    M = route_map(model)
    image = M.masked_fill(~sources_read(model), float("nan"))  # a source the layer does not read (a later one): blank
    note = " (the values; the keys are each layer's own)" * any(not r.keys for r in model.routers)
    note += " (the weights' part that is the same at every token)" * any(r.per_token for r in model.routers)
    print(f"router {cfg.router}{note}: row = layer, column = source layer: its share of the row's mean |weight|, in %")
    print_layer_map(image)
    save_plot(Path(args.out_dir[0]) / "routes.png", {}, "source layer", "layer",
              f"routing weights ({cfg.router}){note}", image=image.numpy())
    return M


# -----------------------------------------------------------------------------
# Activations: the values each layer attends over, and the hidden states


def sequences(cfg, n, seq_len):
    """The first n validation sequences: fixed windows for language, unpadded samples for a task."""
    return runs.load_data(cfg, with_train=False).val_sequences(n, seq_len)


@torch.no_grad()
def activations(model, idx, routed=True):
    """For one sequence idx (T,): per layer, values (T, n_kv*head_dim) and hidden states (T, C).
    The values are the routed ones, built from every layer's own K/V by lime.route_reference (routed=False: each
    layer's own, the output of its value projection, as the paper's Section 5.2 words it)."""
    own, inputs, hidden = [], [], []  # per layer: own K/V (T, n_kv, 2*hd), attention input (1, T, C), output
    hd = model.config.n_embd // model.config.n_head

    def keep_kv(module, args, out):  # (a hook that returns something would replace the output)
        inputs.append(args[0])
        own.append(out[0].view(out.shape[1], -1, 2 * hd))

    hooks = []
    for block in model.transformer.h:
        hooks.append(block.attn.c_kv.register_forward_hook(keep_kv))
        # the stream after the block, as the final norm would read it (the sum of Hyper-Connections' streams)
        hooks.append(block.register_forward_hook(lambda m, i, out: hidden.append(model.residual.end(out)[0])))
    try:
        model(idx[None])
    finally:
        for h in hooks:
            h.remove()
    values = []
    for block, kv, x in zip(model.transformer.h, own, inputs):
        router = block.attn.router
        if router is not None and routed:  # (1, T, n_kv, 2*hd) in, the same out
            kv = router.reference([own[j][None] for j in router.sources], x)[0]
        values.append(kv[..., hd:].flatten(1))  # (T, n_kv*hd)
    return values, hidden


def distinct_labels(runs_):
    """A label for each (router, run folder): the router alone where no other run has it, else with as much of the
    folder's path as tells it from the others of its router (out/grid/int-steps/lime-seed1 beside out/grid/mod-steps/
    lime-seed1: 'lime (int-steps/lime-seed1)')."""
    labels = []
    for router, folder in runs_:
        others = [Path(f).resolve().parts for r, f in runs_ if r == router]
        parts = Path(folder).resolve().parts
        if len(others) == 1:
            labels.append(router)
            continue
        n = next((n for n in range(1, len(parts) + 1) if [o[-n:] for o in others].count(parts[-n:]) == 1), len(parts))
        labels.append(f"{router} ({'/'.join(parts[-n:])})")
    return labels


def renyi_entropy(Z, alpha=1.0, standardise=True):
    """Matrix-based Renyi entropy of the tokens' representations Z (T, d): features standardised over the tokens
    (with standardise=False, the paper's K = Z Z^T as it writes it), Gram matrix over tokens, eigenvalues
    normalised by the trace. From 0 (rank 1) up to log(T - 1) standardised (centring the features over the tokens
    takes away one dimension), log(T) plain."""
    Z = Z.double()
    if standardise:  # (else a feature of large scale, or a large mean shared by all tokens, decides the spectrum)
        Z = (Z - Z.mean(0)) / Z.std(0).clamp(min=1e-8)
    p = torch.linalg.eigvalsh(Z @ Z.T).clamp(min=0)
    p = p / p.sum()
    p = p[p > 0]
    if abs(alpha - 1) < 1e-6:  # the limit alpha -> 1: von Neumann entropy
        return float(-(p * p.log()).sum())
    # log sum p^alpha as a logsumexp: p**alpha itself underflows to 0 at a large alpha (log 0: an entropy of inf)
    return float(torch.logsumexp(alpha * p.log(), 0) / (1 - alpha))


def cmd_entropy(args):
    args.out_dir = list({Path(d).resolve(): d for d in args.out_dir}.values())  # (a run given twice: one column)
    loaded = [load(out_dir, args) for out_dir in args.out_dir]
    # NOTE the entropy of T tokens grows with T (at most log(T - 1)), and a language run's windows are at most its
    # block_size: every run is measured over as many tokens, the fewest any of them holds
    seq_len = min(args.seq_len, *(cfg.block_size for cfg, _ in loaded))
    runs_, counts, tokens, data = [], set(), set(), {}
    for out_dir, (cfg, model) in zip(args.out_dir, loaded):
        seqs = sequences(cfg, args.num_seqs, seq_len)
        per_seq = [activations(model, x, args.values == "routed") for x in seqs]
        counts.add(len(per_seq))
        tokens.update(len(x) for x in seqs)
        data[f"{cfg.router} ({out_dir})"] = runs.seed_group(vars(cfg))[0] or cfg.data  # (a regime's label)
        runs_.append((cfg.router, out_dir, [
            [sum(renyi_entropy(acts[k][l], args.alpha, args.gram == "standardised") for acts in per_seq) / len(per_seq)
             for l in range(cfg.n_layer)]
            for k in (0, 1)]))  # values, hidden
    curves = {}
    for label, (_, _, (values, hidden)) in zip(distinct_labels([(r, d) for r, d, _ in runs_]), runs_):
        curves[f"{label} values"], curves[f"{label} hidden"] = values, hidden
    long = f"{min(tokens)} to {max(tokens)}" if len(tokens) > 1 else f"{min(tokens, default=0)}"
    print(f"matrix-based Renyi entropy (alpha {args.alpha}, {args.gram} features, {args.values} values) in nats, "
          f"mean over {' or '.join(map(str, sorted(counts)))} sequences of {long} tokens")
    if seq_len < args.seq_len and len(args.out_dir) > 1 and len({cfg.block_size for cfg, _ in loaded}) > 1:
        print(f"NOTE --seq-len={args.seq_len}: {seq_len} tokens for every run, the shortest block_size among them")
    width = 2 + max(14, *map(len, curves))  # a column per curve, as wide as its name and a space or two
    print("layer " + "".join(f"{name:>{width}}" for name in curves))
    for l in range(max(len(c) for c in curves.values())):
        print(f"{l:>5} " + "".join(f"{c[l]:{width}.3f}" if l < len(c) else " " * width for c in curves.values()))
    if len(set(data.values())) > 1:  # each run's entropies are over its own data's sequences
        print("NOTE the runs read different data, so their columns compare representations of other text: " +
              "; ".join(f"{run} {what}" for run, what in data.items()))
    save_plot(Path(args.out_dir[0]) / "entropy.png", curves, "layer", f"Renyi entropy (alpha {args.alpha}), nats",
              "representation entropy per layer")
    return curves


# -----------------------------------------------------------------------------
# probe: Figures 2b (values) and 7b (hidden states)


def linear_probe(X, y, n_classes, folds=5, steps=200, seed=0):
    """The accuracy on each of k folds (mean, sample sd over the folds) of a multinomial logistic regression (L-BFGS)
    on X (N, d), trained on the other folds."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(y), generator=g)
    X, y = X[order].double(), y[order]
    accs = []
    for k in range(folds):
        test = torch.zeros(len(y), dtype=torch.bool)
        test[k * len(y) // folds: (k + 1) * len(y) // folds] = True
        mean, std = X[~test].mean(0), X[~test].std(0).clamp(min=1e-8)
        Xtr, Xte = (X[~test] - mean) / std, (X[test] - mean) / std
        W = torch.zeros(X.shape[1], n_classes, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(n_classes, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([W, b], max_iter=steps, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(Xtr @ W + b, y[~test]) + 1e-3 * W.pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        accs.append(((Xte @ W + b).argmax(1) == y[test]).double().mean().item())
    return tables.mean_sd(accs)


def cmd_probe(args):
    """Figures 2b and 7b: how well a linear classifier tells is/are/was/were apart from each layer's values and
    hidden states at those words, as the paper does it: as many occurrences of each word (it takes 1668 of each),
    5-fold cross-validation, the mean and sd over the folds."""
    cfg, model = load(args.out_dir[0], args)
    if cfg.data == "arithmetic":
        raise UsageError("this is an arithmetic checkpoint; its task vocabulary has no ' is', ' are', "
                         "' was', ' were'")
    ids = torch.tensor(list(PROBE_WORDS.values()))
    feats, labels = {kind: [[] for _ in range(cfg.n_layer)] for kind in ("values", "hidden")}, []
    seqs = sequences(cfg, args.num_seqs + 1, args.seq_len)  # fewer where the validation set ends first; one more
    more, seqs = len(seqs) > args.num_seqs, seqs[:args.num_seqs]  # says whether a larger --num-seqs would find more
    for x in seqs:
        where = torch.isin(x, ids).nonzero().flatten()
        if len(where):
            for kind, acts in zip(feats, activations(model, x, args.values == "routed")):  # per layer (T, d)
                for l, a in enumerate(acts):
                    feats[kind][l].append(a[where])
            labels.append((x[where, None] == ids).long().argmax(1))
    y = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(y, minlength=4).tolist()
    print(f"occurrences in {len(seqs)} validation sequences: " + ", ".join(
        f"{w!r} {c}" for w, c in zip(PROBE_WORDS, counts)))
    if min(counts) < 5:
        raise UsageError("too few occurrences of each word for 5-fold cross-validation: " +
                         ("raise --num-seqs" if more else f"the run's validation set has only {len(seqs)} sequences"))
    # as many of each word, drawn at random (seed 0): chance is 1/4, not the most frequent word's share
    g = torch.Generator().manual_seed(0)
    kept = torch.cat([(y == k).nonzero().flatten()[torch.randperm(counts[k], generator=g)[:min(counts)]]
                      for k in range(4)])
    accs = {kind: [linear_probe(torch.cat(f)[kept], y[kept], 4) for f in per_layer]
            for kind, per_layer in feats.items()}
    print(f"5-fold linear probe accuracy ({cfg.router}, {args.values} values), mean ± sd over the folds: "
          f"{min(counts)} of each word, chance 0.250")
    print("layer " + "".join(f"{kind:>18}" for kind in accs))
    for l in range(cfg.n_layer):
        print(f"{l:>5} " + "".join(f"{mu:>10.3f} ± {sd:.3f}" for mu, sd in (accs["values"][l], accs["hidden"][l])))
    save_plot(Path(args.out_dir[0]) / "probe.png", {f"{cfg.router} {kind}": [mu for mu, _ in a]
                                                   for kind, a in accs.items()},
              "layer", "probe accuracy", "is / are / was / were from values and hidden states")
    return accs


# -----------------------------------------------------------------------------
# table: Table 7, or accuracy per tier over seeds (made by tables.results_table)


def run_folders(paths):
    """The run folders among `paths`, each once (a folder given twice is still one run). A file is left out
    with a line saying so: a glob over the runs (out/quick/*) also finds the curves.png saved beside them."""
    paths = list(dict.fromkeys(Path(p).resolve() for p in paths))
    if missing := [d for d in paths if not d.exists()]:  # (a typo: not "no .../summary.json (is the run finished?)")
        raise UsageError(f"no such folder: {missing[0]}")
    folders, files = [d for d in paths if not d.is_file()], [d for d in paths if d.is_file()]
    if not folders:
        raise UsageError(f"no run folder among the paths given ({files[0]} is a file)")
    if files:  # one line for them all: a glob over runs whose logs sit beside them (out/depth/*.out) finds many
        more = f" and {len(files) - 2} more" if len(files) > 3 else ""
        what = "files, not run folders" if len(files) > 1 else "a file, not a run folder"
        print(f"left out {', '.join(map(str, files[:2] if more else files))}{more}: {what}",
              file=sys.stderr)  # (not into a table sent to a file)
    # (a grid's run in its first seconds: its train.out, and none of a run's files yet; not a finished one whose
    # config.json is lost, which a table would leave out without a word)
    starting = [d for d in folders if (d / "train.out").exists() and
                not any((d / name).exists() for name in runs.RUN_FILES)]
    if starting == folders:  # (a grid's runs in their first seconds, before train.py has written anything)
        raise UsageError(f"no run among the paths given has started: {starting[0]} holds a grid's train.out alone")
    for d in starting:
        print(f"left out {d}: a run of grid.py not started yet", file=sys.stderr)
    folders = [d for d in folders if d not in starting]
    for d in folders:  # a folder of runs (out/grid/<regime>, from out/grid/*): not "no .../summary.json"
        if not (d / "config.json").exists() and any(d.glob("*/config.json")):
            raise UsageError(f"{d} holds run folders, not a run: give the runs in it ({d / '*'}; for a glob, one "
                             f"level deeper: {d.parent / '*' / '*'})")
    return folders


def cmd_table(args):
    summaries = []
    for d in run_folders(args.run_dirs):
        summaries.append(runs.read_summary(d))
        if (d / "config.json").exists():  # (else a summary.json copied in from another run: a row named as this one)
            runs.agree(d, runs.read_record(d / "config.json", config=True), summaries[-1])
    table = tables.results_table(summaries, args.split)
    print(table)
    return table


# -----------------------------------------------------------------------------
# curves: validation accuracy and loss against step, mean and spread over seeds


def eval_rows(run_dir):
    """A run's config.json and the evaluations its log.jsonl holds (finished or not)."""
    config = runs.read_record(run_dir / "config.json", config=True)
    summary = runs.summary_if_whole(run_dir)  # a finished run's: its config is config.json's, its steps the log's
    runs.agree(run_dir, config, summary)  # (else a curve named as the other run)
    if not (run_dir / "log.jsonl").exists():
        raise DataError(f"no {run_dir / 'log.jsonl'}: not a run folder, or a run not started yet")
    rows, notice = runs.read_log(run_dir / "log.jsonl")
    if notice:
        print(notice)
    rows = [r for r in rows if "val_loss" in r]
    if not rows and (run_dir / "summary.json").exists():  # (not a run yet to evaluate, left out of the curves)
        raise DataError(f"{run_dir / 'log.jsonl'} holds no evaluation, but the run has finished (summary.json): "
                        "its log is damaged")
    ended = summary.get("steps")  # (a finished run evaluates its last step: a curve cut short draws no run's end)
    if rows and ended is not None and rows[-1]["step"] < ended:
        raise DataError(f"{run_dir / 'log.jsonl'}: its last evaluation is of step {rows[-1]['step']}, before the end "
                        f"of the finished run (step {ended}, its summary.json): its log is cut short")
    for r in rows:  # (each one's metrics read_log has checked)
        if gap := runs.tier_gap(r, config.get("task")):
            raise DataError(f"{run_dir / 'log.jsonl'}, step {r['step']}: {gap}")
        if runs.of_kind(config.get("max_steps"), int) and r["step"] > config["max_steps"]:
            raise DataError(f"{run_dir / 'log.jsonl'}, step {r['step']}: past the run's last step (config.json's "
                            f"max_steps {config['max_steps']}): a row of another run, or copied")
    return config, rows


def cmd_curves(args):
    """{label: {metric: [(step, mean, sd, seeds)]}}: one curve per setting (tables.by_setting), the mean and
    the sample standard deviation over its seeds, at every step that all of its runs have evaluated (a run yet to
    evaluate is left out, with a line that says so)."""
    if args.rows < 1:
        raise UsageError(f"--rows must be positive, got {args.rows}")
    if args.out and Path(args.out).suffix.lower() != ".png":  # never a PNG written over notes.md
        raise UsageError(f"--out={args.out}: the picture is a PNG: give a path ending in .png")
    if args.out and Path(args.out).exists() and not Path(args.out).is_file():  # (before the work, not after it)
        raise UsageError(f"--out={args.out} is a folder, not a file: give the picture's own path")
    if args.out and (problem := folder_problem(Path(args.out).parent)):  # (a file where its folder goes, say)
        raise UsageError(f"--out={args.out}: {problem}")
    folders = run_folders(args.run_dirs)
    read = {d: eval_rows(d) for d in folders}
    evaluated = [d for d in folders if read[d][1]]  # the others stopped, or are still training, before their first
    if not evaluated:
        raise DataError(f"no evaluation yet in {', '.join(map(str, folders))}")
    for d in folders:
        if d not in evaluated:  # (a grid watched as it runs: the curves of the runs that have one)
            print(f"left out {d}: no evaluation yet", file=sys.stderr)
    configs, logs = zip(*map(read.get, evaluated))
    groups = tables.by_setting(configs, logs)  # {setting: each seed's evaluations}
    tiers = [{int(k.removeprefix("val_acc_")) for r in rows for k in r if re.fullmatch(r"val_acc_\d+", k)}
             for seeds in groups.values() for rows in seeds]
    if not args.metric and any(tiers) and not set.intersection(*tiers):
        raise UsageError("these runs share no tier of validation accuracy: give --metric (val_loss, say)")
    metric = args.metric or (f"val_acc_{max(set.intersection(*tiers))}" if any(tiers) else "val_loss")  # hardest
    if metric == "step":
        raise UsageError("--metric step: that is the curves' x axis; give a value the log holds (val_loss, say)")
    for d in evaluated:  # (read_log holds a val_* value to a number; a fork's other key may hold anything: a null,
        # where it was not measured, draws nothing at that step)
        if fault := next((r for r in read[d][1] if r.get(metric) is not None and not runs.of_kind(r[metric], float)),
                         None):
            raise DataError(f"{d / 'log.jsonl'}, step {fault['step']}: {metric} is not a number ({fault[metric]!r}), "
                            "so it draws no curve: give another --metric")
    metrics = list(dict.fromkeys([metric, "val_loss"]))
    curves = {}
    for (regime, router, preset, steps, (_, apart)), seeds in groups.items():
        label = ", ".join(str(x) for x in (router, regime, preset and f"preset {preset}", f"{steps} steps", apart) if x)
        # each seed's evaluations with the metric, by step (a step logged twice: its row with the metric)
        at = [{r["step"]: r for r in rows if r.get(metric) is not None} for rows in seeds]
        common = sorted(set.intersection(*map(set, at)))
        if not common:
            raise DataError(f"{label}: no evaluation with {metric} in all of its {len(seeds)} run(s)")
        curves[label] = {m: [(step, *tables.mean_sd([a[step][m] for a in at]), len(at)) for step in common]
                         for m in metrics}
    for i, (label, c) in enumerate(curves.items()):
        print(f"[{i}] {label}: {c[metric][0][3]} seed(s)")
    over = "one seed each" if all(c[metric][0][3] == 1 for c in curves.values()) else "mean ± sd over the seeds"
    for m in metrics:
        scale, digits = (100, 1) if is_accuracy(m) else (1, 4)  # accuracy in %
        print(f"{m}{' (%)' if scale > 1 else ''}, {over}:")
        steps = sorted({step for c in curves.values() for step, *_ in c[m]})
        every = -(-len(steps) // args.rows)  # at most about --rows rows; the last step always
        print(f"{'step':>8}" + "".join(f"{f'[{i}]':>18}" for i in range(len(curves))))
        for j, step in enumerate(steps):
            if j % every == 0 or j == len(steps) - 1:
                at = [{s: (mu, sd, n) for s, mu, sd, n in c[m]}.get(step) for c in curves.values()]
                cells = [f"{scale * v[0]:.{digits}f}" + f" ± {scale * v[1]:.{digits}f}" * (v[2] > 1) if v else "-"
                         for v in at]  # (no ± over a single seed)
                print(f"{step:>8}" + "".join(f"{cell:>18}" for cell in cells))
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.5), squeeze=False)
        for ax, m in zip(axes[0], metrics):
            scale = 100 if is_accuracy(m) else 1
            for label, c in curves.items():
                steps, mu, sd = (torch.tensor(col, dtype=torch.float64) for col in list(zip(*c[m]))[:3])
                ax.plot(steps, scale * mu, label=f"{label} ({c[m][0][3]} seeds)")
                ax.fill_between(steps, scale * (mu - sd), scale * (mu + sd), alpha=0.2)  # ± 1 sd
            ax.set(xlabel="step", ylabel=m + (" (%)" if scale > 1 else ""), title=f"{m}, mean ± sd over seeds")
        axes[0][0].legend(fontsize=7)
        folder = Path(os.path.commonpath(folders))  # of all the runs
        folder = Path.cwd() if folder == Path(folder.anchor) else folder  # (runs in unrelated trees: not in /)
        write_png(plt, fig, Path(args.out) if args.out else folder / "curves.png")
    return curves


# -----------------------------------------------------------------------------
# prune: top-p pruning of the routers (the paper's first version, Table 5)


def survival_map(model, mask):
    """(L, L): cell (l, j) = the share of layer l's router weights from source layer j that pruning
    kept; NaN where layer l has no learned weight from layer j (a later layer, one outside its window,
    or any at layer 0, whose router is a fixed identity)."""
    L = model.config.n_layer
    M = torch.full((L, L), float("nan"))
    for name, router in prunable_routers(model).items():
        for i, j in enumerate(router.sources):  # mask[name]: (n_kv, n_src, n_kv) or (n_kv, n_src)
            M[router.layer, j] = mask[name][:, i].float().mean().item()
    return M


def from_itself(model, mask):
    """(pruned, total) of the router weights from the layer's own K/V, its last source: the identity at a fresh
    lime's start (GPT.init_weights), so its weights across heads start at exactly 0, mostly stay small, and are what
    top-p takes first. The rest are the weights from earlier layers."""
    pruned = total = 0
    for name in prunable_routers(model):
        own = mask[name][:, -1]  # (n_kv, n_kv) or (n_kv,): the router's weights of its own layer
        pruned, total = pruned + int((~own).sum()), total + own.numel()
    return pruned, total


def cmd_prune(args):
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    save = args.save and Path(args.save)
    if save:  # everything that can refuse the command, before any work
        if same_folder(save, args.out_dir):
            raise UsageError("--save names the run being pruned: give a new folder")
        problem = folder_problem(save)
        if problem:
            raise UsageError(f"--save={save}: {problem}")
        if runs.run_files(save) and not args.overwrite:
            raise UsageError(f"--save={save} already holds a run ({', '.join(runs.run_files(save))}): "
                             "give another folder, or --overwrite to replace it")
        seen = runs.folder_state(save)  # what was checked: compared again once the folder is held
    device = pick_device(args.device)
    ckpt = runs.read_checkpoint(args.out_dir)
    cfg = runs.saved_config(ckpt, args.out_dir, args.data_dir)
    model = runs.model_from(ckpt, args.out_dir).to(device).eval()
    runs.check_of_folder(ckpt, args.out_dir)
    prunable_routers(model)  # a router with nothing to prune is refused before the evaluation
    moments = runs.moments(ckpt).values() if save else ()  # (--save copies them as they are: --resume would refuse it)
    if not all(t.isfinite().all() for t in moments if t.is_floating_point()):
        raise DataError(f"{Path(args.out_dir) / 'ckpt.pt'} is damaged: its optimiser state holds a value that is not "
                        "finite, which --save would copy into the pruned model")
    data, autocast = runs.load_data(cfg, with_train=False), autocast_for(device)
    print(f"evaluating {args.out_dir} on {device}, as it is and then pruned ...", flush=True)  # (two evaluations)
    before = evaluate(model, model, data, cfg.micro_batch_size, device, autocast)
    old = runs.pruning_mask(ckpt, model, Path(args.out_dir) / "ckpt.pt")  # a run pruned already: what it dropped
    already = pruned_total(model, old)[0] if old is not None else 0
    mask = prune_routers(model, args.top_p, old)
    after = evaluate(model, model, data, cfg.micro_batch_size, device, autocast)

    counts = pruned_counts(model, mask)
    pruned, total = pruned_total(model, mask)
    print(f"top-p {args.top_p} pruning of the {cfg.router} routers in {args.out_dir}: pruned weights per layer")
    for layer, (n, of) in counts.items():
        print(f"layer {layer:>3}: {n:>8,} of {of:>8,} ({100 * n / of:5.1f}%)")
    print(f"all:       {pruned:>8,} of {total:>8,} ({100 * pruned / total:5.1f}%)")
    # NOTE a share of all the weights counts the layer's own, most of them 0 at the start: no sign of what it reads
    own, of_own = from_itself(model, mask)
    print(f"of them, from the layer itself (the identity at a fresh lime's start): {own:,} of {of_own:,}; from earlier "
          f"layers: {pruned - own:,} of {total - of_own:,} ({100 * (pruned - own) / max(total - of_own, 1):.1f}%)")
    if already:  # NOTE then neither the counts nor the first column are of the top-p above alone
        print(f"NOTE {args.out_dir} was pruned already ({already:,} of {total:,} weights): the counts above include "
              f"those, and 'as saved' is that pruned model")
    print(f"{'metric':<10} {'as saved' if already else 'unpruned':>10} {'pruned':>10}")
    for key in before:
        print(f"{key:<10} {show_value(key, before[key]):>10} {show_value(key, after[key]):>10}")
    M = survival_map(model, mask)
    print("kept, % of the router weights: row = layer, column = source layer ('.': no learned weight)")
    print_layer_map(M)
    save_plot(Path(args.out_dir) / "prune.png", {}, "source layer", "layer",
              f"router weights kept at top-p {args.top_p}", image=M.numpy())
    report = dict(source=str(args.out_dir), top_p=args.top_p, pruned=pruned, weights=total, already_pruned=already,
                  from_itself=dict(pruned=own, weights=of_own),
                  per_layer={layer: dict(pruned=n, weights=of) for layer, (n, of) in counts.items()},
                  unpruned_metrics=before, pruned_metrics=after)
    if save:  # a checkpoint like train.py's, with the mask that keeps these weights at zero in further training
        with holding(save, "a train.py training there? wait for it to end, or give another folder"):
            runs.refuse_changed(save, seen, "while this one pruned")  # (a prune --save of its own, or a run)
            runs.clear_run(save)
            config = {**ckpt["config"], "data_dir": cfg.data_dir, "out_dir": str(save),  # (its setting: tables.py)
                      "prunings": [*(ckpt["config"].get("prunings") or []), dict(top_p=args.top_p, step=ckpt["step"])]}
            try:  # the checkpoint first and prune.json last: killed in between (kill -9), what is there is a model
                runs.save_checkpoint(save, model, ckpt["optimizer"], ckpt["step"], config, mask)
                atomic_write(save / "config.json", lambda f: f.write(json.dumps(config, indent=2).encode()))
                atomic_write(save / "prune.json", lambda f: f.write(json.dumps(report, indent=2).encode()))
            except BaseException:  # (a full disk, Ctrl-C) no part of a pruned model: the same command goes again
                runs.clear_run(save)
                raise
        print(f"saved the pruned checkpoint in {save}")
    return dict(report, survival=M)


def main(argv=None):
    p = Parser(description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)  # subcommands share Parser's one-line errors
    for name, help_text in (("routes", "router heatmap per layer and source layer"),
                            ("entropy", "Renyi entropy of values and hidden states per layer"),
                            ("probe", "linear probe of is/are/was/were from values and hidden states, per layer")):
        s = sub.add_parser(name, help=help_text)  # each with the flags it reads: no flag is ignored
        if name == "entropy":
            s.add_argument("--out-dir", nargs="+", type=a_path, required=True,
                           help="run folder(s) holding ckpt.pt (several: one curve each)")
        else:
            s.add_argument("--out-dir", nargs=1, type=a_path, required=True, help="run folder holding ckpt.pt")
        if name == "routes":
            continue  # the routers' own weights: no data
        s.add_argument("--data-dir", **runs.DATA_DIR)
        s.add_argument("--num-seqs", type=int, default=64, help="validation sequences to use")
        s.add_argument("--seq-len", type=int, default=256, help="tokens per language sequence (at least 2)")
        s.add_argument("--values", choices=("routed", "own"), default="routed",
                       help="the values each layer's attention reads (routed from earlier layers' in LIMe), or each "
                            "layer's own, its W_V's output (the same in a model that routes nothing)")
        if name == "entropy":
            s.add_argument("--alpha", type=float, default=1.0, help="Renyi entropy order, > 0 (1: von Neumann)")
            s.add_argument("--gram", choices=("standardised", "plain"), default="standardised",
                           help="the Gram matrix of the features standardised over the tokens, or plain: "
                                "K = Z Z^T, as the paper's equation writes it")
    t = sub.add_parser("table", help="the ablation table from finished runs' summary.json, as Markdown")
    t.add_argument("run_dirs", nargs="+", type=a_path,
                   help="run folders; runs that differ only in their seed are averaged")
    t.add_argument("--split", choices=["test", "val"], default="test",
                   help="arithmetic: accuracy on the test split, or on the validation split (for choosing settings)")
    c = sub.add_parser("curves", help="validation accuracy and loss against step, mean ± sd over seeds, from "
                                      "runs' log.jsonl (finished or not)")
    c.add_argument("run_dirs", nargs="+", type=a_path,
                   help="run folders; runs that differ only in their seed make one curve")
    c.add_argument("--metric", help="what to plot beside val_loss: a key of the log's evaluations, e.g. val_acc_4 "
                                    "(default: the validation accuracy of the hardest tier, where there is one)")
    c.add_argument("--rows", type=int, default=20, help="at most about this many steps in the printed table")
    c.add_argument("--out", type=a_path, help="where to save the PNG (default: curves.png in the folder holding all "
                                                 "the runs, or here if only / holds them all)")
    s = sub.add_parser("prune", help="top-p pruning of the router weights: what it removes and what it costs")
    s.add_argument("--out-dir", type=a_path, required=True, help="run folder holding ckpt.pt")
    s.add_argument("--top-p", type=float, default=0.9,
                   help="per target head, keep the smallest set of weights holding this share of its |weight|, "
                        "in (0, 1] (the paper's first version: 0.9)")
    s.add_argument("--save", metavar="NEWDIR", type=a_path, help="write the pruned checkpoint there (a new folder), "
                                                                  "for sample.py or train.py --init-from / --resume")
    s.add_argument("--overwrite", action="store_true", help="let --save replace a run already in NEWDIR")
    s.add_argument("--device", default="auto", help=f"where to evaluate: {DEVICES}")
    s.add_argument("--data-dir", **runs.DATA_DIR)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # a command left out: the error names them, as the usage does
    with one_line_errors("analyze.py"):
        args = p.parse_args(argv)
        if args.command in ("table", "curves", "prune"):
            return {"table": cmd_table, "curves": cmd_curves, "prune": cmd_prune}[args.command](args)
        num_seqs, seq_len, alpha = (getattr(args, k, d) for k, d in (("num_seqs", 1), ("seq_len", 2), ("alpha", 1)))
        for bad, message in ((num_seqs < 1, f"--num-seqs must be positive, got {num_seqs}"),
                             (seq_len < 2, f"--seq-len must be at least 2, got {seq_len}"),
                             (not POSITIVE[1](alpha), f"--alpha must be > 0 and finite, got {alpha}")):
            if bad:
                raise UsageError(message)
        return {"routes": cmd_routes, "entropy": cmd_entropy, "probe": cmd_probe}[args.command](args)


if __name__ == "__main__":
    main()
