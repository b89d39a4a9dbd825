"""The Arithmetic Expression Task (arithmetic.py): every sample checked by an evaluator of its own,
the files, the rows training reads, and old data folders."""

import contextlib
import dataclasses
import errno
import filecmp
import json
import operator
import os
import re
import shlex
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import arithmetic
import cli
import prepare_data
import runs
from cli import DataError, UsageError
from conftest import ANSWERS, error_of, snapshot
from data import evaluate, evaluate_loss
from lime import GPT, GPTConfig

def evaluate_text(text, modulus=None):
    """An independent evaluator for the task's text: precedence, and either exact division and no
    negatives, or arithmetic mod a prime with division by Fermat's inverse b^(P-2)."""
    tokens = text.split()
    pos = 0
    top = arithmetic.Task().max_value if modulus is None else modulus - 1

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
    data = arithmetic.generate(arithmetic.Task(), seed=1, train_size=300, test_size=100)
    assert sorted(data) == ["test_4", "test_5", "test_6", "train", "val_4", "val_5", "val_6"]
    slack = []
    for name, lines in data.items():
        for line in lines:
            steps = line.split(" = ")
            answer, n_prompt = int(steps[-1]), len(steps[0].split()) + 1
            n_ops = [sum(t in arithmetic.OPS for t in s.split()) for s in steps]
            assert n_ops[0] in (3, 4, 5) and n_ops[-1] == 0
            assert all(a - b == 1 for a, b in zip(n_ops, n_ops[1:]))  # one operation per step
            assert all(evaluate_text(s) == answer for s in steps)
            assert arithmetic.split_sample(line) == (steps[0] + " =", answer)
            slack.append(arithmetic.Task().most_new_tokens(steps[0] + " =") - (len(line.split()) - n_prompt + 1))
    assert min(slack) == 0  # the bound on a solution's length (<eos> included) holds, and is tight
    assert {sum(t in arithmetic.OPS for t in l.split(" = ")[0].split()) + 1 for l in data["test_6"]} == {6}
    train = {l.split(" = ")[0] for l in data["train"]}
    tests = [l.split(" = ")[0] for n in (4, 5, 6) for split in ("test", "val") for l in data[f"{split}_{n}"]]
    assert not train & set(tests) and len(set(tests)) == len(tests)
    assert any("/" in l.split(" = ")[0] for l in data["train"]) and any("(" in l for l in data["train"])


def test_arithmetic_files_are_deterministic_and_load(tmp_path, capsys):
    prepare_data.main(["arithmetic", "--data-dir", str(tmp_path / "a"), "--train-size", "200", "--test-size", "20"])
    prepare_data.main(["arithmetic", "--data-dir", str(tmp_path / "b"), "--train-size", "200", "--test-size", "20"])
    tiers = arithmetic.DEFAULTS["tiers"]
    names = ["meta.json", "train.txt", *(f"{split}_{n}.txt" for split in ("test", "val") for n in tiers)]
    assert filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)[0] == names
    task = arithmetic.Task(**arithmetic.DEFAULTS)  # one seed, one data set; another seed, another
    seeded = [arithmetic.generate(task, seed, 20, 2) for seed in (1, 1, 0)]
    assert seeded[0] == seeded[1] != seeded[2]
    vocab, splits, task, _ = arithmetic.load(tmp_path / "a")
    assert task == arithmetic.Task(**arithmetic.DEFAULTS)
    capsys.readouterr()  # --show K: K training samples, spread over the file, so that every tier shows
    prepare_data.main(["arithmetic", "--data-dir", str(tmp_path / "c"), "--tiers", "4,5,6", "--train-size", "30",
                       "--test-size", "2", "--show", "3"])
    shown = [l for l in capsys.readouterr().out.splitlines() if " = " in l]
    assert len(shown) == 3 and all(evaluate_text(l.split(" = ")[0]) == int(l.split()[-1]) for l in shown)
    assert [len(re.findall(r"\d+", l.split(" = ")[0])) - 1 for l in shown] == [4, 5, 6]  # (operators: numbers - 1)
    line = splits[f"test_{tiers[-1]}"][0]
    assert vocab.decode(vocab.encode(line)) == line and len(splits["train"]) == 200 * len(tiers)
    with pytest.raises(DataError, match="'1000' is not in the task vocabulary"):
        vocab.encode("1000 + 1")


@pytest.mark.parametrize("target", ["steps", "answer"])
def test_mod_samples_check_out_with_an_independent_evaluator(target):
    P = 11
    task = arithmetic.Task(field="mod", modulus=P, count="operators", tiers=(2, 4, 6), target=target)
    data = arithmetic.generate(task, seed=3, train_size=300, test_size=50)
    divisions = 0
    for name, lines in data.items():
        for line in lines:
            steps = line.split(" = ")
            answer = int(steps[-1])
            n_ops = [sum(t in "+-*/" for t in step.split()) for step in steps]
            assert n_ops[0] in (2, 4, 6) and (name == "train" or n_ops[0] == int(name[-1]))  # tiers count operators
            assert all(evaluate_text(step, P) == answer for step in steps)
            assert len(line.split()) - len(steps[0].split()) - 1 + (target == "steps") <= \
                task.most_new_tokens(steps[0] + " =")  # what follows '=', with <eos> after a solution
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
    with pytest.raises(DataError, match="divides by 0"):
        task.parse("3 / ( 2 - 2 )")
    with pytest.raises(DataError, match="11 is out of the task's range 0..10"):
        task.parse("11 + 1")


def test_answer_target_loss_covers_only_the_answer(tmp_path):
    task = arithmetic.Task(field="mod", count="operators", tiers=(2, 3), target="answer")
    arithmetic.prepare(tmp_path, task, seed=0, train_size=40, test_size=5)
    data = arithmetic.Data(SimpleNamespace(data_dir=str(tmp_path), block_size=24, eval_samples=5, preset="arith",
                                           task=None))
    assert task.most_new_tokens("1 + 2 * 3 =") == 1 and sorted(data.vals) == [2, 3]  # the answer: one token
    lines = (tmp_path / "train.txt").read_text().splitlines()
    x, y = data.collate([data.encode_row(line) for line in lines])
    for line, xi, yi in zip(lines, x, y):
        expr, answer = line.split(" = ")
        n = len(expr.split()) + 1  # the prompt: the expression and '='
        assert yi.tolist() == [-1] * (n - 1) + [data.vocab.stoi[answer]] + [-1] * (24 - n)
        assert data.vocab.decode(xi[:n].tolist()) == expr + " ="
    steps = arithmetic.Data(SimpleNamespace(data_dir=str(tmp_path), block_size=24, eval_samples=5, preset="arith",
                                            task=None))
    steps.task = dataclasses.replace(task, target="steps")  # the same rows as solutions end with <eos>, learned too
    assert [t for t in steps.collate([steps.encode_row(lines[0])])[1][0].tolist() if t >= 0][-1] == steps.vocab.eos
    # the validation loss is the mean over the scored tokens alone (an answer each), in micro-batches of any size
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=32, block_size=24, vocab_size=64))
    x, y = data.collate(data.val)
    scored = y >= 0  # (rows, 24): one True a row
    want = F.cross_entropy(model(x)[0][scored], y[scored])
    assert scored.sum(1).eq(1).all() and evaluate_loss(model, data, 3, "cpu", contextlib.nullcontext()) == \
        pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("folder", ["arith_dir", "answer_dir"])
def test_a_batch_is_its_rows_collated_one_by_one(folder, request):
    """batch() cuts its rows from one table of every training row: the tensors collate() makes of the same rows
    (the same draws of the generator), with the longest sample filling the block to its last token, or not; for
    solutions, which end with the end token, and for answers, which end with the number, not the padding."""
    arith_dir = request.getfixturevalue(folder)
    longest = arithmetic.Data(SimpleNamespace(data_dir=str(arith_dir), block_size=128, eval_samples=1, task=None,
                                              preset="arith")).longest
    for block in (longest - 1, longest + 5):
        data = arithmetic.Data(SimpleNamespace(data_dir=str(arith_dir), block_size=block, eval_samples=1,
                                               preset="arith", task=None))
        for seed in range(3):
            x, y = data.batch(np.random.default_rng(seed), 256)
            rows = [data.train[i] for i in np.random.default_rng(seed).integers(0, len(data.train), 256)]
            want_x, want_y = data.collate(rows)
            assert x.dtype == want_x.dtype and torch.equal(x, want_x) and torch.equal(y, want_y)
        assert (y[:, -1] >= 0).any() == (block == longest - 1)  # some row ends with the block's last position


def test_a_data_folder_from_before_the_knobs_loads_as_it_was(tmp_path, capsys):
    """meta.json used to hold only the vocabulary, seed and sizes, and there was no validation split."""
    args = ["arithmetic", "--data-dir", str(tmp_path), "--field=int", "--count=operands", "--target=steps",
            "--tiers=4,5,6", "--train-size", "30", "--test-size", "4"]
    prepare_data.main(args)
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({k: meta[k] for k in ("vocab", "seed", "train_size", "test_size")}))
    for p in tmp_path.glob("val_*.txt"):
        p.unlink()
    capsys.readouterr()
    prepare_data.main(args)  # the same data (compared line by line), but for the validation split it never had
    assert "holds this data already" in capsys.readouterr().out and not list(tmp_path.glob("val_*.txt"))
    cfg = SimpleNamespace(data_dir=str(tmp_path), block_size=64, eval_samples=4, preset="arith", task=None)
    data = arithmetic.Data(cfg)
    assert data.task == arithmetic.Task() and data.task.name == "int-steps" and data.vals == {}
    assert data.val == [data.encode_row(line) for n in (4, 5, 6) for line in data.tests[n]]  # val loss on test
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_kv_head=2, n_embd=16, mlp_hidden=32, block_size=64, vocab_size=1024))
    metrics = evaluate(model, model, data, 8, "cpu", contextlib.nullcontext())
    assert sorted(metrics) == ["acc_4", "acc_5", "acc_6", "val_loss", "val_ppl"]
    # with no validation accuracy to steer by, the test's is reported at every evaluation, not at the end alone
    data.accuracy = lambda model, lines, *args, **kw: len(lines) / 100  # (its 4 lines a tier, not generated again)
    assert data.metrics(model, "cpu", final=False) == dict(acc_4=0.04, acc_5=0.04, acc_6=0.04)


def test_a_solution_carries_out_the_leftmost_operation_it_can_at_each_step():
    task = arithmetic.Task()  # the default regime: int, step by step
    assert task.solution(arithmetic.parse_tree("( 1 + 2 ) * ( 3 + 4 ) - 5")) == \
        "( 1 + 2 ) * ( 3 + 4 ) - 5 = 3 * ( 3 + 4 ) - 5 = 3 * 7 - 5 = 21 - 5 = 16"
    assert task.solution(arithmetic.parse_tree("8 - ( 3 - 2 )")) == "8 - ( 3 - 2 ) = 8 - 1 = 7"


def test_validation_rows_are_the_first_eval_samples_of_each_tier(answer_dir):
    """--eval-samples n: accuracy (test and validation) and the validation loss read the first n samples of a tier."""
    data = arithmetic.Data(SimpleNamespace(data_dir=str(answer_dir), block_size=24, eval_samples=3, preset="arith",
                                           task=None))
    split = {name: (answer_dir / f"{name}.txt").read_text().splitlines()[:3]
             for n in data.task.tiers for name in (f"val_{n}", f"test_{n}")}
    assert data.vals == {n: split[f"val_{n}"] for n in data.task.tiers}
    assert data.tests == {n: split[f"test_{n}"] for n in data.task.tiers}
    assert data.val == [data.encode_row(line) for n in data.task.tiers for line in split[f"val_{n}"]]


def test_final_answer_parsing():
    assert arithmetic.final_answer("12 / 4 = 3 <eos> 5 = 7") == 3
    assert arithmetic.final_answer("12 / 4 = 3") == 3
    assert arithmetic.final_answer("12 / 4 = 3 + 1") is None
    assert arithmetic.final_answer("12 / 4") is None and arithmetic.final_answer("") is None


def test_data_is_never_replaced_without_overwrite(tmp_path, capsys):
    """The same data again: nothing to do; an unfinished folder: finished. Other data: refused (test_cli), or
    replaced with --overwrite, and then the folder holds the new data alone. Files by the data's names that this code
    was not writing (no meta.json, no marker: a user's) were replaced, without a word: refused, untouched."""
    folder = tmp_path / "data"
    args = ["arithmetic", "--data-dir", str(folder), "--field=int", "--count=operands", "--tiers=4,5,6",
            "--target=steps", "--train-size", "30", "--test-size", "4"]
    prepare_data.main(args)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    capsys.readouterr()
    made = arithmetic.regime_of(arithmetic.Task(), 0, 30, 4)
    arithmetic.mark_unfinished(folder, made)  # (cut short after meta.json was written, before the marker went)
    prepare_data.main(args)
    assert "holds this data already: int-steps, tiers 4,5,6 operands (seed 0; 30 train, 4 test, 4 val a tier)" in \
        capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    theirs = folder / arithmetic.UNFINISHED  # by the marker's name, but no marker of this code's: left as it is
    for make, remove in ((lambda: theirs.write_text("my notes"), theirs.unlink), (theirs.mkdir, theirs.rmdir)):
        make()
        prepare_data.main(args)
        assert "holds this data already" in capsys.readouterr().out and theirs.exists()
        remove()
    (folder / "meta.json").unlink()  # what an interrupted run leaves: written last, so missing
    (folder / "train.txt").write_text("1 +\n")
    theirs = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert error_of(prepare_data.main, args, capsys) == f"prepare_data.py: error: {folder} holds test_4.txt, " \
        "test_5.txt, test_6.txt, train.txt, val_4.txt, val_5.txt, val_6.txt but no meta.json, and not as data this " \
        f"code was writing: move them away, or replace them with `python prepare_data.py arithmetic --data-dir " \
        f"{folder} --field int --count operands --tiers 4,5,6 --target steps --train-size 30 --test-size 4 --overwrite`"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == theirs
    (folder / arithmetic.UNFINISHED).write_text("")  # an empty one (`touch`): no marker of this code's, nor theirs
    assert "(its unfinished is no marker this code wrote)" in error_of(prepare_data.main, args, capsys)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name != arithmetic.UNFINISHED} == theirs
    arithmetic.mark_unfinished(folder, made)  # ... and the marker an interrupted run leaves: its own
    prepare_data.main(args)  # the same command again finishes it: no --overwrite needed
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    prepare_data.main(["arithmetic", "--data-dir", str(folder), "--tiers=2,3", "--train-size", "30", "--test-size", "4",
                       "--overwrite"])
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "test_2.txt", "test_3.txt", "train.txt",
                                                        "val_2.txt", "val_3.txt"]
    assert arithmetic.holds(folder) == dict(**dataclasses.asdict(arithmetic.Task(**{**arithmetic.DEFAULTS,
                                                                                    "tiers": (2, 3)})),
                                            seed=0, train_size=30, test_size=4)


def test_a_preparation_interrupted_as_it_writes_meta_json_is_finished_by_the_same_command(tmp_path, monkeypatch):
    """meta.json, written last, takes its name whole or not at all: a Ctrl-C as it is written leaves the folder
    unfinished (the marker, no meta.json), which a reader refuses and the same preparation finishes; not a meta.json
    cut short, which is data that cannot be read, replaced only with --overwrite."""
    task, whole, folder = arithmetic.Task(tiers=(2, 3)), tmp_path / "whole", tmp_path / "cut"
    arithmetic.prepare(whole, task, 0, 20, 4)

    def interrupted(value, **kw):
        if "sha256" in value:  # (called as meta.json is written; the marker's first, and its digest's)
            raise KeyboardInterrupt
        return json.dumps(value, **kw)

    with monkeypatch.context() as m:
        m.setattr(arithmetic, "json", SimpleNamespace(dumps=interrupted, loads=json.loads))
        with pytest.raises(KeyboardInterrupt):
            arithmetic.prepare(folder, task, 0, 20, 4)
    assert not (folder / "meta.json").exists() and (folder / arithmetic.UNFINISHED).exists()
    with pytest.raises(DataError) as e:  # the command that was making it, which a folder's name need not say
        arithmetic.load(folder)
    assert str(e.value) == f"{folder} was cut short as its data was made: `python prepare_data.py arithmetic " \
        f"--data-dir {folder} --field int --count operands --tiers 2,3 --target steps --train-size 20 --test-size 4` " \
        "finishes it"
    other = arithmetic.regime_of(arithmetic.Task(tiers=(4,)), 0, 20, 4)  # a run of another regime meets it
    with pytest.raises(DataError, match=r" holds other data than the run's, cut short as it was made \(`python "
                                        r"prepare_data.py .* --tiers 2,3 .*` finishes it\): give --data-dir"):
        arithmetic.load(folder, trained_on=other)  # (not "rebuild it": that would replace the other regime's data)
    marker = (folder / arithmetic.UNFINISHED).read_text()
    for edited in ('{"regime": {}}', '{"regime": {"tiers": [2], "seed": null, "train_size": 20, "test_size": 4}}',
                   '{"regime": {"tiers": [2], "seed": 0, "train_size": "x; rm -rf ~", "test_size": 4}}', "[[[["):
        (folder / arithmetic.UNFINISHED).write_text(edited)  # not the command of a default regime, nor pasted text
        assert arithmetic.finishing(folder) is None
    (folder / arithmetic.UNFINISHED).write_text(marker)
    arithmetic.prepare(folder, task, 0, 20, 4)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == {p.name: p.read_bytes() for p in whole.iterdir()}


def test_two_preparations_of_one_folder_at_once_take_turns(tmp_path, capsys):
    """Another process that prepares the folder (here a thread, with a descriptor of its own, which is the same to
    flock): waited for, and what it made then looked at as always. Both at once wrote a folder of files of either,
    and meta.json of one (another seed's train.txt under meta.json: no line of it wrong), without a word."""
    theirs, ours = arithmetic.Task(tiers=(2, 3)), arithmetic.Task(tiers=(2, 3), target="answer")

    def other_process(folder, task):  # holds the folder now, prepares it 0.2 s later, then lets go
        folder.mkdir()
        held = cli.hold_folder(folder, "a test")
        def finish():
            arithmetic.prepare_held(folder, task, 0, 20, 4, False)
            os.close(held)
        thread = threading.Timer(0.2, finish)
        thread.start()
        return thread

    thread = other_process(tmp_path / "a", theirs)
    with pytest.raises(UsageError, match="already holds int-steps, tiers 2,3 operands .seed 0; 20 train, 4 test, 4 "
                                         "val a tier., with target steps .not answer.: give another --data-dir"):
        arithmetic.prepare(tmp_path / "a", ours, 0, 20, 4)  # (as the other has not written meta.json yet)
    thread.join()
    assert f"{tmp_path / 'a'} is in use by another process (preparing this data?): waiting for it" in \
        capsys.readouterr().out
    assert arithmetic.edited(tmp_path / "a", theirs, 0, 20, 4) is None
    thread = other_process(tmp_path / "b", theirs)  # the same data: made once, and found there by the other
    arithmetic.prepare(tmp_path / "b", theirs, 0, 20, 4)
    thread.join()
    out = capsys.readouterr().out
    assert "holds this data already" in out and out.count("train.txt: 40 samples") == 1


def test_a_preparation_that_waited_for_one_that_removed_the_folder_holds_the_folder_it_prepares(tmp_path, monkeypatch):
    """The preparation waited for may remove the folder it made (cut short before it wrote a file): the one that
    waited held a folder no longer there, and wrote a new one unheld, where a third preparation did not wait."""
    folder = tmp_path / "a"
    folder.mkdir()
    held = cli.hold_folder(folder, "a test")  # (another process, which made the folder, and is stopped 0.2 s later)

    def stopped():
        folder.rmdir()
        os.close(held)

    prepare_held = arithmetic.prepare_held

    def third_comes(data_dir, *args):  # (a third preparation, as this one writes)
        data_dir.mkdir(exist_ok=True)
        with pytest.raises(UsageError, match="is in use by another process"):
            os.close(cli.hold_folder(data_dir, "a test"))
        return prepare_held(data_dir, *args)

    monkeypatch.setattr(arithmetic, "prepare_held", third_comes)
    thread = threading.Timer(0.2, stopped)
    thread.start()
    arithmetic.prepare(folder, arithmetic.Task(tiers=(2, 3)), 0, 20, 4)
    thread.join()
    assert arithmetic.edited(folder, arithmetic.Task(tiers=(2, 3)), 0, 20, 4) is None


def test_a_folder_replaced_while_it_is_read_is_refused_not_read_as_a_mix(tmp_path, monkeypatch):
    """prepare_data.py --overwrite of another seed while a run reads the folder: the splits read before it are of one
    seed, those after of the other, every line valid. Read as one data set without a word before; now one line."""
    folder, task = tmp_path / "a", arithmetic.Task(tiers=(2, 3))
    arithmetic.prepare(folder, task, 0, 20, 4)
    line_problem, replaced = arithmetic.line_problem, []

    def replaced_meanwhile(*args, **kwargs):  # (another process, as the reader checks its first line)
        if not replaced:
            replaced.append(arithmetic.prepare(folder, task, 1, 20, 4, overwrite=True))
        return line_problem(*args, **kwargs)

    monkeypatch.setattr(arithmetic, "line_problem", replaced_meanwhile)
    with pytest.raises(DataError, match=re.escape(f"{folder} changed while it was read (another process preparing "
                                                  "it?): give the command again")):
        arithmetic.load(folder)
    assert replaced and arithmetic.holds(folder)["seed"] == 1
    assert arithmetic.load(folder)[3]["seed"] == 1  # read again: the new data, whole


@pytest.mark.parametrize("flags, message", [
    (["--field", "mod", "--modulus", "2305843009213693951"],
     "--modulus must be at most 1000001, got 2305843009213693951"),
    (["--max-value", "1000000000000"], "--max-value must be at most 1000000, got 1000000000000")])
def test_numbers_past_a_million_are_refused_before_anything_is_written(tmp_path, capsys, flags, message):
    """Both used to hang: the prime checked up to P, the vocabulary of a token per number built after the splits."""
    err = error_of(prepare_data.main, ["arithmetic", "--data-dir", str(tmp_path / "d"), *flags], capsys)
    assert err == f"prepare_data.py: error: {message}: every number is a token of the task's vocabulary"
    assert not (tmp_path / "d").exists()
    assert arithmetic.Task(max_value=10**6).top == 10**6 and arithmetic.Task(field="mod", modulus=999983).top == 999982


@pytest.mark.parametrize("flags, most", [
    (["--tiers", "4,3000"], "31 operators with --target steps, got 3000"),
    (["--tiers", "32,4", "--field", "mod"], "31 operators with --target steps, got 32"),  # (the largest, not the last)
    (["--tiers", "32", "--field", "mod"], "31 operators with --target steps, got 32"),
    (["--tiers", "33", "--count", "operands"], "32 operands with --target steps, got 33"),
    (["--tiers", "512", "--target", "answer"], "511 operators with --target answer, got 512")])
def test_tiers_whose_samples_may_not_fit_the_largest_block_are_refused_before_anything_is_written(tmp_path, capsys,
                                                                                                 flags, most):
    """3000 operators used to run on for days: a step-by-step sample that long takes 18M tokens."""
    err = error_of(prepare_data.main, ["arithmetic", "--data-dir", str(tmp_path / "d"), "--train-size", "1",
                                       "--test-size", "1", *flags], capsys)
    assert err == f"prepare_data.py: error: --tiers must be at most {most}: a sample of more can take over 2048 " \
                  "tokens, the largest block a preset trains on"
    assert not (tmp_path / "d").exists()
    # the bound is the longest sample there is, a chain 1 - ( 2 - ( 3 - ... ) ), and the last tier allowed fits it
    for n, target, tokens in ((31, "steps", 2 * 31 * 32 + 2), (511, "answer", 4 * 511 + 1)):
        task, chain = arithmetic.Task(field="mod", count="operators", tiers=(n,), target=target), 0
        for _ in range(n):
            chain = ("-", 1, chain)
        assert len(task.solution(chain).split()) + (target == "steps") == tokens <= arithmetic.MOST_TOKENS
    # data made before the bound, or by hand, is still read: a run that trained on it goes on
    assert arithmetic.Task.from_meta(dict(field="mod", count="operators", tiers=[32])).tiers == (32,)


def test_a_token_past_the_task_vocabulary_is_read_and_scored_wrong():
    """A model fine-tuned from a language run has more tokens than the task: what it makes of them is wrong, not a
    traceback in the middle of its evaluation."""
    vocab = arithmetic.Vocab(arithmetic.Task().vocab())
    text = vocab.decode([vocab.stoi["2"], vocab.stoi["="], len(vocab.itos) + 300])
    assert text == "2 = <?>" and arithmetic.final_answer(text) is None


def test_primes_are_told_by_divisors_up_to_the_square_root():
    def prime(p):
        try:
            return arithmetic.Task(field="mod", modulus=p) is not None
        except DataError:
            return False
    assert [p for p in range(-1, 60) if prime(p)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
    assert not prime(251 * 251) and not prime(251 * 257) and prime(65521)


@pytest.mark.parametrize("text", ["( " * 3000 + "1" + " )" * 3000, " + ".join(["1"] * 3000)])
def test_an_expression_too_deep_for_the_parser_is_one_error(text):
    """Not Python's RecursionError and its traceback of thousands of lines: --start, or a data file's line."""
    with pytest.raises(DataError) as e:
        arithmetic.Task().parse(text)
    assert str(e.value) == "an expression nested too deeply to read"


def test_data_of_another_range_of_numbers_or_seed_says_so(tmp_path):
    """The regimes differ only in max_operand: the data's description names it, not two identical ones. Data of
    the run's regime but another seed is other samples: refused too, not scored as the run's."""
    arithmetic.prepare(tmp_path, arithmetic.Task(max_operand=10), seed=0, train_size=5, test_size=2)
    run = dict(**dataclasses.asdict(arithmetic.Task()), seed=0, train_size=5, test_size=2)
    with pytest.raises(DataError) as e:
        arithmetic.load(tmp_path, trained_on=run)
    assert str(e.value) == (
        f"{tmp_path} holds int-steps, tiers 4,5,6 operands, max_operand 10, max_value 999 (seed 0; 5 train, 2 test, 2 "
        "val a tier), but the run was trained on int-steps, tiers 4,5,6 operands (seed 0; 5 train, 2 test, 2 val a "
        "tier): give --data-dir the run's data, or make it in a folder of its own with `python prepare_data.py "
        f"arithmetic --data-dir {tmp_path.parent / 'int-steps-operands-4-5-6'} --field int --count operands --tiers "
        "4,5,6 --target steps --train-size 5 --test-size 2`")  # (not "--overwrite" there: the other data is kept)
    named = tmp_path / "int-steps-operands-4-5-6"  # a folder by the run's regime's name, of other data: a
    arithmetic.prepare(named, arithmetic.Task(max_operand=10), seed=0, train_size=5, test_size=2)  # name of its own
    with pytest.raises(DataError) as e:
        arithmetic.load(named, trained_on=run)
    assert str(e.value).endswith(f"make it in a folder of its own with `python prepare_data.py arithmetic --data-dir "
                                 f"{named}-max_operand-20 --field int --count operands --tiers 4,5,6 --target steps "
                                 "--train-size 5 --test-size 2`")
    arithmetic.prepare(tmp_path / "seed-1", arithmetic.Task(), seed=1, train_size=5, test_size=2)
    with pytest.raises(DataError, match=re.escape(
            f"{tmp_path / 'seed-1'} holds int-steps, tiers 4,5,6 operands (seed 1; 5 train, 2 test, 2 val a tier), but "
            "the run was trained on int-steps, tiers 4,5,6 operands (seed 0; 5 train, 2 test, 2 val a tier)")):
        arithmetic.load(tmp_path / "seed-1", trained_on=run)


@pytest.mark.parametrize("task, edit, message", [
    (arithmetic.Task(), dict(target="answer"),
     "train.txt, line 1: not a sample of the task (it has 3 '=', where meta.json's target answer writes 1 for its 3 "
     "operators)"),
    (ANSWERS, dict(target="steps"),
     "train.txt, line 1: not a sample of the task (it has 1 '=', where meta.json's target steps writes 2 for its 2 "
     "operators)"),
    (arithmetic.Task(), dict(count="operators"),
     "train.txt, line 1: not a sample of the task (its expression has 3 operators, not 4 or 5 or 6 as in meta.json's "
     "tiers 4,5,6 operators)"),
    (ANSWERS, dict(count="operands", tiers=[3, 4]),  # (train fits both: each test file holds its tier alone)
     "test_3.txt, line 1: not a sample of the task (its expression has 3 operators, not 2 as in meta.json's tier 3 "
     "operands)"),
    (ANSWERS, dict(field="int", max_operand=10, max_value=10),  # mod 11's numbers, the same vocabulary
     "test_2.txt, line 1: not a sample of the task (0 - ( 1 + 9 ) does not give a whole number in 0..10, as the task "
     "requires)")])
def test_a_meta_json_of_another_regime_than_its_lines_is_one_error(tmp_path, task, edit, message):
    """meta.json edited to another target, count or field than its lines hold: training used to score them as that
    regime, silently (the first step of a solution as its answer; a file of one tier as another). Its sha256 says it
    was edited, with no command to rebuild it: one made of the edited regime would replace the data with another.
    A meta.json from before the sha256s: each line is found not to be a sample of its regime."""
    arithmetic.prepare(tmp_path, task, seed=0, train_size=20, test_size=3)
    meta = json.loads((tmp_path / "meta.json").read_text())
    cfg = SimpleNamespace(data_dir=str(tmp_path), block_size=64, eval_samples=3, preset="arith", task=None)
    (tmp_path / "meta.json").write_text(json.dumps({**meta, **edit}))
    for read in (lambda: arithmetic.load(tmp_path), lambda: arithmetic.Data(cfg)):
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value) == f"{tmp_path / 'meta.json'} is not the one prepare_data.py wrote with this data (its " \
            "sha256 says so): edited? Restore it, or make the data anew in a folder of its own"
    old = {k: v for k, v in meta.items() if k != "sha256"}
    (tmp_path / "meta.json").write_text(json.dumps({**old, **edit}))
    for read in (lambda: arithmetic.load(tmp_path), lambda: arithmetic.Data(cfg)):
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value).startswith(f"{tmp_path}/{message}") and str(e.value).endswith(" --overwrite`"), e.value
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert arithmetic.load(tmp_path)[2] == task  # the lines as they were made: read


@pytest.mark.parametrize("edit", [dict(seed=-1), dict(train_size=True), dict(test_size=2.0)])
def test_a_meta_json_whose_seed_or_sizes_are_not_whole_numbers_is_damaged(tmp_path, edit):
    """Not data of seed -1 (which no command makes) read as it is, nor a size of True read as 1."""
    arithmetic.prepare(tmp_path, arithmetic.Task(tiers=(2,)), seed=0, train_size=5, test_size=2)
    (tmp_path / "meta.json").write_text(json.dumps({**json.loads((tmp_path / "meta.json").read_text()), **edit}))
    (key, value), = edit.items()
    with pytest.raises(DataError) as e:
        arithmetic.load(tmp_path)
    assert str(e.value) == f"{tmp_path / 'meta.json'} is damaged (its {key!r} is {value!r}, not a whole number): " \
        f"rebuild it: `python prepare_data.py arithmetic --data-dir {tmp_path}` with the flags that made it, and " \
        "--overwrite"  # (not a command with --overwrite: pasted, the default regime's would replace the data)


def test_a_meta_json_that_lost_one_of_its_sizes_is_damaged(tmp_path):
    """Not read as a folder from before the sizes were kept (whose regime is compared without them)."""
    arithmetic.prepare(tmp_path, arithmetic.Task(tiers=(2,)), seed=0, train_size=5, test_size=2)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["seed"]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'meta.json'} is damaged (it has no 'seed')")):
        arithmetic.load(tmp_path)


def answer_changed(line):
    expr, answer = line.rsplit(" ", 1)
    return f"{expr} {int(answer) % 999 + 1}"  # (another number of the task's)


@pytest.mark.parametrize("damage, where", [
    (lambda lines: lines[:4] + [answer_changed(lines[4])] + lines[5:], "line 5 of its train.txt"),
    (lambda lines: lines[:4] + lines[5:], 89),  # a line lost
    (lambda lines: lines + lines[:1], 91)])  # a line too many
def test_data_whose_lines_are_not_what_its_meta_json_names_is_not_the_same_data(tmp_path, capsys, damage, where):
    """prepare_data.py used to say 'holds this data already' of a folder whose meta.json names the data asked for,
    whatever its lines held: it compares them with the data it makes, and says where they differ; lines lost or added
    whole, every script says so as it reads the folder (here, how many)."""
    folder = tmp_path / "data"
    args = ["arithmetic", "--data-dir", str(folder), "--count=operands", "--tiers=4,5,6", "--train-size", "30",
            "--test-size", "4"]
    prepare_data.main(args)
    made = {p.name: p.read_bytes() for p in folder.iterdir()}
    (folder / "train.txt").write_text("\n".join(damage((folder / "train.txt").read_text().splitlines())) + "\n")
    damaged = {p.name: p.read_bytes() for p in folder.iterdir()}
    err = error_of(prepare_data.main, args, capsys)
    if isinstance(where, int):
        assert err == f"prepare_data.py: error: {folder} holds arithmetic data that cannot be read (" \
                      f"{folder}/train.txt holds {where} lines, not the 90 that its meta.json names: rebuild it " \
                      f"with `python prepare_data.py arithmetic --data-dir {folder} --field int --count operands " \
                      "--tiers 4,5,6 --target steps --train-size 30 --test-size 4 --overwrite`): give another " \
                      "--data-dir, or --overwrite to replace it"
    else:
        assert err == f"prepare_data.py: error: {folder} holds other lines than this code makes of the data its " \
                      "meta.json names, int-steps, tiers 4,5,6 operands (seed 0; 30 train, 4 test, 4 val a tier) " \
                      f"(edited, or made by another version): {where}: give another --data-dir, or --overwrite to " \
                      "replace it"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == damaged
    prepare_data.main(args + ["--overwrite"])
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == made


def test_no_expression_is_scored_twice_even_where_there_are_few():
    """Test and validation expressions are all distinct and unseen in training, also in a regime with few of them
    (mod 3, one operator: 33 expressions); where too few are left, an error, not repeats."""
    task = arithmetic.Task(field="mod", modulus=3, count="operators", tiers=(1,), target="answer")
    data = arithmetic.generate(task, seed=0, train_size=5, test_size=10)
    scored = [line.split(" = ")[0] for split in ("test_1", "val_1") for line in data[split]]
    assert len(set(scored)) == len(scored) == 20 and not set(scored) & {l.split(" = ")[0] for l in data["train"]}
    with pytest.raises(UsageError, match="tier 1 has too few distinct expressions for 30 unseen ones"):
        arithmetic.generate(task, seed=0, train_size=5, test_size=30)


def test_a_solution_that_never_ends_is_wrong_and_an_answer_past_the_block_is_refused(arith_dir, tmp_path,
                                                                                     monkeypatch):
    """A right solution ends with <eos> within the most new tokens a right one can take: a generation that writes them
    all and goes on is wrong, whatever follows its last '=' where it is cut (before, the right number there counted);
    one that the end of the block cuts is judged on what it wrote. An answer (no <eos> after it) is generated within
    the block: its sample must fit there, not one token past it, where it trained and was never scored."""
    cfg = SimpleNamespace(data_dir=str(arith_dir), task=None, block_size=64, eval_samples=10)
    data = arithmetic.Data(cfg)
    line = data.tests[4][0]
    prompt, answer = arithmetic.split_sample(line)
    n, most = len(prompt.split()), data.task.most_new_tokens(prompt)
    right = line.split(" = ", 1)[1].split() + ["<eos>"]
    def on(k):  # k tokens, then "= answer", and on: never ended
        return ["("] * k + ["=", str(answer), "+", "1", "=", str(answer + 1), "<eos>"]

    def scripted(script):  # data.generate, writing `script` after every prompt
        def generate(model, idx, k, temperature, stop, lengths):
            ids = data.vocab.encode(" ".join(script))
            return torch.tensor([(row[:m] + ids + [stop] * (idx.shape[1] + k))[:idx.shape[1] + k]
                                 for row, m in zip(idx.tolist(), lengths)])
        return generate

    model = SimpleNamespace(config=SimpleNamespace(block_size=64))
    # cut after "= answer": at the most new tokens (wrong), and by the end of the block before them (judged: right)
    for script, block, score in ((right, 64, 1.0), (on(most - 2), 64, 0.0), (on(most - 3), n + most - 1, 1.0)):
        monkeypatch.setattr("data.generate", scripted(script))  # greedy_accuracy's
        model.config.block_size = block
        assert data.accuracy(model, [line], "cpu") == score, (script, block)
    arithmetic.prepare(tmp_path, ANSWERS, seed=0, train_size=50, test_size=5)
    longest = arithmetic.Data(SimpleNamespace(data_dir=str(tmp_path), task=None, block_size=64, eval_samples=5)).longest
    for block, fits in ((longest - 1, False), (longest, True)):
        cfg = SimpleNamespace(data="arithmetic", data_dir=str(tmp_path), task=None, block_size=block, eval_samples=5,
                              vocab_size=1024)
        if fits:
            assert runs.load_data(cfg, new_model=True).last_generated
        else:
            with pytest.raises(UsageError, match=f"a sample of {longest} tokens does not fit --block-size={block} "
                                                 r"\(its last token, the answer, is generated within the block\)"):
                runs.load_data(cfg, new_model=True)


def test_no_scored_expression_is_a_step_of_a_training_solution(tmp_path):
    """With several tiers, a longer training solution reduces to shorter expressions: a scored one among them had its
    whole solution in training (4 of test_1's 50 here; 84% of test_2 in mod 11 at tiers 2,3,4). generate() draws such
    a line again, in its place, so that every other line is what it was; load() refuses data that holds one (made
    before, or edited), or an expression of one scored split in another."""
    task = arithmetic.Task(field="int", count="operators", tiers=(1, 2), target="steps")
    data = arithmetic.generate(task, seed=0, train_size=300, test_size=50)
    learned = {}  # expression -> the first training line that holds it, as a prompt or a step
    for i, line in enumerate(data["train"]):
        for expr in line.split(" = ")[:-1]:
            learned.setdefault(expr, i)
    scored = [line.split(" = ")[0] for name, lines in data.items() if name != "train" for line in lines]
    assert len(set(scored)) == len(scored) == 200 and not set(scored) & set(learned)
    arithmetic.prepare(tmp_path, task, 0, 300, 50)
    assert arithmetic.load(tmp_path)[1] == data
    prompts = {line.split(" = ")[0] for line in data["train"]}
    step = next(s for s, i in learned.items() if s not in prompts and s.count(" ") == 2)  # (one operator: tier 1's)
    for name, line, says in (("test_1", f"{step} = 0", f"a step of the solution of line {learned[step] + 1} of "
                                                        "train.txt too, so that its answer is learned, not worked out"),
                             ("val_2", data["test_2"][7], "the expression of line 8 of test_2.txt too, so that it "
                                                          "counts twice")):
        lines = list(data[name])
        lines[3] = line if name == "val_2" else f"{step} = {task.solution(task.parse(step)).split(' = ')[-1]}"
        (tmp_path / f"{name}.txt").write_text("\n".join(lines) + "\n")
        with pytest.raises(DataError) as e:
            arithmetic.load(tmp_path)
        assert str(e.value).startswith(f"{tmp_path / name}.txt, line 4: its expression is {says} (made by an older "
                                       "version of this code, or edited): rebuild it with `python prepare_data.py")
        (tmp_path / f"{name}.txt").write_text("\n".join(data[name]) + "\n")


@pytest.mark.parametrize("fields, message", [
    (dict(tiers=(4, 4)), "--tiers must be distinct numbers of at least 1 operator (2 operands), got [4, 4]"),
    (dict(tiers=[5, 4, 5]), "--tiers must be distinct numbers of at least 1 operator (2 operands), got [5, 4, 5]"),
    (dict(tiers=(4, 1)), "--tiers must be distinct numbers of at least 1 operator (2 operands), got [4, 1]"),
    (dict(tiers=(3, 0), count="operators"),
     "--tiers must be distinct numbers of at least 1 operator (2 operands), got [3, 0]"),
    (dict(max_operand=1000), "--max-operand must be in 1..--max-value (999), got 1000"),
    (dict(max_operand=10, max_value=9), "--max-operand must be in 1..--max-value (9), got 10"),
    (dict(max_operand=0), "--max-operand must be in 1..--max-value (999), got 0")])
def test_tiers_are_distinct_and_operands_within_the_values(fields, message):
    """Every tier, not the first alone, has an operator (a tier of 1 operand would be a number, no expression); an
    operand past --max-value is no number of the task (nor of its vocabulary)."""
    with pytest.raises(DataError) as e:
        arithmetic.Task(**fields)
    assert str(e.value) == message
    assert arithmetic.Task(count="operators", tiers=(1,)).tiers == (1,)  # the bounds themselves are allowed
    assert arithmetic.Task(max_operand=999).max_operand == 999


@pytest.mark.parametrize("task, flags", [
    (arithmetic.Task(field="mod", target="answer", tiers=(2,)),
     "--field mod --count operands --tiers 2 --target answer"),
    (arithmetic.Task(max_operand=10, tiers=(2,)),
     "--field int --count operands --tiers 2 --target steps --max-operand 10 --max-value 999"),
    (arithmetic.Task(field="mod", modulus=13, target="answer", tiers=(2,)),  # (not mod 11's data in its place)
     "--field mod --count operands --tiers 2 --target answer --modulus 13")])
def test_the_command_a_damaged_folder_names_rebuilds_it(tmp_path, capsys, task, flags):
    """A split lost: the command in the message is the one that makes the folder's own regime again (from its
    meta.json, not the default regime with "and its flags"), and it runs as pasted, a space in the path too."""
    folder = tmp_path / "my data"
    arithmetic.prepare(folder, task, seed=3, train_size=20, test_size=4)
    before = snapshot(folder)
    (folder / "val_2.txt").unlink()
    with pytest.raises(DataError) as e:
        arithmetic.load(folder)
    rebuild = f"python prepare_data.py arithmetic --data-dir '{folder}' {flags} --seed 3 --train-size 20 " \
              "--test-size 4 --overwrite"
    assert str(e.value) == f"{folder / 'val_2.txt'} is missing: rebuild it with `{rebuild}`"
    prepare_data.main(shlex.split(rebuild)[2:])
    assert snapshot(folder) == before


def test_meta_json_holds_the_sha256_of_what_prepare_wrote(tmp_path):
    """Lines that read as samples all the same (moved between splits of a tier) are not what prepare() wrote: the
    split is named, with the command that rebuilds it (the path as it is, capitals too). meta.json's own sha256 covers
    its regime and the splits' sha256s: one edited there blames meta.json, with no command, and prepare_data.py
    refuses it too. CRLF line ends read as the same text: the same data."""
    folder = tmp_path / "My Data"
    arithmetic.prepare(folder, arithmetic.Task(tiers=(2,)), 0, 20, 4)
    made = snapshot(folder)
    first = [(folder / f"{split}_2.txt").read_text().splitlines(True) for split in ("val", "test")]
    (folder / "val_2.txt").write_text("".join([first[1][0], *first[0][1:]]))
    (folder / "test_2.txt").write_text("".join([first[0][0], *first[1][1:]]))
    with pytest.raises(DataError) as e:
        arithmetic.load(folder)
    assert str(e.value) == f"{folder / 'test_2.txt'} is not the file prepare_data.py wrote (its sha256 is not the " \
        "one meta.json records: a line edited, or moved from another split): rebuild it with `python prepare_data.py " \
        f"arithmetic --data-dir '{folder}' --field int --count operands --tiers 2 --target steps --train-size 20 " \
        "--test-size 4 --overwrite`"
    prepare_data.main(shlex.split(str(e.value).split("`")[1])[2:])
    assert snapshot(folder) == made
    meta = json.loads((folder / "meta.json").read_text())
    edited = "meta.json is not the one prepare_data.py wrote with this data (its sha256 says so): edited? " \
        "Restore it, or make the data anew in a folder of its own"
    for sha in ({**meta["sha256"], "train.txt": "0" * 64}, list(meta["sha256"].values())):  # (not train.txt blamed)
        (folder / "meta.json").write_text(json.dumps({**meta, "sha256": sha}))
        with pytest.raises(DataError) as e:
            arithmetic.load(folder)
        assert str(e.value) == f"{folder / edited}"
    (folder / "meta.json").write_text(json.dumps({**meta, "note": "mine"}))  # (the regime as it was)
    with pytest.raises(UsageError, match=re.escape(f"{edited}): give another --data-dir, or --overwrite")):
        arithmetic.prepare(folder, arithmetic.Task(tiers=(2,)), 0, 20, 4)
    (folder / "meta.json").write_text(json.dumps(meta))
    for split in folder.glob("*.txt"):
        split.write_bytes(split.read_bytes().replace(b"\n", b"\r\n"))
    assert arithmetic.load(folder)[1] == {name: lines for name, lines in arithmetic.generate(
        arithmetic.Task(tiers=(2,)), 0, 20, 4).items()}


def test_a_long_text_that_does_not_parse_is_not_echoed_whole():
    """A --start FILE: of megabytes: its line says where, in 200 characters, not the whole text."""
    for text, start in (("1 + " * 100_000, "expected a number, got 'end of input' in '1 + 1 + "),
                        ("1 + " * 100_000 + "1 )", "unexpected ')' in '1 + 1 + "),
                        ("( " + "1 + " * 100_000 + "1", "missing ')' in '( 1 + 1 + ")):
        with pytest.raises(DataError) as e:
            arithmetic.parse_tree(text)
        assert str(e.value).startswith(start) and str(e.value).endswith("'...") and len(str(e.value)) < 300


def test_a_meta_json_this_user_may_not_read_is_not_called_damaged(tmp_path, monkeypatch):
    """A meta.json that is damaged gets the command that rebuilds the folder (--overwrite); one that this user may not
    read is not damaged, and --overwrite would replace data that may be whole."""
    arithmetic.prepare(tmp_path, arithmetic.Task(tiers=(2, 3)), 0, 20, 4)

    def denied(name, read):  # (to root every file is readable: what another user meets, patched)
        def reads(path):
            if path.name == name:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return read(path)
        return reads

    for name, read in (("meta.json", "read_bytes"), ("val_3.txt", "read_text")):  # a split too
        for reader in (arithmetic.load, lambda d: arithmetic.prepare(d, arithmetic.Task(tiers=(2, 3)), 0, 20, 4)):
            with monkeypatch.context() as m:
                m.setattr(Path, read, denied(name, getattr(Path, read)))
                with pytest.raises(DataError) as e:
                    reader(tmp_path)
            assert str(e.value) == f"{tmp_path / name} cannot be read ({os.strerror(errno.EACCES)})"
    monkeypatch.undo()
    (tmp_path / "meta.json").write_text("{")
    with pytest.raises(DataError, match="` with the flags that made it, and --overwrite$"):
        arithmetic.load(tmp_path)


def test_a_seed_makes_the_data_this_code_has_always_made_of_it():
    """prepare_data.py compares a folder's lines with what this code makes of its seed: a generator changed (another
    draw, another split of a tree, another generator for the lines drawn again) would call every folder made before
    "edited", and results would be on other data than reported. Pinned: each split's sha256 (as meta.json records it)
    in int (bottom-up, with scored lines drawn again where they are steps of training) and mod (top-down)."""
    pinned = {
        arithmetic.Task(field="int", count="operators", tiers=(1, 2), target="steps"): dict(
            train="4b399bc0ca636c48", test_1="55191ac4790997a6", test_2="1ef37f6e9a1bc7f1", val_1="d3befa8fb63b77d5",
            val_2="e4d20e38e9e44131"),
        arithmetic.Task(field="mod", modulus=13, count="operators", tiers=(2, 3), target="answer"): dict(
            train="9f1b86911500abc1", test_2="8b7c5b5352106cdf", test_3="7dd5ef593de70aaf", val_2="b6d39470c27c73c8",
            val_3="9d312f16dc1eaf71")}
    for task, digests in pinned.items():
        data = arithmetic.generate(task, seed=0, train_size=300, test_size=50)
        assert {name: arithmetic.sha256("\n".join(lines) + "\n")[:16] for name, lines in data.items()} == digests
        if task.field == "int":  # (its 22nd test line, drawn again: '20 + 12' is a step of a training solution)
            assert data["train"][0] == "14 * 2 = 28" and data["test_1"][21] == "17 + 1 = 18"


def test_an_overwrite_cut_short_is_unfinished_and_the_same_command_finishes_it(tmp_path, monkeypatch):
    """--overwrite removes the old meta.json before it replaces a split: cut short after the first, the folder is
    unfinished, not the old regime's meta.json over new lines (whose advice would rebuild the old data); a reader is
    told the command that finishes the new data, and that command, given again, makes it whole."""
    folder, old, new = tmp_path / "d", arithmetic.Task(tiers=(2, 3)), arithmetic.Task(tiers=(2, 3), target="answer")
    arithmetic.prepare(tmp_path / "whole", new, 0, 20, 4)
    arithmetic.prepare(folder, old, 0, 20, 4)
    atomic_write = arithmetic.atomic_write

    def cut(path, write):  # (a Ctrl-C once train.txt is replaced)
        if Path(path).name == "test_2.txt":
            raise KeyboardInterrupt
        return atomic_write(path, write)

    with monkeypatch.context() as m:
        m.setattr(arithmetic, "atomic_write", cut)
        with pytest.raises(KeyboardInterrupt):
            arithmetic.prepare(folder, new, 0, 20, 4, overwrite=True)
    assert not (folder / "meta.json").exists()
    finish = f"python prepare_data.py arithmetic --data-dir {folder} --field int --count operands --tiers 2,3 " \
        "--target answer --train-size 20 --test-size 4"
    with pytest.raises(DataError) as e:
        arithmetic.load(folder)
    assert str(e.value) == f"{folder} was cut short as its data was made: `{finish}` finishes it"
    prepare_data.main(shlex.split(finish)[2:])
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir()}
