"""
Run management: what train.py needs around its recipe, and what the other scripts read back.

  * the config of a run from its flags: a flag per field of the config dataclass, helped by the
    field's own help text; presets; --resume and --init-from; every check before anything is written;
  * the run's folder: config.json, log.jsonl, ckpt.pt and summary.json, written by rank 0 only,
    each whole or not at all; signals (Ctrl-C, SIGTERM, SIGHUP) that save a checkpoint and exit;
  * a finished run read back: its checkpoint, model and data, its summary and the setting it is a seed of
    (seed_group), which tables.py compares runs by.
"""

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import stat
import sys
import warnings
import zipfile
from contextlib import closing, contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

import arithmetic
import prosqa
from cli import (POSITIVE, SIZE, DataError, Interrupted, Parser, UsageError, a_path, atomic_write, being_written,
                 check_a_file, default_shown, file_state, folder_problem, hold_folder, is_accuracy, one_line_errors,
                 option, pick_device, read_json, refuse_held, refuse_writing, same_folder, shown)
from data import OtherShards, TaskRows, TokenData
from lime import GPT, GPTConfig
from pruning import prunable_routers

# a folder with any of these holds a run, or what analyze.py made of one: --overwrite deletes them all, and
# without it nothing is written there
RUN_FILES = ["ckpt.pt", "log.jsonl", "summary.json", "config.json", "prune.json", "routes.png", "entropy.png",
             "probe.png", "prune.png"]
# what a folder another process holds may be, and what to do (train.py holds its --out-dir while it trains)
TRAINING_THERE = "a train.py still training there? wait for it to end, or give another --out-dir"
DATASETS = {"fineweb-edu": TokenData, "shakespeare": TokenData, "arithmetic": arithmetic.Data, "prosqa": prosqa.Data}


@dataclasses.dataclass
class EvalConfig(GPTConfig):
    """A run's model, its data and how it is evaluated: what sample.py and analyze.py read back of a run (its
    checkpoint's config, checked by check_config), and what train.py's TrainConfig adds training to."""
    data: str = option("fineweb-edu", "dataset", choices=tuple(DATASETS))
    data_dir: str = option("", "where the dataset is (default data/<data>)", path=True)
    micro_batch_size: int = option(16, "sequences per forward pass per process; the rest is gradient accumulation",
                                   rule=SIZE)
    eval_tokens: int = option(2_097_152, "language data: validation tokens, in whole windows from the start of val "
                              "(a shorter shard: all of it)",
                              rule=POSITIVE, data=TokenData)
    eval_samples: int = option(1000, "tasks: samples per tier scored (test, validation); prosqa: test questions; "
                               "a smaller split is scored whole",
                               rule=POSITIVE, data=TaskRows)
    task: dict = None  # not a flag: the task's regime as its data names it (arithmetic), recorded by train.py
    shards: dict = None  # not a flag: the token shards a language run reads (data.TokenData), recorded by train.py


def main(script, argv, cls, presets, train, read_data, description=None):
    """A training script's main: its config from argv (`cls`, `presets`), then train(cfg, run) with
    signals installed; bad input, missing data and interruptions end it with one line. --dry-run checks what
    the run would, up to read_data(cfg, run, dry_run=True) (the run's data, where it is there), and writes nothing."""
    cfg = None

    def data_hint(e):  # for the data a run reads, how to make it, unless the message says so already
        # (it names the data folder or a file in it: not a run's folder beside it, data/arithmetic-quick-runs)
        named = cfg is not None and re.search(re.escape(str(cfg.data_dir)) + r"(?![\w.-])", str(e))
        # NOTE not for the arithmetic task: arithmetic.load says what to do, with the flags of the folder's regime,
        # where `prepare_data.py arithmetic` alone would make the default one (refused, or with --overwrite, replacing)
        if not named or isinstance(e, OtherShards) or cfg.data == "arithmetic":  # (OtherShards: made by preparing)
            return ""
        how = ""
        if "prepare_data.py" not in str(e):
            where = "" if Path(f"data/{cfg.data}").resolve() == Path(cfg.data_dir) else \
                f" --data-dir {shlex.quote(str(cfg.data_dir))}"
            command = f"`python prepare_data.py {cfg.data}{where}`"
            how = f"; prepare it with {command}"
            # a shard named: the command makes anew one that is not there, the others kept (and Tiny Shakespeare's
            # text: --overwrite would download it again, over a text of one's own)
            if re.search(r"\.bin\b", str(e)):
                how = f"; if it is damaged, remove it and prepare it anew with {command}"
        # data to download: the preset that needs none, unless it is the one running, or the data is a fine-tune's
        return how + ("" if cfg.preset == "tiny" or cfg.data == "prosqa" else
                      " (the offline --preset=tiny needs no download)")

    run = None

    def elsewhere():  # NOTE under torchrun every process checks the same flags and files until the run begins: the
        return not (run and run.begun) and not first_here()  # first of each machine says what is wrong, not each

    with one_line_errors(script, data_hint, elsewhere=elsewhere):
        cfg, resume, init, dry_run, seen = resolve(argv, cls, presets, description)
        run = Run(cfg, resume, init, seen)  # reads what a resume keeps of the log: nothing is written till it is whole
        if dry_run:
            run.check_weights()  # on the meta device (no memory, no time), and a narrow copy on the CPU
            # NOTE the data too where it is there, as the run reads it: a sample longer than --block-size, or
            # --stop-at past the steps of --epochs, refused here (grid.py checks its runs so), not by every run
            data = read_data(cfg, run, dry_run=True)
            if run.master:  # (under torchrun, once, not once per process)
                # a length in epochs becomes steps once the data's size is known (train.py): not without the data
                later = " and ".join(f"{steps} from --{epochs.replace('_', '-')}" for steps, epochs in
                                     (("max_steps", "epochs"), ("warmup_steps", "warmup_epochs"))
                                     if data is None and resume is None and getattr(cfg, epochs, 0) > 0)
                checked = f"the flags, the model and the checkpoints they name check out; no data in {cfg.data_dir} " \
                    "yet, so none was checked" if data is None else \
                    "the flags, the model, the data and the checkpoints they name check out"
                print("config: " + json.dumps(dataclasses.asdict(cfg)) + f"\n(--dry-run: {checked}; nothing was "
                      "written" + (f"; the run sets {later} once it reads the data" if later else "") + ")")
            return None
        with Signals() as run.signals, closing(run):
            return train(cfg, run)


# -----------------------------------------------------------------------------
# The config from flags


def flag(name):
    return "--" + name.replace("_", "-")


def parse_bool(text):
    """on/off, true/false, yes/no or 1/0, as `--flag=off` (argparse's type=bool would read 'off' as True)."""
    words = dict(on=True, true=True, yes=True, off=False, false=False, no=False)
    words.update({"1": True, "0": False})
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return words[text.lower()]


def flag_fields(cls):
    """{field: its type} for the fields of `cls` that are flags: those of a type a flag can hold."""
    def depth(f):  # 0 for the fields of cls itself, 1 for its parent's, ...: a class's own flags come first
        return next(i for i, c in enumerate(cls.__mro__) if f.name in vars(c).get("__annotations__", {}))
    own_first = sorted(dataclasses.fields(cls), key=depth)
    return {f: field_type(f) for f in own_first if field_type(f) in (int, float, str, bool)}


# what a field of each type holds, as an error says it
KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a dict", list: "a list"}


def field_type(f):
    """The type of the dataclass field f, which may be written as its name ('int')."""
    return {t.__name__: t for t in KINDS}.get(f.type, f.type)


def build_parser(cls, defaults, description=None):
    """A flag per field of `cls`, helped by the field's metadata (option()'s help text; its name if it
    has none) and showing its value in `defaults` as cli.Help does. Every flag defaults to None, so that what
    was given can be told from what was not."""
    p = Parser(description=description)
    for f, kind in flag_fields(cls).items():
        text = f.metadata.get("help") or f.name.replace("_", " ")
        text = text() if callable(text) else text  # a text that depends on what is registered
        shown = default_shown(text, defaults[f.name])
        p.add_argument(flag(f.name), type=parse_bool if kind is bool else a_path if f.metadata.get("path") else kind,
                       help=(text + f" [{defaults[f.name]}]" * shown).replace("%", "%%"))
    p.add_argument("--resume", action="store_true", help="continue from <out-dir>/ckpt.pt with its saved config")
    p.add_argument("--overwrite", action="store_true",
                   help=f"start over in an <out-dir> that holds a run: its files ({', '.join(RUN_FILES)}) are deleted")
    p.add_argument("--dry-run", action="store_true", help="check the flags, the model, the checkpoints they name "
                                                          "and the data where it is there, print the config, and "
                                                          "stop: nothing is written")
    return p


def resolve(argv, cls, presets, description=None):
    """The config of a run, a `cls`: flags > the model shape of --init-from's run > preset > defaults;
    with --resume, flags > the config saved in the checkpoint. Returns (config, the checkpoint to resume,
    the checkpoint of --init-from, whether --dry-run was given, and the folder_state of --out-dir as the checks
    began). Anything that does not fit is a UsageError (or a DataError, for a checkpoint that cannot be read)
    before anything is written."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default=cls.preset)
    preset = pre.parse_known_args(argv)[0].preset  # first, so that --help shows the preset's defaults
    if preset not in presets:
        raise UsageError(f"unknown preset {preset!r}: choose from {', '.join(presets)}")
    defaults = {**dataclasses.asdict(cls()), **presets[preset], "preset": preset}
    given = {k: v for k, v in vars(build_parser(cls, defaults, description).parse_args(argv)).items() if v is not None}
    resume, overwrite, dry_run = given.pop("resume"), given.pop("overwrite"), given.pop("dry_run")
    if "data_dir" in given:  # a run records where its data is, from any working directory
        given["data_dir"] = str(Path(given["data_dir"]).resolve())
    if resume and overwrite:
        raise UsageError("--resume continues the run in --out-dir and --overwrite deletes it: give one of them")
    cfg = {**defaults, **given}
    for steps, epochs in (("max_steps", "epochs"), ("warmup_steps", "warmup_epochs")):
        if steps in given and epochs in given:
            raise UsageError(f"{flag(steps)} and {flag(epochs)} both say how long: give one of them")
        if steps in given and epochs in cfg:
            cfg[epochs] = 0.0  # a length in steps on the command line wins over the preset's in epochs
    cfg["data_dir"] = given.get("data_dir") or data_folder(presets, preset, cfg["data"])
    init = None
    if cfg["init_from"] and not resume:  # (with --resume, the run's own --init-from: resume_checkpoint checks it)
        init = init_checkpoint(cfg, given)
        # what it starts from is part of its setting (a fine-tune of a longer run is another): here, so that --dry-run
        # (grid.py's check of the runs it keeps) says what config.json will
        cfg["init_source"] = dict(setting=setting(init["config"]), step=init["step"])
    cfg["out_dir"] = cfg["out_dir"] or f"out/{preset}-{cfg['router']}"
    if init is not None and same_folder(cfg["out_dir"], cfg["init_from"]):  # (--overwrite would clear it)
        raise UsageError(f"--out-dir={cfg['out_dir']} is the run --init-from starts from: give a new folder")
    problem = folder_problem(cfg["out_dir"])
    if problem:
        raise UsageError(f"--out-dir={cfg['out_dir']}: {problem}")
    if processes()[0] == 0:  # (rank 0 holds it as the run begins; the others never)
        refuse_held(cfg["out_dir"], TRAINING_THERE)  # first: a run in training there reads as one cut short below
    seen = folder_state(cfg["out_dir"])  # before the checks read the folder (--resume: seconds of checkpoint)
    found = run_files(cfg["out_dir"])
    if found and not resume and not overwrite and not never_trained(cfg["out_dir"], found):
        advice = ": continue it with --resume," if "ckpt.pt" in found else " with no checkpoint to resume from:"
        raise UsageError(f"{cfg['out_dir']} already holds a run ({', '.join(found)}){advice} start over with "
                         "--overwrite, or give another --out-dir")
    ckpt = None
    if resume:
        ckpt, cfg = resume_checkpoint(cls, cfg, given)
    for f in dataclasses.fields(cls):  # a flag for data of another kind would be ignored: say so instead
        kind = f.metadata.get("data")
        if f.name in given and kind and not issubclass(DATASETS.get(cfg["data"], kind), kind):
            meant = " and ".join(name for name, data in DATASETS.items() if issubclass(data, kind))
            raise UsageError(f"{flag(f.name)} is for {meant} data, not --data={cfg['data']}")
    if "prune_at" in given and not cfg["router_top_p"] > 0:
        raise UsageError("--prune-at says when to prune: give --router-top-p too")
    try:
        config = cls(**cfg)  # its own checks: ranges, choices, the model's shape and router
    except ValueError as e:
        raise UsageError(str(e)) from None
    if "router_top_p" in given and config.router_top_p > 0 and "prune_at" not in given and not resume:
        # (its default, 0, prunes the weights the run starts from, drawn or --init-from's; a run started so resumes
        # without it)
        raise UsageError("--router-top-p says how much to prune: give --prune-at too, the step at which to prune (0: "
                         "the weights the run starts from)")
    world = processes()[1]
    if config.batch_size % (config.micro_batch_size * world):
        raise UsageError(f"--batch-size={config.batch_size} is not a multiple of --micro-batch-size="
                         f"{config.micro_batch_size} x {world} processes")
    try:
        pick_device(config.device)
    except UsageError as e:
        if "device" in given or not resume:
            raise
        raise UsageError(f"{e} (the run's, from its config): give --device to resume it on this machine") from None
    if ckpt is not None or not config.epochs > 0:  # a length in epochs is in steps once the data is read
        check_last_step(config)
    return config, ckpt, init, dry_run, seen


def processes():
    """(rank, world size): torchrun's RANK and WORLD_SIZE, or (0, 1) for a plain run (without RANK). Variables that
    no launcher sets so (by hand, or left over in a shell) are a UsageError, not a traceback or a wait for peers."""
    env = os.environ
    if "RANK" not in env:
        return 0, 1
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        int(env.get("LOCAL_RANK", 0)), env["MASTER_ADDR"], env["MASTER_PORT"]
    except (KeyError, ValueError):
        raise UsageError("RANK is set, but not with WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT as torchrun "
                         "sets them: launch with torchrun, or unset RANK for one process") from None
    if not 0 <= rank < world:
        raise UsageError(f"RANK={rank} with WORLD_SIZE={world}: a process's rank is 0 .. WORLD_SIZE - 1")
    return rank, world


def first_here():
    """Whether this process is the first on its machine: a plain run's, or LOCAL_RANK 0's under torchrun (or one whose
    variables processes() refuses: each says so)."""
    try:
        return processes()[1] == 1 or int(os.environ.get("LOCAL_RANK", 0)) == 0
    except UsageError:
        return True


def steps_of_epochs(cfg, steps_per_epoch):
    """--epochs and --warmup-epochs (of a task: samples, not token shards) as --max-steps and --warmup-steps."""
    for epochs, steps in (("epochs", "max_steps"), ("warmup_epochs", "warmup_steps")):
        if getattr(cfg, epochs) > 0:
            n = getattr(cfg, epochs) * steps_per_epoch
            if n >= 2**53:  # (past a float's whole numbers; 1e306 epochs would be an OverflowError's traceback)
                raise UsageError(f"{flag(epochs)}={getattr(cfg, epochs):g} is over 2**53 steps of this data "
                                 f"({steps_per_epoch:g} an epoch)")
            setattr(cfg, steps, math.ceil(n))


def check_last_step(config):
    """--prune-at and --stop-at against the run's last step: a UsageError for one that would never happen."""
    if config.router_top_p > 0 and config.prune_at >= config.max_steps:
        raise UsageError(f"--prune-at={config.prune_at} is not before the last step (max_steps={config.max_steps})")
    if config.stop_at > config.max_steps:  # it would be ignored: the run ends at max_steps (--stop-at=max_steps: there)
        raise UsageError(f"--stop-at={config.stop_at} is past the last step (max_steps={config.max_steps})")


def data_folder(presets, preset, data):
    """Where a run of `preset` reads `data` unless --data-dir says otherwise (an absolute path, so that the
    run reads it from any working directory): the preset's own folder for the preset's own data, data/<data>
    for any other (the preset's folder holds its data, not the data asked for instead)."""
    own = presets[preset].get("data_dir") if data == presets[preset].get("data") else None
    return str(Path(own or f"data/{data}").resolve())


def resume_checkpoint(cls, cfg, given):
    """--resume: the checkpoint in --out-dir and the config saved in it, in which a flag may change only
    the fields that say so (resume="may change": where and how long this session runs)."""
    path = Path(cfg["out_dir"]) / "ckpt.pt"
    free = [f.name for f in dataclasses.fields(cls) if f.metadata.get("resume") == "may change"]
    try:
        ckpt = read_checkpoint(cfg["out_dir"])
        anew = [k for k in given if k in free]  # not read from the checkpoint, nor checked there
        saved = check_config({k: v for k, v in ckpt["config"].items() if k not in anew}, path, cls)
    except DataError as e:
        raise DataError(f"--resume: {e}") from None
    if saved["task"] is not None:  # a task's data is held to the run's regime wherever it is: it may have moved
        free.append("data_dir")
    written = Path(cfg["out_dir"]) / "config.json"  # the run the folder describes: the checkpoint must be of it
    try:  # both read as check_config reads them (an older run's relative data_dir, its missing fields); as JSON
        run, ours = (json.loads(json.dumps(c)) for c in (check_config(read_json(written), written, cls), saved))
    except DataError:  # none, or damaged: --resume writes it anew
        run = ours = {}
    other = [f"{k} {ours[k]!r} (config.json: {run[k]!r})" for k in ours if k not in free and run[k] != ours[k]]
    if other:
        raise DataError(f"--resume: {path} is not of the run that {written} describes: it has {', '.join(other)}; "
                        f"if it is, remove {written.name}, which --resume writes anew")
    if "init_from" in given:  # the command that started the run, --resume added: its --init-from is the run's own
        began, new = saved["init_from"], given["init_from"]
        if not (began and (new == began or same_folder(new, began))):
            raise UsageError(f"--resume continues the run in {cfg['out_dir']}, which started from "
                             f"{began or 'scratch'}, and --init-from={new} starts a new one: give one of them")
    clash = [f"{k}={saved[k]!r} (not {v!r})" for k, v in given.items()
             if k not in free and k != "init_from" and v != saved[k]]
    if clash:
        raise UsageError(f"--resume: {path} was trained with {', '.join(clash)}")
    cfg = {**saved, **{k: v for k, v in given.items() if k in free}}
    cfg["stop_at"] = given.get("stop_at", 0)  # where the earlier session stopped is no stop for this one
    finished = (Path(cfg["out_dir"]) / "summary.json").exists()
    if finished:  # a checkpoint older than the run's end (one restored from a backup): resumed, it would cut the log
        try:      # back to its step and delete the summary, the finished run lost without a word
            summary = read_summary(cfg["out_dir"])
            agree(cfg["out_dir"], run, summary)  # (one copied in from another run: where this one ended is not known)
            ended = summary.get("steps")
            if ended is None:  # (read_summary checks it where it is there)
                raise DataError(f"{Path(cfg['out_dir']) / 'summary.json'} says at which step the run ended nowhere")
        except DataError as e:  # damaged: where that run ended is not known, and a finished run is not replaced unasked
            raise DataError(f"--resume: {e}: the run there has finished, and resuming could replace it; move "
                            f"summary.json away first to train on from the checkpoint's step {ckpt['step']}") from None
        if ckpt["step"] < ended:
            raise DataError(f"--resume: {path} is of step {ckpt['step']}, before the end of the finished run there "
                            f"(step {ended}, its summary.json): resuming would replace that run; move summary.json "
                            "away first to train on from that step")
    if ckpt["step"] > cfg["max_steps"] or (ckpt["step"] == cfg["max_steps"] and finished):
        raise UsageError(f"--resume: the checkpoint is already at max_steps={cfg['max_steps']}; raise --max-steps")
    if 0 < cfg["stop_at"] <= ckpt["step"]:
        raise UsageError(f"--stop-at={cfg['stop_at']}: the checkpoint is already at step {ckpt['step']}")
    return ckpt, cfg


def init_checkpoint(cfg, given):
    """--init-from: the other run's checkpoint. Its model's shape replaces the preset's, so that its
    weights fit; block_size may change (RoPE is computed, not stored). A flag that asks for another
    shape is an error, not a silent change."""
    try:
        init = read_checkpoint(cfg["init_from"])
        source = check_config(init["config"], Path(cfg["init_from"]) / "ckpt.pt", GPTConfig)  # only the model's
        check_of_folder(init, cfg["init_from"])  # (the run it starts from is the one its folder names)
    except DataError as e:
        raise DataError(f"--init-from: {e}") from None
    shape = [f.name for f in dataclasses.fields(GPTConfig) if f.name != "block_size"]
    clash = [f"{k}={source[k]!r} (not {given[k]!r})" for k in shape if k in given and given[k] != source[k]]
    if clash:
        raise UsageError(f"--init-from: {Path(cfg['init_from']) / 'ckpt.pt'} holds a model with {', '.join(clash)}")
    cfg.update({k: source[k] for k in shape})
    return init


# -----------------------------------------------------------------------------
# A run's folder, written while it trains


class Signals:
    """While installed, SIGINT, SIGTERM and SIGHUP (the terminal closed) raise Interrupted (train.py: it saves a
    checkpoint, then exits 128 + the signal), except inside `with signals.hold():`
    (an optimiser update, a checkpoint save), which a signal waits for. Once stopping, every
    further signal waits: the checkpoint being saved on the way out must be written whole."""

    def __init__(self):
        self.held, self.pending, self.stopping = 0, None, False

    def __enter__(self):
        # NOTE not SIGHUP where it is ignored: `nohup` ignores it, so that the run goes on when the terminal closes
        hangup = [] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP]
        self.saved = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM, *hangup)}
        return self

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        if signum == signal.SIGHUP:  # the terminal closed: a line to it would fail (EIO), so none goes there now
            for stream in (sys.stdout, sys.stderr):
                try:
                    fd = stream.fileno()
                except (OSError, ValueError):  # (a stream in memory: a test's)
                    continue
                if stat.S_ISCHR(os.fstat(fd).st_mode):  # a terminal (which os.isatty fails once hung up), not `> log`
                    devnull = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(devnull, fd)
                    os.close(devnull)
        if self.held or self.stopping:
            self.pending = self.pending or signum
        else:
            self.stop(signum)

    def stop(self, signum):
        self.stopping = True
        raise Interrupted(signum)

    @contextmanager
    def hold(self):
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
        if self.pending and not self.held and not self.stopping:
            self.stop(self.pending)


def read_log(path, advice=""):
    """The rows of a log.jsonl, and a notice if its last line was cut short (what a power cut leaves),
    which is dropped; a line in the middle that is not a row is a DataError, ending with `advice`."""
    check_a_file(path, advice)
    try:
        lines, rows, notice, evaluated = Path(path).read_text().splitlines(), [], None, set()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path} cannot be read as a log ({e}){advice}") from None
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not (of_kind(row.get("step"), int) and 0 <= row["step"] < 2**63):
                raise ValueError("no step")  # (a step is a whole number, not true, nor -5, nor 400 digits)
        except (ValueError, RecursionError):  # (RecursionError: brackets nested deeper than json reads)
            if i < len(lines) - 1:
                raise DataError(f"{path}, line {i + 1}: not a row of the log ({line[:40]!r}){advice}") from None
            notice = f"{path}: its last line was cut short, so it is dropped: {line[:40]!r}"
            continue
        # NOTE steps only go on (a resume rewrites the log up to its checkpoint), and a step is evaluated once: else
        # rows of another run appended, or a row copied, whose values curves would draw as this run's
        what = f"step {row['step']} after step {rows[-1]['step']}" if rows and row["step"] < rows[-1]["step"] else \
            f"a second evaluation of step {row['step']}" if "val_loss" in row and row["step"] in evaluated else None
        session = row.get("session", {"device": "", "dtype": ""})  # (what Run.session logs, and summary.json lists)
        if not (isinstance(session, dict) and "step" not in session and
                all(isinstance(session.get(k), str) for k in ("device", "dtype"))):
            what = f"a session of no device or dtype ({line[:40]!r})"
        if what:
            raise DataError(f"{path}, line {i + 1}: {what}: rows of another run, or copied{advice}")
        evaluated.update([row["step"]] if "val_loss" in row else [])
        rows.append(row)
    # each evaluation's metrics (a resumed run keeps them in its log and summary, and curves draws them)
    evaluations = [row for row in rows if "val_loss" in row]
    for row in evaluations:
        for key, value in row.items():
            fault = metric_fault(key, value, diverged=row is evaluations[-1]) or \
                (key.startswith("val_") and not of_kind(value, float) and "not a number")  # (a fork's metric)
            if fault:
                raise DataError(f"{path}, step {row['step']}: {key} is {fault} ({value!r}){advice}")
    return rows, notice


class Run:
    """The folder of one training run, written by rank 0 only: config.json and log.jsonl from the
    start, ckpt.pt at most once per step and whole even when a signal comes during the write, and
    summary.json at the end. `resume` and `init` are the checkpoints of --resume and --init-from; `seen`, the
    folder_state of the folder as resolve() began to check it."""

    def __init__(self, cfg, resume=None, init=None, seen=None):
        self.cfg, self.resume, self.init = cfg, resume, init
        self.out_dir = Path(cfg.out_dir)
        self.signals = Signals()  # not installed (main() installs one): it holds nothing
        self.master = processes()[0] == 0
        self.saved_step = resume["step"] if resume else None  # the step of the checkpoint on disk
        self.router_mask = None  # pruned router weights, saved with the model so that a resumed run keeps them
        # NOTE the step at which this run pruned (--prune-at), in its checkpoints: one of that step may be of the
        # weights before the pruning (its evaluation's) or after, and a run resumed from one after pruned again
        self.pruned_at = self.saved_pruned_at = resume.get("pruned_at") if resume else None
        self.rows, self.notice = [], None  # a resumed run: the log's rows up to its checkpoint, kept
        self.held = None  # the folder's descriptor, held from begin() to close()
        self.ending = None  # a finished run resumed: the config.json that unfinish() writes (begin)
        self.begun = False  # begin() called: from then on each process's errors are its own (runs.main)
        # what the checks saw (resolve's `seen`, taken before they read the folder); begin() holds it, then compares
        self.seen = seen if seen is not None else folder_state(self.out_dir)
        if resume is not None and (self.out_dir / "log.jsonl").exists():
            rows, self.notice = read_log(self.out_dir / "log.jsonl", "; move the log away to resume without it")
            final = self.saved_step == cfg.max_steps  # its evaluation is done again: it has to see the test split
            again = ["val_loss", "session"] if final else ["session"]  # (a session of no step: this one's instead)
            if self.pruned_at != self.saved_step:  # a pruning the checkpoint does not hold (killed before it saved)
                again.append("router_pruned")
            self.rows = [row for row in rows if row["step"] < self.saved_step or
                         row["step"] == self.saved_step and not any(key in row for key in again)]
            # every evaluation between the log's first row and the checkpoint's step is in it (one is logged before
            # its checkpoint is saved): rows gone (a log cut back by whole lines) would leave its curves without them.
            # (A log may begin later than step 0: prune --save's, or one begun anew after the old was moved away)
            evaluated = {row["step"] for row in self.rows if "val_loss" in row}
            first = self.rows[0]["step"] if self.rows else self.saved_step
            gone = [s for s in range(cfg.eval_interval, self.saved_step, cfg.eval_interval)
                    if s > first and s not in evaluated]
            if gone:
                self.notice = "\n".join(filter(None, [self.notice, (
                    f"NOTE {self.out_dir / 'log.jsonl'} lacks the evaluation of step {gone[0]}"
                    f"{f' and {len(gone) - 1} more' if len(gone) > 1 else ''}, before the checkpoint's step "
                    f"{self.saved_step}: its rows were cut away, and its curves will go without them")]))

    def say(self, *args, **kwargs):
        if self.master:
            print(*args, **kwargs)

    def start(self):
        """The checkpoint this run starts from, and how an error names it: (ckpt, '--resume: PATH') or
        (ckpt, '--init-from: PATH'); None for a run from scratch."""
        if self.init is not None:
            return self.init, f"--init-from: {Path(self.cfg.init_from) / 'ckpt.pt'}"
        return (self.resume, f"--resume: {self.out_dir / 'ckpt.pt'}") if self.resume is not None else None

    def restore(self, model, optimizer):
        """Load what this run starts from into the model (and optimiser), which it then saves: with
        --resume, the checkpoint's weights, optimiser state and step; with --init-from, the other
        run's weights only, at step 0. Returns (step, the pruning mask of those weights or None)."""
        self.model, self.optimizer = model, optimizer
        start = self.start()
        if start is None:
            return 0, None
        ckpt, where = start
        mask = load_weights(model, ckpt, where)
        if ckpt is self.init:
            return 0, mask
        built = [{k: group[k] for k in HYPERPARAMETERS if k in group} for group in optimizer.param_groups]
        kernel = [{k: group[k] for k in KERNEL if k in group} for group in optimizer.param_groups]
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:  # (a 'state' that is a list, ...)
            raise DataError(f"{where} holds an optimiser state its config does not describe "
                            f"({load_problem(e)})") from None
        check_optimizer(optimizer, model, where, built, ckpt["step"])
        for group, chosen in zip(optimizer.param_groups, kernel):  # NOTE load_state_dict takes the file's: a CUDA
            group.update(chosen)  # run's fused=True on a CPU now, or a damaged foreach='x' (a traceback at its step)
        return ckpt["step"], mask

    def check_weights(self):
        """--dry-run: the model, built (a method that cannot be built at this shape fails here, not in the run),
        and what restore() checks of the weights it would load (and of their pruning mask; not of the optimiser
        state), on the meta device: no memory, no time. And each weight's initial value, on a narrow copy."""
        start = self.start()
        config = GPTConfig.of(self.cfg)
        with torch.device("meta"):
            model = GPT(config)
            if start is not None:
                load_weights(model, *start)
        # NOTE on meta there are no values, so GPT.init_weights cannot find a method's weight that nothing sets:
        # a narrow copy (the same layers, heads and method; heads of 2, one token) finds it, on the CPU
        GPT(dataclasses.replace(config, n_embd=2 * config.n_head, mlp_hidden=1, vocab_size=1, block_size=1))

    def begin(self):
        """The folder, written only now that everything before has worked: a new run clears what an
        --overwrite leaves, a resumed one keeps the log up to its checkpoint."""
        self.begun = True
        if self.master:
            self.held = hold_folder(self.out_dir, TRAINING_THERE)
            # between this run's checks and now (seconds of data and model), another process may have written a
            # finished run here (clear_run would delete it) or a checkpoint newer than the one --resume read
            refuse_changed(self.out_dir, self.seen, "while this run was starting")
            if self.resume is None:
                clear_run(self.out_dir)
            config = json.dumps(dataclasses.asdict(self.cfg), indent=2).encode()
            if self.resume is not None and (self.out_dir / "summary.json").exists():
                # NOTE a finished run resumed to more steps stays that run (its summary.json, its config.json) until
                # its session logs a step past it or saves a checkpoint (unfinish): one that fails before then (its
                # first batch's data, memory) leaves it as it was
                self.ending = config
            else:
                atomic_write(self.out_dir / "config.json", lambda f: f.write(config))
            atomic_write(self.out_dir / "log.jsonl", lambda f: f.write("".join(json.dumps(r) + "\n" for r in
                                                                                  self.rows).encode()))
            if self.notice:
                print(self.notice)

    def close(self):
        """Let go of the folder (a program that calls train.main() again may train in it)."""
        if self.held is not None:
            os.close(self.held)
            self.held = None

    def log(self, **record):
        """A row of <out-dir>/log.jsonl: one JSON object per logged step and per evaluation."""
        if self.master:
            if "session" not in record:  # (a session's row says where it runs: nothing done yet)
                self.unfinish()
            with self.writing("log.jsonl"), open(self.out_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")  # (a row cut short by a full disk: --resume drops it)

    def unfinish(self):
        """A finished run resumed to more steps (begin) is one no longer: its config.json anew, its summary gone."""
        if self.ending is not None:
            with self.writing("config.json"):
                atomic_write(self.out_dir / "config.json", lambda f: f.write(self.ending))
            with self.writing("summary.json"):
                (self.out_dir / "summary.json").unlink(missing_ok=True)
            self.ending = None

    @contextmanager
    def writing(self, name):
        """Around a write of the run's file `name` as it trains: a full disk is one line, unwritten()'s."""
        try:
            yield
        except DataError as e:  # (atomic_write's, or torch.save's through it: the file before stays)
            raise self.unwritten(e) from None
        except OSError as e:  # (an append's)
            raise self.unwritten(f"cannot write {self.out_dir / name}: {e.strerror or e}") from None

    def unwritten(self, problem):
        """A DataError for a file of the run that cannot be written as it trains (a full disk): what stays, and what to
        do then."""
        kept = "no checkpoint was written; start over with --overwrite" if self.saved_step is None else \
            f"the checkpoint of step {self.saved_step} stays; continue with --resume"
        return DataError(f"{problem}: {kept}")

    def logged_evaluation(self, step):
        """The metrics of the evaluation of `step` that the kept log holds (a resumed run), or None (none at
        max_steps: the final evaluation is always done again, on the test split too)."""
        row = next((r for r in self.rows if r["step"] == step and "val_loss" in r), None)
        return row and {k: v for k, v in row.items() if k != "step"}

    def session(self, step, **where):
        """This session's row of the log (its first step, and where and how it runs: device, dtype, ...), and a note
        if the run's last session ran on another kind of device or in another dtype: the arithmetic changes there,
        and so does the log's ms/step, which nothing else would explain. Returns the note, or None."""
        earlier = next((r["session"] for r in reversed(self.rows) if isinstance(r.get("session"), dict)), None)
        self.log(step=step, session=where)
        self.rows.append(dict(step=step, session=where))  # (the summary lists every session: sessions())
        if earlier is not None and ran_on(earlier) != ran_on(where):
            return (f"NOTE this run ran on {earlier.get('device')} in {earlier.get('dtype')} until step {step}; from "
                    f"here it runs on {where['device']} in {where['dtype']} (log.jsonl has a row for each session)")
        return None

    def sessions(self):
        """Where each session of the run ran, from its first step: [{step, device, dtype, ...}], as the log says
        (a run begun before the log held sessions, or whose log was moved away: only those since)."""
        return [{"step": r["step"], **r["session"]} for r in self.rows if isinstance(r.get("session"), dict)]

    def pruned(self, step, mask, pruned, total):
        """The routers were pruned at `step` (--prune-at): every checkpoint from now on holds the mask and says so
        (one of this step, saved before the pruning by its evaluation, is saved again), and the log has its row."""
        self.router_mask, self.pruned_at = mask, step
        self.log(step=step, router_pruned=pruned, router_weights=total)

    def save(self, step):
        """A checkpoint of `step` (not again if the one on disk is of that step, and as pruned)."""
        if self.master and (step, self.pruned_at) != (self.saved_step, self.saved_pruned_at):
            with self.signals.hold():  # a signal now waits until the file is whole
                with self.writing("ckpt.pt"):
                    save_checkpoint(self.out_dir, self.model, self.optimizer, step, dataclasses.asdict(self.cfg),
                                    self.router_mask, self.pruned_at)
                self.unfinish()  # (where no row of a step came before it)
                self.saved_step, self.saved_pruned_at = step, self.pruned_at

    def interrupted(self, e, step):
        """A signal (Signals) during training: a checkpoint of the last whole step, then exit 128 + the signal."""
        self.signals.stopping = True  # from here on a signal waits for the checkpoint below
        signum = getattr(e, "signum", signal.SIGINT)
        try:
            self.say(f"\n{signal.Signals(signum).name}: saving a checkpoint at step {step}", flush=True)
        finally:  # saved even where that line cannot be written: `| tee`, which the same Ctrl-C ended (then exit 141)
            self.save(step)
        if self.ending is not None:  # (unfinish: not yet) --resume alone would take the finished run's max_steps
            self.say(f"interrupted: {self.out_dir} still holds the run finished at step {step}; continue with --resume "
                     f"--max-steps={self.cfg.max_steps}")
        else:
            self.say(f"interrupted: checkpoint at step {step} in {self.out_dir}; continue with --resume")
        raise SystemExit(128 + signum)

    def output_closed(self, step):
        """What reads the output closed it (`| head`): as after a signal, a checkpoint of the last whole step (the
        BrokenPipeError then goes on to one_line_errors, which exits 141 without a word)."""
        self.signals.stopping = True  # a signal now waits for the checkpoint
        self.save(step)

    def lost_peer(self, why, step):
        """Another process of the run (torchrun) is gone, and a collective failed (`why`): a checkpoint of the last
        whole step, the weights every process holds, saved and said by rank 0 in one line; exit 1. (The other ranks
        say nothing: rank 0 does, or torchrun names it gone.)"""
        self.signals.stopping = True  # torchrun's SIGTERM, which follows, waits for the checkpoint
        self.save(step)
        if self.master:
            print(f"train.py: error: another process of this run is gone or not answering ({why}): checkpoint at "
                  f"step {step} in {self.out_dir}; continue with --resume", file=sys.stderr)
        raise SystemExit(1)

    def diverged(self, e):
        """A loss that is not finite: stop, keeping the last checkpoint, which was good."""
        if self.master:
            kept = "no checkpoint was written" if self.saved_step is None else \
                f"the checkpoint of step {self.saved_step} stays in {self.out_dir}"
            print(f"train.py: error: {e}; stopping: {kept} (lower --lr?)", file=sys.stderr)
        raise SystemExit(1)

    def finish(self, summary):
        if self.master:
            with self.writing("summary.json"):  # (then --resume evaluates the last step again, and writes it)
                atomic_write(self.out_dir / "summary.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))


def ran_on(session):
    """A session's device kind and dtype, as 'cuda bfloat16': what changes a run's arithmetic (cuda:0 for cuda:1
    does not). `session`: a log row's "session", or one of a summary's "sessions"."""
    return f"{str(session.get('device')).split(':')[0]} {session.get('dtype')}"


def format_eta(seconds):
    return f"{seconds / 3600:.1f}h" if seconds > 5400 else f"{seconds / 60:.1f}m" if seconds > 90 else f"{seconds:.0f}s"


# -----------------------------------------------------------------------------
# Checkpoints: the uncompiled model's state_dict with the run's whole config (a dict), and the
# router mask of a pruned model (None if unpruned)


def save_checkpoint(out_dir, model, optimizer, step, cfg, router_mask=None, pruned_at=None):
    optimizer = optimizer if isinstance(optimizer, dict) else optimizer.state_dict()
    ckpt = dict(model=model.state_dict(), optimizer=optimizer, step=step, config=cfg, router_mask=router_mask,
                pruned_at=pruned_at)
    atomic_write(Path(out_dir) / "ckpt.pt", lambda f: torch.save(ckpt, f))


def folder_state(out_dir):
    """{name: cli.file_state} of what a run or a pruning writes in out_dir (RUN_FILES but the plots, which analyze.py
    draws beside a run it reads, harmlessly, as the run goes on): one written since compares unequal."""
    return {name: file_state(Path(out_dir) / name) for name in RUN_FILES if not name.endswith(".png")}


def refuse_changed(out_dir, seen, meanwhile):
    """Once out_dir is held: a UsageError if another process wrote a file of folder_state(out_dir) there since it
    was `seen` (as this command checked the folder, before it held it) and let go. What it wrote, a finished run
    or a newer checkpoint, is not replaced unasked. `meanwhile`: what this process did, as "while this one pruned"."""
    now = folder_state(out_dir)
    changed = [name for name in now if now[name] != seen[name]]
    if changed:
        raise UsageError(f"{out_dir}: another process wrote {', '.join(changed)} there {meanwhile}: nothing was "
                         "written there; give the command again to see what is there now")


def run_files(out_dir):
    """The files in out_dir that make it hold a run (empty if none). One of their names that is not a file (a
    folder) is a DataError: --overwrite could not delete it, and would stop halfway through the others. So is a
    config.json that is no run's without a checkpoint beside it (a file of the user's by that name), which
    --overwrite would delete. (Beside a checkpoint, it is its run's, damaged: --resume writes it anew.)"""
    found = [Path(out_dir) / name for name in RUN_FILES if (Path(out_dir) / name).exists()]
    for path in found:
        check_a_file(path, " but a run's files go by that name: move it away")
    config, ckpt = Path(out_dir) / "config.json", Path(out_dir) / "ckpt.pt"
    if config in found and ckpt not in found and not a_run_config(config):
        raise DataError(f"{config} is not the config.json of a run (no router, max_steps and out_dir in it), which "
                        "--overwrite would delete: move it away, or give another folder")
    return [path.name for path in found]


def a_run_config(path):
    """Whether the file `path` is a JSON object with what every run's config.json holds."""
    try:
        return {"router", "max_steps", "out_dir"} <= json.loads(Path(path).read_bytes()).keys()
    except (ValueError, AttributeError, RecursionError, OSError):  # (not JSON, not UTF-8, JSON but no object, nested
        # past what Python decodes, unreadable)
        return False


def never_trained(out_dir, found):
    """Whether the run in out_dir (its run_files `found`) stopped before it logged a step: its config.json and a
    log.jsonl of no row but its session's (Run.session, and a --prune-at 0's) alone, as a run out of memory in its
    first step leaves, or one stopped as it began (a signal before its loop). Nothing there to keep: the same command
    runs again, without --overwrite. (A config.json that is not a run's, a file of the user's by that name, is
    something to keep: run_files refuses it.)"""
    log = Path(out_dir) / "log.jsonl"
    if not set(found) <= {"config.json", "log.jsonl"} or log.exists() and log.stat().st_size > 4096:  # (a row or two)
        return False
    try:  # (a run's first session begins at step 0; its log is empty if it stopped before that row)
        rows = [json.loads(line) for line in log.read_bytes().splitlines()] if log.exists() else []
        return all(isinstance(row, dict) and row.get("step") == 0 and
                   row.keys() <= {"step", "session", "router_pruned", "router_weights"} for row in rows)
    except (ValueError, RecursionError):  # (not JSON, not UTF-8, nested past what Python decodes)
        return False


def clear_run(out_dir):
    """--overwrite: the old run's files go, so that nothing in the folder describes it any more."""
    for name in RUN_FILES:
        (Path(out_dir) / name).unlink(missing_ok=True)


def read_checkpoint(out_dir):
    """<out-dir>/ckpt.pt as a dict with what train.py saves in it; a DataError if it is missing, empty,
    unreadable or not train.py's."""
    path = Path(out_dir) / "ckpt.pt"
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # (not "no checkpoint at notes.md/ckpt.pt"; os.path's
        # tests: False under a folder this user may not enter, which the read of the checkpoint names)
        raise DataError(f"{out_dir} is not a folder: give the folder of a run")
    check_a_file(path)  # (torch.load would wait on a FIFO forever)
    if not path.exists():
        raise DataError(f"no checkpoint at {path}")
    if not path.stat().st_size:
        raise DataError(f"{path} is empty (cut short while it was written?)")
    try:
        zipfile.ZipFile(path).close()  # (a plain pickle: torch.load would warn in two lines before it fails)
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:  # not the file's contents: this user may not read it
        raise DataError(f"{path} cannot be read ({e.strerror or type(e).__name__})") from None
    except zipfile.BadZipFile:
        raise DataError(f"{path} is not a checkpoint of train.py (not a whole zip archive, as torch.save writes: cut "
                        "short, or another file)") from None
    except Exception as e:
        raise DataError(f"{path} is not a checkpoint of train.py (torch.load: {type(e).__name__})") from None
    try:  # torch.load checks none of the checksums torch.save writes: a byte changed in a weight would load silently
        with zipfile.ZipFile(path) as archive:
            # (the whole file read again: about 2 GB/s). Saved with torch.serialization.set_crc32_options(False),
            # every checksum is 0: there is nothing to check
            bad = archive.testzip() if any(entry.CRC for entry in archive.infolist()) else None
    except zipfile.BadZipFile as e:  # (torch.load read it all the same)
        raise DataError(f"{path} is damaged ({e})") from None
    except Exception as e:  # a byte changed in an entry's header: a name that is not UTF-8, an unknown compression
        raise DataError(f"{path} is damaged: its archive fails a check ({type(e).__name__}; a byte changed on disk "
                        "or in a copy)") from None
    if bad:
        raise DataError(f"{path} is damaged: its {bad} fails its checksum (a byte changed on disk or in a copy)")
    kinds = dict(model=dict, optimizer=dict, step=int, config=dict)
    wrong = [k for k, kind in kinds.items() if not isinstance(ckpt, dict) or not of_kind(ckpt.get(k), kind)]
    if wrong and isinstance(ckpt, dict) and wrong[0] in ckpt:
        k = wrong[0]
        raise DataError(f"{path} is not a checkpoint of train.py: its {k!r} is of type {type(ckpt[k]).__name__}, "
                        f"not {kinds[k].__name__}")
    if wrong:
        raise DataError(f"{path} is not a checkpoint of train.py: it has no {wrong[0]!r}")
    # (a step past its run's length: hand-edited, 2**70 say, which --resume with a --max-steps past it would take)
    if ckpt["step"] < 0 or of_kind(ckpt["config"].get("max_steps"), int) and ckpt["step"] > ckpt["config"]["max_steps"]:
        raise DataError(f"{path} is not a checkpoint of train.py: its 'step' is {ckpt['step']}"
                        + (f", past its config's max_steps={ckpt['config']['max_steps']}" if ckpt["step"] > 0 else ""))
    pruned_at = ckpt.get("pruned_at")  # (not in a checkpoint saved before it was)
    if pruned_at is not None and not (of_kind(pruned_at, int) and 0 <= pruned_at <= ckpt["step"]):
        raise DataError(f"{path} is not a checkpoint of train.py: its 'pruned_at' is not a step up to its 'step'")
    if not all(isinstance(name, str) and torch.is_tensor(value) for name, value in ckpt["model"].items()):
        raise DataError(f"{path} is not a checkpoint of train.py: its 'model' is not a dict of named tensors")
    for kind, tensors in (("weights", ckpt["model"]), ("moments", moments(ckpt))):
        odd = next((name for name, t in tensors.items()  # (dense, with their data; dtypes: check_tensors)
                    if t.layout != torch.strided or t.is_meta), None)
        if odd:  # (a sparse moment: AdamW's checks, and its step, would fail on it in a traceback)
            raise not_weights(path, odd, tensors[odd], kind)
    # a config of more layers than the weights have (hand-edited: n_layer 100000) is one line here, before any script
    # spends minutes building its model, even on the meta device (the routing grows as n_layer^2)
    n_layer = ckpt["config"].get("n_layer")
    blocks = {name.split(".")[2] for name in ckpt["model"] if name.startswith("transformer.h.")}
    if of_kind(n_layer, int) and n_layer != len(blocks):
        raise DataError(f"{path} holds a model its config does not describe (n_layer {n_layer}, and weights of "
                        f"{len(blocks)} blocks)")
    return ckpt


def moments(ckpt, keys=None):
    """The tensors of a checkpoint's optimiser state (those under `keys` only, if given), by a name for errors
    ("optimiser state's exp_avg of parameter 3")."""
    state = ckpt["optimizer"].get("state")
    return {f"optimiser state's {key} of parameter {i}": t for i, s in state.items() if isinstance(s, dict)
            for key, t in s.items() if torch.is_tensor(t) and (keys is None or key in keys)} \
        if isinstance(state, dict) else {}


def not_weights(path, name, t, kind="weights"):
    return DataError(f"{path} is not a checkpoint of train.py: its {name} is not a tensor of {kind} "
                     f"({str(t.dtype).removeprefix('torch.')}, {str(t.layout).removeprefix('torch.')}, {t.device})")


def check_tensors(ckpt, model, path):
    """What load_state_dict would take without a word, checked against the model it loads into: a weight (one of
    the model's parameters) of another dtype than the model's (an int64 or a float64 one, cast silently) or not
    finite (train.py saves none: it stops at a loss that is not finite, keeping the checkpoint before it). By the
    model, not by the file alone: a method's buffers may be of any dtype (a step count) and hold an inf (a mask)."""
    weights = {name: p.dtype for name, p in model.named_parameters(remove_duplicate=False)}  # (the tied head's too)
    for name, t in ckpt["model"].items():
        if name in weights and t.dtype != weights[name]:  # (train.py saves the weights it trains: float32)
            raise not_weights(path, name, t)
        if name in weights and not t.isfinite().all():
            raise DataError(f"{path} is damaged: its {name} is not finite")
    # AdamW keeps a weight's moments in the weight's dtype, and load_state_dict casts them to it without a word (an
    # int64 exp_avg: its fractions gone), so a moment of another dtype is no state of this run's
    for name, t in moments(ckpt, ("exp_avg", "exp_avg_sq")).items():
        if t.dtype not in set(weights.values()):
            raise not_weights(path, name, t, "moments")
    tied = {}  # one weight under two names (the head and the embedding): the file holds it twice, and one would win
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    for first, *rest in (names for names in tied.values() if len(names) > 1):
        w = ckpt["model"].get(first)  # (a name missing, a shape not the model's: load_state_dict says so)
        other = next((n for n in rest if w is not None and n in ckpt["model"] and
                      ckpt["model"][n].shape == w.shape and not torch.equal(ckpt["model"][n], w)), None)
        if other:
            raise DataError(f"{path} is damaged: its {other} and {first}, one weight in the model, differ")


def load_weights(model, ckpt, where):
    """A checkpoint's weights into `model` (on the meta device: keys, shapes and dtypes checked, nothing copied),
    and its pruning mask (pruning_mask); a DataError naming `where` (the flag and file) if they do not fit."""
    check_tensors(ckpt, model, where)
    try:
        with warnings.catch_warnings():  # (on meta, "copying ... is a no-op": the check is what is wanted)
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
            model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # (its shape is the model's: the file is at fault)
        raise DataError(f"{where} holds weights its config does not describe ({load_problem(e)})") from None
    return pruning_mask(ckpt, model, where)


def pruning_mask(ckpt, model, path):
    """The pruning mask a checkpoint holds for `model`, or None: {name: bool tensor} over exactly the model's
    prunable router weights, as train.py saves it; a DataError naming the file otherwise."""
    mask = ckpt.get("router_mask")
    if mask is None:
        if ckpt.get("pruned_at") is not None:  # (resumed without it, the run would train on unpruned)
            raise DataError(f"{path}: its 'pruned_at' says the routers were pruned at step {ckpt['pruned_at']}, but "
                            "it holds no pruning mask ('router_mask')")
        return None
    try:
        want = {name: router.weights().shape for name, router in prunable_routers(model).items()}
    except UsageError:  # a model with nothing to prune
        want = {}
    if not (isinstance(mask, dict) and set(mask) == set(want) and all(
            torch.is_tensor(keep) and keep.dtype == torch.bool and keep.shape == want[k] for k, keep in mask.items())):
        raise DataError(f"{path}: its pruning mask ('router_mask') does not fit the model's router weights")
    for name, keep in mask.items():  # as top_p_mask and mask_routers leave them
        if not keep.flatten(1).any(1).all():
            raise DataError(f"{path}: its pruning mask ('router_mask') keeps no weight of a target head of {name}, "
                            "where pruning keeps each one's largest")
        if ckpt["model"][name][~keep].any():
            raise DataError(f"{path}: its {name} is not zero where its pruning mask ('router_mask') prunes it")
    return mask or None  # (an empty one, of a model with nothing to prune, prunes nothing)


# what the config sets in each of AdamW's parameter groups (train.py's param_groups), or sets how it steps: the
# checkpoint's groups replace them as it loads, so that a damaged one would train on with other values than the config's
# (or fail at its first step: capturable=True on a CPU, a traceback once the run's folder is rewritten)
HYPERPARAMETERS = ("betas", "eps", "weight_decay", "lr_scale", "amsgrad", "maximize", "capturable")
KERNEL = ("fused", "foreach", "differentiable")  # how AdamW computes its step: this session's choice, for its device


def same(value, built):
    """Whether a hyperparameter as loaded is the one the config built: of its kind, and equal (a NaN is not)."""
    if isinstance(built, tuple):
        return isinstance(value, (list, tuple)) and len(value) == len(built) and all(map(same, value, built))
    return of_kind(value, type(built)) and value == built


def check_optimizer(optimizer, model, where, built, step):
    """What load_state_dict takes without a word but AdamW's steps would fail on (a traceback, once the run's folder
    is rewritten) or train on silently: hyperparameters other than `built`, those of the config's groups (a damaged
    lr_scale, maximize=True); moments missing or of another shape than their weight (parameters in another order),
    not finite, or a second moment below 0; no moments at all past step 0 (a run would go on with fresh ones); a count
    of steps that is not finite or below 0 (a division by 0 in the bias correction), or another than the checkpoint's.
    A DataError naming `where` (the flag and file), and the weight."""
    if step > 0 and not optimizer.state:  # (a weight may lack moments, one that never had a gradient; not all of them)
        raise DataError(f"{where} is damaged: its optimiser state holds no moments, at step {step}")
    names = {p: name for name, p in model.named_parameters()}
    taken = 0  # the most steps any weight's state has taken
    for group, want in zip(optimizer.param_groups, built):
        other = next((k for k, v in want.items() if not same(group.get(k), v)), None)
        if other:
            raise DataError(f"{where} holds an optimiser state its config does not describe ({other} "
                            f"{group.get(other)!r}, not {want[other]!r})")
        for p in group["params"]:
            state = optimizer.state.get(p) or {}  # (none: a weight that has had no step)
            for key in ("exp_avg", "exp_avg_sq") if state else ():
                t = state.get(key)
                if not (torch.is_tensor(t) and t.is_floating_point() and t.shape == p.shape):
                    shape = tuple(t.shape) if torch.is_tensor(t) else "none" if t is None else type(t).__name__
                    raise DataError(f"{where} holds an optimiser state its config does not describe ({key} of "
                                    f"{names.get(p)}: {shape}, not {tuple(p.shape)})")
                negative = key == "exp_avg_sq" and (t < 0).any()  # (a second moment is a mean of squares)
                wrong = "not finite" if not t.isfinite().all() else "negative" if negative else None
                if wrong:
                    raise DataError(f"{where} is damaged: its optimiser state's {key} of {names.get(p)} is {wrong}")
            count = state.get("step", 0)
            count = count.item() if torch.is_tensor(count) and count.numel() == 1 else count
            if not (of_kind(count, float) and 0 <= count < math.inf):
                raise DataError(f"{where} is damaged: its optimiser state's step of {names.get(p)} is {count!r}, "
                                "not a count of steps")
            taken = max(taken, count)
    # every step updates the weights that had a gradient (the embedding's always): the most steps a weight's state
    # has taken is the checkpoint's step. Not so: an optimiser state from another checkpoint, whose bias correction
    # (and moments) AdamW would go on with in silence
    if optimizer.state and taken != step:
        raise DataError(f"{where} is damaged: its optimiser state is of step {taken:g}, the checkpoint of step {step} "
                        "(a state from another checkpoint?)")


def load_problem(e):
    """What a failed load_state_dict says is wrong, in one line: its first line only names the model."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line.startswith("Error(s) in")]
    first = (lines or [type(e).__name__])[0][:200]
    # (a name the model has and the file lacks, or the other way: a fork's method renamed or moved a parameter)
    return first + "; has its method's code changed since?" * first.startswith(("Missing key", "Unexpected key"))


def model_from(ckpt, out_dir):
    """The model of a checkpoint read from out_dir (read_checkpoint), rebuilt from its config, on the CPU. Its config
    is held to its weights before anything is allocated: a hand-edited mlp_hidden of 2**30 is one line, not 16 GB."""
    path = Path(out_dir) / "ckpt.pt"
    try:
        config = GPTConfig.of(ckpt["config"])
        with torch.device("meta"):  # (shapes checked, nothing allocated)
            load_weights(GPT(config), ckpt, path)
        model = GPT(config)
        model.load_state_dict(ckpt["model"])
    except DataError:
        raise  # (load_weights': it says what is wrong)
    except Exception as e:  # a file of the right format with the wrong contents
        raise DataError(f"{path} holds a model its config does not describe "
                        f"({load_problem(e)})") from None
    return model


def of_kind(value, kind):
    """isinstance(value, kind), where a bool is no number and an int is a float too (a preset's epochs=200), if it
    fits one (JSON's 400-digit integer does not)."""
    if kind in (int, float):
        number = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
        return number and (kind is int or isinstance(value, float) or abs(value) <= sys.float_info.max)
    return isinstance(value, kind)


def check_config(config, path, cls):
    """The config saved in the checkpoint `path` (a dict) as a dict of the fields of `cls`, each of its field's
    type, rule and choices, and the whole one that cls accepts, the arithmetic regime of `task` too; the fields an
    older run lacks at their defaults, keys of no field left out. Otherwise a DataError naming the file and the
    field (not a flag: the file is at fault, not the command line)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if "data" in names and "data" not in config:  # every run has saved it: its default would name other data
        raise DataError(f"{path}: its saved config names no data (no 'data')")
    if "n_layer" not in config:  # nor its model's shape: GPTConfig's defaults would be another model
        raise DataError(f"{path}: its saved config names no model (no 'n_layer')")
    values = {**dataclasses.asdict(cls()), **{k: v for k, v in config.items() if k in names}}
    where = ""
    try:
        for f in dataclasses.fields(cls):  # first the types, which the rules take for granted
            kind, value = field_type(f), values[f.name]
            if kind in KINDS and not of_kind(value, kind) and not (value is None and f.default is None):
                raise ValueError(f"{f.name} must be {KINDS[kind]}, got {value!r}")
        cls(**values)  # then the fields' rules and choices, and what they say together: the model's shape, ...
        if values.get("task") is not None:
            where = "task: "
            arithmetic.Task.from_meta(values["task"])
            if "tiers" not in values["task"]:  # (every run's names them; {} would read as the default regime)
                raise ValueError("it names no tiers")
        where = "shards: "  # (data.check_shards compares them)
        if values.get("shards") is not None and not all(split in ("train", "val") and isinstance(found, dict) and all(
                isinstance(name, str) and of_kind(n, int) for name, n in found.items())
                for split, found in values["shards"].items()):
            raise ValueError("not {'train' or 'val': {shard name: tokens}}")
        where = "prunings: "  # (of config, not values: no field of EvalConfig, and analyze.py prune --save adds one)
        if config.get("prunings") is not None and not (isinstance(config["prunings"], list) and all(
                isinstance(p, dict) and set(p) == {"top_p", "step"} and of_kind(p["top_p"], float) and
                0 < p["top_p"] <= 1 and of_kind(p["step"], int) and p["step"] >= 0 for p in config["prunings"])):
            raise ValueError("not [{'top_p': a fraction in (0, 1], 'step': a step}, ...]")
    except (DataError, ValueError, TypeError, KeyError) as e:
        problem = re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m[1].replace("-", "_"), str(e))  # cls, Task: flags
        raise DataError(f"{path}: in its saved config, {where}{problem}") from None
    if "data_dir" in values:  # absolute, as train.py saves it (older runs: relative, or none saved)
        values["data_dir"] = str(Path(values["data_dir"] or f"data/{values['data']}").resolve())
    return values


DATA_DIR = dict(type=a_path, help="where the data is, if not where the run's config says")  # saved_config's data_dir


def saved_config(ckpt, out_dir, data_dir=None):
    """The config saved in a checkpoint read from out_dir, checked (check_config), as attributes (cfg.data,
    cfg.block_size, ...): the fields of EvalConfig. `data_dir`, if given, in place of the saved one."""
    config = {**ckpt["config"], **({"data_dir": data_dir} if data_dir else {})}  # (made absolute there, as saved)
    return SimpleNamespace(**check_config(config, Path(out_dir) / "ckpt.pt", EvalConfig))


def read_summary(run_dir):
    """A finished run's summary.json; a DataError if it is missing or damaged."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        if (path.parent / "prune.json").exists() and not (path.parent / "log.jsonl").exists():  # (not trained on)
            raise DataError(f"no {path}: a model saved by analyze.py prune --save, not a run (its prune.json has the "
                            "scores of the pruning; sample.py --eval scores it)")
        raise DataError(f"no {path} (is the run finished?)")
    return read_record(path)


def read_record(path, config=False):
    """A run's summary.json, or with `config` its config.json, the fields that tables group runs by (seed_group)
    checked: a DataError naming the file and the field otherwise."""
    # NOTE tables.config_of tells a config from a summary by its out_dir: one without it would read as a summary that
    # names no setting, and curves would average it with runs of another depth or lr as seeds of one
    record = read_json(path, keys=("router", "out_dir") if config else ("router",))
    for key, kind in dict(router=str, preset=str, seed=int, steps=int, max_steps=int, task=dict, config=dict).items():
        null = record.get(key) is None and key not in ("router", "config")  # (a router and a config are never null)
        if key in record and not null and (not of_kind(record[key], kind) or  # (a seed, a count of steps: >= 0 and
                                           kind is int and not 0 <= record[key] < 2**63):  # 64-bit, as read_log's)
            raise DataError(f"{path} is not what this repo writes: its {key!r} is {shown(record[key], 40)}")
    for key, value in record.items():  # the metrics tables average: train.py stops before one is not finite
        fault = metric_fault(key, value)
        if fault:
            raise DataError(f"{path} is not what this repo writes: its {key!r} is {value!r}, {fault}")
    try:
        seed_group(record)
    except (DataError, ValueError, TypeError, KeyError) as e:
        raise DataError(f"{path} is not what this repo writes: its 'task' ({e})") from None
    gap = tier_gap(record, record.get("task"), finished=not config)
    if gap:
        raise DataError(f"{path} is not what this repo writes: {gap}")
    made = record.get("config", {})  # a summary says what its config says (a table row named by one, run as the other)
    if differ := other_run(record, made):
        raise DataError(f"{path} is not what this repo writes: its {differ!r} is {record[differ]!r}, its "
                        f"config's {made[differ]!r}")
    return record


def other_run(record, config):
    """The first of the fields that name a run (router, seed, preset) in which a run's record and a config, both
    holding it, differ: None where they are of one run."""
    return next((k for k in ("router", "seed", "preset") if k in record and k in config and record[k] != config[k]),
                None)


def agree(run_dir, config, summary):
    """A DataError where a run folder's config.json and summary.json are of two runs (router, seed or preset): one
    copied in from another run, which would be tabled, drawn or scored as this folder's."""
    if differ := other_run(config, summary.get("config", {})):
        raise DataError(f"{Path(run_dir) / 'config.json'} is not of the run that its summary.json describes: its "
                        f"{differ!r} is {config[differ]!r}, the summary's {summary['config'][differ]!r}")


def summary_if_whole(run_dir):
    """A run's summary.json, {} where there is none or it is damaged: what a reader that does not need it compares the
    run's other files with (nothing, then)."""
    try:
        return read_summary(run_dir) if (Path(run_dir) / "summary.json").exists() else {}
    except DataError:
        return {}


def tier_gap(metrics, task, finished=False):
    """The accuracy of one tier that a run's metrics (its summary, an evaluation's log row) lack where they hold
    those of its task's other tiers on that split, said ("no 'acc_6', where ...": beside acc_4 and acc_5); None if
    none. Tables and curves compare the tiers that all their runs hold: one missing from one run leaves every run's
    out. A `finished` run's summary holds the test split's of every tier (else a table shows it as a language run)."""
    tiers = arithmetic.Task.from_meta(task).tiers if task else ()
    for split in ("acc", "val_acc"):
        missing = [f"{split}_{n}" for n in tiers if f"{split}_{n}" not in metrics]
        if missing and len(missing) < len(tiers):  # (none: a validation split that data made before it lacks)
            return f"no {missing[0]!r}, where its task's other tiers have one"
        if missing and finished and split == "acc":
            return f"no {missing[0]!r}, where its task has tiers {','.join(map(str, tiers))}: a finished run has the " \
                   "test split's accuracy of each"
    return None


def metric_fault(key, value, diverged=False):
    """What is wrong with `value` as the metric `key` of a run, or None: an accuracy (acc, acc_4, val_acc_4) is a
    share from 0 to 1, a loss or a perplexity a number from 0 up, with `diverged` also NaN or inf (the log's last
    evaluation of a run that diverged: train.py stops after it). None for a key that is no metric."""
    if is_accuracy(key):
        return None if of_kind(value, float) and 0 <= value <= 1 else "not a share from 0 to 1"
    if key in ("val_loss", "val_ppl"):
        ok = of_kind(value, float) and (0 <= value < math.inf or diverged and not value < 0)  # (NaN < 0 is False)
        return None if ok else "not a number from 0 up"
    return None


# what the runs of one setting may differ in: their seed, the run they start from (--init-from: a fine-tune of
# each pretrained seed), how their length was given (in epochs or in steps: max_steps and warmup_steps hold it
# either way), and where and how each one ran (the same batch in other micro-batches, evaluated more or less often)
NOT_THE_SETTING = {"seed", "init_from", "epochs", "warmup_epochs", "out_dir", "data_dir", "device", "dtype", "compile",
                   "stop_at", "log_interval", "micro_batch_size", "eval_interval"}


def setting(config, aside=frozenset()):
    """The part of a run's config that is its setting (tables.by_setting): all but NOT_THE_SETTING and `aside`, and
    whether it starts from a run (which run is not the setting: each seed of a fine-tune starts from its own; whether
    is)."""
    out = {k: v for k, v in config.items() if k not in NOT_THE_SETTING | aside}
    if "init_from" in config and "init_from" not in aside:
        out["init_from"] = bool(config["init_from"])
    return out


def seed_group(run):
    """(regime, router, preset, steps): what the runs averaged as seeds of one setting share (tables.by_setting
    groups runs by it, and sets apart those that differ in more). `run`: a summary.json, or a config.json (its
    max_steps)."""
    task = run.get("task")
    regime = arithmetic.Task.from_meta(task).label if task else ""  # e.g. 'int-steps, tiers 4,5,6 operands'
    return regime, run["router"], run.get("preset"), run.get("steps", run.get("max_steps"))


def load_checkpoint(out_dir, device, data_dir=None):
    """A run's config (saved_config) and its model, rebuilt from that config, in eval mode on `device`."""
    ckpt = read_checkpoint(out_dir)
    cfg, model = saved_config(ckpt, out_dir, data_dir), model_from(ckpt, out_dir)  # (each checks what it reads)
    check_of_folder(ckpt, out_dir)
    return cfg, model.to(device).eval()


def check_of_folder(ckpt, out_dir):
    """A DataError where the checkpoint read from out_dir is of another model or seed than the folder's config.json
    names, or of a step before the end of the finished run that its summary.json describes, or a summary.json of
    another run than config.json's: a folder of two runs (a file copied in by hand, or restored from a backup), which
    would be scored, drawn, pruned or started from as the one it names. Nothing to compare with where those files are
    missing or damaged: the checkpoint says what it is."""
    written = Path(out_dir) / "config.json"
    try:
        run = read_json(written) if written.exists() else {}
    except DataError:
        run = {}
    summary = summary_if_whole(out_dir)
    agree(out_dir, run, summary)
    ended = summary.get("steps")
    other = [f"{k} {ckpt['config'][k]!r} (config.json: {run[k]!r})"
             for k in [*(f.name for f in dataclasses.fields(GPTConfig)), "seed"]
             if k in run and k in ckpt["config"] and run[k] != ckpt["config"][k]]
    if other:
        raise DataError(f"{Path(out_dir) / 'ckpt.pt'} is not of the run that {written} describes: it has "
                        f"{', '.join(other)}; move the one that is not this run's away")
    if ended is not None and ckpt["step"] < ended:  # (a finished run's last checkpoint is of its last step)
        raise DataError(f"{Path(out_dir) / 'ckpt.pt'} is of step {ckpt['step']}, before the end of the finished run "
                        f"there (step {ended}, its summary.json), and would be taken for that run; copy it into a "
                        "folder of its own to use it as it is")


def check_data_dir(cfg):
    """A UsageError where the data's folder is a file (its meta.json, say) or a FIFO: no data there, nor to be made."""
    if Path(cfg.data_dir).exists() and not Path(cfg.data_dir).is_dir():
        raise UsageError(f"{cfg.data_dir} is not a folder: give --data-dir the folder that holds the data")


def load_data(cfg, with_train=True, new_model=False):
    """The data set a run's config names (a training config, or a saved one), its training split too
    unless with_train is False. It must fit the model: its samples the block, its tokens the vocabulary. A new
    run's flags set them (training_data says which to give); a saved model's are fixed, and the data is at fault."""
    check_data_dir(cfg)
    # NOTE else a run would read what is there so far: some shards, or a folder's files of two versions
    refuse_writing(cfg.data_dir)
    data = DATASETS[cfg.data](cfg, with_train)
    # NOTE a sample's last token is only learned, so one past the block fits; but not where generation writes it
    # (answers with no end token after them), which would train on it and never score it
    if data.longest and data.longest > cfg.block_size + (not data.last_generated):
        why = " (its last token, the answer, is generated within the block)" if data.last_generated else ""
        if new_model:
            raise UsageError(f"a sample of {data.longest} tokens does not fit --block-size={cfg.block_size}{why}")
        raise DataError(f"{cfg.data_dir} holds a sample of {data.longest} tokens, longer than the model's "
                        f"block_size={cfg.block_size}{why}")
    if data.vocab_size > cfg.vocab_size and not new_model:
        raise DataError(f"{cfg.data_dir} holds token ids up to {data.vocab_size - 1}, past the model's "
                        f"vocab_size={cfg.vocab_size}")
    return data


def training_data(cfg, run, generates=None, home=None, dry_run=False):
    """load_data() for a training run, checked against its model. `generates`: the arithmetic regime that the
    run's preset makes in its own folder `home` when that has none; another folder without data is an error
    that gives the command making it. A vocabulary or a sample that does not fit the model is a UsageError.
    A dry run makes nothing: data not there yet is None, for the run itself to make (checked as far as it can be
    without writing) or to ask for."""
    folder = Path(cfg.data_dir)
    makes = generates and cfg.data == "arithmetic" and cfg.data_dir == home  # (the preset's own task, here)
    if not makes:  # (the preset's preparation refuses a file there itself: arithmetic.check_writable)
        check_data_dir(cfg)  # before "no data there: make it with prepare_data.py", which would refuse a file too
    # (a task's meta.json is written last; another data set's folder: any file in it)
    there = (folder / "meta.json").exists() if cfg.data == "arithmetic" else folder.is_dir() and any(folder.iterdir())
    if makes and not there:  # what the preparation of the folder would refuse: refused before a word of it, dry or not
        arithmetic.check_preparable(folder, generates)
    # what the run refuses of a folder without its task: one cut short as it was made (load() says it, with the command
    # that finishes it), or a folder of one's own (or a mistyped one) that an offline preset does not make
    unmade = cfg.data == "arithmetic" and not makes and not there
    finish = unmade and arithmetic.finishing(cfg.data_dir)
    missing = unmade and generates and run.resume is None and not finish
    make = missing and arithmetic.command(dataclasses.asdict(generates), cfg.data_dir)  # (the command that makes it)
    if dry_run:
        held = being_written(folder)
        if not there or held:
            # a note, not an error: the data may be made by then (as grid.py makes its regimes after its dry runs)
            if (missing or finish) and not held and run.master:
                print(f"note: {cfg.data_dir} was cut short as its data was made: the run needs `{finish}` first"
                      if finish else f"note: no arithmetic data in {cfg.data_dir}: the run needs it made first, by "
                      f"`{make}`", file=sys.stderr)
            return None
    if makes:
        if not there and run.master:  # (under torchrun, rank 0 alone; the others wait at the barrier)
            print(f"preparing the arithmetic task in {home} (once, offline)")
            arithmetic.prepare(home, generates)  # (over what an interrupted one left, if any)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # every process, whether or not it found the data: none waits alone
    elif missing:  # (a finishing one: load() says it)
        raise DataError(f"no arithmetic data in {cfg.data_dir}: run `{make}`")
    data = load_data(cfg, new_model=run.resume is None)
    if data.vocab_size > cfg.vocab_size:
        whose = f" (the model of --init-from={cfg.init_from})" if cfg.init_from else ""
        # a task's vocabulary is known; token shards show theirs only in part, and hold GPT-2's 50257 tokens here
        task = isinstance(data, TaskRows)
        fits = max(-(-data.vocab_size // 64) * 64, 0 if task else GPTConfig.vocab_size)  # padded to a multiple of 64
        fix = f"give --vocab-size={fits}" if not cfg.init_from else \
            f"the model's is fixed: train a new run with --vocab-size={fits}"  # (a resumed one's: load_data says)
        raise UsageError(f"--vocab-size={cfg.vocab_size}{whose} is smaller than the {cfg.data} vocabulary "
                         f"({'' if task else 'at least '}{data.vocab_size}): {fix}")
    return data
