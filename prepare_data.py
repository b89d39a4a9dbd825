"""
Downloads, tokenises and generates the data of the LIMe experiments.

    python prepare_data.py fineweb-edu --shards 32   # GPT-2 tokens, ~191 MiB per shard
    python prepare_data.py shakespeare               # ~1 MB of text -> GPT-2 tokens
    python prepare_data.py arithmetic --show 5       # the Arithmetic Expression Task, offline
    python prepare_data.py prosqa                    # ProsQA (~18k questions) -> GPT-2 tokens

What each becomes is in data.py (token shards), arithmetic.py and prosqa.py, which training
reads. Nothing half-written ever takes a final name: downloads stream to `<file>.part`
(resumed with HTTP Range, from its own URL and version of the file only) and every write goes to a temporary file
that is renamed only when whole and verified. What is there already is kept: a file downloaded or made before,
the same arithmetic data; other arithmetic data is refused. --overwrite replaces them.
"""

# cli first: from then on a Ctrl-C is one line, even while torch (seconds to load) is still loading
from cli import (DataError, Parser, UsageError, a_path, atomic_write, check_a_file, failure, folder_problem,
                 holding, one_line_errors)

import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import requests

import arithmetic
import prosqa
from data import check_shard, gpt2_encoding, shard_sets, write_shard

FINEWEB_URL = "https://huggingface.co/datasets/kjj0/finewebedu10B-gpt2/resolve/main"
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_BYTES = 1_115_394  # its size: a server that sends no Content-Length tells no cut
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
CHUNK_BYTES = 1 << 16  # a cut connection loses at most the chunk in flight; progress is told chunk by chunk


# -----------------------------------------------------------------------------
# Downloads


def download(url, dest, verify=None, retries=5, timeout=30, overwrite=False):
    """Stream url to dest via dest.part: resumes with HTTP Range (a .part of this url alone, which dest.part.url
    names, and of the same version of the file, by If-Range), retries transient errors, runs verify(part) before the
    final rename. Returns False if dest was already there (with `overwrite`, fetches it again, and the old file stays
    until the new one is whole)."""
    dest = Path(dest)
    part, source = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.url")
    if dest.exists() and not overwrite:
        return False
    for path in (part, source):
        check_a_file(path, ": move it away")  # (a folder, say: neither resumed nor replaced)
    # the sidecar: the URL, then the validator (ETag or Last-Modified) of the file the .part is the start of, if any
    was, _, validator = (source.read_text(errors="replace") if source.exists() else "an unknown URL").partition("\n")
    if part.exists() and was != url:
        was = was if was.isprintable() else repr(was[:80])  # (a damaged sidecar's bytes: not to the terminal)
        print(f"{part.name}: of {was}, not {url}: downloading it from its first byte", file=sys.stderr)
        part.unlink()  # its rest would be of another file
    elif part.exists() and not (validator.isprintable() and validator.isascii()):  # (no header's value: a traceback)
        print(f"{part.name}: its {source.name} is damaged (the file's version, {validator[:40]!r}): downloading it "
              "from its first byte", file=sys.stderr)
        part.unlink()  # which version its bytes are of is not known
        validator = ""
    made = not dest.parent.exists()  # (made here, it goes again with a download that fails its check)
    for attempt in range(retries + 1):
        have = part.stat().st_size if part.exists() else 0
        try:
            # If-Range: the rest only if the file is still the one the .part began (else the server sends it whole)
            ask = {"Range": f"bytes={have}-", **({"If-Range": validator} if validator else {})} if have else {}
            # NOTE the bytes as the server holds them: a range of a compressed answer (gzip) is no range of the file
            ask["Accept-Encoding"] = "identity"
            with requests.get(url, headers=ask, stream=True, timeout=timeout) as r:
                if r.status_code == 416 and have:  # no byte past the .part's end: it holds the whole file, unless
                    total = content_range(r.headers)[1]  # the file is of another length now (another version)
                    if total in (None, have):
                        break
                    part.unlink()
                    raise requests.ConnectionError(f"the file is of {total:,} bytes now, its .part of {have:,}")
                if r.status_code in TRANSIENT_STATUS:
                    raise requests.ConnectionError(f"HTTP {r.status_code}")
                if r.status_code not in (200, 206):  # (a 4xx; a 204 or a redirect to nowhere: no file either)
                    raise DataError(f"{url}: HTTP {r.status_code}")
                if r.headers.get("Content-Type", "").lower().startswith("text/html"):  # no file of ours is a web page
                    raise DataError(f"{url}: the server sent a web page (Content-Type: {r.headers['Content-Type']}), "
                                    "not the file: a login or proxy page?")
                if r.status_code == 206 and checked_validator(r.headers) not in ("", validator) and validator:
                    part.unlink()  # NOTE the rest of another version (a proxy that takes Range, not If-Range)
                    raise requests.ConnectionError("the file changed on the server since its .part began")
                if r.status_code == 206 and content_range(r.headers)[0] not in (None, have):
                    part.unlink()  # NOTE appended, another range would make a file of the right length, and wrong
                    raise requests.ConnectionError("the server sent another range than the rest of the .part")
                if r.status_code != 206:  # the server ignored Range, or the file changed since (If-Range): start again
                    have = 0
                    validator = checked_validator(r.headers)
                length = r.headers.get("Content-Length", "")  # (none, or not a number: no size to check against)
                total = have + (int(length) if length.isdigit() and length.isascii() else 0)
                progress = Progress(dest.name, have, total)
                dest.parent.mkdir(parents=True, exist_ok=True)  # only now: a failed first request leaves no folder
                with open(part, "ab" if have else "wb", buffering=0) as f:  # (unbuffered: nothing to fail at close)
                    if not have:  # (after the truncation: never an old .part under the new URL)
                        atomic_write(source, lambda s: s.write(f"{url}\n{validator}".encode()))
                    for block in r.iter_content(CHUNK_BYTES):
                        append(f, block, part)
                        progress.update(len(block))
                progress.done()
                if part.stat().st_size < total:
                    raise requests.ConnectionError("connection closed early")
            break
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
            if attempt == retries:
                again = "run again to resume" if part.exists() else "run again to try again"
                raise DataError(f"{url}: {failure(e)} (gave up after {retries} retries; {again})")
            wait = min(2**attempt, 30)
            # (on a terminal, a new line first: the progress line may be half drawn)
            print("\n" * sys.stderr.isatty() + f"{dest.name}: {failure(e)}; retrying in {wait}s", file=sys.stderr)
            time.sleep(wait)
        except (requests.RequestException, ValueError) as e:  # an answer no retry mends: a redirect loop, one to
            raise DataError(f"{url}: {failure(e)} ({type(e).__name__})") from None  # ftp:// or to no URL, ...
    if verify is not None:
        try:
            verify(part)
        except DataError:
            part.unlink(missing_ok=True)  # a corrupt file is never left behind to be resumed or renamed
            source.unlink(missing_ok=True)
            if made and not any(dest.parent.iterdir()):
                dest.parent.rmdir()
            raise
    os.replace(part, dest)
    source.unlink(missing_ok=True)
    return True


def content_range(headers):
    """(first byte, the file's length) by an answer's Content-Range: 'bytes 100-199/200' (206), 'bytes */200' (416);
    None for what it does not say."""
    m = re.fullmatch(r"bytes (?:(\d+)-\d+|\*)/(\d+|\*)", headers.get("Content-Range", "").strip(), flags=re.ASCII)
    return (int(m[1]) if m and m[1] else None), (int(m[2]) if m and m[2] != "*" else None)


def checked_validator(headers):
    """What tells this version of a file from the next, for If-Range: a strong ETag, else Last-Modified, else ""
    (a weak ETag, W/"...", never matches in If-Range: a resume would then always start over)."""
    etag = headers.get("ETag", "")
    return etag if etag and not etag.startswith("W/") else headers.get("Last-Modified", "")


def append(f, block, part):
    """All of `block` written to the unbuffered file `f`, the .part of a download; a full disk is a DataError."""
    view = memoryview(block)
    try:
        while view:  # (a write may take part of it, the part the disk had room for)
            view = view[f.write(view):]
    except OSError as e:  # what is in the .part stays: the same command resumes from there
        raise DataError(f"cannot write {part}: {e.strerror}; make room and run the same command again to resume") \
            from None


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


# -----------------------------------------------------------------------------
# The data sets


def refuse_other_shards(data_dir, name):
    """A UsageError where data_dir holds another data set's token shards than `name`'s: a run would read both."""
    others = sorted(shard_sets(data_dir) - {name}) if Path(data_dir).is_dir() else []
    if others:
        raise UsageError(f"{data_dir} holds the token shards of other data ({', '.join(f'{s}_*' for s in others)}): "
                         f"give {name} a --data-dir of its own")


def prepare_fineweb(data_dir, shards, base_url=FINEWEB_URL, overwrite=False):
    refuse_other_shards(data_dir, "finewebedu")
    names = ["finewebedu_val_000000.bin"] + [f"finewebedu_train_{i:06d}.bin" for i in range(1, shards + 1)]
    for name in names:
        dest = Path(data_dir) / name
        fetched = download(f"{base_url.rstrip('/')}/{name}", dest, verify=check_shard, overwrite=overwrite)
        print(f"{dest}: {kept_shard(dest):,} tokens{'' if fetched else ' (already there)'}")  # (fetched: checked)


def prepare_shakespeare(data_dir, url=SHAKESPEARE_URL, enc=None, val_fraction=0.1, overwrite=False):
    """Tiny Shakespeare as GPT-2 tokens: the first 90% of the text is train, the rest val."""
    refuse_other_shards(data_dir, "shakespeare")
    text_path = Path(data_dir) / "input.txt"
    shards = {split: Path(data_dir) / f"shakespeare_{split}_000000.bin" for split in ("train", "val")}
    if all(p.exists() for p in shards.values()) and not overwrite:
        for path in shards.values():
            print(f"{path}: {kept_shard(path):,} tokens (already there)")
        return

    def check(part):
        size = part.stat().st_size
        if url == SHAKESPEARE_URL and size != SHAKESPEARE_BYTES:
            raise DataError(f"{text_path}: {size:,} bytes, not the {SHAKESPEARE_BYTES:,} of Tiny Shakespeare " +
                            ("(a download cut short?): run the same command again" if size < SHAKESPEARE_BYTES else
                             "(another file at its URL?)"))
        split_text(part, val_fraction)

    download(url, text_path, verify=check, overwrite=overwrite)
    parts = split_text(text_path, val_fraction)  # (one downloaded, or one of your own put there)
    enc = enc or gpt2_encoding()
    for path in shards.values():  # NOTE both go before either is made: cut short between the two, the folder would
        path.unlink(missing_ok=True)  # hold a shard of each text, which the same command then kept as the data
    for split, part in zip(shards, parts):
        tokens = [enc.eot_token] + enc.encode_ordinary(part)  # documents start with end-of-text
        write_shard(shards[split], tokens)
        print(f"{shards[split]}: {len(tokens):,} tokens")


def split_text(path, val_fraction):
    """(train text, val text) of the file at `path`: DataError unless it is UTF-8 with text for both."""
    name = Path(str(path).removesuffix(".part"))  # (a download is checked before it takes its name)
    fix = "" if name != Path(path) else ": put a text there, or --overwrite to download it again"
    if Path(path).exists() and not Path(path).is_file():  # a FIFO, whose read would wait for a writer forever; a
        raise DataError(f"{name} is not a file: move it away")  # folder, which no download could replace
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{name} cannot be read as UTF-8 text ({e}){fix}") from None
    cut = int(len(text) * (1 - val_fraction))
    if not text[:cut] or not text[cut:]:  # (a shard of the end-of-text token alone trains on nothing)
        raise DataError((f"{name} is empty" if not text else f"{name} holds only {len(text)} character(s), too few "
                         "for a train and a val split") + fix)
    return text[:cut], text[cut:]


def kept_shard(path):
    """check_shard of a shard made or downloaded before: a damaged one says how to replace it."""
    try:
        return check_shard(path)
    except DataError as e:
        raise DataError(f"{e}: remove it, and the same command makes it anew") from None


def prepare_prosqa(data_dir, base_url=prosqa.URL, enc=None, overwrite=False):
    """Download the three splits (resumable, each checked before it takes its name), then tokenise
    each into prosqa_<split>.npz."""
    enc = enc or gpt2_encoding()  # first: without the vocabulary there is no point in downloading
    for split in prosqa.SPLITS:
        dest = Path(data_dir) / f"prosqa_{split}.json"
        fetched = download(f"{base_url.rstrip('/')}/{dest.name}", dest, verify=prosqa.check, overwrite=overwrite)
        try:
            records = prosqa.check(dest)
        except DataError as e:  # (one downloaded before, damaged since: one downloaded now is checked already)
            raise DataError(f"{e}: remove {dest}, and the same command downloads it anew") from None
        path = dest.with_suffix(".npz")
        if path.exists() and not fetched and not overwrite:
            # kept, as made before: checked, not said to be there whole when it is cut short or of other records
            try:
                kept = len(prosqa.load(data_dir, split, unrecorded_ok=False)[0])
            except prosqa.Stale:  # made from a JSON file edited or copied in since, or not known which: made anew
                print(f"{path}: not made from this {dest.name}, or not known to be: made anew")
            else:
                if kept != len(records):
                    raise DataError(f"{path} holds {kept} questions, {dest.name} {len(records)}: remove the .npz and "
                                    f"run `{prosqa.command(data_dir)}`")
                print(f"{dest}: {len(records):,} records; {path.name} (already there)")
                continue
        tokens, offsets, prompt_lens = prosqa.tokenize(records, enc)
        atomic_write(path, lambda f: np.savez(f, tokens=tokens, offsets=offsets, prompt_lens=prompt_lens,
                                              eot=np.array(enc.eot_token), json_sha256=np.array(prosqa.digest(dest))))
        print(f"{dest}: {len(records):,} records{'' if fetched else ' (already there)'}; {path.name}: "
              f"{len(tokens):,} tokens, longest record {np.diff(offsets).max()}")


def main(argv=None):
    p = Parser(description=__doc__)
    p.add_argument("name", choices=["fineweb-edu", "shakespeare", "arithmetic", "prosqa"], help="dataset to prepare")
    p.add_argument("--data-dir", type=a_path, help="output folder (default: data/NAME)")
    scopes = {}  # flag -> what it is for, as its help begins ("arithmetic, int: ..."); given for other data: refused

    def add(flag, scope, help, **kw):
        scopes[flag] = scope.split(", ")
        p.add_argument(flag, help=f"{scope}: {help}", **kw)

    add("--shards", "fineweb-edu", "train shards of 1e8 tokens (32: 3.2B, the 150m preset's 3.1B and some)",
        type=int, default=32)
    add("--base-url", "fineweb-edu, prosqa",
        f"where the files are, for a mirror (default: {FINEWEB_URL}, {prosqa.URL})")
    add("--url", "shakespeare", "where the text is", default=SHAKESPEARE_URL)
    add("--seed", "arithmetic", "generator seed", type=int, default=0)
    defaults = arithmetic.Task(**arithmetic.DEFAULTS)
    add("--field", "arithmetic", "int (whole numbers, exact division) or mod (the integers mod --modulus)",
        default=defaults.field, choices=arithmetic.CHOICES["field"])
    add("--modulus", "arithmetic, mod", "the prime P (default 11, as Feng et al.)", type=int, default=defaults.modulus)
    add("--max-operand", "arithmetic, int", "operands are drawn from 1..this", type=int, default=defaults.max_operand)
    add("--max-value", "arithmetic, int", "every value stays in 0..this", type=int, default=defaults.max_value)
    add("--count", "arithmetic", "what a tier's number counts", default=defaults.count,
        choices=arithmetic.CHOICES["count"])
    add("--tiers", "arithmetic", "the tiers to generate, comma-separated (default %(default)s)",
        default=",".join(map(str, defaults.tiers)))
    add("--target", "arithmetic", "learn the whole step-by-step solution, or only the answer after '='",
        default=defaults.target, choices=arithmetic.CHOICES["target"])
    add("--train-size", "arithmetic", "training samples per tier", type=int, default=50_000)
    add("--test-size", "arithmetic", "samples per tier in the test split, and again in the validation split",
        type=int, default=1000)
    add("--show", "arithmetic", "print K training samples", type=int, default=0, metavar="K")
    p.add_argument("--overwrite", action="store_true", help="replace what --data-dir holds: data of another regime "
                                                            "(arithmetic); files downloaded or made before (the rest)")
    goes_on = ": run the same command again to go on (a partial download resumes from its .part file)"
    with one_line_errors("prepare_data.py", interrupted=goes_on):
        args, given = p.parse_args(argv), p.given(argv)
        for flag, scope in scopes.items():  # a flag for other data would be ignored: say so instead
            dest, fields = flag[2:].replace("-", "_"), [f for f in scope if f in arithmetic.CHOICES["field"]]
            if dest not in given:
                continue
            if args.name not in scope:
                names, field = [s for s in scope if s not in fields], f" (--field={fields[0]})" if fields else ""
                raise UsageError(f"{flag} is for {' and '.join(names)} data{field}, not {args.name}")
            if fields and args.field not in fields:
                raise UsageError(f"{flag} is for --field={fields[0]}, not --field={args.field}")
        data_dir = args.data_dir or os.path.join("data", args.name)
        for flag, value in (("--url", args.url), ("--base-url", args.base_url)):
            if value is None:
                continue
            if not value.isprintable():  # (a line break: the URL in every message would span two lines)
                raise UsageError(f"{flag}={value!r}: not a URL (it holds a line break or another control character)")
            if not value.startswith(("http://", "https://")):  # (requests: MissingSchema)
                local = f": for a file here, put it in {data_dir} as input.txt" if flag == "--url" else ""
                raise UsageError(f"{flag}={value}: give an http(s) URL{local}")
            try:
                requests.Request("GET", value).prepare()  # its form, checked without a connection
            except requests.RequestException as e:
                raise UsageError(f"{flag}={value}: not a URL ({e})") from None
        if folder_problem(data_dir):
            raise UsageError(f"--data-dir={data_dir}: {folder_problem(data_dir)}")
        if args.name == "fineweb-edu" and not 1 <= args.shards <= 99:
            raise UsageError(f"--shards must be 1..99, got {args.shards}")
        for key, least in (("train_size", 1), ("test_size", 1), ("show", 0), ("seed", 0)):  # (meta.json's seed: >= 0)
            if args.name == "arithmetic" and getattr(args, key) < least:
                raise UsageError(f"--{key.replace('_', '-')} must be >= {least}, got {getattr(args, key)}")
        if args.name == "arithmetic":
            try:
                tiers = tuple(int(t) for t in args.tiers.split(","))
            except ValueError:
                raise UsageError(f"--tiers must be numbers separated by commas, e.g. 4,5,6; got {args.tiers!r}")
            try:
                task = arithmetic.Task(args.field, args.modulus, args.max_operand, args.max_value, args.count, tiers,
                                       args.target).check_fits()
            except DataError as e:
                raise UsageError(str(e)) from None
        if args.name != "arithmetic":  # (arithmetic.prepare holds it itself)
            # (two at once: each renamed or resumed the other's .part)
            with holding(data_dir, "a prepare_data.py preparing it? wait for it to end, or give another --data-dir"):
                if args.name == "fineweb-edu":
                    prepare_fineweb(data_dir, args.shards, args.base_url or FINEWEB_URL, overwrite=args.overwrite)
                elif args.name == "prosqa":
                    prepare_prosqa(data_dir, args.base_url or prosqa.URL, overwrite=args.overwrite)
                else:
                    prepare_shakespeare(data_dir, args.url, overwrite=args.overwrite)
        else:
            arithmetic.prepare(data_dir, task, args.seed, args.train_size, args.test_size, args.overwrite)
            if args.show > 0:
                train = arithmetic.load(data_dir)[1]["train"]
                for line in train[:: max(1, len(train) // args.show)][: args.show]:
                    print(line)  # spread over the file, so every tier shows


if __name__ == "__main__":
    main()
