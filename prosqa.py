"""
ProsQA (Hao et al. 2024; the paper's Section 5.3.1): questions over a graph of made-up concepts,
answered with the chain of facts that proves the answer. The paper fine-tunes its pretrained
150M models on it and scores open generation on the test split.

    python prepare_data.py prosqa                    # ~18k / 300 / 500 questions -> GPT-2 tokens

A data folder holds each split's JSON file from the Coconut repository and its GPT-2 tokens
(prosqa_<split>.npz). `Data` is what training reads: questions as rows, and accuracy on the
test questions by greedy generation, judged by `correct`.
"""

import hashlib
import json
import shlex
from pathlib import Path

import numpy as np

from cli import DataError, check_a_file
from data import TaskRows, decode_tokens, gpt2_encoding, greedy_accuracy

URL = "https://raw.githubusercontent.com/facebookresearch/coconut/main/data"
SPLITS = ("train", "valid", "test")

# The files (Hao et al. 2024): questions over a graph of made-up concepts, answered with the path
# that proves the answer. The files come from the Coconut repository, whose layout we follow:
#   <eot>Every shumpus is a rempus. ... Is Tom a lempus or scrompus?\n      <- the prompt
#   Tom is a terpus.\nEvery terpus is a brimpus.\nEvery brimpus is a lempus.\n### Tom is a lempus.<eot>


def check(path):
    """The records of a ProsQA file. A DataError unless it is a JSON list of objects, each with a
    `question` (text), its reasoning `steps` (a list of texts) and an `answer` (text)."""
    name = Path(path).name.removesuffix(".part")
    if Path(path).exists() and not Path(path).is_file():  # a FIFO, whose read would wait for a writer forever
        raise DataError(f"{name} in {Path(path).parent} is not a file")
    try:
        records = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise DataError(f"{name} is missing from {Path(path).parent}") from None
    except OSError as e:
        raise DataError(f"{name} cannot be read ({e.strerror})") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # a JSONDecodeError is a ValueError; nesting too
        raise DataError(f"{name}: not valid JSON ({e})") from None  # deep to parse, a RecursionError
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


def texts(record):
    """(prompt, completion): the question and a newline; then each step on a line of its own, and
    '### ' with the answer. Tokenised apart, so that the prompt ends on a token boundary."""
    return record["question"] + "\n", "".join(step + "\n" for step in record["steps"]) + "### " + record["answer"]


def tokenize(records, enc):
    """(tokens, offsets, prompt_lens): record i is tokens[offsets[i]:offsets[i + 1]], <eot> prompt
    completion <eot> (the pretraining shards also start each document with <eot>); its prompt is
    the first prompt_lens[i] of them, <eot> included."""
    seqs, prompt_lens = [], []
    for record in records:
        prompt, completion = texts(record)
        ids = [enc.eot_token] + enc.encode_ordinary(prompt)
        prompt_lens.append(len(ids))
        seqs.append(ids + enc.encode_ordinary(completion) + [enc.eot_token])
    tokens = np.concatenate(seqs)
    assert tokens.max() < 2**16, "stored as uint16, like the token shards"
    return tokens.astype(np.uint16), np.cumsum([0] + [len(s) for s in seqs]), np.array(prompt_lens)


def command(data_dir):
    """The command that prepares the ProsQA data in data_dir."""
    where = "" if Path(data_dir).resolve() == Path("data/prosqa").resolve() else \
        f" --data-dir {shlex.quote(str(data_dir))}"
    return f"python prepare_data.py prosqa{where}"


def digest(path):
    """The SHA-256 of a file's bytes, in hex (what an .npz records of the JSON file it was made from); None where
    there is no regular file to read."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest() if Path(path).is_file() else None
    except OSError:
        return None


class Stale(DataError):
    """Tokens made from another version of the JSON file beside them."""


def load(data_dir, split, unrecorded_ok=True):
    """One split as a list of (token ids, prompt length), and the end-of-text id. The ids are views
    into one int64 array: 18k Python lists of a few hundred ints each would take several times the memory.
    A DataError unless the file is as prepare_data.py writes it (see `tokenize`); a Stale one where it was made from
    another version of the JSON file beside it, or (unless `unrecorded_ok`) does not record which."""
    path = Path(data_dir) / f"prosqa_{split}.npz"
    if not path.exists():
        raise DataError(f"no ProsQA data in {data_dir}: run `{command(data_dir)}`")
    again = f"; remove it and run `{command(data_dir)}`"  # (which keeps an .npz that is there)
    check_a_file(path, again)  # (np.load would wait on a FIFO forever)
    try:
        with open(path, "rb") as f:  # np.load takes what is not a zip file for a pickle, and refuses it with advice
            head = f.read(4)  # to load it unsafely: not what a damaged file needs
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}{again}") from None
    if head != b"PK\x03\x04":
        raise DataError(f"{path} is " + ("empty" if not head else "not an .npz file (no zip header)") + again)
    try:
        with np.load(path) as f:
            tokens, offsets, prompt_lens, eot = (f[k] for k in ("tokens", "offsets", "prompt_lens", "eot"))
            made_from = str(f["json_sha256"]) if "json_sha256" in f.files else None
    except Exception as e:  # a truncated or foreign file
        raise DataError(f"cannot read {path}: {e}{again}") from None
    for key, a in (("tokens", tokens), ("offsets", offsets), ("prompt_lens", prompt_lens), ("eot", eot)):
        if a.dtype.kind not in "iu" or a.ndim != (0 if key == "eot" else 1):
            raise DataError(f"{path}: {key} is not {'an integer' if key == 'eot' else 'a 1-D integer array'}{again}")
    if not len(prompt_lens):
        raise DataError(f"{path}: no records{again}")
    if len(offsets) != len(prompt_lens) + 1:
        raise DataError(f"{path}: {len(offsets)} offsets for {len(prompt_lens)} records{again}")
    lengths = np.diff(offsets.astype(np.int64))  # (unsigned differences would wrap)
    if offsets[0] != 0 or offsets[-1] != len(tokens) or (lengths < 0).any():
        raise DataError(f"{path}: the offsets do not rise from 0 to the number of tokens{again}")
    wrong = np.flatnonzero((prompt_lens < 1) | (prompt_lens >= lengths))  # no prompt, or nothing after it
    if len(wrong):
        i, n = wrong[0], lengths[wrong[0]]
        raise DataError(f"{path}: record {i}: a prompt of {prompt_lens[i]} tokens, not 1 .. {n - 1} of its {n}{again}")
    if tokens.min() < 0 or tokens.max() > eot:
        raise DataError(f"{path}: token ids outside 0 .. {eot}, the end of text{again}")
    # each record is <eot> ... <eot> with none between: else its offsets or its eot are not the ones it was
    # written with (a record that takes the next one's start; an end that generation never stops at: every answer wrong)
    ends, starts = (tokens == eot).astype(np.int64), offsets[:-1].astype(np.int64)
    wrong = np.flatnonzero((ends[starts] == 0) | (ends[starts + lengths - 1] == 0) |
                           (np.add.reduceat(ends, starts) != 2))
    if len(wrong):
        raise DataError(f"{path}: record {wrong[0]} does not start and end with the end of text ({eot}), with none "
                        f"between{again}")
    # one from before .npz files recorded their JSON's digest: loaded, on Data's count check alone (blind to other
    # records of the same number); prepare_data.py makes it anew (unrecorded_ok=False)
    if made_from is None and not unrecorded_ok:
        raise Stale(f"{path} does not record the JSON file it was made from{again}")
    json_path = path.with_suffix(".json")
    if made_from is not None and digest(json_path) not in (None, made_from):  # (none: no JSON there to compare)
        raise Stale(f"{path} was made from another version of {json_path.name}{again}")
    tokens = tokens.astype(np.int64)
    rows = [(tokens[a:b], int(n)) for a, b, n in zip(offsets[:-1], offsets[1:], prompt_lens)]
    return rows, int(eot)


def correct(completion, answer):
    """Our accuracy rule for ProsQA. `completion`: the text generated after the prompt, up to (not
    including) the first end-of-text. Its answer is all that follows its first '###'; it is right
    when it equals the reference answer once whitespace is normalised in both (every run of spaces,
    tabs and newlines becomes one space, none at either end). Case and punctuation count; a
    completion without '###' is wrong. The reasoning steps before '###' are not scored."""
    if "###" not in completion:
        return False
    return " ".join(completion.split("###", 1)[1].split()) == " ".join(answer.split())


class Data(TaskRows):
    """ProsQA: training on the train split, validation loss on the valid split, and accuracy on the
    first eval_samples questions of the test split, which is where the paper reports it. `tests`
    holds (prompt ids, reference answer, most new tokens): a generated completion is cut at twice the
    longest one in the valid and test splits (not train, which an evaluation need not load)."""

    def __init__(self, cfg, with_train=True):
        self.T, n = cfg.block_size, cfg.eval_samples
        self.val, self.pad = load(cfg.data_dir, "valid")
        self.train = load(cfg.data_dir, "train")[0] if with_train else []
        self.train_size = len(self.train)
        test, records = load(cfg.data_dir, "test")[0], check(Path(cfg.data_dir) / "prosqa_test.json")
        if len(test) != len(records):  # the tokens and the answers they are scored against: one record each
            raise DataError(f"{Path(cfg.data_dir) / 'prosqa_test.npz'} holds {len(test)} questions, "
                            f"prosqa_test.json {len(records)}: remove the .npz and run `{command(cfg.data_dir)}`")
        test, answers = test[:n], [r["answer"] for r in records[:n]]
        most = 2 * max(len(ids) - n_prompt for ids, n_prompt in self.val + test)
        self.tests = [(ids[:n_prompt].tolist(), answer, most) for (ids, n_prompt), answer in zip(test, answers)]
        self.vocab_size = self.pad + 1  # GPT-2's end-of-text is the last of its tokens
        self.longest = max(len(ids) for ids, _ in self.train + self.val + test)
        if with_train:  # NOTE a run needs GPT-2's vocabulary only to score its first evaluation (metrics): without it
            gpt2_encoding()  # (no cache, no network) it would fail there, its steps before lost; so fail here instead

    def metrics(self, model, device, rank=0, world=1, final=True):
        """acc: the share of test questions whose greedy completion ends in the right answer (`correct`)."""
        enc = gpt2_encoding()
        return dict(acc=greedy_accuracy(model, self.tests, lambda ids, answer: correct(decode_tokens(enc, ids), answer),
                                        self.pad, device, rank=rank, world=world))
