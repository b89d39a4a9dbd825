"""LIMe against the baseline over seeds and regimes of the arithmetic task (grid.py)."""

import io
import json
import math
import os
import re
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import arithmetic
import cli
import conftest
import grid
import methods
from conftest import PRUNABLE, error_of, snapshot


def test_grid_trains_every_router_and_seed_and_keeps_finished_runs(tmp_path, capsys, train_in_this_process):
    """Each regime, router and seed once (named twice too), every run's --eval-samples the grid's --test-size, every
    run in the tables; a run killed before its first checkpoint is started over; finished runs are kept, and checked
    against the command and their folder (another seed's summary is refused)."""
    args = ["--fields", "mod,mod", "--targets", "answer", "--tiers", "2,3", "--routers", "lime,none,lime",
            "--seeds", "1,1", "--train-size", "40", "--test-size", "6", "--epochs", "0.5", "--jobs", "2",
            "--out-dir", str(tmp_path / "out"), "--data-root", str(tmp_path / "data"),
            "--", "--n-layer=2", "--n-embd=16", "--n-head=2", "--n-kv-head=2", "--mlp-hidden=32", "--batch-size=8",
            "--micro-batch-size=8", "--log-interval=1"]
    (tmp_path / "data" / "mod11-answer-operators-2-3").mkdir(parents=True)  # a generation cut short: made again
    (tmp_path / "data" / "mod11-answer-operators-2-3" / "train.txt").write_text("1 + 1 = 2\n")
    arithmetic.mark_unfinished(tmp_path / "data" / "mod11-answer-operators-2-3", arithmetic.regime_of(  # (as left)
        arithmetic.Task(field="mod", target="answer", tiers=(2, 3), count="operators"), 0, 40, 6))
    killed = tmp_path / "out" / "mod11-answer-operators-2-3" / "lime-seed1"  # before its first checkpoint
    killed.mkdir(parents=True)
    (killed / "log.jsonl").write_text('{"step": 1, "loss": 3.2}\n')
    tables = grid.main(args)
    out = capsys.readouterr().out
    regime = tmp_path / "out" / "mod11-answer-operators-2-3"
    assert sorted(p.name for p in regime.iterdir()) == ["lime-seed1", "none-seed1"]
    for run in regime.iterdir():
        config = json.loads((run / "config.json").read_text())
        assert (config["vocab_size"], config["max_steps"], config["block_size"] % 8) == (24, 5, 0)  # 80 samples / 8 / 2
        rows = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
        assert config["eval_samples"] == 6 and [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
        assert json.loads((run / "summary.json").read_text())["task"]["field"] == "mod"
        assert "done:" in (run / "train.out").read_text()
    assert "grid: 2 runs, 0 finished before; 2 to go" in out and "[2/2]" in out
    assert "accuracy per tier (%), val split, one seed each:" in out  # (not "mean ± sd" over one seed)
    assert tables["val"].splitlines()[0] == ("| router | val loss | val acc_2 | val acc_3 | "
                                             "change to lime (val loss) | change to lime (val acc_2) | "
                                             "change to lime (val acc_3) |")  # (headed as a table over seeds)
    assert tables["test"].splitlines()[0] == ("| router | val loss | acc_2 | acc_3 | change to lime (val loss) | "
                                              "change to lime (acc_2) | change to lime (acc_3) |")  # (not val's)
    assert [row.split(" | ")[0] for row in tables["test"].splitlines()[2:]] == ["| lime", "| none"]  # every run
    before = snapshot(regime)
    assert grid.main(args) == tables and snapshot(regime) == before  # finished runs are kept, not redone
    assert "2 finished before; 0 to go" in capsys.readouterr().out
    other = [a if a != "0.5" else "1" for a in args]  # --epochs 1: not the budget those runs had
    assert f"{regime / 'lime-seed1'} is a finished run of --epochs 0.5, not 1: a finished run is kept, so give " \
        "another --out-dir" in error_of(grid.main, other, capsys)
    assert snapshot(regime) == before
    assert f"{regime / 'lime-seed1'} is a finished run of lr 0.001, not 0.01: a finished run is kept, so give " \
        "another --out-dir for other flags" in error_of(grid.main, [*args, "--lr=0.01"], capsys)  # before the others
    block = json.loads((regime / "lime-seed1" / "config.json").read_text())["block_size"]
    # what the grid fits to each regime's data, or derives from it, is compared too where the flags give it
    differ = {"--warmup-steps=2": "warmup_steps 0, not 2", "--warmup-epochs=0.2": "warmup_epochs 0.0, not 0.2",
              "--block=128": f"block_size {block}, not 128"}  # (abbreviated, as train.py takes it)
    for flag, says in differ.items():
        assert f"{regime / 'lime-seed1'} is a finished run of {says}: a finished run is kept" in \
            error_of(grid.main, [*args, flag], capsys)
    assert snapshot(regime) == before
    other = [a if a != "40" else "48" for a in args]  # other data, in a folder of the same name: the runs kept as if
    other[other.index("--data-root") + 1] = str(tmp_path / "data48")  # of it, without a word
    assert f"{regime / 'lime-seed1'} is a finished run on mod11-answer, tiers 2,3 operators (seed 0; 40 train, 6 " \
        "test, 6 val a tier), not the grid's mod11-answer, tiers 2,3 operators (seed 0; 48 train, 6 test, 6 val a " \
        "tier): a finished run is kept, so give another --out-dir for other data" in error_of(grid.main, other, capsys)
    assert snapshot(regime) == before and not (tmp_path / "data48").exists()
    lime, none = regime / "lime-seed1", regime / "none-seed1"  # damaged by hand: kept runs are checked, not trusted
    config = json.loads((lime / "config.json").read_text())
    for key, value in [("epochs", "0.5"), ("epochs", math.nan), ("epochs", -1.0), ("lr", "x"), ("lr", None),
                       ("warmup_epochs", None),  # (a null: was a run of other flags, exit 2)
                       ("task", {"tiers": [2, 3]}), ("task", {**config["task"], "seed": "x"})]:  # (not a regime)
        (lime / "config.json").write_text(json.dumps({**config, key: value}))
        assert error_of(grid.main, args, capsys, code=1).endswith(
            f"{lime / 'config.json'} is not what this repo writes: its {key!r} is {value!r}")
    for key, value, says in [("n_layer", "2", "n_layer must be an integer, got '2'"),  # (as sample.py reads them)
                             ("task", {}, "task: it names no tiers"),  # (was: a run of the default regime, exit 2)
                             ("task", {"tiers": "2"}, "task: tiers must be a list of whole numbers, got '2'"),
                             ("task", "x", "task must be a dict, got 'x'"),
                             ("task", [], "task must be a dict, got []")]:
        (lime / "config.json").write_text(json.dumps({**config, key: value}))
        assert error_of(grid.main, args, capsys, code=1) == \
            f"grid.py: error: {lime / 'config.json'}: in its saved config, {says}"
    (lime / "config.json").write_text(json.dumps(config))
    shutil.copytree(lime, tmp_path / "source")  # a run to start from: the kept one was trained from scratch
    lime_only = [a if a != "lime,none,lime" else "lime" for a in args] + [f"--init-from={tmp_path / 'source'}"]
    assert error_of(grid.main, lime_only, capsys).startswith(  # (not a damaged file: a null init_source is none)
        f"grid.py: error: {lime} is a finished run of init_from '', init_source None, not '{tmp_path / 'source'}', {{")
    (lime / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "warmup_epochs"}))
    assert f"{lime} is a finished run of warmup_epochs 0.0, not 0.2: a finished run is kept" in \
        error_of(grid.main, [*args, "--warmup-epochs=0.2"], capsys)  # (an older run's config: no warm-up in epochs)
    (lime / "config.json").write_text(json.dumps(config))
    kept = (none / "config.json").read_text()  # the second run alone of another setting: each kept run is checked
    (none / "config.json").write_text(json.dumps({**json.loads(kept), "batch_size": 16}))
    assert error_of(grid.main, args, capsys).endswith(f"{none} is a finished run of batch_size 16, not 8: a finished "
                                                      "run is kept, so give another --out-dir for other flags")
    (none / "config.json").write_text(kept)
    summary = json.loads((lime / "summary.json").read_text())
    (lime / "summary.json").write_text(json.dumps({**summary, "seed": 2, "config": {**summary["config"], "seed": 2}}))
    assert error_of(grid.main, args, capsys, code=1).endswith(  # (another seed's, copied here)
        f"{lime / 'summary.json'} is of router lime, seed 2, not of the run its folder is for: move it away")
    shutil.copy(none / "summary.json", lime / "summary.json")
    assert error_of(grid.main, args, capsys, code=1).endswith(
        f"{lime / 'summary.json'} is of router none, seed 1, not of the run its folder is for: move it away")
    (lime / "summary.json").unlink()  # a run stopped before its end goes on from its checkpoint: checked up front
    before = snapshot(regime)  # too (each run was refused as it started: "FAILED, exit 2: --resume: ...")
    assert error_of(grid.main, [a if a != "0.5" else "1" for a in args], capsys) == f"grid.py: error: {lime} is an " \
        "unfinished run of --epochs 0.5, not 1: a run goes on from its checkpoint, so give another --out-dir for " \
        "another budget"
    err = error_of(grid.main, [*args, "--eval-interval=3"], capsys)  # (what only train.py --resume refuses: asked)
    assert err.startswith(f"grid.py: error: train.py, as the grid runs it: --resume: {lime / 'ckpt.pt'} was trained "
                          "with eval_interval=") and err.endswith(" (not 3)")
    assert snapshot(regime) == before
    (lime / "ckpt.pt").write_bytes(b"")  # train.py's exit code too: 1, the folder's fault, not the command's
    assert error_of(grid.main, args, capsys, code=1) == f"grid.py: error: train.py, as the grid runs it: --resume: " \
        f"{lime / 'ckpt.pt'} is empty (cut short while it was written?)"
    # removed by hand (the summary too): the log holds the run's evaluations, its curves, which the grid deleted as it
    (lime / "ckpt.pt").unlink()  # started the run over (--overwrite); train.py alone refuses, and so does the grid now
    before = snapshot(regime)
    assert error_of(grid.main, args, capsys) == f"grid.py: error: {lime} holds a run that evaluated (its log.jsonl) " \
        "but no checkpoint to go on from: move it away for the grid to train it anew, or give another --out-dir"
    assert snapshot(regime) == before
    assert grid.going_on(lime) == []  # (as the grid launches a run: one that became so meanwhile, left to train.py)


def test_grid_runs_each_seed_of_each_router(tmp_path, train_in_this_process, monkeypatch):
    got = []
    monkeypatch.setattr(grid, "run_grid", lambda runs, args, extra: got.extend(runs) or {})
    grid.main(["--fields", "mod", "--targets", "answer", "--tiers", "2", "--train-size", "40", "--test-size", "6",
               "--routers", "lime,none,hc,hc-4,lime", "--seeds", "2,1,2", "--out-dir", str(tmp_path / "out"),
               "--data-root", str(tmp_path / "data")])
    assert [(name, router, seed) for name, router, seed, *_ in got] == [  # (hc-4 is hc: one method, run once)
        ("mod11-answer-operators-2", router, seed) for router in ("lime", "none", "hc") for seed in (2, 1)]
    assert methods.distinct(["first-2", "hc-static-4", "first-2", "hc-static", "first-3"]) == [
        "first-2", "hc-static-4", "first-3"]


def fake_runs(monkeypatch, polls=1, fails=()):
    """Stands in for subprocess.Popen in run_grid: each run ends at its `polls`-th poll, having written its summary
    (acc_2 seed / 10, val_acc_2 seed / 20, val_loss 1) and a line to its train.out; the seeds in `fails` exit 1.
    -> (how many ran as each one started, the thread counts the runs were given)."""
    running, most, threads = [], [], set()

    class Run:
        def __init__(self, cmd, stdout, stderr, env, preexec_fn):
            flags = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)
            self.out, self.seed, self.router, self.log = Path(flags["out-dir"]), int(flags["seed"]), flags["router"], \
                stdout
            self.polls, self.returncode = 0, None
            running.append(self)
            most.append(len(running))
            threads.add(env["OMP_NUM_THREADS"])

        def poll(self):
            self.polls += 1
            if self.polls == polls:
                running.remove(self)
                summary = dict(router=self.router, seed=self.seed, acc_2=self.seed / 10, val_acc_2=self.seed / 20,
                               val_loss=1.0)
                (self.out / "summary.json").write_text(json.dumps(summary))
                self.log.write("train.py: error: in use\n" if self.seed in fails else "done\n")
                self.returncode = int(self.seed in fails)
            return self.returncode

    monkeypatch.setattr(grid.subprocess, "Popen", Run)
    monkeypatch.setattr(grid.time, "sleep", lambda seconds: None)
    return most, threads


def test_grid_runs_jobs_at_a_time_and_tables_its_seeds(tmp_path, capsys, monkeypatch):
    """--jobs runs at once, never more; each run's summary in the tables, the validation split's first."""
    most, _ = fake_runs(monkeypatch)
    args = SimpleNamespace(out_dir=str(tmp_path / "out"), jobs=2, epochs=1.0, test_size=2)
    runs = [("regime", router, seed, tmp_path / "data", 16, 24) for router, seed in (("lime", 1), ("lime", 2),
                                                                                       ("none", 1))]
    tables = grid.run_grid(runs, args, [])
    assert max(most) == 2 and len(most) == 3
    out = capsys.readouterr().out
    assert out.index("val split, mean ± sd over seeds:") < out.index("test split, mean ± sd over seeds:")
    assert "|  | lime | 2 | 1.000 ± 0.000 | 7.5 ± 3.5 | - |" in tables["val"].splitlines()
    assert "|  | none | 1 | 1.000 | 10.0 | +5.0 |" in tables["test"].splitlines()


def test_a_grid_gives_each_run_the_thread_count_the_user_set(tmp_path, capsys, monkeypatch):
    """An OMP_NUM_THREADS of the user's own is each run's, as train.py run alone would take it, not cores / --jobs;
    one that is not a count of threads is not passed on."""
    _, threads = fake_runs(monkeypatch)
    for own, given in (("3", "3"), ("0", str(os.cpu_count() or 1)), ("x", str(os.cpu_count() or 1))):
        monkeypatch.setenv("OMP_NUM_THREADS", own)
        threads.clear()
        args = SimpleNamespace(out_dir=str(tmp_path / f"out-{own}"), jobs=1, epochs=1.0, test_size=2)
        grid.run_grid([("regime", "lime", 1, tmp_path / "data", 16, 24)], args, [])
        assert threads == {given} and f"1 at a time on {given} thread(s) each" in capsys.readouterr().out


def test_a_regime_with_too_few_expressions_leaves_no_folder_behind(tmp_path, capsys, refused):
    """mod 3, one operator: 33 expressions, too few for 30 unseen ones in each scored split. Found as the data is
    generated, after the checks: one line, exit 2, and the folders the grid made for it are gone again."""
    args = ["--fields", "mod", "--modulus", "3", "--targets", "answer", "--tiers", "1", "--train-size", "5",
            "--test-size", "30", "--out-dir", str(tmp_path / "out"), "--data-root", str(tmp_path / "data" / "root")]
    (tmp_path / "data").mkdir()  # there before: it stays
    assert error_of(grid.main, args, capsys) == "grid.py: error: tier 1 has too few distinct expressions for 30 " \
        "unseen ones: lower --test-size or --train-size"
    assert snapshot(tmp_path) == {tmp_path: None, tmp_path / "data": None}


def test_grid_refuses_a_data_folder_of_another_regime(arith_dir, tmp_path, capsys, refused):
    shutil.copytree(arith_dir, tmp_path / "int-steps-operands-4-5-6")  # 100 samples a tier, not the grid's 20000
    before = snapshot(tmp_path)
    err = error_of(grid.main, ["--fields", "int", "--targets", "answer,steps", "--count", "operands", "--tiers",
                               "4,5,6", "--data-root", str(tmp_path), "--out-dir", str(tmp_path / "out")], capsys)
    assert err.startswith("grid.py: error: ") and "holds other arithmetic data" in err and "--data-root" in err
    assert snapshot(tmp_path) == before


def test_grid_refuses_files_of_anothers_where_its_data_goes(tmp_path, capsys, refused):
    """Files by the data's names, no meta.json, and no marker of a generation cut short: someone else's, kept
    (they were replaced by the regime's data without a word)."""
    regime = tmp_path / "data" / "mod11-answer-operators-2"
    regime.mkdir(parents=True)
    (regime / "train.txt").write_text("my own lines\n")
    before = snapshot(tmp_path)
    assert error_of(grid.main, ["--fields", "mod", "--targets", "answer", "--tiers", "2", "--train-size", "40",
                                "--test-size", "6", "--data-root", str(tmp_path / "data"), "--out-dir",
                                str(tmp_path / "out")], capsys) == \
        f"grid.py: error: {regime} holds train.txt but no meta.json, and not as data this code was writing: move " \
        "them away, or give another --data-root"
    assert snapshot(tmp_path) == before
    (regime / "train.txt").unlink()
    (regime / "meta.json").symlink_to(tmp_path / "nowhere")  # a link to nowhere: not a file, and said so
    assert error_of(grid.main, ["--fields", "mod", "--targets", "answer", "--tiers", "2", "--train-size", "40",
                                "--test-size", "6", "--data-root", str(tmp_path / "data"), "--out-dir",
                                str(tmp_path / "out")], capsys, code=1) == \
        f"grid.py: error: {regime / 'meta.json'} is not a file but the data's files go by that name: move it away"
    assert (regime / "meta.json").is_symlink() and not (tmp_path / "out").exists()


def test_grid_refuses_a_data_folder_whose_lines_were_edited(tmp_path, capsys, refused):
    regime = tmp_path / "data" / "mod11-answer-operators-2"  # the grid's data, made before, then a line edited by hand
    arithmetic.prepare(regime, arithmetic.Task(field="mod", count="operators", target="answer", tiers=(2,)), 0, 40, 6)
    lines = (regime / "train.txt").read_text().splitlines()
    (regime / "train.txt").write_text("\n".join([*lines[:6], lines[7], lines[6], *lines[8:]]) + "\n")
    before = snapshot(tmp_path)
    assert error_of(grid.main, ["--fields", "mod", "--targets", "answer", "--tiers", "2", "--train-size", "40",
                                "--test-size", "6", "--data-root", str(tmp_path / "data"), "--out-dir",
                                str(tmp_path / "out")], capsys, code=1).endswith(
        f"{regime} holds other lines than this code makes of the data its meta.json names, mod11-answer, tiers 2 "
        "operators (seed 0; 40 train, 6 test, 6 val a tier) (edited, or made by another version): line 7 of its "
        "train.txt: move it away to have it made again")
    assert snapshot(tmp_path) == before


def test_a_run_that_fails_is_named_whatever_its_output_holds(tmp_path, capsys, train_in_this_process):
    """A run whose train.out holds bytes that are not UTF-8 (damaged, then appended to): its last line, not a traceback
    with the other runs left training."""
    run = tmp_path / "out" / "mod11-answer-operators-2" / "lime-seed1"
    run.mkdir(parents=True)
    (run / "train.out").write_bytes(b"\xff\xfe\n")
    (run / "ckpt.pt").write_bytes(b"")  # an unfinished run's checkpoint, cut short: its --resume fails
    with pytest.raises(SystemExit) as e:
        grid.main(["--fields", "mod", "--targets", "answer", "--tiers", "2", "--train-size", "40", "--test-size", "6",
                   "--routers", "lime", "--seeds", "1", "--data-root", str(tmp_path / "data"), "--out-dir",
                   str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and err == "grid.py: error: 1 run(s) failed: mod11-answer-operators-2 lime seed 1 (see " \
        "train.out in each); once the cause is mended, run the same command again to go on\n"
    assert f"FAILED, exit 1: train.py: error: --resume: {run / 'ckpt.pt'} is empty" in out


def test_a_run_finished_by_hand_while_the_grid_waited_for_it_is_kept(tmp_path, capsys, monkeypatch):
    """A run killed before its first checkpoint is started over (--overwrite), but that is decided as the grid launches
    it: a train.py run by hand there while the grid trained the one before it, and finished, is kept, not deleted."""
    args = ["--fields", "mod", "--targets", "answer", "--tiers", "2", "--train-size", "40", "--test-size", "6",
            "--routers", "lime,none", "--seeds", "1", "--epochs", "0.5", "--jobs", "2", "--out-dir",
            str(tmp_path / "out"), "--data-root", str(tmp_path / "data"), "--", "--n-layer=2", "--n-embd=16",
            "--n-head=2", "--n-kv-head=2", "--mlp-hidden=32", "--batch-size=8", "--micro-batch-size=8"]
    by_hand = tmp_path / "out" / "mod11-answer-operators-2" / "none-seed1"
    by_hand.mkdir(parents=True)
    (by_hand / "log.jsonl").write_text('{"step": 1, "loss": 3.2}\n')  # killed before its first checkpoint
    launched, before = [], {}

    class AndOneByHand(conftest.TrainInThisProcess):  # as the grid trains its first run, the second one is run by hand
        def __init__(self, cmd, **kwargs):
            if not launched:
                # the grid's command of the other run: its router and folder, nothing else (a path may hold "lime": CI's
                # python is /tmp/lime-ci-venv/bin/python)
                other = {"--router=lime": "--router=none",
                         f"--out-dir={by_hand.parent / 'lime-seed1'}": f"--out-dir={by_hand}"}
                hand = [other.get(a, a) for a in cmd] + ["--overwrite"]
                assert conftest.train_here(hand, io.StringIO()) == 0 and (by_hand / "summary.json").exists()
                before.update(snapshot(by_hand))
            launched.append(cmd)
            super().__init__(cmd, **kwargs)

    monkeypatch.setattr(grid.subprocess, "Popen", AndOneByHand)
    monkeypatch.setattr(grid.subprocess, "run", conftest.check_here)
    grid.main(args)
    out = capsys.readouterr().out
    assert len(launched) == 1 and "] mod11-answer-operators-2 none seed 1: finished by another process meanwhile: " \
        "kept" in out
    assert snapshot(by_hand) == before and "| none |" in out  # its files as it left them, and in the tables


def test_a_grid_refuses_an_out_dir_that_another_grid_runs_in(tmp_path, capsys, refused):
    """Two grids with one --out-dir at once started the same runs twice: each a second time once the other's had
    ended (over it), or refused as "in use" with the other run's last line of their shared train.out as its reason.
    The second grid is refused before it starts a run, as the grid's folder, not as its first run's that the other
    grid trains (train.py's "in use", as the grid checks that run's flags); the first one's runs are its own."""
    out = tmp_path / "out"
    run = out / "mod11-answer-operators-2" / "lime-seed1"
    run.mkdir(parents=True)
    held = [cli.hold_folder(folder, "a test") for folder in (out, run)]  # (another process's grid, and its run)
    try:
        err = error_of(grid.main, ["--fields", "mod", "--targets", "answer", "--tiers", "2", "--train-size", "40",
                                   "--test-size", "6", "--routers", "lime", "--seeds", "1", "--data-root",
                                   str(tmp_path / "data"), "--out-dir", str(out)], capsys)
    finally:
        for fd in held:
            os.close(fd)
    assert err == f"grid.py: error: {out} is in use by another process (a grid.py still running there? wait for it " \
        "to end, or give another --out-dir)"
    assert list(run.iterdir()) == [] and not (tmp_path / "data").exists()  # (nor its data made)


@pytest.mark.parametrize("flags, message", [
    (["--", "--batch-size=abc"], "train.py, as the grid runs it: argument --batch-size: invalid int value: 'abc'"),
    (["--", "--lr=0"], "train.py, as the grid runs it: --lr must be positive, got 0"),
    (["--", "--resume"], "the flags for train.py: --resume: the grid decides it run by run (a finished run is kept, "
                         "an unfinished one resumes, one that never saved starts over)"),
    (["--", "--over"], "the flags for train.py: --overwrite: the grid decides it run by run"),  # (it ran the grid)
    (["--epochs", "nan"], "--jobs, --epochs, --train-size and --test-size must be positive (--epochs finite)"),
    (["--seeds", "1,99999999999999999999"], "--seeds must be at most 2**63 - 1, got 99999999999999999999"),
    (["--", "--see=5"], "the flags for train.py: --seed is the grid's to set, run by run"),  # an abbreviation too
    (["--", "--max-steps=5"], "the flags for train.py: --max-steps: the grid sets every run's length, with --epochs"),
    (["--", "--dry-run"], "the flags for train.py: --dry-run: the grid runs every run to its end"),
    (["--", "--dry"], "the flags for train.py: --dry-run: the grid runs every run to its end"),  # as train.py reads it
    (["--", "--stop-at", "3"], "the flags for train.py: --stop-at: the grid runs every run to its end"),
    (["--", "--data=prosqa"], "the flags for train.py: --data: the grid trains on the arithmetic regimes it makes"),
    (["--", "--epochs=3", "--out-dir=x"], "the flags for train.py: --out-dir, --epochs is the grid's to set"),
    (["--routers", "lime,bogus"], "--routers: unknown router 'bogus'"),
    (["--seeds", "1,-1"], "--seeds must be >= 0, got -1"),
    (["--routers", "lime,none", "--", "--router-top-p=0.9", "--prune-at=1"],
     "train.py, as the grid runs it: --router-top-p applies to routers whose weights() is a learned Parameter "
     f"itself, the same at every token ({PRUNABLE}), not --router=none"),
    # (each router's flags are checked)
])
def test_grid_checks_everything_before_it_writes(tmp_path, capsys, refused, flags, message):
    """The flags after -- too, by train.py's own --dry-run: one line, exit 2, no data generated, no run started."""
    args = ["--fields", "mod", "--targets", "answer", "--tiers", "2,3", "--out-dir", str(tmp_path / "out"),
            "--data-root", str(tmp_path / "data"), *flags]
    assert message in error_of(grid.main, args, capsys)
    assert list(tmp_path.iterdir()) == []


def test_flags_that_a_regimes_data_refuses_are_refused_before_any_run(tmp_path, capsys, refused):
    """A --block-size after '--' that a regime's samples do not fit (or a --vocab-size its vocabulary): train.py's
    dry run says so, naming the regime, once its data is there: a regime's made now before a run starts or a
    train.out is written (the data kept for the next command), one's already there before anything is written."""
    args = ["--fields", "mod", "--targets", "answer,steps", "--tiers", "2", "--train-size", "40", "--test-size", "6",
            "--out-dir", str(tmp_path / "out"), "--data-root", str(tmp_path / "data")]
    steps = "mod11-steps-operators-2"  # (the answer regime's samples, of 10 tokens, fit a block of 12; its, of 14, not)
    line = f"grid.py: error: train.py, as the grid runs it on {steps}: a sample of 14 tokens does not fit " \
        "--block-size=12"
    for targets in ("steps", "answer,steps"):  # (the second: the answer regime's data is not made either)
        assert error_of(grid.main, [*args[:3], targets, *args[4:], "--", "--block-size=12"], capsys) == line
        assert not (tmp_path / "out").exists() and [p.name for p in (tmp_path / "data").iterdir()] == [steps]
    assert f"on {steps}: --vocab-size=8 is smaller than the arithmetic vocabulary (19)" in error_of(
        grid.main, [*args, "--", "--vocab-size=8"], capsys)
    held = cli.hold_folder(tmp_path / "data" / steps, "a test")  # (prepare_data.py, writing it: no data to check yet)
    try:
        assert error_of(grid.main, [*args, "--", "--block-size=12"], capsys) == f"grid.py: error: {tmp_path / 'data'}" \
            f"/{steps} is in use by another process (a prepare_data.py preparing it? wait for it to end)"
    finally:
        os.close(held)
    assert not (tmp_path / "out").exists() and [p.name for p in (tmp_path / "data").iterdir()] == [steps]


def test_a_run_that_starts_from_another_model_keeps_its_vocabulary():
    """The grid fits each run's block and vocabulary to its regime; but a model that --init-from (after '--') starts
    from has a vocabulary of its own, which train.py refuses to see another of: the block alone is fitted then."""
    args = SimpleNamespace(epochs=1.0, test_size=6)
    for extra, fitted in (([], ["--block-size=16", "--vocab-size=24"]), (["--init-from=run"], ["--block-size=16"])):
        cmd = grid.train_command("lime", 1, Path("data"), Path("out"), args, extra, (16, 24))
        assert [a for a in cmd if a.startswith(("--block-size", "--vocab-size"))] == fitted


def test_each_run_is_a_process_of_its_own_under_a_launcher_too(monkeypatch):
    """A launcher's RANK (or torchrun's, around grid.py) would make every run a rank of one distributed job."""
    for name, value in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", MASTER_PORT="29500", KEEP="me").items():
        monkeypatch.setenv(name, value)
    env = grid.alone(OMP_NUM_THREADS="2")
    assert (env["KEEP"], env["OMP_NUM_THREADS"]) == ("me", "2")
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"} & set(env)


def test_modulus_sets_the_mod_field_alone():
    """--modulus with int and mod: the int regime is the int data there is, which prepare_data.py makes."""
    args = SimpleNamespace(fields="int,mod", targets="steps", count="operators", tiers="4,5,6", modulus=7)
    tasks = dict(grid.regimes(args))
    assert tasks["int-steps-operators-4-5-6"] == arithmetic.Task(field="int", count="operators", target="steps")
    assert tasks["mod7-steps-operators-4-5-6"].modulus == 7


@pytest.mark.skipif(grid.LIBC is None, reason="PR_SET_PDEATHSIG is Linux's")
def test_a_grid_killed_where_it_cannot_pass_a_signal_on_takes_its_runs_with_it(grid_and_its_run):
    """kill -9 of the grid: each run it launched gets SIGTERM from the kernel (train.py saves a checkpoint on it), not
    left training alone, where the grid run again would find it "in use". (The grid and its run: conftest's.)"""
    the_grid, got = grid_and_its_run
    assert the_grid.stdout.readline() == b"ready\n"  # its run is running
    the_grid.kill()
    the_grid.wait()
    for _ in range(100):
        if got.exists() and got.read_text():  # (made, then written: not read between the two)
            break
        time.sleep(0.1)
    assert got.read_text() == "term"


def test_a_grid_runs_jobs_at_a_time_and_a_run_that_exits_non_zero_failed(tmp_path, capsys, monkeypatch):
    """At most --jobs runs at once, each on its share of the cores; each run's line counts it and gives its test and
    val accuracies; a run that exits non-zero failed, even with a summary.json there (a train.py run by hand that
    finished while the grid's run was refused): named, and the grid exits 1."""
    most, threads = fake_runs(monkeypatch, polls=3, fails={3})
    monkeypatch.delenv("OMP_NUM_THREADS")  # (conftest.py sets it for the tests)
    args = SimpleNamespace(out_dir=str(tmp_path / "out"), jobs=2, epochs=1.0, test_size=2)
    with pytest.raises(SystemExit) as e:
        grid.run_grid([("regime", "lime", seed, tmp_path / "data", 16, 24) for seed in range(1, 6)], args, [])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and err == "grid.py: error: 1 run(s) failed: regime lime seed 3 (see train.out in " \
        "each); once the cause is mended, run the same command again to go on\n"
    assert len(most) == 5 and max(most) == 2 and threads == {str(max(1, (os.cpu_count() or 1) // 2))}
    lines = [re.sub(r" \(\d+\.\d min\)$", "", line) for line in out.splitlines() if line.startswith("[")]
    assert lines == [f"[{n}/5] regime lime seed {n}: test {10 * n}.0%, val {5 * n}.0%" if n != 3 else
                     "[3/5] regime lime seed 3: FAILED, exit 1: train.py: error: in use" for n in range(1, 6)]


@pytest.mark.parametrize("stop", ["signal", "closed output"])
def test_a_signal_to_the_grid_reaches_its_runs_and_waits_for_them(tmp_path, capsys, stop):
    """SIGTERM (a scheduler, `kill`) or Ctrl-C: grid.py passes it on to every run (train.py saves a checkpoint) and
    waits for them, so that none trains on alone, where the same command run again would start it a second time; a
    second signal while it waits waits too. So too when what reads its output closes it (`grid.py | head`), which it
    finds when it next prints."""
    runs = []

    class Training:  # stands in for subprocess.Popen: a run that trains until it is signalled
        def __init__(self, cmd, stdout, stderr, env, preexec_fn):
            self.returncode, self.signals = None, []
            runs.append(self)

        def poll(self):
            if len(runs) == 2 and not self.signals:  # both runs started: the grid is told to stop
                if stop == "signal":
                    os.kill(os.getpid(), signal.SIGTERM)
                elif self is runs[0]:
                    self.returncode = 1  # (a run that ends: the grid prints a line, and its output is gone)
            return self.returncode

        def send_signal(self, signum):
            self.signals.append(signum)

        def wait(self):
            if self is next(r for r in runs if r.signals):  # impatient: a second signal, while the runs save
                os.kill(os.getpid(), signal.SIGTERM)  # (after either stop: a closed output's too)
            self.returncode = 128 + self.signals[0]

    args = SimpleNamespace(out_dir=str(tmp_path / "out"), jobs=2, epochs=1.0, test_size=2)
    grid_runs = [("regime", router, 1, tmp_path / "data", 16, 24) for router in ("lime", "none")]
    def as_ctrl_c(signum, frame):  # (SIGTERM not handled by the grid is a failed test, not a killed pytest)
        raise KeyboardInterrupt

    previous, ended = signal.signal(signal.SIGTERM, as_ctrl_c), None
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(grid.subprocess, "Popen", Training)
            if stop == "closed output":
                def closed(*line, **kwargs):  # the header goes out; the next line finds the reader gone
                    if line[0].startswith("["):
                        raise BrokenPipeError
                m.setattr(grid, "print", closed, raising=False)
            try:  # (a BrokenPipeError: then one_line_errors exits 141 without a word)
                grid.run_grid(grid_runs, args, [])
            except (SystemExit, BrokenPipeError, KeyboardInterrupt) as e:  # (a KeyboardInterrupt would end the session)
                ended = e
        assert signal.getsignal(signal.SIGTERM) is as_ctrl_c  # the grid's handler is gone again
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert isinstance(ended, SystemExit if stop == "signal" else BrokenPipeError), ended
    if stop == "closed output":  # the run still training is stopped and waited for
        assert runs[0].signals == [] and runs[1].signals == [signal.SIGTERM] and runs[1].returncode == 143
        return
    assert ended.code == 143 and [r.signals for r in runs] == [[signal.SIGTERM]] * 2
    assert all(r.returncode == 143 for r in runs)  # each waited for
    assert capsys.readouterr().err == "grid.py: interrupted (SIGTERM); run the same command again to go on\n"
