"""ProsQA (prosqa.py): the download and its checks, the tokens, the accuracy rule, and fine-tuning
from a checkpoint through train.py, sample.py and analyze.py."""

import dataclasses
import errno
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import requests
import tiktoken
import torch

import analyze
import prepare_data
import prosqa
import sample
import train
from cli import DataError
from conftest import error_of, prosqa_files, prosqa_records, snapshot
from data import decode_tokens
from lime import GPT, GPTConfig

def test_prosqa_download_check_and_tokens(serve, tmp_path, offline_gpt2, capsys):
    files, enc = prosqa_files(), offline_gpt2
    server = serve(files)
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url])
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data
    rows, eot = prosqa.load(tmp_path, "train")
    assert eot == enc.eot_token and len(rows) == 32
    said = next(line for line in capsys.readouterr().out.splitlines() if "prosqa_train.json: 32 records" in line)
    assert said.endswith(f"{sum(len(ids) for ids, _ in rows):,} tokens, longest record "
                         f"{max(len(ids) for ids, _ in rows)}")
    for (ids, n_prompt), r in zip(rows, json.loads(files["prosqa_train.json"])):
        ids = ids.tolist()
        assert enc.decode(ids[:n_prompt]) == f"<|endoftext|>{r['question']}\n"
        assert enc.decode(ids[n_prompt:]) == f"{r['steps'][0]}\n{r['steps'][1]}\n### {r['answer']}<|endoftext|>"
    n = len(server.requests)
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url])
    assert len(server.requests) == n and "(already there)" in capsys.readouterr().out
    (tmp_path / "prosqa_test.json").unlink()  # fetched again, of a new version: its tokens made anew, not kept
    newer = serve({**files, "prosqa_test.json": json.dumps(prosqa_records(5, 7)).encode()})
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", newer.url])
    assert [enc.decode(ids[:n]) for ids, n in prosqa.load(tmp_path, "test")[0]] == \
        [f"<|endoftext|>{r['question']}\n" for r in prosqa_records(5, 7)]


@pytest.mark.parametrize("bad, message", [
    (b'[{"question": "Is Al a wu?", "steps": []', "prosqa_valid.json: not valid JSON"),
    (json.dumps([dict(question="Is Al a wu?", steps=["Al is a wu."])]).encode(), "record 0 has no 'answer'"),
    (json.dumps([dict(question="Is Al a wu?", steps="Al is a wu.", answer="Al is a wu.")]).encode(),
     "record 0: 'steps' is not a list of texts"),
    (json.dumps({"question": "Is Al a wu?"}).encode(), "expected a non-empty JSON list"),
    (b"[]", "prosqa_valid.json: expected a non-empty JSON list of records"),
    (json.dumps([dict(question="Is Al a wu?", steps=["Al is a wu.", 3], answer="Al is a wu.")]).encode(),
     "record 0: 'steps' is not a list of texts"),
    (b"[" * 100_000 + b"]" * 100_000, "prosqa_valid.json: not valid JSON (maximum recursion depth exceeded"),
])
def test_corrupt_prosqa_file_is_reported_and_not_kept(serve, tmp_path, offline_gpt2, capsys, bad, message):
    server = serve({**prosqa_files(), "prosqa_valid.json": bad})
    err = error_of(prepare_data.main, ["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url], capsys, code=1)
    assert err.startswith("prepare_data.py: error: prosqa_valid.json") and message in err
    assert not list(tmp_path.glob("prosqa_valid.*")) and (tmp_path / "prosqa_train.npz").exists()
    # downloaded whole before, damaged since: its line says how to download it anew (not --overwrite: every split)
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", serve(prosqa_files()).url])
    (tmp_path / "prosqa_valid.json").write_bytes(bad)
    err = error_of(prepare_data.main, ["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url], capsys, code=1)
    assert message in err and err.endswith(f": remove {tmp_path / 'prosqa_valid.json'}, and the same command "
                                           "downloads it anew")


def changed(a, i, value):
    a = a.copy()
    a[i] = value
    return a


NOT_FRAMED = "does not start and end with the end of text (256), with none between"


def test_the_longest_sample_may_be_a_test_question(serve, tmp_path, offline_gpt2):
    """A test question longer than every training sample is the one that must fit the block: the data says so."""
    test = prosqa_records(4, 2)
    test[1]["question"] += " Every le is a wu." * 8
    prepare_data.prepare_prosqa(tmp_path, serve({**prosqa_files(), "prosqa_test.json": json.dumps(test).encode()}).url)
    data = prosqa.Data(SimpleNamespace(data_dir=str(tmp_path), block_size=1024, eval_samples=4))
    assert data.longest == len(prosqa.load(tmp_path, "test")[0][1][0]) > max(len(ids) for ids, _ in data.train)


@pytest.mark.parametrize("damage, message", [  # damage(the file's good arrays): the arrays it replaces
    (lambda f: dict(tokens=f["tokens"][:0], offsets=f["offsets"][:1], prompt_lens=f["prompt_lens"][:0]), "no records"),
    (lambda f: dict(eot=np.array("x")), "eot is not an integer"),
    (lambda f: dict(tokens=f["tokens"].astype(float)), "tokens is not a 1-D integer array"),
    (lambda f: dict(prompt_lens=f["prompt_lens"][:, None]), "prompt_lens is not a 1-D integer array"),
    (lambda f: dict(offsets=f["offsets"][:0]), "0 offsets for 4 records"),
    (lambda f: dict(prompt_lens=f["prompt_lens"][:3]), "5 offsets for 3 records"),
    (lambda f: dict(offsets=f["offsets"] + 1), "the offsets do not rise from 0 to the number of tokens"),
    (lambda f: dict(offsets=f["offsets"][[0, 2, 1, 3, 4]]), "the offsets do not rise from 0 to the number of tokens"),
    (lambda f: dict(tokens=np.append(f["tokens"], 7)), "the offsets do not rise from 0 to the number of tokens"),
    (lambda f: dict(prompt_lens=changed(f["prompt_lens"], 1, 0)),
     "record 1: a prompt of 0 tokens, not 1 .. {m} of its {n}"),
    (lambda f: dict(prompt_lens=changed(f["prompt_lens"], 1, np.diff(f["offsets"])[1])),
     "record 1: a prompt of {n} tokens, not 1 .. {m} of its {n}"),
    (lambda f: dict(tokens=changed(f["tokens"], 5, 257)), "token ids outside 0 .. 256, the end of text"),
    (lambda f: dict(tokens=changed(f["tokens"].astype(np.int64), 5, -1)),
     "token ids outside 0 .. 256, the end of text"),
    # what no check above sees: a record's end of text that is not where its offsets say, or not the file's eot
    (lambda f: dict(offsets=changed(f["offsets"], 2, f["offsets"][2] + 1)), "record 1 " + NOT_FRAMED),
    (lambda f: dict(tokens=changed(f["tokens"], 5, 256)), "record 0 " + NOT_FRAMED),
    (lambda f: dict(tokens=changed(f["tokens"], 0, 7)), "record 0 " + NOT_FRAMED),
    (lambda f: dict(tokens=changed(changed(f["tokens"], 0, 7), 5, 256)), "record 0 " + NOT_FRAMED),  # two, one not
    (lambda f: dict(tokens=changed(changed(f["tokens"], f["offsets"][1] - 1, 7), 5, 256)),  # at its start or its end
     "record 0 " + NOT_FRAMED),
    (lambda f: dict(eot=np.array(300)), "record 0 " + NOT_FRAMED.replace("256", "300")),
])
def test_damaged_prosqa_tokens_are_reported(serve, tmp_path, offline_gpt2, damage, message):
    prepare_data.prepare_prosqa(tmp_path, serve(prosqa_files()).url)
    path = tmp_path / "prosqa_valid.npz"
    rows, eot = prosqa.load(tmp_path, "valid")  # as written: loads
    assert len(rows) == 4 and eot == offline_gpt2.eot_token
    with np.load(path) as f:
        good = dict(f)
    np.savez(path, **{**good, **damage(good)})
    before = snapshot(tmp_path)
    with pytest.raises(DataError) as e:
        prosqa.load(tmp_path, "valid")
    n = len(rows[1][0])
    assert str(e.value) == (f"{path}: {message.format(n=n, m=n - 1)}; remove it and run "
                            f"`python prepare_data.py prosqa --data-dir {tmp_path}`")
    assert snapshot(tmp_path) == before


def one_fewer(path):
    """Cuts the last record from the .npz at `path`, which still records the JSON it was made from: as by hand."""
    with np.load(path) as f:
        good = dict(f)
    cut = good["offsets"][-2]
    np.savez(path, **{**good, "tokens": good["tokens"][:cut], "offsets": good["offsets"][:-1],
                      "prompt_lens": good["prompt_lens"][:-1]})


@pytest.mark.parametrize("damage, message", [  # damage(the .npz of the valid split), as a disk, a copy or a hand may
    (lambda p: p.write_bytes(b""), "{path} is empty"),
    (lambda p: p.write_bytes(p.read_bytes()[:100]), "cannot read {path}: File is not a zip file"),  # cut short
    (lambda p: p.write_bytes(bytes(range(256)) * 4), "{path} is not an .npz file (no zip header)"),  # (not np.load's
    (lambda p: (p.unlink(), p.mkdir()), "{path} is not a file"),  # advice to load it as a pickle, unsafely)
    (one_fewer, "{path} holds 3 questions, prosqa_valid.json 4"),  # (made anew where the JSON changed)
])
def test_a_damaged_prosqa_npz_is_one_line_not_kept_as_there(serve, tmp_path, offline_gpt2, capsys, damage, message):
    """prepare_data.py keeps the tokens it made before: it reads them first, as training will, and does not say
    "(already there)" of a file that training then refuses."""
    server = serve(prosqa_files())
    prepare_data.prepare_prosqa(tmp_path, server.url)
    path = tmp_path / "prosqa_valid.npz"
    damage(path)
    before = snapshot(tmp_path)
    err = error_of(prepare_data.main, ["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url], capsys, 1)
    assert err == f"prepare_data.py: error: {message.format(path=path)}" + \
        ("; remove it and run" if "holds" not in message else ": remove the .npz and run") + \
        f" `python prepare_data.py prosqa --data-dir {tmp_path}`"
    assert snapshot(tmp_path) == before


def test_prosqa_overwrite_downloads_and_tokenises_the_files_again(serve, tmp_path, offline_gpt2):
    """--overwrite replaces the files made before with the server's (a new version there), the tokens with them: not
    "(already there)" of the old ones."""
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", serve(prosqa_files()).url])
    newer = {name: json.dumps(prosqa_records(5, 10 + i)).encode() for i, name in enumerate(prosqa_files())}
    server = serve(newer)
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url, "--overwrite"])
    assert sorted(name for name, _ in server.requests) == sorted(newer)
    for split in prosqa.SPLITS:
        assert (tmp_path / f"prosqa_{split}.json").read_bytes() == newer[f"prosqa_{split}.json"]
        assert len(prosqa.load(tmp_path, split, unrecorded_ok=False)[0]) == 5


def test_prosqa_tokens_whose_json_was_removed_load(serve, tmp_path, offline_gpt2):
    """An .npz is compared with the JSON file beside it where there is one: with that file removed since (training
    reads the tokens alone), it loads as it is, not refused as made from another version."""
    prepare_data.prepare_prosqa(tmp_path, serve(prosqa_files()).url)
    rows = prosqa.load(tmp_path, "train")[0]
    (tmp_path / "prosqa_train.json").unlink()
    assert [ids.tolist() for ids, _ in prosqa.load(tmp_path, "train")[0]] == [ids.tolist() for ids, _ in rows]


@pytest.mark.parametrize("n", [4, 3])  # other questions, as many as before or not
def test_prosqa_tokens_of_another_json_are_refused_and_made_anew(serve, tmp_path, offline_gpt2, capsys, n):
    """An .npz records the JSON file it was made from: where that file changed since (an edit, a copy), training
    refuses it, not pairing the old questions with the new answers, and prepare_data.py makes it anew, not kept for
    its count."""
    server = serve(prosqa_files())
    prepare_data.prepare_prosqa(tmp_path, server.url)
    other, path = prosqa_records(n, 99), tmp_path / "prosqa_test.npz"
    (tmp_path / "prosqa_test.json").write_text(json.dumps(other))
    before = snapshot(tmp_path)
    cfg = SimpleNamespace(data_dir=str(tmp_path), block_size=1024, eval_samples=4)
    for read in (lambda: prosqa.load(tmp_path, "test"), lambda: prosqa.Data(cfg, with_train=False)):
        with pytest.raises(DataError) as e:
            read()
        assert str(e.value) == (f"{path} was made from another version of prosqa_test.json; remove it and run "
                                f"`python prepare_data.py prosqa --data-dir {tmp_path}`")
    assert snapshot(tmp_path) == before
    capsys.readouterr()
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url])
    assert f"{path}: not made from this prosqa_test.json, or not known to be: made anew" in capsys.readouterr().out
    tests = prosqa.Data(cfg, with_train=False).tests
    assert [(offline_gpt2.decode(ids), answer) for ids, answer, _ in tests] == \
        [(f"<|endoftext|>{r['question']}\n", r["answer"]) for r in other]


def test_prosqa_tokens_that_record_no_json_load_and_are_made_anew(serve, tmp_path, offline_gpt2, capsys):
    """An .npz from before they recorded their JSON file: training reads it (on the count check), prepare_data.py,
    which cannot tell whether it is of this JSON, makes it anew."""
    server = serve(prosqa_files())
    prepare_data.prepare_prosqa(tmp_path, server.url)
    path = tmp_path / "prosqa_valid.npz"
    rows = prosqa.load(tmp_path, "valid")[0]
    with np.load(path) as f:
        np.savez(path, **{k: f[k] for k in f.files if k != "json_sha256"})
    assert [ids.tolist() for ids, _ in prosqa.load(tmp_path, "valid")[0]] == [ids.tolist() for ids, _ in rows]
    capsys.readouterr()
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url])
    assert f"{path}: not made from this prosqa_valid.json, or not known to be: made anew" in capsys.readouterr().out
    with np.load(path) as f:
        assert str(f["json_sha256"]) == prosqa.digest(tmp_path / "prosqa_valid.json")


def test_test_tokens_and_answers_are_one_record_each(serve, tmp_path, offline_gpt2):
    """Scored by zip, a test split of 3 questions against 4 answers would pair the wrong ones, or leave some out."""
    train, valid = prosqa_records(32, 0), prosqa_records(4, 1)
    train[5]["question"] += " Every le is a wu." * 8  # the longest sample, in train
    valid[2]["steps"].append("Every yu is a zo, and every zo is a ri, and every ri is a le.")  # the longest completion
    prepare_data.prepare_prosqa(tmp_path, serve({**prosqa_files(), "prosqa_train.json": json.dumps(train).encode(),
                                                 "prosqa_valid.json": json.dumps(valid).encode()}).url)
    cfg = SimpleNamespace(data_dir=str(tmp_path), block_size=1024, eval_samples=2)
    data = prosqa.Data(cfg)  # as written: the first 2 test questions, each with its answer, cut at twice the longest
    completions = [len(ids) - n for split in ("valid", "test") for ids, n in prosqa.load(tmp_path, split)[0]]
    answers = [r["answer"] for r in prosqa.check(tmp_path / "prosqa_test.json")[:2]]
    assert [(answer, most) for _, answer, most in data.tests] == [(a, 2 * completions[2]) for a in answers]
    assert completions[2] == max(completions) > max(completions[4:])  # (the valid split's, not the test split's)
    lengths = {split: [len(ids) for ids, _ in prosqa.load(tmp_path, split)[0]] for split in prosqa.SPLITS}
    assert data.longest == lengths["train"][5] > max(lengths["valid"] + lengths["test"])  # what the block must hold
    assert data.vocab_size == offline_gpt2.eot_token + 1 == offline_gpt2.n_vocab  # the end of text, the last token
    with np.load(tmp_path / "prosqa_test.npz") as f:
        good = dict(f)
    cut = good["offsets"][3]
    np.savez(tmp_path / "prosqa_test.npz", **{**good, "tokens": good["tokens"][:cut], "offsets": good["offsets"][:4],
                                              "prompt_lens": good["prompt_lens"][:3]})
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'prosqa_test.npz'} holds 3 questions, prosqa_test.json "
                                                  "4: remove the .npz and run `python prepare_data.py prosqa "
                                                  f"--data-dir {tmp_path}`")):
        prosqa.Data(cfg)


class ScriptedModel:
    """Stands in for a GPT in greedy_accuracy, with `scripted` for its generation: continues each prompt
    with the tokens scripted for it."""

    def __init__(self, script, block_size):
        self.script, self.config, self.asked = script, dataclasses.make_dataclass("C", ["block_size"])(block_size), []


def scripted(model, idx, max_new_tokens, temperature, stop, lengths):
    model.asked.append((idx.shape, max_new_tokens, temperature, stop, lengths))
    T = idx.shape[1] + max_new_tokens
    return torch.tensor([(row[:n] + model.script[tuple(row[:n])] + [stop] * T)[:T]
                         for row, n in zip(idx.tolist(), lengths)])


def test_prosqa_accuracy_on_hand_made_generations(offline_gpt2, monkeypatch):
    right, answer = "Al is a wu.\nEvery wu is a yu.\n### Al  is a\nyu. ", "Al is a yu."
    assert prosqa.correct(right, answer)  # whitespace runs and ends do not count
    assert not prosqa.correct("Al is a wu.\n### Al is a yu", answer)  # punctuation does
    assert not prosqa.correct("### al is a yu.", answer) and not prosqa.correct("Al is a yu.", answer)
    assert not prosqa.correct("### Al is a yu.\n### Al is a yu.", answer)  # everything after the first ###
    assert prosqa.correct("### Al is a yu.", " Al  is a\nyu.\n")  # the reference's whitespace is normalised too
    enc = offline_gpt2
    eot, long_prompt = enc.eot_token, [enc.eot_token] + [3] * 48
    script = {(eot, 1, 2): enc.encode_ordinary(right) + [eot] + enc.encode_ordinary("### Bo is a zo."),  # cut at <eot>
              tuple(long_prompt): enc.encode_ordinary("### Cy is a ri. and more, never ended")}
    items = [([eot, 1, 2], answer, 100), ([eot, 1, 2], "Bo is a zo.", 100), (long_prompt, "Cy is a ri.", 100),
             (long_prompt, "Cy is a ri. and more, never ended", 100)]
    model = ScriptedModel(script, block_size=64)
    monkeypatch.setattr("data.generate", scripted)  # greedy_accuracy's
    tests = SimpleNamespace(tests=items, pad=eot)
    # right: the first (what follows <eot> does not count) and the third (the block ends after "### Cy is a ri.")
    assert prosqa.Data.metrics(tests, model, "cpu") == dict(acc=2 / 4)
    assert model.asked == [((4, 49), 15, 0, eot, [3, 3, 49, 49])]  # one batch, each prompt to the end of the block
    assert decode_tokens(enc, [72, 105, 999]) == "Hi\ufffd"  # an id past the vocabulary: no crash, no match
    assert decode_tokens(enc, [eot, enc.n_vocab]) == "<|endoftext|>\ufffd"  # (the first id past it)


def test_prosqa_fine_tuning_from_a_checkpoint(serve, arith_run, tmp_path, offline_gpt2, capsys):
    folder, out = tmp_path / "prosqa", tmp_path / "ft"
    prepare_data.prepare_prosqa(folder, serve(prosqa_files()).url)
    train.main(["--preset=prosqa", f"--data-dir={folder}", f"--out-dir={out}", f"--init-from={arith_run}",
                "--block-size=128", "--batch-size=8", "--micro-batch-size=8", "--epochs=0.8", "--warmup-epochs=0.3",
                "--eval-samples=2", "--log-interval=1"])
    config = json.loads((out / "config.json").read_text())
    # the shape of the tiny arithmetic model, not the preset's 150M; the preset's schedule, in epochs of 32 samples:
    # 0.8 and 0.3 of 4 steps, rounded up (3.2 -> 4, 1.2 -> 2)
    assert (config["n_layer"], config["n_embd"], config["vocab_size"], config["block_size"]) == (2, 32, 1024, 128)
    assert (config["max_steps"], config["warmup_steps"], config["lr"], config["schedule"]) == (4, 2, 1e-4, "linear")
    assert config["init_from"] == str(arith_run) and "starting from the weights of" in capsys.readouterr().out
    # four small steps from the arithmetic run's weights: still close to them, unlike a fresh initialisation
    source, tuned = (torch.load(d / "ckpt.pt", weights_only=True)["model"] for d in (arith_run, out))
    torch.manual_seed(config["seed"])
    fresh = GPT(GPTConfig.of(config)).state_dict()
    w = "transformer.h.1.mlp.c_fc.weight"
    assert (tuned[w] - source[w]).abs().max() < 0.005 < (fresh[w] - source[w]).abs().max()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"] == "prosqa" and 0 <= summary["acc"] <= 1 and summary["steps"] == 4
    assert sample.main(["--out-dir", str(out), "--eval"]) == {k: summary[k] for k in ("val_loss", "val_ppl", "acc")}
    assert analyze.main(["table", str(out)]).startswith("| router | val loss | acc |")
    capsys.readouterr()
    sample.main(["--out-dir", str(out), "--num-samples", "1"])  # a test question, answered, with a verdict
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] in {r["question"] for r in prosqa_records(4, 2)} and "--- [" in shown[-1]


def test_prosqa_training_without_gpt2s_vocabulary_fails_before_it_begins(serve, arith_run, tmp_path, offline_gpt2,
                                                                          monkeypatch, capsys):
    """Its accuracy decodes with GPT-2's vocabulary, a download on first use: where there is none, the run is one line
    before it writes anything, not a failure at its first evaluation with every step before it lost."""
    folder, out = tmp_path / "prosqa", tmp_path / "ft"
    prepare_data.prepare_prosqa(folder, serve(prosqa_files()).url)

    def offline(name):  # (what tiktoken's fetch meets offline: requests' 300 characters, cut to their cause)
        requests.get("http://127.0.0.1:9/vocab.bpe", timeout=5)

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    err = error_of(train.main, ["--preset=prosqa", f"--data-dir={folder}", f"--out-dir={out}",
                                f"--init-from={arith_run}", "--block-size=128", "--batch-size=8",
                                "--micro-batch-size=8", "--max-steps=4", "--eval-interval=2"], capsys, 1)
    assert err == "train.py: error: tiktoken could not load the GPT-2 vocabulary (downloaded on first use): Failed " \
        f"to establish a new connection: [Errno {errno.ECONNREFUSED}] Connection refused"
    assert not out.exists()
    # no data: the command that downloads it, and no word of the offline quick start (no ProsQA fine-tune there)
    err = error_of(train.main, ["--preset=prosqa", f"--data-dir={tmp_path / 'none'}", f"--out-dir={out}",
                                f"--init-from={arith_run}"], capsys, 1)
    assert err.endswith(f": run `python prepare_data.py prosqa --data-dir {tmp_path / 'none'}`")
