"""What every script shares (cli.py), and every bad input of every script: one line, its exit
code, and nothing written."""

import ast
from pathlib import Path

import pytest
import torch

import analyze
import cli
import grid
import prepare_data
import sample
import train
from conftest import error_of, snapshot, tiny_args

def test_peak_flops_only_for_known_devices(monkeypatch):
    names = {"cuda": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA H100 PCIe", "cuda:2": "NVIDIA GeForce GTX 1080"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[device])
    assert cli.peak_flops("cuda", "bfloat16") == 989e12
    assert cli.peak_flops("cuda:1", "bfloat16") == 756e12
    assert cli.peak_flops("cuda:2", "bfloat16") is None  # unknown: no MFU rather than a wrong one
    assert cli.peak_flops("cuda", "float32") is None and cli.peak_flops("cpu", "bfloat16") is None


def test_no_script_imports_another():
    """The scripts (the files with a __main__) import the modules, never a script: each reads on its own."""
    files = {p.stem: p.read_text() for p in Path(__file__).parent.glob("*.py")
             if not p.stem.startswith(("test_", "conftest"))}
    scripts = {name for name, text in files.items() if 'if __name__ == "__main__":' in text}
    assert scripts == {"train", "sample", "analyze", "bench", "grid", "prepare_data"}
    for name, text in files.items():
        tree = ast.parse(text)
        imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
        imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & scripts, (name, imported & scripts)


def train_args(*flags):
    return lambda a, r, t: tiny_args(a, t / "run", *flags)


# Every bad input of issue 12, through the scripts' main(argv). In argv(a, r, t), a is the arithmetic
# data, r a finished run and t a scratch folder holding a file notes.md. Exit code 2: bad usage.
BAD_INPUTS = [
    ("train", train_args("--seed=-1"), 2, "--seed must be >= 0, got -1"),
    ("train", train_args("--n-embd=0"), 2, "--n-embd must be positive, got 0"),
    ("train", train_args("--n-head=0"), 2, "--n-head must be positive, got 0"),
    ("train", train_args("--n-kv-head=0"), 2, "--n-kv-head must be positive, got 0"),
    ("train", train_args("--n-layer=0"), 2, "--n-layer must be positive, got 0"),
    ("train", train_args("--device=cuda"), 2, "--device=cuda: this torch is a CPU-only build"),
    ("train", train_args("--device=foo"), 2, "--device='foo': choose from auto, cpu, cuda, cuda:N, mps"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={t / 'notes.md'}"), 2, "is a file, not a folder"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={t / 'notes.md' / 'run'}"), 2,
     "notes.md is a file, not a folder"),
    ("train", train_args("--stop-at=-1"), 2, "--stop-at must be >= 0, got -1"),
    ("train", train_args("--eval-samples=0"), 2, "--eval-samples must be positive, got 0"),
    ("train", train_args("--resume", "--overwrite"), 2, "give one of them"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={r}", "--max-steps=6", "--resume"), 2,
     "already at max_steps=6"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--top-k", "0", "--temperature", "1"], 2,
     "--top-k must be positive"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--top-k", "-3", "--temperature", "1"], 2, "got -3"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--device", "foo"], 2, "--device='foo'"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--data-dir", str(t / "missing")], 1, "no arithmetic data in"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--eval", "--data-dir", str(t / "missing")], 1,
     "no arithmetic data in"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "notes.md")], 2, "is a file, not a folder"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--show", "-1"], 2,
     "--show must be >= 0, got -1"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--field=mod", "--modulus=12"], 2,
     "--modulus must be a prime"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--tiers=4,x"], 2,
     "--tiers must be numbers separated by commas"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--target=both"], 2,
     "invalid choice: 'both'"),
    ("grid", lambda a, r, t: ["--fields", "real", "--out-dir", str(t / "g"), "--data-root", str(t / "d")], 2,
     "--field must be int or mod, got 'real'"),
    ("grid", lambda a, r, t: ["--seeds", "1,two", "--out-dir", str(t / "g"), "--data-root", str(t / "d")], 2,
     "--seeds and --tiers take numbers"),

    ("analyze", lambda a, r, t: ["entropy", "--out-dir", str(r), "--num-seqs", "0"], 2, "--num-seqs must be positive"),
    ("analyze", lambda a, r, t: ["entropy", "--out-dir", str(r), "--alpha", "-1"], 2, "--alpha must be > 0, got -1"),
    ("analyze", lambda a, r, t: ["prune", "--out-dir", str(r), "--top-p", "0"], 2, "--top-p must be in (0, 1], got 0"),
    ("analyze", lambda a, r, t: ["prune", "--out-dir", str(r), "--save", str(r)], 2, "--save names the run being"),
    ("train", train_args("--prune-at=3"), 2, "--prune-at says when to prune: give --router-top-p too"),
    ("train", train_args("--router-top-p=1.5"), 2, "--router-top-p must be in (0, 1]"),
    ("train", train_args("--router=dynamic", "--router-top-p=0.9"), 2, "prunes learned static routers"),
    ("train", train_args("--router-top-p=0.9", "--prune-at=12"), 2, "--prune-at=12 is not before the last step"),
    ("train", train_args("--init-from=/nonexistent/run"), 2, "--init-from: no checkpoint at /nonexistent/run/ckpt.pt"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--init-from={r}", "--n-layer=3"), 2,
     "ckpt.pt holds a model with n_layer=2 (not 3)"),
    ("train", lambda a, r, t: tiny_args(a, r, f"--init-from={r}", "--resume"), 2, "give one of them"),
    ("train", lambda a, r, t: ["--preset=prosqa", f"--data-dir={t / 'none'}", f"--out-dir={t / 'run'}",
                               f"--init-from={r}"], 1, "no ProsQA data in"),
]


def bad_input_id(case):
    script, argv, _, _ = case
    args = argv(Path("a"), Path("r"), Path("t"))
    return " ".join([script, *(args[len(tiny_args("a", "r")):] if script == "train" else args)])


@pytest.mark.parametrize("script, argv, code, message", BAD_INPUTS, ids=map(bad_input_id, BAD_INPUTS))
def test_every_bad_input_is_one_line_and_changes_nothing(arith_dir, arith_run, tmp_path, capsys, monkeypatch,
                                                         script, argv, code, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)  # what a CPU-only build says, even on a GPU machine
    (tmp_path / "notes.md").write_text("not a folder")
    before = snapshot(arith_dir, arith_run, tmp_path)
    main = {"train": train.main, "sample": sample.main, "prepare_data": prepare_data.main, "analyze": analyze.main,
            "grid": grid.main}[script]
    err = error_of(main, argv(arith_dir, arith_run, tmp_path), capsys, code)
    assert err.startswith(f"{script}.py: error: ") and message in err
    assert snapshot(arith_dir, arith_run, tmp_path) == before
