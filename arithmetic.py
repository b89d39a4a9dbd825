"""
The Arithmetic Expression Task (the paper's Section 5.3.2 and Appendix B): solve an expression
over integers step by step, scored by the final number. Generated here, offline; the paper does
not publish its generator.

    python prepare_data.py arithmetic --show 5       # a data folder: train, val_N, test_N, meta.json

A data folder holds plain text, one sample per line ('EXPR = STEP = ... = ANSWER'), and its
regime in meta.json, with the task's small vocabulary in which every integer is one token.
`Data` is what training reads: samples as rows, and accuracy per tier by greedy generation.
"""

import dataclasses
import hashlib
import json
import math
import random
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from cli import (DataError, Unreadable, UsageError, atomic_write, check_a_file, file_state, folder_problem,
                 holding, read_json)
from data import TaskRows, greedy_accuracy
from lime import GPTConfig

# The task
#
# An expression is a tree: a number, or (op, left, right). It is written with the fewest
# parentheses that keep its structure, and solved one operation per step, always the
# leftmost operation whose operands are both numbers (a post-order walk):
#   ( 7 + 5 ) / ( 6 + 4 * 3 - 2 * 7 ) = 12 / ( 6 + 4 * 3 - 2 * 7 ) = 12 / ( 6 + 12 - 2 * 7 ) = ... = 3
# The regimes the task spans, all in Task and in each data folder's meta.json:
# - field: `int`, whole numbers 1..max_operand combined into values in 0..max_value, division exact
#   (ours); or `mod`, the integers mod a prime P, division by the modular inverse (Feng et al. 2023,
#   which the paper's source, Arefin et al. 2024, follows: P = 11).
# - count: what a tier's number counts, operands (ours) or operators (Feng et al.'s: 6 operators = 7 numbers).
# - target: the whole step-by-step solution, or only the answer right after the expression's '='.

OPS = ("+", "-", "*", "/")
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
SYMBOLS = ("<eos>", "=", "(", ")", *OPS)  # the vocabulary, before a token for every number 0..top
LARGEST = 10**6  # the largest number a regime may have: every number is a token (and a row of the embedding)
MOST_TOKENS = GPTConfig.block_size  # the longest a sample may be: the default block, the largest preset block
CHOICES = dict(field=("int", "mod"), count=("operands", "operators"), target=("steps", "answer"))  # a Task's words


@dataclass(frozen=True)
class Task:
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
        if not isinstance(self.tiers, (list, tuple)):  # (a meta.json may hold 5 or "4,5,6")
            raise DataError(f"--tiers must be a list of whole numbers, got {self.tiers!r}")
        object.__setattr__(self, "tiers", tuple(self.tiers))  # JSON gives a list
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise DataError(f"--{name} must be {' or '.join(choices)}, got {getattr(self, name)!r}")
        for name in ("modulus", "max_operand", "max_value", "tiers"):  # (a meta.json or a config may hold '11', 4.5)
            values = self.tiers if name == "tiers" else (getattr(self, name),)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                what, value = ("whole numbers", list(values)) if name == "tiers" else ("a whole number", values[0])
                raise DataError(f"--{name.replace('_', '-')} must be {what}, got {value!r}")
        if self.top > LARGEST:  # first: a vocabulary far past it would take forever to build
            flag, value, most = ("--max-value", self.max_value, LARGEST) if self.field == "int" else \
                ("--modulus", self.modulus, LARGEST + 1)
            raise DataError(f"{flag} must be at most {most}, got {value}: every number is a token of the task's "
                            "vocabulary")
        if self.field == "mod" and not (self.modulus >= 2 and
                                        all(self.modulus % d for d in range(2, math.isqrt(self.modulus) + 1))):
            raise DataError(f"--modulus must be a prime (every nonzero number needs an inverse), got {self.modulus}")
        if self.field == "int" and not 1 <= self.max_operand <= self.max_value:
            raise DataError(f"--max-operand must be in 1..--max-value ({self.max_value}), got {self.max_operand}")
        least = 1 if self.count == "operators" else 2
        if not self.tiers or min(self.tiers) < least or len(set(self.tiers)) < len(self.tiers):
            raise DataError(f"--tiers must be distinct numbers of at least 1 operator (2 operands), got "
                            f"{list(self.tiers)}")

    def check_fits(self):
        """For new data only (prepare_data.py, grid.py): every sample fits MOST_TOKENS. Not in __post_init__, so that
        data and runs made before this bound (with tiers past it, and a larger --block-size) are still read."""
        def longest(n):  # tokens in the longest sample of n operators: a chain 1 - ( 2 - ( 3 - ... ) ), 4n - 1
            # tokens, 4 fewer each step; then '=' and the answer, or every step, the '='s and <eos> (3000: 18M tokens)
            return 4 * n + 1 if self.target == "answer" else 2 * n * (n + 1) + 2

        operands = self.count == "operands"  # (a tier of n operands has n - 1 operators)
        if longest(max(self.tiers) - operands) > MOST_TOKENS:
            most = max(n for n in range(MOST_TOKENS) if longest(n) <= MOST_TOKENS) + operands
            raise DataError(f"--tiers must be at most {most} {self.count} with --target {self.target}, got "
                            f"{max(self.tiers)}: a sample of more can take over {MOST_TOKENS} tokens, the largest "
                            "block a preset trains on")
        return self

    @classmethod
    def from_meta(cls, meta):
        if not isinstance(meta, dict):  # ('field' in "x" or in a list finds none: it would read as the default regime)
            raise DataError(f"a regime is a dict of its fields, not {type(meta).__name__}")
        return cls(**{f.name: meta[f.name] for f in dataclasses.fields(cls) if f.name in meta})

    @property
    def name(self):
        """A short label of the regime, e.g. 'mod11-answer' or 'int-steps'."""
        return f"{'int' if self.field == 'int' else f'mod{self.modulus}'}-{self.target}"

    @property
    def folder(self):
        """The name of a folder of its data, as grid.py names them: 'int-steps-operators-4-5-6'."""
        return f"{self.name}-{self.count}-{'-'.join(map(str, self.tiers))}"

    @property
    def label(self):
        """The name with the tiers, e.g. 'mod11-answer, tiers 4,5,6 operators', and the range of int numbers
        where it is not the default: 'int-steps, tiers 4,5,6 operands, max_operand 10, max_value 999'."""
        limits = self.field == "int" and (self.max_operand, self.max_value) != (Task.max_operand, Task.max_value)
        return f"{self.name}, tiers {','.join(map(str, self.tiers))} {self.count}" + \
            f", max_operand {self.max_operand}, max_value {self.max_value}" * limits  # (unless the defaults)

    @property
    def top(self):
        """The largest number that can occur."""
        return self.max_value if self.field == "int" else self.modulus - 1

    def vocab(self):
        return [*SYMBOLS, *map(str, range(self.top + 1))]

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

    def most_new_tokens(self, prompt):
        """The most tokens a right solution of the prompt 'EXPR =' can take: the answer alone, or, for
        the steps of an expression of L tokens with n operators, (L - 2) + (L - 4) + ... + (L - 2n)
        (each step takes at least one operator and one number away), n - 1 '=' between them and <eos>."""
        if self.target == "answer":
            return 1
        tokens = prompt.split()[:-1]
        L, n = len(tokens), sum(t in OPS for t in tokens)
        return n * L - n * n

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

        try:
            node = parse_tree(text)
            check(node)  # (recursive too: '1 + 1 + ... + 1' is a tree as deep as it is long)
        except RecursionError:
            raise DataError("an expression nested too deeply to read") from None
        return node


# The regime `prepare_data.py arithmetic` and --preset=arith generate unless told otherwise: the one the paper
# describes (integer operands, values past 100, a step-by-step solution, and "6 operands" = 7 numbers: see the README),
# at its hardest tier alone: one model per tier gave LLaMA's 41.3% and LIMe 17.6 points ahead on a GPU (README;
# --tiers 4 for the control)
DEFAULTS = dict(field="int", count="operators", tiers=(6,), target="steps")
# The CPU quick start (--preset=tiny) keeps the task as this repo first made it: LIMe leads there within minutes
QUICK_START = Task()


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
    shown = repr(text) if len(text) <= 200 else f"{text[:200]!r}..."  # (a FILE: --start of megabytes: not all of it)

    def parse(level):  # level 1: + -, level 2: * /, level 3: a number or ( ... )
        nonlocal pos
        if level == 3:
            tok = tokens[pos] if pos < len(tokens) else "end of input"
            pos += 1
            if tok == "(":
                node = parse(1)
                if pos >= len(tokens) or tokens[pos] != ")":
                    raise DataError(f"missing ')' in {shown}")
                pos += 1
                return node
            if not (tok.isascii() and tok.isdigit()):  # (not '²', a digit that int() does not read)
                raise DataError(f"expected a number, got {tok[:40]!r} in {shown}")
            if len(tok) > len(str(LARGEST)):  # (nor 5000 digits, past what int() reads)
                raise DataError(f"a number of {len(tok)} digits, past every task's range, in {text[:40]!r}...")
            return int(tok)
        node = parse(level + 1)
        while pos < len(tokens) and PRECEDENCE.get(tokens[pos]) == level:
            op = tokens[pos]
            pos += 1
            node = (op, node, parse(level + 1))
        return node

    node = parse(1)
    if pos != len(tokens):
        raise DataError(f"unexpected {tokens[pos][:40]!r} in {shown}")
    return node


def generate(task, seed, train_size, test_size):
    """{'train': [lines], 'test_4': [lines], ..., 'val_4': [lines], ...}: train_size samples per tier
    in train, test_size per tier in each test and validation split. No expression occurs twice
    across splits, nor is a scored one a step of a training solution: validation, for choosing settings, is as
    unseen as the test."""
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
                    raise UsageError(f"tier {n} has too few distinct expressions for {test_size} unseen ones: "
                                    f"lower --test-size or --train-size")
            out[f"{split}_{n}"] = lines
    # NOTE with several tiers, a longer training solution reduces to shorter expressions ('2 + 4 * 1 / 5 = 2 + 4 / 5
    # = ...'): one that is scored would have its whole solution in training. Such a line is drawn again, in its place,
    # from a generator of its own, so that every other line stays what this code made before it looked for them
    learned, again = written(out["train"]), random.Random(f"{seed} again")
    for name, lines in out.items():
        for i in range(len(lines)) if name != "train" else ():
            tries = 0
            while lines[i].split(" = ")[0] in learned:
                line = task.solution(task.random_expression(again, int(name.split("_")[1])))
                expr, tries = line.split(" = ")[0], tries + 1
                if expr not in seen and expr not in learned:
                    seen.add(expr)
                    lines[i] = line
                elif tries > 100 * test_size:
                    raise UsageError(f"{name.replace('_', ' tier ')} has too few expressions that are no step of a "
                                     "training solution: lower --test-size or --train-size")
    return out


def written(train):
    """Every expression that training lines write before an answer, each prompt and each step: a set (150k lines)."""
    return {expr for line in train for expr in line.split(" = ")[:-1]}


# meta.json's 'sha256', which prepare() writes and load() checks: {'train.txt': hex, 'test_4.txt': hex, ...,
# 'meta.json': hex}, a sha256 of each split's text and of meta.json's own fields (the regime, the vocabulary, the
# splits' sha256s). A line edited, or moved from one split to another of its tier, reads as a sample all the same:
# only this tells it from what was made. And an edited regime is told from damaged lines, so that no advice rebuilds
# the edited one in place of the data


def sha256(text):
    return hashlib.sha256(text.encode()).hexdigest()


def meta_sha256(meta):
    """The sha256 of meta.json's fields, all but this one (meta['sha256']['meta.json'])."""
    return sha256(json.dumps({**meta, "sha256": {k: v for k, v in meta["sha256"].items() if k != "meta.json"}},
                             sort_keys=True))


SIZES = dict(seed=0, train_size=50_000, test_size=1000)  # the generator's, unless told otherwise
NOT_DATA = " but the data's files go by that name: move it away"  # (check_a_file's end)
FILES = re.compile(r"(train|(test|val)_\d+)\.txt|meta\.json")  # what a data folder of the task holds
UNFINISHED = "unfinished"  # there while prepare() writes a folder: one without meta.json is then its own, cut short


def regime(meta):
    """What makes a folder's data what it is: the task, and the generator's seed and sizes (where known)."""
    sizes = {k: meta[k] for k in SIZES if k in meta}  # (an old run's: none)
    if sizes and len(sizes) < len(SIZES):  # some, not all: a key lost, and the regime no longer compared at all
        raise DataError(f"it has no {next(k for k in SIZES if k not in sizes)!r}")
    fields = [f.name for f in dataclasses.fields(Task)]
    lost = [k for k in fields if k not in meta]
    if lost and len(lost) < len(fields):  # some, not all (a meta.json from before them has none): one lost would read
        raise DataError(f"it has no {lost[0]!r}")  # as its default, another regime, whose rebuild replaces this one
    for k, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise DataError(f"its {k!r} is {v!r}, not a whole number")
    return {**dataclasses.asdict(Task.from_meta(meta)), **sizes}


def regime_of(task, seed, train_size, test_size):
    """The regime (as regime() reads it from a meta.json) of the data that generate() makes of these."""
    return {**dataclasses.asdict(task), "seed": seed, "train_size": train_size, "test_size": test_size}


def describe(regime):
    """'int-steps, tiers 4,5,6 operands (seed 0; 50000 train, 1000 test, 1000 val a tier)'."""
    sizes = f"seed {regime['seed']}; {regime['train_size']} train, {regime['test_size']} test, {regime['test_size']} " \
            "val a tier" if "seed" in regime else "seed and sizes not recorded"
    return f"{Task.from_meta(regime).label} ({sizes})"


def command(regime, data_dir):
    """The prepare_data.py command that builds `regime`'s data in data_dir."""
    t, default = Task.from_meta(regime), Task()
    flags = [f"--data-dir {shlex.quote(str(data_dir))}", f"--field {t.field}", f"--count {t.count}",
             f"--tiers {','.join(map(str, t.tiers))}", f"--target {t.target}"]
    flags += [f"--modulus {t.modulus}"] * (t.field == "mod" and t.modulus != default.modulus)
    flags += [f"--max-operand {t.max_operand} --max-value {t.max_value}"] * (
        t.field == "int" and (t.max_operand, t.max_value) != (default.max_operand, default.max_value))
    flags += [f"--{k.replace('_', '-')} {regime[k]}" for k in SIZES if regime.get(k, SIZES[k]) != SIZES[k]]
    return "python prepare_data.py arithmetic " + " ".join(flags)


def mark_unfinished(data_dir, regime):
    """The marker prepare() leaves while it writes data_dir: it names the regime it is making (see finishing())."""
    note = "prepare_data.py was writing this folder: the same command finishes it"
    atomic_write(Path(data_dir) / UNFINISHED, lambda f: f.write(json.dumps(dict(note=note, regime=regime)).encode()))


def finishing(data_dir):
    """The command that finishes data_dir, where a preparation was cut short as it wrote it: its marker names the
    regime it was making (a folder's name need not: a grid's or a user's). None where there is no such marker (or
    one written before markers named it)."""
    try:
        made = read_json(Path(data_dir) / UNFINISHED, keys=("regime",))["regime"]
        if not (isinstance(made, dict) and {"tiers", *SIZES} <= made.keys()):  # (as prepare writes it: whole)
            return None
        return command(regime(made), data_dir)  # (regime(): the sizes are whole numbers, the task a task)
    except (DataError, KeyError, TypeError, ValueError):  # (none, an old marker, or a regime that is no task's)
        return None


def damaged_line(path, i, e, meta):
    """The DataError for line i (from 0) of a split that is not a sample of the task, with the command that
    makes the folder's data again."""
    return DataError(f"{path}, line {i + 1}: not a sample of the task ({e}): rebuild it with "
                     f"`{command(regime(meta), Path(path).parent)} --overwrite`")


def line_problem(task, line, tiers, solve):
    """Why `line` is not a sample of `task` in one of `tiers`, or None: its expression's operators and its '='s, and
    with `solve` its expression and solution, worked out again (a split that is scored: its answers the regime's)."""
    steps = line.split(" = ")
    expr = task.parse(steps[0]) if solve else None  # (DataError: not an expression, or a step the regime forbids)
    n, ops = sum(map(steps[0].count, OPS)), [k - (task.count == "operands") for k in tiers]
    if n not in ops:
        return f"its expression has {n} operators, not {' or '.join(map(str, ops))} as in meta.json's tier" \
               f"{'s' * (len(tiers) > 1)} {','.join(map(str, tiers))} {task.count}"
    if len(steps) - 1 != (n if task.target == "steps" else 1):
        return f"it has {len(steps) - 1} '=', where meta.json's target {task.target} writes " \
               f"{n if task.target == 'steps' else 1} for its {n} operators"
    right = task.solution(expr) if solve else line
    return None if right == line else f"its solution is not the one of meta.json's regime {task.name}, which " \
                                      f"ends '= {right.rsplit(' = ', 1)[-1]}'"


def holds(data_dir):
    """The regime (see regime()) of the data in data_dir, or None where it holds none of the task's
    files; a DataError where they are unfinished or damaged."""
    data_dir = Path(data_dir)
    if not (data_dir.is_dir() and any(FILES.fullmatch(p.name) for p in data_dir.iterdir())):
        return None
    return regime(load(data_dir, every_line=False)[3])  # (its callers compare every line: edited() says where)


def edited(data_dir, task, seed, train_size, test_size):
    """Where data_dir, whose meta.json names this data, holds other lines than this code makes of it: '<data_dir>
    holds other lines than ...: line 7 of its train.txt', or None. The data is made again and compared line by line
    (seconds at the paper's size); a split that is not there is not compared: load() refuses a folder that lacks
    one, but for the validation split of a folder made before it existed."""
    for name, lines in generate(task, seed, train_size, test_size).items():
        path = Path(data_dir) / f"{name}.txt"
        there = path.read_text().splitlines() if path.exists() else lines  # (as load() reads it)
        if there != lines:
            i = next((i for i, (a, b) in enumerate(zip(there, lines)) if a != b), min(len(there), len(lines)))
            return (f"{data_dir} holds other lines than this code makes of the data its meta.json names, "
                    f"{describe(regime_of(task, seed, train_size, test_size))} (edited, or made by another version): "
                    f"line {i + 1} of its {path.name}")
    return None


def not_ours(data_dir):
    """'<data_dir> holds train.txt, ... but no meta.json ...' where data_dir holds files by the data's names that no
    preparation cut short left (no marker): a user's, never ours to replace unasked; else None."""
    data_dir = Path(data_dir)
    meta = data_dir / "meta.json"  # (a link to nowhere too: not "holds meta.json ... but no meta.json"; prepare
    # refuses it as not a file)
    # NOTE the marker is ours only as prepare writes it (finishing() reads it): an empty one (`touch`) says nothing
    if meta.exists() or meta.is_symlink() or finishing(data_dir) or not data_dir.is_dir():
        return None
    there = sorted(p.name for p in data_dir.iterdir() if FILES.fullmatch(p.name))
    marker = f" (its {UNFINISHED} is no marker this code wrote)" if (data_dir / UNFINISHED).exists() else ""
    return f"{data_dir} holds {', '.join(there)} but no meta.json, and not as data this code was writing{marker}" \
        if there else None


def prepare(data_dir, task, seed=0, train_size=50_000, test_size=1000, overwrite=False):
    """Generate the task's files in data_dir, meta.json last: a folder without it but with the UNFINISHED marker
    (written first, removed last) was cut short while it was generated, and is generated again. The same data there
    already (made again, and compared line by line) is kept as it is; other data, data that cannot be read, lines
    damaged or edited, or files by the data's names that no preparation left (not_ours), is replaced only with
    `overwrite`, a UsageError otherwise. The folder is held meanwhile: another process preparing it is waited for,
    and what it made is then looked at as above (two at once wrote a folder of files of either, meta.json of one)."""
    data_dir = Path(data_dir)
    check_writable(data_dir)
    with holding(data_dir, "preparing this data?", wait=True):
        prepare_held(data_dir, task, seed, train_size, test_size, overwrite)


def check_preparable(data_dir, task, seed=0, train_size=50_000, test_size=1000):
    """What prepare() refuses of a folder that holds no data yet, found without writing (train.py --dry-run)."""
    check_writable(data_dir)
    replaced(Path(data_dir), regime_of(task, seed, train_size, test_size))


def check_writable(data_dir):
    """A DataError where data_dir cannot be a folder to write in (a file by its name, say)."""
    problem = folder_problem(data_dir)
    if problem:
        raise DataError(f"cannot write {data_dir}: {problem}")


def data_files(data_dir):
    """The files by the data's names in data_dir; a DataError for one that is no file, which --overwrite could neither
    replace nor delete (a folder; also a link to nowhere, which check_a_file's exists() passes)."""
    there = [p for p in sorted(Path(data_dir).glob("*")) if FILES.fullmatch(p.name)]
    odd = next((p for p in there if not p.is_file()), None)
    if odd:
        raise DataError(f"{odd} is not a file{NOT_DATA}")
    return there


def replaced(data_dir, want, overwrite=False):
    """The files by the data's names in data_dir, which a preparation replaces (data_files): an error for files no
    preparation left (not_ours) unless `overwrite`."""
    there = data_files(data_dir)
    theirs = not overwrite and not_ours(data_dir)
    if theirs:  # (the command, not "--overwrite": train.py's presets call this too, and their --overwrite is the run's)
        raise UsageError(f"{theirs}: move them away, or replace them with `{command(want, data_dir)} --overwrite`")
    return there


def prepare_held(data_dir, task, seed, train_size, test_size, overwrite):
    """prepare()'s work, in the folder it holds."""
    want = regime_of(task, seed, train_size, test_size)
    data_files(data_dir)  # (first: not "cannot be read ...: --overwrite to replace it", which could not)
    if not overwrite and (data_dir / "meta.json").exists():  # (without it: unfinished, or not_ours, below)
        try:
            have = holds(data_dir)
        except Unreadable:  # (not damaged: --overwrite would replace data that may be whole)
            raise
        except DataError as e:
            raise UsageError(f"{data_dir} holds arithmetic data that cannot be read ({e}): give another "
                             "--data-dir, or --overwrite to replace it") from None
        change = have == want and edited(data_dir, task, seed, train_size, test_size)
        if change:  # meta.json says this data, a file says otherwise: a line cut, edited or lost
            raise UsageError(f"{change}: give another --data-dir, or --overwrite to replace it")
        if have == want:
            if finishing(data_dir):  # our marker: cut short before it had deleted anything (else a user's file,
                (data_dir / UNFINISHED).unlink()  # or a folder, by its name: not ours to remove, harmless beside data)
            print(f"{data_dir} holds this data already: {describe(have)}")
            return
        if have:
            show = lambda v: "not recorded" if v is None else ",".join(map(str, v)) if isinstance(v, (tuple, list)) \
                else v  # noqa: E731 (as the flags take it: tiers 4,5,6)
            differs = ", ".join(f"{k} {show(have.get(k))} (not {show(v)})" for k, v in want.items() if have.get(k) != v)
            raise UsageError(f"{data_dir} already holds {describe(have)}, with {differs}: give another "
                             "--data-dir, or --overwrite to replace it")
    there = replaced(data_dir, want, overwrite)
    marker = data_dir / UNFINISHED
    data = generate(task, seed, train_size, test_size)
    # what the new data does not replace itself goes first, meta.json with it: from here until the new one is written
    # last, the folder is unfinished (a reader refuses it; see the end of load; the marker says it is ours), and then
    # holds the new data alone
    mark_unfinished(data_dir, want)
    for stale in there:
        if stale.stem not in data:
            stale.unlink()
    texts = {name: "\n".join(lines) + "\n" for name, lines in data.items()}
    for name, lines in data.items():
        path = data_dir / f"{name}.txt"
        atomic_write(path, lambda f: f.write(texts[name].encode()))
        print(f"{path}: {len(lines):,} samples, longest {max(len(l.split()) for l in lines) + 1} tokens")
    meta = dict(vocab=task.vocab(), **{k: want[k] for k in SIZES}, **dataclasses.asdict(task))
    meta["sha256"] = {f"{name}.txt": sha256(text) for name, text in texts.items()}
    meta["sha256"]["meta.json"] = meta_sha256(meta)
    atomic_write(data_dir / "meta.json", lambda f: f.write(json.dumps(meta).encode()))
    marker.unlink()
    print(f"{data_dir / 'meta.json'}: {task.label}, task vocabulary of {len(meta['vocab'])} tokens")


class Vocab:
    """Whitespace tokens <-> ids for the arithmetic task."""

    def __init__(self, tokens):
        self.itos = list(tokens)
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        if not all(isinstance(t, str) for t in self.itos) or "<eos>" not in self.stoi or "=" not in self.stoi:
            raise DataError("its vocabulary is not the task's")
        self.eos = self.stoi["<eos>"]

    def encode(self, text):
        try:
            return [self.stoi[t] for t in text.split()]
        except KeyError as e:
            raise DataError(f"{e.args[0]!r} is not in the task vocabulary ({' '.join(SYMBOLS[1:])}, "
                            f"numbers 0..{len(self.itos) - len(SYMBOLS) - 1})") from None

    def decode(self, ids):
        """An id past the task's tokens reads '<?>': a model's vocabulary may be larger (--init-from a language run)."""
        return " ".join(self.itos[i] if i < len(self.itos) else "<?>" for i in ids)


def load(data_dir, trained_on=None, every_line=True):
    """(vocab, {'train': [lines], 'test_4': [...], 'val_4': [...], ...}, task, meta). A folder written
    before the validation split existed has none. trained_on: the regime a run's config names (a dict);
    a folder that holds another is a DataError, not a score on the wrong task. So is a folder that is
    unfinished or damaged: meta.json missing or unreadable, a split missing or empty, a line of another regime
    than meta.json names (see line_problem), meta.json edited, and, with `every_line`, a split that is not the one
    prepare() wrote, as its sha256 in meta.json says (a line edited or moved, which reads as a sample all the same)."""
    data_dir = Path(data_dir)
    where = f" --data-dir {shlex.quote(str(data_dir))}"
    # NOTE until meta.json is read, no command makes this folder's regime: the default one with --overwrite, pasted
    # as it stands, would replace the data with another regime's. So the flags are the user's to give
    rebuild = f"rebuild it with `{command(trained_on, data_dir)} --overwrite`" if trained_on else \
        f"rebuild it: `python prepare_data.py arithmetic{where}` with the flags that made it, and --overwrite"
    if not (data_dir / "meta.json").exists():
        if (finish := finishing(data_dir)) and (not trained_on or finish == command(trained_on, data_dir)):
            raise DataError(f"{data_dir} was cut short as its data was made: `{finish}` finishes it")
        if finish:  # NOTE not "rebuild it": that would replace the other regime's data, which its command finishes
            raise DataError(f"{data_dir} holds other data than the run's, cut short as it was made (`{finish}` "
                            f"finishes it): give --data-dir the folder this run was trained on")
        if trained_on:
            raise DataError(f"no arithmetic data in {data_dir}: give --data-dir the folder this run was trained "
                            f"on, or {rebuild.removesuffix(' --overwrite`')}`")
        where = "" if data_dir.resolve() == Path("data/arithmetic").resolve() else where
        raise DataError(f"no arithmetic data in {data_dir}: run `python prepare_data.py arithmetic{where}`")
    seen = file_state(data_dir / "meta.json")  # compared once every split is read: see the end
    try:
        meta = read_json(data_dir / "meta.json", keys=("vocab",))
    except Unreadable:  # (not damaged: no rebuild, which would replace data that may be whole)
        raise
    except DataError as e:  # damaged: rebuild it ("prepare it" is refused in a folder of data)
        raise DataError(f"{e}: {rebuild}") from None
    try:
        task = Task.from_meta(meta)
        have = regime(meta)  # (its seed and sizes are checked there)
        vocab = Vocab(meta["vocab"])
        if vocab.itos != task.vocab():  # a token's id is its place in the task's: another order, another meaning
            raise DataError("its vocabulary is not the task's")
    except (DataError, KeyError, TypeError) as e:
        raise DataError(f"{data_dir / 'meta.json'} is damaged ({e}): {rebuild}") from None
    recorded = meta.get("sha256")  # (none in a folder made before prepare() recorded them)
    if recorded is not None and not (isinstance(recorded, dict) and recorded.get("meta.json") == meta_sha256(meta)):
        # NOTE no rebuild: its regime, from which the command would be made, may be what was edited (tiers, seed)
        raise DataError(f"{data_dir / 'meta.json'} is not the one prepare_data.py wrote with this data (its sha256 "
                        "says so): edited? Restore it, or make the data anew in a folder of its own")
    if trained_on:
        want = regime(trained_on)
        differ = [k for k in want if k in have and have[k] != want[k]]
        if differ:  # NOTE not "rebuild it" there: that would replace the other regime's data (a grid's, ...)
            elsewhere = data_dir.parent / Task.from_meta(want).folder
            if elsewhere.resolve() == data_dir.resolve():  # (the regime's name, other sizes: a grid's folder, say)
                elsewhere = elsewhere.with_name(elsewhere.name + "".join(f"-{k}-{want[k]}" for k in differ))
            raise DataError(f"{data_dir} holds {describe(have)}, but the run was trained on {describe(want)}: give "
                            f"--data-dir the run's data, or make it in a folder of its own with "
                            f"`{command(trained_on, elsewhere)}`")
    else:  # the flags that make this folder's data again, from its meta.json
        rebuild = f"rebuild it with `{command(have, data_dir)} --overwrite`"
    names = ["train", *(f"{split}_{k}" for split in ("test", "val") for k in task.tiers)]
    if "field" not in meta and not any((data_dir / f"val_{k}.txt").exists() for k in task.tiers):
        names = names[:1 + len(task.tiers)]  # made before the validation split (and the regime's fields) existed
    lines_in = {name: have["train_size"] * len(task.tiers) if name == "train" else have["test_size"]
                for name in names} if "test_size" in have else {}  # lines per split, where meta.json says (not old)
    splits, shas = {}, {}
    for name in names:
        path = data_dir / f"{name}.txt"
        check_a_file(path, NOT_DATA)  # (a FIFO's size is 0: not "empty")
        if not path.exists() or not path.stat().st_size:
            raise DataError(f"{path} is {'missing' if not path.exists() else 'empty'}: {rebuild}")
        try:
            text = path.read_text()
        except OSError as e:  # (not damaged: no rebuild, which would replace data that may be whole)
            raise Unreadable(f"{path} cannot be read ({e.strerror or e})") from None
        except UnicodeDecodeError as e:
            raise DataError(f"{path} cannot be read ({e}): {rebuild}") from None
        if every_line and recorded is not None:  # (as read: CRLF ends are read as "\n", and so are the same tokens)
            shas[f"{name}.txt"] = sha256(text)
        if not text.endswith("\n"):  # each line ends with one, the last too: a copy or a disk cut it short
            raise DataError(f"{path} is cut short (its last line has no end): {rebuild}")
        splits[name] = text.splitlines()
        # a line of another regime than meta.json's (target, count, tiers): one line, not a run scored on the wrong one
        tiers = task.tiers if name == "train" else (int(name.split("_")[1]),)
        for i, line in enumerate(splits[name]):
            try:
                problem = line_problem(task, line, tiers, solve=name != "train")  # (not train: seconds at 150k lines)
            except DataError as e:
                problem = str(e)
            if problem:
                raise damaged_line(path, i, problem, meta)
        if lines_in and len(splits[name]) != lines_in[name]:  # (lines cut away whole, or added: every line a sample)
            raise DataError(f"{path} holds {len(splits[name])} lines, not the {lines_in[name]} that its meta.json "
                            f"names: {rebuild}")
    # a scored expression is there once (generate): not twice (a copied line would count twice), not in training, as
    # a sample or as a step of a longer one's solution (data made before generate() saw to it, or edited), where its
    # answer would be learned, not worked out
    learned = written(splits["train"])
    where = {}  # a scored expression -> (split, line) of its first place
    for name in names[1:]:
        for i, line in enumerate(splits[name]):
            expr = line.split(" = ")[0]
            if expr in learned:  # (where in train: looked up only now)
                where[expr] = next(("train", j) for j, x in enumerate(splits["train"]) if expr in x.split(" = ")[:-1])
            there = where.setdefault(expr, (name, i))
            if there != (name, i):
                what = "a step of the solution" if there[0] == "train" and \
                    not splits["train"][there[1]].startswith(expr + " = ") else "the expression"
                why = "its answer is learned, not worked out" if there[0] == "train" else "it counts twice"
                raise DataError(f"{data_dir / name}.txt, line {i + 1}: its expression is {what} of line "
                                f"{there[1] + 1} of {there[0]}.txt too, so that {why} (made by an older version "
                                f"of this code, or edited): {rebuild}")
    # NOTE prepare(overwrite=True) deletes meta.json before it replaces a split and writes it anew last: a meta.json
    # unchanged now means that no split read above was replaced meanwhile (else: some of either data, silently)
    if file_state(data_dir / "meta.json") != seen:
        raise DataError(f"{data_dir} changed while it was read (another process preparing it?): give the command again")
    # last (a folder replaced meanwhile is not edited), what passes every check above, each line a sample of its tier:
    # a line edited, or moved between splits
    changed = [f for f, sha in shas.items() if recorded.get(f) != sha]
    if changed:
        raise DataError(f"{data_dir / changed[0]} is not the file prepare_data.py wrote (its sha256 is not the one "
                        f"meta.json records: a line edited, or moved from another split): {rebuild}")
    return vocab, splits, task, meta


def split_sample(line):
    """'EXPR = ... = ANSWER' -> ('EXPR =', ANSWER): the prompt and the right final answer."""
    expr, _, rest = line.partition(" = ")
    return expr + " =", int(rest.split()[-1] if rest else expr)


def final_answer(generated):
    """The number after the last '=' of a generated solution, or None if there is none."""
    tail = generated.split("<eos>")[0].split("=")[-1].split()
    return int(tail[0]) if len(tail) == 1 and tail[0].isdigit() else None



class Data(TaskRows):
    """The arithmetic task, in the regime its folder's meta.json names (`task`). Accuracy on the first
    eval_samples expressions of each tier: `tests` from the test split, `vals` from the validation
    split (empty for a folder made before it existed). Validation loss on the validation rows
    (the test rows, for such an old folder)."""

    def __init__(self, cfg, with_train=True):
        self.vocab, splits, self.task, meta = load(cfg.data_dir, cfg.task)
        self.T, n = cfg.block_size, cfg.eval_samples
        # every line is checked where it is read: a damaged file is one line naming it, not a traceback
        rows = {name: self.encode_rows(Path(cfg.data_dir) / f"{name}.txt", lines[:None if name == "train" else n], meta)
                for name, lines in splits.items() if with_train or name != "train"}
        self.train = rows.get("train", [])
        self.tests = {k: splits[f"test_{k}"][:n] for k in self.task.tiers}
        self.vals = {k: splits[f"val_{k}"][:n] for k in self.task.tiers if f"val_{k}" in splits}
        self.val = [row for k in self.task.tiers for row in rows[f"val_{k}" if self.vals else f"test_{k}"]]
        self.pad, self.vocab_size = self.vocab.eos, len(self.vocab.itos)
        self.train_size, self.regime = len(self.train), regime(meta)
        self.label = describe(self.regime)  # with its seed and sizes: a preset trains on whatever its folder holds
        self.longest = max(len(ids) for split in rows.values() for ids, _ in split)  # test's too: it is generated
        self.last_generated = self.task.target == "answer"  # (a solution's last token is <eos>, which need not be)

    def encode_row(self, line):
        """(token ids, the prompt's length: up to the first '='). A solution ends with <eos>, which is
        learned so that generation stops; an answer has none, so the loss covers the answer alone."""
        end = [self.vocab.eos] if self.task.target == "steps" else []
        return self.vocab.encode(line) + end, line.split().index("=") + 1

    def encode_rows(self, path, lines, meta):
        rows = []
        for i, line in enumerate(lines):
            try:
                split_sample(line)  # a number at the end
                rows.append(self.encode_row(line))
            except (DataError, ValueError) as e:
                raise damaged_line(path, i, e, meta) from None
        return rows

    def metrics(self, model, device, rank=0, world=1, final=True):
        """Accuracy per tier: val_acc_4, ... on the validation split at every evaluation, and acc_4, ...
        on the test split only at the end (`final`), so that the test is not what a run is steered
        by. A folder made before the validation split existed reports the test every time."""
        splits = [("val_", self.vals)] if self.vals else []
        splits += [("", self.tests)] if final or not self.vals else []
        return {f"{prefix}acc_{n}": self.accuracy(model, lines, device, rank, world)
                for prefix, split in splits for n, lines in split.items()}

    def accuracy(self, model, lines, device, rank=0, world=1):
        """Share of expressions whose greedy, open-ended solution (or answer) ends in the right answer."""
        items = [(self.vocab.encode(prompt), answer, self.task.most_new_tokens(prompt))
                 for prompt, answer in map(split_sample, lines)]
        return greedy_accuracy(model, items, lambda ids, answer: final_answer(self.vocab.decode(ids)) == answer,
                               self.vocab.eos, device, rank=rank, world=world, must_stop=self.task.target == "steps")
