"""Generation and evaluation from a checkpoint (sample.py)."""

import argparse
import contextlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import tiktoken
import torch

import arithmetic
import cli
import prepare_data
import prosqa
import runs
import sample
from generation import generate
from conftest import edit_checkpoint, edit_settings, error_of, prosqa_files, small_encoding, snapshot
from data import write_shard

def test_sample_arithmetic_greedy_equals_generate(arith_run, capsys):
    first = sample.main(["--out-dir", str(arith_run), "--num-samples", "4", "--seed", "5"])
    again = sample.main(["--out-dir", str(arith_run), "--num-samples", "4", "--seed", "5"])
    assert first == again and len(first) == 4
    model = runs.load_checkpoint(arith_run, "cpu")[1]
    vocab = arithmetic.load(json.loads((arith_run / "config.json").read_text())["data_dir"])[0]
    for ids in first:
        n_prompt = ids.index(vocab.stoi["="]) + 1
        ref = generate(model, torch.tensor([ids[:n_prompt]]), 64 - n_prompt, temperature=0, stop=vocab.eos)
        assert ref[0].tolist() == ids
    lines = [l for l in capsys.readouterr().out.splitlines() if "tokens/s" in l]
    assert len(lines) == 8 and all(("[right]" in l) or ("[wrong, the answer is" in l) for l in lines)
    assert ["warm-up" in l for l in lines] == [True, False, False, False] * 2  # the first speed of a call says so


def test_a_huge_num_samples_draws_its_prompts_lazily(arith_run):
    """--num-samples past what a list holds: the prompts come one at a time (a list of them was an OverflowError); past
    the test expressions, each of them once (not "sample larger than population")."""
    drawn = sample.prompts(argparse.Namespace(start="3 + 4", temperature=1.0), None, 99999999999999999999)
    assert next(drawn) == "3 + 4"
    codec = sample.Codec(runs.load_checkpoint(arith_run, "cpu")[0])
    every = sample.prompts(argparse.Namespace(start=None, seed=1), codec, 10**6)
    assert len(every) == len(set(every)) == sum(len(codec.splits[f"test_{k}"]) for k in codec.task.tiers) == 30


def test_the_default_seed_is_the_one_help_gives(arith_run):
    """No --seed: the expressions and samples of --seed 1337, as --help says (not another run's draw each time)."""
    assert sample.main(["--out-dir", str(arith_run), "--num-samples", "2"]) == \
        sample.main(["--out-dir", str(arith_run), "--num-samples", "2", "--seed", "1337"])


def test_an_expression_is_read_with_or_without_spaces(arith_run):
    """--start in the task's tokens, however spaced: '(7+5)/3' is '( 7 + 5 ) / 3', not one odd number."""
    spaced = sample.main(["--out-dir", str(arith_run), "--start", "( 7 + 5 ) / 3"])
    assert sample.main(["--out-dir", str(arith_run), "--start", "(7+5)/3="]) == spaced and len(spaced) == 1


def test_a_run_trained_on_answers_alone_generates_the_answer_alone(whole_run, capsys):
    """--target answer: one token after '=', the only one such a run learned to write (no <eos> after it, nor more)."""
    vocab = arithmetic.load(json.loads((whole_run / "config.json").read_text())["data_dir"])[0]
    for ids in sample.main(["--out-dir", str(whole_run), "--num-samples", "3"]):
        assert ids.index(vocab.stoi["="]) == len(ids) - 2  # the prompt ends with its one '=', then one token
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all("[right]" in line or "[wrong, the answer is" in line for line in lines)


def test_seed_and_defaults_decide_what_is_sampled(arith_run, language_run, offline_gpt2, monkeypatch):
    """--seed picks the test expressions and seeds the sampling: the same seed, the same samples; another, others.
    Language samples at temperature 0.8 from the 200 likeliest tokens unless told; a task decodes greedily."""
    real, calls = sample.generate, []
    monkeypatch.setattr(sample, "generate", lambda *args, **kw: calls.append(kw) or real(*args, **kw))
    picked = [sample.main(["--out-dir", str(arith_run), "--num-samples", "3", "--seed", str(s)]) for s in (5, 6)]
    assert picked[0] != picked[1]
    language = ["--out-dir", str(language_run), "--start", "To be", "--num-samples", "2", "--max-new-tokens", "20"]
    first, again, other = (sample.main([*language, "--seed", str(s)]) for s in (5, 5, 6))
    assert first == again and first != other and first[0] != first[1]
    assert {(c["temperature"], c["top_k"]) for c in calls} == {(0.0, None), (0.8, 200)}


def test_sample_given_expression_reports_the_verdict(arith_run, capsys):
    sample.main(["--out-dir", str(arith_run), "--start", "( 7 + 5 ) / 3", "--num-samples", "1"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("( 7 + 5 ) / 3 = ") and ("[right]" in line or "the answer is 4]" in line)


def test_a_tasks_line_shows_and_judges_what_comes_before_its_stop_token(arith_run, tmp_path, offline_gpt2, capsys,
                                                                          monkeypatch):
    """A task's generation ends with its stop token (arithmetic's <eos>, ProsQA's end of text): the line shows what
    comes before it, and the verdict judges that. A ProsQA prompt is as in training: end of text, the question and a
    newline. (The model's generation is given here: the right one, and its stop token.)"""
    asked = []

    def generating(continuation):
        def generate_(model, idx, max_new_tokens, **kwargs):
            asked.append(idx[0].tolist())
            return torch.tensor([idx[0].tolist() + continuation])
        monkeypatch.setattr(sample, "generate", generate_)

    args = argparse.Namespace(temperature=0.0, top_k=None, num_samples=1, max_new_tokens=200, seed=0)
    cfg, model = runs.load_checkpoint(arith_run, "cpu")
    codec = sample.Codec(cfg)
    args.start, solution = codec.splits["test_4"][0].split(" = ", 1)  # a test line: its expression, its solution
    generating(codec.vocab.encode(solution) + [codec.stop])
    list(sample.samples(model, codec, args, "cpu", contextlib.nullcontext()))
    assert capsys.readouterr().out.startswith(f"{args.start} = {solution}   [right] (")
    for name, content in prosqa_files().items():
        (tmp_path / name).write_bytes(content)
    codec = sample.Codec(SimpleNamespace(data="prosqa", data_dir=str(tmp_path)))
    record = json.loads((tmp_path / "prosqa_test.json").read_text())[0]
    question, completion = prosqa.texts(record)
    generating(offline_gpt2.encode_ordinary(completion) + [codec.stop])
    args.start = record["question"]
    list(sample.samples(SimpleNamespace(config=model.config), codec, args, "cpu", contextlib.nullcontext()))
    assert asked[-1] == [offline_gpt2.eot_token] + offline_gpt2.encode_ordinary(question)
    assert capsys.readouterr().out.startswith(f"{record['question']}\n{completion}\n--- [right] (")


def test_prosqa_test_questions_are_drawn_by_the_seed(tmp_path, offline_gpt2):
    """Without --start, a ProsQA run answers test questions drawn by --seed: the same seed, the same ones; another
    seed, others; more than the split holds, each of its questions once."""
    for name, content in prosqa_files().items():
        (tmp_path / name).write_bytes(content)
    codec = sample.Codec(SimpleNamespace(data="prosqa", data_dir=str(tmp_path)))
    drawn = [sample.prompts(argparse.Namespace(start=None, seed=seed), codec, 2) for seed in (0, 0, 1)]
    assert drawn[0] == drawn[1] != drawn[2] and len(drawn[0]) == 2 and set(drawn[0] + drawn[2]) <= set(codec.answers)
    assert sorted(sample.prompts(argparse.Namespace(start=None, seed=0), codec, 10)) == sorted(codec.answers)


def test_a_prompt_token_the_model_cannot_look_up_is_one_line(language_run, capsys, monkeypatch):
    """The model's embedding holds token ids 0 .. vocab_size - 1: a prompt token of id vocab_size itself (320, here
    a tokenizer whose end of text comes after the model's vocabulary) is refused in one line, not looked up."""
    base = small_encoding()
    past = tiktoken.Encoding(name="past", pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks,
                             special_tokens={"<|endoftext|>": 320})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: past)
    err = error_of(sample.main, ["--out-dir", str(language_run), "--start", "To be<|endoftext|>"], capsys)
    assert err == "sample.py: error: token 320 is outside the model's vocabulary of 320"


def test_sample_eval_matches_train(arith_run, language_run, capsys):
    summary = json.loads((arith_run / "summary.json").read_text())
    capsys.readouterr()
    metrics = sample.main(["--out-dir", str(arith_run), "--eval"])
    shown = f"acc_4 {100 * summary['acc_4']:.1f}%, acc_5"  # printed in percent, as the README shows them
    assert shown in capsys.readouterr().out
    assert metrics == {k: summary[k] for k in ("val_loss", "val_ppl", "acc_4", "acc_5", "acc_6", "val_acc_4",
                                               "val_acc_5", "val_acc_6")}
    summary = json.loads((language_run / "summary.json").read_text())
    metrics = sample.main(["--out-dir", str(language_run), "--eval"])
    assert metrics == {k: summary[k] for k in ("val_loss", "val_ppl")}


def test_a_block_one_token_shorter_than_the_longest_sample_scores_it(arith_run, tmp_path, capsys):
    """A sample's last token is only a target: a model whose block holds all but it scores the run as its own block
    does; a block one token shorter is refused (the data does not fit the saved model: exit 1)."""
    run = tmp_path / "run"
    shutil.copytree(arith_run, run)
    cfg = runs.saved_config(runs.read_checkpoint(run), run)
    data = runs.load_data(cfg, with_train=False)
    longest = data.longest
    cfg.vocab_size = data.vocab_size  # likewise a vocabulary of exactly the data's tokens fits, one less does not
    assert runs.load_data(cfg, with_train=False).vocab_size == cfg.vocab_size
    cfg.vocab_size -= 1
    with pytest.raises(cli.DataError, match=re.escape(f"holds token ids up to {cfg.vocab_size}, past the model's "
                                                      f"vocab_size={cfg.vocab_size}")):
        runs.load_data(cfg, with_train=False)
    summary = json.loads((run / "summary.json").read_text())
    for block in (longest - 1, longest - 2):
        edit_settings(run, block_size=block)
        if block == longest - 1:
            metrics = sample.main(["--out-dir", str(run), "--eval"])
            # the accuracies to the bit; the loss to float rounding: a shorter block is another matmul shape, which
            # some CPUs' kernels sum in another order (7e-8 relative on one CI machine)
            assert metrics == pytest.approx({k: summary[k] for k in metrics}, rel=1e-6, abs=0) and "acc_6" in metrics
            assert {k: v for k, v in metrics.items() if "acc" in k} == {k: summary[k] for k in metrics if "acc" in k}
        else:
            assert error_of(sample.main, ["--out-dir", str(run), "--eval"], capsys, code=1).endswith(
                f"holds a sample of {longest} tokens, longer than the model's block_size={block}")


def test_data_past_a_saved_models_vocabulary_is_one_line(language_run, tmp_path, capsys):
    """--data-dir anew, with token ids the model's embedding cannot look up: the data is at fault (exit 1)."""
    n = runs.read_checkpoint(language_run)["config"]["shards"]["val"]["text_val_000000.bin"]
    write_shard(tmp_path / "text_val_000000.bin", [400] + [5] * (n - 1))  # (the run's shard by name and length)
    argv = ["--out-dir", str(language_run), "--eval", f"--data-dir={tmp_path}"]
    assert error_of(sample.main, argv, capsys, code=1) == \
        f"sample.py: error: {tmp_path} holds token ids up to 400, past the model's vocab_size=320"
    # a folder without them (the run's data moved away since): where to point it
    argv[-1] = f"--data-dir={tmp_path / 'moved'}"
    assert error_of(sample.main, argv, capsys, code=1) == f"sample.py: error: no val shards in {tmp_path / 'moved'}: " \
        "give --data-dir the folder that holds the run's shards now"


def test_a_run_is_never_scored_on_another_regime(arith_run, tmp_path, capsys):
    """The regime is in the run's config (config.json and the checkpoint); data of another one is refused."""
    for config in (json.loads((arith_run / "config.json").read_text()), runs.read_checkpoint(arith_run)["config"]):
        assert arithmetic.Task.from_meta(config["task"]) == arithmetic.Task()
    other = tmp_path / "other"
    arithmetic.prepare(other, arithmetic.Task(field="mod", target="answer"), seed=0, train_size=5, test_size=2)
    mine = tmp_path / "int-steps-operands-4-5-6"  # a folder of its own, named as grid.py names them
    make = (f"python prepare_data.py arithmetic --data-dir {mine} --field int --count operands --tiers 4,5,6 "
            "--target steps --train-size 100 --test-size 10")
    for flags in (["--eval"], ["--start", "1 + 2 + 3 + 4"]):
        err = error_of(sample.main, ["--out-dir", str(arith_run), "--data-dir", str(other), *flags], capsys, code=1)
        assert err == (f"sample.py: error: {other} holds mod11-answer, tiers 4,5,6 operands (seed 0; 5 train, 2 test, "
                       "2 val a tier), but the run was trained on int-steps, tiers 4,5,6 operands (seed 0; 100 train, "
                       f"10 test, 10 val a tier): give --data-dir the run's data, or make it in a folder of its own "
                       f"with `{make}`")
    # the command it names makes exactly the run's data, which the run then takes; the other regime's is kept
    before = snapshot(other)
    prepare_data.main(make.split()[2:])
    assert sample.main(["--out-dir", str(arith_run), "--data-dir", str(mine), "--eval"]) == \
        sample.main(["--out-dir", str(arith_run), "--eval"])
    assert snapshot(other) == before


def test_sample_language_checkpoint(language_run, offline_gpt2, capsys, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("To be")
    outs = sample.main(["--out-dir", str(language_run), "--start", f"FILE:{prompt}", "--num-samples", "2",
                        "--max-new-tokens", "10", "--temperature", "0"])
    assert len(outs) == 1 and len(outs[0]) == len("To be") + 10  # greedy: the one answer, once
    assert capsys.readouterr().out.startswith("To be") and offline_gpt2.decode(outs[0][:5]) == "To be"
    outs = sample.main(["--out-dir", str(language_run), "--start", "To be", "--num-samples", "2",
                        "--max-new-tokens", "10", "--temperature", "1", "--top-k", "1"])
    assert len(outs) == 2 and outs[0] == outs[1]  # sampled, so two, though top-k 1 makes them equal


@pytest.mark.parametrize("args, message", [
    (["--start", ""], "--start is empty"),
    (["--start", " \n"], "--start is empty"),  # (blank: no text either)
    (["--max-new-tokens", "0"], "--num-samples and --max-new-tokens must be positive"),
    (["--start", "1 + " * 40 + "1"], "the prompt is 82 tokens; the model's block size is 64"),
    (["--start", "1 + " * 31 + "1"], "the prompt is 64 tokens; the model's block size is 64"),  # no room for one more
    (["--start", "7 / 2"], "7 / 2 does not give a whole number"),
    (["--start", "7 + x"], "expected a number, got 'x'"),
    (["--start", "7+hi"], "expected a number, got 'h' in '7 + h i' (the task's spacing of '7+hi')"),  # (as typed too)
    (["--start", "1000 - 1"], "1000 is out of the task's range 0..999"),
])
def test_sample_bad_input(arith_run, capsys, args, message):
    err = error_of(sample.main, ["--out-dir", str(arith_run), *args], capsys)
    assert err.startswith("sample.py: error: ") and message in err


def test_a_prompt_file_that_cannot_be_read_is_exit_1(arith_run, tmp_path, capsys):
    """Missing, not UTF-8, or no file at all: a FIFO (whose read would wait for a writer forever), a device (/dev/zero:
    a read without end), a folder."""
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    for name, message in (("missing.txt", "No such file or directory"), ("latin1.txt", "not UTF-8 text")):
        err = error_of(sample.main, ["--out-dir", str(arith_run), "--start", f"FILE:{tmp_path / name}"], capsys, code=1)
        assert err == f"sample.py: error: --start FILE:{tmp_path / name}: {message}"
    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "fifo", Path("/dev/zero"), tmp_path):
        err = error_of(sample.main, ["--out-dir", str(arith_run), "--start", f"FILE:{path}"], capsys, code=1)
        assert err == f"sample.py: error: {path} is not a file"


def test_sample_missing_or_unreadable_checkpoint(tmp_path, capsys):
    assert "no checkpoint at" in error_of(sample.main, ["--out-dir", str(tmp_path)], capsys, code=1)
    (tmp_path / "ckpt.pt").write_text("garbage")
    assert error_of(sample.main, ["--out-dir", str(tmp_path / "ckpt.pt")], capsys, code=1) == \
        f"sample.py: error: {tmp_path / 'ckpt.pt'} is not a folder: give the folder of a run"  # (a file given)
    assert error_of(sample.main, ["--out-dir", str(tmp_path)], capsys, code=1) == \
        f"sample.py: error: {tmp_path / 'ckpt.pt'} is not a checkpoint of train.py (not a whole zip archive, as " \
        "torch.save writes: cut short, or another file)"
    (tmp_path / "ckpt.pt").write_bytes(pickle.dumps({"model": {}}))  # a plain pickle: one line, not torch's warning
    assert error_of(sample.main, ["--out-dir", str(tmp_path)], capsys, code=1).endswith("cut short, or another file)")


def test_a_run_reads_from_any_folder_and_from_an_older_version(language_run, tmp_path, monkeypatch):
    """A run records where its data is as an absolute path; one from before (a relative path, and a config
    without the fields added since) still loads."""
    config = json.loads((language_run / "config.json").read_text())
    assert Path(config["data_dir"]).is_absolute()
    expected = sample.main(["--out-dir", str(language_run), "--eval"])
    monkeypatch.chdir(tmp_path)
    assert sample.main(["--out-dir", str(language_run), "--eval"]) == expected
    old = tmp_path / "old"
    shutil.copytree(language_run, old)

    def older(ckpt):
        for field in ("task", "init_from", "router_top_p", "prune_at", "norm_eps"):  # fields added over time
            ckpt["config"].pop(field)
        ckpt["config"]["dropout"] = 0.0  # and one since gone, which no check minds
        ckpt["config"]["data_dir"] = os.path.relpath(config["data_dir"], tmp_path)

    edit_checkpoint(old, older)
    assert sample.main(["--out-dir", str(old), "--eval"]) == expected
    assert runs.load_checkpoint(old, "cpu")[0].data_dir == config["data_dir"]  # read back as absolute, as saved now
