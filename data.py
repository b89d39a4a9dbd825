"""
The data that training and evaluation read, and the evaluation every data set shares.

Token data sets (FineWeb-Edu, Tiny Shakespeare) are shards in the llm.c format: a 1024-byte
header of 256 int32 (magic 20240520, version 1, token count) followed by uint16 tokens.
Training reads random windows of them; validation, fixed windows from the start of the
validation shard. A task (arithmetic.py, prosqa.py) is a list of samples, each a prompt and
what follows it, padded into rows with the loss on what follows the prompt only. Batches are
a pure function of (seed, step, rank), so a resumed run sees exactly the batches an
uninterrupted one would.

Every data set has the same face: batch(rng, n) for training, val_batches() for the loss,
metrics() for what else it scores (a task's accuracy), and val_sequences() for analysis.
"""

import math
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cli import DataError, atomic_write, failure
from generation import generate

MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 1024


def batch_rng(seed, step, micro):
    """The generator of micro-batch `micro` of a step, counted over every process (rank * micro-steps per process + its
    own): one process with 8 micro-steps draws the rows that 8 processes with one each draw."""
    return np.random.default_rng([seed, step, 0, micro])  # (the 0: a rank's place once; one process's rows as before)


# -----------------------------------------------------------------------------
# Token shards


def write_shard(path, tokens):
    tokens = np.asarray(tokens)
    assert tokens.min() >= 0 and tokens.max() < 2**16, "shards hold uint16 tokens"
    header = np.zeros(256, dtype="<i4")
    header[:3] = MAGIC, VERSION, len(tokens)
    atomic_write(path, lambda f: (f.write(header.tobytes()), f.write(tokens.astype("<u2").tobytes())))


def check_shard(path):
    """The tokens of `path`, counted: DataError unless it has a valid header and exactly the tokens it announces,
    at least one."""
    name = Path(path).with_name(Path(path).name.removesuffix(".part"))  # (a download's .part: the shard it becomes)
    if Path(path).exists() and not Path(path).is_file():  # a FIFO, whose open would wait for a writer forever
        raise DataError(f"{name}: not a file")
    try:
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES).ljust(HEADER_BYTES, b"\0"), dtype="<i4")  # (cut short: 0s)
    except OSError as e:  # this user may not read it, say
        raise DataError(f"{name}: cannot be read ({e.strerror})") from None
    if len(header) < 3 or header[0] != MAGIC or header[1] != VERSION:
        raise DataError(f"{name}: not a token shard (bad magic or version in the header)")
    if header[2] < 1:  # (a shard of no tokens trains on nothing)
        raise DataError(f"{name}: holds no tokens (its header announces {header[2]})")
    expected = HEADER_BYTES + 2 * int(header[2])
    size = os.path.getsize(path)
    if size != expected:
        raise DataError(f"{name}: {size} bytes, but its header announces {header[2]} tokens ({expected} bytes)")
    return int(header[2])


class Shard:
    """A shard's tokens, read from the file as they are asked for: len(shard), and shard[a:b] as a uint16 array.
    NOTE not np.memmap: a mapped file cut short under a run (truncated in place) reads as token 0 to the end of its
    last page, and past it ends the process with SIGBUS, no message.
    The file stays open, so a shard replaced by another file (renamed over it) reads as the run began."""

    def __init__(self, path):
        self.path, self.tokens = Path(path), check_shard(path)
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)
        if os.fstat(self.fd).st_size != HEADER_BYTES + 2 * self.tokens:  # (replaced between its check and here)
            raise self.cut_short()

    def __len__(self):
        return self.tokens

    def __getitem__(self, window):
        if not isinstance(window, slice) or window.step not in (None, 1):
            raise TypeError(f"a shard is read in windows of consecutive tokens, shard[a:b], not [{window!r}]")
        start, stop, _ = window.indices(self.tokens)
        size, data = 2 * max(0, stop - start), b""
        while len(data) < size:  # (one read returns 2 GB at most)
            chunk = os.pread(self.fd, size - len(data), HEADER_BYTES + 2 * start + len(data))
            if not chunk:  # past the file's end
                raise self.cut_short()
            data += chunk
        return np.frombuffer(data, dtype="<u2")

    def cut_short(self):
        return DataError(f"{self.path}: cut short while this run read it ({HEADER_BYTES + 2 * self.tokens} bytes "
                         f"when it began, {os.fstat(self.fd).st_size} now): put the shard back as it was")


def shard_paths(data_dir, split):
    """The token shards of one split ('train' or 'val') in data_dir, in name order: <set>_<split>_<number>.bin."""
    return sorted(Path(data_dir).glob(f"*_{split}_*.bin"))


def shard_sets(data_dir):
    """The data sets whose token shards data_dir holds, by the names' first part: {'finewebedu', ...}."""
    return {p.name.rsplit(f"_{split}_", 1)[0] for split in ("train", "val") for p in shard_paths(data_dir, split)}


def load_tokens(data_dir, split, trained=False):
    """All shards of one split ('train' or 'val') of a token dataset: {file name: Shard}, in name order.
    `trained`: those of a run that read them there, evaluated, and may have been moved since."""
    paths = shard_paths(data_dir, split)
    if not paths:
        moved = ": give --data-dir the folder that holds the run's shards now" if trained else ""
        raise DataError(f"no {split} shards in {data_dir}{moved}")
    sets = sorted(shard_sets(data_dir))
    if len(sets) > 1:  # NOTE else a run would train on both, and evaluate on the first by name
        raise DataError(f"{data_dir} holds the token shards of {len(sets)} data sets "
                        f"({', '.join(f'{s}_*' for s in sets)}): give each a folder of its own")
    return {p.name: Shard(p) for p in paths}


class OtherShards(DataError):
    """check_shards' error: its folder holds data, other than the run read (so no hint to prepare it: runs.main)."""


def check_shards(cfg, shards):
    """A DataError unless the shards found, {split: {file name: tokens}}, are the ones the run of `cfg` read, as it
    recorded them (cfg.shards; a new run has none, nor one from before they were recorded): a shard added since (more
    of FineWeb prepared), gone or changed would make a resumed run's batches, or an evaluation's tokens, not its own."""
    for split, now in shards.items():
        saved = (getattr(cfg, "shards", None) or {}).get(split)
        if saved is None or saved == now:
            continue
        name = next(n for n in sorted(now.keys() | saved.keys()) if now.get(n) != saved.get(n))
        change = "is new" if name not in saved else "is gone" if name not in now else \
            f"holds {now[name]:,} tokens, not {saved[name]:,}"
        raise OtherShards(f"{cfg.data_dir} holds other {split} shards than the run read ({name} {change}): put the "
                        "run's shards back, or train a new run on these")


SWAP = threading.Lock()  # gpt2_encoding's, around its swap of tiktoken's fetch


def gpt2_encoding(timeout=30):
    """tiktoken's GPT-2 encoding, its vocabulary fetched on first use with a `timeout` (seconds without a byte)."""
    import requests
    import tiktoken
    import tiktoken.load

    def fetch(path):
        if not path.startswith(("http://", "https://")):
            return read_file(path)
        with requests.get(path, timeout=timeout) as r:
            r.raise_for_status()
            return r.content

    # NOTE tiktoken fetches with requests.get(url), no timeout: a network that stalls would hang every script here
    # until Ctrl-C. So its fetch is swapped for one with a timeout while the encoding loads (its cache, its checks
    # of the files' hashes stay tiktoken's), one thread at a time (else one could put back the other's swap for good)
    with SWAP:
        read_file = tiktoken.load.read_file
        tiktoken.load.read_file = fetch
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise DataError(f"tiktoken could not load the GPT-2 vocabulary (downloaded on first use): {failure(e)}") \
                from None
        finally:
            tiktoken.load.read_file = read_file


def decode_tokens(enc, ids):
    """Text of token ids. An id the encoding does not have (the model's vocabulary is padded past
    GPT-2's 50257, and an untrained model may pick one) reads as U+FFFD rather than failing."""
    known = enc.n_vocab
    return b"".join(enc.decode_single_token_bytes(i) if i < known else "\ufffd".encode() for i in ids).decode(
        "utf-8", errors="replace")


class TokenData:
    """Random windows of block_size + 1 tokens from the train shards; fixed windows from the start
    of the validation shard (the first eval_tokens), so that every run is evaluated on the same tokens.
    `cfg`: a run's config (a TrainConfig, or the one saved with a checkpoint)."""
    train_size = longest = None  # windows, not samples: no epochs, any length fits
    label = regime = None  # one data set, no variants

    def __init__(self, cfg, with_train=True):
        # a saved run evaluated (sample.py, analyze.py: they take --data-dir anew), its shards read in cfg.data_dir;
        # not a run resumed, which reads its own folder
        trained = bool(getattr(cfg, "shards", None)) and not with_train
        found = {"val": load_tokens(cfg.data_dir, "val", trained)}
        if with_train:
            found["train"] = load_tokens(cfg.data_dir, "train")
        # what the run reads, {split: {shard: tokens}}: train.py records it in the run's config, and this checks it
        self.shards = {split: {name: len(tokens) for name, tokens in shards.items()} for split, shards in found.items()}
        check_shards(cfg, self.shards)
        val = next(iter(found["val"].values()))  # (the first validation shard: every evaluation reads its start)
        T = cfg.block_size
        n = min(cfg.eval_tokens, len(val) - 1) // T
        if n < 1:
            raise DataError(f"validation shard in {cfg.data_dir} is shorter than one block of {T}")
        self.val_x = torch.from_numpy(val[: n * T].astype(np.int64)).view(n, T)
        self.val_y = torch.from_numpy(val[1: n * T + 1].astype(np.int64)).view(n, T)
        self.T, self.model_vocab = T, cfg.vocab_size
        # the vocabulary the tokens need, as far as the validation windows tell (for the caller to check against
        # the model; reading every train shard for it would take minutes at FineWeb's size): batch() checks the rest
        self.vocab_size = int(max(self.val_x.max(), self.val_y.max())) + 1
        if with_train:
            self.train = list(found["train"].values())
            self.sizes = np.array([len(s) - T for s in self.train])  # where a window of T + 1 tokens may start
            if self.sizes.min() < 1:
                raise DataError(f"a train shard in {cfg.data_dir} is shorter than one block of {T} and its next token")

    def batch(self, rng, n):
        shard = rng.choice(len(self.train), size=n, p=self.sizes / self.sizes.sum())
        starts = rng.integers(0, self.sizes[shard])
        rows = np.stack([self.train[s][o: o + self.T + 1].astype(np.int64) for s, o in zip(shard, starts)])
        rows = torch.from_numpy(rows)  # (n, T + 1)
        if rows.max() >= self.model_vocab:  # (an embedding lookup past the table would be a traceback mid-run)
            raise DataError(f"token id {int(rows.max())} of a train shard is past the model's --vocab-size="
                            f"{self.model_vocab}, which the validation shard's tokens fit: train a new run with a "
                            "--vocab-size above it")
        return rows[:, :-1], rows[:, 1:]

    def val_batches(self, size, rank, world):
        for i in range(rank * size, len(self.val_x), size * world):
            yield self.val_x[i: i + size], self.val_y[i: i + size]

    def val_sequences(self, n, seq_len):
        """The first n validation windows, seq_len tokens each."""
        return [x[:seq_len] for x in self.val_x[:n]]

    def metrics(self, model, device, rank=0, world=1, final=True):
        return {}  # language: the loss is all


class TaskRows:
    """A task's samples as rows of block_size tokens, the loss only on what follows the prompt.
    A subclass fills `train` and `val` with (token ids ending with the end token, prompt length),
    `pad` (the end token), `train_size`, and `longest` (tokens, the end token included) and
    `vocab_size` for the caller to check against the model; and says what it scores (metrics)."""
    label = regime = None  # a task with variants: what to print about the one loaded, and its fields (a dict)
    shards = None  # samples, not token shards (TokenData)
    # a sample's last token is learned from the one before it, and never read: block_size + 1 tokens fit. True where
    # that last token is what the scoring generates (an answer with no end token after it): then the block holds it
    last_generated = False
    table = None  # every training row, padded, built at the first batch (see batch)

    def collate(self, rows):
        """Inputs padded with the end token; targets only after the prompt, -1 elsewhere."""
        x = torch.full((len(rows), self.T), self.pad)
        y = torch.full((len(rows), self.T), -1)
        for i, (ids, n_prompt) in enumerate(rows):
            x[i, : len(ids) - 1] = torch.tensor(ids[:-1])
            y[i, n_prompt - 1: len(ids) - 1] = torch.tensor(ids[n_prompt:])
        return x, y

    def batch(self, rng, n):
        """collate() of n training rows drawn at random, cut from a table of them all: collating row by row
        took 45 ms for 1024 arithmetic rows on a CPU, longer than the paper's arithmetic model takes a step."""
        if self.table is None:
            lengths = np.array([len(ids) for ids, _ in self.train])
            table = np.full((len(self.train), self.T + 1), self.pad, dtype=np.int32)  # (N, T + 1)
            table[np.arange(self.T + 1) < lengths[:, None]] = np.concatenate([ids for ids, _ in self.train])
            self.table = torch.from_numpy(table), torch.from_numpy(lengths), torch.tensor([p for _, p in self.train])
        table, lengths, prompts = self.table
        i = torch.from_numpy(rng.integers(0, len(self.train), n))
        rows, t = table[i].long(), torch.arange(self.T)  # (n, T + 1), (T,)
        n_ids, n_prompt = lengths[i, None], prompts[i, None]  # each (n, 1)
        x = torch.where(t < n_ids - 1, rows[:, :-1], self.pad)  # (n, T): the sample but its last token
        y = torch.where((t >= n_prompt - 1) & (t < n_ids - 1), rows[:, 1:], -1)  # (n, T): what follows the prompt
        return x, y

    def val_batches(self, size, rank, world):
        for i in range(rank * size, len(self.val), size * world):
            yield self.collate(self.val[i: i + size])

    def val_sequences(self, n, seq_len=None):
        """The first n validation samples, unpadded, without their end token."""
        return [torch.tensor(ids[:-1]) for ids, _ in self.val[:n]]


# -----------------------------------------------------------------------------
# Evaluation: the same fixed validation set for every run, so router modes compare exactly


@torch.no_grad()
def evaluate_loss(model, data, micro_batch_size, device, autocast, rank=0, world=1):
    """Mean cross-entropy over the fixed validation set (summed over processes)."""
    total = torch.zeros(2, device=device, dtype=torch.float64)  # (sum of losses, number of tokens)
    for x, y in data.val_batches(micro_batch_size, rank, world):
        x, y = x.to(device), y.to(device)
        with autocast:
            logits = model(x)[0]
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1,
                                                 reduction="sum")
        total += torch.stack([loss.double(), (y != -1).sum().double()])
    if world > 1:
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


@torch.no_grad()
def greedy_accuracy(model, items, judge, stop, device, batch_size=256, rank=0, world=1, must_stop=False):
    """Share of items (prompt ids, reference, most new tokens) for which judge(generated ids,
    reference) holds. The generation is greedy and open-ended: it ends at the `stop` token (cut off
    before judging) or after the item's most new tokens (or at the end of the block), and is judged on
    what it wrote by then; with `must_stop` (a right one ends with `stop`, within its most new tokens), one that
    wrote its most without `stop` is wrong, and one that the end of the block cut is judged. Prompts of all lengths
    share a batch (generate's `lengths`); sorted by length, so that the prompts in one batch differ little and the
    batch runs little past its own end."""
    items = sorted(items[rank::world], key=lambda item: len(item[0]))
    correct = torch.zeros(2, device=device)  # (right answers, items)
    for i in range(0, len(items), batch_size):
        chunk = items[i: i + batch_size]
        lengths = [len(prompt) for prompt, _, _ in chunk]
        ends = [min(n + most, model.config.block_size) for n, (_, _, most) in zip(lengths, chunk)]
        T = max(lengths)
        idx = torch.tensor([prompt + [stop] * (T - len(prompt)) for prompt, _, _ in chunk], device=device)  # (B, T)
        out = generate(model, idx, max(*ends, T) - T, temperature=0, stop=stop, lengths=lengths)
        for row, n, end, (_, reference, most) in zip(out.tolist(), lengths, ends, chunk):
            row = row[n:end]
            if stop in row:
                row = row[: row.index(stop)]
            elif must_stop and end == n + most:  # NOTE no right one is longer: whatever its text, it did not end
                continue
            correct[0] += bool(judge(row, reference))
        correct[1] += len(chunk)
    if world > 1:
        dist.all_reduce(correct)
    return (correct[0] / correct[1].clamp(min=1)).item()


def evaluate(model, raw_model, data, micro_batch_size, device, autocast, rank=0, world=1, final=True):
    """Validation loss and perplexity, plus what the data set scores besides (data.metrics: a task's
    accuracy). `final`: the end of a run, where a task looks at its test split too. `model` may be
    compiled or wrapped; generation runs on the plain `raw_model`."""
    model.eval()
    # NOTE a DDP forward syncs buffers across processes, so one process with no validation batch (fewer rows
    # than processes x micro-batch) would hang the rest: evaluate through the module it wraps
    plain = model.module if isinstance(model, DistributedDataParallel) else model
    loss = evaluate_loss(plain, data, micro_batch_size, device, autocast, rank, world)
    out = dict(val_loss=loss, val_ppl=math.exp(min(loss, 50)))
    with autocast:
        out.update(data.metrics(raw_model, device, rank, world, final))
    model.train()
    return out
