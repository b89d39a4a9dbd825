"""ProsQA (prosqa.py): the download and its checks, the tokens, the accuracy rule, and fine-tuning
from a checkpoint through train.py, sample.py and analyze.py."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

import analyze
import prepare_data
import prosqa
import sample
import train
from conftest import error_of, prosqa_files, prosqa_records
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
    for (ids, n_prompt), r in zip(rows, json.loads(files["prosqa_train.json"])):
        ids = ids.tolist()
        assert enc.decode(ids[:n_prompt]) == f"<|endoftext|>{r['question']}\n"
        assert enc.decode(ids[n_prompt:]) == f"{r['steps'][0]}\n{r['steps'][1]}\n### {r['answer']}<|endoftext|>"
    n = len(server.requests)
    prepare_data.main(["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url])
    assert len(server.requests) == n and "(already there)" in capsys.readouterr().out


@pytest.mark.parametrize("bad, message", [
    (b'[{"question": "Is Al a wu?", "steps": []', "prosqa_valid.json: not valid JSON"),
    (json.dumps([dict(question="Is Al a wu?", steps=["Al is a wu."])]).encode(), "record 0 has no 'answer'"),
    (json.dumps([dict(question="Is Al a wu?", steps="Al is a wu.", answer="Al is a wu.")]).encode(),
     "record 0: 'steps' is not a list of texts"),
    (json.dumps({"question": "Is Al a wu?"}).encode(), "expected a non-empty JSON list"),
])
def test_corrupt_prosqa_file_is_reported_and_not_kept(serve, tmp_path, offline_gpt2, capsys, bad, message):
    server = serve({**prosqa_files(), "prosqa_valid.json": bad})
    err = error_of(prepare_data.main, ["prosqa", "--data-dir", str(tmp_path), "--base-url", server.url], capsys, code=1)
    assert err.startswith("prepare_data.py: error: prosqa_valid.json") and message in err
    assert not list(tmp_path.glob("prosqa_valid.*")) and (tmp_path / "prosqa_train.npz").exists()


class ScriptedModel:
    """Stands in for a GPT in greedy_accuracy: continues each prompt with the tokens scripted for it."""

    def __init__(self, script, block_size):
        self.script, self.config, self.asked = script, dataclasses.make_dataclass("C", ["block_size"])(block_size), []

    def generate(self, idx, max_new_tokens, temperature, stop, lengths):
        self.asked.append((idx.shape, max_new_tokens, temperature, stop, lengths))
        T = idx.shape[1] + max_new_tokens
        return torch.tensor([(row[:n] + self.script[tuple(row[:n])] + [stop] * T)[:T]
                             for row, n in zip(idx.tolist(), lengths)])


def test_prosqa_accuracy_on_hand_made_generations(offline_gpt2):
    right, answer = "Al is a wu.\nEvery wu is a yu.\n### Al  is a\nyu. ", "Al is a yu."
    assert prosqa.correct(right, answer)  # whitespace runs and ends do not count
    assert not prosqa.correct("Al is a wu.\n### Al is a yu", answer)  # punctuation does
    assert not prosqa.correct("### al is a yu.", answer) and not prosqa.correct("Al is a yu.", answer)
    assert not prosqa.correct("### Al is a yu.\n### Al is a yu.", answer)  # everything after the first ###
    enc = offline_gpt2
    eot, long_prompt = enc.eot_token, [enc.eot_token] + [3] * 48
    script = {(eot, 1, 2): enc.encode_ordinary(right) + [eot] + enc.encode_ordinary("### Bo is a zo."),  # cut at <eot>
              tuple(long_prompt): enc.encode_ordinary("### Cy is a ri. and more, never ended")}
    items = [([eot, 1, 2], answer, 100), ([eot, 1, 2], "Bo is a zo.", 100), (long_prompt, "Cy is a ri.", 100),
             (long_prompt, "Cy is a ri. and more, never ended", 100)]
    model = ScriptedModel(script, block_size=64)
    data = SimpleNamespace(tests=items, pad=eot)
    # right: the first (what follows <eot> does not count) and the third (the block ends after "### Cy is a ri.")
    assert prosqa.Data.metrics(data, model, "cpu") == dict(acc=2 / 4)
    assert model.asked == [((4, 49), 15, 0, eot, [3, 3, 49, 49])]  # one batch, each prompt to the end of the block
    assert decode_tokens(enc, [72, 105, 999]) == "Hi\ufffd"  # an id past the vocabulary: no crash, no match


def test_prosqa_fine_tuning_from_a_checkpoint(serve, arith_run, tmp_path, offline_gpt2, capsys):
    folder, out = tmp_path / "prosqa", tmp_path / "ft"
    prepare_data.prepare_prosqa(folder, serve(prosqa_files()).url)
    train.main(["--preset=prosqa", f"--data-dir={folder}", f"--out-dir={out}", f"--init-from={arith_run}",
                "--block-size=128", "--batch-size=8", "--micro-batch-size=8", "--epochs=1", "--warmup-epochs=0.5",
                "--eval-samples=2", "--log-interval=1"])
    config = json.loads((out / "config.json").read_text())
    # the shape of the tiny arithmetic model, not the preset's 150M; the preset's schedule, in epochs of 32 samples
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
    assert analyze.main(["table", str(out)]).startswith("| router | acc |")
    capsys.readouterr()
    sample.main(["--out-dir", str(out), "--num-samples", "1"])  # a test question, answered, with a verdict
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] in {r["question"] for r in prosqa_records(4, 2)} and "--- [" in shown[-1]
