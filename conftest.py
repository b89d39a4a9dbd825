"""What the test files share: small models, a local file server, tiny training runs (made once
per session), the check that a script failed in one line, and the processes of the tests that need their own, started
as the session starts. The tests run on the CPU, with no network. Run them with `python -m pytest -q`."""

import contextlib
import hashlib
import http.server
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import tiktoken

# NOTE one thread per test process, and per script a test starts (they inherit it): as fast as two on an idle
# 2-core machine, and about 5x faster where another process keeps the cores busy (two suites at once: with torch's
# default of a thread per core, idle threads spin while they wait on each other). Set before torch loads, which
# reads it then
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

if not torch.cuda.is_available():  # before lime imports kernels.py: Triton kernels then run on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
# NOTE the tests choose their own kernels and tiles: a LIME_TRITON or LIME_TILE left in the shell (from timing a
# tile with bench.py) would change what every test, and every script they start, runs
for knob in ("LIME_TRITON", "LIME_TILE"):
    os.environ.pop(knob, None)
# NOTE a job a script starts in the background (`pytest &`, nohup) ignores Ctrl-C, and so would every script the
# tests start: the tests of Ctrl-C need it as an interactive shell leaves it, to Python's handler
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import arithmetic  # noqa: E402
import grid  # noqa: E402
import prosqa  # noqa: E402
import train  # noqa: E402
from cli import seed_draws  # noqa: E402
from data import write_shard  # noqa: E402
from lime import GPT, GPTConfig  # noqa: E402
from methods import registry, router_forms  # noqa: E402
from pruning import prunable  # noqa: E402

# the routers that top-p pruning takes, as its errors list them: derived, so that a fork's router joins them
PRUNABLE = router_forms(prunable)


def methods_where(test=lambda cls: True):
    """The --router values (J = 2 where it has no default) of the methods of the registry that pass test:
    a fork's too, so that the promises every method keeps are tested for it."""
    return [name.replace("-J", "" if cls.J else "-2") for name, cls in registry().items() if test(cls)]


def small_config(router, **kw):
    base = dict(block_size=32, vocab_size=64, n_layer=6, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, router=router)
    return GPTConfig(**{**base, **kw})


def small_model(router, seed=0, **kw):
    seed_draws("cpu", seed)  # (not torch.manual_seed: a millisecond a model, as cli.seed_draws says)
    return GPT(small_config(router, **kw))


def perturbed(model, scale, g=None):
    """model, every parameter moved by scale * N(0, 1): no path starts at zero any more (a gate, a per-token router's
    input map, the value residual's weight, a baseline that starts as `none`), and from 0.1 on, attention is far
    from uniform, so that a key or value off by 0.1% shows in the logits. g: the generator to draw from (seed 0)."""
    g = g or torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def tokens(B=2, T=16, vocab=64, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def error_of(main, argv, capsys, code=2):
    """A script's main(argv) that must fail: checks the exit code (2 for bad usage, 1 for a failure
    at run time) and that stderr is one line, and returns that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, (e.value.code, err)
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def snapshot(*roots):
    """Every path under the roots, with the bytes of each file."""
    return {p: p.read_bytes() if p.is_file() else None for root in roots for p in [root, *root.rglob("*")]}


class FileServer:
    """Serves bytes from 127.0.0.1 with HTTP Range (or, with ranges=False, ignoring it, as some servers do) and
    If-Range against each file's ETag (its content's hash: a file changed in `files` gets another; if_range=False
    ignores it, as a proxy may); can cut a file's first response halfway. `headers`: sent with each file, as well as
    its Content-Length and ETag (None: not sent)."""

    def __init__(self, files, cut_once=(), ranges=True, headers=None, if_range=True):
        self.files, self.cut_once, self.requests, self.if_ranges = dict(files), set(cut_once), [], []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                server.requests.append((name, self.headers.get("Range")))
                server.if_ranges.append(self.headers.get("If-Range"))
                if name not in server.files:
                    self.send_error(404)
                    return
                data = server.files[name]
                etag = f'"{hashlib.sha256(data).hexdigest()[:16]}"'
                start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-"))[1]) if ranges else 0
                if if_range and self.headers.get("If-Range", etag) != etag:  # another version than the client's
                    start = 0
                self.send_response(206 if start else 200)
                for key, value in {"Content-Length": str(len(data) - start), "ETag": etag, **(headers or {})}.items():
                    if value is not None:  # (no Content-Length: the body ends where the connection does)
                        self.send_header(key, value)
                self.end_headers()
                if name in server.cut_once:  # announce everything, send half, hang up
                    server.cut_once.discard(name)
                    self.wfile.write(data[start:start + (len(data) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # a short poll: close() waits for the loop to see the shutdown, half a second per test by default
        threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.01), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(files, cut_once=(), ranges=True, headers=None, if_range=True):
        servers.append(FileServer(files, cut_once, ranges, headers, if_range))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def small_encoding():
    """A byte-level tiktoken Encoding with the GPT-2 split pattern: no download."""
    return tiktoken.Encoding(
        name="test-bytes",
        pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|endoftext|>": 256},
    )


@pytest.fixture
def offline_gpt2(monkeypatch):
    """GPT-2's vocabulary is a download: the small encoding stands in for it wherever it is asked for."""
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: small_encoding())
    return small_encoding()


@pytest.fixture(scope="session")
def arith_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("arith")
    arithmetic.prepare(path, arithmetic.Task(), seed=0, train_size=100, test_size=10)
    return path


ANSWERS = arithmetic.Task(field="mod", count="operators", tiers=(2, 3), target="answer")


@pytest.fixture(scope="session")
def answer_dir(tmp_path_factory):
    """The task with direct answers (mod 11, 2 and 3 operators): one token to generate per scored sample,
    so that a test of training spends its time training, not generating solutions."""
    path = tmp_path_factory.mktemp("answers")
    arithmetic.prepare(path, ANSWERS, seed=0, train_size=100, test_size=10)
    return path


def tiny_args(arith_dir, out_dir, *extra):
    return ["--preset=tiny", f"--data-dir={arith_dir}", f"--out-dir={out_dir}", "--n-layer=2", "--n-head=2",
            "--n-kv-head=2", "--n-embd=32", "--mlp-hidden=64", "--batch-size=8", "--micro-batch-size=4",
            "--max-steps=12", "--eval-interval=6", "--eval-samples=1", "--log-interval=1", "--warmup-steps=2", *extra]


def edit_checkpoint(run, edit):
    """The run's ckpt.pt loaded, changed in place by edit(ckpt), and saved again, as a hand or a tool may."""
    ckpt = torch.load(run / "ckpt.pt", weights_only=True)
    edit(ckpt)
    torch.save(ckpt, run / "ckpt.pt")


def edit_settings(run, **changes):
    """The run's settings changed alike in ckpt.pt and config.json: the run as if it had been trained so (a
    checkpoint changed alone is of another run than its folder's: sample.py and analyze.py refuse it)."""
    edit_checkpoint(run, lambda ckpt: ckpt["config"].update(changes))
    config = Path(run) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **changes}))


def read_log(out_dir):
    return [json.loads(l) for l in (Path(out_dir) / "log.jsonl").read_text().splitlines()]


def train_losses(out_dir):
    return {r["step"]: r["loss"] for r in read_log(out_dir) if "loss" in r}


@pytest.fixture(scope="session")
def whole_run(answer_dir, tmp_path_factory):
    """tiny_args's 12 steps in one go: what every interrupted and resumed run must equal."""
    out = tmp_path_factory.mktemp("whole")
    train.main(tiny_args(answer_dir, out))
    return out


def assert_same_run(out, whole):
    """The same weights and the same log rows, evaluations included, exactly (on CPU); only the timings differ, and
    the resumed run's log has a row for each session it ran (the whole run's: one, at step 0)."""
    timing = ("ms_per_step", "tokens_per_s")
    rows = [[{k: v for k, v in r.items() if k not in timing} for r in read_log(d) if "session" not in r]
            for d in (out, whole)]
    assert rows[0] == rows[1]
    sessions = [[r["step"] for r in read_log(d) if "session" in r] for d in (out, whole)]
    assert sessions[1] == [0] and sessions[0][0] == 0 and sessions[0] == sorted(sessions[0])
    a, b = (torch.load(d / "ckpt.pt", weights_only=True)["model"] for d in (whole, out))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="session")
def arith_run(arith_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("arith_run")
    train.main(tiny_args(arith_dir, out, "--max-steps=6"))
    return out


@pytest.fixture(scope="session")
def answer_run(answer_dir, tmp_path_factory):
    """arith_run's steps on the direct answers: for a test that evaluates a run again and again, and reads nothing of
    its task (one token to generate per scored sample, not a whole solution)."""
    out = tmp_path_factory.mktemp("answer_run")
    train.main(tiny_args(answer_dir, out, "--max-steps=6"))
    return out


@pytest.fixture(scope="session")
def language_run(tmp_path_factory):
    """A few steps on GPT-2-format shards of text tokenised with the small test encoding."""
    folder, out = tmp_path_factory.mktemp("lang_data"), tmp_path_factory.mktemp("lang_run")
    enc = small_encoding()
    text = "To be, or not to be, that is the question. " * 200
    write_shard(folder / "text_train_000000.bin", [enc.eot_token] + enc.encode_ordinary(text))
    write_shard(folder / "text_val_000000.bin", [enc.eot_token] + enc.encode_ordinary(text[:2000]))
    train.main(["--preset=tiny", "--data=shakespeare", f"--data-dir={folder}", f"--out-dir={out}", "--vocab-size=320",
                "--block-size=32", "--n-layer=2", "--n-embd=32", "--n-head=2", "--n-kv-head=2", "--batch-size=8",
                "--micro-batch-size=8", "--max-steps=6", "--eval-interval=6", "--eval-tokens=512"])
    return out


def prosqa_records(n, seed):
    """ProsQA's format, in miniature: a two-step proof of the answer."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        who, (a, b, c) = rng.choice(["Al", "Bo", "Cy"]), rng.sample(["wu", "yu", "zo", "ri", "le"], 3)
        records.append(dict(question=f"Every {a} is a {b}. {who} is a {a}. Is {who} a {b} or {c}?",
                            steps=[f"{who} is a {a}.", f"Every {a} is a {b}."], answer=f"{who} is a {b}."))
    return records


def prosqa_files(sizes=(32, 4, 4)):
    return {f"prosqa_{split}.json": json.dumps(prosqa_records(n, i)).encode()
            for i, (split, n) in enumerate(zip(prosqa.SPLITS, sizes))}


# grid.py's runs and flag checks in this process (a process of their own spends seconds importing torch)


def train_here(cmd, out):
    """`python train.py ...` as train.main(...) in this process, its output into `out`: its exit code. (A
    process of its own would spend seconds importing torch; test_two_process_ddp_on_cpu runs train.py as one.)"""
    assert cmd[:2] == [sys.executable, str(Path(grid.__file__).with_name("train.py"))], cmd
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            train.main(cmd[2:])
            return 0
        except SystemExit as e:
            return e.code


class TrainInThisProcess:
    """Stands in for subprocess.Popen in grid.py."""

    def __init__(self, cmd, stdout, stderr, env, preexec_fn):
        # each run's share of the cores: how many depends on the machine's (test_grid checks the share)
        assert env["OMP_NUM_THREADS"] == env["TORCHINDUCTOR_COMPILE_THREADS"] and int(env["OMP_NUM_THREADS"]) >= 1
        assert stderr is grid.subprocess.STDOUT
        assert "RANK" not in env
        self.returncode = train_here(cmd, stdout)

    def poll(self):
        return self.returncode


def check_here(cmd, capture_output, text, env):
    """Stands in for subprocess.run in grid.py: train.py's --dry-run."""
    assert "RANK" not in env
    out = io.StringIO()
    code = train_here(cmd, out)
    return grid.subprocess.CompletedProcess(cmd, code, out.getvalue(), out.getvalue())


@pytest.fixture
def train_in_this_process(monkeypatch):
    monkeypatch.setattr(grid.subprocess, "Popen", TrainInThisProcess)
    monkeypatch.setattr(grid.subprocess, "run", check_here)
    monkeypatch.setattr(grid.time, "sleep", lambda seconds: None)  # (grid.py polls its runs: these ended as they began)


@pytest.fixture
def refused(train_in_this_process, monkeypatch):
    """For a grid that must refuse: a run it starts fails the test at once, where it would train (for minutes, at the
    grid's default sizes) if the refusal were gone."""
    def started(cmd, **kwargs):
        pytest.fail(f"the grid started a run it should have refused: {' '.join(cmd[1:3])}")
    monkeypatch.setattr(grid.subprocess, "Popen", started)


# Processes that take seconds (most of them importing torch), started as the session starts: they run beside the tests
# before the ones that read them, on the core those leave idle (a test runs on one thread), not while those wait


EARLY = []  # the fixtures below, in the order their tests come


def early(fixture):
    """A session fixture that started_early sets up as the session starts."""
    EARLY.append(fixture.__name__)
    return pytest.fixture(scope="session")(fixture)


@pytest.fixture(scope="session", autouse=True)
def started_early(request):
    """Every fixture of EARLY that a selected test uses, set up before the first test."""
    used = {name for item in request.session.items for name in item.fixturenames}
    for name in EARLY:
        if name in used:
            try:
                request.getfixturevalue(name)
            except Exception:  # an error of its own tests (pytest keeps it for them), not of the first test's
                pass


def beside(cmd, nice, **kwargs):
    """subprocess.Popen(cmd, **kwargs) at a lower priority (the processes it starts inherit it): on the core the tests
    leave idle, not on theirs. The later its test comes, the higher the nice."""
    p = subprocess.Popen(cmd, **kwargs)
    os.setpriority(os.PRIO_PROCESS, p.pid, nice)
    return p


def ended(*procs):
    """At a fixture's end: its processes, where no test waited for them."""
    for p in procs:
        p.kill()
        p.communicate()


HERE = Path(__file__).parent  # where the scripts are


@early
def gpu_script_here(tmp_path_factory):
    """(process, its $OUT) of test_the_gpu_script_without_a_gpu_is_one_line_and_makes_nothing: `.ci/gpu 5` here."""
    if torch.cuda.is_available():  # (the test is skipped: there the script would measure)
        yield None
        return
    out = tmp_path_factory.mktemp("gpu") / "out"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # (its python3: this one, with torch)
    p = beside(["bash", str(HERE / ".ci" / "gpu"), "5"], 5, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
               env={**os.environ, "OUT": str(out), "PATH": path})
    yield p, out
    ended(p)


@early
def registers_1b():
    """test_the_registers_script_compiles_the_kernels_for_a_gpu_without_one's `.ci/registers.py --shape 1b`, at a
    packed tile (TRITON_INTERPRET=1 as the tests set it: the script compiles for sm_90 all the same)."""
    p = beside([sys.executable, str(HERE / ".ci" / "registers.py"), "--shape", "1b"], 5, stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True, env={**os.environ, "LIME_TILE": "128/4/8/1/1"})
    yield p
    ended(p)


@early
def knobs_of_a_tile():
    """test_lime_tile_sets_the_kernels_knobs_or_is_refused's process: kernels' five knobs under LIME_TILE."""
    p = beside([sys.executable, "-c", "import kernels; print(*map(kernels.__dict__.get, kernels.KNOBS))"], 8,
               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
               env={**os.environ, "LIME_TILE": "128/8/0/4/1"})
    yield p
    ended(p)


@early
def ctrl_c_while_torch_loads():
    """test_ctrl_c_while_torch_loads_is_one_line's `python train.py --help`, sent a Ctrl-C 0.3 s in, by a timer (torch
    takes seconds to load), and another sent SIGTERM. At the tests' own priority: the signal must not come before
    Python is up."""
    procs = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        procs[signum] = subprocess.Popen([sys.executable, "train.py", "--help"], cwd=HERE, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        threading.Timer(0.3, procs[signum].send_signal, (signum,)).start()
    yield procs
    ended(*procs.values())


@early
def closed_and_broken_pipe():
    """The two scripts of test_output_closed_by_its_reader_is_no_traceback: one prints to a reader that closes its
    output, the other writes to a pipe of its own whose reader is gone."""
    closed = "import cli\nwith cli.one_line_errors('x.py'):\n    for i in range(10**6):\n        print(i)"
    other = ("import cli, os\nwith cli.one_line_errors('x.py'):\n    r, w = os.pipe()\n    os.close(r)\n"
             "    os.write(w, b'x')")
    procs = [beside([sys.executable, "-c", code], 10, cwd=HERE, text=True, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE) for code in (closed, other)]
    yield procs
    ended(*procs)


@early
def grid_and_its_run(tmp_path_factory):
    """(grid.py's process, the file its run writes) of test_a_grid_killed_where_it_cannot_pass_a_signal_on_takes_its_
    runs_with_it. The run stands in for train.py: it trains (sleeps) until a SIGTERM, which it writes down."""
    if grid.LIBC is None:  # (the test is skipped: no PR_SET_PDEATHSIG, and the run would outlive the grid)
        yield None
        return
    got = tmp_path_factory.mktemp("killed") / "got"
    run = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'w').write('term'), "
           "sys.exit(0))); print('ready', flush=True); time.sleep(600)")
    grid_code = ("import subprocess, sys, grid; p = grid.launch([sys.executable, '-c', sys.argv[1], sys.argv[2]], "
                 "subprocess.PIPE, None); print(p.stdout.readline().decode().strip(), flush=True); p.wait()")
    the_grid = beside([sys.executable, "-c", grid_code, run, str(got)], 15, stdout=subprocess.PIPE, cwd=HERE)
    yield the_grid, got
    ended(the_grid)


@early
def ddp_run(answer_dir, tmp_path_factory):
    """(its two processes, its folder) of test_two_process_ddp_on_cpu's run: 2 processes, 4 steps."""
    out = tmp_path_factory.mktemp("ddp") / "ddp"
    cmd = [sys.executable, "train.py", *tiny_args(answer_dir, out, "--max-steps=4", "--eval-interval=4")]
    # the environment torchrun gives each process, set here: torchrun's own start (a third torch import) costs seconds
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [beside(cmd, 15, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    yield procs, out
    ended(*procs)


def ctrl_c_at_its_first_output(p, read):
    """`| tee`, then Ctrl-C: in a thread, as the run goes on."""
    os.read(read, 1)  # the first bytes come when the buffer fills, dozens of steps in
    os.close(read)
    p.send_signal(signal.SIGINT)


@early
def closed_output_started(answer_dir, tmp_path_factory):
    """ctrl_c -> (process, run folder) of test_a_closed_output_stops_the_run_with_a_checkpoint's `python train.py`,
    whose reader closes its output."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (else the first line fails, before step 1)
    runs = {}
    for ctrl_c in (False, True):
        out = tmp_path_factory.mktemp("closed") / "run"
        cmd = [sys.executable, "train.py", *tiny_args(answer_dir, out, "--max-steps=3000", "--eval-interval=5000")]
        read, write = os.pipe()
        p = beside(cmd, 19, stdout=write, stderr=subprocess.PIPE, text=True, cwd=HERE,
                   env={**env, "OMP_NUM_THREADS": "1"})
        os.close(write)
        if ctrl_c:
            threading.Thread(target=ctrl_c_at_its_first_output, args=(p, read), daemon=True).start()
        else:
            os.close(read)
        runs[ctrl_c] = p, out
    yield runs
    ended(*(p for p, _ in runs.values()))
