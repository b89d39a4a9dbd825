"""The paper's analyses for a run (analyze.py): router maps, entropy, the probe, tables (tables.py), pruning."""

import dataclasses
import json
import math
import os
import re
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

import analyze
import arithmetic
import cli
import runs
import sample
import tables
import train
from conftest import edit_settings, error_of, methods_where, perturbed, small_model, snapshot, tiny_args, tokens
from data import write_shard

@pytest.mark.parametrize("mode", ["none", "lime", "first-2"])
def test_route_map_rows_sum_to_one(mode):
    M = analyze.route_map(small_model(mode))
    torch.testing.assert_close(M.sum(1), torch.ones(6))
    assert torch.all(M.triu(1) == 0)
    if mode == "none":
        assert torch.equal(M, torch.eye(6))
    if mode == "first-2":
        assert torch.all(M[5, 2:5] == 0) and torch.all(M[5, [0, 1, 5]] > 0)
    read = analyze.sources_read(small_model(mode))  # what `routes` shows; '.' elsewhere, not a learned 0
    assert read.tolist() == (M > 0).tolist()
    assert read[5].tolist() == [mode != "none"] * 2 + [mode == "lime"] * 3 + [True]


def test_routes_command(arith_run, capsys):
    M = analyze.main(["routes", "--out-dir", str(arith_run)])
    torch.testing.assert_close(M.sum(1), torch.ones(2))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "router lime: row = layer, column = source layer: its share of the row's mean |weight|, in %"
    # whole percentages: layer 0 reads itself alone (100), not layer 1 ('.'); layer 1's two shares make 100
    assert out[1:3] == ["         0   1", "   0:  100   ."]
    shares = [int(v) for v in re.fullmatch(r"   1: ( *\d+)( *\d+)", out[3]).groups()]
    assert shares == [round(100 * v) for v in M[1].tolist()] and 99 <= sum(shares) <= 101


@pytest.mark.parametrize("mode, note", [("value-residual", "the values; the keys are each layer's own"),
                                         ("dynamic", "the weights' part that is the same at every token")])
def test_routes_say_what_the_map_leaves_out(mode, note, tmp_path, answer_dir, capsys):
    run = tmp_path / mode
    train.main(tiny_args(answer_dir, run, f"--router={mode}", "--max-steps=2"))
    capsys.readouterr()
    analyze.main(["routes", "--out-dir", str(run)])
    assert f"router {mode} ({note}): row = layer" in capsys.readouterr().out


def test_activations_are_the_values_each_layer_reads_routed():
    """What entropy and probe read at a layer: the values its attention reads, routed from the layers' own. Keys of
    zero, and every router reading layer 0's heads alone: each layer's values are layer 0's own, not zero."""
    model = small_model("lime")
    n_kv, hd = model.config.n_kv_head, model.config.n_embd // model.config.n_head
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_kv.weight.view(n_kv, 2 * hd, -1)[:, :hd] = 0  # each head's keys, then its values
        for router in analyze.prunable_routers(model).values():  # (the learned ones: layers 1 and up)
            router.weight.zero_()[:, 0] = torch.eye(n_kv)  # head h of layer 0 into head h
    values, hidden = analyze.activations(model, tokens(1, 16)[0])
    assert len(values) == len(hidden) == 6 and values[0].shape == (16, n_kv * hd) and values[0].abs().min() > 0
    for v in values[1:]:
        torch.testing.assert_close(v, values[0])
    # routed=False: each layer's own values, what its value projection makes of its input (ln_1 of the stream)
    own, same = analyze.activations(model, tokens(1, 16)[0], routed=False)
    inputs = []
    hooks = [block.attn.register_forward_hook(lambda m, args, out: inputs.append(args[0][0])) for block in
             model.transformer.h]
    with torch.no_grad():
        model(tokens(1, 16))
    for h in hooks:
        h.remove()
    for block, v, x in zip(model.transformer.h, own, inputs):
        W = block.attn.c_kv.weight.view(n_kv, 2, hd, -1)[:, 1].reshape(n_kv * hd, -1)  # each head's value rows
        torch.testing.assert_close(v, x @ W.T)
    assert torch.equal(own[0], values[0]) and not torch.allclose(own[1], values[1]) and all(map(torch.equal, same,
                                                                                                    hidden))


@pytest.mark.parametrize("mode", methods_where())
def test_activations_are_the_values_each_layer_attends_over(mode, monkeypatch):
    """For every method, the values entropy and probe read at a layer are those its attention reads: routed by the
    router's reference, whatever its kind (per token, values alone), a method of the stream's own values as they are.
    Every weight moved (perturbed): no path that starts at zero hides a source read wrong."""
    model, idx = perturbed(small_model(mode), 0.1), tokens(1, 16)[0]
    values, _ = analyze.activations(model, idx)
    read, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: read.append(v) or sdpa(q, k, v, **kw))
    with torch.no_grad():
        model(idx[None])
    assert len(read) == len(values) == 6
    for v, attended in zip(values, read):  # attended (1, n_kv, T, hd) -> (T, n_kv * hd)
        torch.testing.assert_close(v, attended[0].transpose(0, 1).flatten(1), rtol=1e-5, atol=1e-6)


def test_survival_map_puts_each_source_in_its_column():
    """A router that reads some layers (first-2: layers 0 and 1 and its own): what pruning kept of each source's
    weights in that layer's column, NaN where there is no learned weight (layer 0, a source not read)."""
    model = small_model("first-2")
    mask = {}
    for name, router in analyze.prunable_routers(model).items():
        mask[name] = torch.zeros(router.weight.shape, dtype=torch.bool)
        mask[name][:, -1] = True  # its own layer's weights, all kept
        mask[name][0, 0, 0] = True  # one of the 4 of layer 0's
    expected = torch.full((6, 6), math.nan)
    for layer in range(1, 6):
        expected[layer, [0, 1, layer]] = torch.tensor([0.25, 0.0, 1.0])
    torch.testing.assert_close(analyze.survival_map(model, mask), expected, equal_nan=True)


def test_from_itself_counts_the_weights_of_the_layers_own_k_v_alone():
    """What prune reports of the weights it removed that a layer reads from its own K/V (its last source), apart
    from those it reads from earlier layers."""
    model = small_model("lime")
    routers = analyze.prunable_routers(model)
    mask = {name: torch.ones(router.weight.shape, dtype=torch.bool) for name, router in routers.items()}
    first, second = list(mask)[:2]  # layers 1 and 2: sources [0, 1] and [0, 1, 2]
    mask[first][0, -1, 1] = mask[first][1, -1, 0] = False  # two of layer 1's weights of its own K/V
    mask[second][1, 0, 0] = False  # one of layer 2's from layer 0
    n_kv = model.config.n_kv_head
    assert analyze.from_itself(model, mask) == (2, len(routers) * n_kv * n_kv)


def test_renyi_entropy_extremes():
    g = torch.Generator().manual_seed(0)
    T = 32
    rank1 = torch.randn(T, 1, generator=g) @ torch.randn(1, 64, generator=g)
    isotropic = torch.randn(T, 8192, generator=g)
    for alpha in (1.0, 2.0):
        assert abs(analyze.renyi_entropy(rank1, alpha)) < 1e-6
        # centring over tokens leaves T - 1 dimensions: the maximum is log(T - 1)
        assert 0.995 * math.log(T - 1) < analyze.renyi_entropy(isotropic, alpha) <= math.log(T - 1) + 1e-9
    # a large order: not p**alpha, which underflows to 0 (an entropy of inf), and no more than at a smaller order
    assert 0 < analyze.renyi_entropy(isotropic, 1e4) <= analyze.renyi_entropy(isotropic, 1e3) <= \
        analyze.renyi_entropy(isotropic, 2.0)
    # the features are standardised: a feature's scale or offset (one in kilometres, one in metres) changes nothing
    Z = torch.randn(T, 6, generator=g, dtype=torch.float64)  # (in float32, + 1.0 to 1e-3 Z loses 4 digits)
    rescaled = Z * torch.tensor([1e3, 1e-3, 1.0, 50.0, 0.2, 7.0]) + torch.arange(6.0)
    for alpha in (1.0, 2.0):
        assert analyze.renyi_entropy(rescaled, alpha) == pytest.approx(analyze.renyi_entropy(Z, alpha), rel=1e-6)
    # plain (--gram plain): the paper's equation as written, K = Z Z^T, S = log(sum (l_i / tr K)^alpha) / (1 - alpha)
    lam = np.linalg.eigvalsh(rescaled.numpy() @ rescaled.numpy().T).clip(min=0)
    lam = lam[lam > 0] / lam.sum()
    assert analyze.renyi_entropy(rescaled, 2.0, standardise=False) == pytest.approx(-np.log((lam ** 2).sum()), rel=1e-9)
    assert analyze.renyi_entropy(rescaled, 1.0, standardise=False) == pytest.approx(-(lam * np.log(lam)).sum(),
                                                                                   rel=1e-9)
    # no centring: an isotropic cloud reaches log(T), and the kilometres feature decides the spectrum
    assert math.log(T - 1) < analyze.renyi_entropy(isotropic, standardise=False) <= math.log(T) + 1e-9
    assert analyze.renyi_entropy(rescaled, standardise=False) < 0.5 * analyze.renyi_entropy(Z, standardise=False)


def test_entropy_command_two_runs(arith_run, tmp_path, arith_dir, answer_dir, capsys, monkeypatch):
    base = tmp_path / "none"
    train.main(tiny_args(arith_dir, base, "--router=none", "--max-steps=2"))
    curves = analyze.main(["entropy", "--out-dir", str(arith_run), str(base), "--num-seqs", "4"])
    assert set(curves) == {"lime values", "lime hidden", "none values", "none hidden"}
    assert all(len(c) == 2 and all(0 <= v <= math.log(64) for v in c) for c in curves.values())
    out = capsys.readouterr().out
    assert "matrix-based Renyi entropy (alpha 1.0, standardised features, routed values) in nats" in out and \
        "NOTE" not in out  # (one data set)
    plain = analyze.main(["entropy", "--out-dir", str(arith_run), "--num-seqs", "4", "--gram", "plain"])
    assert "(alpha 1.0, plain features, routed values)" in capsys.readouterr().out and \
        plain["lime values"] != curves["lime values"]
    # each layer's own values: layer 0 routes nothing, layer 1 reads layer 0's too; the hidden states are the same
    own = analyze.main(["entropy", "--out-dir", str(arith_run), str(base), "--num-seqs", "4", "--values", "own"])
    assert "(alpha 1.0, standardised features, own values)" in capsys.readouterr().out
    assert own["lime values"][0] == curves["lime values"][0] and own["lime values"][1] != curves["lime values"][1]
    routed_alike = {k: v for k, v in curves.items() if k != "lime values"}
    assert {k: v for k, v in own.items() if k != "lime values"} == routed_alike
    assert torch.equal(analyze.main(["routes", "--out-dir", str(base)]), torch.eye(2))  # no router: each its own layer
    sequences = analyze.sequences  # a validation set of 3: fewer sequences than asked for
    monkeypatch.setattr(analyze, "sequences", lambda cfg, n, seq_len: sequences(cfg, min(n, 3), seq_len))
    cfg, model = runs.load_checkpoint(base, "cpu")
    acts = [analyze.activations(model, x) for x in analyze.sequences(cfg, 8, 256)]
    capsys.readouterr()
    curves = analyze.main(["entropy", "--out-dir", str(base), "--num-seqs", "8"])
    assert "mean over 3 sequences" in capsys.readouterr().out and len(acts) == 3
    for k, kind in enumerate(("values", "hidden")):  # per layer, the mean over the sequences there are
        assert curves[f"none {kind}"] == pytest.approx([sum(analyze.renyi_entropy(a[k][l]) for a in acts) / len(acts)
                                                        for l in range(2)])
    again = tmp_path / "again"  # two runs of one router: each keeps its curves, named by its folder
    shutil.copytree(arith_run, again)
    both = analyze.main(["entropy", "--out-dir", str(arith_run), str(again), "--num-seqs", "2"])
    assert set(both) == {f"lime ({name}) {kind}" for name in (arith_run.name, "again") for kind in ("values", "hidden")}
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("layer"))
    assert re.split(" {2,}", header) == ["layer", *both]  # long names too, each in its column
    assert both[f"lime ({arith_run.name}) values"] == both["lime (again) values"]  # the same weights
    other = tmp_path / "other"  # a run of another regime: its entropies are over other sequences, and it says so
    train.main(tiny_args(answer_dir, other, "--max-steps=1"))
    capsys.readouterr()
    analyze.main(["entropy", "--out-dir", str(arith_run), str(other), "--num-seqs", "2"])
    assert capsys.readouterr().out.splitlines()[-2] == (
        f"NOTE the runs read different data, so their columns compare representations of other text: lime "
        f"({arith_run}) int-steps, tiers 4,5,6 operands; lime ({other}) mod11-answer, tiers 2,3 operators")


def test_entropy_keeps_runs_of_one_name_and_measures_every_run_over_as_many_tokens(arith_run, language_run, tmp_path,
                                                                                    capsys):
    """Two runs of one router in folders of one name (a grid's out/grid/<regime>/lime-seed1): each keeps its curves,
    named by as much of its path as tells them apart; before, the second took the first's place without a word.
    Runs of other block sizes are measured over as many tokens, the fewest any holds, and the header says how many:
    the entropy of T tokens grows with T, and a run's windows are at most its block_size."""
    for regime in ("x", "y"):
        shutil.copytree(arith_run, tmp_path / regime / "run")
    curves = analyze.main(["entropy", "--out-dir", str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run"),
                           "--num-seqs", "2"])
    assert set(curves) == {f"lime ({regime}/run) {kind}" for regime in "xy" for kind in ("values", "hidden")}
    longer = tmp_path / "b64"  # the same model, said to take windows of 64 tokens (RoPE is computed: any length)
    shutil.copytree(language_run, longer)
    edit_settings(longer, block_size=64)
    capsys.readouterr()
    analyze.main(["entropy", "--out-dir", str(language_run), str(longer), "--num-seqs", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("mean over 2 sequences of 32 tokens")
    assert "NOTE --seq-len=256: 32 tokens for every run, the shortest block_size among them" in out


def test_linear_probe_separates_what_is_separable():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 4
    X = torch.randn(200, 16, generator=g) * 0.3
    X[torch.arange(200), y] += 3.0  # class k lights up feature k
    assert analyze.linear_probe(X, y, 4)[0] > 0.95
    noise = torch.randn(200, 16, generator=g)
    assert analyze.linear_probe(noise, y, 4)[0] < 0.45  # chance is 0.25
    # no feature to go by: each fold predicts its training folds' majority, right for the four 0s and wrong for
    # the 1 (whichever fold holds it, its training folds are all 0s): 1, 1, 1, 1 and 0 over the 5 folds
    assert analyze.linear_probe(torch.zeros(5, 3), torch.tensor([0, 0, 0, 0, 1]), 2) == \
        pytest.approx((0.8, statistics.stdev([1, 1, 1, 1, 0])))


def test_probe_command(arith_run, tmp_path, capsys, monkeypatch):
    assert "arithmetic checkpoint; its task vocabulary has no ' is'" in error_of(
        analyze.main, ["probe", "--out-dir", str(arith_run)], capsys)
    folder, out = tmp_path / "data", tmp_path / "run"
    g = np.random.default_rng(0)
    words = list(analyze.PROBE_WORDS.values())
    tokens = np.where(g.random(20000) < 0.2, g.choice(words, 20000), g.integers(0, 300, 20000))
    write_shard(folder / "w_train_000000.bin", tokens)
    write_shard(folder / "w_val_000000.bin", tokens[:4000])
    train.main(["--preset=tiny", "--data=shakespeare", f"--data-dir={folder}", f"--out-dir={out}", "--vocab-size=576",
                "--block-size=64", "--n-layer=2", "--n-embd=32", "--n-head=2", "--n-kv-head=2", "--batch-size=4",
                "--micro-batch-size=4", "--max-steps=2", "--eval-interval=2", "--eval-tokens=256"])
    capsys.readouterr()
    accs = analyze.main(["probe", "--out-dir", str(out), "--num-seqs", "8", "--seq-len", "64"])
    assert set(accs) == {"values", "hidden"} and all(len(a) == 2 and all(0 <= mu <= 1 and sd >= 0 for mu, sd in a)
                                                     for a in accs.values())
    # --eval-tokens=256 holds 4 windows of 64: what the probe used, not the 8 asked for
    assert capsys.readouterr().out.startswith("occurrences in 4 validation sequences: ' is' ")
    def windows(*counts):  # two windows of 64 tokens, none a probe word but the counts of each, in that order
        x = torch.tensor(g.integers(0, 300, 128))
        x[g.choice(128, sum(counts), replace=False)] = torch.tensor(words).repeat_interleave(torch.tensor(counts))
        return lambda cfg, n, seq_len: list(x.view(2, 64))[:n]

    monkeypatch.setattr(analyze, "sequences", windows(5, 5, 5, 4))  # 5 folds need 5 of each word
    assert error_of(analyze.main, ["probe", "--out-dir", str(out)], capsys).endswith(
        "too few occurrences of each word for 5-fold cross-validation: the run's validation set has only 2 sequences")
    monkeypatch.setattr(analyze, "sequences", windows(5, 6, 5, 5))
    probed = []  # what each probe is given: as many of each word (5), as the paper (1668 of each)
    monkeypatch.setattr(analyze, "linear_probe", lambda X, y, n: probed.append(torch.bincount(y).tolist()) or (1, 0))
    assert len(analyze.main(["probe", "--out-dir", str(out)])["hidden"]) == 2
    assert probed == [[5, 5, 5, 5]] * 4  # (2 layers, values and hidden states)
    assert capsys.readouterr().out.splitlines()[:3] == [
        "occurrences in 2 validation sequences: ' is' 5, ' are' 6, ' was' 5, ' were' 5",
        "5-fold linear probe accuracy (lime, routed values), mean ± sd over the folds: 5 of each word, chance 0.250",
        "layer " + " " * 12 + "values" + " " * 12 + "hidden"]
    monkeypatch.undo()
    monkeypatch.setitem(analyze.PROBE_WORDS, " were", 575)  # a word that never occurs: more windows would not help
    too_few = "analyze.py: error: too few occurrences of each word for 5-fold cross-validation: "
    for n in (8, 4):
        assert error_of(analyze.main, ["probe", "--out-dir", str(out), "--num-seqs", str(n)], capsys) == \
            too_few + "the run's validation set has only 4 sequences"
    assert error_of(analyze.main, ["probe", "--out-dir", str(out), "--num-seqs", "3"], capsys) == \
        too_few + "raise --num-seqs"


def test_ablation_table(tmp_path, capsys):
    table7 = {"none": 16.4611, "first-4": 15.9586, "lime": 15.9267}  # the paper's Table 7
    dirs = []
    for router, ppl in table7.items():
        d = tmp_path / router
        d.mkdir()
        (d / "summary.json").write_text(json.dumps(dict(router=router, val_ppl=ppl)))
        dirs.append(str(d))
    table = analyze.main(["table", *dirs])
    assert "| none | 16.4611 | +3.36% |" in table and "| first-4 | 15.9586 | +0.20% |" in table
    assert "| lime | 15.9267 | - |" in table
    assert table.startswith("| router | perplexity | change to lime (perplexity) |")
    assert re.match("analyze.py: error: no .*summary.json", error_of(analyze.main, ["table", str(tmp_path)], capsys,
                                                                      code=1))
    assert error_of(analyze.main, ["table", "--split", "val", *dirs], capsys) == (
        "analyze.py: error: --split val: these runs have no validation accuracy (arithmetic data made before the "
        "validation split existed, or not arithmetic)")  # not a table of perplexities, said to be the val split's
    with pytest.raises(cli.DataError, match=re.escape("these runs' summaries have no metric in common (accuracy per "
                                                      "tier, acc or val_ppl)")):
        tables.results_table([dict(router="none", val_ppl=16.4), dict(router="lime", acc=0.5)])
    # an acc in some summaries alone: the perplexity every run has, not a refusal
    assert tables.results_table([dict(router="none", val_ppl=16.4, acc=0.5), dict(router="lime", val_ppl=16.0)]) == \
        "| router | perplexity | change to lime (perplexity) |\n|---|---|---|\n| none | 16.4000 | +2.50% |\n" \
        "| lime | 16.0000 | - |"
    # runs whose summaries name no seed (older ones) are not taken for one seed twice: their mean and spread
    assert tables.results_table([dict(router="lime", val_ppl=2.0), dict(router="lime", val_ppl=4.0)]).endswith(
        "| lime | 2 | 3.000 ± 1.414 |")
    # a val loss in some summaries alone: its column is left out, and a line says why (it left without a word)
    full, lacking = dict(router="none", acc_4=0.25, val_loss=0.5), dict(router="lime", acc_4=0.5)
    assert tables.results_table([full, lacking]).startswith("| router | acc_4 | change to lime (acc_4) |") and \
        tables.results_table([full, lacking]).endswith("\n\nNOTE no val loss column: 1 of these 2 runs' summaries "
                                                      "have none")
    assert "NOTE" not in tables.results_table([full, dict(lacking, val_loss=0.25)])


def test_table_averages_over_seeds(tmp_path, capsys):
    dirs = []
    for regime, field in (("mod", "mod"), ("int", "int")):
        task = dataclasses.asdict(arithmetic.Task(field=field, count="operators", target="answer"))
        for router, accs in (("lime", (0.50, 0.60, 0.70)), ("none", (0.20, 0.30, 0.40))):
            for seed, acc in enumerate(accs):
                d = tmp_path / regime / f"{router}-{seed}"
                d.mkdir(parents=True)
                summary = dict(router=router, task=task, seed=seed, acc_4=0.9, acc_5=0.8, acc_6=acc, val_acc_4=0.9,
                               val_acc_5=0.8, val_acc_6=acc - 0.1,
                               val_loss=(0.2 if router == "lime" else 0.5) + seed / 10)
                (d / "summary.json").write_text(json.dumps(summary))
                dirs.append(str(d))
    table = analyze.main(["table", *dirs])
    head = "| regime | router | seeds | val loss | acc_4 | acc_5 | acc_6 | lime ahead, last tier (pts) |"
    assert table.splitlines()[0] == head and len(table.splitlines()) == 6  # no NOTE: the regime is a column
    mod, int_ = "| mod11-answer, tiers 4,5,6 operators |", "| int-answer, tiers 4,5,6 operators |"
    lime = "lime | 3 | 0.300 ± 0.100 | 90.0 ± 0.0 | 80.0 ± 0.0 | 60.0 ± 10.0 | - |"
    none = "none | 3 | 0.600 ± 0.100 | 90.0 ± 0.0 | 80.0 ± 0.0 | 30.0 ± 10.0 | +30.0 |"
    # rows in the order of the runs given (a grid's: regime by regime, the routers as --routers names them)
    assert table.splitlines()[2:] == [f"{mod} {lime}", f"{mod} {none}", f"{int_} {lime}", f"{int_} {none}"]
    val = analyze.main(["table", "--split", "val", *dirs])
    twice = analyze.main(["table", *dirs[:3], *dirs[:3]])  # a run given twice is one run
    assert "| mod11-answer, tiers 4,5,6 operators | lime | 3 |" in twice and "| 6 |" not in twice
    shutil.copytree(dirs[0], tmp_path / "copy")  # a copy of a run is not one more seed (curves: the same)
    assert error_of(analyze.main, ["table", *dirs[:3], str(tmp_path / "copy")], capsys) == (
        "analyze.py: error: two of these runs are seed 0 of router lime, mod11-answer, tiers 4,5,6 operators: "
        "a mean over seeds takes each seed once")
    lang = []
    for preset, router, ppl in (("150m", "lime", 15.9), ("deep", "lime", 14.0), ("150m", "none", 16.4)):
        lang.append(tmp_path / f"{preset}-{router}")
        lang[-1].mkdir()
        (lang[-1] / "summary.json").write_text(json.dumps(dict(router=router, preset=preset, steps=6000, val_ppl=ppl)))
    table = analyze.main(["table", *map(str, lang)])  # other presets are not seeds of one run: Table 7's layout
    assert table.startswith("| router | perplexity |") and len(table.splitlines()) == 7
    assert table.splitlines()[2:5] == ["| lime (preset 150m) | 15.9000 | - |",  # two rows of lime: named apart,
                                       "| lime (preset deep) | 14.0000 | - |",  # each the lime of its own preset
                                       "| none | 16.4000 | +3.14% |"]
    assert table.endswith("\n\nNOTE the rows differ in more than their router: preset "
                          "(lime 150m, lime deep, none 150m)")
    assert f"{int_} lime | 3 | 0.300 ± 0.100 | 90.0 ± 0.0 | 80.0 ± 0.0 | 50.0 ± 10.0 | - |" in val


def test_runs_that_differ_in_more_than_their_seed_are_rows_apart(tmp_path, capsys):
    """A row (or a curve) is a mean over the seeds of one setting: runs of one router whose configs differ in lr or
    depth are rows apart, each named by what sets it apart (a depth ablation in one table), never averaged; where and
    how each ran (out_dir, device, ...) may differ within a row."""
    dirs = []
    for seed, (lr, n_layer) in enumerate([(1e-3, 4), (1e-3, 4), (1e-5, 4), (1e-3, 6)]):
        how = {k: f"{k} of run {seed}" for k in runs.NOT_THE_SETTING - {"seed"}}  # each of them may differ
        config = dict(router="lime", preset="tiny", seed=seed, max_steps=10, lr=lr, n_layer=n_layer, **how)
        d = tmp_path / f"run{seed}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        (d / "log.jsonl").write_text(json.dumps(dict(step=10, val_loss=1.0 + seed)) + "\n")
        summary = dict(router="lime", preset="tiny", seed=seed, steps=10, val_ppl=2.0 + seed, config=config)
        (d / "summary.json").write_text(json.dumps(summary))
        dirs.append(str(d))
    assert "| lime | 2 | 2.500 ± 0.707 |" in analyze.main(["table", *dirs[:2]])
    table = analyze.main(["table", *dirs[:3]])
    assert "| lime (lr 0.001) | 2 | 2.500 ± 0.707 |" in table and "| lime (lr 1e-05) | 1 | 4.000 |" in table
    assert "NOTE" not in table  # (what sets the rows apart is in their names)
    curves = analyze.main(["curves", *dirs[:2], dirs[3]])
    assert {label: c["val_loss"] for label, c in curves.items()} == {
        "lime, preset tiny, 10 steps, n_layer 4": [(10, 1.5, pytest.approx(0.5 ** 0.5), 2)],
        "lime, preset tiny, 10 steps, n_layer 6": [(10, 4.0, 0.0, 1)]}
    table = analyze.main(["table", dirs[2], dirs[3]])  # one run a row: Table 7's layout, each named by both fields
    assert [line.split(" | ")[0] for line in table.splitlines()[2:4]] == ["| lime (lr 1e-05, n_layer 4)",
                                                                       "| lime (lr 0.001, n_layer 6)"]
    scratch = tmp_path / "scratch"  # seed 0 again, from scratch: each seed of a fine-tune starts from its own run,
    shutil.copytree(dirs[0], scratch)  # but a seed trained from scratch is another setting
    summary = json.loads((scratch / "summary.json").read_text())
    summary["seed"], summary["config"]["seed"], summary["config"]["init_from"] = 5, 5, ""
    (scratch / "summary.json").write_text(json.dumps(summary))
    assert list(tables.by_setting([json.loads((tmp_path / "run0" / "summary.json").read_text()), summary])) == [
        ("", "lime", "tiny", 10, ((("init_from", "true"),), "init_from True")),
        ("", "lime", "tiny", 10, ((("init_from", "false"),), "init_from False"))]
    for i, n in enumerate((9, 10)):  # seeds that read other shards: the name says where, not all 99 of them
        summary = json.loads((tmp_path / f"run{i}" / "summary.json").read_text())
        summary["config"]["shards"] = {"train": {f"fineweb_train_{j:06d}.bin": 10**8 for j in range(1, n)}}
        (tmp_path / f"run{i}" / "summary.json").write_text(json.dumps(summary))
    assert [line.split(" | ")[0] for line in analyze.main(["table", *dirs[:2]]).splitlines()[2:4]] == [
        "| lime (shards.train.fineweb_train_000009.bin (absent))", "| lime (shards.train.fineweb_train_000009.bin "
        "100000000)"]
    (tmp_path / "old").mkdir()  # a summary from before summaries kept their config: it differs in nothing known
    (tmp_path / "old" / "summary.json").write_text(json.dumps(dict(router="lime", preset="tiny", seed=9, steps=10,
                                                                   val_ppl=2.0)))
    assert "| lime | 2 | 3.000 ± 1.414 |" in analyze.main(["table", str(tmp_path / "old"), dirs[2]])
    (tmp_path / "copy").mkdir()  # but a copy of a run is no second seed
    shutil.copy(tmp_path / "run2" / "summary.json", tmp_path / "copy")
    assert error_of(analyze.main, ["table", dirs[2], dirs[3], str(tmp_path / "copy")], capsys) == \
        "analyze.py: error: two of these runs are seed 2 of router lime (lr 1e-05, n_layer 4): a mean over seeds " \
        "takes each seed once"


def test_rows_apart_have_names_of_their_own_and_compare_with_their_own_lime():
    """Rows set apart by values deep inside a field (fine-tunes of sources that differ in depth and length) are named
    by every place that differs, never alike (curves keyed by the name dropped one); a baseline row compares with the
    lime row of its own values; a config from before a field (prunings) holds it as not set, with the unpruned."""
    def summary(router, seed, ppl, **config):
        return dict(router=router, preset="tiny", seed=seed, steps=10, val_ppl=ppl,
                    config=dict(router=router, preset="tiny", seed=seed, max_steps=10, out_dir=f"{router}{seed}",
                                **config))
    sources = [dict(setting=dict(n_layer=n, max_steps=m), step=m) for n in (4, 8) for m in (8, 16)]
    rows = tables.by_setting([summary("lime", i, 2.0 + i, init_source=src) for i, src in enumerate(sources)])
    names = [tables.row_name(key, list(rows)) for key in rows]
    assert len(set(names)) == 4 and names[3] == ("lime (init_source.setting.n_layer 8, init_source.setting.max_steps "
                                                 "16, init_source.step 16)")
    runs_ = [summary("lime", 1, 2.0, n_layer=4), summary("lime", 2, 3.0, n_layer=8), summary("none", 1, 6.0, n_layer=4)]
    runs_ = [dict(r, acc_6=a, val_loss=1.0) for r, a in zip(runs_, (0.5, 0.6, 0.1))]
    table = tables.results_table(runs_ + [dict(runs_[2], seed=2, config=dict(runs_[2]["config"], seed=2))])
    assert "| none | 2 | 1.000 ± 0.000 | 10.0 ± 0.0 | +40.0 |" in table  # against lime at n_layer 4, not 8
    # one run a row (Table 7's layout) the same, whichever lime row comes first
    assert tables.results_table(runs_[::-1]).splitlines()[2:5] == [
        "| none | 1.0000 | 10.0% | +0.00% | -40.0 pts |", "| lime (n_layer 8) | 1.0000 | 60.0% | - | - |",
        "| lime (n_layer 4) | 1.0000 | 50.0% | - | - |"]
    old, new, pruned = (summary("lime", i, 2.0 + i) for i in range(3))
    new["config"]["prunings"], pruned["config"]["prunings"] = None, [dict(top_p=0.9, step=5)]
    assert [len(r) for r in tables.by_setting([old, new, pruned]).values()] == [2, 1]


def test_a_table_of_routers_trained_differently_says_how(tmp_path):
    """Rows that differ in more than their router and regime (a length, an lr, which a row does not show) compare
    more than the methods: a NOTE under the table names each such field and every row's value."""
    dirs = []
    for router, seed, steps, lr in (("lime", 1, 1500, 3e-3), ("lime", 2, 1500, 3e-3), ("none", 1, 30, 1e-3)):
        config = dict(router=router, preset="tiny", seed=seed, max_steps=steps, lr=lr, n_layer=4,
                      out_dir=f"{router}{seed}")
        dirs.append(tmp_path / f"{router}{seed}")
        dirs[-1].mkdir()
        (dirs[-1] / "summary.json").write_text(json.dumps(dict(router=router, preset="tiny", seed=seed, steps=steps,
                                                               val_ppl=2.0 + seed, config=config)))
    note = "\n\nNOTE the rows differ in more than their router: lr (lime 0.003, none 0.001); steps (lime 1500, none 30)"
    assert analyze.main(["table", *map(str, dirs)]).endswith("| none | 1 | 3.000 |" + note)
    # Table 7's layout: the same NOTE, and no change to a lime of another length (as over seeds): no such column
    assert analyze.main(["table", *map(str, dirs[1:])]) == "| router | perplexity |\n|---|---|\n| lime | 4.0000 |\n" \
        "| none | 3.0000 |" + note
    assert "NOTE" not in analyze.main(["table", *map(str, dirs[:2])])
    old = dict(router="none", preset="tiny", seed=1, steps=1500, val_ppl=3.0)  # before summaries kept their config
    new = json.loads((dirs[0] / "summary.json").read_text())
    assert "NOTE" not in tables.results_table([new, old])  # the old one has no lr to compare


def test_a_row_is_named_by_up_to_three_of_the_fields_that_set_it_apart():
    """Three fields apart: each named; a fourth: counted, not named (a row's name stays a line)."""
    def run(**config):
        return dict(router="lime", preset="tiny", seed=1, steps=9, val_ppl=2.0,
                    config=dict(out_dir="r", router="lime", preset="tiny", seed=1, max_steps=9, **config))

    three = [run(lr=1e-3, n_layer=4, warmup_steps=10), run(lr=2e-3, n_layer=8, warmup_steps=20)]
    assert tables.results_table(three).splitlines()[2:] == ["| lime (lr 0.001, n_layer 4, warmup_steps 10) | 2.0000 |",
                                                             "| lime (lr 0.002, n_layer 8, warmup_steps 20) | 2.0000 |"]
    four = [{**r, "config": {**r["config"], "min_lr": m}} for r, m in zip(three, (0.1, 0.2))]
    assert tables.results_table(four).splitlines()[2] == "| lime (lr 0.001, n_layer 4, warmup_steps 10, +1 more) | " \
        "2.0000 |"


def test_a_table_of_runs_that_ran_in_other_precisions_says_which():
    """A run resumed on a CPU after a GPU ran its last steps in float32 where its rivals ran bf16 throughout: a NOTE
    under the table says which run ran how (from the summaries' sessions); none where they all ran alike."""
    def run(router, seed, *sessions):
        return dict(router=router, preset="tiny", seed=seed, steps=9, val_ppl=2.0 + seed,
                    sessions=[dict(step=step, device=device, dtype=dtype, compile=True, world_size=1)
                              for step, device, dtype in sessions])

    gpu = (0, "cuda:0", "bfloat16")
    alike = [run("none", 1, gpu), run("none", 2, gpu, (5, "cuda", "bfloat16")), run("lime", 1, gpu)]
    assert "NOTE" not in tables.results_table(alike)
    assert "NOTE" not in tables.results_table([*alike, dict(router="lime", preset="tiny", seed=2, steps=9, val_ppl=3)])
    moved = run("lime", 2, gpu, (4, "cpu", "float32"), (6, "cpu", "float32"))
    assert tables.results_table([*alike, moved]).endswith(
        "\n\nNOTE these runs did not all run alike: cuda bfloat16 (none seed 1, none seed 2, lime seed 1); "
        "cuda bfloat16, then cpu float32 from step 4 (lime seed 2)")
    assert tables.results_table([moved]).endswith("NOTE these runs did not all run alike: cuda bfloat16, then cpu "
                                                  "float32 from step 4 (lime seed 2)")  # one run, two precisions
    cpu = run("lime", 2, (0, "cpu", "float32"))  # each run alike throughout, but not as the others
    assert tables.results_table([*alike, cpu]).endswith(
        "\n\nNOTE these runs did not all run alike: cuda bfloat16 (none seed 1, none seed 2, lime seed 1); "
        "cpu float32 (lime seed 2)")
    late = run("lime", 2, (4, "cpu", "float32"))  # its first sessions not recorded (begun before, or its log moved)
    assert tables.results_table([*alike, late]).endswith("; not recorded, then cpu float32 from step 4 (lime seed 2)")
    pruned = {**late, "config": dict(out_dir="p", prunings=[dict(top_p=0.9, step=4)])}  # (analyze.py prune --save)
    assert tables.results_table([*alike, pruned]).endswith("; in the run it was pruned from, then cpu float32 from "
                                                           "step 4 (lime seed 2)")


def test_the_note_compares_rows_within_a_regime_and_sees_a_fine_tune():
    """grid.py fits each regime's block and vocabulary to its data: rows of two regimes that differ in those alone
    get no NOTE (every default grid's table did); rows of one regime do, and so does a row fine-tuned from a run
    (--init-from, whose path differs seed by seed) beside one trained from scratch."""
    def run(router, field, init_from="", lr=1e-3):
        task = dataclasses.asdict(arithmetic.Task(field=field, count="operators", target="answer"))
        config = dict(router=router, preset="arith", seed=1, max_steps=10, lr=lr, init_from=init_from,
                      block_size=48 if field == "int" else 24, vocab_size=1008 if field == "int" else 24)
        return dict(router=router, task=task, preset="arith", seed=1, steps=10, acc_4=0.5, config=config)

    grid = [run(router, field) for field in ("int", "mod") for router in ("lime", "none")]
    assert "NOTE" not in tables.results_table(grid)
    table = tables.results_table([*grid, {**grid[2], "steps": 20}])  # two rows of lime in a regime: named apart
    assert "| mod11-answer, tiers 4,5,6 operators | lime (10 steps) | 1 |" in table
    assert "| mod11-answer, tiers 4,5,6 operators | lime (20 steps) | 1 |" in table and "| lime | 1 |" in table
    table = tables.results_table([*grid[:3], run("none", "mod", lr=3e-3)])
    assert table.endswith("|\n\nNOTE the rows of mod11-answer, tiers 4,5,6 operators differ in more than their "
                          "router: lr (lime 0.001, none 0.003)")
    table = tables.results_table([run("lime", "mod", init_from="out/lime-seed1"), run("none", "mod")])
    assert table.endswith("|\n\nNOTE the rows differ in more than their router: init_from (lime True, none False)")
    assert "NOTE" not in tables.results_table([run("lime", "mod", "out/a"), run("none", "mod", "out/b")])
    # fine-tunes of a lime and a none run (ProsQA's table): their sources differ in their router, which is the rows'
    tuned = [run(router, "mod", f"out/{router}") for router in ("lime", "none")]
    for r, lr in zip(tuned, (1e-3, 1e-3)):
        r["config"]["init_source"] = dict(setting=dict(router=r["router"], preset="150m", lr=lr, n_layer=12), step=6000)
    assert "NOTE" not in tables.results_table(tuned)
    tuned[1]["config"]["init_source"]["setting"]["lr"] = 3e-3  # a source trained otherwise: said where it differs
    assert tables.results_table(tuned).endswith("router: init_source.setting.lr (lime 0.001, none 0.003)")
    pruned = run("lime", "mod")
    pruned["config"]["prunings"] = [dict(top_p=0.9, step=5)]
    table = tables.results_table([pruned, {**run("none", "mod"), "config": {**run("none", "mod")["config"],
                                                                            "prunings": None}}])
    assert table.endswith("router: prunings (lime [{'top_p': 0.9, 'step': 5}], none not set)")  # as a row's name


def test_curves_average_the_seeds_at_the_steps_they_all_have_evaluated(tmp_path, capsys):
    task = dataclasses.asdict(arithmetic.Task(field="mod", count="operators", target="answer"))
    dirs = []
    # the second `none` seed diverged at step 200 (train.py logs that evaluation, then stops): its curve ends
    # where its log does, and the loss there, NaN, makes the mean NaN, with no traceback
    for router, seeds in (("lime", ((.2, .5, .7), (.4, .7, .9))), ("none", ((.1, .2, .3), (.1, .4)))):
        for seed, accs in enumerate(seeds):
            d = tmp_path / f"{router}-{seed}"
            d.mkdir()
            config = dict(out_dir="run", router=router, task=task, seed=seed, preset="arith", max_steps=300)
            (d / "config.json").write_text(json.dumps(config))
            rows = [dict(step=100 * i + 50, loss=2.0) for i in range(3)]  # training rows: not evaluations
            rows += [dict(step=100 * (i + 1), val_loss=1 - acc, val_acc_4=1.0, val_acc_5=1.0, val_acc_6=acc)
                     for i, acc in enumerate(accs)]
            rows[-1]["val_loss"] = math.nan if (router, seed) == ("none", 1) else rows[-1]["val_loss"]
            rows.sort(key=lambda r: r["step"])
            (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3')  # a cut last line
            dirs.append(str(d))
    curves = analyze.main(["curves", *dirs, dirs[0], "--out", str(tmp_path / "c.png")])  # a run given twice: once
    label = "{}, mod11-answer, tiers 4,5,6 operators, preset arith, 300 steps"
    lime, none = curves[label.format("lime")], curves[label.format("none")]
    assert [(s, n) for s, _, _, n in lime["val_acc_6"]] == [(100, 2), (200, 2), (300, 2)]
    assert [(s, n) for s, _, _, n in none["val_acc_6"]] == [(100, 2), (200, 2)]
    assert lime["val_acc_6"][1][1:3] == pytest.approx((0.6, math.sqrt(0.02)))
    assert lime["val_loss"][1][1:3] == pytest.approx((0.4, math.sqrt(0.02)))
    assert none["val_loss"][0][1:3] == pytest.approx((0.9, 0.0)) and math.isnan(none["val_loss"][1][1])
    out = capsys.readouterr().out
    assert "     200       60.0 ± 14.1       30.0 ± 14.1" in out
    assert "     300       80.0 ± 14.1                 -" in out
    assert "its last line was cut short" in out and "val_acc_6 (%), mean ± sd over the seeds:" in out
    with pytest.MonkeyPatch.context() as m:  # (no picture: the table is what this looks at)
        m.setattr(analyze, "pyplot", lambda: None)
        for rows in ("1", "2"):  # at most about --rows rows (of the 3 steps): the first step, and the last always
            analyze.main(["curves", *dirs, "--rows", rows])
            assert [line.split()[0] for line in capsys.readouterr().out.splitlines() if re.match(" +\\d+ ", line)] \
                == ["100", "300"] * 2, rows  # val_acc_6, val_loss
    # a step evaluated twice (a row copied), or steps that go back (another run's rows appended): which row wins
    # was the last one's, drawn as this run's, exit 0
    for name, extra, what in (("twice", dict(step=300, val_loss=5.0), "a second evaluation of step 300"),
                              ("appended", dict(step=50, loss=2.0), "step 50 after step 300")):
        damaged = tmp_path / name
        shutil.copytree(dirs[0], damaged)
        (damaged / "log.jsonl").write_text((tmp_path / "lime-0" / "log.jsonl").read_text().rsplit("\n", 1)[0] + "\n" +
                                           json.dumps(extra) + "\n")
        assert error_of(analyze.main, ["curves", str(damaged)], capsys, 1) == f"analyze.py: error: " \
            f"{damaged / 'log.jsonl'}, line 7: {what}: rows of another run, or copied"
    huge = tmp_path / "huge"  # JSON's integers have no limit; a float does
    shutil.copytree(dirs[0], huge)
    (huge / "log.jsonl").write_text('{"step": 100, "val_loss": 1' + "0" * 400 + '}\n')
    assert "step 100: val_loss is not a number from 0 up (1000" in error_of(analyze.main, ["curves", str(huge)], capsys,
                                                                           code=1)
    tiers = '"val_acc_4": 0.5, "val_acc_5": 0.5, '  # (each row holds every tier or none)
    for row, fault in [(tiers + '"val_loss": 0.5, "val_acc_6": 1.5', "val_acc_6 is not a share from 0 to 1 (1.5)"),
                       # as in a summary.json; a loss of NaN or inf is what a diverged run logs last, not one below 0
                       ('"val_loss": -Infinity', "val_loss is not a number from 0 up (-inf)")]:
        (huge / "log.jsonl").write_text('{"step": 100, "val_loss": 0.5, %s"val_acc_6": 0.5}\n{"step": 200, %s}\n'
                                        % (tiers, row))
        assert f"step 200: {fault}" in error_of(analyze.main, ["curves", str(huge)], capsys, code=1)
    (huge / "summary.json").write_text(json.dumps(dict(router="lime", val_loss=0.0, val_ppl=1.0)))  # a loss of 0
    assert analyze.main(["table", str(huge)]).endswith("| lime | 1.0000 |")  # (float32 rounds a sure one to it)
    (huge / "summary.json").write_text(json.dumps(dict(router="lime", acc_4=10**400, val_loss=0.5)))
    assert "summary.json is not what this repo writes: its 'acc_4' is 1000" in error_of(
        analyze.main, ["table", str(huge)], capsys, code=1)
    gap = tmp_path / "gap"  # one tier's accuracy missing: a table and curves, which show the tiers every run has,
    shutil.copytree(dirs[0], gap)  # would leave that tier out for all the runs, and take another for the last one
    (gap / "summary.json").write_text(json.dumps(dict(router="lime", task=task, seed=0, acc_4=0.5, acc_6=0.5)))
    assert error_of(analyze.main, ["table", str(gap)], capsys, code=1) == f"analyze.py: error: {gap / 'summary.json'}" \
        " is not what this repo writes: no 'acc_5', where its task's other tiers have one"
    (gap / "log.jsonl").write_text(json.dumps(dict(step=100, val_loss=0.5, val_acc_4=0.5, val_acc_5=0.5)) + "\n")
    assert error_of(analyze.main, ["curves", str(gap)], capsys, code=1) == f"analyze.py: error: {gap / 'log.jsonl'}, " \
        "step 100: no 'val_acc_6', where its task's other tiers have one"
    shutil.copytree(dirs[1], tmp_path / "copy")  # a copy of a run is not one more seed
    assert error_of(analyze.main, ["curves", *dirs, str(tmp_path / "copy")], capsys).endswith(
        "two of these runs are seed 1 of router lime, mod11-answer, tiers 4,5,6 operators: a mean over seeds takes "
        "each seed once")
    picture = tmp_path / "curves.png"  # where curves saves its picture by default: a glob over the runs finds it
    picture.write_bytes(b"\x89PNG")
    acc_4 = analyze.main(["curves", *dirs[:2], str(picture), "--metric", "val_acc_4",
                          "--out", str(tmp_path / "c.PNG")])  # (a PNG's suffix in capitals: a PNG all the same)
    assert list(next(iter(acc_4.values()))) == ["val_acc_4", "val_loss"]
    assert f"left out {picture}: a file, not a run folder" in capsys.readouterr().err
    logs = [tmp_path / f"lime-seed{i}.out" for i in range(4)]  # grid.py's train.out, or nohup's, beside the runs
    for log in logs:
        log.write_text("step 1\n")
    assert analyze.run_folders([*dirs[:2], *logs]) == [Path(d).resolve() for d in dirs[:2]]
    assert capsys.readouterr().err == f"left out {logs[0]}, {logs[1]} and 2 more: files, not run folders\n"
    assert "no run folder among the paths given" in error_of(analyze.main, ["table", str(picture)], capsys, code=2)
    assert error_of(analyze.main, ["table", dirs[0], str(tmp_path / "typo")], capsys) == \
        f"analyze.py: error: no such folder: {tmp_path / 'typo'}"
    (tmp_path / "d.png").mkdir()  # a picture asked for by name where it cannot go: refused first, not exit 0 without it
    assert error_of(analyze.main, ["curves", *dirs[:2], "--out", str(tmp_path / "d.png")], capsys, code=2) == \
        f"analyze.py: error: --out={tmp_path / 'd.png'} is a folder, not a file: give the picture's own path"
    assert error_of(analyze.main, ["curves", *dirs[:2], "--out", str(picture / "c.png")], capsys, code=2) == \
        f"analyze.py: error: --out={picture / 'c.png'}: {picture} is a file, not a folder"
    assert "no evaluation with val_acc_7 in all of its 2 run(s)" in error_of(
        analyze.main, ["curves", *dirs[:2], "--metric", "val_acc_7"], capsys, code=1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(dict(out_dir="run", router="lime")))
    assert "not a run folder, or a run not started yet" in error_of(analyze.main, ["curves", str(tmp_path / "empty")],
                                                                   capsys, code=1)
    fork = tmp_path / "fork"  # a fork's own metric, not val_*: what it logs is its own, and may be no number
    shutil.copytree(dirs[0], fork)
    rows = (fork / "log.jsonl").read_text().splitlines()[:-1]  # (the cut last line off)
    for value in (0.5, None, "x", [1], True):
        evals = [json.loads(r) for r in rows]
        for r in evals:
            r.update(bleu=0.5 if r["step"] < 300 else value) if "val_loss" in r else None
        (fork / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
        args = ["curves", str(fork), "--metric", "bleu", "--out", str(tmp_path / "c.png")]
        if value in (0.5, None):  # a null: not measured at that step, drawn at the others (was a traceback)
            assert [(s, m) for s, m, _, _ in analyze.main(args)[label.format("lime")]["bleu"]] == \
                [(100, 0.5), (200, 0.5), (300, 0.5)][:3 if value else 2]
        else:  # was a traceback of mean_sd, or, for true, a curve at 1
            assert error_of(analyze.main, args, capsys, code=1) == f"analyze.py: error: {fork / 'log.jsonl'}, step " \
                f"300: bleu is not a number ({value!r}), so it draws no curve: give another --metric"
    assert error_of(analyze.main, ["curves", str(fork), "--metric", "step"], capsys) == "analyze.py: error: " \
        "--metric step: that is the curves' x axis; give a value the log holds (val_loss, say)"


def test_the_curves_picture_draws_what_is_printed(tmp_path, monkeypatch):
    """The picture draws the printed means (accuracy in %) with a band of 1 sd, in the folder that holds all the runs,
    here above their regimes' folders; of seeds evaluated at other intervals, each step's mean is of that step's."""
    pytest.importorskip("matplotlib")  # (optional: CI has none)
    accs = {1: {50: 0.1, 100: 0.25, 150: 0.4, 200: 0.5}, 2: {100: 0.35, 200: 0.3}}
    dirs = []
    for seed, at in accs.items():
        d = tmp_path / "grid" / f"regime{seed}" / f"lime-seed{seed}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(dict(out_dir="run", router="lime", seed=seed, max_steps=200,
                                                       eval_interval=200 // len(at))))
        (d / "log.jsonl").write_text("".join(json.dumps(dict(step=step, val_loss=1 - acc, val_acc_4=acc)) + "\n"
                                             for step, acc in at.items()))
        dirs.append(str(d))
    drawn = []

    def keep(plt, fig, path):  # (write_png's place: what the picture shows, not a PNG to decode)
        drawn.append((path, [(ax.get_ylabel(), ax.lines[0].get_xydata(), ax.collections[0].get_paths()[0].vertices)
                             for ax in fig.axes]))
        plt.close(fig)

    monkeypatch.setattr(analyze, "write_png", keep)
    curve = analyze.main(["curves", *dirs])["lime, 200 steps"]
    sd = math.sqrt(0.005)  # of 0.25 and 0.35, as of 0.5 and 0.3 twice that
    assert curve["val_acc_4"] == [pytest.approx(p) for p in ((100, 0.3, sd, 2), (200, 0.4, 2 * sd, 2))]
    assert curve["val_loss"] == [pytest.approx(p) for p in ((100, 0.7, sd, 2), (200, 0.6, 2 * sd, 2))]
    [(path, axes)] = drawn
    assert path == tmp_path / "grid" / "curves.png"
    for (ylabel, line, band), (metric, scale) in zip(axes, (("val_acc_4 (%)", 100), ("val_loss", 1))):
        assert ylabel == metric
        points = curve[metric.split()[0]]
        assert line.tolist() == [pytest.approx([step, scale * mu]) for step, mu, _, _ in points]
        for step, mu, sd, _ in points:  # the band at each step: from mean - sd to mean + sd
            ys = band[band[:, 0] == step, 1]
            assert (ys.min(), ys.max()) == pytest.approx((scale * (mu - sd), scale * (mu + sd)))
    # runs in unrelated trees (their one common folder the root): the picture goes into the working folder, not /
    monkeypatch.setattr(analyze.os.path, "commonpath", lambda paths: Path(dirs[0]).anchor)
    monkeypatch.chdir(tmp_path)
    analyze.main(["curves", *dirs])
    assert drawn[-1][0] == tmp_path / "curves.png"


def test_a_tier_missing_is_said_however_many_are_missing():
    """An evaluation's row, or a summary, that holds the accuracy of some of its task's tiers and not of others: the
    first one missing is named, whether one tier is missing or all but one; none at all is a split not evaluated."""
    task = dataclasses.asdict(arithmetic.QUICK_START)  # tiers 4, 5 and 6
    assert runs.tier_gap({"val_acc_4": 0.5, "val_acc_6": 0.5}, task) == runs.tier_gap({"val_acc_4": 0.5}, task) == \
        "no 'val_acc_5', where its task's other tiers have one"
    assert runs.tier_gap({"val_loss": 1.0}, task) is None and runs.tier_gap({"val_acc_4": 0.5}, None) is None


def test_runs_of_other_tiers_are_refused_not_tabled_by_perplexity(tmp_path, capsys):
    """Runs that share no tier: table and curves say so (before, table fell back to perplexity alone and
    curves blamed the runs' logs)."""
    dirs = []
    for tiers in ((4, 5, 6), (2, 3)):
        d = tmp_path / "-".join(map(str, tiers))
        d.mkdir()
        task = dataclasses.asdict(arithmetic.Task(field="mod", count="operators", target="answer", tiers=tiers))
        accs = {f"{prefix}acc_{k}": 0.5 for k in tiers for prefix in ("", "val_")}
        (d / "summary.json").write_text(json.dumps(dict(router="lime", task=task, seed=1, val_ppl=2.0, **accs)))
        (d / "config.json").write_text(json.dumps(dict(out_dir="run", router="lime", task=task, seed=1, max_steps=10)))
        (d / "log.jsonl").write_text(json.dumps(dict(step=10, val_loss=1.0, **accs)) + "\n")
        dirs.append(str(d))
    assert "these runs share no tier of test accuracy (theirs: 2,3; 4,5,6)" in error_of(
        analyze.main, ["table", *dirs], capsys)
    assert "share no tier of val accuracy" in error_of(analyze.main, ["table", "--split", "val", *dirs], capsys)
    with pytest.raises(cli.UsageError, match=re.escape("share no tier of test accuracy (theirs: 4,5,6; none)")):
        tables.results_table([json.loads((tmp_path / "4-5-6" / "summary.json").read_text()),
                              dict(router="none", val_ppl=2.0)])  # a language run beside them: not perplexities alone
    assert "share no tier of validation accuracy: give --metric" in error_of(analyze.main, ["curves", *dirs], capsys)
    fresh = tmp_path / "fresh"  # a run that has not evaluated yet (stopped, or still training): left out, with a line
    shutil.copytree(dirs[0], fresh)
    (fresh / "summary.json").unlink()
    (fresh / "log.jsonl").write_text(json.dumps(dict(step=5, loss=2.0)) + "\n" +  # and pruned (--prune-at 5): no
                                     json.dumps(dict(step=5, router_pruned=3, router_weights=8)) + "\n")  # evaluation
    (fresh / "config.json").write_text(json.dumps(dict(out_dir="run", router="none", task=task, seed=1, max_steps=10)))
    capsys.readouterr()
    assert list(analyze.main(["curves", dirs[1], str(fresh), "--out", str(tmp_path / "c.png")])) == [
        "lime, mod11-answer, tiers 2,3 operators, 10 steps"]
    assert capsys.readouterr().err == f"left out {fresh}: no evaluation yet\n"
    assert error_of(analyze.main, ["curves", str(fresh)], capsys, code=1) == \
        f"analyze.py: error: no evaluation yet in {fresh}"  # (none at all: nothing to draw)
    starting = tmp_path / "starting"  # a grid's run in its first seconds: its train.out alone (it was "no config.json")
    starting.mkdir()
    (starting / "train.out").write_text("")
    assert list(analyze.main(["curves", dirs[1], str(starting), "--out", str(tmp_path / "c.png")])) == [
        "lime, mod11-answer, tiers 2,3 operators, 10 steps"]
    assert capsys.readouterr().err == f"left out {starting}: a run of grid.py not started yet\n"
    assert error_of(analyze.main, ["table", str(starting)], capsys) == \
        f"analyze.py: error: no run among the paths given has started: {starting} holds a grid's train.out alone"
    lost = tmp_path / "lost"  # a grid's finished run whose config.json is lost: not one that has not started
    shutil.copytree(dirs[1], lost)
    (lost / "train.out").write_text("")
    (lost / "config.json").unlink()
    assert analyze.main(["table", str(lost)]) == analyze.main(["table", dirs[1]])  # (its summary.json: in the table)
    assert error_of(analyze.main, ["curves", str(lost)], capsys, code=1) == \
        f"analyze.py: error: no {lost / 'config.json'}"
    assert list(analyze.main(["curves", *dirs, "--metric", "val_loss", "--out", str(tmp_path / "c.png")])) == [
        "lime, mod11-answer, tiers 4,5,6 operators, 10 steps", "lime, mod11-answer, tiers 2,3 operators, 10 steps"]
    out = capsys.readouterr().out
    assert out.count("val_loss, one seed each:") == 1 and " ± " not in out  # the metric asked for; no sd of one


def test_curves_pair_the_seeds_by_step_not_by_row(tmp_path, capsys, monkeypatch):
    """Seeds evaluated at other steps (eval_interval may differ between them): each seed's value at a step, at the steps
    they all have; and a mean over two seeds beside one seed is headed as a mean over seeds."""
    monkeypatch.setattr(analyze, "pyplot", lambda: None)
    dirs = []
    for router, seed, steps in (("lime", 0, (100, 200, 300)), ("lime", 1, (150, 300)), ("none", 0, (100, 200, 300))):
        d = tmp_path / f"{router}-{seed}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(out_dir="run", router=router, seed=seed, max_steps=300)))
        (d / "log.jsonl").write_text("".join(json.dumps(dict(step=s, val_loss=s / 1000 + seed)) + "\n" for s in steps))
        dirs.append(str(d))
    curves = analyze.main(["curves", *dirs])
    assert curves["lime, 300 steps"]["val_loss"] == [(300, pytest.approx(0.8), pytest.approx(math.sqrt(0.5)), 2)]
    assert [s for s, *_ in curves["none, 300 steps"]["val_loss"]] == [100, 200, 300]
    out = capsys.readouterr().out
    assert "val_loss, mean ± sd over the seeds:" in out and "     300   0.8000 ± 0.7071            0.3000" in out


def test_a_folder_of_runs_is_not_taken_for_a_run(tmp_path, capsys):
    """`table out/grid/*` gives the regimes' folders, one level above the runs: said so, with the glob that gives
    the runs, not "no .../summary.json (is the run finished?)"."""
    regime = tmp_path / "grid" / "int-steps"
    for seed in (1, 2):
        (regime / f"lime-seed{seed}").mkdir(parents=True)
        (regime / f"lime-seed{seed}" / "config.json").write_text(json.dumps(dict(out_dir="run", router="lime",
                                                                                  seed=seed)))
    for command in ("table", "curves"):
        assert error_of(analyze.main, [command, str(regime)], capsys) == (
            f"analyze.py: error: {regime} holds run folders, not a run: give the runs in it ({regime}/*; for a glob, "
            f"one level deeper: {tmp_path}/grid/*/*)")


def test_ablation_table_of_accuracies_gives_the_change_in_points(tmp_path):
    dirs = []
    for router, acc in (("lime", 0.0), ("none", 0.25), ("first-4", 0.038)):  # lime solved nothing at 6 operands
        dirs.append(tmp_path / router)
        dirs[-1].mkdir()
        (dirs[-1] / "summary.json").write_text(json.dumps(dict(router=router, acc_4=0.5, acc_5=0.298, acc_6=acc)))
    table = analyze.main(["table", *map(str, dirs)])
    assert table.splitlines()[0] == "| router | acc_4 | acc_5 | acc_6 | change to lime (acc_4) | " \
        "change to lime (acc_5) | change to lime (acc_6) |"
    assert "| none | 50.0% | 29.8% | 25.0% | +0.0 pts | +0.0 pts | +25.0 pts |" in table  # not n/a: nothing is % of 0
    assert "| first-4 | 50.0% | 29.8% | 3.8% | +0.0 pts | +0.0 pts | +3.8 pts |" in table
    assert tables.change("val_ppl", 16.4, 0.0) == "n/a"  # (a perplexity of 0, written by hand: nothing is % of 0)
    for path, loss in zip(dirs, (0.25, 0.5, 0.2)):  # with a validation loss in every summary, the loss beside them
        summary = json.loads((path / "summary.json").read_text())
        (path / "summary.json").write_text(json.dumps(dict(summary, val_loss=loss)))
    table = analyze.main(["table", *map(str, dirs)])
    assert table.splitlines()[0].startswith("| router | val loss | acc_4 | acc_5 | acc_6 | change to lime (val loss) |")
    assert "| none | 0.5000 | 50.0% | 29.8% | 25.0% | +100.00% | +0.0 pts |" in table


def test_a_pruned_run_and_fine_tunes_of_other_runs_are_rows_apart(answer_dir, answer_run, tmp_path,
                                                                                 capsys):
    """A run pruned by prune --save and trained on, beside one never pruned, made one row of two seeds in table and
    curves; so did fine-tunes of runs of other lengths. A config now holds what its run started from: the prunings of
    prune --save, and with --init-from the setting and step of the run it starts from. Both are part of its setting."""
    pruned, unpruned = tmp_path / "pruned", tmp_path / "unpruned"
    analyze.main(["prune", "--out-dir", str(answer_run), "--top-p", "0.7", "--save", str(pruned)])
    train.main(["--resume", f"--out-dir={pruned}", "--max-steps=8"])
    train.main(tiny_args(answer_dir, unpruned, "--max-steps=8", "--seed=2"))
    capsys.readouterr()  # pruned again: what it holds says so, and is no "unpruned" model
    report = analyze.main(["prune", "--out-dir", str(pruned), "--top-p", "0.9"])
    already = int((~torch.load(pruned / "ckpt.pt")["router_mask"]["transformer.h.1.attn.router.weight"]).sum())
    out = capsys.readouterr().out
    assert report["already_pruned"] == already > 0 and "unpruned" not in out and f"NOTE {pruned} was pruned already " \
        f"({already} of 8 weights): the counts above include those, and 'as saved' is that pruned model" in out
    assert [line.split(" | ")[0] for line in analyze.main(["table", str(pruned), str(unpruned)]).splitlines()[2:4]] == \
        ["| lime (prunings [{'top_p': 0.7, 'step': 6}])", "| lime (no prunings)"]
    assert [label.split(" steps, ")[1] for label in analyze.main(["curves", str(pruned), str(unpruned)])] == [
        "prunings [{'top_p': 0.7, 'step': 6}]", "no prunings"]
    short, tunes = tmp_path / "short", [tmp_path / "tune1", tmp_path / "tune2"]
    train.main(tiny_args(answer_dir, short, "--max-steps=2", "--seed=3"))
    for tune, source, seed in zip(tunes, (unpruned, short), (2, 3)):
        train.main(tiny_args(answer_dir, tune, f"--init-from={source}", "--max-steps=2", f"--seed={seed}"))
    assert json.loads((tunes[1] / "config.json").read_text())["init_source"] == dict(
        setting=tables.setting(json.loads((short / "config.json").read_text())), step=2)
    capsys.readouterr()  # --dry-run says it too (grid.py checks the runs it keeps by it)
    train.main(tiny_args(answer_dir, tmp_path / "dry", f"--init-from={short}", "--max-steps=2", "--dry-run"))
    dry = json.loads(capsys.readouterr().out.split("config: ", 1)[1].split("\n")[0])
    assert dry["init_source"] == json.loads((tunes[1] / "config.json").read_text())["init_source"]
    assert [line.split(" | ")[0] for line in analyze.main(["table", *map(str, tunes)]).splitlines()[2:4]] == [
        "| lime (init_source.setting.max_steps 8, init_source.step 8)",
        "| lime (init_source.setting.max_steps 2, init_source.step 2)"]
    again = tmp_path / "tune3"  # a fine-tune of another seed of the same setting: one more seed of the row
    shutil.copytree(tunes[1], again)
    summary, config = (json.loads((again / name).read_text()) for name in ("summary.json", "config.json"))
    summary["seed"] = summary["config"]["seed"] = config["seed"] = 4  # (its files agree: a run of seed 4)
    (again / "summary.json").write_text(json.dumps(summary))
    (again / "config.json").write_text(json.dumps(config))
    assert "| lime | 2 |" in analyze.main(["table", str(tunes[1]), str(again)])


def test_prune_command_saves_a_checkpoint_that_stays_pruned(answer_dir, answer_run, tmp_path, capsys, monkeypatch):
    new, name = tmp_path / "pruned", "transformer.h.1.attn.router.weight"
    shutil.copytree(answer_dir, tmp_path / "moved")  # the run's data where --data-dir says: the pruned run reads it
    monkeypatch.chdir(tmp_path)  # (given relative, recorded absolute, as train.py records it)
    report = analyze.main(["prune", "--out-dir", str(answer_run), "--top-p", "0.7", "--save", str(new), "--data-dir",
                           "moved"])
    ckpt = torch.load(new / "ckpt.pt", weights_only=True)
    assert ckpt["config"]["data_dir"] == json.loads((new / "config.json").read_text())["data_dir"] == \
        str((tmp_path / "moved").resolve())
    keep = ckpt["router_mask"][name]
    assert report["pruned"] == int((~keep).sum()) > 0 and report["weights"] == 8
    assert torch.all(ckpt["model"][name][~keep] == 0) and ckpt["config"]["out_dir"] == str(new)
    assert torch.isnan(report["survival"][0]).all()  # layer 0's router is a fixed identity
    assert report["survival"][1].tolist() == keep.float().mean(dim=(0, 2)).tolist()
    out = capsys.readouterr().out
    assert f"all:       {report['pruned']:>8,} of        8" in out and "unpruned" in out
    assert out.startswith(f"evaluating {answer_run} on cpu, as it is and then pruned ...\n")  # (a progress line)
    assert f"layer   1: {report['pruned']:>8,} of        8 ({report['pruned'] / 8:6.1%})" in out.splitlines()
    own = int((~keep[:, -1]).sum())  # layer 1's weights of its own 2 heads, into each of its 2 heads
    assert report["from_itself"] == dict(pruned=own, weights=4) and "of them, from the layer itself (the identity at " \
        f"a fresh lime's start): {own} of 4; from earlier layers: {report['pruned'] - own} of 4 " \
        f"({100 * (report['pruned'] - own) / 4:.1f}%)" in out.splitlines()
    summary = json.loads((answer_run / "summary.json").read_text())
    assert report["unpruned_metrics"] == {k: summary[k] for k in report["unpruned_metrics"]}
    # sample.py loads it (and `train.py --resume` keeps the zeros, as in the test above: the mask is in ckpt.pt)
    assert runs.load_checkpoint(new, "cpu")[1].routers[1].weight.count_nonzero() == keep.sum()
    assert len(sample.main(["--out-dir", str(new), "--num-samples", "1", "--max-new-tokens", "2"])) == 1
    again = tmp_path / "pruned-again"  # pruned once more: both prunings, in order, its setting (tables.py)
    analyze.main(["prune", "--out-dir", str(new), "--top-p", "0.5", "--save", str(again)])
    assert json.loads((again / "config.json").read_text())["prunings"] == [dict(top_p=0.7, step=6),
                                                                            dict(top_p=0.5, step=6)]
    before = snapshot(new)
    err = error_of(analyze.main, ["prune", "--out-dir", str(answer_run), "--save", str(new)], capsys)
    assert "already holds a run" in err and "--overwrite" in err and snapshot(new) == before
    (tmp_path / "link").symlink_to(answer_run)  # the run itself by another name: --overwrite would clear it
    before = snapshot(answer_run)
    assert error_of(analyze.main, ["prune", "--out-dir", str(answer_run), "--save", str(tmp_path / "link"),
                                   "--overwrite"], capsys) == "analyze.py: error: --save names the run being pruned: " \
        "give a new folder"
    assert snapshot(answer_run) == before
    mine = tmp_path / "mine"  # no checkpoint, but files --overwrite would delete: refused too
    mine.mkdir()
    (mine / "prune.json").write_text('{"mine": 1}')
    err = error_of(analyze.main, ["prune", "--out-dir", str(answer_run), "--save", str(mine)], capsys)
    assert f"--save={mine} already holds a run (prune.json)" in err
    assert (mine / "prune.json").read_text() == '{"mine": 1}'
    (mine / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')  # --overwrite: the old run's files go
    held = cli.hold_folder(mine, "a test")  # but not from under a train.py that trains there
    try:
        err = error_of(analyze.main, ["prune", "--out-dir", str(answer_run), "--save", str(mine), "--overwrite"],
                       capsys)
    finally:
        os.close(held)
    assert err == f"analyze.py: error: {mine} is in use by another process (a train.py training there? wait for " \
        "it to end, or give another folder)"
    assert (mine / "log.jsonl").exists() and (mine / "prune.json").read_text() == '{"mine": 1}'
    report = analyze.main(["prune", "--out-dir", str(answer_run), "--top-p", "1", "--save", str(mine), "--overwrite"])
    assert report["pruned"] == 0 and report["top_p"] == 1  # p = 1: every weight is kept (its smallest is not 0)
    assert json.loads((mine / "prune.json").read_text())["pruned"] == 0 and not (mine / "log.jsonl").exists()
    assert error_of(analyze.main, ["table", str(mine)], capsys, code=1) == f"analyze.py: error: no {mine}/summary." \
        "json: a model saved by analyze.py prune --save, not a run (its prune.json has the scores of the pruning; " \
        "sample.py --eval scores it)"  # not 'is the run finished?'
    (mine / "log.jsonl").write_text('{"step": 1, "loss": 2.0}\n')  # trained on from there (--resume): a run again
    assert error_of(analyze.main, ["table", str(mine)], capsys, code=1).endswith("(is the run finished?)")


def test_prune_save_refuses_a_folder_another_process_wrote_while_it_pruned(answer_run, tmp_path, capsys, monkeypatch):
    """--save is checked before the two evaluations, and written after them: another prune --save into the same
    folder (or a run) that wrote there meanwhile and ended is not replaced unasked, not even with --overwrite, which
    said what to replace as the command began."""
    new = tmp_path / "new"
    evaluate = analyze.evaluate

    def meanwhile(*args, **kwargs):  # (another process, as this one evaluates)
        new.mkdir(exist_ok=True)
        (new / "prune.json").write_text('{"theirs": 1}')
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(analyze, "evaluate", meanwhile)
    for flags in ([], ["--overwrite"]):
        err = error_of(analyze.main, ["prune", "--out-dir", str(answer_run), "--save", str(new), *flags], capsys)
        assert err == f"analyze.py: error: {new}: another process wrote prune.json there while this one " \
            "pruned: nothing was written there; give the command again to see what is there now"
        assert sorted(p.name for p in new.iterdir()) == ["prune.json"]
        assert (new / "prune.json").read_text() == '{"theirs": 1}'


def test_prune_save_onto_a_full_disk_leaves_no_model_without_its_checkpoint(answer_run, tmp_path, capsys,
                                                                           monkeypatch):
    """--save whose checkpoint cannot be written (a full disk), or stopped as it writes (Ctrl-C): one line, and its
    config.json and prune.json go too, not a folder that no reader takes and that the same command then refuses (it
    holds a run)."""
    new = tmp_path / "pruned"

    def full(out_dir, *args, **kwargs):
        raise cli.DataError(f"cannot write {out_dir}/ckpt.pt: No space left on device")

    monkeypatch.setattr(runs, "save_checkpoint", full)
    args = ["prune", "--out-dir", str(answer_run), "--top-p", "0.7", "--save", str(new)]
    assert error_of(analyze.main, args, capsys, code=1) == f"analyze.py: error: cannot write {new}/ckpt.pt: No " \
        "space left on device"
    assert not new.exists()  # (made for nothing: it goes again)
    monkeypatch.undo()
    real, written = analyze.atomic_write, []

    def interrupted(path, write):  # Ctrl-C as the last file is written
        written.extend([path.name] if path.parent == new else [])  # (not the picture, beside the run pruned)
        if path.name == "prune.json":
            raise KeyboardInterrupt
        real(path, write)

    for module in (analyze, runs):
        monkeypatch.setattr(module, "atomic_write", interrupted)
    with pytest.raises(SystemExit):
        analyze.main(args)
    assert not new.exists()
    assert written == ["ckpt.pt", "config.json", "prune.json"]  # killed (kill -9) before the end, it leaves a model
    monkeypatch.undo()
    analyze.main(args)  # once there is room
    assert sorted(p.name for p in new.iterdir()) == ["ckpt.pt", "config.json", "prune.json"]


def test_mean_and_sample_sd_of_the_seeds():
    assert tables.mean_sd([0.5, 0.6, 0.7]) == pytest.approx((0.6, 0.1))  # sqrt((0.1^2 + 0 + 0.1^2) / (3 - 1))
    assert tables.mean_sd([4.0]) == (4.0, 0.0)
    mean, sd = tables.mean_sd([1.0, math.nan])  # a seed that diverged: no spread to speak of, not a spread of 0
    assert math.isnan(mean) and math.isnan(sd)
    mean, sd = tables.mean_sd([1.0, math.inf])
    assert mean == math.inf and math.isnan(sd)


def test_one_seed_has_no_sd_and_regimes_stay_apart():
    """A row of one run shows its value alone, not '± 0.0' (which would look certain); single runs of two regimes
    are rows by regime, not Table 7's layout (whose change to lime would compare runs of different tasks)."""
    task = {field: dataclasses.asdict(arithmetic.Task(field=field, count="operators", target="answer"))
            for field in ("mod", "int")}

    def run(router, seed, acc, field="mod"):
        return dict(router=router, task=task[field], seed=seed, acc_4=0.9, acc_5=0.8, acc_6=acc)

    mod = "| mod11-answer, tiers 4,5,6 operators |"
    table = tables.results_table([run("lime", 0, 0.5), run("lime", 1, 0.7), run("none", 0, 0.2)])
    assert f"{mod} lime | 2 | 90.0 ± 0.0 | 80.0 ± 0.0 | 60.0 ± 14.1 | - |" in table
    assert f"{mod} none | 1 | 90.0 | 80.0 | 20.0 | +40.0 |" in table
    # (a val loss that not every run has: no column of it)
    table = tables.results_table([{**run("lime", 0, 0.5), "val_loss": 0.3}, run("none", 0, 0.2, "int")])
    assert table.splitlines()[0] == "| regime | router | seeds | acc_4 | acc_5 | acc_6 | lime ahead, last tier (pts) |"
    assert f"{mod} lime | 1 | 90.0 | 80.0 | 50.0 | - |" in table
    assert "| int-answer, tiers 4,5,6 operators | none | 1 | 90.0 | 80.0 | 20.0 | - |" in table  # no lime of its own
    table = tables.results_table([run("none", 0, 0.2), run("none", 1, 0.4)])  # no lime at all: no such column
    assert table.splitlines()[0] == "| regime | router | seeds | acc_4 | acc_5 | acc_6 |"
    assert f"{mod} none | 2 | 90.0 ± 0.0 | 80.0 ± 0.0 | 30.0 ± 14.1 |" in table


def test_what_the_seeds_of_one_setting_may_differ_in():
    """As tables.py says: their seed, the run they start from (a fine-tune of each pretrained seed), how their length
    was given, and where and how each one ran. Anything else (lr, batch size, warm-up, the data's sizes: every other
    field of train.py's config) makes them two settings."""
    may = ["init_from", "epochs", "warmup_epochs", "data_dir", "device", "dtype", "compile", "stop_at", "log_interval",
           "micro_batch_size", "eval_interval"]
    first = dict(router="lime", preset="tiny", max_steps=10, lr=1e-3, seed=0, out_dir="a")
    for field in may:
        pair = [{**first, field: "a's"}, {**first, field: "b's", "seed": 1, "out_dir": "b"}]
        assert list(tables.by_setting(pair).values()) == [pair], field  # one setting, two seeds
    task = arithmetic.regime_of(arithmetic.Task(), 0, 100, 10)  # (one regime's label, other data: another setting)
    grouped = {"router", "preset", "max_steps"}  # (runs.seed_group's: rows apart, not refused)
    for field in sorted({f.name for f in dataclasses.fields(train.TrainConfig)} - {*may, "seed", "out_dir"} - grouped):
        a, b = (dict(task, train_size=n) for n in (100, 200)) if field == "task" else ("a's", "b's")
        rows = tables.by_setting([{**first, field: a}, {**first, field: b, "seed": 1, "out_dir": "b"}])
        assert [key[4][0][0][0].split(".")[0] for key in rows] == [field] * 2, field
        assert [len(runs) for runs in rows.values()] == [1, 1], field
