"""What every script shares (cli.py), and every bad input of every script: one line, its exit
code, and nothing written."""

import ast
import contextlib
import dataclasses
import errno
import fcntl
import io
import json
import math
import os
import re
import shutil
import signal
import stat
import struct
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import analyze
import arithmetic
import bench
import cli
import data
import grid
import methods
import prepare_data
import prosqa
import runs
import sample
import train
from conftest import PRUNABLE, edit_checkpoint, edit_settings, error_of, snapshot, tiny_args
from data import MAGIC, write_shard


def test_a_cuda_device_is_one_this_machine_has(monkeypatch):
    """--device=cuda:N numbers the visible devices from 0: with one, cuda:0 is it and cuda:1 is refused. A CUDA build
    that sees no device says so (not that it is a CPU-only build); auto is CUDA, then MPS, then the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(cli.UsageError, match=re.escape("--device=cuda:0: no CUDA device is visible")):
        cli.pick_device("cuda:0")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert cli.pick_device("auto") == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert cli.pick_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.pick_device("cuda:0") == "cuda:0" and cli.pick_device("cuda") == "cuda"
    with pytest.raises(cli.UsageError, match=re.escape("--device=cuda:1: this machine has 1 CUDA device, numbered "
                                                       "from 0")):
        cli.pick_device("cuda:1")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert cli.pick_device("auto") == "cuda"  # (CUDA first, where a machine has both)
    for name in ("cpu:0", "cuda:", "cuda:0x", "gpu"):  # the whole name, not a known one it begins with
        with pytest.raises(cli.UsageError, match=re.escape(f"--device={name!r}: choose from auto, cpu, cuda, cuda:N")):
            cli.pick_device(name)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(cli.UsageError, match=re.escape("--device=mps: MPS is not available on this machine")):
        cli.pick_device("mps")


def test_lime_triton_is_checked_with_the_device(monkeypatch):
    """LIME_TRITON is auto, 0 or 1: another value is refused, not read as auto; 1 off CUDA needs Triton's
    interpreter (else a traceback from Triton's driver at the first forward), or Triton at all."""
    import kernels
    monkeypatch.setattr(kernels, "USE_TRITON", "yes")
    with pytest.raises(cli.UsageError, match=re.escape("LIME_TRITON='yes': choose from auto (Triton on CUDA), 0")):
        cli.pick_device("auto")  # (auto too: resolved, then checked)
    monkeypatch.setattr(kernels, "USE_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(cli.UsageError, match="LIME_TRITON=1 on cpu: .* so set TRITON_INTERPRET=1 too"):
        cli.pick_device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert cli.pick_device("cpu") == "cpu"
    monkeypatch.setattr(kernels, "triton", None)
    with pytest.raises(cli.UsageError, match="LIME_TRITON=1: this Python has no Triton"):
        cli.pick_device("cpu")
    for value in ("0", "auto"):
        monkeypatch.setattr(kernels, "USE_TRITON", value)
        assert cli.pick_device("cpu") == "cpu"



def test_lime_tile_sets_the_kernels_knobs_or_is_refused(monkeypatch, knobs_of_a_tile):
    """LIME_TILE names a tile as bench.py --kernels --sweep does, and sets the kernels' five knobs for the process; a
    value that is not five whole numbers, or not powers of 2 where Triton needs them, is one line as the device is
    picked, where the kernels would otherwise run the default tile without a word."""
    import kernels
    for tile, problem in [("256/4/8/1", "five whole numbers, COLUMNS/NUM_WARPS/NMAX/SPLIT/PACK"),
                          ("256/4/x/1/0", "five whole numbers"), ("256/4/-1/1/0", "five whole numbers"),
                          ("192/4/8/1/0", "COLUMNS (16 to 4096), NUM_WARPS (32 at most) and SPLIT are powers of 2, "
                                          "NMAX 0 to 64, PACK 0 or 1"),
                          ("256/64/8/1/0", "are powers of 2"), ("256/4/8/0/0", "are powers of 2"),
                          ("8/4/8/1/0", "are powers of 2"), ("8192/4/8/1/0", "are powers of 2"),  # (Triton: a tile
                          ("256/4/65/1/0", "NMAX 0 to 64"),  # of at most 2**20 values; a launch's arguments: a few KB)
                          ("256/4/8/1/2", "PACK 0 or 1")]:
        monkeypatch.setattr(kernels, "TILE", tile)
        with pytest.raises(cli.UsageError, match=re.escape(f"LIME_TILE={tile!r}: ") + f".*{re.escape(problem)}"):
            cli.pick_device("cpu")
    for tile in ("128/8/0/4/1", "16/4/64/1/0", "4096/32/0/4/0"):
        monkeypatch.setattr(kernels, "TILE", tile)
        assert cli.pick_device("cpu") == "cpu"
    stdout, stderr = knobs_of_a_tile.communicate(timeout=120)  # a process under LIME_TILE=128/8/0/4/1 (conftest)
    assert stdout.split() == ["128", "8", "0", "4", "1"], stderr


def test_metrics_show_accuracies_in_percent():
    """What the scripts print of metrics: an accuracy (acc, acc_4, val_acc_6) in percent, as the README gives them,
    anything else to 4 decimals."""
    assert cli.show_metrics(dict(val_loss=0.26531, val_ppl=1.30381, acc_4=0.31, val_acc_6=1.0, acc=0.5)) == \
        "val_loss 0.2653, val_ppl 1.3038, acc_4 31.0%, val_acc_6 100.0%, acc 50.0%"
    assert cli.show_metrics(dict(accept_rate=0.25, acc_4x=0.5)) == "accept_rate 0.2500, acc_4x 0.5000"  # (a fork's)


def test_each_rule_takes_its_bounds_and_nothing_past_them():
    """A config field's rule (check_fields) at its edges: the least and the most it takes, the values just past them,
    and NaN and the infinities, which no rule takes (a NaN compares False with anything: `not x <= 0` would take it)."""
    for (text, ok), good, bad in [(cli.POSITIVE, [1e-300, 1, 1e300], [0, -1e-300]),
                                  (cli.NON_NEGATIVE, [0, 0.0, 1e300], [-1e-300, -1]),
                                  (cli.SEED, [0, 2**63 - 1], [-1, 2**63]),
                                  (cli.SIZE, [1, 2**31 - 1], [0, 2**31])]:
        assert [ok(x) for x in good] == [True] * len(good), text
        assert [ok(x) for x in [*bad, math.nan, math.inf, -math.inf]] == [False] * (len(bad) + 3), text


def test_peak_flops_only_for_known_devices(monkeypatch):
    names = {"cuda": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA H100 PCIe", "cuda:2": "NVIDIA GeForce GTX 1080",
             "cuda:3": "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[device])
    assert cli.peak_flops("cuda", "bfloat16") == 989e12
    assert cli.peak_flops("cuda:1", "bfloat16") == 756e12
    assert cli.peak_flops("cuda:3", "bfloat16") == 989e12  # (the H100 SXM's compute, with more memory)
    assert cli.peak_flops("cuda:2", "bfloat16") is None  # unknown: no MFU rather than a wrong one
    assert cli.peak_flops("cuda", "float32") is None and cli.peak_flops("cpu", "bfloat16") is None


def test_autocast_is_bfloat16_on_cuda_unless_told():
    """What sample.py and analyze.py evaluate in: bf16 autocast on any CUDA device (as training there), full precision
    on the CPU, and what a dtype given says."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no CUDA here: torch disables the autocast it builds, with a warning)
        cuda = cli.autocast_for("cuda:1")
    assert (cuda.device, cuda.fast_dtype) == ("cuda", torch.bfloat16)
    assert isinstance(cli.autocast_for("cpu"), contextlib.nullcontext)
    cpu = cli.autocast_for("cpu", "bfloat16")
    assert (cpu.device, cpu.fast_dtype) == ("cpu", torch.bfloat16)
    assert cli.dtype_for("cuda:1") == "bfloat16" and cli.dtype_for("mps") == cli.dtype_for("cpu") == "float32"
    assert cli.dtype_for("cuda", "float32") == "float32" and cli.dtype_for("cpu", "bfloat16") == "bfloat16"


def test_compile_is_on_for_cuda_unless_told():
    assert cli.compiles("auto", "cuda:1") and not cli.compiles("auto", "cpu") and not cli.compiles("auto", "mps")
    assert cli.compiles("on", "cpu") and not cli.compiles("off", "cuda")


def test_ctrl_c_while_torch_loads_is_one_line(ctrl_c_while_torch_loads):
    """torch takes seconds to load, and a Ctrl-C meanwhile costs no traceback either; SIGTERM (`kill`) is one line too,
    not an exit in silence. (The processes: conftest's, started as the session starts.)"""
    for signum, proc in ctrl_c_while_torch_loads.items():
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out, err) == (128 + signum, "", f"train.py: interrupted ({signum.name})\n")


def test_output_closed_by_its_reader_is_no_traceback(closed_and_broken_pipe):
    """`python analyze.py ... | head -1`: once head has gone, the script stops without a word. Another pipe broken
    (a worker's, say) is a fault, and keeps its traceback. (Both scripts, conftest's, started as the session starts:
    each imports torch.)"""
    procs = closed_and_broken_pipe
    assert procs[0].stdout.readline() == "0\n"
    procs[0].stdout.close()
    assert (procs[0].wait(timeout=60), procs[0].stderr.read()) == (128 + signal.SIGPIPE, "")
    stderr = procs[1].communicate(timeout=60)[1]
    assert procs[1].returncode == 1 and "BrokenPipeError" in stderr


def test_an_output_that_cannot_be_written_is_one_line(monkeypatch, capsys):
    """`analyze.py table > out` on a full disk: a print that fails, or the output still buffered as the script ends
    (which Python's exit would flush: two lines and exit 120), is one line and exit 1; and so is a folder made on a
    full disk (a new --out-dir). Another error of a file's stays a fault to see."""
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    class Buffered(io.StringIO):  # (what a print wrote waits in the buffer)
        def flush(self):
            raise full

    class Unbuffered(io.StringIO):
        def write(self, text):
            raise full

    for stdout in (Buffered, Unbuffered):
        monkeypatch.setattr(sys, "stdout", stdout())
        with pytest.raises(SystemExit) as e, cli.one_line_errors("analyze.py"):
            print("a table")
        assert e.value.code == 1
        assert capsys.readouterr().err == "analyze.py: error: cannot write the output (No space left on device)\n"
    # a read that fails names no file either (numpy's): an input/output error is not blamed on the output alone
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    with pytest.raises(SystemExit) as e, cli.one_line_errors("train.py"):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    assert e.value.code == 1 and capsys.readouterr().err == "train.py: error: input/output error, writing the output " \
        "or reading a file (a failing disk, or a terminal gone)\n"
    monkeypatch.undo()
    monkeypatch.setattr(os, "mkdir", lambda path, mode=0o777: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))))
    with pytest.raises(SystemExit) as e, cli.one_line_errors("train.py"):
        cli.hold_folder("out/new-run", "a test")
    monkeypatch.undo()
    assert e.value.code == 1
    assert capsys.readouterr().err == "train.py: error: cannot write out/new-run: No space left on device\n"
    with pytest.raises(OSError, match="ckpt.pt"), cli.one_line_errors("analyze.py"):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), "ckpt.pt")


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



def test_help_gives_each_flags_default(capsys, monkeypatch):
    """--help (cli.Help; train.py's flags from its config): a flag's default after its help, '[3]', where it has one
    and its help does not say it ('(default: ...)'): not '[None]', '[False]' or an empty '[]'."""
    p = cli.Parser(prog="x.py")
    p.add_argument("--n", type=int, default=3, help="a set of defaults")
    p.add_argument("--name", help="a name")
    p.add_argument("--on", action="store_true", help="a switch")
    p.add_argument("--dir", default="out", help="where (default: out/<name>)")
    assert " ".join(p.format_help().split()).endswith("--n N a set of defaults [3] --name NAME a name --on a switch "
                                                      "--dir DIR where (default: out/<name>)")
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "--preset PRESET named set of defaults: 150m, 1b, deep, arith, prosqa, tiny [150m]" \
        in text and "--lr LR peak learning rate [0.001]" in text
    assert "--out-dir OUT_DIR checkpoints and logs (default out/<preset>-<router>) --batch-size" in text
    assert "fresh optimiser) --data DATA dataset [fineweb-edu]" in text
    monkeypatch.setenv("COLUMNS", "10000")  # (no line to wrap: argparse would break a name at its hyphen)
    for main in (train.main, grid.main):  # the methods, a fork's too (bench.py's default lists them all)
        with pytest.raises(SystemExit):
            main(["--help"])
        assert f": {methods.router_forms()}" in capsys.readouterr().out, main.__module__

def test_a_folder_that_cannot_be_written_is_refused_before_anything_is(arith_dir, tmp_path, capsys, monkeypatch):
    """An --out-dir inside a folder this user may not write in: one line naming that folder, not a PermissionError
    after the data was read. (To root every folder is writable: os.access says here what it says to another user.)"""
    access = os.access
    monkeypatch.setattr(cli.os, "access", lambda p, mode: access(p, mode) and Path(p) != tmp_path)
    err = error_of(train.main, tiny_args(arith_dir, tmp_path / "runs" / "a"), capsys)
    assert err == f"train.py: error: --out-dir={tmp_path / 'runs' / 'a'}: {tmp_path} is not writable"
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def shut(tmp_path, monkeypatch):
    """A folder this user may not enter (chmod 000), as a user other than root meets it: a stat of anything in it is
    a PermissionError (Path.exists raises it), and os.access says no. (To root every folder is open: patched.)"""
    shut = tmp_path.resolve() / "shut"
    shut.mkdir()
    access, stat, lstat = os.access, os.stat, os.lstat

    def denied(real):
        def call(path, *args, **kwargs):
            if not isinstance(path, int) and shut in Path(os.fsdecode(path)).parents:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "stat", denied(stat))
    monkeypatch.setattr(os, "lstat", denied(lstat))
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: access(p, mode, **kw) and Path(p) != shut)
    return shut


# (script, argv(a, t, shut), exit code, message(t, shut)): a, the arithmetic data; t, a scratch folder
IN_A_SHUT_FOLDER = [
    ("train", lambda a, t, s: tiny_args(a, s / "run"), 2, lambda t, s: f"--out-dir={s / 'run'}: {s} is not writable"),
    ("prepare_data", lambda a, t, s: ["arithmetic", "--data-dir", str(s / "d")], 2,
     lambda t, s: f"--data-dir={s / 'd'}: {s} is not writable"),
    ("grid", lambda a, t, s: ["--out-dir", str(s / "g"), "--data-root", str(t / "d")], 2,
     lambda t, s: f"--out-dir={s / 'g'}: {s} is not writable"),
    ("analyze", lambda a, t, s: ["table", str(s / "run")], 1,
     lambda t, s: f"{s / 'run'}: {os.strerror(errno.EACCES)} (this user may not enter {s})"),
    ("sample", lambda a, t, s: ["--out-dir", str(s / "run")], 1,
     lambda t, s: f"{s / 'run' / 'ckpt.pt'}: {os.strerror(errno.EACCES)} (this user may not enter {s})"),
    ("train", lambda a, t, s: ["--preset=arith", f"--data-dir={s}", f"--out-dir={t / 'run'}"], 1,
     lambda t, s: f"{s / 'meta.json'}: {os.strerror(errno.EACCES)} (this user may not enter {s})"),
]


@pytest.mark.parametrize("script, argv, code, message", IN_A_SHUT_FOLDER,
                         ids=[f"{c[0]} {c[2]}" for c in IN_A_SHUT_FOLDER])
def test_a_path_in_a_folder_this_user_may_not_enter_is_one_line(arith_dir, tmp_path, shut, capsys, refused, script,
                                                                 argv, code, message):
    """Not a PermissionError's traceback: a folder to write in is refused (exit 2, as one not writable); a path to
    read gives the folder on its way that this user may not enter (exit 1)."""
    main = {"train": train.main, "sample": sample.main, "prepare_data": prepare_data.main, "analyze": analyze.main,
            "grid": grid.main}[script]
    before = snapshot(arith_dir, tmp_path)
    assert error_of(main, argv(arith_dir, tmp_path, shut), capsys, code) == \
        f"{script}.py: error: {message(tmp_path, shut)}"
    assert snapshot(arith_dir, tmp_path) == before


def test_a_permission_error_is_one_line_where_it_names_a_path(tmp_path, capsys, monkeypatch):
    """A file this user may not read or write: its path and why, and the folder on its way this user may not enter,
    if any (not one it may enter but not write in); one of no path (a signal to another user's process, say) is a
    fault to see, and keeps its traceback."""
    with pytest.raises(SystemExit) as e, cli.one_line_errors("x.py"):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "log.jsonl"))
    assert (e.value.code, capsys.readouterr().err) == (1, f"x.py: error: {tmp_path / 'log.jsonl'}: "
                                                          f"{os.strerror(errno.EACCES)}\n")
    (tmp_path / "read-only").mkdir()
    (tmp_path / "shut").mkdir()
    access = os.access  # (to root every folder is open: what another user is told, patched)
    monkeypatch.setattr(cli.os, "access", lambda p, mode: access(p, mode) and not (
        Path(p).name == "read-only" and mode & os.W_OK or Path(p).name == "shut" and mode & os.X_OK))
    for folder, after in (("read-only", ""), ("shut", f" (this user may not enter {tmp_path / 'shut'})")):
        with pytest.raises(SystemExit), cli.one_line_errors("x.py"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / folder / "log.jsonl"))
        assert capsys.readouterr().err == f"x.py: error: {tmp_path / folder / 'log.jsonl'}: " \
                                          f"{os.strerror(errno.EACCES)}{after}\n"
    with pytest.raises(PermissionError), cli.one_line_errors("x.py"):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))


def test_what_the_output_cannot_encode_prints_escaped(tmp_path, monkeypatch):
    """A path of bytes that are not UTF-8 (Python reads them as surrogates, \\udcff) printed to an output that is
    strict (PYTHONIOENCODING=utf-8:strict, or a UTF-8 locale): escaped, not a UnicodeEncodeError once the work is
    done (train.py's run saved, analyze.py's picture)."""
    run = tmp_path / os.fsdecode(b"run\xff")
    run.mkdir()
    (run / "config.json").write_text(json.dumps(dict(out_dir="run", router="lime")))
    (run / "log.jsonl").write_text('{"step": 1, "val_loss": 0.5}\n{"step": 2')  # a cut last line: a notice naming it
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="utf-8", errors="strict"))
    monkeypatch.setattr(analyze, "pyplot", lambda: None)  # (no picture: the notice is what this looks at)
    analyze.main(["curves", str(run)])
    sys.stdout.flush()
    said = f"{run.resolve() / 'log.jsonl'}: its last line was cut short".encode(errors="backslashreplace")
    assert b"/run\\udcff/log.jsonl" in said and said in out.getvalue()


@contextlib.contextmanager
def within(seconds):
    """The body, failed after `seconds` where it would wait forever (an open of a FIFO that no one writes)."""
    def late(signum, frame):
        pytest.fail(f"still waiting after {seconds} s")
    previous = signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_data_a_preparation_holds_is_refused_not_read(arith_dir, tmp_path, capsys):
    """A run started while prepare_data.py writes its data folder read what was there so far (some shards of
    FineWeb-Edu) with exit 0, and could not be resumed once the rest came. Readers at once do not refuse one another."""
    d = tmp_path / "d"
    shutil.copytree(arith_dir, d)
    held = cli.hold_folder(d, "a test")  # (prepare_data.py, writing it)
    try:
        err = error_of(train.main, tiny_args(d, tmp_path / "run"), capsys)
        train.main(tiny_args(d, tmp_path / "run", "--dry-run"))  # a dry run checks the rest: the data is not there yet
        assert f"no data in {d} yet, so none was checked" in capsys.readouterr().out
    finally:
        os.close(held)
    assert err == f"train.py: error: {d} is in use by another process (a prepare_data.py preparing it? wait for it " \
        "to end)"
    assert not (tmp_path / "run").exists()
    reader = os.open(d, os.O_RDONLY)
    try:
        fcntl.flock(reader, fcntl.LOCK_SH)  # another run, reading it
        assert cli.refuse_writing(d, "a test") is None
    finally:
        os.close(reader)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs (Windows)")
def test_a_fifo_by_a_files_name_is_refused_not_waited_on(arith_dir, arith_run, tmp_path, capsys):
    """A FIFO where a run's file should be (mkfifo, by hand or by a tool): its read would wait for a writer forever.
    Each reader refuses it as train.py does, with one line."""
    for name, argv in (("summary.json", ["table"]), ("config.json", ["curves"]), ("log.jsonl", ["curves"]),
                       ("ckpt.pt", ["routes", "--out-dir"])):
        run = tmp_path / f"run-{name}"
        shutil.copytree(arith_run, run)
        (run / name).unlink()
        os.mkfifo(run / name)
        before = snapshot(run)
        with within(10):
            assert error_of(analyze.main, [*argv, str(run)], capsys, 1) == \
                f"analyze.py: error: {run / name} is not a file"
        assert snapshot(run) == before
    os.mkfifo(tmp_path / "x_val_000000.bin")  # the readers of data too: a token shard, a ProsQA file and its tokens
    os.mkfifo(tmp_path / "prosqa_test.json")
    os.mkfifo(tmp_path / "prosqa_test.npz")
    (tmp_path / "s").mkdir()  # (a folder of its own: no other data set's shards beside it)
    os.mkfifo(tmp_path / "s" / "input.txt")  # (a text of your own, whose shards are not made yet)
    arith = tmp_path / "arith"  # an arithmetic split, whose size reads 0: not "empty", nor a rebuild that fails
    shutil.copytree(arith_dir, arith)
    (arith / "val_5.txt").unlink()
    os.mkfifo(arith / "val_5.txt")
    with within(10):
        with pytest.raises(cli.DataError, match=rf"^{re.escape(str(tmp_path / 'x_val_000000.bin'))}: not a file$"):
            data.check_shard(tmp_path / "x_val_000000.bin")
        with pytest.raises(cli.DataError, match=rf"^prosqa_test.json in {re.escape(str(tmp_path))} is not a file$"):
            prosqa.check(tmp_path / "prosqa_test.json")
        with pytest.raises(cli.DataError, match=rf"^{re.escape(str(tmp_path / 'prosqa_test.npz'))} is not a file; "):
            prosqa.load(tmp_path, "test")
        with pytest.raises(cli.DataError, match=rf"^{re.escape(str(tmp_path / 's' / 'input.txt'))} is not a file: "):
            prepare_data.prepare_shakespeare(tmp_path / "s")
        with pytest.raises(cli.DataError, match=rf"^{re.escape(str(arith / 'val_5.txt'))} is not a file but the data's "
                                                "files go by that name: move it away$"):
            arithmetic.load(arith)
        # a FIFO by the data folder's name: a run (of token data) and a dry run look for a folder, not into a FIFO
        os.mkfifo(tmp_path / "fifo")
        flags = ["--preset=tiny", "--data=shakespeare", f"--data-dir={tmp_path / 'fifo'}", "--vocab-size=320",
                 f"--out-dir={tmp_path / 'run'}"]
        for dry in ([], ["--dry-run"]):
            assert error_of(train.main, [*flags, *dry], capsys, 2) == \
                f"train.py: error: {tmp_path / 'fifo'} is not a folder: give --data-dir the folder that holds the data"


def test_two_processes_writing_one_file_do_not_collide(tmp_path, monkeypatch):
    """Two runs of an offline preset started at once both generate its data: each write goes through a
    temporary file of its own, so neither renames the other's away (a FileNotFoundError once)."""
    path = tmp_path / "train.txt"

    def first(f):
        f.write(b"the same lines\n")
        with monkeypatch.context() as other:  # meanwhile, another process writes the same file, whole
            other.setattr(cli.os, "getpid", lambda: 1)
            cli.atomic_write(path, lambda g: g.write(b"the same lines\n"))

    cli.atomic_write(path, first)
    assert path.read_bytes() == b"the same lines\n" and list(tmp_path.iterdir()) == [path]
    # what a process killed while writing left (a checkpoint's can be GBs) goes; a running process's stays
    killed, writing = tmp_path / "train.txt.999999999.tmp", tmp_path / f"train.txt.{os.getppid()}.tmp"
    others = tmp_path / "train.txt.999999998.tmp"  # another user's process, running: signal 0 may not reach it
    for stale in (killed, writing, others):
        stale.write_bytes(b"half")
    kill = os.kill
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: kill(pid, sig) if pid != 999999998 else (
        _ for _ in ()).throw(PermissionError(errno.EPERM, os.strerror(errno.EPERM))))
    cli.atomic_write(path, lambda f: f.write(b"new"))
    assert set(tmp_path.iterdir()) == {path, writing, others} and path.read_bytes() == b"new"
    # a name that glob reads as a pattern ('[1]' matches b1.json) goes by its own leftovers only; a leftover whose
    # middle is no process id is not taken for one
    odd, near, no_pid = tmp_path / "b[1].json", tmp_path / "b1.json.999999999.tmp", tmp_path / "b[1].json.x.tmp"
    for stale in (tmp_path / "b[1].json.999999999.tmp", near, no_pid):
        stale.write_bytes(b"half")
    cli.atomic_write(odd, lambda f: f.write(b"new"))
    assert set(tmp_path.iterdir()) == {path, writing, others, odd, near, no_pid}
    # a folder by such a name is no leftover of ours, and one that may not be removed is left: the file is written
    folder, kept = tmp_path / "c.json.999999999.tmp", tmp_path / "c.json.999999997.tmp"
    folder.mkdir()
    kept.write_bytes(b"half")
    unlink = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: unlink(self, missing_ok) if self != kept else (
        _ for _ in ()).throw(PermissionError(errno.EPERM, os.strerror(errno.EPERM))))
    cli.atomic_write(tmp_path / "c.json", lambda f: f.write(b"new"))
    assert (tmp_path / "c.json").read_bytes() == b"new" and folder.is_dir() and kept.exists()


def test_what_a_killed_process_left_goes_before_the_write_needs_its_space(tmp_path):
    """A temporary file that a process killed while writing left (a checkpoint's: GBs) goes before the new file is
    written, not after it is whole: on a full disk, that write would fail for the space the leftover holds, again and
    again, and the leftover stay."""
    path, killed = tmp_path / "ckpt.pt", tmp_path / "ckpt.pt.999999999.tmp"
    killed.write_bytes(b"half")
    seen = []

    def full(f):
        seen.append(killed.exists())
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(cli.DataError, match="No space left on device"):
        cli.atomic_write(path, full)
    assert seen == [False] and not list(tmp_path.iterdir())


def test_a_file_written_since_compares_unequal(tmp_path):
    """file_state (what bench.py's --json and arithmetic's meta.json are compared by) tells each change alone, the
    file's time set back as it was: replaced by a rename (its inode), appended to (its size), rewritten in place at
    the same size (its time of change); and a file gone."""
    path, other, t = tmp_path / "b.json", tmp_path / "new", 10**18
    assert cli.file_state(path) is None
    path.write_bytes(b"1234")
    os.utime(path, ns=(t, t))

    def append():
        with path.open("ab") as f:
            f.write(b"9")
        os.utime(path, ns=(t, t))
    for change in (lambda: (other.write_bytes(b"5678"), os.utime(other, ns=(t, t)), os.replace(other, path)), append,
                   lambda: (path.write_bytes(b"abcde"), os.utime(path, ns=(t, t + 1))), path.unlink):
        seen = cli.file_state(path)
        assert cli.file_state(path) == seen  # (read again: the same)
        change()
        assert cli.file_state(path) != seen
    assert cli.file_state(path) is None


def test_a_hold_on_a_folder_removed_or_replaced_meanwhile_holds_nothing_there(tmp_path):
    """held_there: the folder hold_folder holds is the one at its path until it is removed, or replaced by one of
    the same name (another process that made it anew as this one waited): then the lock holds nothing there."""
    folder = tmp_path / "data"
    fd = cli.hold_folder(folder, "a test")
    try:
        assert cli.held_there(fd, folder)
        folder.rmdir()
        assert not cli.held_there(fd, folder)
        folder.mkdir()
        assert not cli.held_there(fd, folder)
    finally:
        os.close(fd)


def held_then_removed(folder):
    """`folder` made and held as another process would, which removes it and lets go 0.2 s later (its command cut
    short before it wrote): the timer that does it, started."""
    other = cli.hold_folder(folder, "a test")

    def stopped():
        folder.rmdir()
        os.close(other)

    timer = threading.Timer(0.2, stopped)
    timer.start()
    return timer


def test_a_hold_waited_for_holds_the_folder_at_its_path_when_the_other_removed_it(tmp_path, capsys):
    """hold_folder(wait=True) on a folder whose maker removes it as it lets go (cut short before it wrote): the hold
    came back on the folder gone, and every caller but arithmetic.prepare wrote into a folder made anew, unheld."""
    folder = tmp_path / "data"
    timer = held_then_removed(folder)
    fd = cli.hold_folder(folder, "a test", wait=True)
    timer.join()
    try:
        assert cli.held_there(fd, folder) and "in use by another process (a test): waiting" in capsys.readouterr().out
        with pytest.raises(cli.UsageError, match="is in use by another process"):  # (and held it is)
            cli.hold_folder(folder, "a test")
    finally:
        os.close(fd)


def test_a_folder_held_and_made_for_nothing_goes_again(tmp_path):
    """holding() removes a folder that it made and that is still empty after it (a command that failed before it
    wrote), also one made anew after the one it waited for was removed; never one that was there before it."""
    folder = tmp_path / "data"
    timer = held_then_removed(folder)
    with pytest.raises(ZeroDivisionError), cli.holding(folder, "a test", wait=True):
        1 / 0
    timer.join()
    assert not folder.exists()
    folder.mkdir()  # (the user's own, empty)
    with pytest.raises(ZeroDivisionError), cli.holding(folder, "a test"):
        1 / 0
    assert folder.is_dir()


def test_a_folder_to_write_in_needs_both_write_and_search_permission(tmp_path, monkeypatch):
    """folder_problem: a folder on the way that this user may write in but not enter (no x bit), or enter but not
    write in, cannot hold a new file: either is named. (To root every folder is open: os.access patched.)"""
    (tmp_path / "a").mkdir()
    access = os.access
    for denied in (os.X_OK, os.W_OK):
        monkeypatch.setattr(cli.os, "access", lambda p, mode: access(p, mode) and not (
            Path(p) == tmp_path / "a" and mode & denied))
        assert cli.folder_problem(tmp_path / "a" / "run") == f"{tmp_path / 'a'} is not writable"
    monkeypatch.setattr(cli.os, "access", access)
    assert cli.folder_problem(tmp_path / "a" / "run") is None


def test_a_json_file_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    """read_json: a file there that the disk fails to give (or this user may not read) names itself and why."""
    path = tmp_path / "summary.json"
    path.write_text("{}")
    monkeypatch.setattr(Path, "read_bytes", lambda self: (_ for _ in ()).throw(
        OSError(errno.EIO, os.strerror(errno.EIO), str(self))))
    with pytest.raises(cli.DataError) as e:
        cli.read_json(path)
    assert str(e.value) == f"{path} cannot be read ({os.strerror(errno.EIO)})"


def test_a_write_that_fails_is_one_line_and_leaves_the_old_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"old")

    def disk_full(error):
        def write(f):
            f.write(b"half")
            raise error
        return write

    for error, says in ((OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
                        (RuntimeError("[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing "
                                      "file data/0: file write failed\n(more)"), "[enforce fail at inline_container"),
                        (RuntimeError(), "RuntimeError")):  # (one that says nothing: its kind, not an IndexError)
        with pytest.raises(cli.DataError) as e:
            cli.atomic_write(path, disk_full(error))
        assert str(e.value) == f"cannot write {path}: " + (  # (one line: a RuntimeError's first)
            "[enforce fail at inline_container.cc:858] . PytorchStreamWriter failed writing file data/0: file write "
            "failed" if says.startswith("[") else says)
        assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == b"old"

    class Full(io.RawIOBase):  # a disk that fills up after 1000 bytes of a checkpoint
        def __init__(self, f):
            self.f = f

        def writable(self):
            return True

        def write(self, b):
            if self.f.tell() + len(b) > 1000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

    # torch.save's own error says where it stopped ("[enforce fail ...] unexpected pos 704 vs 598"), its write's why
    with pytest.raises(cli.DataError, match=re.escape(f"cannot write {path}: No space left on device")):
        cli.atomic_write(path, lambda f: torch.save({"model": torch.zeros(10_000)}, Full(f)))
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == b"old"
    with pytest.raises(cli.DataError, match=re.escape(f"cannot write {path}/x: {path} is a file, not a folder")):
        cli.atomic_write(path / "x", lambda f: f.write(b"new"))
    with pytest.raises(cli.DataError, match=re.escape(f"cannot write {tmp_path}: {tmp_path} is not a file")):
        cli.atomic_write(tmp_path, lambda f: f.write(b"new"))  # a folder, or a device, by that name
    if hasattr(os, "mkfifo"):  # neither a file nor a folder (a FIFO here; /dev/null, which a rename would replace)
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(cli.DataError, match=re.escape(f"cannot write {tmp_path / 'fifo'}: {tmp_path / 'fifo'} is "
                                                          "not a file")):
            cli.atomic_write(tmp_path / "fifo", lambda f: f.write(b"new"))
        with pytest.raises(cli.DataError, match=re.escape(f"{tmp_path / 'fifo'} is not a folder")):  # (not "a file")
            cli.atomic_write(tmp_path / "fifo" / "x", lambda f: f.write(b"new"))
        assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)


def test_a_write_is_on_disk_before_it_takes_the_name(tmp_path, monkeypatch):
    """A rename can reach the disk before the data it names (ext4's delayed allocation, say): after a power cut, an
    empty checkpoint in place of the old one. So the data is synced first."""
    done = []
    monkeypatch.setattr(cli.os, "fsync", lambda fd: done.append(
        ("fsync", "folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else os.fstat(fd).st_size)))
    replace = os.replace
    monkeypatch.setattr(cli.os, "replace", lambda a, b: (done.append(("replace",)), replace(a, b)))
    cli.atomic_write(tmp_path / "ckpt.pt", lambda f: f.write(b"weights"))
    # and the rename is on disk too: the folder's names are synced after it
    assert done == [("fsync", 7), ("replace",), ("fsync", "folder")]
    assert (tmp_path / "ckpt.pt").read_bytes() == b"weights"

    def fsync(error):
        def fail(fd):
            raise OSError(error, os.strerror(error))
        return fail

    monkeypatch.setattr(cli.os, "fsync", fsync(errno.EINVAL))  # a file system that cannot sync: written as it is
    cli.atomic_write(tmp_path / "ckpt.pt", lambda f: f.write(b"new"))
    assert (tmp_path / "ckpt.pt").read_bytes() == b"new"
    monkeypatch.setattr(cli.os, "fsync", fsync(errno.EIO))  # a disk that fails: the old file stays
    with pytest.raises(cli.DataError, match="Input/output error"):
        cli.atomic_write(tmp_path / "ckpt.pt", lambda f: f.write(b"newer"))
    assert (tmp_path / "ckpt.pt").read_bytes() == b"new"


def test_a_folder_that_cannot_be_synced_is_written_as_it_is(tmp_path, monkeypatch):
    """The sync of the folder after the rename is best-effort: skipped where the OS cannot (a file system that
    refuses it, a folder that may not be read, no O_DIRECTORY as on Windows); a disk that fails is still one line."""
    real, path = os.fsync, tmp_path / "ckpt.pt"

    def fsync(error):
        def folder_fails(fd):
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                raise OSError(error, os.strerror(error))
            real(fd)
        return folder_fails

    for i, error in enumerate((errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
        monkeypatch.setattr(cli.os, "fsync", fsync(error))
        cli.atomic_write(path, lambda f: f.write(b"v%d" % i))
        assert path.read_bytes() == b"v%d" % i and list(tmp_path.iterdir()) == [path]
    monkeypatch.setattr(cli.os, "fsync", fsync(errno.EIO))
    with pytest.raises(cli.DataError, match=re.escape(f"cannot write {path}: Input/output error")):
        cli.atomic_write(path, lambda f: f.write(b"v3"))
    assert list(tmp_path.iterdir()) == [path]  # (renamed already: the new file, not known to be on disk)

    def unreadable(*args):  # a folder it may write in but not read (os.open opens only the folder here)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(cli.os, "open", unreadable)
    cli.atomic_write(path, lambda f: f.write(b"v4"))
    assert path.read_bytes() == b"v4"
    monkeypatch.delattr(cli.os, "O_DIRECTORY")
    cli.atomic_write(path, lambda f: f.write(b"v5"))
    assert path.read_bytes() == b"v5"


def test_sigterm_is_one_line_and_unwinds_what_was_under_way(tmp_path, capsys):
    """As Ctrl-C: a temporary file goes (a write cut short), then one line and exit 143, not a silent kill."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # (what every script starts with)
    with pytest.raises(SystemExit) as e, cli.one_line_errors("prepare_data.py"):
        cli.atomic_write(tmp_path / "train.txt", lambda f: (f.write(b"half"), os.kill(os.getpid(), signal.SIGTERM)))
    assert e.value.code == 143 and capsys.readouterr().err == "prepare_data.py: interrupted (SIGTERM)\n"
    assert not list(tmp_path.iterdir()) and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back

    def own(signum, frame):  # a handler the program set itself (as train.py's, which saves a checkpoint first): kept
        pass
    signal.signal(signal.SIGTERM, own)
    try:
        with cli.one_line_errors("x.py"):
            assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_ctrl_c_once_a_script_is_done_is_ignored(monkeypatch):
    """After a script's last line, Python takes a third of a second to shut down (torch's finalizers): a Ctrl-C then
    printed a traceback from one of them. In a script's own process it is ignored once the script is done; where a
    program of one's own runs a script's main() (a sweep.py beside them, calling train.main in a loop), or in a test
    or a notebook, Ctrl-C stays a KeyboardInterrupt after it."""
    monkeypatch.setattr(cli, "SCRIPT", "x.py")  # (`python x.py`)
    try:
        for script, after in (("x.py", signal.SIG_IGN), ("train.py", signal.default_int_handler)):
            signal.signal(signal.SIGINT, cli.interrupted_while_starting)  # as cli.py sets it where it starts a script
            with cli.one_line_errors(script):
                assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            assert signal.getsignal(signal.SIGINT) is after, script
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with cli.one_line_errors("x.py"):  # (a test's process: cli.py set no handler of its own)
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("error, says", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB of "
                            "which 1.2 GiB is free. Including non-PyTorch memory, this process has 77.9 GiB memory in "
                            "use. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
                            "expandable_segments:True to avoid fragmentation."), "try setting PYTORCH_CUDA_ALLOC_CONF="
                                                                                 "expandable_segments:True to avoid"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 8000000000000 bytes."), "DefaultCPUAllocator: can't allocate memory"),
    (RuntimeError("DefaultCPUAllocator: can't allocate memory:\n  you tried to allocate 8 bytes."),
     "(DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes.)"),  # (its lines joined)
    (MemoryError(), "(MemoryError)")])  # (numpy's, drawing a batch of rows, may say nothing more)
def test_out_of_memory_is_one_line(capsys, error, says):
    with pytest.raises(SystemExit) as e, cli.one_line_errors("train.py"):
        raise error
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("train.py: error: out of memory (") and says in err
    assert err.endswith("): a smaller --micro-batch-size, --block-size or model needs less\n") and err.count("\n") == 1
    with pytest.raises(RuntimeError, match="a fault"), cli.one_line_errors("train.py"):  # any other: a traceback
        raise RuntimeError("a fault")


def test_a_compiler_torch_compile_lacks_is_one_line(capsys):
    """torch.compile on a machine without gcc (slim images): what to do, in one line; any other failure of the
    compiler stays a traceback, a bug to see. The message is the first line of inductor's, with `PATH` emptied
    (train.py --compile on, where a --compile=off run trains)."""
    from torch._inductor.exc import InductorError
    missing = InductorError(RuntimeError("InvalidCxxCompiler: No working C++ compiler found in "
                                         "torch._inductor.config.cpp.cxx: (None, 'g++')"), "")
    with pytest.raises(SystemExit) as e, cli.one_line_errors("train.py"):
        raise missing
    assert e.value.code == 1 and capsys.readouterr().err == (
        "train.py: error: no C compiler (InvalidCxxCompiler), which torch.compile and the Triton kernels need: install "
        "gcc, or give --compile=off (and on CUDA set LIME_TRITON=0) to run without it\n")
    # Triton's own, at the first launch of kernels.py's kernels on CUDA: --compile=off alone does not avoid it
    with pytest.raises(SystemExit), cli.one_line_errors("train.py"):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable or set "
                           "triton.knobs.build.impl.")
    assert "LIME_TRITON=0" in capsys.readouterr().err
    with pytest.raises(InductorError), cli.one_line_errors("train.py"):
        raise InductorError(NotImplementedError("an op it cannot lower"), "")


def test_every_config_train_saves_is_read_back():
    """The checks a saved config is read back with (runs.check_config: sample.py and analyze.py read EvalConfig's
    fields, --resume TrainConfig's) pass every config train.py saves, of every preset."""
    for preset in train.PRESETS:  # (the arith preset's epochs=200: an int is a number too)
        saved = dataclasses.asdict(train.TrainConfig(**{**train.PRESETS[preset], "preset": preset}))
        saved["data_dir"] = runs.data_folder(train.PRESETS, preset, saved["data"])  # absolute, as train.py saves it
        for cls in (train.TrainConfig, runs.EvalConfig):
            assert runs.check_config(saved, "ckpt.pt", cls) == {f.name: saved[f.name] for f in dataclasses.fields(cls)}


def train_args(*flags):
    return lambda a, r, t: tiny_args(a, t / "run", *flags)


# Every bad input of issue 12, through the scripts' main(argv). In argv(a, r, t), a is the arithmetic
# data, r a finished run and t a scratch folder holding a file notes.md. Exit code 2: bad usage.
BAD_INPUTS = [
    ("train", train_args("--seed=-1"), 2, "--seed must be in 0 .. 2**63 - 1, got -1"),
    ("train", train_args("--seed=99999999999999999999"), 2, "--seed must be in 0 .. 2**63 - 1, got 9999"),
    ("train", train_args(f"--seed={2**63}"), 2, f"--seed must be in 0 .. 2**63 - 1, got {2**63}"),
    ("train", train_args("--grad-clip=inf"), 2, "--grad-clip must be finite, got inf"),
    ("train", train_args("--lr=inf"), 2, "--lr must be finite, got inf"),
    ("train", train_args("--min-lr=-inf"), 2, "--min-lr must be finite, got -inf"),
    ("train", train_args("--n-embd=0"), 2, "--n-embd must be in 1 .. 2**31 - 1, got 0"),
    ("train", train_args("--n-head=0"), 2, "--n-head must be in 1 .. 2**31 - 1, got 0"),
    ("train", train_args("--n-kv-head=0"), 2, "--n-kv-head must be in 1 .. 2**31 - 1, got 0"),
    ("train", train_args("--n-layer=0"), 2, "--n-layer must be in 1 .. 2**31 - 1, got 0"),
    ("train", train_args("--batch-size=4294967296", "--micro-batch-size=4294967296"), 2,
     "--micro-batch-size must be in 1 .. 2**31 - 1, got 4294967296"),
    ("train", train_args("--block-size=99999999999999999999"), 2,  # (a typo, not an OverflowError from inside torch)
     "--block-size must be in 1 .. 2**20, got 99999999999999999999"),
    ("train", train_args("--router=last-99999999999999999999"), 2,
     "router 'last-99999999999999999999': J must be in 1 .. 2**31 - 1, got 99999999999999999999"),
    ("train", train_args("--router=hc-2147483647"), 2,  # (before: a traceback, its storage's size overflowing)
     "--router=hc-2147483647: at most 64 streams (J), each a copy of the residual stream at every token"),
    ("train", train_args("--device=cuda"), 2, "--device=cuda: this torch is a CPU-only build"),
    ("train", train_args("--device=mps"), 2, "--device=mps: MPS is not available on this machine"),
    ("train", train_args("--device=foo"), 2, "--device='foo': choose from auto, cpu, cuda, cuda:N, mps"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={t / 'notes.md'}"), 2, "is a file, not a folder"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={t / 'notes.md' / 'run'}"), 2,
     "notes.md is a file, not a folder"),
    # a file for the data's folder: not "no data there, make it with prepare_data.py", which refuses a file too
    *(("train", lambda a, r, t, dry=dry: tiny_args(a, t / "run", f"--data-dir={t / 'notes.md'}", *dry), 2,
       "notes.md is not a folder: give --data-dir the folder that holds the data")
      for dry in ([], ["--dry-run"])),
    ("train", train_args("--stop-at=-1"), 2, "--stop-at must be >= 0, got -1"),
    ("train", train_args("--min-lr=5"), 2, "--min-lr=5 is above --lr=0.003, the schedule's peak"),  # (it trained)
    ("train", train_args("--lr=1e300", "--min-lr=0"), 2,  # (a traceback from inside AdamW at the first step)
     "--lr=1e+300 is too large: AdamW's first step, lr / (1 - beta1) = 1e+301, overflows float32"),
    ("train", train_args("--router-lr=1e38"), 2, "--router-lr=1e+38 is too large: AdamW's first step"),
    ("train", lambda a, r, t: [f for f in tiny_args(a, t / "run", "--epochs=1e306") if "--max-steps" not in f], 2,
     "--epochs=1e+306 is over 2**53 steps of this data"),  # (an OverflowError's traceback)
    ("train", train_args("--beta2=1"), 2, "--beta2 must be in [0, 1), got 1.0"),
    ("train", train_args("--eval-samples=0"), 2, "--eval-samples must be positive, got 0"),
    ("train", lambda a, r, t: ["--preset=150m", "--data=shakespeare", "--epochs=2", f"--out-dir={t / 'run'}"], 2,
     "--epochs is for arithmetic and prosqa data, not --data=shakespeare"),  # refused, not ignored
    ("train", lambda a, r, t: ["--preset=150m", "--data=shakespeare", "--eval-tokens=100", f"--out-dir={t / 'run'}"],
     2, "--eval-tokens=100 is less than one window of --block-size=2048: nothing to evaluate on"),  # (not the shard)
    ("train", train_args("--eval-tokens=100"), 2, "--eval-tokens is for fineweb-edu and shakespeare data, not "
                                                  "--data=arithmetic"),
    ("train", train_args("--resume", "--overwrite"), 2, "give one of them"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={r}", "--max-steps=6", "--resume"), 2,
     "already at max_steps=6"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={r}", "--max-steps=4", "--resume"), 2,
     "--resume: the checkpoint is already at max_steps=4; raise --max-steps"),  # (at step 6: past it, not trained back)
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--out-dir={r}", "--max-steps=8", "--resume", "--stop-at=6"), 2,
     "--stop-at=6: the checkpoint is already at step 6"),  # (a session that would take no step, and rewrite the run)
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--top-k", "0", "--temperature", "1"], 2,
     "--top-k must be positive"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--top-k", "-3", "--temperature", "1"], 2, "got -3"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--top-k", "5"], 2, "--top-k cuts what sampling draws from, and "
     "this decodes greedily (temperature 0, the default for arithmetic and prosqa: give --temperature too)"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--start", "1 + ² + 3"], 2,  # a digit that int() does not read
     "--start: expected a number, got '²' in '1 + ² + 3'"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--seed", "-1"], 2, "--seed must be in 0 .. 2**63 - 1, got -1"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--temperature", "nan"], 2,
     "--temperature must be >= 0 and finite, got nan"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--temperature", "inf"], 2,  # (uniform, --top-k unheard)
     "--temperature must be >= 0 and finite, got inf"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--num-samples", "0"], 2,
     "--num-samples and --max-new-tokens must be positive"),  # (not a silent nothing)
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--device", "foo"], 2, "--device='foo'"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--eval", "--top-k", "5", "--seed", "2"], 2,
     "--eval scores the run on its fixed evaluation sets, without sampling: not with --top-k, --seed"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--eval", "--seed", "1337"], 2,  # at its default: refused too
     "without sampling: not with --seed"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--data-dir", str(t / "missing")], 1, "no arithmetic data in"),
    # a file for the data's folder, scored or sampled from: not "no data there, rebuild it", which prepare_data refuses
    *(("sample", lambda a, r, t, flags=flags: ["--out-dir", str(r), *flags, "--data-dir", str(t / "notes.md")], 2,
       "notes.md is not a folder: give --data-dir") for flags in (["--eval"], [])),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--eval", "--data-dir", str(t / "missing")], 1,
     "no arithmetic data in"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "notes.md")], 2, "is a file, not a folder"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--show", "-1"], 2,
     "--show must be >= 0, got -1"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--train-size=0"], 2,
     "--train-size must be >= 1, got 0"),  # (not a train.txt of one empty line, which every reader refuses)
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--seed=-1"], 2,
     "--seed must be >= 0, got -1"),  # (not data that every reader then refuses: "its 'seed' is -1")
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--field=mod", "--modulus=12"], 2,
     "--modulus must be a prime"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--tiers=4,x"], 2,
     "--tiers must be numbers separated by commas"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--target=both"], 2,
     "invalid choice: 'both'"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--shards=3"], 2,
     "--shards is for fineweb-edu data, not arithmetic"),  # a flag for other data is refused, not ignored
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--shards=32"], 2,
     "--shards is for fineweb-edu data, not arithmetic"),  # ... at its default value too
    ("prepare_data", lambda a, r, t: ["fineweb-edu", "--data-dir", str(t / "new"), "--shards=0",
                                      "--base-url=http://127.0.0.1:9/"], 2, "--shards must be 1..99, got 0"),
    ("prepare_data", lambda a, r, t: ["fineweb-edu", "--data-dir", str(t / "new"), "--shards=100",
                                      "--base-url=http://127.0.0.1:9/"], 2, "--shards must be 1..99, got 100"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", str(t / "new"), "--modulus=7"], 2,
     "--modulus is for --field=mod, not --field=int"),
    ("prepare_data", lambda a, r, t: ["shakespeare", "--data-dir", str(t / "new"), "--modulus=7"], 2,
     "--modulus is for arithmetic data (--field=mod), not shakespeare"),
    ("prepare_data", lambda a, r, t: ["shakespeare", "--data-dir", str(t / "new"), f"--url={t / 'input.txt'}"], 2,
     "input.txt: give an http(s) URL: for a file here, put it in "),  # (requests: a traceback, an empty folder)
    ("prepare_data", lambda a, r, t: ["shakespeare", "--data-dir", str(t / "new"), "--url="], 2,
     "--url=: give an http(s) URL"),
    ("prepare_data",
     lambda a, r, t: ["fineweb-edu", "--data-dir", str(t / "new"), "--base-url=http://localhost:99999/"], 2,
     "--base-url=http://localhost:99999/: not a URL (Failed to parse: http://localhost:99999/)"),
    ("prepare_data", lambda a, r, t: ["shakespeare", "--data-dir", str(t / "new"), "--base-url=x"], 2,
     "--base-url is for fineweb-edu and prosqa data, not shakespeare"),
    ("grid", lambda a, r, t: ["--fields", "real", "--out-dir", str(t / "g"), "--data-root", str(t / "d")], 2,
     "grid.py: error: --fields must be int or mod, got 'real'"),
    ("grid", lambda a, r, t: ["--targets", "steps,all", "--out-dir", str(t / "g"), "--data-root", str(t / "d")], 2,
     "grid.py: error: --targets must be steps or answer, got 'all'"),
    ("grid", lambda a, r, t: ["--seeds", "1,two", "--out-dir", str(t / "g"), "--data-root", str(t / "d")], 2,
     "--seeds and --tiers take numbers"),
    ("grid", lambda a, r, t: ["--tiers", "4,3000", "--out-dir", str(t / "g"), "--data-root", str(t / "d")], 2,
     "--tiers must be at most 31 operators with --targets steps, got 3000: a sample of more can take over 2048 tokens"),
    ("grid", lambda a, r, t: ["--fields", "int", "--modulus", "7", "--out-dir", str(t / "g"), "--data-root",
                              str(t / "d")], 2, "--modulus is for the mod field, and --fields=int has none"),
    ("grid", lambda a, r, t: ["--fields", "int", "--modulus", "11", "--out-dir", str(t / "g"), "--data-root",
                              str(t / "d")], 2, "--modulus is for the mod field, and --fields=int has none"),

    ("analyze", lambda a, r, t: [], 2,  # (not argparse's bare "required: command": which ones)
     "the following arguments are required: {routes,entropy,probe,table,curves,prune}"),
    ("analyze", lambda a, r, t: ["entropy", "--out-dir", str(r), "--num-seqs", "0"], 2, "--num-seqs must be positive"),
    ("analyze", lambda a, r, t: ["probe", "--out-dir", str(r), "--seq-len", "1"], 2,
     "--seq-len must be at least 2, got 1"),  # (a token and its next: what the language windows need at least)
    ("analyze", lambda a, r, t: ["routes", "--out-dir", str(r), "--alpha", "3"], 2,
     "unrecognized arguments: --alpha 3"),  # each subcommand takes only the flags it reads
    ("analyze", lambda a, r, t: ["probe", "--out-dir", str(r), str(r)], 2, "unrecognized arguments: "),
    ("analyze", lambda a, r, t: ["entropy", "--out-dir", str(r), "--alpha", "-1"], 2,
     "--alpha must be > 0 and finite, got -1"),
    ("analyze", lambda a, r, t: ["prune", "--out-dir", str(r), "--top-p", "0"], 2, "--top-p must be in (0, 1], got 0"),
    ("analyze", lambda a, r, t: ["prune", "--out-dir", str(r), "--save", str(r)], 2, "--save names the run being"),
    ("analyze", lambda a, r, t: ["prune", "--out-dir", str(r), "--save", ""], 2, "argument --save: an empty path"),
    # an empty path (a $VARIABLE not set) is not the flag left out: not a run from scratch in place of --init-from's,
    # nor the preset's own out/tiny-lime replaced (--overwrite), nor data written to data/arithmetic or runs to here
    ("train", train_args("--init-from="), 2, "argument --init-from: an empty path (a $VARIABLE that is not set?)"),
    ("train", train_args("--out-dir=", "--overwrite"), 2, "argument --out-dir: an empty path"),
    ("train", train_args("--data-dir="), 2, "argument --data-dir: an empty path"),
    ("sample", lambda a, r, t: ["--out-dir", str(r), "--data-dir", ""], 2, "argument --data-dir: an empty path"),
    ("analyze", lambda a, r, t: ["entropy", "--out-dir", str(r), "--data-dir", ""], 2,
     "argument --data-dir: an empty path"),
    ("analyze", lambda a, r, t: ["curves", str(r), "--out", ""], 2, "argument --out: an empty path"),
    ("analyze", lambda a, r, t: ["table", str(r), ""], 2, "argument run_dirs: an empty path"),
    ("analyze", lambda a, r, t: ["routes", "--out-dir", ""], 2, "argument --out-dir: an empty path"),
    ("sample", lambda a, r, t: ["--out-dir", ""], 2, "argument --out-dir: an empty path"),
    ("prepare_data", lambda a, r, t: ["arithmetic", "--data-dir", ""], 2, "argument --data-dir: an empty path"),
    ("grid", lambda a, r, t: ["--out-dir", "", "--data-root", str(t / "d")], 2, "argument --out-dir: an empty path"),
    ("analyze", lambda a, r, t: ["curves", str(r), "--out", str(t / "notes.md")], 2,
     "notes.md: the picture is a PNG: give a path ending in .png"),
    ("train", train_args("--vocab-size=1000"), 2, "--vocab-size=1000 is smaller than the arithmetic vocabulary (1008): "
                                                 "give --vocab-size=1024"),  # (a size that fits, padded to 64)
    ("train", train_args("--prune-at=3"), 2, "--prune-at says when to prune: give --router-top-p too"),
    ("train", train_args("--router-top-p=0.9"), 2, "--router-top-p says how much to prune: give --prune-at too, the "
     "step at which to prune (0: the weights the run starts from)"),  # (not the drawn weights pruned, without a word)
    ("train", train_args("--router-top-p=1.5"), 2, "--router-top-p must be in (0, 1]"),
    ("train", train_args("--router=dynamic", "--router-top-p=0.9"), 2, "--router-top-p applies to routers whose "
     "weights() is a learned Parameter itself, the same at every token"),
    ("train", train_args("--router=hc", "--router-top-p=0.9"), 2, f"the same at every token ({PRUNABLE}), "
     "not --router=hc"),
    ("train", train_args("--router-top-p=0.9", "--prune-at=12"), 2, "--prune-at=12 is not before the last step"),
    ("train", train_args("--stop-at=13"), 2, "--stop-at=13 is past the last step (max_steps=12)"),
    ("train", train_args("--stop-at=13", "--dry-run"), 2, "--stop-at=13 is past the last step (max_steps=12)"),
    ("train", train_args("--router-top-p=0.9", "--prune-at=12", "--dry-run"), 2, "--prune-at=12 is not before the"),
    ("train", train_args("--init-from=/nonexistent/run"), 1, "--init-from: no checkpoint at /nonexistent/run/ckpt.pt"),
    ("train", train_args("--resume"), 1, "--resume: no checkpoint at"),
    ("train", lambda a, r, t: tiny_args(a, t / "run", f"--init-from={r}", "--n-layer=3"), 2,
     "ckpt.pt holds a model with n_layer=2 (not 3)"),
    ("train", lambda a, r, t: tiny_args(a, r, f"--init-from={r}", "--resume"), 2, "give one of them"),
    ("train", lambda a, r, t: tiny_args(a, r, f"--init-from={r}/", "--overwrite"), 2,  # not over the run it starts from
     "is the run --init-from starts from: give a new folder"),
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
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)  # (and a Mac without MPS)
    (tmp_path / "notes.md").write_text("not a folder")
    before = snapshot(arith_dir, arith_run, tmp_path)
    main = {"train": train.main, "sample": sample.main, "prepare_data": prepare_data.main, "analyze": analyze.main,
            "grid": grid.main}[script]
    err = error_of(main, argv(arith_dir, arith_run, tmp_path), capsys, code)
    assert err.startswith(f"{script}.py: error: ") and message in err
    assert snapshot(arith_dir, arith_run, tmp_path) == before


# Every file a script reads, damaged as a power cut, a full disk, a stray edit or another run leaves it. In
# damage(d, r, t) -> argv, d is a copy of the arithmetic data, r a copy of a finished run on it, t a scratch
# folder holding notes.md: each case damages its copies, runs the script, and nothing may change.


def write(path, content):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(content if isinstance(content, bytes) else content.encode())


def on_the_copy(d, r, t):
    """The run r, as if it had been trained on d, the copy of its data."""
    edit_checkpoint(r, lambda ckpt: ckpt["config"].update(data_dir=str(d)))


def resume(d, r, t):
    """The flags that continue the finished run r for two more steps."""
    return tiny_args(d, r, "--max-steps=8", "--resume")


def then(*steps):
    """Damage in several steps, the last one giving the argv."""
    def damage(d, r, t):
        for step in steps[:-1]:
            step(d, r, t)
        return steps[-1](d, r, t)
    return damage


def another_regime(d, r, t):
    shutil.rmtree(d)
    arithmetic.prepare(d, arithmetic.Task(field="mod", target="answer"), seed=0, train_size=5, test_size=2)


def hand_edit(**changes):
    """The run's saved config (in ckpt.pt) edited by hand."""
    return lambda d, r, t: edit_checkpoint(r, lambda ckpt: ckpt["config"].update(changes))


def config_edit(**changes):
    """The run's config.json edited by hand, the same way (--resume holds the checkpoint to it)."""
    return lambda d, r, t: write(r / "config.json", json.dumps({**json.loads((r / "config.json").read_text()),
                                                                 **changes}))


def json_edit(name, change):
    """The run's `name` (summary.json, config.json) edited by hand: change(its dict) written in its place."""
    return lambda d, r, t: write(r / name, json.dumps(change(json.loads((r / name).read_text()))))


def edit_weight(change):
    """One weight of the run's checkpoint changed: not its values, what kind of tensor holds them."""
    name = "transformer.h.0.mlp.c_fc.weight"
    return lambda d, r, t: edit_checkpoint(r, lambda ckpt: ckpt["model"].update({name: change(ckpt["model"][name])}))


def edit_mask(keep):
    """The run's checkpoint given a pruning mask of keep(router weight) for each router (its weights as they are)."""
    return lambda d, r, t: edit_checkpoint(r, lambda ckpt: ckpt.update(router_mask={
        k: keep(w) for k, w in ckpt["model"].items() if k.endswith("router.weight")}))


def edit_moments(change):
    """AdamW's state of the first weight in the run's checkpoint, changed in place."""
    return lambda d, r, t: edit_checkpoint(r, lambda ckpt: change(next(iter(ckpt["optimizer"]["state"].values()))))


def flip_a_bit(r):
    """One bit of one weight in the run's ckpt.pt flipped, as a disk or a copy may: torch.load reads another weight."""
    weight = torch.load(r / "ckpt.pt", weights_only=True)["model"]["transformer.h.0.mlp.c_fc.weight"]
    data = (r / "ckpt.pt").read_bytes()
    at = data.index(weight.numpy().tobytes()[:64])
    write(r / "ckpt.pt", data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])


def flip_name_byte(data):
    """A zip archive (ckpt.pt) with a byte of its first entry's name changed (past ASCII): torch.load reads it all the
    same (it goes by the central directory), and the check of the archive fails on the name."""
    at = 30 + 1  # a local file header is 30 bytes, then the name
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def meta_edit(**changes):
    """The data's meta.json edited by hand: it names another regime than its lines are."""
    return lambda d, r, t: write(d / "meta.json", json.dumps({**json.loads((d / "meta.json").read_text()), **changes}))


def edit_lines(path, edit):
    """The lines of a file edited: edit(list of lines, each with its end) -> lines."""
    write(path, "".join(edit(Path(path).read_text().splitlines(True))))


def swap_first_lines(a, b):
    """The first lines of two files swapped (of one tier: each still a sample of it)."""
    first_a, first_b = (Path(p).read_text().splitlines(True)[0] for p in (a, b))
    edit_lines(a, lambda lines: [first_b, *lines[1:]])
    edit_lines(b, lambda lines: [first_a, *lines[1:]])


NO_TOKENS = struct.pack("<3i", MAGIC, 1, 0).ljust(1024, b"\0")  # a token shard's header announcing 0 tokens


def deep(text):
    """JSON nested deeper than Python's json parses (a RecursionError)."""
    return "[" * 100_000 + text + "]" * 100_000


DAMAGED = [
    ("train", then(on_the_copy, lambda d, r, t: write(r / "ckpt.pt", b""), resume), 1,
     "ckpt.pt is empty (cut short while it was written?)"),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.pop("optimizer")), resume), 1,
     "is not a checkpoint of train.py: it has no 'optimizer'"),
    ("train", then(lambda d, r, t: write(r / "ckpt.pt", b"PK\x03\x04 half a zip"),
                   lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}")), 1,
     ("--init-from: ", "ckpt.pt is not a checkpoint of train.py (not a whole zip archive, as torch.save writes: cut "
                       "short, or another file)")),
    ("train", then(lambda d, r, t: (t / "link").symlink_to(r),  # another name of the run it starts from: not over it
                   lambda d, r, t: tiny_args(d, t / "link", f"--init-from={r}", "--overwrite")), 2,
     "is the run --init-from starts from: give a new folder"),
    ("train", then(on_the_copy, lambda d, r, t: write(r / "log.jsonl", '{"step": 1}\n{"st\n{"step": 2}\n'), resume), 1,
     "log.jsonl, line 2: not a row of the log ('{\"st'); move the log away to resume without it"),
    ("train", then(on_the_copy, lambda d, r, t: shutil.rmtree(d), resume), 1,  # the run's own regime, not the preset's
     ("no arithmetic data in ", ": give --data-dir the folder this run was trained on, or rebuild it with `python "
      "prepare_data.py arithmetic --data-dir ", " --target steps --train-size 100 --test-size 10`")),
    ("train", then(on_the_copy, another_regime, resume), 1,
     ("holds mod11-answer, tiers 4,5,6 operands (seed 0; 5 train, 2 test, 2 val a tier), but the run was trained on "
      "int-steps, tiers 4,5,6 operands (seed 0; 100 train, 10 test, 10 val a tier): give --data-dir the run's data, "
      "or make it in a folder of its own with `python prepare_data.py arithmetic --data-dir ",
      "int-steps-operands-4-5-6 --field int")),  # (a new folder: "--overwrite" there replaced the other regime's data)
    ("train", then(lambda d, r, t: ((r / "log.jsonl").unlink(), (r / "log.jsonl").mkdir()),
                   lambda d, r, t: tiny_args(d, r, "--overwrite")), 1,
     "log.jsonl is not a file but a run's files go by that name: move it away"),  # not half the run deleted
    ("analyze", then(lambda d, r, t: (t / "p" / "config.json").mkdir(parents=True),
                     lambda d, r, t: ["prune", "--out-dir", str(r), "--top-p", "0.5", "--save", str(t / "p"),
                                      "--overwrite"]), 1,
     "config.json is not a file but a run's files go by that name"),
    ("sample", then(lambda d, r, t: write(d / "val_4.txt", " + ".join(["1"] * 60) + " = 60\n" +
                                          "".join((d / "val_4.txt").read_text().splitlines(True)[1:])),
                    lambda d, r, t: ["--out-dir", str(r), "--eval", f"--data-dir={d}"]), 1,
     "val_4.txt, line 1: not a sample of the task (its expression has 59 operators, not 3 as in meta.json's tier 4 "
     "operands): rebuild it with `python prepare_data.py arithmetic --data-dir "),  # (not a sample of 122 tokens)
    # another run's checkpoint in the folder (copied in by hand): once scored and drawn, exit 0, as the run it is not
    ("sample", then(hand_edit(seed=7), lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     ("ckpt.pt is not of the run that ", "config.json describes: it has seed 7 (config.json: 1337); move the one that "
      "is not this run's away")),
    ("analyze", then(hand_edit(seed=7), lambda d, r, t: ["routes", "--out-dir", str(r)]), 1,
     "config.json describes: it has seed 7 (config.json: 1337)"),
    ("analyze", then(hand_edit(seed=7), lambda d, r, t: ["prune", "--out-dir", str(r), "--device=cpu"]), 1,
     "describes: it has seed 7 (config.json: 1337); move"),  # (not a pruned model saved of the other run)
    # a log that lost its last rows (the run's steps 7-12, and its evaluation at 12): not a curve cut short
    ("analyze", then(lambda d, r, t: write(r / "summary.json",
                                           json.dumps({**json.loads((r / "summary.json").read_text()), "steps": 12})),
                     lambda d, r, t: ["curves", str(r), "--out", str(t / "c.png")]), 1,
     "log.jsonl: its last evaluation is of step 6, before the end of the finished run (step 12, its summary.json): its "
     "log is cut short"),
    *(("analyze", then(config_edit(seed=7), argv), 1,
       "config.json is not of the run that its summary.json describes: its 'seed' is 7, the summary's 1337")
      for argv in (lambda d, r, t: ["curves", str(r), "--out", str(t / "c.png")], lambda d, r, t: ["table", str(r)])),
    # a summary.json copied in from another run (whole: its config its own): tabled, scored or started from as this one
    ("analyze", then(json_edit("summary.json", lambda s: {**s, "preset": "arith", "config": {**s["config"],
                                                                                "preset": "arith"}}),
                     lambda d, r, t: ["table", str(r)]), 1,
     "config.json is not of the run that its summary.json describes: its 'preset' is 'tiny', the summary's 'arith'"),
    *((script, then(json_edit("summary.json", lambda s: {**s, "seed": 7, "config": {**s["config"], "seed": 7}}), argv),
       1, ("config.json is not of the run that its summary.json describes: its 'seed' is 1337, the summary's 7",))
      for script, argv in (("analyze", lambda d, r, t: ["table", str(r)]),
                           ("sample", lambda d, r, t: ["--out-dir", str(r), "--eval"]),
                           ("analyze", lambda d, r, t: ["routes", "--out-dir", str(r)]),
                           ("train", lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}")),
                           ("train", then(on_the_copy, resume)))),
    ("train", then(hand_edit(seed=7), lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}")), 1,
     ("--init-from: ", "config.json describes: it has seed 7 (config.json: 1337)")),  # (not started from as that run)
    # an older checkpoint of the run (restored from a backup): scored, drawn or started from as the finished run
    *((script, then(lambda d, r, t: edit_checkpoint(r, lambda c: c.update(step=3)), argv), 1,
       "ckpt.pt is of step 3, before the end of the finished run there (step 6, its summary.json), and would be "
       "taken for that run; copy it into a folder of its own to use it as it is")
      for script, argv in (("sample", lambda d, r, t: ["--out-dir", str(r), "--eval"]),
                           ("analyze", lambda d, r, t: ["routes", "--out-dir", str(r)]),
                           ("train", lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}")))),
    ("sample", then(lambda d, r, t: edit_settings(r, block_size=16),
                    lambda d, r, t: ["--out-dir", str(r), "--eval", f"--data-dir={d}"]), 1,
     "holds a sample of 50 tokens, longer than the model's block_size=16"),  # (a flag cannot make it fit)
    ("train", then(lambda d, r, t: write(d / "meta.json", '{"vocab": ["<eos>"'),
                   lambda d, r, t: tiny_args(d, t / "run")), 1,  # (not `prepare it`: refused, as it is; nor the
     ("meta.json is not valid JSON", "` with the flags that made it, and --overwrite")),  # default regime's command)
    # a field lost: read as its default, another regime, which the advice then rebuilt in place of this one
    ("train", then(lambda d, r, t: write(d / "meta.json", json.dumps({k: v for k, v in json.loads(
        (d / "meta.json").read_text()).items() if k != "tiers"})), lambda d, r, t: tiny_args(d, t / "run")), 1,
     "meta.json is damaged (it has no 'tiers')"),
    ("train", then(lambda d, r, t: write(d / "meta.json", json.dumps({**json.loads((d / "meta.json").read_text()),
                                                                      "seed": "0"})),
                   lambda d, r, t: tiny_args(d, t / "run")), 1, "meta.json is damaged (its 'seed' is '0', not a whole"),
    ("train", then(lambda d, r, t: write(d / "meta.json", "{}"), lambda d, r, t: tiny_args(d, t / "run")), 1,
     "meta.json is not what this repo writes: it has no 'vocab'"),
    ("train", then(lambda d, r, t: write(d / "train.txt", ""), lambda d, r, t: tiny_args(d, t / "run")), 1,
     "train.txt is empty: rebuild it with"),
    ("train", then(lambda d, r, t: (d / "test_5.txt").unlink(), lambda d, r, t: tiny_args(d, t / "run")), 1,
     "test_5.txt is missing"),
    ("train", then(lambda d, r, t: write(d / "val_4.txt", "1 + x = 3\n"), lambda d, r, t: tiny_args(d, t / "run")), 1,
     ("val_4.txt, line 1: not a sample of the task (expected a number, got 'x' in '1 + x')", "--overwrite`")),
    # sample.py's prompts are test lines: one that is not a sample is the file's fault, not a traceback or --start's
    ("sample", then(on_the_copy, lambda d, r, t: [write(p, "1 + x = 3\n") for p in d.glob("test_*.txt")],
                    lambda d, r, t: ["--out-dir", str(r), "--num-samples", "1"]), 1,
     ("txt, line 1: not a sample of the task (expected a number, got 'x'", "--overwrite`")),
    ("sample", then(on_the_copy, lambda d, r, t: [write(p, "( 7 + *\n") for p in d.glob("test_*.txt")],
                    lambda d, r, t: ["--out-dir", str(r), "--num-samples", "1"]), 1,
     "txt, line 1: not a sample of the task (expected a number, got '*' in '( 7 + *')"),
    ("sample", then(on_the_copy, lambda d, r, t: edit_lines(d / "test_4.txt", lambda lines: ["9" * 5000 + " + 1 = 1\n",
                                                                                         *lines[1:]]),
                    lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,  # (more digits than int() reads)
     "test_4.txt, line 1: not a sample of the task (a number of 5000 digits, past every task's range, in '99999"),
    ("train", lambda d, r, t: ["--preset=tiny", f"--data-dir={t / 'arithmetc-quick'}", f"--out-dir={t / 'run'}"], 1,
     "no arithmetic data in"),  # a mistyped folder is not generated
    ("train", then(lambda d, r, t: (write(t / "lang" / "x_train_000000.bin", bytes(1100)),
                                    write(t / "lang" / "x_val_000000.bin", b"")),
                   lambda d, r, t: ["--preset=tiny", "--data=shakespeare", f"--data-dir={t / 'lang'}",
                                    f"--out-dir={t / 'run'}"]), 1, "x_val_000000.bin: not a token shard"),
    ("train", then(lambda d, r, t: (write_shard(t / "lang" / "x_train_000000.bin", [5, 2] * 600),
                                    write(t / "lang" / "x_val_000000.bin", struct.pack("<3i", MAGIC, 1, 600)[:10])),
                   lambda d, r, t: ["--preset=tiny", "--data=shakespeare", f"--data-dir={t / 'lang'}",
                                    f"--out-dir={t / 'run'}"]), 1,  # (cut inside its header: a traceback)
     "x_val_000000.bin: 10 bytes, but its header announces 600 tokens (2224 bytes)"),
    # GPT-2's token ids past the small presets' vocabulary: one line with the flag that fits, not an IndexError
    ("train", then(lambda d, r, t: (t / "lang").mkdir(),
                   lambda d, r, t: [write_shard(t / "lang" / f"x_{split}_000000.bin", [5, 2000] * 600)
                                    for split in ("train", "val")],
                   lambda d, r, t: ["--preset=tiny", "--data=shakespeare", f"--data-dir={t / 'lang'}",
                                    f"--out-dir={t / 'run'}"]), 2,
     "--vocab-size=1024 is smaller than the shakespeare vocabulary (at least 2001): give --vocab-size=50304"),
    ("sample", then(lambda d, r, t: write(r / "ckpt.pt", b""), lambda d, r, t: ["--out-dir", str(r)]), 1,
     "ckpt.pt is empty"),
    ("sample", then(lambda d, r, t: (r / "ckpt.pt").unlink() or (r / "ckpt.pt").mkdir(),
                    lambda d, r, t: ["--out-dir", str(r)]), 1, "ckpt.pt is not a file"),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda c: c["config"].update(n_layer=3)),
                    lambda d, r, t: ["--out-dir", str(r)]), 1,
     "ckpt.pt holds a model its config does not describe (n_layer 3, and weights of 2 blocks)"),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda c: c["model"].update(  # (a fork renamed its parameter)
        {"transformer.h.1.attn.router.w": c["model"].pop("transformer.h.1.attn.router.weight")})),
                    lambda d, r, t: ["--out-dir", str(r)]), 1,
     ("ckpt.pt holds weights its config does not describe (Missing key(s) in state_dict: \"transformer.h.1.attn.router"
      ".weight\"", "; has its method's code changed since?)")),
    ("sample", then(hand_edit(n_layer=100_000), lambda d, r, t: ["--out-dir", str(r)]), 1,  # (not minutes building)
     "ckpt.pt holds a model its config does not describe (n_layer 100000, and weights of 2 blocks)"),
    ("train", then(hand_edit(n_layer=100_000), config_edit(n_layer=100_000),  # (the folder's run, so edited)
                   lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}", "--dry-run")), 1,
     ("--init-from: ", "ckpt.pt holds a model its config does not describe (n_layer 100000, and weights of 2 ")),
    ("analyze", then(hand_edit(mlp_hidden=2**30), lambda d, r, t: ["routes", "--out-dir", str(r)]), 1,  # (not 16 GB)
     ("ckpt.pt holds weights its config does not describe (size mismatch for ", "mlp.c_fc.weight")),
    ("sample", then(lambda d, r, t: write(r / "ckpt.pt", flip_name_byte((r / "ckpt.pt").read_bytes())),
                    lambda d, r, t: ["--out-dir", str(r)]), 1,
     "ckpt.pt is damaged: its archive fails a check (UnicodeDecodeError; a byte changed on disk or in a copy)"),
    ("sample", then(lambda d, r, t: edit_lines(d / "val_5.txt", lambda lines: lines[:-1]),
                    lambda d, r, t: ["--out-dir", str(r), "--eval", f"--data-dir={d}"]), 1,  # (a mean over 9, not 10)
     ("val_5.txt holds 9 lines, not the 10 that its meta.json names: rebuild it with", "--overwrite`")),
    ("sample", then(lambda d, r, t: edit_lines(d / "test_4.txt", lambda lines: lines[:1] * 2 + lines[2:]),
                    lambda d, r, t: ["--out-dir", str(r), "--eval", f"--data-dir={d}"]), 1,  # (one sample scored twice)
     "test_4.txt, line 2: its expression is the expression of line 1 of test_4.txt too, so that it counts twice "
     "(made by an older version of this code, or edited): rebuild it with"),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.update(step=3)),  # (from a backup)
                   lambda d, r, t: tiny_args(d, r, "--max-steps=8", "--resume")), 1,
     "ckpt.pt is of step 3, before the end of the finished run there (step 6, its summary.json): resuming would "
     "replace that run; move summary.json away first to train on from that step"),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda c: c.update(step="7")),
                    lambda d, r, t: ["--out-dir", str(r)]), 1,
     "ckpt.pt is not a checkpoint of train.py: its 'step' is of type str, not int"),
    ("sample", then(lambda d, r, t: write(d / "meta.json", "{"),
                    lambda d, r, t: ["--out-dir", str(r), "--data-dir", str(d), "--eval"]), 1,
     "meta.json is not valid JSON"),
    ("analyze", then(lambda d, r, t: write(r / "ckpt.pt", b"garbage"), lambda d, r, t: ["routes", "--out-dir", str(r)]),
     1, "is not a checkpoint of train.py"),
    # a saved config that train.py would not have written: the file and the field, never a flag
    ("sample", then(hand_edit(data="nope"), lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     "ckpt.pt: in its saved config, data='nope': choose from fineweb-edu, shakespeare, arithmetic, prosqa"),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda ckpt: ckpt["config"].pop("data")),
                    lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1, "ckpt.pt: its saved config names no data"),
    ("sample", then(hand_edit(data_dir=5), lambda d, r, t: ["--out-dir", str(r)]), 1,
     "ckpt.pt: in its saved config, data_dir must be a string, got 5"),
    ("sample", then(hand_edit(task="x"), lambda d, r, t: ["--out-dir", str(r)]), 1,
     "ckpt.pt: in its saved config, task must be a dict, got 'x'"),
    ("analyze", then(hand_edit(block_size="x"), lambda d, r, t: ["routes", "--out-dir", str(r)]), 1,
     "ckpt.pt: in its saved config, block_size must be an integer, got 'x'"),
    ("sample", then(hand_edit(block_size=2**31 - 1), lambda d, r, t: ["--out-dir", str(r)]), 1,  # (held by no weight)
     "ckpt.pt: in its saved config, block_size must be in 1 .. 2**20, got 2147483647"),
    ("analyze", then(hand_edit(task={"field": "real"}), lambda d, r, t: ["entropy", "--out-dir", str(r)]), 1,
     "ckpt.pt: in its saved config, task: field must be int or mod, got 'real'"),
    ("sample", then(hand_edit(task={}), lambda d, r, t: ["--out-dir", str(r)]), 1,  # not the default regime
     "ckpt.pt: in its saved config, task: it names no tiers"),
    ("analyze", then(hand_edit(micro_batch_size=0), lambda d, r, t: ["prune", "--out-dir", str(r), "--device=cpu"]),
     1, "ckpt.pt: in its saved config, micro_batch_size must be in 1 .. 2**31 - 1, got 0"),
    ("analyze", then(hand_edit(prunings="abc"), lambda d, r, t: ["prune", "--out-dir", str(r), "--device=cpu",
                                                                 "--save", str(t / "pruned")]), 1,  # (not copied on)
     "ckpt.pt: in its saved config, prunings: not [{'top_p': a fraction in (0, 1], 'step': a step}, ...]"),
    ("analyze", then(lambda d, r, t: edit_checkpoint(r, lambda ckpt: ckpt["optimizer"]["state"][0]["exp_avg"].fill_(
        math.inf)), lambda d, r, t: ["prune", "--out-dir", str(r), "--device=cpu", "--save", str(t / "pruned")]), 1,
     "ckpt.pt is damaged: its optimiser state holds a value that is not finite, which --save would copy into"),
    *(("train", then(on_the_copy, hand_edit(prunings=[pruning]), resume), 1,  # (top-p 0 would prune every weight)
       "ckpt.pt: in its saved config, prunings: not [{'top_p': a fraction in (0, 1], 'step': a step}, ...]")
      for pruning in (dict(top_p=0.9), dict(top_p=0.0, step=2))),
    ("train", then(on_the_copy, hand_edit(seed=7), resume), 1,  # another run's checkpoint, not mixed into this one
     ("--resume: ", "ckpt.pt is not of the run that ", "config.json describes: it has seed 7 (config.json: ")),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda c: c["model"]["transformer.h.0.mlp.c_fc.weight"].fill_(
        math.nan)), lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     "ckpt.pt is damaged: its transformer.h.0.mlp.c_fc.weight is not finite"),
    ("train", then(on_the_copy, hand_edit(lr=0), resume), 1,
     ("--resume: ", "ckpt.pt: in its saved config, lr must be positive, got 0")),  # (not --lr: no flag gave it)
    ("train", then(on_the_copy, hand_edit(preset=["tiny"]), resume), 1,
     "ckpt.pt: in its saved config, preset must be a string, got ['tiny']"),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.update(router_mask={"nope": torch.ones(
        2, dtype=torch.bool)})), resume), 1,
     "ckpt.pt: its pruning mask ('router_mask') does not fit the model's router"),
    *(("train", then(on_the_copy, lambda d, r, t, at=at: edit_checkpoint(r, lambda c: c.update(pruned_at=at(c))),
                     resume), 1,
       "ckpt.pt is not a checkpoint of train.py: its 'pruned_at' is not a step up to its 'step'")
      for at in (lambda c: torch.ones(2), lambda c: c["step"] + 1)),  # (a pruning after the checkpoint's step)
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.update(router_mask={
        k: torch.ones(v.shape, dtype=torch.uint8) for k, v in c["model"].items() if k.endswith("router.weight")})),
                   resume), 1, "ckpt.pt: its pruning mask ('router_mask') does not fit"),  # (~1 is 254, not False)
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.update(router_mask={
        k: torch.ones(v.shape[0], dtype=torch.bool) for k, v in c["model"].items() if k.endswith("router.weight")})),
                   resume), 1, "ckpt.pt: its pruning mask ('router_mask') does not fit"),  # (of another shape)
    ("sample", then(hand_edit(shards={"val": 5}), lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     "ckpt.pt: in its saved config, shards: not {'train' or 'val': {shard name: tokens}}"),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.update(pruned_at=c["step"])), resume),
     1, "ckpt.pt: its 'pruned_at' says the routers were pruned at step 6, but it holds no pruning mask"),  # (else: on
    ("train", then(on_the_copy, edit_mask(lambda w: w == 2), resume), 1,  # unpruned; and below, a mask pruning does not
     "ckpt.pt: its pruning mask ('router_mask') keeps no weight of a target head of transformer.h."),  # make)
    ("sample", then(edit_mask(lambda w: w != w.flatten()[w.flatten().nonzero()[0]]),
                    lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     ("ckpt.pt: its transformer.h.", "router.weight is not zero where its pruning mask ('router_mask') prunes it")),
    # --dry-run loads the weights it names on the meta device: what the run itself would refuse, it refuses
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.update(router_mask={"nope": torch.ones(
        2, dtype=torch.bool)})), lambda d, r, t: [*resume(d, r, t), "--dry-run"]), 1,
     "ckpt.pt: its pruning mask ('router_mask') does not fit the model's router"),
    ("train", then(on_the_copy, hand_edit(vocab_size=2048), config_edit(vocab_size=2048),
                   lambda d, r, t: [*resume(d, r, t), "--dry-run"]), 1,
     ("--resume: ", "ckpt.pt holds weights its config does not describe (size mismatch")),
    ("train", then(hand_edit(vocab_size=2048), config_edit(vocab_size=2048),
                   lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}", "--dry-run")), 1,
     ("--init-from: ", "ckpt.pt holds weights its config does not describe (size mismatch")),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c["optimizer"].update(
        param_groups=c["optimizer"]["param_groups"][:1])), resume), 1,
     ("--resume: ", "ckpt.pt holds an optimiser state its config does not describe (loaded state dict has a different "
                    "number of parameter groups")),
    ("analyze", then(lambda d, r, t: edit_checkpoint(r, lambda c: c.update(router_mask="x")),
                     lambda d, r, t: ["prune", "--out-dir", str(r), "--device=cpu"]), 1,
     "its pruning mask ('router_mask')"),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda c: c["model"].update({5: torch.ones(1)})),
                    lambda d, r, t: ["--out-dir", str(r)]), 1,
     "is not a checkpoint of train.py: its 'model' is not a dict of named tensors"),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda c: c.update(step=-3)), lambda d, r, t: ["--out-dir",
                                                                                                     str(r)]), 1,
     "is not a checkpoint of train.py: its 'step' is -3"),
    ("train", then(hand_edit(vocab_size=2048), config_edit(vocab_size=2048),
                   lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}")), 1,
     ("--init-from: ", "ckpt.pt holds weights its config does not describe (size mismatch")),  # the file's fault
    ("train", then(hand_edit(n_embd=30), lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}")), 1,
     ("--init-from: ", "ckpt.pt: in its saved config, n_embd=30 must split into n_head=2 heads of even size")),
    ("analyze", then(lambda d, r, t: write(d / "meta.json", "{"),
                     lambda d, r, t: ["entropy", "--out-dir", str(r), "--data-dir", str(d)]), 1,
     "meta.json is not valid JSON"),
    ("analyze", then(lambda d, r, t: write(r / "log.jsonl", '{"step": 1}\n{"st\n{"step": 2}\n'),
                     lambda d, r, t: ["curves", str(r)]), 1, "log.jsonl, line 2: not a row of the log ('{\"st')"),
    ("analyze", then(lambda d, r, t: write(r / "log.jsonl", '{"step": 1}\n{"step": -5}\n{"step": 2}\n'),
                     lambda d, r, t: ["curves", str(r)]), 1,
     "log.jsonl, line 2: not a row of the log ('{\"step\": -5}')"),
    ("analyze", then(lambda d, r, t: write(r / "log.jsonl", '{"step": 2, "val_loss": "abc"}\n'),
                     lambda d, r, t: ["curves", str(r)]), 1,
     "log.jsonl, step 2: val_loss is not a number from 0 up ('abc')"),
    ("analyze", then(lambda d, r, t: write(r / "log.jsonl", '{"step": 2, "val_loss": NaN}\n{"step": 4, "val_loss": 1}'),
                     lambda d, r, t: ["curves", str(r)]), 1,
     "log.jsonl, step 2: val_loss is not a number from 0 up (nan)"),  # (NaN: a diverged run's last evaluation only)
    ("analyze", then(lambda d, r, t: write(r / "log.jsonl", '{"step": 2, "val_loss": 1, "val_bleu": "abc"}\n'),
                     lambda d, r, t: ["curves", str(r)]), 1,
     "log.jsonl, step 2: val_bleu is not a number ('abc')"),  # a fork's metric
    ("analyze", then(lambda d, r, t: write(r / "summary.json", '{"router": "li'), lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not valid JSON"),
    ("analyze", then(lambda d, r, t: write(r / "summary.json", '{"router": ["lime"]}'),
                     lambda d, r, t: ["table", str(r)]), 1, "summary.json is not what this repo writes: its 'router'"),
    ("analyze", then(lambda d, r, t: write(r / "summary.json", '{"router": "lime", "acc_4": NaN}'),
                     lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not what this repo writes: its 'acc_4' is nan"),
    ("analyze", then(lambda d, r, t: write(r / "config.json", '{"out_dir": "run", "router": "lime", "task": '
                                                              '{"field": "real"}}'),
                     lambda d, r, t: ["curves", str(r)]), 1,
     "config.json is not what this repo writes: its 'task' (--field must be int or mod, got 'real')"),
    # (each once a table or a curve, exit 0: a config.json without out_dir read as a summary that names no setting,
    # so averaged with runs of another depth as their seed; an arithmetic run as a language run; a row named by the
    # summary's router, of a run of the config's)
    ("analyze", then(lambda d, r, t: write(r / "log.jsonl", ""), lambda d, r, t: ["curves", str(r), str(r)]), 1,
     "log.jsonl holds no evaluation, but the run has finished (summary.json): its log is damaged"),  # (not "left out")
    ("analyze", then(json_edit("config.json", lambda c: {k: v for k, v in c.items() if k != "out_dir"}),
                     lambda d, r, t: ["curves", str(r)]), 1,
     "config.json is not what this repo writes: it has no 'out_dir'"),
    ("analyze", then(json_edit("summary.json", lambda s: {k: v for k, v in s.items() if not k.startswith("acc_")}),
                     lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not what this repo writes: no 'acc_4', where its task has tiers 4,5,6: a finished run has the "
     "test split's accuracy of each"),
    ("analyze", then(json_edit("summary.json", lambda s: {**s, "router": "none"}), lambda d, r, t: ["table", str(r)]),
     1, "summary.json is not what this repo writes: its 'router' is 'none', its config's 'lime'"),
    ("analyze", then(lambda d, r, t: write(r / "summary.json", "{}"), lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not what this repo writes: it has no 'router'"),
    ("analyze", then(lambda d, r, t: write(r / "summary.json", ""), lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is empty"),
    ("analyze", then(lambda d, r, t: ((r / "summary.json").unlink(), (r / "summary.json").mkdir()),
                     lambda d, r, t: ["table", str(r)]), 1, "summary.json is not a file"),
    ("grid", then(lambda d, r, t: (shutil.copytree(d, t / "root" / "int-steps-operands-4-5-6"),
                                   write(t / "root" / "int-steps-operands-4-5-6" / "meta.json", "{")),
                  lambda d, r, t: ["--fields", "int", "--targets", "steps", "--count", "operands", "--tiers",
                                   "4,5,6", "--data-root", str(t / "root"), "--out-dir", str(t / "g")]), 1,
     "meta.json is not valid JSON"),
    ("grid", then(lambda d, r, t: write(t / "g" / "int-steps-operands-4-5-6" / "lime-seed1" / "summary.json", "{"),
                  lambda d, r, t: ["--fields", "int", "--targets", "steps", "--count", "operands", "--tiers",
                                   "4,5,6", "--data-root", str(t / "root"), "--out-dir", str(t / "g")]), 1,
     "summary.json is not valid JSON"),
    ("prepare_data", lambda d, r, t: ["arithmetic", "--data-dir", str(d), "--tiers=4,5"], 2,
     "already holds int-steps, tiers 4,5,6 operands (seed 0; 100 train, 10 test, 10 val a tier), with count operands "
     "(not operators), tiers 4,5,6 (not 4,5), train_size 100 (not 50000), test_size 10 (not 1000): give another "
     "--data-dir, or --overwrite to replace it"),
    ("prepare_data", then(lambda d, r, t: write(d / "meta.json", "{"),
                          lambda d, r, t: ["arithmetic", "--data-dir", str(d)]), 2,
     "holds arithmetic data that cannot be read ("),
    *(("prepare_data", then(lambda d, r, t: ((d / "val_4.txt").unlink(), (d / "val_4.txt").mkdir()),
                            lambda d, r, t, more=more: ["arithmetic", "--data-dir", str(d), "--count=operands",
                                                        "--train-size=100", "--test-size=10", *more]), 1,
       "val_4.txt is not a file but the data's files go by that name: move it away")  # (not "--overwrite to replace
      for more in ([], ["--overwrite"])),  # it", which cannot)
    ("bench", lambda d, r, t: ["--device", "cpu", "--json", str(t / "notes.md" / "b.json")], 2,
     "notes.md is a file, not a folder"),
    ("bench", lambda d, r, t: ["--device", "cpu", "--json", str(t)], 2, "is not a file"),  # a folder
    ("bench", lambda d, r, t: ["--device", "cpu", "--block-size=99999999999999999999"], 2,
     "--block-size must be in 1 .. 2**20"),
    ("bench", lambda d, r, t: ["--device", "cpu", "--json", "/dev/null", "--overwrite"], 2,
     "--json=/dev/null: /dev/null is not a file"),  # (a rename over it would replace the device, as root)
    ("bench", lambda d, r, t: ["--device", "cpu", "--suite", "--json", str(t / "notes.md")], 1,
     "notes.md is not valid JSON"),
    ("bench", then(lambda d, r, t: write(t / "s.json", '{"suite": []}'),
                   lambda d, r, t: ["--device", "cpu", "--suite", "--json", str(t / "s.json")]), 1,
     "s.json is not what this repo writes: it has no 'device'"),
    ("bench", then(lambda d, r, t: write(t / "s.json", "[]"),
                   lambda d, r, t: ["--device", "cpu", "--suite", "--json", str(t / "s.json")]), 1,
     "s.json is not what this repo writes: not a JSON object"),
    ("bench", then(lambda d, r, t: write(t / "s.json", '{"device": 1, "torch": 1, "dtype": 1, "suite": [1]}'),
                   lambda d, r, t: ["--device", "cpu", "--suite", "--json", str(t / "s.json")]), 1,
     "s.json is not what this repo writes: its 'suite' is not a list of parts"),
    # what fuzzing the values and the structure of each file found (before: a traceback, a wrong exit code, or a run
    # that began, rewriting its folder, and then failed)
    ("analyze", then(lambda d, r, t: write(r / "summary.json", deep("")), lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not what this repo writes: nested too deeply to read"),
    ("analyze", then(lambda d, r, t: write(r / "log.jsonl", '{"step": 1}\n' + deep("") + '\n{"step": 2}\n'),
                     lambda d, r, t: ["curves", str(r)]), 1, "log.jsonl, line 2: not a row of the log ('[[[["),
    ("analyze", then(lambda d, r, t: write(r / "log.jsonl", '{"step": 1%s}\n{"step": 2}\n' % ("0" * 400)),
                     lambda d, r, t: ["curves", str(r)]), 1,
     "log.jsonl, line 1: not a row of the log ('{\"step\": 100"),  # (a step of 401 digits: as a float, OverflowError)
    ("analyze", then(lambda d, r, t: write(r / "summary.json", '{"router": null, "acc_4": 0.5}'),
                     lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not what this repo writes: its 'router' is None"),
    ("analyze", then(lambda d, r, t: write(r / "summary.json", '{"router": "lime", "seed": "1", "acc_4": 0.5}'),
                     lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not what this repo writes: its 'seed' is '1'"),
    ("analyze", then(lambda d, r, t: write(r / "summary.json", '{"router": "lime", "steps": -3, "acc_4": 0.5}'),
                     lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not what this repo writes: its 'steps' is -3"),  # (not a row of '-3 steps')
    ("analyze", then(config_edit(max_steps=10**400), lambda d, r, t: ["curves", str(r), "--out", str(t / "c.png")]), 1,
     "config.json is not what this repo writes: its 'max_steps' is 1000000000000000000000000000000000000..."),
    ("analyze", then(lambda d, r, t: write(r / "summary.json", '{"router": "lime", "acc_4": 0.5, "config": null}'),
                     lambda d, r, t: ["table", str(r)]), 1,
     "summary.json is not what this repo writes: its 'config' is None"),
    ("analyze", then(lambda d, r, t: os.symlink(t / "loop", t / "loop"), lambda d, r, t: ["table", str(t / "loop")]), 1,
     "a symbolic link on the way leads back to itself" if sys.version_info < (3, 13) else "loop/summary.json"),
    # a folder to write in that is a link to itself: mkdir finds the name taken (after grid.py generated its data)
    ("train", then(lambda d, r, t: os.symlink(t / "loop", t / "loop"), lambda d, r, t: tiny_args(d, t / "loop")), 2,
     ("--out-dir=", "loop is a symbolic link to nothing (or back to itself)")),
    ("grid", then(lambda d, r, t: os.symlink(t / "loop", t / "loop"),
                  lambda d, r, t: ["--out-dir", str(t / "loop" / "g"), "--data-root", str(t / "root")]), 2,
     "loop is a symbolic link to nothing (or back to itself)"),
    ("grid", then(lambda d, r, t: (t / "g" / "int-steps-operands-4-5-6" / "lime-seed1" / "train.out").mkdir(
                      parents=True),
                  lambda d, r, t: ["--fields", "int", "--targets", "steps", "--count", "operands", "--tiers",
                                   "4,5,6", "--data-root", str(t / "root"), "--out-dir", str(t / "g")]), 1,
     "lime-seed1/train.out is not a file but a run's output goes by that name: move it away"),  # (once runs started)
    ("grid", then(lambda d, r, t: (t / "g" / "int-steps-operands-4-5-6" / "lime-seed1").mkdir(parents=True) or
                  os.symlink(t / "gone", t / "g" / "int-steps-operands-4-5-6" / "lime-seed1" / "train.out"),
                  lambda d, r, t: ["--fields", "int", "--targets", "steps", "--count", "operands", "--tiers",
                                   "4,5,6", "--data-root", str(t / "root"), "--out-dir", str(t / "g")]), 1,
     "lime-seed1/train.out is a symbolic link to nothing (or back to itself): move it away"),  # (a traceback once)
    ("prepare_data", then(lambda d, r, t: os.symlink(t / "gone", t / "input.txt.part"),
                          lambda d, r, t: ["shakespeare", "--data-dir", str(t), "--url", "http://127.0.0.1:9/x"]), 1,
     "input.txt.part is a symbolic link to nothing (or back to itself): move it away"),  # (a traceback once)
    ("analyze", then(lambda d, r, t: (r / "ckpt.pt").unlink() or os.symlink(t / "gone", r / "ckpt.pt"),
                     lambda d, r, t: ["routes", "--out-dir", str(r)]), 1,
     "ckpt.pt is a symbolic link to nothing (or back to itself): move it away"),  # (not "no checkpoint")
    ("grid", then(lambda d, r, t: write(t / "g" / "int-steps-operands-4-5-6" / "lime-seed1", "not a run"),
                  lambda d, r, t: ["--fields", "int", "--targets", "steps", "--count", "operands", "--tiers",
                                   "4,5,6", "--data-root", str(t / "root"), "--out-dir", str(t / "g")]), 1,
     "lime-seed1 is a file, not a folder, where a run of the grid goes: move it away"),  # (once runs started)
    ("prepare_data", then(lambda d, r, t: os.symlink(t / "nowhere", t / "link"),
                          lambda d, r, t: ["arithmetic", "--data-dir", str(t / "link")]), 2,
     "link is a symbolic link to nothing (or back to itself)"),
    ("bench", then(lambda d, r, t: write(t / "s.json", '{"device": 1, "torch": 1, "dtype": 1, '
                                                        '"suite": [{"part": [1]}]}'),
                   lambda d, r, t: ["--device", "cpu", "--suite", "--json", str(t / "s.json")]), 1,
     "s.json is not what this repo writes: its 'suite' is not a list of parts"),  # (a part named by a list: unhashable)
    ("sample", then(edit_weight(lambda w: w.to_sparse()), lambda d, r, t: ["--out-dir", str(r)]), 1,
     "ckpt.pt is not a checkpoint of train.py: its transformer.h.0.mlp.c_fc.weight is not a tensor of weights "
     "(float32, sparse_coo, cpu)"),
    ("analyze", then(edit_weight(lambda w: w.to("meta")), lambda d, r, t: ["routes", "--out-dir", str(r)]), 1,
     "c_fc.weight is not a tensor of weights (float32, strided, meta)"),
    ("sample", then(edit_weight(lambda w: w.long()), lambda d, r, t: ["--out-dir", str(r)]), 1,
     "c_fc.weight is not a tensor of weights (int64, strided, cpu)"),  # (load_state_dict would cast it, silently)
    ("analyze", then(edit_weight(lambda w: w.double()), lambda d, r, t: ["routes", "--out-dir", str(r)]), 1,
     "c_fc.weight is not a tensor of weights (float64, strided, cpu)"),  # (so would it a float of another width)
    # checked against the model it loads into (runs.check_tensors: a method's buffers may hold any dtype, or an inf)
    ("train", then(on_the_copy, edit_weight(lambda w: w.long()), lambda d, r, t: tiny_args(d, t / "new",
                                                                                          f"--init-from={r}")), 1,
     ("--init-from: ", "c_fc.weight is not a tensor of weights (int64, strided, cpu)")),
    ("train", then(on_the_copy, edit_weight(lambda w: w.fill_(math.inf)), resume), 1,
     ("--resume: ", "ckpt.pt is damaged: its transformer.h.0.mlp.c_fc.weight is not finite")),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda c: c.update(step=True)),
                    lambda d, r, t: ["--out-dir", str(r)]), 1,
     "ckpt.pt is not a checkpoint of train.py: its 'step' is of type bool, not int"),
    ("train", then(lambda d, r, t: edit_checkpoint(r, lambda c: c.update(config={})),
                   lambda d, r, t: tiny_args(d, t / "new", f"--init-from={r}")), 1,
     ("--init-from: ", "ckpt.pt: its saved config names no model (no 'n_layer')")),  # (not a clash with --n-layer)
    # the optimiser state, which AdamW's first step reads: a traceback or a loss of NaN after the folder was rewritten
    ("train", then(on_the_copy, edit_moments(lambda s: s.update(exp_avg=s["exp_avg"][:1])), resume), 1,
     ("--resume: ", "ckpt.pt holds an optimiser state its config does not describe (exp_avg of transformer.")),
    ("train", then(on_the_copy, edit_moments(lambda s: s["exp_avg_sq"].fill_(-1.0)), resume), 1,
     ("--resume: ", "ckpt.pt is damaged: its optimiser state's exp_avg_sq of transformer.", " is negative")),
    # a moment of another dtype than its weight's, which load_state_dict would cast without a word (int64: its fractions
    # gone; float64: its last bits), the run resumed with other moments than it saved
    *(("train", then(on_the_copy, edit_moments(lambda s, d=dtype: s.update(exp_avg=s["exp_avg"].to(d))), resume), 1,
       ("--resume: ", f"ckpt.pt is not a checkpoint of train.py: its optimiser state's exp_avg of parameter 0 is not a "
        f"tensor of moments ({name}, strided, cpu)")) for dtype, name in ((torch.int64, "int64"),
                                                                         (torch.float64, "float64"))),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c["optimizer"]["param_groups"][0].update(
        betas="x")), resume), 1, "ckpt.pt holds an optimiser state its config does not describe (betas 'x', not (0.9"),
    # what AdamW's steps read of the state but load_state_dict takes as it is: a traceback once the folder was
    # rewritten (the finished run's summary.json gone), or a run trained on with other values than its config's
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c["optimizer"]["param_groups"][0].update(
        lr_scale="x")), resume), 1, "ckpt.pt holds an optimiser state its config does not describe (lr_scale 'x', not "
                                    "1.0)"),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c["optimizer"]["param_groups"][0].update(
        maximize=True)), resume), 1, "an optimiser state its config does not describe (maximize True, not False)"),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c["optimizer"]["param_groups"][0].update(
        capturable=True)), resume), 1, "an optimiser state its config does not describe (capturable True, not False)"),
    ("train", then(on_the_copy, edit_moments(lambda s: s["exp_avg"].fill_(math.nan)), resume), 1,
     ("--resume: ", "ckpt.pt is damaged: its optimiser state's exp_avg of transformer.", " is not finite")),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c["optimizer"]["param_groups"][0].update(
        betas=(0.9, 0.95, 0.5))), resume), 1,  # (zip would read the first two: AdamW's step fails on three)
     "ckpt.pt holds an optimiser state its config does not describe (betas (0.9, 0.95, 0.5), not (0.9, 0.95))"),
    ("train", then(on_the_copy, edit_moments(lambda s: s.update(step=torch.tensor(math.inf))), resume), 1,
     ("--resume: ", "ckpt.pt is damaged: its optimiser state's step of transformer.", "is inf, not a count of steps")),
    ("train", then(on_the_copy, edit_moments(lambda s: s.update(step=torch.tensor(-1.0))), resume), 1,
     ("--resume: ", "ckpt.pt is damaged: its optimiser state's step of transformer.", "is -1.0, not a count of steps")),
    # a state from another checkpoint of the run: AdamW's bias correction and moments of other steps, in silence
    ("train", then(on_the_copy, edit_moments(lambda s: s.update(step=s["step"] + 1)), resume), 1,
     ("--resume: ", "ckpt.pt is damaged: its optimiser state is of step 7, the checkpoint of step 6 (a state from ")),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: [s.update(step=s["step"] - 4) for s in
                                                                               c["optimizer"]["state"].values()]),
                   resume), 1, "ckpt.pt is damaged: its optimiser state is of step 2, the checkpoint of step 6"),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c["optimizer"].update(state={})), resume),
     1, ("--resume: ", "ckpt.pt is damaged: its optimiser state holds no moments, at step ")),  # (not fresh moments)
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c["optimizer"].update(state=[1])), resume),
     1, "ckpt.pt holds an optimiser state its config does not describe ('list' object has no attribute 'items')"),
    ("sample", then(lambda d, r, t: flip_a_bit(r), lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     ("ckpt.pt is damaged: its ", "/data/", " fails its checksum (a byte changed on disk or in a copy)")),  # (scored)
    # a vocabulary in another order: the run's token ids would read as other tokens, its scores silently wrong
    ("sample", then(on_the_copy, lambda d, r, t: write(d / "meta.json", json.dumps(
        {**json.loads((d / "meta.json").read_text()), "vocab": arithmetic.Task().vocab()[::-1]})),
                    lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     ("meta.json is damaged (its vocabulary is not the task's): rebuild it with", "--overwrite`")),
    # a number of the regime that is not one: not "holds int-steps ..., but the run was trained on int-steps ..."
    ("sample", then(on_the_copy, meta_edit(modulus="11"), lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     "meta.json is damaged (--modulus must be a whole number, got '11'): rebuild it with"),
    ("sample", then(on_the_copy, meta_edit(tiers=5), lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     "meta.json is damaged (--tiers must be a list of whole numbers, got 5): rebuild it with"),
    ("sample", then(on_the_copy, meta_edit(tiers=[4, 5.0]), lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     "meta.json is damaged (--tiers must be whole numbers, got [4, 5.0]): rebuild it with"),
    # a split cut short mid-line, whose last line may still read as a sample (here '... = 1' for '... = 123')
    ("train", then(lambda d, r, t: write(d / "train.txt", (d / "train.txt").read_bytes()[:-3]),
                   lambda d, r, t: tiny_args(d, t / "run")), 1,
     ("train.txt is cut short (its last line has no end): rebuild it with", "--overwrite`")),
    ("sample", then(on_the_copy, lambda d, r, t: write(d / "test_4.txt", (d / "test_4.txt").read_bytes()[:-1]),
                    lambda d, r, t: ["--out-dir", str(r), "--eval"]), 1,
     "test_4.txt is cut short (its last line has no end)"),
    # a meta.json that names another regime than its lines are: not a run trained and scored on the wrong one, and
    # not the command that rebuilds the edited regime (--target answer, --tiers 4,5) in place of the data
    ("train", then(meta_edit(target="answer"), lambda d, r, t: tiny_args(d, t / "run")), 1,
     "meta.json is not the one prepare_data.py wrote with this data (its sha256 says so): edited? Restore it, or make "
     "the data anew in a folder of its own"),
    ("sample", then(meta_edit(tiers=[4, 5]), lambda d, r, t: ["--out-dir", str(r), "--data-dir", str(d), "--eval"]), 1,
     ("is not the one prepare_data.py wrote with this data", "Restore it")),
    ("train", then(meta_edit(seed=1), lambda d, r, t: tiny_args(d, t / "run")), 1,  # (seed 1's data is other data)
     ("/meta.json is not the one prepare_data.py wrote", "edited?")),
    # a meta.json from before the sha256s: its lines found not to be of its regime
    ("train", then(meta_edit(count="operators", sha256=None), lambda d, r, t: tiny_args(d, t / "run")), 1,
     "train.txt, line 1: not a sample of the task (its expression has 3 operators, not 4 or 5 or 6 as in meta.json's "
     "tiers 4,5,6 operators)"),
    # lines that are samples all the same: swapped between splits of a tier, or edited in train.txt (not solved again)
    ("train", then(lambda d, r, t: swap_first_lines(d / "val_4.txt", d / "test_4.txt"),
                   lambda d, r, t: tiny_args(d, t / "run")), 1,
     ("test_4.txt is not the file prepare_data.py wrote (its sha256 is not the one meta.json records: a line edited, "
      "or moved from another split): rebuild it with `python prepare_data.py arithmetic --data-dir ", "--overwrite`")),
    ("sample", then(lambda d, r, t: swap_first_lines(d / "val_5.txt", d / "test_5.txt"),
                    lambda d, r, t: ["--out-dir", str(r), "--data-dir", str(d), "--eval"]), 1,
     "test_5.txt is not the file prepare_data.py wrote"),
    ("train", then(on_the_copy, lambda d, r, t: edit_lines(d / "train.txt", lambda lines: [
        re.sub(r"\d+$", lambda m: str((int(m[0]) + 1) % 1000), lines[0].strip()) + "\n", *lines[1:]]), resume), 1,
     ("train.txt is not the file prepare_data.py wrote (its sha256", "--train-size 100 --test-size 10 --overwrite`")),
    # a scored line's answer edited: solved again, not scored against the wrong answer
    ("train", then(lambda d, r, t: edit_lines(d / "val_5.txt", lambda lines: [
        re.sub(r"\d+$", lambda m: str((int(m[0]) + 1) % 1000), lines[0].strip()) + "\n", *lines[1:]]),
                   lambda d, r, t: tiny_args(d, t / "run")), 1,
     "val_5.txt, line 1: not a sample of the task (its solution is not the one of meta.json's regime int-steps, which "
     "ends '= "),
    # data that meta.json names but whose lines are not it (swapped, lost): not "holds this data already"
    ("prepare_data", then(lambda d, r, t: edit_lines(d / "train.txt", lambda lines: lines[::-1]),
                          lambda d, r, t: ["arithmetic", "--data-dir", str(d), "--count=operands", "--tiers=4,5,6",
                                           "--train-size=100", "--test-size=10"]), 2,
     "data holds other lines than this code makes of the data its meta.json names, int-steps, tiers 4,5,6 operands "
     "(seed 0; 100 train, 10 test, 10 val a tier) (edited, or made by another version): line 1 of its train.txt: give "
     "another --data-dir, or --overwrite to replace it"),
    ("prepare_data", then(lambda d, r, t: edit_lines(d / "test_5.txt", lambda lines: lines[:-1]),
                          lambda d, r, t: ["arithmetic", "--data-dir", str(d), "--count=operands", "--tiers=4,5,6",
                                           "--train-size=100", "--test-size=10"]), 2,
     ("data holds arithmetic data that cannot be read (", "test_5.txt holds 9 lines, not the 10 that its meta.json "
      "names: rebuild it with", "--overwrite`): give another --data-dir, or --overwrite to replace it")),
    ("prepare_data", then(lambda d, r, t: [p.unlink() for p in d.glob("val_*.txt")],  # (not a folder from before them)
                          lambda d, r, t: ["arithmetic", "--data-dir", str(d), "--count=operands", "--tiers=4,5,6",
                                           "--train-size=100", "--test-size=10"]), 2, "val_4.txt is missing"),
    # a folder by the name of one of the data's files: not a traceback after meta.json was deleted
    ("prepare_data", then(lambda d, r, t: ((d / "meta.json").unlink(), (d / "meta.json").mkdir()),
                          lambda d, r, t: ["arithmetic", "--data-dir", str(d), "--overwrite"]), 1,
     "meta.json is not a file but the data's files go by that name: move it away"),
    ("prepare_data", then(lambda d, r, t: (d / "val_9.txt").mkdir(),
                          lambda d, r, t: ["arithmetic", "--data-dir", str(d), "--overwrite"]), 1,
     "val_9.txt is not a file but the data's files go by that name: move it away"),
    # a token shard of no tokens, made or downloaded before
    ("prepare_data", then(lambda d, r, t: (write_shard(t / "shakespeare_train_000000.bin", [5, 2] * 600),
                                           write(t / "shakespeare_val_000000.bin", NO_TOKENS)),
                          lambda d, r, t: ["shakespeare", "--data-dir", str(t)]), 1,
     "shakespeare_val_000000.bin: holds no tokens (its header announces 0): remove it, and the same command makes "
     "it anew"),
    # what an adversarial review found: before, a traceback, memory without end, or a run or a user's file replaced
    ("train", then(lambda d, r, t: edit_checkpoint(r, lambda c: c.update(step=2**70)),  # (a list of 2**70 steps)
                   lambda d, r, t: tiny_args(d, r, f"--max-steps={2**80}", "--resume")), 1,
     "ckpt.pt is not a checkpoint of train.py: its 'step' is 1180591620717411303424, past its config's max_steps=6"),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.update(step=3)),
                   lambda d, r, t: write(r / "summary.json", ""), resume), 1,  # (its step unknown: not replaced)
     ("--resume: ", "summary.json is empty", "the run there has finished, and resuming could replace it; move "
      "summary.json away first to train on from the checkpoint's step 3")),
    ("train", then(on_the_copy, lambda d, r, t: edit_checkpoint(r, lambda c: c.update(step=3)),
                   json_edit("summary.json", lambda s: {k: v for k, v in s.items() if k != "steps"}), resume), 1,
     ("--resume: ", "summary.json says at which step the run ended nowhere")),
    ("train", then(on_the_copy, edit_moments(lambda s: s.update(exp_avg_sq=s["exp_avg_sq"].to_sparse())), resume), 1,
     "ckpt.pt is not a checkpoint of train.py: its optimiser state's exp_avg_sq of parameter 0 is not a tensor of "
     "moments (float32, sparse_coo, cpu)"),
    ("analyze", then(edit_moments(lambda s: s.update(exp_avg=s["exp_avg"].to_sparse())),
                     lambda d, r, t: ["prune", "--out-dir", str(r), "--save", str(t / "p")]), 1,
     "its optimiser state's exp_avg of parameter 0 is not a tensor of moments (float32, sparse_coo, cpu)"),
    ("train", then(on_the_copy, lambda d, r, t: edit_lines(r / "log.jsonl", lambda lines: [
        re.sub(r'"val_loss": [0-9.e-]+', '"val_loss": "abc"', x) for x in lines]), resume), 1,  # (kept, and summed up)
     ("log.jsonl, step 6: val_loss is not a number from 0 up ('abc'); move the log away to resume without it")),
    ("train", then(on_the_copy, lambda d, r, t: edit_lines(r / "log.jsonl", lambda lines: [
        '{"step": 0, "session": {"step": "zz", "device": ["cpu"]}}\n', *lines[1:]]), resume), 1,
     "log.jsonl, line 1: a session of no device or dtype ('{\"step\": 0, \"session\": {\"step\": \"zz\""),
    ("analyze", then(lambda d, r, t: edit_lines(r / "log.jsonl", lambda ls: [*ls, '{"step": 45, "val_loss": 1}\n']),
                     lambda d, r, t: ["curves", str(r)]), 1,
     "log.jsonl, step 45: past the run's last step (config.json's max_steps 6): a row of another run, or copied"),
    ("sample", then(lambda d, r, t: edit_checkpoint(r, lambda c: c["model"].update({  # (saved once, as one storage)
        "lm_head.weight": c["model"]["lm_head.weight"] + 1.0})),
                    lambda d, r, t: ["--out-dir", str(r)]), 1,  # (one of the two would win, silently)
     "ckpt.pt is damaged: its lm_head.weight and transformer.wte.weight, one weight in the model, differ"),
    ("prepare_data", then(lambda d, r, t: (write(t / "mine" / "train.txt", "my notes"), write(t / "mine" / "unfinished",
                                                                                               "")),
                          lambda d, r, t: ["arithmetic", "--data-dir", str(t / "mine")]), 2,
     "mine holds train.txt but no meta.json, and not as data this code was writing (its unfinished is no marker this "
     "code wrote): move them away"),
]


@pytest.mark.parametrize("script, damage, code, message", DAMAGED, ids=[f"{c[0]} {str(c[3])[:50]}" for c in DAMAGED])
def test_every_damaged_file_is_one_line_and_changes_nothing(arith_dir, arith_run, tmp_path, capsys, script, damage,
                                                             code, message, train_in_this_process):
    d, r, t = tmp_path / "data", tmp_path / "run", tmp_path / "t"
    shutil.copytree(arith_dir, d)
    shutil.copytree(arith_run, r)
    t.mkdir()
    (t / "notes.md").write_text("not a folder")
    argv = damage(d, r, t)
    before = snapshot(arith_dir, arith_run, tmp_path)
    main = {"train": train.main, "sample": sample.main, "prepare_data": prepare_data.main, "analyze": analyze.main,
            "grid": grid.main, "bench": bench.main}[script]
    err = error_of(main, argv, capsys, code)
    messages = message if isinstance(message, tuple) else (message,)
    assert err.startswith(f"{script}.py: error: ") and all(m in err for m in messages), err
    assert snapshot(arith_dir, arith_run, tmp_path) == before


def test_a_summary_of_steps_past_64_bits_is_damaged_not_a_later_end(arith_run, tmp_path):
    """A summary.json whose steps no run reaches (2**70) is damaged: nothing to hold the checkpoint and the log to (as
    a missing one), not the end of a run that both fall short of (the checkpoint or the log blamed)."""
    r = tmp_path / "run"
    shutil.copytree(arith_run, r)
    write(r / "summary.json", json.dumps({**json.loads((r / "summary.json").read_text()), "steps": 2**70}))
    runs.check_of_folder(runs.read_checkpoint(r), r)  # (scored and drawn as it is)
    assert [row["step"] for row in analyze.eval_rows(r)[1]] == [6]


def test_arithmetic_data_is_not_given_the_default_regimes_command(arith_dir, arith_run, tmp_path, capsys,
                                                                  train_in_this_process):
    """A run's arithmetic data that cannot be read is not told `prepare it with python prepare_data.py arithmetic`:
    that makes the default regime, not the folder's (refused there; with --overwrite, in place of its data)."""
    d, r = tmp_path / "data", tmp_path / "run"
    shutil.copytree(arith_dir, d)
    shutil.copytree(arith_run, r)
    on_the_copy(d, r, tmp_path)
    (d / "val_4.txt").unlink()
    (d / "val_4.txt").mkdir()
    assert error_of(train.main, resume(d, r, tmp_path), capsys, code=1) == \
        f"train.py: error: {d / 'val_4.txt'} is not a file{arithmetic.NOT_DATA}"


def test_a_checkpoint_saved_without_checksums_reads_as_it_is(arith_run, tmp_path):
    """torch.save with its CRC-32s turned off writes 0 for each: nothing to check there, not a damaged file."""
    shutil.copytree(arith_run, tmp_path / "run")
    ckpt = torch.load(arith_run / "ckpt.pt", weights_only=True)
    ckpt["step"] = 0  # (and of step 0, as a Ctrl-C before the first step saves it: a checkpoint all the same)
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    finally:
        torch.serialization.set_crc32_options(previous)  # (a global of torch's: as it was, for the tests after)
    read = runs.read_checkpoint(tmp_path / "run")
    assert read["step"] == ckpt["step"] and all(torch.equal(read["model"][k], w) for k, w in ckpt["model"].items())


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_peak_memory_is_in_bytes(monkeypatch):
    """A run's summary.json says peak_memory_bytes: on a CPU the peak resident size, which getrusage gives in KiB
    on Linux (and in bytes on macOS: the same getrusage read as if here were macOS is 1024 times less)."""
    peak_kib = int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())[1])
    assert abs(cli.peak_memory("cpu") / (peak_kib * 1024) - 1) < 0.05
    monkeypatch.setattr(cli.sys, "platform", "darwin")
    assert abs(cli.peak_memory("cpu") / peak_kib - 1) < 0.05
    monkeypatch.setattr(cli.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=1000))  # exactly, the unit
    assert cli.peak_memory("cpu") == 1000
    monkeypatch.setattr(cli.sys, "platform", "linux")
    assert cli.peak_memory("cpu") == 1000 * 1024  # (KiB: not 1000 * 1000)


@pytest.mark.parametrize("env, message", [
    (dict(RANK="0"), "RANK is set, but not with WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun "
                     "sets them: launch with torchrun, or unset RANK for one process"),  # (KeyError: 'WORLD_SIZE')
    (dict(RANK="abc", WORLD_SIZE="1", MASTER_ADDR="x", MASTER_PORT="1"), "RANK is set, but not with"),  # (int())
    (dict(RANK="0", WORLD_SIZE="0", MASTER_ADDR="x", MASTER_PORT="1"),  # (ZeroDivisionError)
     "RANK=0 with WORLD_SIZE=0: a process's rank is 0 .. WORLD_SIZE - 1"),
])
def test_torchruns_variables_set_by_hand_are_one_line(arith_dir, tmp_path, capsys, monkeypatch, env, message):
    """Variables no launcher sets so (by hand, or left in a shell): one line, not a traceback from int() or from
    torch.distributed. WORLD_SIZE without RANK is a plain run, one process, in every check."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert message in error_of(train.main, tiny_args(arith_dir, tmp_path / "run", "--dry-run"), capsys)
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", "3")  # (--batch-size=8 is no multiple of 4 x 3: it was refused as if 3 ran)
    train.main(tiny_args(arith_dir, tmp_path / "run", "--dry-run"))
    assert not (tmp_path / "run").exists()
