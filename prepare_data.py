"""
Downloads, tokenises and generates the data of the LIMe experiments, and loads it back.

    python prepare_data.py fineweb-edu --shards 32   # GPT-2 tokens, ~191 MiB per shard
    python prepare_data.py shakespeare               # ~1 MB of text -> GPT-2 tokens
    python prepare_data.py arithmetic --show 5       # the Arithmetic Expression Task, offline
    python prepare_data.py prosqa                    # ProsQA (~18k questions) -> GPT-2 tokens

Token datasets are shards in the llm.c format: a 1024-byte header of 256 int32
(magic 20240520, version 1, token count) followed by uint16 tokens, one loader for all.
The arithmetic task is plain text, one sample per line, with its own small vocabulary
in which every integer is one token. ProsQA keeps its JSON files beside their GPT-2
tokens (one .npz per split). Nothing half-written ever takes a final name:
downloads stream to `<file>.part` (resumed with HTTP Range) and every write goes to a
temporary file that is renamed only when whole and verified.
"""

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import requests
import torch

FINEWEB_URL = "https://huggingface.co/datasets/kjj0/finewebedu10B-gpt2/resolve/main"
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
PROSQA_URL = "https://raw.githubusercontent.com/facebookresearch/coconut/main/data"
PROSQA_SPLITS = ("train", "valid", "test")
MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 1024
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
CHUNK_BYTES = 1 << 20  # a cut connection loses at most the chunk in flight


class DataError(Exception):
    """A problem a user can fix; the command line prints it as one line."""


def folder_problem(path):
    """Why `path` cannot be a folder to write in (its first existing part is a file, say), or None."""
    for p in [Path(path), *Path(path).parents]:
        if p.exists():
            if not p.is_dir():
                return f"{p} is a file, not a folder"
            return None if os.access(p, os.W_OK | os.X_OK) else f"{p} is not writable"
    return None


def atomic_write(path, write):
    """Call write(f) on a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# -----------------------------------------------------------------------------
# Token shards


def write_shard(path, tokens):
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0 and tokens.max() < 2**16, "shards hold uint16 tokens"
    header = np.zeros(256, dtype="<i4")
    header[:3] = MAGIC, VERSION, len(tokens)
    atomic_write(path, lambda f: (f.write(header.tobytes()), f.write(tokens.astype("<u2").tobytes())))


def check_shard(path):
    """Raise DataError unless `path` has a valid header and exactly the tokens it announces."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    name = Path(path).name.removesuffix(".part")
    if len(header) < 3 or header[0] != MAGIC or header[1] != VERSION:
        raise DataError(f"{name}: not a token shard (bad magic or version in the header)")
    expected = HEADER_BYTES + 2 * int(header[2])
    size = os.path.getsize(path)
    if size != expected:
        raise DataError(f"{name}: {size} bytes, but its header announces {header[2]} tokens ({expected} bytes)")
    return int(header[2])


def read_shard(path):
    check_shard(path)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES)


def load_tokens(data_dir, split):
    """All shards of one split ('train' or 'val') of a token dataset, as uint16 arrays."""
    paths = sorted(Path(data_dir).glob(f"*_{split}_*.bin"))
    if not paths:
        raise DataError(f"no {split} shards in {data_dir}")
    return [read_shard(p) for p in paths]


# -----------------------------------------------------------------------------
# Downloads


def download(url, dest, verify=None, retries=5, timeout=30):
    """Stream url to dest via dest.part: resumes with HTTP Range, retries transient errors,
    runs verify(part) before the final rename. Returns False if dest was already there."""
    dest = Path(dest)
    if dest.exists():
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    for attempt in range(retries + 1):
        have = part.stat().st_size if part.exists() else 0
        try:
            with requests.get(url, headers={"Range": f"bytes={have}-"} if have else {}, stream=True,
                              timeout=timeout) as r:
                if r.status_code == 416:  # the .part already holds every byte
                    break
                if r.status_code in TRANSIENT_STATUS:
                    raise requests.ConnectionError(f"HTTP {r.status_code}")
                if r.status_code >= 400:
                    raise DataError(f"{url}: HTTP {r.status_code}")
                if r.status_code != 206:  # the server ignored Range: start again
                    have = 0
                total = have + int(r.headers.get("Content-Length", 0))
                progress = Progress(dest.name, have, total)
                with open(part, "ab" if have else "wb") as f:
                    for block in r.iter_content(CHUNK_BYTES):
                        f.write(block)
                        progress.update(len(block))
                progress.done()
                if part.stat().st_size < total:
                    raise requests.ConnectionError("connection closed early")
            break
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
            if attempt == retries:
                raise DataError(f"{url}: {e} (gave up after {retries} retries; run again to resume)")
            wait = min(2**attempt, 30)
            print(f"\n{dest.name}: {e}; retrying in {wait}s", file=sys.stderr)
            time.sleep(wait)
    if verify is not None:
        try:
            verify(part)
        except DataError:
            part.unlink()  # a corrupt file is never left behind to be resumed or renamed
            raise
    os.replace(part, dest)
    return True


class Progress:
    """One line per file: bytes, MB/s, ETA; redrawn in place on a terminal, every 10s otherwise."""

    def __init__(self, name, start, total):
        self.name, self.start, self.done_bytes, self.total = name, start, start, total
        self.t0 = self.last = time.time()
        self.tty = sys.stdout.isatty()

    def update(self, n):
        self.done_bytes += n
        now = time.time()
        if now - self.last >= (0.5 if self.tty else 10):
            self.last = now
            self.show(now)

    def show(self, now, end="\r"):
        rate = (self.done_bytes - self.start) / max(now - self.t0, 1e-9)
        eta = f"ETA {(self.total - self.done_bytes) / rate:.0f}s" if rate > 0 and self.total else ""
        line = f"{self.name}: {self.done_bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB {rate / 1e6:.1f} MB/s {eta}"
        print(line, end=end if self.tty else "\n", flush=True)

    def done(self):
        self.show(time.time(), end="\n")


def prepare_fineweb(data_dir, shards, base_url=FINEWEB_URL):
    names = ["finewebedu_val_000000.bin"] + [f"finewebedu_train_{i:06d}.bin" for i in range(1, shards + 1)]
    for name in names:
        dest = Path(data_dir) / name
        fetched = download(f"{base_url.rstrip('/')}/{name}", dest, verify=check_shard)
        print(f"{dest}: {check_shard(dest):,} tokens{'' if fetched else ' (already there)'}")


def gpt2_encoding():
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken fetches the vocabulary on first use
        raise DataError(f"tiktoken could not load the GPT-2 vocabulary (downloaded on first use): {e}") from None


def decode_tokens(enc, ids):
    """Text of token ids. An id the encoding does not have (the model's vocabulary is padded past
    GPT-2's 50257, and an untrained model may pick one) reads as U+FFFD rather than failing."""
    known = enc.n_vocab
    return b"".join(enc.decode_single_token_bytes(i) if i < known else "\ufffd".encode() for i in ids).decode(
        "utf-8", errors="replace")


def prepare_shakespeare(data_dir, url=SHAKESPEARE_URL, enc=None, val_fraction=0.1):
    """Tiny Shakespeare as GPT-2 tokens: the first 90% of the text is train, the rest val."""
    text_path = Path(data_dir) / "input.txt"
    download(url, text_path)
    enc = enc or gpt2_encoding()
    text = text_path.read_text(encoding="utf-8")
    cut = int(len(text) * (1 - val_fraction))
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        tokens = [enc.eot_token] + enc.encode_ordinary(part)  # documents start with end-of-text
        path = Path(data_dir) / f"shakespeare_{split}_000000.bin"
        write_shard(path, tokens)
        print(f"{path}: {len(tokens):,} tokens")


# -----------------------------------------------------------------------------
# The Arithmetic Expression Task
#
# An expression is a tree: a number, or (op, left, right). It is written with the fewest
# parentheses that keep its structure, and solved one operation per step, always the
# leftmost operation whose operands are both numbers (a post-order walk):
#   ( 7 + 5 ) / ( 6 + 4 * 3 - 2 * 7 ) = 12 / ( 6 + 4 * 3 - 2 * 7 ) = 12 / ( 6 + 12 - 2 * 7 ) = ... = 3
# The regimes the task spans, all in ArithmeticTask and in each data folder's meta.json:
# - field: `int`, whole numbers 1..max_operand combined into values in 0..max_value, division exact
#   (ours); or `mod`, the integers mod a prime P, division by the modular inverse (Feng et al. 2023,
#   which the paper's source, Arefin et al. 2024, follows: P = 11).
# - count: what a tier's number counts, operands (ours) or operators (Feng et al.'s: 6 operators = 7 numbers).
# - target: the whole step-by-step solution, or only the answer right after the expression's '='.

OPS = ("+", "-", "*", "/")
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass(frozen=True)
class ArithmeticTask:
    """One regime of the task. The defaults are the task as this repo first generated it, so that a
    meta.json written before these knobs existed loads as what it is."""
    field: str = "int"  # int: whole numbers, exact division; mod: the integers mod `modulus`
    modulus: int = 11  # mod: P, a prime, so that every nonzero number has an inverse
    max_operand: int = 20  # int: operands are drawn from 1..max_operand
    max_value: int = 999  # int: every intermediate value is in 0..max_value
    count: str = "operands"  # what a tier's number counts: operands or operators
    tiers: tuple = (4, 5, 6)  # the tiers generated, trained on together and scored one by one
    target: str = "steps"  # steps: the whole solution; answer: only the final number

    def __post_init__(self):
        object.__setattr__(self, "tiers", tuple(self.tiers))  # JSON gives a list
        for name, choices in (("field", ("int", "mod")), ("count", ("operands", "operators")),
                              ("target", ("steps", "answer"))):
            if getattr(self, name) not in choices:
                raise DataError(f"--{name} must be {' or '.join(choices)}, got {getattr(self, name)!r}")
        if self.field == "mod" and not (self.modulus >= 2 and all(self.modulus % d for d in range(2, self.modulus))):
            raise DataError(f"--modulus must be a prime (every nonzero number needs an inverse), got {self.modulus}")
        if self.field == "int" and not 1 <= self.max_operand <= self.max_value:
            raise DataError(f"--max-operand must be in 1..--max-value ({self.max_value}), got {self.max_operand}")
        if not self.tiers or min(self.tiers) < (1 if self.count == "operators" else 2) or len(set(self.tiers)) < len(self.tiers):
            raise DataError(f"--tiers must be distinct numbers of at least 1 operator (2 operands), got {self.tiers}")

    @classmethod
    def from_meta(cls, meta):
        return cls(**{f.name: meta[f.name] for f in dataclasses.fields(cls) if f.name in meta})

    @property
    def name(self):
        """A short label of the regime, e.g. 'mod11-answer' or 'int-steps'."""
        return f"{'int' if self.field == 'int' else f'mod{self.modulus}'}-{self.target}"

    @property
    def label(self):
        """The name with the tiers, e.g. 'mod11-answer, tiers 4,5,6 operators'."""
        return f"{self.name}, tiers {','.join(map(str, self.tiers))} {self.count}"

    @property
    def top(self):
        """The largest number that can occur."""
        return self.max_value if self.field == "int" else self.modulus - 1

    def vocab(self):
        return ["<eos>", "=", "(", ")", *OPS, *map(str, range(self.top + 1))]

    def apply(self, op, a, b):
        """a op b, or None where the regime does not allow it (inexact division, a value out of range)."""
        if self.field == "mod":
            if op == "/":  # a / b = a * b^-1: the one b with b * (a / b) = a
                return None if b % self.modulus == 0 else a * pow(b, -1, self.modulus) % self.modulus
            return (a + b if op == "+" else a - b if op == "-" else a * b) % self.modulus
        if op == "/":
            return a // b if b > 0 and a % b == 0 else None
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return value if 0 <= value <= self.max_value else None

    def evaluate(self, node):
        return node if isinstance(node, int) else self.apply(node[0], self.evaluate(node[1]), self.evaluate(node[2]))

    def random_expression(self, rng, tier):
        n = tier + 1 if self.count == "operators" else tier  # operands
        return self.bottom_up(rng, n) if self.field == "int" else self.top_down(rng, rng.randrange(self.modulus), n - 1)

    def bottom_up(self, rng, n):
        """int: a random tree over n operands, redrawn until every step is valid."""
        if n == 1:
            return rng.randint(1, self.max_operand)
        while True:
            k = rng.randint(1, n - 1)
            left, right = self.bottom_up(rng, k), self.bottom_up(rng, n - k)
            a, b = self.evaluate(left), self.evaluate(right)
            ops = [op for op in OPS if self.apply(op, a, b) is not None]
            if ops:
                return (rng.choice(ops), left, right)

    def top_down(self, rng, answer, n_ops):
        """mod, as Feng et al. build it: from the answer, n_ops times replace a random number x by
        `a op b` with a and op uniform and b solved so that the value stays x ((op, a) redrawn where
        no b exists). Every step is valid by construction, so nothing is rejected afterwards."""
        tree = answer
        for _ in range(n_ops):
            k = rng.randrange(count_numbers(tree))
            tree = replace_number(tree, k, lambda x: self.split(rng, x))
        return tree

    def split(self, rng, x):
        P = self.modulus
        while True:
            op, a = rng.choice(OPS), rng.randrange(P)
            if op == "+":
                return (op, a, (x - a) % P)
            if op == "-":
                return (op, a, (a - x) % P)
            if op == "*" and a:
                return (op, a, x * pow(a, -1, P) % P)
            if op == "*" and x == 0:  # 0 * b = 0 for every b
                return (op, a, rng.randrange(P))
            if op == "/" and x and a:  # a / b = x  <=>  b = a / x, nonzero since a is
                return (op, a, a * pow(x, -1, P) % P)
            if op == "/" and x == 0 and a == 0:  # 0 / b = 0 for every nonzero b
                return (op, a, rng.randrange(1, P))

    def solution(self, expr):
        """The sample: 'EXPR = STEP = ... = ANSWER', one operation per step, or 'EXPR = ANSWER'."""
        steps = [render(expr)]
        while not isinstance(expr, int):
            expr = self.solve_step(expr)
            steps.append(render(expr))
        return " = ".join(steps if self.target == "steps" else [steps[0], steps[-1]])

    def solve_step(self, node):
        """Carry out the leftmost operation whose operands are both numbers."""
        op, left, right = node
        if not isinstance(left, int):
            return (op, self.solve_step(left), right)
        if not isinstance(right, int):
            return (op, left, self.solve_step(right))
        return self.apply(op, left, right)

    def parse(self, text):
        """'( 7 + 5 ) / 3' -> ('/', ('+', 7, 5), 3); DataError unless every step is valid in this regime."""
        def check(n):  # bottom-up, so that an operation is only applied to valid values
            if isinstance(n, int):
                if n > self.top:
                    raise DataError(f"{n} is out of the task's range 0..{self.top}")
                return n
            value = self.apply(n[0], check(n[1]), check(n[2]))
            if value is None:
                raise DataError(f"{render(n)} " + ("divides by 0" if self.field == "mod" else
                                f"does not give a whole number in 0..{self.max_value}, as the task requires"))
            return value

        node = parse_tree(text)
        check(node)
        return node


# The regime `prepare_data.py arithmetic` and --preset=arith generate unless told otherwise (see the README)
# (chosen with grid.py on the validation split: the largest lead of LIMe at the hardest tier, though within noise)
ARITH_DEFAULTS = dict(field="mod", count="operators", tiers=(4, 5, 6), target="answer")
# The CPU quick start (--preset=tiny) keeps the task as this repo first made it: LIMe leads there within minutes
QUICK_START = ArithmeticTask()


def count_numbers(node):
    return 1 if isinstance(node, int) else count_numbers(node[1]) + count_numbers(node[2])


def replace_number(node, k, new):
    """node with its k-th number x (left to right) replaced by new(x)."""
    if isinstance(node, int):
        return new(node)
    op, left, right = node
    n = count_numbers(left)
    return (op, replace_number(left, k, new), right) if k < n else (op, left, replace_number(right, k - n, new))


def render(node, parent_prec=0, right_side=False):
    """Space-separated tokens; a right operand of equal precedence keeps its parentheses."""
    if isinstance(node, int):
        return str(node)
    op, left, right = node
    prec = PRECEDENCE[op]
    text = f"{render(left, prec)} {op} {render(right, prec, True)}"
    return f"( {text} )" if prec < parent_prec or (right_side and prec == parent_prec) else text


def parse_tree(text):
    """'( 7 + 5 ) / 3' -> ('/', ('+', 7, 5), 3), the structure alone; DataError unless well formed."""
    tokens, pos = text.split(), 0

    def parse(level):  # level 1: + -, level 2: * /, level 3: a number or ( ... )
        nonlocal pos
        if level == 3:
            tok = tokens[pos] if pos < len(tokens) else "end of input"
            pos += 1
            if tok == "(":
                node = parse(1)
                if pos >= len(tokens) or tokens[pos] != ")":
                    raise DataError(f"missing ')' in {text!r}")
                pos += 1
                return node
            if not tok.isdigit():
                raise DataError(f"expected a number, got {tok!r} in {text!r}")
            return int(tok)
        node = parse(level + 1)
        while pos < len(tokens) and PRECEDENCE.get(tokens[pos]) == level:
            op = tokens[pos]
            pos += 1
            node = (op, node, parse(level + 1))
        return node

    node = parse(1)
    if pos != len(tokens):
        raise DataError(f"unexpected {tokens[pos]!r} in {text!r}")
    return node


def generate_arithmetic(task, seed, train_size, test_size):
    """{'train': [lines], 'test_4': [lines], ..., 'val_4': [lines], ...}: train_size samples per tier
    in train, test_size per tier in each test and validation split. No expression occurs twice
    across splits: validation, for choosing settings, is as unseen as the test."""
    rng = random.Random(seed)
    out = {"train": [task.solution(task.random_expression(rng, n)) for n in task.tiers for _ in range(train_size)]}
    seen = {line.split(" = ")[0] for line in out["train"]}
    for split in ("test", "val"):
        for n in task.tiers:
            lines, tries = [], 0
            while len(lines) < test_size:
                line = task.solution(task.random_expression(rng, n))
                tries += 1
                if line.split(" = ")[0] not in seen:
                    seen.add(line.split(" = ")[0])
                    lines.append(line)
                elif tries > 100 * test_size:
                    raise DataError(f"tier {n} has too few distinct expressions for {test_size} unseen ones: "
                                    f"lower --test-size or --train-size")
            out[f"{split}_{n}"] = lines
    return out


def prepare_arithmetic(data_dir, task, seed=0, train_size=50_000, test_size=1000):
    data = generate_arithmetic(task, seed, train_size, test_size)
    for name, lines in data.items():
        path = Path(data_dir) / f"{name}.txt"
        atomic_write(path, lambda f: f.write(("\n".join(lines) + "\n").encode()))
        print(f"{path}: {len(lines):,} samples, longest {max(len(l.split()) for l in lines) + 1} tokens")
    meta = dict(vocab=task.vocab(), seed=seed, train_size=train_size, test_size=test_size, **dataclasses.asdict(task))
    atomic_write(Path(data_dir) / "meta.json", lambda f: f.write(json.dumps(meta).encode()))
    print(f"{Path(data_dir) / 'meta.json'}: {task.label}, task vocabulary of {len(meta['vocab'])} tokens")


class TaskVocab:
    """Whitespace tokens <-> ids for the arithmetic task."""

    def __init__(self, tokens):
        self.itos = list(tokens)
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.eos = self.stoi["<eos>"]

    def encode(self, text):
        try:
            return [self.stoi[t] for t in text.split()]
        except KeyError as e:
            raise DataError(f"{e.args[0]!r} is not in the task vocabulary ({' '.join(self.itos[1:8])}, "
                            f"numbers 0..{len(self.itos) - 9})") from None

    def decode(self, ids):
        return " ".join(self.itos[i] for i in ids)


def load_arithmetic(data_dir, trained_on=None):
    """(vocab, {'train': [lines], 'test_4': [...], 'val_4': [...], ...}, task). A folder written
    before the validation split existed has none. trained_on: the task a run's config names (its
    fields as a dict); a folder that holds another one is a DataError, not a score on the wrong task."""
    data_dir = Path(data_dir)
    if not (data_dir / "meta.json").exists():
        where = "" if data_dir == Path("data/arithmetic") else f" --data-dir {data_dir}"
        raise DataError(f"no arithmetic data in {data_dir}: run `python prepare_data.py arithmetic{where}`")
    meta = json.loads((data_dir / "meta.json").read_text())
    task = ArithmeticTask.from_meta(meta)
    if trained_on and ArithmeticTask.from_meta(trained_on) != task:
        raise DataError(f"{data_dir} holds the task {task.label}, but the run was trained on "
                        f"{ArithmeticTask.from_meta(trained_on).label}: give --data-dir the run's data")
    splits = {p.stem: p.read_text().splitlines() for p in sorted(data_dir.glob("*.txt"))}
    return TaskVocab(meta["vocab"]), splits, task


def split_sample(line):
    """'EXPR = ... = ANSWER' -> ('EXPR =', ANSWER): the prompt and the right final answer."""
    expr, _, rest = line.partition(" = ")
    return expr + " =", int(rest.split()[-1] if rest else expr)


def final_answer(generated):
    """The number after the last '=' of a generated solution, or None if there is none."""
    tail = generated.split("<eos>")[0].split("=")[-1].split()
    return int(tail[0]) if len(tail) == 1 and tail[0].isdigit() else None


# -----------------------------------------------------------------------------
# ProsQA (Hao et al. 2024): questions over a graph of made-up concepts, answered with the path
# that proves the answer. The files come from the Coconut repository, whose layout we follow:
#   <eot>Every shumpus is a rempus. ... Is Tom a lempus or scrompus?\n      <- the prompt
#   Tom is a terpus.\nEvery terpus is a brimpus.\nEvery brimpus is a lempus.\n### Tom is a lempus.<eot>


def check_prosqa(path):
    """The records of a ProsQA file. A DataError unless it is a JSON list of objects, each with a
    `question` (text), its reasoning `steps` (a list of texts) and an `answer` (text)."""
    name = Path(path).name.removesuffix(".part")
    try:
        records = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise DataError(f"{name} is missing from {Path(path).parent}") from None
    except (UnicodeDecodeError, ValueError) as e:  # a JSONDecodeError is a ValueError
        raise DataError(f"{name}: not valid JSON ({e})") from None
    if not isinstance(records, list) or not records:
        raise DataError(f"{name}: expected a non-empty JSON list of records")
    for i, r in enumerate(records):
        for key, kind in (("question", "a text"), ("steps", "a list of texts"), ("answer", "a text")):
            if not isinstance(r, dict) or key not in r:
                raise DataError(f"{name}: record {i} has no {key!r}")
            value = r[key]
            if not (isinstance(value, str) if key != "steps" else
                    isinstance(value, list) and all(isinstance(step, str) for step in value)):
                raise DataError(f"{name}: record {i}: {key!r} is not {kind}")
    return records


def prosqa_texts(record):
    """(prompt, completion): the question and a newline; then each step on a line of its own, and
    '### ' with the answer. Tokenised apart, so that the prompt ends on a token boundary."""
    return record["question"] + "\n", "".join(step + "\n" for step in record["steps"]) + "### " + record["answer"]


def tokenize_prosqa(records, enc):
    """(tokens, offsets, prompt_lens): record i is tokens[offsets[i]:offsets[i + 1]], <eot> prompt
    completion <eot> (the pretraining shards also start each document with <eot>); its prompt is
    the first prompt_lens[i] of them, <eot> included."""
    seqs, prompt_lens = [], []
    for record in records:
        prompt, completion = prosqa_texts(record)
        ids = [enc.eot_token] + enc.encode_ordinary(prompt)
        prompt_lens.append(len(ids))
        seqs.append(ids + enc.encode_ordinary(completion) + [enc.eot_token])
    tokens = np.concatenate(seqs)
    assert tokens.max() < 2**16, "stored as uint16, like the token shards"
    return tokens.astype(np.uint16), np.cumsum([0] + [len(s) for s in seqs]), np.array(prompt_lens)


def prepare_prosqa(data_dir, base_url=PROSQA_URL, enc=None):
    """Download the three splits (resumable, each checked before it takes its name), then tokenise
    each into prosqa_<split>.npz."""
    enc = enc or gpt2_encoding()  # first: without the vocabulary there is no point in downloading
    for split in PROSQA_SPLITS:
        dest = Path(data_dir) / f"prosqa_{split}.json"
        fetched = download(f"{base_url.rstrip('/')}/{dest.name}", dest, verify=check_prosqa)
        records = check_prosqa(dest)
        tokens, offsets, prompt_lens = tokenize_prosqa(records, enc)
        path = dest.with_suffix(".npz")
        atomic_write(path, lambda f: np.savez(f, tokens=tokens, offsets=offsets, prompt_lens=prompt_lens,
                                              eot=np.array(enc.eot_token)))
        print(f"{dest}: {len(records):,} records{'' if fetched else ' (already there)'}; {path.name}: "
              f"{len(tokens):,} tokens, longest record {np.diff(offsets).max()}")


def load_prosqa(data_dir, split):
    """One split as a list of (token ids, prompt length), and the end-of-text id. The ids are views
    into one int64 array: 18k Python lists of a few hundred ints each would take several times the memory."""
    path = Path(data_dir) / f"prosqa_{split}.npz"
    if not path.exists():
        where = "" if Path(data_dir) == Path("data/prosqa") else f" --data-dir {data_dir}"
        raise DataError(f"no ProsQA data in {data_dir}: run `python prepare_data.py prosqa{where}`")
    try:
        with np.load(path) as f:
            tokens, offsets, prompt_lens, eot = (f[k] for k in ("tokens", "offsets", "prompt_lens", "eot"))
    except Exception as e:  # a truncated or foreign file
        raise DataError(f"cannot read {path}: {e}; prepare it again") from None
    tokens = tokens.astype(np.int64)
    rows = [(tokens[a:b], int(n)) for a, b, n in zip(offsets[:-1], offsets[1:], prompt_lens)]
    return rows, int(eot)


def prosqa_correct(completion, answer):
    """Our accuracy rule for ProsQA. `completion`: the text generated after the prompt, up to (not
    including) the first end-of-text. Its answer is all that follows its first '###'; it is right
    when it equals the reference answer once whitespace is normalised in both (every run of spaces,
    tabs and newlines becomes one space, none at either end). Case and punctuation count; a
    completion without '###' is wrong. The reasoning steps before '###' are not scored."""
    if "###" not in completion:
        return False
    return " ".join(completion.split("###", 1)[1].split()) == " ".join(answer.split())


# -----------------------------------------------------------------------------
# Batches for training and evaluation: language windows and arithmetic rows, both a pure
# function of (seed, step, rank), so a resumed run sees exactly the batches an uninterrupted one would


class TokenData:
    """Random windows of block_size + 1 tokens from the train shards; fixed windows from the start
    of the validation shard, so that every run is evaluated on the same tokens."""

    def __init__(self, cfg, with_train=True):
        val = load_tokens(cfg["data_dir"], "val")[0]
        T = cfg["block_size"]
        n = min(cfg["eval_tokens"], len(val) - 1) // T
        if n < 1:
            raise DataError(f"validation shard in {cfg['data_dir']} is shorter than one block of {T}")
        self.val_x = torch.from_numpy(val[: n * T].astype(np.int64)).view(n, T)
        self.val_y = torch.from_numpy(val[1: n * T + 1].astype(np.int64)).view(n, T)
        self.T = T
        if with_train:
            self.train = load_tokens(cfg["data_dir"], "train")
            self.sizes = np.array([len(s) - T - 1 for s in self.train])
            if self.sizes.min() < 1:
                raise DataError(f"a train shard in {cfg['data_dir']} is shorter than one block of {T}")

    def batch(self, rng, n):
        shard = rng.choice(len(self.train), size=n, p=self.sizes / self.sizes.sum())
        starts = rng.integers(0, self.sizes[shard])
        rows = np.stack([self.train[s][o: o + self.T + 1].astype(np.int64) for s, o in zip(shard, starts)])
        rows = torch.from_numpy(rows)  # (n, T + 1)
        return rows[:, :-1], rows[:, 1:]

    def val_batches(self, size, rank, world):
        for i in range(rank * size, len(self.val_x), size * world):
            yield self.val_x[i: i + size], self.val_y[i: i + size]


class TaskRows:
    """A task's samples as rows of block_size tokens, the loss only on what follows the prompt.
    `train` and `val` hold (token ids ending with the end token, prompt length); `pad` is the end
    token; `longest` (tokens, the end token included) and `vocab_size` are for the caller to check
    against the model."""

    def collate(self, rows):
        """Inputs padded with the end token; targets only after the prompt, -1 elsewhere."""
        x = torch.full((len(rows), self.T), self.pad)
        y = torch.full((len(rows), self.T), -1)
        for i, (ids, n_prompt) in enumerate(rows):
            x[i, : len(ids) - 1] = torch.tensor(ids[:-1])
            y[i, n_prompt - 1: len(ids) - 1] = torch.tensor(ids[n_prompt:])
        return x, y

    def batch(self, rng, n):
        return self.collate([self.train[i] for i in rng.integers(0, len(self.train), n)])

    def val_batches(self, size, rank, world):
        for i in range(rank * size, len(self.val), size * world):
            yield self.collate(self.val[i: i + size])


class ArithmeticData(TaskRows):
    """The arithmetic task, in the regime its folder's meta.json names (`task`). Accuracy on the first
    eval_samples expressions of each tier: `tests` from the test split, `vals` from the validation
    split (empty for a folder made before it existed). Validation loss on the validation rows
    (the test rows, for such an old folder)."""

    def __init__(self, cfg, with_train=True):
        # only training generates the task: evaluating or analysing a run reads it, like any other data
        if with_train and not (Path(cfg["data_dir"]) / "meta.json").exists() and cfg["preset"] in ("tiny", "arith"):
            print(f"preparing the arithmetic task in {cfg['data_dir']} (once, offline)")
            task = QUICK_START if cfg["preset"] == "tiny" else ArithmeticTask(**ARITH_DEFAULTS)
            prepare_arithmetic(cfg["data_dir"], task)
        self.vocab, splits, self.task = load_arithmetic(cfg["data_dir"], cfg.get("task"))
        self.T, n = cfg["block_size"], cfg["eval_samples"]
        self.train = [self.encode_row(line) for line in splits["train"]] if with_train else []
        self.tests = {k: splits[f"test_{k}"][:n] for k in self.task.tiers}
        self.vals = {k: splits[f"val_{k}"][:n] for k in self.task.tiers if f"val_{k}" in splits}
        self.val = [self.encode_row(line) for lines in (self.vals or self.tests).values() for line in lines]
        self.pad, self.vocab_size = self.vocab.eos, len(self.vocab.itos)
        self.longest = max(len(ids) for ids, _ in self.train + self.val)
        # a solution ends with the end token; an answer is one token, all that is generated
        self.max_new_tokens = cfg["block_size"] if self.task.target == "steps" else 1

    def encode_row(self, line):
        """(token ids, the prompt's length: up to the first '='). A solution ends with <eos>, which is
        learned so that generation stops; an answer has none, so the loss covers the answer alone."""
        end = [self.vocab.eos] if self.task.target == "steps" else []
        return self.vocab.encode(line) + end, line.split().index("=") + 1


class ProsQAData(TaskRows):
    """ProsQA: training on the train split, validation loss on the valid split, and accuracy on the
    first eval_samples questions of the test split, which is where the paper reports it. `tests`
    holds (prompt ids, reference answer); `max_new_tokens` bounds a generated completion at twice
    the longest one in the valid and test splits (not train, which an evaluation need not load)."""

    def __init__(self, cfg, with_train=True):
        self.T, n = cfg["block_size"], cfg["eval_samples"]
        self.val, self.pad = load_prosqa(cfg["data_dir"], "valid")
        self.train = load_prosqa(cfg["data_dir"], "train")[0] if with_train else []
        test = load_prosqa(cfg["data_dir"], "test")[0][:n]
        answers = [r["answer"] for r in check_prosqa(Path(cfg["data_dir"]) / "prosqa_test.json")[:n]]
        self.tests = [(ids[:n_prompt].tolist(), answer) for (ids, n_prompt), answer in zip(test, answers)]
        self.vocab_size = self.pad + 1  # GPT-2's end-of-text is the last of its tokens
        self.longest = max(len(ids) for ids, _ in self.train + self.val + test)
        self.max_new_tokens = 2 * max(len(ids) - n_prompt for ids, n_prompt in self.val + test)


def load_data(cfg, with_train=True):
    loader = dict(arithmetic=ArithmeticData, prosqa=ProsQAData).get(cfg["data"], TokenData)
    return loader(cfg, with_train)


def batch_rng(seed, step, rank, micro):
    return np.random.default_rng([seed, step, rank, micro])


# -----------------------------------------------------------------------------


def fail(message, code):
    """One line on stderr. Exit codes, as in every script here: 2 for bad usage (argparse's),
    1 for a failure at run time, 128 + the signal for an interruption."""
    print(f"prepare_data.py: {message}", file=sys.stderr)
    sys.exit(code)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input, not argparse's usage block
        fail(f"error: {message}", 2)


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=["fineweb-edu", "shakespeare", "arithmetic", "prosqa"], help="dataset to prepare")
    p.add_argument("--data-dir", help="output folder (default: data/NAME)")
    p.add_argument("--shards", type=int, default=32, help="fineweb-edu: train shards of 1e8 tokens (32 for 3.1B)")
    p.add_argument("--base-url", help=f"fineweb-edu, prosqa: where the files are, for a mirror "
                                      f"(default: {FINEWEB_URL}, {PROSQA_URL})")
    p.add_argument("--url", default=SHAKESPEARE_URL, help="shakespeare: where the text is")
    p.add_argument("--seed", type=int, default=0, help="arithmetic: generator seed")
    p.add_argument("--field", default=ARITH_DEFAULTS["field"], choices=["int", "mod"],
                   help="arithmetic: int (whole numbers, exact division) or mod (the integers mod --modulus)")
    p.add_argument("--modulus", type=int, default=11, help="arithmetic, mod: the prime P (default 11, as Feng et al.)")
    p.add_argument("--max-operand", type=int, default=20, help="arithmetic, int: operands are drawn from 1..this")
    p.add_argument("--max-value", type=int, default=999, help="arithmetic, int: every value stays in 0..this")
    p.add_argument("--count", default=ARITH_DEFAULTS["count"], choices=["operands", "operators"],
                   help="arithmetic: what a tier's number counts")
    p.add_argument("--tiers", default=",".join(map(str, ARITH_DEFAULTS["tiers"])),
                   help="arithmetic: the tiers to generate, comma-separated (default %(default)s)")
    p.add_argument("--target", default=ARITH_DEFAULTS["target"], choices=["steps", "answer"],
                   help="arithmetic: learn the whole step-by-step solution, or only the answer after '='")
    p.add_argument("--train-size", type=int, default=50_000, help="arithmetic: training samples per tier")
    p.add_argument("--test-size", type=int, default=1000,
                   help="arithmetic: samples per tier in the test split, and again in the validation split")
    p.add_argument("--show", type=int, default=0, metavar="K", help="arithmetic: print K training samples")
    args = p.parse_args(argv)
    data_dir = args.data_dir or os.path.join("data", args.name)
    if folder_problem(data_dir):
        p.error(f"--data-dir={data_dir}: {folder_problem(data_dir)}")
    if args.name == "fineweb-edu" and not 1 <= args.shards <= 99:
        p.error(f"--shards must be 1..99, got {args.shards}")
    for key, least in (("train_size", 1), ("test_size", 1), ("show", 0)):
        if args.name == "arithmetic" and getattr(args, key) < least:
            p.error(f"--{key.replace('_', '-')} must be >= {least}, got {getattr(args, key)}")
    if args.name == "arithmetic":
        try:
            tiers = tuple(int(t) for t in args.tiers.split(","))
        except ValueError:
            p.error(f"--tiers must be numbers separated by commas, e.g. 4,5,6; got {args.tiers!r}")
        try:
            task = ArithmeticTask(args.field, args.modulus, args.max_operand, args.max_value, args.count, tiers,
                                  args.target)
        except DataError as e:
            p.error(str(e))
    try:
        if args.name == "fineweb-edu":
            prepare_fineweb(data_dir, args.shards, args.base_url or FINEWEB_URL)
        elif args.name == "prosqa":
            prepare_prosqa(data_dir, args.base_url or PROSQA_URL)
        elif args.name == "shakespeare":
            prepare_shakespeare(data_dir, args.url)
        else:
            prepare_arithmetic(data_dir, task, args.seed, args.train_size, args.test_size)
            train = load_arithmetic(data_dir)[1]["train"]
            for line in train[:: max(1, len(train) // args.show)][: args.show] if args.show > 0 else []:
                print(line)  # spread over the file, so every tier shows
    except DataError as e:
        fail(f"error: {e}", 1)
    except KeyboardInterrupt:
        fail("interrupted: a partial download stays as .part and resumes on the next run", 130)


if __name__ == "__main__":
    main()
