"""Training (train.py) and its run management (runs.py): the loss goes down, resuming equals not
stopping, signals save a checkpoint, flags come from the config, several processes."""

import contextlib
import dataclasses
import errno
import io
import json
import math
import os
import shutil
import signal
import socket
import sys
import types
from pathlib import Path

import pytest
import torch

import arithmetic
import cli
import methods
import runs
import sample
import train
from conftest import (assert_same_run, edit_checkpoint, error_of, read_log, small_encoding, small_model, snapshot,
                      tiny_args, train_losses)
from data import write_shard
from cli import option
from lime import GPT, GPTConfig

def test_tiny_training_lowers_the_loss(arith_dir, tmp_path, capsys):
    out = tmp_path / "run"
    train.main(tiny_args(arith_dir, out, "--max-steps=40", "--eval-interval=20", "--lr=1e-2"))
    printed = capsys.readouterr().out
    assert f"task: int-steps, tiers 4,5,6 operands (seed 0; 100 train, 10 test, 10 val a tier), from {arith_dir}" \
        in printed  # the sizes too: a preset trains on whatever its folder holds
    losses = list(train_losses(out).values())
    assert len(losses) == 40 and sum(losses[-5:]) < 0.8 * sum(losses[:5])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["router"] == "lime" and summary["steps"] == 40 and summary["tokens_seen"] == 40 * 8 * 64
    assert {"val_loss", "val_ppl", "acc_4", "acc_5", "acc_6", "val_acc_6", "tokens_per_s", "peak_memory_bytes"} <= \
        set(summary)
    assert arithmetic.Task.from_meta(summary["task"]) == arithmetic.Task() and summary["seed"] == 1337
    assert (summary["data"], summary["preset"], summary["device"]) == ("arithmetic", "tiny", cli.pick_device("auto"))
    evals = [r for r in read_log(out) if "val_loss" in r]
    assert [r["step"] for r in evals] == [20, 40] and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert "val_acc_6" in evals[0] and "acc_6" not in evals[0] and "acc_6" in evals[-1]  # the test split at the end
    config = json.loads((out / "config.json").read_text())
    assert config["router"] == "lime" and config["n_embd"] == 32 and config["lr"] == 1e-2
    assert summary["config"] == config  # what tables hold seeds of one setting to
    assert f"eval step 40: val_loss {summary['val_loss']:.4f}, val_ppl" in printed  # accuracies in percent:
    assert f", acc_6 {100 * summary['acc_6']:.1f}% (" in printed and f"acc_6 {100 * summary['acc_6']:.1f}%\n" in printed


def test_evaluating_changes_nothing_in_training(answer_dir, tmp_path):
    """A run evaluated at every step (validation loss, greedy generation) trains as one evaluated only at its end: the
    same losses and weights to the bit. The README's curves rely on it: their runs evaluate 15 times, not 3."""
    for every in (1, 3):
        train.main(tiny_args(answer_dir, tmp_path / f"every-{every}", "--max-steps=3", f"--eval-interval={every}"))
    often, once = tmp_path / "every-1", tmp_path / "every-3"
    assert [r["step"] for r in read_log(often) if "val_loss" in r] == [1, 2, 3]  # it did evaluate each step
    assert train_losses(often) == train_losses(once)
    a, b = (torch.load(d / "ckpt.pt", weights_only=True)["model"] for d in (often, once))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("interrupt", ["stop-at", "ctrl-c", "ctrl-c in an evaluation", "a cut last line"])
def test_resume_equals_uninterrupted(answer_dir, whole_run, tmp_path, monkeypatch, capsys, interrupt):
    """Losses, weights and every row of the log, evaluations included, as if the run had not stopped."""
    parts = tmp_path / "parts"
    if interrupt in ("stop-at", "a cut last line"):
        train.main(tiny_args(answer_dir, parts, "--stop-at=5"))
        if interrupt == "a cut last line":  # what a power cut leaves
            with open(parts / "log.jsonl", "a") as f:
                f.write('{"step": 6, "lo')
    else:  # Ctrl-C while fetching the batch of step 7 (steps 1..7 done and saved), or in the evaluation of step 6
        where = "metrics" if interrupt.endswith("evaluation") else "batch"
        real, calls = getattr(arithmetic.Data, where), []

        def interrupted(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == (1 if where == "metrics" else 2 * 7 + 1):
                raise KeyboardInterrupt
            return real(self, *args, **kwargs)

        monkeypatch.setattr(arithmetic.Data, where, interrupted)
        with pytest.raises(SystemExit) as e:
            train.main(tiny_args(answer_dir, parts))
        assert e.value.code == 130
        monkeypatch.setattr(arithmetic.Data, where, real)
    stopped_at = torch.load(parts / "ckpt.pt", weights_only=True)["step"]
    assert stopped_at == {"ctrl-c": 7, "ctrl-c in an evaluation": 6}.get(interrupt, 5)
    capsys.readouterr()
    train.main(tiny_args(answer_dir, parts, "--resume"))
    assert_same_run(parts, whole_run)
    dropped = "its last line was cut short, so it is dropped" in capsys.readouterr().out
    assert dropped == (interrupt == "a cut last line")


def test_a_session_stopped_between_progress_lines_leaves_no_row_of_its_own(answer_dir, tmp_path):
    """--stop-at on a step that --log-interval does not log: the session ends without a row for it (as one a signal
    ends), so that the resumed run's log is the uninterrupted run's, row for row."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train.main(tiny_args(answer_dir, whole, "--log-interval=4"))
    train.main(tiny_args(answer_dir, parts, "--log-interval=4", "--stop-at=5"))
    assert [r["step"] for r in read_log(parts) if "loss" in r] == [4]
    train.main(tiny_args(answer_dir, parts, "--log-interval=4", "--resume"))
    assert_same_run(parts, whole)


def test_resume_steps_adamw_as_this_session_chooses(answer_dir, whole_run, tmp_path, capsys):
    """How AdamW computes its step (fused, foreach, differentiable: train.py's choice for its device) is this
    session's, not the checkpoint's: a GPU run's fused=True resumed on a CPU, or a value damaged by hand, would train
    on another kernel (other last bits) or fail at its first step, in a traceback once the folder was rewritten."""
    parts = tmp_path / "parts"
    train.main(tiny_args(answer_dir, parts, "--stop-at=5"))
    edit_checkpoint(parts, lambda c: [g.update(fused=True, differentiable=True, foreach="x")
                                      for g in c["optimizer"]["param_groups"]])
    train.main(tiny_args(answer_dir, parts, "--resume"))
    assert_same_run(parts, whole_run)
    groups = torch.load(parts / "ckpt.pt", weights_only=True)["optimizer"]["param_groups"]
    assert {(g["fused"], g["foreach"], g["differentiable"]) for g in groups} == {(False, None, False)}  # (a CPU's)


@pytest.mark.parametrize("flags, message", [
    (["--preset=huge"], "unknown preset 'huge': choose from 150m, 1b, deep, arith, prosqa, tiny"),
    (["--router=first-0"], "unknown router 'first-0'"),
    (["--n-kv-head=3", "--n-head=2"], "n_kv_head=3 must divide n_head=2"),
    (["--micro-batch-size=3"], "--batch-size=8 is not a multiple of --micro-batch-size=3"),
    (["--schedule=step"], "--schedule='step': choose from cosine, linear"),
    (["--max-steps=abc"], "argument --max-steps: invalid int value"),
])
def test_bad_input_is_one_line_and_writes_nothing(arith_dir, tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    err = error_of(train.main, tiny_args(arith_dir, out, *flags), capsys)
    assert err.startswith("train.py: error: ") and message in err
    assert not out.exists()


def test_the_batch_is_split_over_every_process(tmp_path, capsys, monkeypatch):
    """Under torchrun, --batch-size is over all processes: 8 is not 2 processes' micro-batches of 8, but of 4."""
    monkeypatch.chdir(tmp_path)
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="localhost", MASTER_PORT="29500"
                            ).items():  # (what torchrun sets)
        monkeypatch.setenv(name, value)
    err = error_of(train.main, ["--preset=tiny", "--batch-size=8", "--micro-batch-size=8", "--dry-run"], capsys)
    assert err == "train.py: error: --batch-size=8 is not a multiple of --micro-batch-size=8 x 2 processes"
    assert train.main(["--preset=tiny", "--batch-size=8", "--micro-batch-size=4", "--dry-run"]) is None
    assert list(tmp_path.iterdir()) == []


def test_the_micro_batches_of_every_process_are_those_of_one_process(answer_dir, tmp_path, monkeypatch):
    """A step's micro-batches are numbered over every process (rank * micro-steps + its own): 2 processes of 2
    micro-steps each draw, between them, the micro-batches of one process with 4, each once. (Which process draws
    which leaves the step as it is. test_two_process_ddp_on_cpu runs one micro-step a process, where rank + micro
    is the same number.)"""
    class Drawn(Exception):
        pass

    def draws(rank, world, micro_steps):
        """The micro-batch numbers of step 0 that train.py draws as `rank` of `world`: the run ends at its last."""
        seen = []

        def batch_rng(seed, step, micro):
            seen.append(micro)
            if len(seen) == micro_steps:
                raise Drawn
            return real(seed, step, micro)
        monkeypatch.setattr(runs, "processes", lambda: (rank, world))  # (no RANK: no process group, no DDP)
        monkeypatch.setattr(train, "batch_rng", batch_rng)
        with pytest.raises(Drawn):
            train.main(tiny_args(answer_dir, tmp_path / f"{rank}-of-{world}", "--batch-size=16"))
        return seen

    real = train.batch_rng
    assert sorted(draws(0, 2, 2) + draws(1, 2, 2)) == draws(0, 1, 4) == [0, 1, 2, 3]


def test_under_torchrun_a_line_every_process_would_say_is_said_once_a_machine(tmp_path, capsys, monkeypatch):
    """Until the run begins, every process checks the same flags and files: the first of each machine (LOCAL_RANK 0)
    says what is wrong, the others exit with its code in silence (a line from each, crossed on one stderr). From then
    on each process's errors are its own."""
    monkeypatch.chdir(tmp_path)
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="localhost", MASTER_PORT="29500"
                            ).items():
        monkeypatch.setenv(name, value)
    flags = ["--preset=tiny", "--micro-batch-size=32", "--out-dir=run"]
    for argv, code in (([*flags[:1], "--dry-run"], 2), ([*flags, "--resume"], 1)):  # (batch 64 of 64 x 2; no ckpt)
        for local_rank, said in (("1", 0), ("0", 1)):  # (RANK=1, LOCAL_RANK=0: the first process of a second machine)
            monkeypatch.setenv("LOCAL_RANK", local_rank)
            with pytest.raises(SystemExit) as e:
                train.main(argv)
            assert e.value.code == code and capsys.readouterr().err.count("train.py: error: ") == said

    def fails(begun, error):  # train(), failing before the run's folder is begun (its data, say) or after it
        def train_(cfg, run):
            if begun:
                run.begin()
            raise error
        return train_

    monkeypatch.setenv("LOCAL_RANK", "1")
    for error, code, line in ((cli.DataError("no val shards"), 1, "train.py: error: no val shards\n"),
                              (cli.Interrupted(signal.SIGINT), 130, "train.py: interrupted (SIGINT)\n")):
        for begun in (False, True):
            with pytest.raises(SystemExit) as e:
                runs.main("train.py", flags, train.TrainConfig, train.PRESETS, fails(begun, error), train.training_data)
            assert e.value.code == code and capsys.readouterr().err == line * begun
    assert list(tmp_path.iterdir()) == []  # (rank 1 writes nothing)
    monkeypatch.setattr(os, "_exit", sys.exit)  # a Ctrl-C as torch loads, before any of that
    for local_rank, said in (("1", 0), ("0", 1)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit) as e:
            cli.interrupted_while_starting(signal.SIGINT, None)
        assert e.value.code == 130 and capsys.readouterr().err.count("interrupted (SIGINT)") == said


GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:61068. "
        "This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting "
        "an error.")


@contextlib.contextmanager
def a_group_of_one():
    """torchrun's variables for a process group of one (gloo, in this process) on a free port; afterwards the group
    that train.py made of them is gone, and so are they."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as m:
        for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port)).items():
            m.setenv(name, value)
        try:
            yield
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def test_a_process_of_the_run_gone_leaves_a_checkpoint_of_the_last_step_and_one_line(answer_dir, whole_run, tmp_path,
                                                                                   monkeypatch, capsys):
    """Under torchrun, another process killed (kill -9, out of memory) fails this one's next collective: rank 0 saves
    the last whole step, which every process holds, and says so in one line, exit 1 (it was gloo's traceback, and the
    steps since the last evaluation were lost); another rank, or one outside the loop, stops with that line or none.
    Here a process group of one (gloo, in this process), and the peer's loss raised as gloo raises it."""
    _, undo = stop_at_step(monkeypatch, 8, lambda: (_ for _ in ()).throw(RuntimeError(GLOO)))
    out = tmp_path / "run"
    with a_group_of_one():
        err = error_of(train.main, tiny_args(answer_dir, out), capsys, code=1)
    assert err == "train.py: error: another process of this run is gone or not answering (gloo: Connection closed " \
                  f"by peer [127.0.0.1]:61068): checkpoint at step 7 in {out}; continue with --resume"
    assert runs.read_checkpoint(out)["step"] == 7  # what the line says (not step 6's, of the last evaluation)
    undo()
    train.main(tiny_args(answer_dir, out, "--resume"))  # (as a plain run, here)
    assert_same_run(out, whole_run)
    run = runs.Run(runs.resolve(tiny_args(answer_dir, tmp_path / "other"), train.TrainConfig, train.PRESETS)[0])
    run.master = False  # another rank's: it saves nothing and says nothing (rank 0 does, or torchrun names it gone)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run.lost_peer("gloo: Connection closed by peer", 7)
    run.log(step=7, loss=1.0)  # nor does it write a log row or a summary, ever: rank 0 writes the run's files
    run.finish(dict(router="lime", steps=7))
    assert e.value.code == 1 and capsys.readouterr() == ("", "") and not (tmp_path / "other").exists()
    for rank, said in (("1", ""), ("0", "x.py: error: another process of this run is gone or not answering "
                                        "(gloo: Connection closed by peer [127.0.0.1]:61068)\n")):  # (outside the
        # loop: the barrier of its data)
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e, cli.one_line_errors("x.py"):
            raise RuntimeError(GLOO)
        assert e.value.code == 1 and capsys.readouterr().err == said
    assert cli.lost_peer(RuntimeError("DefaultCPUAllocator: can't allocate memory")) is None


def test_a_process_gone_at_the_logged_loss_leaves_the_step_before_it(answer_dir, whole_run, tmp_path, monkeypatch,
                                                                      capsys):
    """The loss's all_reduce of a logged step fails where another process is gone: it runs before the update, so rank
    0 saves the step before, whose row the log holds (it ran after step += 1: a checkpoint of step 8 and no row of
    it, missing from the log for good once resumed). A process group of one, as above."""
    all_reduce, losses = torch.distributed.all_reduce, []

    def reduce(tensor, *args, **kwargs):  # train()'s own (the loss's, --log-interval=1: one a step), not evaluate()'s
        if sys._getframe(1).f_code is train.train.__code__:
            losses.append(tensor)
            if len(losses) == 8:
                raise RuntimeError(GLOO)
        return all_reduce(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", reduce)
    out = tmp_path / "run"
    with a_group_of_one():
        err = error_of(train.main, tiny_args(answer_dir, out), capsys, code=1)
    assert err.endswith(f"checkpoint at step 7 in {out}; continue with --resume")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    train.main(tiny_args(answer_dir, out, "--resume"))
    assert_same_run(out, whole_run)


def test_under_torchrun_gradients_are_averaged_once_a_step_at_its_last_micro_step(answer_dir, tmp_path, monkeypatch):
    """DDP averages the gradients over the processes in a micro-step's backward unless inside no_sync(): of a step's
    2 micro-steps the first runs inside it and the last does not, so that the update takes the sum of every
    micro-step's gradient averaged over every process (averaged at the first, the last one's stayed each process's
    own). A process group of one (gloo, in this process), whose DDP forward says whether its backward averages."""
    synced, forward = [], torch.nn.parallel.DistributedDataParallel.forward

    def spy(self, *args, **kwargs):
        synced.append(self.require_backward_grad_sync)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.parallel.DistributedDataParallel, "forward", spy)
    with a_group_of_one():
        train.main(tiny_args(answer_dir, tmp_path / "run", "--max-steps=2", "--eval-interval=2"))
    assert synced == [False, True] * 2  # (evaluation runs the module DDP wraps, not DDP)


def test_resume_with_an_incompatible_checkpoint(answer_dir, tmp_path, capsys):
    """Another router, or a file that is no checkpoint, is refused and the run's files kept; so is a checkpoint of
    the first step whose optimiser state holds no moments (it would go on with fresh ones, as from step 0)."""
    out = tmp_path / "run"
    train.main(tiny_args(answer_dir, out, "--stop-at=1"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "was trained with router='lime' (not 'none')" in error_of(
        train.main, tiny_args(answer_dir, out, "--router=none", "--resume"), capsys)
    edit_checkpoint(out, lambda ckpt: ckpt["optimizer"].update(state={}))
    assert error_of(train.main, tiny_args(answer_dir, out, "--resume"), capsys, code=1) == \
        f"train.py: error: --resume: {out / 'ckpt.pt'} is damaged: its optimiser state holds no moments, at step 1"
    edit_checkpoint(out, lambda ckpt: ckpt["config"].update(device="cuda:7"))  # (a run moved from a GPU machine)
    msg = error_of(train.main, tiny_args(answer_dir, out, "--resume"), capsys)
    assert msg.startswith("train.py: error: --device=cuda:7: ") and msg.endswith(
        " (the run's, from its config): give --device to resume it on this machine")
    (out / "ckpt.pt").write_bytes(b"not a checkpoint")
    assert "--resume: " + str(out / "ckpt.pt") + " is not a checkpoint of train.py" in error_of(
        train.main, tiny_args(answer_dir, out, "--resume"), capsys, code=1)
    assert {p.name for p in out.iterdir()} == set(before)
    assert all((out / n).read_bytes() == b for n, b in before.items() if n != "ckpt.pt")


def test_a_log_cut_at_a_lines_end_is_said_as_the_run_resumes(answer_dir, tmp_path, capsys):
    """A log.jsonl cut back by whole lines (by hand, or a tool) read as whole: --resume went on without a word, and
    the evaluations cut away were gone from every curve of the run. It still goes on (they are gone either way),
    and says so."""
    out = tmp_path / "run"
    train.main(tiny_args(answer_dir, out, "--stop-at=8"))
    (out / "log.jsonl").write_text((out / "log.jsonl").read_text().splitlines(keepends=True)[0])
    capsys.readouterr()
    train.main(tiny_args(answer_dir, out, "--resume"))
    assert f"NOTE {out / 'log.jsonl'} lacks the evaluation of step 6, before the checkpoint's step 8: its rows were " \
        "cut away, and its curves will go without them\n" in capsys.readouterr().out
    assert [r["step"] for r in read_log(out) if "val_loss" in r] == [12]
    for name, keep in (("whole", lambda r: True), ("begun later", lambda r: r["step"] >= 7)):  # (prune --save's log
        run = tmp_path / name  # begins at its checkpoint's step; so does one begun anew, the old moved away)
        train.main(tiny_args(answer_dir, run, "--stop-at=8"))
        (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_log(run) if keep(r)))
        capsys.readouterr()
        train.main(tiny_args(answer_dir, run, "--resume"))
        assert "NOTE" not in capsys.readouterr().out


def test_missing_language_data_says_how_to_prepare(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the preset's own folder, data/fineweb-edu: the command needs no --data-dir
    msg = error_of(train.main, ["--preset=150m", "--out-dir=run"], capsys, code=1)
    assert msg.endswith("; prepare it with `python prepare_data.py fineweb-edu` (the offline --preset=tiny needs no "
                        "download)")
    msg = error_of(train.main, ["--preset=150m", f"--data-dir={tmp_path / 'nothing'}", f"--out-dir={tmp_path / 'run'}"],
                   capsys, code=1)
    assert "no val shards in" in msg and "python prepare_data.py fineweb-edu" in msg and "--preset=tiny" in msg
    msg = error_of(train.main, ["--preset=tiny", "--data=shakespeare", f"--data-dir={tmp_path / 'nothing'}",
                                f"--out-dir={tmp_path / 'run'}"], capsys, code=1)  # no advice to run what runs
    assert msg.endswith(f"; prepare it with `python prepare_data.py shakespeare --data-dir {tmp_path / 'nothing'}`")
    half = tmp_path / "half"  # a shard missing: prepare_data.py makes it
    write_shard(half / "shakespeare_train_000000.bin", list(range(100)))
    msg = error_of(train.main, ["--preset=tiny", "--data=shakespeare", f"--data-dir={half}",
                                f"--out-dir={tmp_path / 'run'}"], capsys, code=1)
    assert msg.endswith(f"no val shards in {half}; prepare it with `python prepare_data.py shakespeare --data-dir "
                        f"{half}`")
    (half / "shakespeare_val_000000.bin").write_bytes(b"not a shard")  # damaged: removed, made anew
    msg = error_of(train.main, ["--preset=tiny", "--data=shakespeare", f"--data-dir={half}",
                                f"--out-dir={tmp_path / 'run'}"], capsys, code=1)
    assert msg.endswith(f"shakespeare_val_000000.bin: not a token shard (bad magic or version in the header); if it "
                        f"is damaged, remove it and prepare it anew with `python prepare_data.py shakespeare "
                        f"--data-dir {half}`")
    assert not (tmp_path / "run").exists()


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(answer_dir, tmp_path, monkeypatch, capsys):
    """A training loss that is not finite (from step 9 on) stops the run at that step, before its row is logged, and
    the checkpoint of step 6 stays; a validation loss that is not finite stops it before that evaluation's checkpoint
    is saved (a model that diverged is never saved over the last good one)."""
    out = tmp_path / "run"
    real_forward = GPT.forward
    calls = []

    def forward(self, idx, targets=None, cache=None):
        logits, loss = real_forward(self, idx, targets, cache)
        if targets is not None and self.training:
            calls.append(1)
            if len(calls) > 2 * 8:  # from step 9 on, with 2 micro-steps per step
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    assert error_of(train.main, tiny_args(answer_dir, out), capsys, code=1) == "train.py: error: training loss is " \
        f"nan at step 9; stopping: the checkpoint of step 6 stays in {out} (lower --lr?)"
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 6 and max(train_losses(out)) == 8
    assert not (out / "summary.json").exists()
    monkeypatch.undo()
    real_evaluate = train.evaluate
    monkeypatch.setattr(train, "evaluate", lambda *args, **kw: {**real_evaluate(*args, **kw), "val_loss": math.nan})
    out = tmp_path / "diverged"
    assert error_of(train.main, tiny_args(answer_dir, out), capsys, code=1) == "train.py: error: validation loss is " \
        "nan at step 6; stopping: no checkpoint was written (lower --lr?)"
    assert not (out / "ckpt.pt").exists() and max(train_losses(out)) == 6


def test_a_run_that_diverges_before_its_first_checkpoint_says_so(tmp_path, capsys):
    """A loss that is not finite before any checkpoint: the line says that none was written, not that one stays
    (Run.diverged's message alone; the run that diverges after a checkpoint is the test above)."""
    run = runs.Run(train.TrainConfig(out_dir=str(tmp_path / "run")))
    with pytest.raises(SystemExit) as e:
        run.diverged(FloatingPointError("training loss is nan at step 3"))
    assert e.value.code == 1 and capsys.readouterr().err == \
        "train.py: error: training loss is nan at step 3; stopping: no checkpoint was written (lower --lr?)\n"


def test_a_disk_that_fails_while_a_run_is_saved_leaves_its_files_as_they_were(arith_run, tmp_path, monkeypatch):
    """ckpt.pt and summary.json are written whole or not at all: a disk that fails during the write (here, as it
    syncs the file) is a DataError, and the checkpoint and summary from before stay, byte for byte."""
    run = tmp_path / "run"
    shutil.copytree(arith_run, run)
    before = snapshot(run)
    ckpt = runs.read_checkpoint(run)
    cfg = train.TrainConfig(**{**ckpt["config"], "out_dir": str(run)})
    model = GPT(GPTConfig.of(cfg))

    def failing(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(cli.os, "fsync", failing)
    for write in (lambda: runs.save_checkpoint(run, model, ckpt["optimizer"], 7, ckpt["config"]),
                  lambda: runs.Run(cfg).finish(dict(router="none", steps=7))):
        with pytest.raises(cli.DataError, match="Input/output error"):
            write()
        assert snapshot(run) == before


def full_disk(monkeypatch, name, nth):
    """From the `nth` time a file whose name begins with `name` is opened to be written (the log's appends,
    atomic_write's temporary files), the disk is full: a write writes half of what it is given, then fails (ENOSPC)."""
    real, opened = open, []

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            self.f.write(b[:len(b) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, key):
            return getattr(self.f, key)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        if Path(file).name.startswith(name) and mode[0] in "wa":
            opened.append(file)
            return Full(f) if len(opened) >= nth else f
        return f

    for module in (runs, cli):
        monkeypatch.setattr(module, "open", full, raising=False)


@pytest.mark.parametrize("name, nth, kept", [
    ("log.jsonl", 10, 6),  # the row of step 7 (log interval 1), after the evaluation of step 6
    ("ckpt.pt", 2, 6),  # the checkpoint of step 12
    ("ckpt.pt", 1, None),  # the first one, of step 6
    ("summary.json", 1, 12),
])
def test_a_full_disk_as_a_run_trains_is_one_line_and_the_run_goes_on_from_there(answer_dir, whole_run, tmp_path,
                                                                                monkeypatch, capsys, name, nth, kept):
    """A file of the run that cannot be written (a full disk) ends it with one line that names the file and says what
    stays and what to do: --resume from the checkpoint before (a log row cut short is dropped), or --overwrite where
    none was written; then the run is the one that never stopped."""
    out = Path(f"{answer_dir}-{tmp_path.name}")  # beside the data, its name longer: no advice to prepare the data
    full_disk(monkeypatch, name, nth)
    err = error_of(train.main, tiny_args(answer_dir, out), capsys, code=1)
    then = "no checkpoint was written; start over with --overwrite" if kept is None else \
        f"the checkpoint of step {kept} stays; continue with --resume"
    assert err == f"train.py: error: cannot write {out / name}: {os.strerror(errno.ENOSPC)}: {then}"
    assert not list(out.glob("*.tmp")) and not (out / "summary.json").exists()
    assert (out / "ckpt.pt").exists() == (kept is not None)
    monkeypatch.undo()
    train.main(tiny_args(answer_dir, out, "--overwrite" if kept is None else "--resume"))
    assert_same_run(out, whole_run)


def test_an_output_that_cannot_be_written_stops_the_run_with_a_checkpoint(answer_dir, whole_run, tmp_path,
                                                                          monkeypatch, capsys):
    """`python train.py > log` on a full disk: as a closed output (`| head`), the run stops with a checkpoint of its
    last whole step (its row logged first), then says so in one line, exit 1; --resume goes on as if it had not."""
    out = tmp_path / "run"

    class Full(io.StringIO):
        def write(self, text):
            if text.startswith("step 8/"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", Full())
    err = error_of(train.main, tiny_args(answer_dir, out), capsys, code=1)
    assert err == "train.py: error: cannot write the output (No space left on device): the checkpoint of step 8 " \
        "stays; continue with --resume"
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 8 == max(train_losses(out))
    monkeypatch.undo()
    train.main(tiny_args(answer_dir, out, "--resume"))
    assert_same_run(out, whole_run)


def test_flags_come_from_the_config_fields():
    """A field added to the config is a flag: helped by option()'s text (by its name without one), a bool
    read as on/off, the defaults of the preset given shown; a field of another type (task) is no flag."""
    @dataclasses.dataclass
    class Fork(train.TrainConfig):
        plain: int = 3
        switch: bool = option(True, "a documented switch")

    p = runs.build_parser(Fork, {**dataclasses.asdict(Fork()), **train.PRESETS["tiny"]})
    args = p.parse_args(["--plain=5", "--switch=off"])
    assert args.plain == 5 and args.switch is False and p.parse_args(["--switch=on"]).switch is True
    assert [p.parse_args([f"--switch={w}"]).switch for w in ("1", "0", "Yes", "FALSE")] == [True, False, True, False]
    helps = {a.dest: a.help for a in p._actions}
    assert helps["plain"] == "plain [3]" and helps["switch"] == "a documented switch [True]"
    assert helps["router"] == f"cross-layer method, a router or a baseline: {methods.router_forms()} [lime]"
    assert all(helps.values())
    assert helps["n_layer"] == "number of decoder blocks (L) [4]" and "task" not in helps  # the tiny preset's 4
    assert [a.dest for a in p._actions][1:3] == ["plain", "switch"]  # the fork's own fields first
    with pytest.raises(cli.UsageError, match="expected on or off, got 'maybe'"):
        p.parse_args(["--switch=maybe"])


def test_help_shows_the_defaults_of_the_preset_given(capsys, monkeypatch):
    monkeypatch.setitem(train.PRESETS, "mine", {})  # a fork's preset: --preset's help lists it too
    with pytest.raises(SystemExit) as e:
        train.main(["--preset=1b", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # as wrapped to any terminal's width
    assert e.value.code == 0 and "--n-layer N_LAYER number of decoder blocks (L) [16]" in out
    assert "--batch-size BATCH_SIZE sequences per optimiser step, over all processes [1024]" in out
    assert "--preset PRESET named set of defaults: 150m, 1b, deep, arith, prosqa, tiny, mine [1b]" in out


def test_param_groups_follow_the_spec():
    """Two methods stand for every one: param_groups sorts a method's parameters by where the model holds them
    (model.routers; model.residual, whose names start so), not by anything the method says."""
    model = small_model("dynamic")
    cfg = train.TrainConfig(weight_decay=0.1, lr=1e-3, router_lr=1e-2)
    groups = train.param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = [(g["weight_decay"], g["lr_scale"] * cfg.lr, {names[id(p)] for p in g["params"]}) for g in groups]
    (wd0, lr0, decay), (wd1, lr1, no_decay), (wd2, lr2, router) = by_group
    assert (wd0, lr0) == (0.1, 1e-3) and (wd1, lr1) == (0.0, 1e-3) and (wd2, lr2) == (0.0, 1e-2)
    assert router == {n for n in names.values() if "router" in n} and any("proj" in n for n in router)
    assert "transformer.wte.weight" in no_decay and all("ln" in n or "wte" in n for n in no_decay)
    assert all(n.endswith(("c_q.weight", "c_kv.weight", "c_proj.weight", "c_fc.weight")) for n in decay)
    assert len(decay | no_decay | router) == len(names)
    hc = small_model("hc")  # a method of the residual stream (baselines.py): its matrices too, without decay
    residual = {id(p): p for n, p in hc.named_parameters() if n.startswith("residual.")}
    assert any(p.dim() >= 2 for p in residual.values())
    assert [(g["weight_decay"], g["lr_scale"]) for g in train.param_groups(hc, cfg) if any(id(p) in residual for p in
                                                                                         g["params"])] == [(0.0, 1.0)]


def test_learning_rate_schedules():
    cfg = train.TrainConfig(lr=1e-3, min_lr=1e-6, warmup_steps=10, max_steps=110, schedule="cosine")
    assert train.learning_rate(0, cfg) == pytest.approx(1e-4) and train.learning_rate(9, cfg) == pytest.approx(1e-3)
    assert train.learning_rate(10, cfg) == pytest.approx(1e-3)  # the first step of the decay: the peak, not past it
    assert train.learning_rate(60, cfg) == pytest.approx((1e-3 + 1e-6) / 2)
    assert train.learning_rate(110, cfg) == pytest.approx(1e-6)
    cfg.schedule = "linear"
    assert train.learning_rate(35, cfg) == pytest.approx(1e-6 + 0.75 * (1e-3 - 1e-6))


def test_the_eta_is_in_seconds_then_minutes_then_hours():
    """The progress line's ETA: whole seconds up to a minute and a half, then minutes up to an hour and a half, then
    hours, each to a tenth."""
    assert [runs.format_eta(s) for s in (0, 60, 89.6, 90, 91, 5400, 5401, 36000)] == \
        ["0s", "60s", "90s", "90s", "1.5m", "90.0m", "1.5h", "10.0h"]


def test_the_eta_counts_to_the_step_this_session_stops_at(answer_dir, tmp_path, capsys):
    """--stop-at ends the session before --max-steps: its progress lines count the time left to that step."""
    train.main(tiny_args(answer_dir, tmp_path / "run", "--max-steps=100000", "--stop-at=4", "--log-interval=2"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 2/100000", "step 4/100000"]
    assert lines[-1].endswith("| ETA 0s")


def test_a_step_is_the_mean_over_its_micro_batches_at_each_groups_rate(answer_dir, tmp_path, monkeypatch):
    """Batch 8 as 2 micro-steps of 4: each micro-step draws rows of its own, the loss a step logs and backpropagates
    is the mean over them (each micro-step's loss / 2), and every parameter group steps at the schedule's rate times
    its scale (the router's: --router-lr / --lr), with the --eps given."""
    real_batch, batches = arithmetic.Data.batch, []
    monkeypatch.setattr(arithmetic.Data, "batch", lambda self, rng, n: batches.append(real_batch(self, rng, n)) or
                        batches[-1])
    out = tmp_path / "run"
    train.main(tiny_args(answer_dir, out, "--max-steps=1", "--eval-interval=1", "--log-interval=5", "--eps=1e-6"))
    assert len(batches) == 2 and not torch.equal(batches[0][0], batches[1][0])
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    cfg = train.TrainConfig(**ckpt["config"])
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig.of(cfg))  # the initial weights, drawn as train.py draws them
    assert train_losses(out)[1] == pytest.approx(sum(model(x, y)[1].item() for x, y in batches) / 2, rel=1e-6)
    # the last step is logged, off the --log-interval too, with the rate it stepped at (the first: of step 0)
    assert [r["lr"] for r in read_log(out) if "loss" in r] == [train.learning_rate(0, cfg)]
    rates = {g["lr_scale"]: g["lr"] for g in ckpt["optimizer"]["param_groups"]}
    assert {g["eps"] for g in ckpt["optimizer"]["param_groups"]} == {1e-6}  # AdamW's, as given (not its own 1e-8)
    assert rates == pytest.approx({1.0: train.learning_rate(0, cfg), cfg.router_lr / cfg.lr:
                                   train.learning_rate(0, cfg) * cfg.router_lr / cfg.lr})


@pytest.mark.parametrize("router", ["lime", "hc"])  # (a router's weights are in the blocks; hc's outside them)
def test_clipping_bounds_what_the_optimiser_sees(answer_dir, tmp_path, monkeypatch, router):
    """At every step AdamW sees gradients of global norm exactly --grad-clip where they are larger (so not
    twice it, nor unclipped), and as they are with --grad-clip=0: the norm of every parameter's gradient."""
    norms = []
    step = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    seen = {}
    for clip in ("0.01", "0"):
        norms.clear()
        train.main(tiny_args(answer_dir, tmp_path / clip, "--max-steps=2", "--eval-interval=2", f"--grad-clip={clip}",
                             f"--router={router}"))
        seen[clip] = list(norms)
    # clipped at both steps; unclipped, above even the default --grad-clip=1 (0 is off, not the default)
    assert len(seen["0.01"]) == 2 and min(seen["0"]) > 2 * train.TrainConfig.grad_clip, seen
    assert seen["0.01"] == pytest.approx([0.01, 0.01], rel=1e-5), seen


def test_two_process_ddp_on_cpu(ddp_run, answer_dir, tmp_path):
    procs, out = ddp_run
    outputs = [p.communicate(timeout=120) for p in procs]
    result = types.SimpleNamespace(returncode=max(p.returncode for p in procs), stdout=outputs[0][0] + outputs[1][0],
                                   stderr=outputs[0][1] + outputs[1][1])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 process(es)" in result.stdout and result.stdout.count("step 4/4") == 1  # only rank 0 prints
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and math.isfinite(summary["val_loss"])
    # 2 processes x micro-batch 4 = the batch of 8 in a single micro-step each: the rows, and so the weights, of one
    # process with 2 micro-steps of 4 (up to the order in which the gradients are summed)
    assert "1 micro-step(s) of 4" in result.stdout
    train.main(tiny_args(answer_dir, tmp_path / "one", "--max-steps=4", "--eval-interval=4"))
    one, two = (torch.load(d / "ckpt.pt", weights_only=True)["model"] for d in (tmp_path / "one", out))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-6, msg=name)
    # the logged loss is the step's, over every process's rows, as one process logs it (it was rank 0's rows alone)
    losses = [[r["loss"] for r in read_log(d) if "loss" in r] for d in (tmp_path / "one", out)]
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-6), losses


def test_a_run_that_never_logged_a_step_is_run_again_by_the_same_command(answer_dir, tmp_path, monkeypatch, capsys):
    """Out of memory in the first step (or a signal as the run began, before its loop): the folder holds config.json
    and an empty log, nothing to keep. The same command again (a smaller micro-batch, say) was refused: "already holds
    a run ... with no checkpoint to resume from: start over with --overwrite"."""
    def out_of_memory(self, rng, n):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes.")

    for flags in ([], ["--router-top-p=0.5", "--prune-at=0"]):  # (pruned at step 0, and out of memory after)
        monkeypatch.setattr(arithmetic.Data, "batch", out_of_memory)
        out = tmp_path / f"run{len(flags)}"
        err = error_of(train.main, tiny_args(answer_dir, out, "--max-steps=2", *flags), capsys, code=1)
        assert "out of memory" in err and sorted(p.name for p in out.iterdir()) == ["config.json", "log.jsonl"]
        assert [r.keys() for r in read_log(out)][0] == {"step", "session"}  # where it ran, and no step
        monkeypatch.undo()
        train.main(tiny_args(answer_dir, out, "--max-steps=2", "--micro-batch-size=2", "--eval-interval=2", *flags))
        assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_a_new_run_never_replaces_an_old_one(arith_dir, arith_run, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(arith_run, old)
    for name in ("routes.png", "entropy.png", "probe.png", "prune.png", "prune.json"):  # what analyze.py writes there
        (old / name).write_bytes(b"a picture of the old run")
    before = snapshot(old)
    theirs = tmp_path / "theirs"  # a config.json that is no run's
    theirs.mkdir()
    (theirs / "config.json").write_text('{"my": "settings"}\n')
    nested = tmp_path / "nested"  # JSON nested deeper than Python decodes: not a run's either, and no traceback
    nested.mkdir()
    (nested / "config.json").write_text("[" * 100000)
    later = tmp_path / "later"  # a session that began at step 500, its checkpoint moved away: not a run never trained
    later.mkdir()
    shutil.copy(old / "config.json", later)
    (later / "log.jsonl").write_text('{"step": 500, "session": {"device": "cpu", "dtype": "float32", "compile": '
                                     'false, "world_size": 1}}\n')
    for run in (old, tmp_path / "log-only", later):  # a log alone is a run too: one cut short before its first save
        if run.name == "log-only":
            run.mkdir()
            (run / "log.jsonl").write_text('{"step": 1, "loss": 6.9}\n')
        err = error_of(train.main, tiny_args(arith_dir, run, "--max-steps=6"), capsys)
        assert err.startswith(f"train.py: error: {run} already holds a run (")
        assert ("--resume" in err) == (run == old) and "--overwrite" in err  # no advice to resume without a ckpt
    for mine, extra in [(theirs, []), (nested, []), (theirs, ["--overwrite"])]:  # a file of the user's: not deleted,
        # not even by --overwrite, which says it deletes a run
        err = error_of(train.main, tiny_args(arith_dir, mine, "--max-steps=6", *extra), capsys, 1)
        assert err == f"train.py: error: {mine / 'config.json'} is not the config.json of a run (no router, " \
            "max_steps and out_dir in it), which --overwrite would delete: move it away, or give another folder"
    assert snapshot(old) == before and (theirs / "config.json").read_text() == '{"my": "settings"}\n'
    assert list(theirs.iterdir()) == [theirs / "config.json"]
    train.main(tiny_args(arith_dir, old, "--max-steps=2", "--eval-interval=2", "--eval-samples=1", "--overwrite"))
    # --overwrite starts over: only the new run's files, the old pictures gone
    assert {p.name for p in old.iterdir()} == {"ckpt.pt", "log.jsonl", "summary.json", "config.json"}
    assert json.loads((old / "summary.json").read_text())["steps"] == 2 and sorted(train_losses(old)) == [1, 2]
    assert torch.load(old / "ckpt.pt", weights_only=True)["step"] == 2


def stop_at_step(monkeypatch, step, stop):
    """stop() as the run draws the first micro-batch of `step` (tiny_args: two a step), steps before it done.
    Returns the list that counts the micro-batches drawn, and undo(), which puts the data's own batch back."""
    real_batch, calls = arithmetic.Data.batch, []

    def batch(self, rng, n):
        calls.append(1)
        if len(calls) == 2 * (step - 1) + 1:
            stop()
        return real_batch(self, rng, n)

    monkeypatch.setattr(arithmetic.Data, "batch", batch)
    return calls, lambda: monkeypatch.setattr(arithmetic.Data, "batch", real_batch)


# SIGTERM: what `kill` and a cluster scheduler send; SIGHUP: the terminal closed (a real one too, tried by hand)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_saves_a_checkpoint_and_resume_is_exact(answer_dir, whole_run, tmp_path, monkeypatch, capsys, signum):
    """In this process, as a subprocess would spend seconds importing torch: train.main is what
    `python train.py` runs, signal handler included, and its SystemExit code is the exit status."""
    _, undo = stop_at_step(monkeypatch, 8, lambda: os.kill(os.getpid(), signum))
    out = tmp_path / "run"

    def unhandled(signum, frame):  # rather than the default, which would end the test session
        pytest.fail(f"train.py did not handle {signal.Signals(signum).name}")

    previous = signal.signal(signum, unhandled)
    try:
        with pytest.raises(SystemExit) as e:
            train.main(tiny_args(answer_dir, out))
        assert signal.getsignal(signum) is unhandled  # train.py put the handler before it back
    finally:
        signal.signal(signum, previous)
    assert e.value.code == 128 + signum
    printed = capsys.readouterr()
    assert f"{signal.Signals(signum).name}: saving a checkpoint at step 7" in printed.out and "--resume" in printed.out
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 7
    undo()
    train.main(tiny_args(answer_dir, out, "--resume"))
    assert_same_run(out, whole_run)


def test_a_signal_while_a_step_is_logged_leaves_the_checkpoint_its_log_row(answer_dir, whole_run, tmp_path,
                                                                           monkeypatch):
    """A signal after an update, as its log row is made (where .item() waits for the device): the checkpoint of that
    step was saved without the row, which the log then lacked for good, resumed or not."""
    real, calls = train.synchronize, []

    def synchronize(device):  # once before step 1, then once a logged step (log interval 1), and after evaluation 6
        calls.append(1)
        if len(calls) == 9:  # step 7's
            os.kill(os.getpid(), signal.SIGTERM)
        return real(device)

    monkeypatch.setattr(train, "synchronize", synchronize)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("train.py did not handle SIGTERM"))
    try:
        with pytest.raises(SystemExit, match="143"):
            train.main(tiny_args(answer_dir, tmp_path / "run"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["step"] == 7
    assert sorted(train_losses(tmp_path / "run")) == list(range(1, 8))
    monkeypatch.setattr(train, "synchronize", real)
    train.main(tiny_args(answer_dir, tmp_path / "run", "--resume"))
    assert_same_run(tmp_path / "run", whole_run)


def test_after_sighup_nothing_is_written_to_the_closed_terminal(tmp_path, monkeypatch):
    """A line to a terminal that hung up fails (EIO): the checkpoint was saved, but the run ended in a traceback (exit
    1, tried with a real one). Its terminal output goes to /dev/null from the signal on; output to a file stays."""
    primary, terminal = os.openpty()
    log = open(tmp_path / "log", "w")
    with open(terminal, "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", log)
        with pytest.raises(cli.Interrupted), runs.Signals() as signals:
            signals.handle(signal.SIGHUP, None)
        assert os.path.samestat(os.fstat(out.fileno()), os.stat(os.devnull))
        assert os.path.samestat(os.fstat(log.fileno()), os.stat(tmp_path / "log"))
    os.close(primary)
    log.close()


def test_under_nohup_a_closed_terminal_does_not_stop_a_run(answer_dir, whole_run, tmp_path, monkeypatch):
    """`nohup` ignores SIGHUP so that a run outlives its terminal: train.py keeps it ignored (and so do the runs
    grid.py starts, which inherit it), and the run ends as an uninterrupted one."""
    calls, _ = stop_at_step(monkeypatch, 8, lambda: os.kill(os.getpid(), signal.SIGHUP))
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        train.main(tiny_args(answer_dir, tmp_path / "run"))
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert len(calls) > 2 * 7 + 1
    assert_same_run(tmp_path / "run", whole_run)


@pytest.mark.parametrize("case", ["second signal during the save on the way out", "signal during a periodic save"])
def test_a_signal_during_a_save_waits_for_it(answer_dir, tmp_path, monkeypatch, capsys, case):
    second = case.startswith("second")
    real_save, real_batch, saves, batches = torch.save, arithmetic.Data.batch, [], []

    def save(obj, f):
        saves.append(obj["step"])
        os.kill(os.getpid(), signal.SIGINT)  # unless it waits, KeyboardInterrupt here, and no checkpoint
        real_save(obj, f)

    def batch(self, rng, n):
        batches.append(1)
        if second and len(batches) == 2 * 3 + 1:  # the first Ctrl-C, after step 3
            os.kill(os.getpid(), signal.SIGINT)
        return real_batch(self, rng, n)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(arithmetic.Data, "batch", batch)
    periodic = [] if second else ["--eval-interval=2", "--eval-samples=1"]  # the save after the evaluation of step 2
    ended = None
    try:
        train.main(tiny_args(answer_dir, tmp_path / "run", *periodic))
    except (SystemExit, KeyboardInterrupt) as e:  # a KeyboardInterrupt would otherwise stop the whole test session
        ended = e
    assert isinstance(ended, SystemExit) and ended.code == 128 + signal.SIGINT
    step = 3 if second else 2
    assert saves == [step]  # one save, whole; the signal during it did not start another
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["step"] == step
    out = capsys.readouterr()
    assert out.out.count("saving a checkpoint") == 1 and f"interrupted: checkpoint at step {step}" in out.out
    assert "Traceback" not in out.err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # train.py put the usual Ctrl-C back


def test_a_signal_inside_hold_waits_for_its_end_and_the_first_one_counts():
    """runs.Signals: inside hold() (nested too) a signal waits for the end of the outermost block, then stops the run;
    of two that came meanwhile, the first is the one it stops with (Ctrl-C then SIGTERM: 130, not 143). Once it is
    stopping, a signal waits even outside hold(). Leaving puts the handlers before it back."""
    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    done = []
    with runs.Signals() as signals:
        with pytest.raises(cli.Interrupted) as e:
            with signals.hold():
                with signals.hold():
                    os.kill(os.getpid(), signal.SIGINT)
                    os.kill(os.getpid(), signal.SIGTERM)
                    done.append("inner")
                done.append("outer")
        assert done == ["inner", "outer"] and e.value.signum == signal.SIGINT and signals.stopping
        os.kill(os.getpid(), signal.SIGTERM)  # stopping: no second Interrupted on the way out
        done.append("after")
    assert done[-1] == "after" and [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before


@pytest.fixture(scope="module")
def closed_output_runs(closed_output_started):
    """ctrl_c -> (stderr, exit code, run folder) of the runs of closed_output_started (conftest), ended."""
    return {ctrl_c: (p.communicate(timeout=120)[1], p.returncode, out)
            for ctrl_c, (p, out) in closed_output_started.items()}


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["| head", "| tee, and Ctrl-C"])
def test_a_closed_output_stops_the_run_with_a_checkpoint(closed_output_runs, ctrl_c):
    """`python train.py | head`: once what reads the output has closed it, the run stops as a signal stops it, with a
    checkpoint of its last whole step, then exits 141 without a word. Here the reader is gone from the start, and
    the first write fails when the buffer of a pipe (8 KiB) fills: mid-run, dozens of progress lines in. And
    `python train.py | tee log`, then Ctrl-C, which ends tee too: the line that says a checkpoint is being saved
    cannot be written, and the checkpoint is saved all the same."""
    stderr, returncode, out = closed_output_runs[ctrl_c]
    assert returncode == 128 + signal.SIGPIPE and stderr == ""
    step = torch.load(out / "ckpt.pt", weights_only=True)["step"]
    assert 0 < step < 3000 and not (out / "summary.json").exists()
    if not ctrl_c:  # its progress line was the one that failed: the step is whole, and so is its row, written first
        assert max(train_losses(out)) == step


def test_resume_after_a_cut_in_the_final_evaluation_only_evaluates(answer_dir, tmp_path, capsys):
    """The last step is evaluated, the test split too, whether or not --eval-interval divides it (5 steps, every 6);
    a signal during that evaluation leaves its checkpoint and no summary.json: --resume takes no step, evaluates it
    again, to the same log row and summary, and then the run is finished."""
    run = tmp_path / "cut"
    train.main(tiny_args(answer_dir, run, "--max-steps=5"))
    log, old = read_log(run), json.loads((run / "summary.json").read_text())
    assert [r["step"] for r in log if "val_loss" in r] == [5] and "acc_3" in log[-1]
    (run / "summary.json").unlink()  # as when a signal came during the last evaluation: ckpt at max_steps, no summary
    capsys.readouterr()
    train.main(tiny_args(answer_dir, run, "--max-steps=5", "--resume"))
    new = json.loads((run / "summary.json").read_text())
    assert {k: new[k] for k in ("steps", "val_loss", "acc_2", "acc_3", "val_acc_3")} == \
        {k: old[k] for k in ("steps", "val_loss", "acc_2", "acc_3", "val_acc_3")}
    assert "step 1/" not in capsys.readouterr().out  # no training step was taken
    session = dict(step=5, session=dict(device="cpu", dtype="float32", compile=False, world_size=1))
    assert read_log(run) == [*log[:-1], session, log[-1]]  # step 5's loss kept, its evaluation done again, the same
    err = error_of(train.main, tiny_args(answer_dir, run, "--max-steps=5", "--resume"), capsys)  # finished now
    assert "already at max_steps=5" in err


def router_state(ckpt, name):
    """The AdamW moments of one router weight in a saved checkpoint (the optimiser keys them by position)."""
    cfg = train.TrainConfig(**ckpt["config"])
    model = GPT(GPTConfig.of(cfg))
    params = [n for g in train.param_groups(model, cfg) for n, p in model.named_parameters()
              if any(p is q for q in g["params"])]
    return ckpt["optimizer"]["state"][params.index(name)]


@pytest.mark.parametrize("prune_at, stop", [(2, "signal"), (3, "signal"), (3, "killed")])
def test_a_run_stopped_after_its_pruning_resumes_as_if_never_stopped(answer_dir, tmp_path, monkeypatch, prune_at, stop):
    """Stopped in the step after its pruning (--prune-at): a signal saves a checkpoint of the pruning's step, after
    it, from which the resumed run pruned the pruned weights again (more zeros) and logged it twice. Where that step
    is an evaluation's (3), its checkpoint, saved before the pruning, was not saved again, and the resumed run went
    on unpruned. Killed (no checkpoint on the way out), it resumes from that one and prunes, once."""
    prune = ["--router-top-p=0.7", f"--prune-at={prune_at}", "--max-steps=6", "--eval-interval=3", "--eval-samples=1"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train.main(tiny_args(answer_dir, whole, *prune))
    class Killed(Exception):  # what nothing catches: nothing saved on the way out, as after kill -9
        pass

    def stopped():
        if stop == "killed":
            raise Killed
        os.kill(os.getpid(), signal.SIGTERM)

    _, undo = stop_at_step(monkeypatch, prune_at + 1, stopped)  # the step after the pruning
    with pytest.raises(Killed if stop == "killed" else SystemExit):
        train.main(tiny_args(answer_dir, cut, *prune))
    ckpt = torch.load(cut / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == (3 if stop == "killed" else prune_at)
    assert ckpt["pruned_at"] == (None if stop == "killed" else prune_at)
    undo()
    train.main(tiny_args(answer_dir, cut, *prune, "--resume"))
    assert_same_run(cut, whole)


def test_pruning_during_training_survives_resume(answer_dir, tmp_path, capsys):
    prune = ["--router-top-p=0.7", "--prune-at=2", "--max-steps=6", "--eval-interval=6", "--eval-samples=1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train.main(tiny_args(answer_dir, whole, *prune))
    train.main(tiny_args(answer_dir, parts, *prune, "--stop-at=4"))  # stopped after the pruning
    mask = torch.load(parts / "ckpt.pt", weights_only=True)["router_mask"]
    out = capsys.readouterr().out
    zeroed = sum(int((~keep).sum()) for keep in mask.values())  # (every router's, of the 6 layers' 8 + 12 + ...)
    total = sum(keep.numel() for keep in mask.values())
    assert f"step 2: top-p 0.7 pruning zeroed {zeroed:,} of {total:,} router weights ({100 * zeroed / total:.1f}%); " \
        "they stay zero from here on" in out.splitlines()
    assert "were pruned: they stay zero" not in out  # (not before the pruning)
    # resumed without --prune-at, which a new run with --router-top-p needs: the run's own is in its config
    train.main(tiny_args(answer_dir, parts, *[f for f in prune if not f.startswith("--prune-at")], "--resume"))
    assert_same_run(parts, whole)
    ckpt = torch.load(parts / "ckpt.pt", weights_only=True)
    name = "transformer.h.1.attn.router.weight"
    keep = ckpt["router_mask"][name]
    assert 0 < (~keep).sum() < keep.numel() and ckpt["pruned_at"] == 2  # (the session before pruned it)
    said = f"{int((~keep).sum())} of 8 router weights were pruned: they stay zero"
    assert said in capsys.readouterr().out
    train.main(tiny_args(answer_dir, tmp_path / "fine", f"--init-from={parts}", "--max-steps=1", "--eval-interval=1"))
    assert said in capsys.readouterr().out  # (a run that starts from a pruned model says so too)
    assert torch.all(ckpt["model"][name][~keep] == 0) and torch.all(ckpt["model"][name][keep] != 0)
    state = router_state(ckpt, name)  # no gradient and no momentum reach a pruned weight
    assert torch.all(state["exp_avg"][~keep] == 0) and torch.all(state["exp_avg_sq"][~keep] == 0)
    assert json.loads((parts / "summary.json").read_text())["router_pruned"] == int((~keep).sum())
    assert [r["router_pruned"] for r in read_log(parts) if "router_pruned" in r] == [int((~keep).sum())]


def test_a_run_from_init_from_resumes_with_the_command_that_started_it(answer_dir, whole_run, tmp_path, capsys):
    """Stopped, a run that --init-from started says "continue with --resume": the same command with --resume added
    goes on as if uninterrupted (--init-from names the run's own start, by any name of that folder: here with a
    trailing slash); another --init-from is refused."""
    start = [f"--init-from={whole_run}", "--max-steps=4", "--eval-interval=2"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train.main(tiny_args(answer_dir, whole, *start))
    train.main(tiny_args(answer_dir, parts, *start, "--stop-at=2"))
    assert "continue with --resume" in capsys.readouterr().out
    train.main(tiny_args(answer_dir, parts, f"--init-from={whole_run}/", *start[1:], "--resume"))
    assert_same_run(parts, whole)
    again = tiny_args(answer_dir, parts, f"--init-from={whole}", "--resume", "--max-steps=5")
    err = error_of(train.main, again, capsys)
    assert err == (f"train.py: error: --resume continues the run in {parts}, which started from {whole_run}, and "
                   f"--init-from={whole} starts a new one: give one of them")


def test_a_folder_another_run_trains_in_is_refused_and_kept(answer_dir, whole_run, tmp_path, capsys):
    """Two runs in one folder at once (a grid started again while its runs go on, a --resume while the run still trains)
    would leave a log, a checkpoint and a summary of either: the second is refused before it writes a byte, a --dry-run
    (grid.py's check of a run to go on with) too. A run lets go of its folder when it ends, stopped or not: the resume
    tests train twice in one folder, in this process."""
    run = tmp_path / "run"
    shutil.copytree(whole_run, run)
    before = snapshot(run)
    held = cli.hold_folder(run, "a test")  # (flock: another open of the folder, as another process's would be)
    try:  # whatever the flags: said first, not what the folder reads as (a run to resume, or --overwrite) as it trains
        for again in (["--overwrite"], ["--resume"], [], ["--resume", "--dry-run"], ["--overwrite", "--dry-run"]):
            err = error_of(train.main, tiny_args(answer_dir, run, *again, "--max-steps=13"), capsys)
            assert err == (f"train.py: error: {run} is in use by another process (a train.py still training there? "
                           "wait for it to end, or give another --out-dir)")
            assert snapshot(run) == before
    finally:
        os.close(held)
    train.main(tiny_args(answer_dir, run, "--resume", "--max-steps=13"))
    assert read_log(run)[-1]["step"] == 13


def test_a_run_another_process_writes_while_this_one_starts_is_refused_and_kept(answer_dir, whole_run, tmp_path,
                                                                                  capsys, monkeypatch):
    """A run checks its folder first, then spends seconds on its data and model before it holds the folder: another
    process may write a run there meanwhile, and end. A new run then deleted that finished run unasked, and a
    --resume went on from the checkpoint it read, older than the one there now: each is refused, the files kept."""
    run = tmp_path / "run"

    def finished_meanwhile(*args, **kwargs):  # (another process, as this one reads its data)
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(whole_run, run)
        return training_data(*args, **kwargs)

    training_data = runs.training_data
    monkeypatch.setattr(runs, "training_data", finished_meanwhile)
    err = error_of(train.main, tiny_args(answer_dir, run), capsys)  # (empty, as it checked)
    assert err == (f"train.py: error: {run}: another process wrote ckpt.pt, log.jsonl, summary.json, config.json there "
                   "while this run was starting: nothing was written there; give the command again to see what is "
                   "there now")
    files = lambda d: {p.name: p.read_bytes() for p in d.iterdir()}  # noqa: E731
    assert files(run) == files(whole_run)  # as the other process left it
    monkeypatch.setattr(runs, "training_data", training_data)
    train.main(tiny_args(answer_dir, run, "--stop-at=6", "--overwrite"))
    monkeypatch.setattr(runs, "training_data", finished_meanwhile)
    err = error_of(train.main, tiny_args(answer_dir, run, "--resume"), capsys)  # (it read the checkpoint of step 6)
    assert "another process wrote ckpt.pt, log.jsonl, summary.json, config.json there" in err
    assert files(run) == files(whole_run)

    def drawn_meanwhile(*args, **kwargs):  # (analyze.py routes, beside a run it only reads): no run's write
        (run / "routes.png").write_bytes(b"a plot")
        return training_data(*args, **kwargs)

    monkeypatch.setattr(runs, "training_data", drawn_meanwhile)
    train.main(tiny_args(answer_dir, run, "--resume", "--max-steps=13"))
    assert read_log(run)[-1]["step"] == 13


def test_a_resume_whose_checkpoint_another_process_replaced_as_it_was_read_is_refused(answer_dir, whole_run, tmp_path,
                                                                                      capsys, monkeypatch):
    """What the run's checks saw is recorded before they read the folder, not after: a --resume loads the checkpoint
    first (seconds for a large model), and another process that trained the run on meanwhile was taken as seen, so
    the resume went on from the older checkpoint, over the newer one (its log cut). (A summary.json written meanwhile
    is refused sooner: a checkpoint before the end of a finished run is not resumed.)"""
    run = tmp_path / "run"
    train.main(tiny_args(answer_dir, run, "--stop-at=6"))
    read_checkpoint = runs.read_checkpoint

    def trained_on_meanwhile(*args, **kwargs):  # (another process saves step 12 as this one loads step 6's checkpoint)
        ckpt = read_checkpoint(*args, **kwargs)
        for name in ("ckpt.pt", "log.jsonl"):
            shutil.copy(whole_run / name, run / name)
        return ckpt

    monkeypatch.setattr(runs, "read_checkpoint", trained_on_meanwhile)
    err = error_of(train.main, tiny_args(answer_dir, run, "--resume"), capsys)
    assert err == (f"train.py: error: {run}: another process wrote ckpt.pt, log.jsonl there while this run was "
                   "starting: nothing was written there; give the command again to see what is there now")
    assert all((run / name).read_bytes() == (whole_run / name).read_bytes() for name in ("ckpt.pt", "log.jsonl"))


def test_an_empty_pruning_mask_prunes_nothing_where_there_is_nothing_to_prune(tmp_path):
    """A checkpoint's router_mask of {} (train.py saves none such): of a model with nothing to prune, no pruning (it
    failed at the run's first line, 'top-p pruning applies to ...'); of one with router weights, a mask that does
    not fit them."""
    assert runs.pruning_mask({"router_mask": {}}, small_model("none"), tmp_path / "ckpt.pt") is None
    with pytest.raises(cli.DataError, match="its pruning mask .'router_mask'. does not fit"):
        runs.pruning_mask({"router_mask": {}}, small_model("lime"), tmp_path / "ckpt.pt")


def test_a_preset_folder_holds_the_preset_data_and_a_dry_run_writes_nothing(tmp_path, capsys, monkeypatch):
    """--data with a preset of other data reads data/<data>, not the preset's folder; --dry-run checks and prints
    the config (its data_dir absolute, so that the run reads it from any folder) and writes nothing."""
    monkeypatch.chdir(tmp_path)
    for flags, data_dir in ((["--data=shakespeare"], "data/shakespeare"), ([], "data/arithmetic-quick"),
                            (["--data-dir=mine"], "mine")):
        assert train.main(["--preset=tiny", *flags, "--dry-run"]) is None
        printed = capsys.readouterr().out
        config = json.loads(printed.splitlines()[0].removeprefix("config: "))
        assert config["data_dir"] == str(tmp_path / data_dir) and "nothing was written" in printed
        assert config["out_dir"] == "out/tiny-lime"  # no --out-dir: out/<preset>-<router>, as --help says
    for name, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="localhost", MASTER_PORT="29500"
                            ).items():  # under torchrun (which sets these) the config is printed once, by rank 0
        monkeypatch.setenv(name, value)
    assert train.main(["--preset=tiny", "--micro-batch-size=32", "--dry-run"]) is None
    assert capsys.readouterr().out == ""
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_checks_the_data_where_it_is_there(answer_dir, tmp_path, capsys):
    """What the run refuses of its data, a dry run refuses too where the data is there (grid.py checks its runs
    so): a sample longer than the block, a vocabulary larger than the model's, --stop-at or --prune-at past the
    steps of --epochs. Where the data is not there yet, the same flags pass, and the dry run says it."""
    epochs = [a for a in tiny_args(answer_dir, tmp_path / "run") if not a.startswith("--max-steps=")] + ["--epochs=0.5"]
    # 200 samples in batches of 8, half an epoch: 12.5 steps, 13
    for extra, message in ((["--block-size=4"], "a sample of "), (["--vocab-size=8"], "--vocab-size=8 is smaller "
                                                                   "than the arithmetic vocabulary"),
                           (["--stop-at=14"], "--stop-at=14 is past the last step (max_steps=13)"),
                           (["--router-top-p=0.9", "--prune-at=13"], "--prune-at=13 is not before the last step")):
        assert message in error_of(train.main, [*epochs, *extra, "--dry-run"], capsys)
        train.main([*epochs, *extra, f"--data-dir={tmp_path / 'none'}", "--dry-run"])
        printed, note = capsys.readouterr()
        assert f"no data in {tmp_path / 'none'} yet, so none was checked; nothing was written; the run sets " \
            "max_steps from --epochs" in printed
        # which the run refuses, unless it is made meanwhile (as grid.py makes its regimes): a note of what makes it
        assert note == f"note: no arithmetic data in {tmp_path / 'none'}: the run needs it made first, by `python " \
            f"prepare_data.py arithmetic --data-dir {tmp_path / 'none'} --field int --count operands --tiers 4,5,6 " \
            "--target steps`\n"
    # a length in steps is known without the data: --stop-at past it refused with none there, as the run refuses it
    err = error_of(train.main, [*tiny_args(answer_dir, tmp_path / "run"), "--stop-at=13",
                                f"--data-dir={tmp_path / 'none'}", "--dry-run"], capsys)
    assert err == "train.py: error: --stop-at=13 is past the last step (max_steps=12)"
    train.main([*epochs, "--stop-at=13", "--dry-run"])
    printed = capsys.readouterr().out
    assert '"max_steps": 13' in printed and printed.endswith("the data and the checkpoints they name check out; "
                                                             "nothing was written)\n")
    assert list(tmp_path.iterdir()) == []
    held = cli.hold_folder(tmp_path / "held", "a test")  # (a folder a prepare_data.py is writing: no note, its data
    try:  # is on the way)
        train.main([*epochs, f"--data-dir={tmp_path / 'held'}", "--dry-run"])
    finally:
        os.close(held)
    assert capsys.readouterr().err == ""


def test_a_length_in_steps_on_the_command_line_wins_over_a_presets_epochs(tmp_path, capsys, monkeypatch):
    """--preset=arith sets 200 epochs: --max-steps given instead is the run's length, not silently ignored
    (and likewise --warmup-steps over --preset=prosqa's warm-up epoch); both at once is an error. A --stop-at at
    that last step is no error: the run ends there anyway."""
    monkeypatch.chdir(tmp_path)
    for argv, want in [(["--preset=arith", "--max-steps=40"], dict(max_steps=40, epochs=0.0)),
                       (["--preset=arith", "--max-steps=40", "--stop-at=40"], dict(max_steps=40, stop_at=40)),
                       (["--preset=arith", "--seed=0"], dict(epochs=200, seed=0)),  # (the first seed there is)
                       (["--preset=tiny", "--router-top-p=1", "--prune-at=3"], dict(router_top_p=1.0)),  # (keeps all)
                       (["--preset=prosqa", "--warmup-steps=5"], dict(warmup_steps=5, warmup_epochs=0.0, epochs=10)),
                       (["--preset=prosqa"], dict(warmup_epochs=1, epochs=10))]:  # (both in epochs)
        train.main([*argv, "--dry-run"])
        printed = capsys.readouterr().out
        config = json.loads(printed.splitlines()[0].removeprefix("config: "))
        assert {k: config[k] for k in want} == want
        # the steps a length in epochs gives are known once the data is: the dry run says so, not 6000 silently
        later = [f"{s} from --{e}" for s, e in [("max_steps", "epochs"), ("warmup_steps", "warmup-epochs")]
                 if config[e.replace("-", "_")] > 0]
        assert printed.endswith(f"; the run sets {' and '.join(later)} once it reads the data)\n" if later else
                                "nothing was written)\n")
    for epochs in ("2", "-5"):  # (a value that would be refused is refused, not overridden)
        err = error_of(train.main, ["--preset=arith", "--max-steps=40", f"--epochs={epochs}", "--dry-run"], capsys)
        assert "--max-steps and --epochs both say how long: give one of them" in err
    assert list(tmp_path.iterdir()) == []


def test_resume_needs_nothing_but_the_folder_and_keeps_the_final_evaluation_whole(answer_dir, whole_run, tmp_path,
                                                                                   monkeypatch, capsys):
    """--resume without --preset or --data-dir continues on the run's own data, and with --data-dir on the same
    data moved elsewhere. Ending a run early with a lower --max-steps at a step that had an intermediate
    evaluation evaluates it again, as a final one. Resumed to more steps, a finished run is one no longer, from
    its first new checkpoint: a session stopped before one leaves the finished run as it was."""
    parts, short, moved = tmp_path / "parts", tmp_path / "short", tmp_path / "moved"
    train.main(tiny_args(answer_dir, parts, "--stop-at=6"))
    shutil.copytree(answer_dir, moved)
    train.main(["--out-dir", str(parts), "--resume", f"--data-dir={moved}"])
    assert_same_run(parts, whole_run)
    # a run of epochs (200 samples in batches of 8, half an epoch: 12.5 steps, 13) ended with --max-steps=6
    argv = tiny_args(answer_dir, short, "--stop-at=6", "--epochs=0.5")
    train.main([a for a in argv if not a.startswith("--max-steps=")])
    assert json.loads((short / "config.json").read_text())["max_steps"] == 13
    capsys.readouterr()
    train.main(["--out-dir", str(short), "--resume", "--dry-run"])  # its steps are known: no word of epochs
    printed = capsys.readouterr().out
    assert '"max_steps": 13' in printed.splitlines()[0] and printed.endswith("nothing was written)\n")
    err = error_of(train.main, ["--out-dir", str(short), "--resume", "--stop-at=14", "--dry-run"], capsys)
    assert err == "train.py: error: --stop-at=14 is past the last step (max_steps=13)"  # checked in steps, as known
    train.main(["--out-dir", str(short), "--resume", "--max-steps=6"])
    evals = [r for r in read_log(short) if "val_loss" in r]
    assert [r["step"] for r in evals] == [6] and "acc_3" in evals[0]  # one evaluation, with the test split
    summary = json.loads((short / "summary.json").read_text())
    assert "acc_3" in summary and summary["tokens_seen"] == 6 * 8 * 64  # every step, those of the first session too
    before = snapshot(short)

    def interrupted(self, *args, **kwargs):  # Ctrl-C at the first batch of the session that goes on to step 8
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(SystemExit) as e:
        patch.setattr(arithmetic.Data, "batch", interrupted)
        train.main(["--out-dir", str(short), "--resume", "--max-steps=8"])
    assert "still holds the run finished at step 6; continue with --resume --max-steps=8" in capsys.readouterr().out
    assert e.value.code == 130 and snapshot(short).keys() == before.keys()  # the run as it was: its log aside,
    assert all(snapshot(short)[p] == before[p] for p in before if p.name != "log.jsonl")  # whose session rows differ
    assert [r for r in read_log(short) if "session" not in r] == \
        [json.loads(line) for line in before[short / "log.jsonl"].splitlines() if b'"session"' not in line]
    real, calls = arithmetic.Data.batch, []

    def fails_later(self, *args, **kwargs):  # step 7 taken (2 micro-batches) and logged, then an error
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("out of memory")
        return real(self, *args, **kwargs)

    with monkeypatch.context() as patch, pytest.raises(RuntimeError):
        patch.setattr(arithmetic.Data, "batch", fails_later)
        train.main(["--out-dir", str(short), "--resume", "--max-steps=8"])
    assert [r["step"] for r in read_log(short) if "loss" in r][-1] == 7  # logged: a run of 8 steps no longer finished
    assert not (short / "summary.json").exists() and json.loads((short / "config.json").read_text())["max_steps"] == 8
    (short / "config.json").write_text("null")  # damaged: --resume writes it anew
    train.main(["--out-dir", str(short), "--resume", "--max-steps=8", "--stop-at=7"])  # finished, and now not
    assert not (short / "summary.json").exists() and runs.read_checkpoint(short)["step"] == 7


def test_a_session_in_another_precision_is_said_and_logged(answer_dir, tmp_path, capsys):
    """A run resumed where its arithmetic changes (a CPU after a GPU; here float32 after bfloat16) says so as it
    begins; its log has a row for each session, and its summary lists them: where each step ran stays on record."""
    run = tmp_path / "run"
    train.main(tiny_args(answer_dir, run, "--max-steps=4", "--stop-at=2", "--dtype=bfloat16"))
    capsys.readouterr()
    train.main(tiny_args(answer_dir, run, "--max-steps=4", "--resume", "--stop-at=3", "--dtype=float32"))
    assert "NOTE this run ran on cpu in bfloat16 until step 2; from here it runs on cpu in float32" in \
        capsys.readouterr().out
    train.main(tiny_args(answer_dir, run, "--max-steps=4", "--resume"))  # as the session before it: nothing said
    assert "NOTE" not in capsys.readouterr().out
    where = dict(device="cpu", compile=False, world_size=1)
    sessions = [dict(step=0, dtype="bfloat16", **where), dict(step=2, dtype="float32", **where),
                dict(step=3, dtype="float32", **where)]
    assert [dict(step=r["step"], **r["session"]) for r in read_log(run) if "session" in r] == sessions
    assert json.loads((run / "summary.json").read_text())["sessions"] == sessions


def test_a_session_on_another_device_of_its_kind_is_not_said(answer_dir, tmp_path, capsys):
    """Another device of the same kind (cuda:1 for cuda:0), compiled or not, in more or fewer processes: the arithmetic
    is the same, so nothing is said as the run resumes; its log still has the session's row."""
    run = tmp_path / "run"
    train.main(tiny_args(answer_dir, run, "--max-steps=4", "--stop-at=2"))
    rows = read_log(run)
    for r in rows:  # as if the first session had run on another device of this kind, compiled, in 8 processes
        if "session" in r:
            r["session"].update(device="cpu:1", compile=True, world_size=8)
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    train.main(tiny_args(answer_dir, run, "--max-steps=4", "--resume"))
    assert "NOTE" not in capsys.readouterr().out
    assert [r["session"]["device"] for r in read_log(run) if "session" in r] == ["cpu:1", "cpu"]


def test_language_data_cannot_move_under_a_resumed_run(language_run, tmp_path, capsys):
    """--data-dir anew on --resume is for a task's data, which is checked against the run's regime: token shards
    say nothing of what they hold, so another folder of them is refused, not trained on."""
    err = error_of(train.main, ["--out-dir", str(language_run), "--resume", "--max-steps=8", f"--data-dir={tmp_path}",
                                "--dry-run"], capsys)
    assert f"--resume: {language_run / 'ckpt.pt'} was trained with data_dir=" in err and f"(not '{tmp_path}')" in err


def test_a_language_run_reads_only_the_shards_it_began_with(tmp_path, capsys):
    """Token shards say nothing of what they hold, so a run records which it reads, {split: {shard: tokens}}: one added
    since (more of FineWeb prepared), gone or changed is refused as the run resumes or is evaluated, not read."""
    folder, run = tmp_path / "data", tmp_path / "run"
    enc = small_encoding()
    text = enc.encode_ordinary("To be, or not to be, that is the question. " * 40)
    write_shard(folder / "text_train_000000.bin", text)
    write_shard(folder / "text_val_000000.bin", text[:300])
    train.main(["--preset=tiny", "--data=shakespeare", f"--data-dir={folder}", f"--out-dir={run}", "--vocab-size=320",
                "--block-size=32", "--n-layer=1", "--n-embd=16", "--n-head=2", "--n-kv-head=2", "--batch-size=4",
                "--micro-batch-size=4", "--max-steps=2", "--stop-at=1", "--eval-tokens=256"])
    shards = {"val": {"text_val_000000.bin": 300}, "train": {"text_train_000000.bin": len(text)}}
    assert json.loads((run / "config.json").read_text())["shards"] == runs.read_checkpoint(run)["config"]["shards"] \
        == shards
    for name, tokens, split, change in [("text_train_000001.bin", text, "train", "text_train_000001.bin is new"),
                                        ("text_val_000000.bin", text[:200], "val", "text_val_000000.bin holds 200 "
                                         "tokens, not 300")]:
        kept = (folder / name).read_bytes() if (folder / name).exists() else None
        write_shard(folder / name, tokens)
        line = f"{folder} holds other {split} shards than the run read ({change}): put the run's shards back, or " \
            "train a new run on these"
        assert error_of(train.main, ["--out-dir", str(run), "--resume"], capsys, code=1) == f"train.py: error: {line}"
        if split == "val":  # (an evaluation reads the validation shards alone)
            assert error_of(sample.main, ["--out-dir", str(run), "--eval"], capsys, code=1) == \
                f"sample.py: error: {line}"
        (folder / name).write_bytes(kept) if kept else (folder / name).unlink()
    folder.rename(tmp_path / "moved")  # moved away: an evaluation may read them elsewhere, a resumed run may not
    assert "give --data-dir" not in error_of(train.main, ["--out-dir", str(run), "--resume"], capsys, code=1)
    assert error_of(sample.main, ["--out-dir", str(run), "--eval"], capsys, code=1) == f"sample.py: error: no val " \
        f"shards in {folder}: give --data-dir the folder that holds the run's shards now"
    (tmp_path / "moved").rename(folder)
    train.main(["--out-dir", str(run), "--resume"])  # its own shards again
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_an_offline_preset_generates_only_its_own_data_in_its_own_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = error_of(train.main, ["--preset=arith", "--data=shakespeare", "--out-dir=run"], capsys, code=1)
    assert f"no val shards in {tmp_path / 'data' / 'shakespeare'}" in err
    err = error_of(train.main, ["--preset=tiny", "--data-dir=data/arithmetc-quick", "--out-dir=run"], capsys, code=1)
    # the preset's own regime, the one whose samples fit its block (the paper's default regime does not fit tiny's)
    assert f"no arithmetic data in {tmp_path / 'data' / 'arithmetc-quick'}: run `python prepare_data.py arithmetic " \
           f"--data-dir {tmp_path / 'data' / 'arithmetc-quick'} --field int --count operands --tiers 4,5,6 " \
           "--target steps`" in err
    home = tmp_path / "data" / "arithmetic-quick"  # the preset's own folder, with the user's files by its data's names
    home.mkdir(parents=True)
    (home / "train.txt").write_text("1 + 2 = 3\n")
    for flags in ([], ["--overwrite"], ["--dry-run"]):  # (the run's --overwrite is not the data's; a dry run refuses
        # it too)
        err = error_of(train.main, ["--preset=tiny", "--out-dir=run", *flags], capsys)
        assert err == f"train.py: error: {home} holds train.txt but no meta.json, and not as data this code was " \
            "writing: move them away, or replace them with `python prepare_data.py arithmetic --data-dir " \
            f"{home} --field int --count operands --tiers 4,5,6 --target steps --overwrite`"
    assert (home / "train.txt").read_text() == "1 + 2 = 3\n" and not (tmp_path / "run").exists()
    shutil.rmtree(home)
    home.write_text("")  # a file where the preset's folder goes
    for flags in ([], ["--dry-run"]):  # (and not "preparing the arithmetic task" first)
        with pytest.raises(SystemExit):
            train.main(["--preset=tiny", "--out-dir=run", *flags])
        assert capsys.readouterr() == ("", f"train.py: error: cannot write {home}: {home} is a file, not a folder\n")
    shutil.rmtree(tmp_path / "data")
    err = error_of(train.main, ["--preset=arith", "--data-dir=mine", "--out-dir=run"], capsys, code=1)
    assert err.endswith(f"`python prepare_data.py arithmetic --data-dir {tmp_path / 'mine'} --field int --count "
                        "operators --tiers 6 --target steps`")  # (no word of a download: the task needs none)
    assert list(tmp_path.iterdir()) == []
    real = arithmetic.atomic_write

    def cut(path, write):  # Ctrl-C as meta.json is written: the folder holds another regime's data, cut short
        if Path(path).name == "meta.json":
            raise KeyboardInterrupt
        real(path, write)

    with monkeypatch.context() as m:
        m.setattr(arithmetic, "atomic_write", cut)
        with pytest.raises(KeyboardInterrupt):
            arithmetic.prepare(Path("mine"), arithmetic.Task(field="mod", tiers=(2,)), 0, 8, 2)
    err = error_of(train.main, ["--preset=arith", "--data-dir=mine", "--out-dir=run"], capsys, code=1)
    assert err == f"train.py: error: {tmp_path / 'mine'} was cut short as its data was made: `python prepare_data.py " \
        f"arithmetic --data-dir {tmp_path / 'mine'} --field mod --count operands --tiers 2 --target steps " \
        "--train-size 8 --test-size 2` finishes it"  # the command of the data it held, not of the preset's regime
    train.main(["--preset=arith", "--data-dir=mine", "--out-dir=run", "--dry-run"])  # the same, as a dry run's note
    assert capsys.readouterr().err == f"note: {tmp_path / 'mine'} was cut short as its data was made: the run needs " \
        f"`python prepare_data.py arithmetic --data-dir {tmp_path / 'mine'} --field mod --count operands --tiers 2 " \
        "--target steps --train-size 8 --test-size 2` first\n"


def test_token_ids_past_the_vocabulary_say_what_to_give(arith_run, tmp_path, capsys):
    """Token shards whose ids the model's embedding cannot look up: the flag that fits, or, for a model whose
    vocabulary is fixed (--init-from), a new run; an id that only a train shard holds, one line mid-run."""
    lang = tmp_path / "lang"
    lang.mkdir()
    write_shard(lang / "x_val_000000.bin", [5, 2000] * 300)
    write_shard(lang / "x_train_000000.bin", [5, 2000] * 300)
    shakespeare = ["--preset=tiny", "--data=shakespeare", f"--data-dir={lang}", "--max-steps=2"]
    err = error_of(train.main, [*shakespeare, f"--init-from={arith_run}", f"--out-dir={tmp_path / 'a'}"], capsys)
    assert err.endswith("is smaller than the shakespeare vocabulary (at least 2001): the model's is fixed: train a new "
                        "run with --vocab-size=50304")
    write_shard(lang / "x_val_000000.bin", [5, 7] * 300)  # now only the train shard holds 2000
    err = error_of(train.main, [*shakespeare, f"--out-dir={tmp_path / 'b'}"], capsys, code=1)
    assert err == "train.py: error: token id 2000 of a train shard is past the model's --vocab-size=1024, which the " \
                  "validation shard's tokens fit: train a new run with a --vocab-size above it"


def test_under_torchrun_rank_0_alone_generates_a_presets_data(tmp_path, monkeypatch):
    """An offline preset's data, under torchrun: rank 0 generates it, and every process meets at one barrier,
    whether or not it found the data there (one that skipped it would leave the others waiting for good)."""
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(arithmetic, "prepare", lambda home, task: calls.append(("prepare", task)))
    cfg = runs.resolve(["--preset=tiny", "--out-dir=run"], train.TrainConfig, train.PRESETS)[0]
    home = runs.data_folder(train.PRESETS, "tiny", "arithmetic")
    for master, expected in ((False, ["barrier"]), (True, [("prepare", arithmetic.QUICK_START), "barrier"])):
        calls.clear()
        with pytest.raises(cli.DataError, match="no arithmetic data"):  # (prepare wrote nothing here)
            runs.training_data(cfg, types.SimpleNamespace(master=master, resume=None), train.GENERATES["tiny"], home)
        assert calls == expected
    (Path(home) / "meta.json").parent.mkdir(parents=True)
    (Path(home) / "meta.json").write_text("{")  # found (damaged, so that loading it stops the call): still the barrier
    calls.clear()
    with pytest.raises(cli.DataError, match="meta.json is not valid JSON"):
        runs.training_data(cfg, types.SimpleNamespace(master=False, resume=None), train.GENERATES["tiny"], home)
    assert calls == ["barrier"]


def test_init_from_takes_the_models_shape_but_not_its_block_size(arith_dir, arith_run, tmp_path):
    """--init-from: the other run's model, at a block size of this run's (RoPE is computed, not stored: its weights fit
    a longer block, to fine-tune on longer samples); its checkpoint's weights load into that model."""
    args = ["--preset=tiny", f"--data-dir={arith_dir}", f"--out-dir={tmp_path / 'long'}", f"--init-from={arith_run}",
            "--block-size=128"]
    cfg, resume, init, *_ = runs.resolve(args, train.TrainConfig, train.PRESETS)
    assert (cfg.block_size, init["config"]["block_size"], resume) == (128, 64, None)
    shape = ("n_layer", "n_head", "n_kv_head", "n_embd", "mlp_hidden")  # the preset's: 4, 4, 4, 64, 256
    assert [getattr(cfg, k) for k in shape] == [init["config"][k] for k in shape] == [2, 2, 2, 32, 64]
    runs.Run(cfg, None, init).check_weights()
