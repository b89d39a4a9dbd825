"""
The arithmetic task's regimes, LIMe against the baseline over several seeds, in one command.

    python grid.py                                         # {int, mod 11} x {steps, answer}, lime and none, 3 seeds
    python grid.py --targets answer --epochs 4 -- --batch-size 32   # after '--': flags for every train.py run

For each regime it generates one data folder (`<data-root>/<regime>`, the same expressions for every
seed and router), then trains `train.py --preset=arith` once per router and seed, in parallel
processes (`--jobs`), each into `<out-dir>/<regime>/<router>-seed<N>` with its output in train.out
there. Finally it prints accuracy per tier, mean ± sd over seeds, on the validation split (what a
setting is chosen on) and on the test split (what is reported); `python analyze.py table
<out-dir>/*/*` prints them again. Run the same command again to go on: a finished run is kept, an
interrupted one resumes from its checkpoint. A grid holds its --out-dir while it runs: a second one
there at once is refused. A finished run is kept, never redone: other --epochs, data or flags after
'--' over the runs kept or resumed are an error, so give another --out-dir for another setting.
Everything is checked before anything is written: its flags, the routers, the flags after '--' (by
train.py --dry-run; they may not set what the grid sets run by run: --router, --seed, --epochs, the
folders; nor --max-steps, --stop-at, --dry-run, --resume or --overwrite), and what the folders hold
already (each unfinished run by train.py --resume --dry-run). What only a regime's data can tell (a
--block-size after '--' that its longest sample does not fit, say) is checked where its data is there
before anything is written, and for a regime made now once it is made, before any run starts.
"""

# cli first: from then on a Ctrl-C is one line, even while torch (seconds to load) is still loading
from cli import (DataError, Parser, UsageError, a_path, check_a_file, folder_problem, holding, one_line_errors,
                 read_json, refuse_held, refuse_writing, shown)

import ctypes
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import arithmetic
from methods import distinct, router_forms
from runs import RUN_FILES, EvalConfig, Signals, check_config, of_kind, read_log, read_summary, run_files
from tables import by_setting, differences, results_table

# what a grid's --out-dir that another process holds may be, and what to do
GRID_THERE = "a grid.py still running there? wait for it to end, or give another --out-dir"

LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None  # (for prctl)


def regimes(args):
    """(folder name, arithmetic.Task) for every field and target asked for."""
    tiers = tuple(int(t) for t in args.tiers.split(","))
    out = []
    for field in dict.fromkeys(args.fields.split(",")):  # in order, each once
        for target in dict.fromkeys(args.targets.split(",")):
            modulus = args.modulus if field == "mod" else arithmetic.Task.modulus  # (int data: the default)
            task = arithmetic.Task(field=field, modulus=modulus, count=args.count, tiers=tiers,
                                   target=target).check_fits()  # (new data: its samples must fit a block)
            out.append((task.folder, task))  # e.g. int-steps-operators-4-5-6
    return out


def data_of(task, args):
    """The grid's data of a regime, as arithmetic.regime() reads a meta.json or a run's config: seed 0 and its sizes."""
    return arithmetic.regime_of(task, 0, args.train_size, args.test_size)


def prepare(data_dir, task, args, generate=True):
    """A regime's data folder: one that holds exactly this regime is reused, any other refused; with
    `generate`, one that holds nothing yet is generated; without, the lines of one reused are checked too."""
    refuse_writing(data_dir)  # (else a run's dry run would find no data there yet, and check none)
    want = data_of(task, args)
    # (without meta.json, which comes last, a folder is one a grid was cut short while generating: made again; or
    # files of another's: kept)
    theirs = arithmetic.not_ours(data_dir)
    if theirs:
        raise UsageError(f"{theirs}: move them away, or give another --data-root")
    have = arithmetic.holds(data_dir) if (data_dir / "meta.json").exists() else None
    if have is not None and have != want:
        raise UsageError(f"{data_dir} holds other arithmetic data, {arithmetic.describe(have)}, not the grid's "
                         f"{arithmetic.describe(want)}: give another --data-root")
    change = have and not generate and arithmetic.edited(data_dir, task, 0, args.train_size, args.test_size)
    if change:
        raise DataError(f"{change}: move it away to have it made again")
    if have is None and generate:
        print(f"grid: generating {data_dir}")
        arithmetic.prepare(data_dir, task, 0, args.train_size, args.test_size)


def model_fit(data_dir):
    """(block size, vocabulary size): the smallest multiples of 8 that hold the longest sample and the
    regime's vocabulary. Padding costs as much as tokens, and an output row per unused token too."""
    vocab, splits, _, _ = arithmetic.load(data_dir)
    longest = max(len(line.split()) + 1 for lines in splits.values() for line in lines)
    return -(-longest // 8) * 8, -(-len(vocab.itos) // 8) * 8


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = Parser(prog="grid.py", description=__doc__)
    words = arithmetic.CHOICES
    p.add_argument("--fields", default=",".join(words["field"]), help=f"comma-separated: {', '.join(words['field'])}")
    p.add_argument("--targets", default=",".join(words["target"]),
                   help=f"comma-separated: {', '.join(words['target'])}")
    p.add_argument("--count", default=arithmetic.DEFAULTS["count"], choices=words["count"],
                   help="what a tier counts")
    p.add_argument("--tiers", default=",".join(map(str, arithmetic.DEFAULTS["tiers"])),
                   help="the tiers, comma-separated; one model learns all of them (e.g. 4,5,6)")
    p.add_argument("--modulus", type=int, default=11, help="the prime of the mod field")
    p.add_argument("--train-size", type=int, default=20_000, help="training samples per tier")
    p.add_argument("--test-size", type=int, default=500, help="samples per tier in the test and validation splits")
    p.add_argument("--routers", default="lime,none", help=f"comma-separated router modes to compare: {router_forms()}")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated train.py seeds (weights and data order)")
    p.add_argument("--epochs", type=float, default=2.0, help="training epochs of every run")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="runs at a time (default: one per CPU core), each on its share of the cores (or "
                        "OMP_NUM_THREADS threads, where set)")
    p.add_argument("--out-dir", type=a_path, default="out/grid", help="where the runs go")
    p.add_argument("--data-root", type=a_path, default="data/grid", help="where each regime's data folder goes")
    with one_line_errors("grid.py"):
        # everything is checked before anything is written: the flags, the routers, the flags for train.py,
        # the folders, and what the folders hold already
        args = p.parse_args(argv)
        if args.jobs < 1 or not 0 < args.epochs < math.inf or args.train_size < 1 or args.test_size < 1:  # (nan too)
            raise UsageError("--jobs, --epochs, --train-size and --test-size must be positive (--epochs finite)")
        try:
            seeds = list(dict.fromkeys(int(s) for s in args.seeds.split(",")))
            grid = regimes(args)
        except ValueError as e:
            raise UsageError(f"--seeds and --tiers take numbers separated by commas ({e})") from None
        except DataError as e:  # a regime's (arithmetic.Task's) words: its --field is a value of our --fields
            raise UsageError(re.sub(r"--(field|target)\b", r"--\1s", str(e))) from None
        if "modulus" in p.given(argv) and "mod" not in {task.field for _, task in grid}:
            raise UsageError(f"--modulus is for the mod field, and --fields={args.fields} has none")
        if min(seeds) < 0:
            raise UsageError(f"--seeds must be >= 0, got {min(seeds)}")
        if max(seeds) > 2**63 - 1:  # (as train.py's --seed: torch's generator takes no more)
            raise UsageError(f"--seeds must be at most 2**63 - 1, got {max(seeds)}")
        try:
            routers = distinct(args.routers.split(","))  # (lime,lime or hc,hc-4: one method, run once)
        except ValueError as e:
            raise UsageError(f"--routers: {e}") from None
        whole = "the grid runs every run to its end (Ctrl-C stops them all; the same command goes on)"
        each = "the grid decides it run by run (a finished run is kept, an unfinished one resumes, one that never " \
            "saved starts over)"
        ours = {"--max-steps": "the grid sets every run's length, with --epochs",
                "--data": "the grid trains on the arithmetic regimes it makes", "--stop-at": whole, "--dry-run": whole,
                "--resume": each, "--overwrite": each}
        for flag in named(extra, ours):
            raise UsageError(f"the flags for train.py: {flag}: {ours[flag]}")
        for flag in ("out_dir", "data_root"):
            problem = folder_problem(getattr(args, flag))
            if problem:
                raise UsageError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: {problem}")
        # before the runs' checks: another grid's runs, in training there, read as train.py's folders in use
        refuse_held(args.out_dir, GRID_THERE)
        folders = {name: Path(args.data_root) / name for name, _ in grid}  # each regime's data
        for name, task in grid:
            prepare(folders[name], task, args, generate=False)
        runs = [(name, router, seed, folders[name]) for name, _ in grid for router in routers for seed in seeds]
        for name, router, seed, _ in runs:  # (a run's output goes to a file of that name, opened as it starts)
            log = run_dir(args, name, router, seed) / "train.out"
            if folder_problem(log.parent):  # (a file where the run's folder goes, say)
                raise DataError(f"{folder_problem(log.parent)}, where a run of the grid goes: move it away")
            check_a_file(log, " but a run's output goes by that name: move it away")
        # each regime's data that is there already: the block and vocabulary its runs get (model_fit), and what
        # train.py's dry run checks the flags after '--' against now (a sample past a --block-size given there, say)
        fits = {name: model_fit(folder) for name, folder in folders.items() if (folder / "meta.json").exists()}

        def check_run(name, router, seed):  # train.py's dry run of a run as the grid starts it: its config
            return check_flags(train_command(router, seed, folders[name], run_dir(args, name, router, seed), args,
                                             extra, fits.get(name, ())), name if name in fits else "")

        name, seed = grid[0][0], seeds[0]
        configs = {}
        for router in routers:  # the flags every run gets, with each router: a process each, seconds
            config = configs[router] = check_run(name, router, seed)
            ours = dict(preset="arith", router=router, seed=seed, data_dir=str(folders[name].resolve()),
                        out_dir=str(run_dir(args, name, router, seed)), epochs=args.epochs)
            # (a flag after '--' may not change what the grid sets per run)
            taken = [f"--{k.replace('_', '-')}" for k, v in ours.items() if config.get(k) != v]
            if taken:
                raise UsageError(f"the flags for train.py: {', '.join(taken)} is the grid's to set, run by run")
        for other in [n for n in fits if n != name]:  # every other regime's data there, with one router
            check_run(other, routers[0], seed)
        tasks = dict(grid)
        for name, router, seed, data_dir in runs:
            out = run_dir(args, name, router, seed)
            check_kept(out, router, seed, tasks[name], configs[router], args,
                       train_command(router, seed, data_dir, out, args, extra))
        made = [Path(f) for f in (args.out_dir, args.data_root) if not Path(f).exists()]
        # held from here: a second grid there at once (it would start the same runs again, and the runs of both
        # would write one train.out) is refused before it writes
        with holding(args.out_dir, GRID_THERE):
            try:
                for name, task in grid:
                    prepare(folders[name], task, args)
                    if name not in fits:  # made now: its data against the flags, before any run starts
                        fits[name] = model_fit(folders[name])  # (reads the whole folder: once per regime)
                        check_run(name, routers[0], seeds[0])
                return run_grid([(*run, *fits[run[0]]) for run in runs], args, extra)
            except BaseException:  # (too few expressions for a regime's sizes, found as it is generated, say)
                for folder in made:  # made for nothing: gone again, as arithmetic.prepare's own data folder
                    with suppress(OSError):  # (rmdir takes an empty folder only: another's data stays)
                        folder.rmdir()
                raise


def run_dir(args, name, router, seed):
    """The folder of a run of the grid: <out-dir>/<regime>/<router>-seed<N>."""
    return Path(args.out_dir) / name / f"{router}-seed{seed}"


def named(argv, flags):
    """The flags among `flags` that argv gives, as train.py's parser reads them: abbreviated too (--dry)."""
    names = [token.split("=")[0] for token in argv if token.startswith("--")]
    return [f for f in flags if any(len(name) >= 4 and f.startswith(name) for name in names)]


def check_kept(out, router, seed, task, config, args, command):
    """A run the grid keeps (finished) or goes on with (its checkpoint: --resume) has to be readable, this run, of
    this budget, data and flags (`config`: what train.py makes of them; `command`: the run's): else a line now, not a
    run refused (or a table of runs of another setting) later. A run that has neither is started over (going_on),
    unless its log holds an evaluation."""
    finished = (out / "summary.json").exists()
    if not finished and not (out / "ckpt.pt").exists() and evaluated(out):  # (as train.py, run by hand, refuses it)
        raise UsageError(f"{out} holds a run that evaluated (its log.jsonl) but no checkpoint to go on from: move it "
                         "away for the grid to train it anew, or give another --out-dir")
    if not finished and not ((out / "ckpt.pt").exists() and (out / "config.json").exists()):
        return
    if finished:
        summary = read_summary(out)
        if (summary["router"], summary.get("seed")) != (router, seed):
            raise DataError(f"{out / 'summary.json'} is of router {summary['router']}, seed {summary.get('seed')}, "
                            "not of the run its folder is for: move it away")
    what, kept_as = ("a finished run", "a finished run is kept") if finished else \
        ("an unfinished run", "a run goes on from its checkpoint")
    kept = read_json(out / "config.json", keys=("epochs",))
    # its model, data and task as sample.py reads them (a task of no tiers: not the default regime): the file's fault
    check_config(kept, out / "config.json", EvalConfig)
    epochs = kept["epochs"]
    if not (of_kind(epochs, float) and 0 < epochs < math.inf):  # (NaN: not a budget of another size, but none)
        raise DataError(f"{out / 'config.json'} is not what this repo writes: its 'epochs' is {epochs!r}")
    if epochs != args.epochs:
        raise UsageError(f"{out} is {what} of --epochs {epochs:g}, not {args.epochs:g}: {kept_as}, so give another "
                         "--out-dir for another budget")
    # trained on the grid's data: another --train-size (its regime's folder name is the same) is other data
    try:
        trained_on = arithmetic.regime(kept["task"]) if kept.get("task") is not None else None  # (older: unrecorded)
    except (DataError, KeyError, TypeError):  # (a regime's every field: check_config reads the tiers alone)
        raise DataError(f"{out / 'config.json'} is not what this repo writes: its 'task' is {kept['task']!r}") from None
    want = data_of(task, args)
    if trained_on and trained_on != want:
        raise UsageError(f"{out} is {what} on {arithmetic.describe(trained_on)}, not the grid's "
                         f"{arithmetic.describe(want)}: {kept_as}, so give another --out-dir for other data")
    # and of these flags: aside what the grid fits to each regime's data (unless the flags after -- give it, for every
    # run), and the steps of an epoch (known once the data is), but the warm-up epochs (which tables.setting leaves out)
    fitted = {"max_steps", "task", "block_size", "vocab_size"} - {f[2:].replace("-", "_") for f in
                                                                  named(command, ["--block-size", "--vocab-size"])}
    other = differences(kept, config, fitted | ({"warmup_steps"} if config["warmup_epochs"] else set()))
    kept = {"warmup_epochs": 0.0, **kept}  # (an older run's config has none: it had no warm-up in epochs)
    other += ["warmup_epochs"] * (kept["warmup_epochs"] != config["warmup_epochs"])
    for k in other:  # a value of another kind than the flag's (a null for a number) is the file's fault, not the flags'
        # (a null for a dict or list is none given: a run from scratch has init_source null, as with its prunings)
        if k in kept and config[k] is not None and not of_kind(kept[k], type(config[k])) and \
                (kept[k] is not None or not isinstance(config[k], (dict, list))):
            raise DataError(f"{out / 'config.json'} is not what this repo writes: its {k!r} is {kept[k]!r}")
    if other:
        raise UsageError(f"{out} is {what} of {', '.join(f'{k} {shown(kept.get(k))}' for k in other)}, not "
                         f"{', '.join(shown(config[k]) for k in other)}: {kept_as}, so give another --out-dir for "
                         "other flags")
    if not finished:  # and what only train.py --resume says (a flag a session may not change: --eval-interval, say)
        check_flags(command, resume=True)


def train_command(router, seed, data_dir, out, args, extra, fit=()):
    """The command line of one run: train.py's arith preset, this regime's data and size, the flags after --."""
    # (a model that --init-from starts from keeps its own vocabulary: one fitted to the regime would be refused)
    block_vocab = [f"--block-size={fit[0]}", *[f"--vocab-size={fit[1]}"] * (not named(extra, ["--init-from"]))] \
        if fit else []
    return [sys.executable, str(Path(__file__).with_name("train.py")), "--preset=arith", f"--router={router}",
            f"--seed={seed}", f"--data-dir={data_dir}", f"--out-dir={out}", f"--epochs={args.epochs}", *block_vocab,
            f"--eval-samples={args.test_size}", *extra]


def alone(**settings):
    """The environment of one run: this one, without torchrun's variables (under a launcher that sets RANK,
    each run would otherwise take itself for one process of a distributed run), plus `settings`."""
    distributed = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in distributed}, **settings}


def check_flags(cmd, regime="", resume=False):
    """train.py's own check of a run's flags (--dry-run: nothing written), before the grid writes anything; with
    `resume`, as the run goes on from its checkpoint. Its one line, if any, becomes grid.py's, with its exit code
    (and the `regime` whose data it read, if any); otherwise the run's config (a dict)."""
    done = subprocess.run([*cmd, "--resume" if resume else "--overwrite", "--dry-run"], capture_output=True,
                          text=True, env=alone())
    if done.returncode:
        line = (done.stderr.strip().splitlines() or ["(no output)"])[-1].removeprefix("train.py: error: ")
        on = f" on {regime}" if regime else ""
        raise (DataError if done.returncode == 1 else UsageError)(f"train.py, as the grid runs it{on}: {line}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("config: "))[8:])


def going_on(out):
    """The flag a run of the grid gets as it is launched, decided then, not as the grid started (a train.py run by
    hand there meanwhile may have saved a checkpoint, or finished it: then an --overwrite would delete it)."""
    if (out / "ckpt.pt").exists():
        return ["--resume"]
    # NOTE a run that evaluated had a checkpoint (train.py saves one with each evaluation), removed since (to save disk,
    # say): its log holds its curves, not the grid's to delete. check_kept refused it; one that became so meanwhile
    # is left to train.py's own line
    if evaluated(out):
        return []
    # started, but killed before its first checkpoint: nothing to keep (a name that is not a file: train.py's line)
    return ["--overwrite"] if any((out / name).exists() for name in RUN_FILES) else []


def evaluated(out):
    """Whether the log of the run in `out` holds an evaluation, or cannot be read (then not the grid's to delete)."""
    try:
        return (out / "log.jsonl").exists() and any("val_loss" in row for row in read_log(out / "log.jsonl")[0])
    except DataError:
        return True


def launch(cmd, log, env):
    """One run's process, its output into `log`. On Linux it ends with the grid however the grid ends: killed where it
    cannot pass a signal on (kill -9, the out-of-memory killer), the kernel sends each run SIGTERM (PR_SET_PDEATHSIG),
    so it saves a checkpoint and stops, and the same command run again resumes it, not finds it still training."""
    grid = os.getpid()

    def with_the_grid():  # in the new process, before train.py starts
        LIBC.prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != grid:  # the grid died before this line: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=with_the_grid if LIBC else None)


def run_grid(runs, args, extra):
    # a run's share of the cores, for its math and (on CUDA, where train.py compiles) for torch.compile's workers,
    # which would otherwise start one per core in every run; or the user's own OMP_NUM_THREADS, as train.py alone
    # would take it
    own = os.environ.get("OMP_NUM_THREADS", "")
    threads = own if own.isdigit() and int(own) > 0 else str(max(1, (os.cpu_count() or 1) // args.jobs))
    env = alone(OMP_NUM_THREADS=threads, TORCHINDUCTOR_COMPILE_THREADS=threads, PYTHONUNBUFFERED="1")
    todo, running, failed, started = [], {}, [], time.time()
    dirs = []
    for name, router, seed, data_dir, block, vocab in runs:
        out = run_dir(args, name, router, seed)
        dirs.append(out)
        if (out / "summary.json").exists():
            continue  # finished: kept, never redone
        run_files(out)  # (a folder where a run's file goes: one line now, not a failed run later)
        todo.append((f"{name} {router} seed {seed}", out, train_command(router, seed, data_dir, out, args, extra,
                                                                         (block, vocab))))
    print(f"grid: {len(runs)} runs, {len(runs) - len(todo)} finished before; {len(todo)} to go, {args.jobs} at a "
          f"time on {threads} thread(s) each; each run's output in <run>/train.out under {args.out_dir}")
    done = len(runs) - len(todo)
    # Ctrl-C, SIGTERM (a scheduler, `kill`) or SIGHUP (the terminal closed): passed on to the runs, which save a
    # checkpoint, then waited for, so that no run goes on training alone, where the same command run again would
    # start it a second time
    with Signals() as signals:
        try:
            while todo or running:
                while todo and len(running) < args.jobs:
                    label, out, cmd = todo.pop(0)
                    if (out / "summary.json").exists():  # a train.py run by hand there, while the grid waited
                        done += 1
                        print(f"[{done}/{len(runs)}] {label}: finished by another process meanwhile: kept", flush=True)
                        continue
                    out.mkdir(parents=True, exist_ok=True)
                    cmd = [*cmd, *going_on(out)]
                    log = open(out / "train.out", "a")
                    with signals.hold():  # a signal waits until the new run is among those it is passed on to
                        running[launch(cmd, log, env)] = (label, out, log, time.time())
                time.sleep(0.2)
                for proc in [q for q in running if q.poll() is not None]:
                    label, out, log, t = running.pop(proc)
                    log.close()
                    done += 1
                    if proc.returncode == 0 and (out / "summary.json").exists():
                        s = read_summary(out)
                        accs = ", ".join(f"{split} " + " / ".join(f"{100 * v:.1f}" for k, v in s.items()
                                                                    if re.fullmatch(prefix + r"acc_\d+", k)) + "%"
                                         for split, prefix in (("test", ""), ("val", "val_")))
                        print(f"[{done}/{len(runs)}] {label}: {accs} ({(time.time() - t) / 60:.1f} min)", flush=True)
                    else:
                        with open(out / "train.out", "rb") as f:  # its end only (a run's output of many sessions)
                            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                            lines = f.read().decode(errors="replace").strip().splitlines() or ["(no output)"]
                        failed.append(label)
                        print(f"[{done}/{len(runs)}] {label}: FAILED, exit {proc.returncode}: {lines[-1]}", flush=True)
        except (KeyboardInterrupt, BrokenPipeError) as e:  # a signal, or what read the grid's output closed it
            signum = getattr(e, "signum", signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM)
            signals.stopping = True  # a second signal waits: the runs are saving their checkpoints
            for proc in running:
                proc.send_signal(signum)  # train.py saves a checkpoint on either
            for proc in running:
                proc.wait()
            if isinstance(e, BrokenPipeError):
                raise  # `grid.py | head`: exit 141 without a word (one_line_errors), as the runs have stopped
            print(f"grid.py: interrupted ({signal.Signals(signum).name}); run the same command again to go on",
                  file=sys.stderr)
            raise SystemExit(128 + signum)
    summaries = [read_summary(d) for d in dirs if (d / "summary.json").exists()]
    print(f"grid: {len(summaries)} of {len(runs)} runs finished in {(time.time() - started) / 60:.1f} min")
    tables = {}
    if summaries:
        seeds = "one seed each" if all(len(runs) == 1 for runs in by_setting(summaries).values()) else \
            "mean ± sd over seeds"
        for split in ("val", "test"):
            tables[split] = results_table(summaries, split)
            print(f"\naccuracy per tier (%), {split} split, {seeds}:\n{tables[split]}")
    if failed:
        # (a run's last line advises train.py's --resume or --overwrite: here the grid's command does it for each)
        print(f"grid.py: error: {len(failed)} run(s) failed: {'; '.join(failed)} (see train.out in each); once the "
              "cause is mended, run the same command again to go on", file=sys.stderr)
        raise SystemExit(1)
    return tables


if __name__ == "__main__":
    main()
