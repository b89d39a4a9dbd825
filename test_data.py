"""Token data (data.py) and the downloads and tokenisation of prepare_data.py, against a local server."""

import contextlib
import errno
import math
import os
import random
import re
import socket
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import requests
import tiktoken.load
import torch
from urllib3.exceptions import ProtocolError

import prepare_data
from cli import DataError, failure, hold_folder
from conftest import error_of, small_encoding, small_model
from data import (HEADER_BYTES, MAGIC, TaskRows, TokenData, batch_rng, evaluate, evaluate_loss, gpt2_encoding,
                  greedy_accuracy, load_tokens, write_shard)
from generation import generate


def shard_bytes(tokens, magic=MAGIC, count=None, version=1):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    return header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()


def fineweb_files(n_train=2):
    rng = np.random.default_rng(0)
    names = ["finewebedu_val_000000.bin"] + [f"finewebedu_train_{i:06d}.bin" for i in range(1, n_train + 1)]
    return {name: shard_bytes(rng.integers(0, 50257, 5000 + 100 * i)) for i, name in enumerate(names)}


def test_fineweb_download_then_nothing_to_do(serve, tmp_path, capsys):
    files = fineweb_files()
    server = serve(files)
    prepare_data.prepare_fineweb(tmp_path, 2, server.url)
    assert "already there" not in capsys.readouterr().out
    for name, data in files.items():
        assert (tmp_path / name).read_bytes() == data
    assert len(load_tokens(tmp_path, "train")) == 2 and len(load_tokens(tmp_path, "val")["finewebedu_val_000000.bin"]) \
        == 5000
    n = len(server.requests)
    prepare_data.prepare_fineweb(tmp_path, 2, server.url)
    assert len(server.requests) == n  # complete files are not fetched again, and each says so
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.endswith("tokens (already there)") for line in lines)
    assert not list(tmp_path.glob("*.part"))


def test_fineweb_resumes_after_cut_connection(serve, tmp_path, monkeypatch):
    """A download cut short resumes where it stopped (HTTP Range); from its first byte where the server ignores Range,
    and where --overwrite fetches the file anew."""
    monkeypatch.setattr(prepare_data.time, "sleep", lambda s: None)
    monkeypatch.setattr(prepare_data, "CHUNK_BYTES", 1024)
    files = fineweb_files(1)
    server = serve(files, cut_once={"finewebedu_train_000001.bin"})
    prepare_data.prepare_fineweb(tmp_path, 1, server.url)
    data = files["finewebedu_train_000001.bin"]
    assert (tmp_path / "finewebedu_train_000001.bin").read_bytes() == data
    ranges = [r for name, r in server.requests if name == "finewebedu_train_000001.bin"]
    assert len(ranges) == 2 and ranges[0] is None
    resumed_at = int(re.match(r"bytes=(\d+)-$", ranges[1])[1])  # the second request asked only for the rest
    assert 0 < resumed_at <= len(data) // 2
    # a server that ignores Range sends the whole file again: the download starts over, not appended to the part
    other = tmp_path / "other"
    server = serve(files, cut_once={"finewebedu_train_000001.bin"}, ranges=False)
    prepare_data.prepare_fineweb(other, 1, server.url)
    assert (other / "finewebedu_train_000001.bin").read_bytes() == data
    assert [r for name, r in server.requests if name == "finewebedu_train_000001.bin"][1] is not None
    # --overwrite fetches a file anew, from its first byte: a part left beside the old file is not resumed
    files = {**files, "finewebedu_train_000001.bin": data[:1024] + bytes(len(data) - 1024)}  # (a new version)
    (tmp_path / "finewebedu_train_000001.bin.part").write_bytes(data[:2048])
    prepare_data.prepare_fineweb(tmp_path, 1, serve(files).url, overwrite=True)
    assert (tmp_path / "finewebedu_train_000001.bin").read_bytes() == files["finewebedu_train_000001.bin"]


def test_a_part_of_another_url_is_started_over(serve, tmp_path, capsys, monkeypatch, offline_gpt2):
    """A download cut short, then one of another --url into the same folder: the .part of the first is not resumed
    with the rest of the second (a text of two, said to be fine), but started over, with a line that says so."""
    monkeypatch.setattr(prepare_data, "CHUNK_BYTES", 100)  # (a cut keeps the blocks before it)
    a, b = b"Ay, my lord.\n" * 400, b"No, madam.\n" * 400
    server, folder = serve({"a.txt": a, "b.txt": b}, cut_once={"a.txt"}), tmp_path / "s"
    with pytest.raises(DataError):  # (no retries left: what a Ctrl-C leaves too)
        prepare_data.download(f"{server.url}/a.txt", folder / "input.txt", retries=0)
    assert (folder / "input.txt.part").read_bytes() == a[:len(a) // 2]
    capsys.readouterr()
    prepare_data.main(["shakespeare", "--data-dir", str(folder), "--url", f"{server.url}/b.txt"])
    assert (folder / "input.txt").read_bytes() == b and server.requests == [("a.txt", None), ("b.txt", None)]
    assert capsys.readouterr().err == f"input.txt.part: of {server.url}/a.txt, not {server.url}/b.txt: downloading " \
        "it from its first byte\n"
    assert sorted(p.name for p in folder.iterdir()) == ["input.txt", "shakespeare_train_000000.bin",
                                                        "shakespeare_val_000000.bin"]  # (nothing of the .part left)
    other = tmp_path / "t"  # a sidecar of bytes (damaged): shown as a repr, not sent to the terminal as they are
    other.mkdir()
    (other / "input.txt.part").write_bytes(a[:100])
    (other / "input.txt.part.url").write_bytes(b"\x1b[2J\x00 junk")
    prepare_data.main(["shakespeare", "--data-dir", str(other), "--url", f"{server.url}/b.txt"])
    assert capsys.readouterr().err == f"input.txt.part: of '\\x1b[2J\\x00 junk', not {server.url}/b.txt: " \
        "downloading it from its first byte\n" and (other / "input.txt").read_bytes() == b


def test_an_overwrite_cut_short_resumes_its_part(serve, tmp_path, monkeypatch):
    """--overwrite stopped mid-download leaves a .part of the new file: the same command resumes it (HTTP Range), as
    the line of a Ctrl-C says, where it used to delete it and start over."""
    monkeypatch.setattr(prepare_data, "CHUNK_BYTES", 100)  # (a cut keeps the blocks before it)
    old, new = b"old" * 500, bytes(range(100)) * 20
    (tmp_path / "x.bin").write_bytes(old)
    server = serve({"x.bin": new}, cut_once={"x.bin"})
    with pytest.raises(DataError):  # (no retries left: what a Ctrl-C leaves too)
        prepare_data.download(f"{server.url}/x.bin", tmp_path / "x.bin", retries=0, overwrite=True)
    assert (tmp_path / "x.bin").read_bytes() == old  # (kept until the new one is whole)
    assert prepare_data.download(f"{server.url}/x.bin", tmp_path / "x.bin", retries=0, overwrite=True) is True
    assert (tmp_path / "x.bin").read_bytes() == new
    assert server.requests == [("x.bin", None), ("x.bin", f"bytes={len(new) // 2}-")]


def test_a_part_of_a_file_changed_since_is_started_over(serve, tmp_path, monkeypatch):
    """A download cut short, then the file replaced on the server under the same URL: the resume asks for the rest only
    if the file is still the one the .part began (If-Range, with the ETag or Last-Modified the sidecar keeps). Before,
    it kept the first half of the old file and the second half of the new, with exit 0. A .part whose sidecar has no
    validator (a server that sends none, or a .part of the code before) resumes on Range alone, as before."""
    monkeypatch.setattr(prepare_data, "CHUNK_BYTES", 100)  # (a cut keeps the blocks before it)
    monkeypatch.setattr(prepare_data.time, "sleep", lambda s: None)
    old, new = bytes(range(100)) * 20, bytes(range(99, -1, -1)) * 20  # (of one length: no size tells them apart)
    server, dest = serve({"x.bin": old}, cut_once={"x.bin"}), tmp_path / "x.bin"
    with pytest.raises(DataError):  # (no retries left: what a Ctrl-C leaves too)
        prepare_data.download(f"{server.url}/x.bin", dest, retries=0)
    etag = (tmp_path / "x.bin.part.url").read_text().split("\n")[1]
    assert etag.startswith('"') and (tmp_path / "x.bin.part").read_bytes() == old[:1000]
    server.files["x.bin"] = new
    assert prepare_data.download(f"{server.url}/x.bin", dest, retries=0) is True
    assert dest.read_bytes() == new and server.if_ranges == [None, etag]
    assert server.requests == [("x.bin", None), ("x.bin", "bytes=1000-")]  # asked for the rest, sent all of it
    # the file unchanged, the rest is what comes; with no validator kept, Range alone
    for headers in ({}, {"ETag": None}):
        server = serve({"x.bin": old}, cut_once={"x.bin"}, headers=headers)
        dest.unlink()
        with pytest.raises(DataError):
            prepare_data.download(f"{server.url}/x.bin", dest, retries=0)
        assert prepare_data.download(f"{server.url}/x.bin", dest, retries=0) is True
        assert dest.read_bytes() == old and server.requests[1] == ("x.bin", "bytes=1000-")
        assert server.if_ranges[1] == (None if headers else etag)
    # a server (a proxy) that takes Range and not If-Range: the rest of the new file is not kept, it starts over
    server, dest = serve({"x.bin": old}, cut_once={"x.bin"}, if_range=False), tmp_path / "y.bin"
    with pytest.raises(DataError):
        prepare_data.download(f"{server.url}/x.bin", dest, retries=0)
    server.files["x.bin"] = new
    assert prepare_data.download(f"{server.url}/x.bin", dest, retries=1) is True and dest.read_bytes() == new
    # a weak ETag never matches in If-Range: Last-Modified stands in for it
    assert prepare_data.checked_validator({"ETag": 'W/"1"', "Last-Modified": "Sun, 29 Nov 2026 02:00:00 GMT"}) == \
        "Sun, 29 Nov 2026 02:00:00 GMT"
    assert prepare_data.checked_validator({"ETag": '"1"', "Last-Modified": "x"}) == '"1"'


def test_a_download_onto_a_full_disk_is_one_line_and_resumes(serve, tmp_path, monkeypatch, capsys):
    """The disk fills up during a download: one line that names the .part, which keeps what was written (a write
    takes the part of a block that fits); once there is room, the same command resumes from there (HTTP Range)."""
    monkeypatch.setattr(prepare_data, "CHUNK_BYTES", 1000)
    files = fineweb_files(1)
    server = serve(files)
    real = open

    class Full:  # room for 2500 bytes
        def __init__(self, f):
            self.f = f

        def write(self, b):
            if self.f.tell() >= 2500:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(bytes(b)[:2500 - self.f.tell()])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(prepare_data, "open", lambda path, *args, **kwargs: Full(real(path, *args, **kwargs)),
                        raising=False)  # (the module opens the .part alone)
    args = ["fineweb-edu", "--shards", "1", "--data-dir", str(tmp_path), "--base-url", server.url]
    part = tmp_path / "finewebedu_val_000000.bin.part"
    assert error_of(prepare_data.main, args, capsys, code=1) == f"prepare_data.py: error: cannot write {part}: " \
        f"{os.strerror(errno.ENOSPC)}; make room and run the same command again to resume"
    data = files["finewebedu_val_000000.bin"]
    assert part.read_bytes() == data[:2500]
    monkeypatch.undo()
    prepare_data.main(args)
    assert [(tmp_path / name).read_bytes() for name in files] == list(files.values())
    assert ("finewebedu_val_000000.bin", "bytes=2500-") in server.requests


def test_fineweb_overwrite_downloads_the_shards_again(serve, tmp_path):
    """--overwrite fetches every shard anew (a new version on the server), not "(already there)" of the old ones."""
    args = ["fineweb-edu", "--shards", "1", "--data-dir", str(tmp_path)]
    prepare_data.main(args + ["--base-url", serve(fineweb_files(1)).url])
    newer = {name: shard_bytes(np.arange(300 + i)) for i, name in enumerate(fineweb_files(1))}
    server = serve(newer)
    prepare_data.main(args + ["--base-url", server.url, "--overwrite"])
    assert sorted(name for name, _ in server.requests) == sorted(newer)
    assert {name: (tmp_path / name).read_bytes() for name in newer} == newer


class Answer:
    """What requests.get returns, as download() reads it: a context manager with a status, its headers and a body of
    one block. A test's Response(Answer) sets what it answers."""
    status_code, headers, body = 200, {}, b""

    def __init__(self, url, headers, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def iter_content(self, size):
        yield self.body


def test_a_part_that_holds_the_whole_file_is_checked_and_renamed(tmp_path, monkeypatch):
    """A .part of every byte (cut short after the last came, before it took its name): the server answers its resume,
    a range past the end, with 416; the .part is the file, checked and renamed, not 'HTTP 416' at every try."""
    data, asked, checked = bytes(range(200)), [], []

    class Response(Answer):
        def __init__(self, url, headers, **kwargs):
            asked.append(headers.get("Range"))
            self.status_code, self.headers = 416, {"Content-Range": f"bytes */{len(data)}"}

    url = "http://example.invalid/x.bin"
    (tmp_path / "x.bin.part").write_bytes(data)
    (tmp_path / "x.bin.part.url").write_text(f"{url}\n")
    monkeypatch.setattr(prepare_data.requests, "get", Response)
    assert prepare_data.download(url, tmp_path / "x.bin", verify=lambda p: checked.append(p.read_bytes())) is True
    assert (tmp_path / "x.bin").read_bytes() == data and asked == [f"bytes={len(data)}-"] and checked == [data]
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]


@pytest.mark.parametrize("part, answer", [(bytes(range(100)), 206), (b"x" * 300, 416)], ids=["206", "416"])
def test_a_resume_answered_for_another_range_or_length_starts_over(tmp_path, monkeypatch, part, answer):
    """A 206 of another range than the rest of the .part (appended, a file of the right length and the wrong bytes),
    or a 416 that gives the file another length than the .part's (a file changed since: the .part was renamed as the
    whole file): the .part is dropped, and the file fetched from its first byte. A 416 to a request for the whole file
    is one line."""
    monkeypatch.setattr(prepare_data.time, "sleep", lambda s: None)
    data, url, asked, whole = bytes(range(200)), "http://example.invalid/x.bin", [], [200]

    class Response(Answer):
        body = data

        def __init__(self, url, headers, **kwargs):
            asked.append(headers.get("Range"))
            self.status_code, self.headers = whole[0], {"Content-Length": str(len(data))}
            if "Range" in headers:  # (the whole file, or none of it)
                self.status_code = answer
                self.headers["Content-Range"] = "bytes 0-199/200" if answer == 206 else "bytes */200"

    (tmp_path / "x.bin.part").write_bytes(part)
    (tmp_path / "x.bin.part.url").write_text(f"{url}\n")
    monkeypatch.setattr(prepare_data.requests, "get", Response)
    assert prepare_data.download(url, tmp_path / "x.bin") is True
    assert (tmp_path / "x.bin").read_bytes() == data and asked == [f"bytes={len(part)}-", None]
    whole[0] = 416
    with pytest.raises(DataError, match=re.escape(f"{url}: HTTP 416")):
        prepare_data.download(url, tmp_path / "y.bin")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]


@pytest.mark.parametrize("bad, message", [
    (shard_bytes(range(100), magic=123), "bad magic"),
    (shard_bytes(range(100), count=500), "header announces 500 tokens"),
    (shard_bytes(range(100), count=50), "1224 bytes, but its header announces 50 tokens (1124 bytes)"),  # more: too
    (shard_bytes(range(100), version=2), "not a token shard (bad magic or version in the header)"),
    (shard_bytes([]), "holds no tokens (its header announces 0)"),  # (was kept, as a shard of 0 tokens)
])
def test_corrupt_shard_is_reported_and_not_kept(serve, tmp_path, capsys, bad, message):
    files = fineweb_files(1)
    files["finewebedu_train_000001.bin"] = bad
    server = serve(files)
    args = ["fineweb-edu", "--shards", "1", "--data-dir", str(tmp_path), "--base-url", server.url]
    err = error_of(prepare_data.main, args, capsys, code=1)
    assert message in err and err.startswith(
        f"prepare_data.py: error: {tmp_path / 'finewebedu_train_000001.bin'}: ")  # (where: not .part)
    assert not (tmp_path / "finewebedu_train_000001.bin").exists()
    assert not (tmp_path / "finewebedu_train_000001.bin.part").exists()
    assert (tmp_path / "finewebedu_val_000000.bin").exists()  # the good file before it stays


def test_missing_file_is_one_line(serve, tmp_path, capsys):
    server = serve({})
    folder = tmp_path / "fineweb"
    args = ["fineweb-edu", "--shards", "1", "--data-dir", str(folder), "--base-url", server.url]
    err = error_of(prepare_data.main, args, capsys, code=1)
    assert re.match("prepare_data.py: error: .*HTTP 404", err)
    assert not folder.exists()  # nothing fetched, no folder made


def test_a_body_shorter_than_announced_is_resumed_not_kept(tmp_path, monkeypatch):
    """An HTTP library that ends a body cut short without an error (urllib3 before 2.0): the download asks for the
    rest, as for a cut it is told of, again where the rest is cut short too, and the file takes its name whole."""
    monkeypatch.setattr(prepare_data.time, "sleep", lambda s: None)
    data, asked = bytes(range(200)), []

    class Response(Answer):  # each answer announces the rest and ends halfway through it, but the third, all of it
        def __init__(self, url, headers, **kwargs):
            asked.append(headers.get("Range"))
            start = int(headers["Range"][6:-1]) if "Range" in headers else 0
            rest = data[start:]
            self.status_code, self.body = (206 if start else 200), rest if len(asked) == 3 else rest[:len(rest) // 2]
            self.headers = {"Content-Length": str(len(rest))}

    monkeypatch.setattr(prepare_data.requests, "get", Response)
    with pytest.raises(DataError, match=r"\(gave up after 1 retries; run again to resume\)$"):  # (its .part kept)
        prepare_data.download("http://example.invalid/x.bin", tmp_path / "x.bin", retries=1)
    assert prepare_data.download("http://example.invalid/x.bin", tmp_path / "x.bin") is True  # ... and resumed
    assert (tmp_path / "x.bin").read_bytes() == data and asked == [None, "bytes=100-", "bytes=150-"]
    assert not (tmp_path / "x.bin.part").exists()


def test_retries_wait_twice_as_long_each_time(tmp_path, monkeypatch):
    """A server that cannot be reached is asked again after 1, 2, 4, 8 and 16 s (the default 5 retries)."""
    waits = []
    monkeypatch.setattr(prepare_data.time, "sleep", waits.append)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: refused
        with pytest.raises(DataError):
            prepare_data.download(f"http://127.0.0.1:{s.getsockname()[1]}/x.bin", tmp_path / "x.bin")
    assert waits == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("status", [204, 301])
def test_an_answer_that_is_no_file_is_one_line_and_nothing_kept(tmp_path, monkeypatch, status):
    """No content (204), or a redirect that names no place to go (301 without Location, which requests stops at): no
    file, said so, where its empty body was saved as the file (and then refused as cut short, or kept)."""
    class Response(Answer):
        status_code = status

    monkeypatch.setattr(prepare_data.requests, "get", Response)
    with pytest.raises(DataError, match=f"^http://example.invalid/x.bin: HTTP {status}$"):
        prepare_data.download("http://example.invalid/x.bin", tmp_path / "x.bin")
    assert not list(tmp_path.iterdir())


def test_a_server_not_reached_is_a_short_line_per_retry(tmp_path, capsys, monkeypatch):
    """A server that cannot be reached (a port nothing listens on; offline, a host that does not resolve): a line per
    retry and the error name the cause without requests' wrappers, some 300 characters of them; no folder made, and no
    .part to resume from, so not said to be."""
    monkeypatch.setattr(prepare_data.time, "sleep", lambda s: None)
    refused = re.escape(f"Failed to establish a new connection: [Errno {errno.ECONNREFUSED}] "
                        f"{os.strerror(errno.ECONNREFUSED)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: refused, and no other process can take the port meanwhile
        url = f"http://127.0.0.1:{s.getsockname()[1]}/x.bin"
        with pytest.raises(DataError) as e:
            prepare_data.download(url, tmp_path / "new" / "x.bin", retries=2)
    assert re.fullmatch(f"{re.escape(url)}: {refused} \\(gave up after 2 retries; run again to try again\\)",
                        str(e.value))
    lines = capsys.readouterr().err.splitlines()  # (no blank lines: stderr is not a terminal here)
    assert [re.sub(refused, "REFUSED", line) for line in lines] == [
        "x.bin: REFUSED; retrying in 1s", "x.bin: REFUSED; retrying in 2s"]
    assert not (tmp_path / "new").exists()
    # a connection cut mid-download: the message and its cause; an error that says nothing: its kind
    reset = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    assert failure(requests.ConnectionError(ProtocolError("Connection aborted.", reset))) == \
        f"Connection aborted. [Errno {errno.ECONNRESET}] Connection reset by peer"
    assert failure(requests.ConnectionError(OSError())) == "OSError"


def test_language_windows_predict_the_next_token(tmp_path):
    """A train row is block_size consecutive tokens of one shard, its targets the same window one token on, from
    anywhere in the shard (the last start included); the validation windows are the first eval_tokens of the val
    shard, back to back, their targets one token on too. Shards of counting tokens show each."""
    write_shard(tmp_path / "x_val_000000.bin", np.arange(100) % 500)
    write_shard(tmp_path / "x_val_000001.bin", 500 + np.arange(100))  # (a second: the first is evaluated on)
    for i, size in enumerate((40, 300)):
        write_shard(tmp_path / f"x_train_{i:06d}.bin", 1000 * i + np.arange(size))  # shard i counts from 1000 i
    cfg = type("Config", (), dict(data_dir=str(tmp_path), block_size=8, eval_tokens=32, vocab_size=2000))
    data = TokenData(cfg)
    x, y = data.batch(np.random.default_rng(0), 4000)
    assert x.shape == y.shape == (4000, 8)
    assert torch.equal(x[:, 1:], x[:, :-1] + 1) and torch.equal(y, x + 1)  # within one shard, one token on
    starts = {(int(first) // 1000, int(first) % 1000) for first in x[:, 0]}
    assert {start for shard, start in starts if shard == 0} == set(range(40 - 8))  # every start that fits 8 + 1
    assert {shard for shard, _ in starts} == {0, 1}
    assert torch.equal(data.val_x, torch.arange(32).view(4, 8)) and torch.equal(data.val_y, data.val_x + 1)
    shard_0 = (x[:, 0] < 1000).float().mean().item()  # every start equally likely: shard 0 holds 32 of the 324
    assert abs(shard_0 - 32 / 324) < 0.01  # (by tokens, 40 of 340, is 0.02 off)
    # the windows split between processes, each once; what analysis reads of them, seq_len tokens of the first n
    assert [[x[0, 0].item() for x, _ in data.val_batches(1, rank, 2)] for rank in (0, 1)] == [[0, 16], [8, 24]]
    assert [s.tolist() for s in data.val_sequences(2, 3)] == [[0, 1, 2], [8, 9, 10]]
    # eval_tokens past the shard: the windows it holds every target of (a 10th would need a 101st token), and
    # the vocabulary they need counts those targets (90, a target only)
    whole = TokenData(SimpleNamespace(data_dir=str(tmp_path), block_size=10, eval_tokens=10**6, vocab_size=2000),
                      with_train=False)
    assert torch.equal(whole.val_x, torch.arange(90).view(9, 10)) and whole.val_y[-1, -1] == 90 == whole.vocab_size - 1
    with pytest.raises(DataError, match=re.escape(f"validation shard in {tmp_path} is shorter than one block of 100")):
        TokenData(type("Config", (), dict(data_dir=str(tmp_path), block_size=100, eval_tokens=10**6, vocab_size=2000)))
    with pytest.raises(DataError, match=re.escape(f"a train shard in {tmp_path} is shorter than one block of 40 and "
                                                  "its next token")):  # (40 tokens: no window of 41)
        TokenData(SimpleNamespace(data_dir=str(tmp_path), block_size=40, eval_tokens=80, vocab_size=2000))


def test_a_shard_cut_short_under_a_run_is_one_line_and_one_replaced_reads_as_it_began(tmp_path, monkeypatch):
    """Training reads windows from the shards as it goes. A shard truncated in place under it is a DataError that says
    so (a mapped file read 0s where it was cut within a page, and ended the process with SIGBUS past it); one renamed
    over (prepare_data.py run again) reads as the run began, so a run's batches stay its own."""
    write_shard(tmp_path / "x_val_000000.bin", np.arange(100))
    train = tmp_path / "x_train_000000.bin"
    write_shard(train, np.arange(1000))
    cfg = SimpleNamespace(data_dir=str(tmp_path), block_size=8, eval_tokens=32, vocab_size=2000)
    data = TokenData(cfg)
    write_shard(train, np.arange(1000) + 1000)  # written beside, then renamed over
    x, y = data.batch(np.random.default_rng(0), 200)
    assert x.max() < 1000 and torch.equal(y[:, :-1], x[:, 1:])
    data = TokenData(cfg)  # (a run that began with the new one)
    pread = os.pread  # a read returns at most 2 GB on Linux, less than a shard may hold: read on until the window ends
    monkeypatch.setattr(os, "pread", lambda fd, n, at: pread(fd, min(n, 7), at))
    assert data.train[0][995:1200].tolist() == list(range(1995, 2000)) and len(data.train[0][5:5]) == 0
    monkeypatch.undo()
    for bad in (3, slice(0, 10, 2)):  # (a step was an assert, gone under python -O)
        with pytest.raises(TypeError, match=re.escape("a shard is read in windows of consecutive tokens, shard[a:b]")):
            data.train[0][bad]
    with open(train, "r+b") as f:
        f.truncate(HEADER_BYTES + 2 * 500)  # half of it gone, in place
    with pytest.raises(DataError) as e:
        data.batch(np.random.default_rng(0), 200)
    assert str(e.value) == f"{train}: cut short while this run read it (3024 bytes when it began, 2024 now): put " \
        "the shard back as it was"


def test_a_diverged_model_has_a_perplexity_of_e_to_the_50_at_most(tmp_path):
    """A loss of 1000 (a run gone wrong) is logged as it is; its perplexity, e^1000, is past a float: capped at e^50."""
    class Sure(torch.nn.Module):  # all on token 0, which no target is
        def forward(self, x):
            return torch.zeros(*x.shape, 64).index_fill(-1, torch.tensor([0]), 1000.0), None

    write_shard(tmp_path / "x_val_000000.bin", np.arange(1, 40))
    data = TokenData(type("Config", (), dict(data_dir=str(tmp_path), block_size=8, eval_tokens=32, vocab_size=64)),
                     with_train=False)
    out = evaluate(Sure(), None, data, 2, "cpu", contextlib.nullcontext())
    assert out == dict(val_loss=pytest.approx(1000.0), val_ppl=math.exp(50))


def test_a_micro_batch_is_drawn_by_its_seed_step_and_number():
    """The same (seed, step, micro-batch) draws the same rows, so that a resumed run sees the batches of one never
    stopped; another seed, step or micro-batch, other rows."""
    keys = [(seed, step, micro) for seed in (0, 1) for step in (0, 1, 7) for micro in (0, 1)]
    drawn = {key: tuple(batch_rng(*key).integers(0, 2**62, 4).tolist()) for key in keys}
    assert all(tuple(batch_rng(*key).integers(0, 2**62, 4).tolist()) == drawn[key] for key in keys)
    assert len(set(drawn.values())) == len(keys)
    # NOTE the rows every run so far drew: a change of the generator's seed would give a run resumed from an older
    # checkpoint other batches than its first session's, silently
    assert batch_rng(1337, 5, 3).integers(0, 2**62, 2).tolist() == [3316481126716950212, 2172486899641963223]


def test_task_rows_for_evaluation_and_analysis():
    """A task's validation samples: split between processes, each once, padded with the end token and scored after
    the prompt; for analysis, unpadded and without their end token (1 here)."""
    rows = TaskRows()
    rows.T, rows.pad, rows.val = 6, 1, [([5, 6, 7, 1], 2), ([8, 9, 1], 1), ([4, 4, 4, 4, 1], 3)]
    assert [[(x.tolist(), y.tolist()) for x, y in rows.val_batches(1, rank, 2)] for rank in (0, 1)] == [
        [([[5, 6, 7, 1, 1, 1]], [[-1, 7, 1, -1, -1, -1]]), ([[4, 4, 4, 4, 1, 1]], [[-1, -1, 4, 1, -1, -1]])],
        [([[8, 9, 1, 1, 1, 1]], [[9, 1, -1, -1, -1, -1]])]]
    assert [s.tolist() for s in rows.val_sequences(2)] == [[5, 6, 7], [8, 9]]


def test_token_ids_past_the_model_vocabulary_are_one_line(tmp_path, monkeypatch):
    """The validation windows tell the caller the vocabulary they need; a train batch past the model's is a
    DataError, not an embedding lookup's IndexError in the middle of a run. A shard that is a folder, or that this
    user may not read: one line too."""
    write_shard(tmp_path / "x_val_000000.bin", [3, 7, 9] * 20)
    write_shard(tmp_path / "x_train_000000.bin", [3, 7, 64] * 20)  # 64: the first id past a vocabulary of 64
    cfg = type("Config", (), dict(data_dir=str(tmp_path), block_size=8, eval_tokens=32, vocab_size=64))
    data = TokenData(cfg)
    assert data.vocab_size == 10  # ids up to 9 in the validation windows
    with pytest.raises(DataError, match="token id 64 of a train shard is past the model's --vocab-size=64, which the "
                                        "validation shard's tokens fit: train a new run with a --vocab-size above it"):
        data.batch(np.random.default_rng(0), 4)
    (tmp_path / "x_train_000001.bin").mkdir()  # a folder by a shard's name
    with pytest.raises(DataError, match=re.escape("x_train_000001.bin: not a file")):
        TokenData(cfg)

    def denied(*args):  # (to root every file is readable: what another user meets, patched)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(args[0]))
    monkeypatch.setattr("data.open", denied, raising=False)  # (data.py's own open)
    with pytest.raises(DataError) as e:
        TokenData(cfg)
    assert str(e.value) == f"{tmp_path / 'x_val_000000.bin'}: cannot be read ({os.strerror(errno.EACCES)})"


def test_shakespeare_tokenised_into_shards(serve, tmp_path, offline_gpt2, monkeypatch):
    """The text as GPT-2 tokens, 90% train and 10% val, each shard after an end-of-text; a shard missing is made
    again, and --overwrite downloads the text anew."""
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 20
    server = serve({"input.txt": text.encode()})
    enc = small_encoding()
    prepare_data.prepare_shakespeare(tmp_path, f"{server.url}/input.txt", enc=enc)
    train, val = (tokens[:] for split in ("train", "val") for tokens in load_tokens(tmp_path, split).values())
    assert train[0] == val[0] == enc.eot_token
    assert enc.decode(list(train[1:])) + enc.decode(list(val[1:])) == text  # exact round trip
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15
    shards = {p: p.read_bytes() for p in tmp_path.glob("*.bin")}
    next(p for p in shards if "_val_" in p.name).unlink()  # (what a Ctrl-C between the two writes leaves)
    prepare_data.main(["shakespeare", "--data-dir", str(tmp_path), "--url", f"{server.url}/input.txt"])
    assert {p: p.read_bytes() for p in tmp_path.glob("*.bin")} == shards
    newer = "Second Citizen:\nWe are accounted poor citizens.\n" * 20
    url = f"{serve({'input.txt': newer.encode()}).url}/input.txt"
    prepare_data.main(["shakespeare", "--data-dir", str(tmp_path), "--url", url, "--overwrite"])
    train, val = (tokens[:] for split in ("train", "val") for tokens in load_tokens(tmp_path, split).values())
    assert enc.decode(list(train[1:])) + enc.decode(list(val[1:])) == newer == (tmp_path / "input.txt").read_text()
    # an --overwrite cut short between its two shards leaves none of the old text's: the same command makes both anew
    # from the new text, where it took a shard of each text for the data
    newest, written = "Third Citizen:\nWhat authority surfeits on would relieve us.\n" * 20, []
    url = f"{serve({'input.txt': newest.encode()}).url}/input.txt"

    def cut_after_one(path, tokens):  # the first shard written, then Ctrl-C
        if written:
            raise KeyboardInterrupt
        written.append(path)
        write_shard(path, tokens)

    monkeypatch.setattr(prepare_data, "write_shard", cut_after_one)
    with pytest.raises(KeyboardInterrupt):
        prepare_data.prepare_shakespeare(tmp_path, url, enc=enc, overwrite=True)
    monkeypatch.setattr(prepare_data, "write_shard", write_shard)
    prepare_data.prepare_shakespeare(tmp_path, url, enc=enc)
    train, val = (tokens[:] for split in ("train", "val") for tokens in load_tokens(tmp_path, split).values())
    assert enc.decode(list(train[1:])) + enc.decode(list(val[1:])) == newest
    for shard in tmp_path.glob("*.bin"):
        shard.unlink()
    (tmp_path / "input.txt").write_bytes(b"\xff\xfe not UTF-8")  # a text of your own, put there, in another encoding
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'input.txt'} cannot be read as UTF-8 text ('utf-8' "
                                                  "codec can't decode byte 0xff in position 0")):
        prepare_data.prepare_shakespeare(tmp_path, f"{server.url}/input.txt", enc=enc)


@pytest.mark.parametrize("text, message", [
    (b"", "input.txt is empty"), (b"A", "input.txt holds only 1 character(s), too few for a train and a val split")])
def test_shakespeare_of_no_text_is_refused_and_not_kept(serve, tmp_path, capsys, offline_gpt2, text, message):
    """An empty download used to become shards of the end-of-text token alone, said to be fine (and kept: the same
    command then found them 'already there'). Nothing of it is kept now, and a text put there is refused too."""
    server, folder = serve({"input.txt": text}), tmp_path / "s"
    err = error_of(prepare_data.main, ["shakespeare", "--data-dir", str(folder), "--url", f"{server.url}/input.txt"],
                   capsys, code=1)
    assert err == f"prepare_data.py: error: {folder / message}"
    assert not folder.exists()  # no text, no .part, no shard: not even the folder made for them
    folder.mkdir()
    (folder / "input.txt").write_bytes(text)  # a text of one's own, put there
    err = error_of(prepare_data.main, ["shakespeare", "--data-dir", str(folder)], capsys, code=1)
    assert err == f"prepare_data.py: error: {folder / message}: put a text there, or --overwrite to download it again"
    assert [p.name for p in folder.iterdir()] == ["input.txt"]


def test_tiny_shakespeare_is_its_first_90_percent_for_training_and_says_how_many_tokens(serve, tmp_path, capsys):
    """The split is at 90% of the text, and each shard's line counts its tokens (the end-of-text token first)."""
    text, enc = "abcdefghij\n" * 100, small_encoding()
    prepare_data.prepare_shakespeare(tmp_path, f"{serve({'input.txt': text.encode()}).url}/input.txt", enc=enc)
    train, val = (next(iter(load_tokens(tmp_path, split).values()))[:] for split in ("train", "val"))
    assert enc.decode(list(train[1:])) + enc.decode(list(val[1:])) == text and \
        enc.decode(list(val[1:])) == text[int(0.9 * len(text)):]
    assert [line for line in capsys.readouterr().out.splitlines() if line.endswith(" tokens")] == [
        f"{tmp_path / f'shakespeare_{split}_000000.bin'}: {len(tokens):,} tokens" for split, tokens in
        (("train", train), ("val", val))]


@pytest.mark.parametrize("kind", ["text/html", "Text/HTML"])  # (a media type's case says nothing)
def test_a_web_page_is_not_taken_for_the_text(serve, tmp_path, capsys, offline_gpt2, kind):
    """A server that answers with a web page (a login page, a proxy's) in place of the text: refused, and nothing of it
    kept (it was tokenised as the text)."""
    page = b"<!DOCTYPE html><html><body>Please sign in to continue.</body></html>\n" * 20
    server, folder = serve({"input.txt": page}, headers={"Content-Type": f"{kind}; charset=utf-8"}), tmp_path / "s"
    url = f"{server.url}/input.txt"
    err = error_of(prepare_data.main, ["shakespeare", "--data-dir", str(folder), "--url", url], capsys, code=1)
    assert err == f"prepare_data.py: error: {url}: the server sent a web page (Content-Type: {kind}; " \
        "charset=utf-8), not the file: a login or proxy page?"
    assert not folder.exists()


def test_tiny_shakespeare_cut_short_is_not_kept(serve, tmp_path, capsys, monkeypatch, offline_gpt2):
    """Without a Content-Length, a connection that ends halfway ends the text there: Tiny Shakespeare's own size tells
    the cut (half of it was tokenised). (The local server stands in for its URL, and a short text for it.)"""
    text = b"First Citizen:\nSpeak, speak.\n" * 70
    folder = tmp_path / "s"
    server = serve({"input.txt": text}, cut_once={"input.txt"}, headers={"Content-Length": None})
    monkeypatch.setattr(prepare_data, "SHAKESPEARE_URL", f"{server.url}/input.txt")
    monkeypatch.setattr(prepare_data, "SHAKESPEARE_BYTES", len(text), raising=False)
    err = error_of(prepare_data.main, ["shakespeare", "--data-dir", str(folder)], capsys, code=1)
    assert err == f"prepare_data.py: error: {folder / 'input.txt'}: {len(text) // 2:,} bytes, not the {len(text):,} " \
        "of Tiny Shakespeare (a download cut short?): run the same command again"
    assert not folder.exists()
    prepare_data.main(["shakespeare", "--data-dir", str(folder)])  # whole, this time
    assert (folder / "input.txt").read_bytes() == text
    monkeypatch.setattr(prepare_data, "SHAKESPEARE_BYTES", len(text) - 1)  # longer than Tiny Shakespeare: not cut
    err = error_of(prepare_data.main, ["shakespeare", "--data-dir", str(folder), "--overwrite"], capsys, code=1)
    assert err.endswith(f"{len(text):,} bytes, not the {len(text) - 1:,} of Tiny Shakespeare (another file at its "
                        "URL?)")
    assert (folder / "input.txt").read_bytes() == text


def test_a_folder_another_preparation_holds_is_refused(serve, tmp_path, capsys, offline_gpt2):
    """Two preparations of one folder at once: the second found the .part gone that the first had renamed (a
    traceback). It is refused in one line now, before it downloads anything."""
    server, folder = serve({"input.txt": b"To be, or not to be.\n" * 20}), tmp_path / "s"
    args = ["shakespeare", "--data-dir", str(folder), "--url", f"{server.url}/input.txt"]
    held = hold_folder(folder, "a test")  # (another process, preparing it)
    try:
        err = error_of(prepare_data.main, args, capsys)
    finally:
        os.close(held)
    assert err == f"prepare_data.py: error: {folder} is in use by another process (a prepare_data.py preparing it? " \
        "wait for it to end, or give another --data-dir)"
    assert list(folder.iterdir()) == [] and server.requests == []


def test_greedy_accuracy_batches_prompts_of_all_lengths_as_if_each_ran_alone():
    """Every item's generation, judged, is the one it gets alone: its prompt, greedy, cut at the stop token
    or after its own most new tokens or at the end of the block."""
    model, rng = small_model("lime", block_size=24).eval(), random.Random(0)
    items = [([rng.randrange(64) for _ in range(rng.randint(2, 14))], i, rng.randint(1, 14)) for i in range(16)]
    stop = generate(model, torch.tensor([items[0][0]]), 3, temperature=0)[0, -1].item()  # a token it does write
    judged = {}

    def judge(ids, i):
        judged[i] = ids
        return len(ids) % 2 == 0

    accuracy = greedy_accuracy(model, items, judge, stop, "cpu", batch_size=6)
    alone = {}
    for prompt, i, most in items:
        row = generate(model, torch.tensor([prompt]), min(most, 24 - len(prompt)), temperature=0)[0, len(prompt):]
        row = row.tolist()
        alone[i] = row[: row.index(stop)] if stop in row else row
    assert judged == alone and any(len(ids) < most for (_, i, most), ids in zip(items, alone.values()))
    assert accuracy == pytest.approx(sum(len(ids) % 2 == 0 for ids in alone.values()) / len(items))


def test_the_loss_of_a_task_is_the_mean_over_its_scored_tokens():
    """Neither the prompt nor the padding is scored, and the mean is over every scored token of the split, not a mean
    of each micro-batch's: a model that bets on the next token repeating the current one is right at 1 of the 6."""
    class Repeat(torch.nn.Module):
        def forward(self, x):
            return 3 * torch.nn.functional.one_hot(x, 10).float(), None  # logit 3 on the current token, 0 elsewhere

    rows = TaskRows()
    # (input, target) pairs scored: (6, 7), (7, 1); (8, 9), (9, 1); (4, 4), (4, 1). Not scored: 12 of prompt or padding
    rows.T, rows.pad, rows.val = 6, 1, [([5, 6, 7, 1], 2), ([8, 9, 1], 1), ([4, 4, 4, 4, 1], 3)]
    right, wrong = math.log(math.exp(3) + 9) - 3, math.log(math.exp(3) + 9)
    for size in (1, 2, 3):
        loss = evaluate_loss(Repeat(), rows, size, "cpu", contextlib.nullcontext())
        assert loss == pytest.approx((right + 5 * wrong) / 6)


def test_task_rows_split_between_processes_micro_batch_by_micro_batch():
    """Each process takes every world-th micro-batch of the validation rows, from its rank's: every row once."""
    rows = TaskRows()
    rows.T, rows.pad, rows.val = 3, 0, [([i, i, 0], 1) for i in range(1, 8)]
    assert [[x[:, 0].tolist() for x, _ in rows.val_batches(2, rank, 2)] for rank in (0, 1)] == [
        [[1, 2], [5, 6]], [[3, 4], [7]]]


def test_an_answer_no_retry_mends_is_one_line_and_asked_for_as_stored(tmp_path, monkeypatch):
    """What the server answers that no retry mends (a redirect loop, one to ftp:// or to no URL): a traceback before,
    one line now. A Content-Length that is no number is no size (a traceback before). Every request asks for the
    bytes as stored (Accept-Encoding: identity): a gzip answer's range is of the compressed bytes, not of the
    .part's, and its rest did not decode, on every run again."""
    monkeypatch.setattr(prepare_data.time, "sleep", lambda s: None)
    for error in (requests.TooManyRedirects("Exceeded 30 redirects."), requests.exceptions.InvalidSchema("ftp"),
                  ValueError("Invalid IPv6 URL")):
        def fails(url, headers, **kwargs):
            raise error
        monkeypatch.setattr(prepare_data.requests, "get", fails)
        with pytest.raises(DataError) as e:
            prepare_data.download("http://example.invalid/x.bin", tmp_path / "x.bin")
        assert str(e.value).startswith("http://example.invalid/x.bin: ") and type(error).__name__ in str(e.value)
    asked = []

    class Response(Answer):
        headers, body = {"Content-Length": "1, 1"}, b"abc"

        def __init__(self, url, headers, **kwargs):
            asked.append(headers)

    monkeypatch.setattr(prepare_data.requests, "get", Response)
    assert prepare_data.download("http://example.invalid/x.bin", tmp_path / "x.bin") is True
    assert (tmp_path / "x.bin").read_bytes() == b"abc" and asked == [{"Accept-Encoding": "identity"}]


def test_a_part_whose_sidecar_names_no_version_a_header_can_carry_is_started_over(serve, tmp_path, capsys):
    """The sidecar's second line (the ETag the .part began with) sent as If-Range: with a line break or a byte past
    ASCII in it (an editor's newline, a damaged file), requests refused it in a traceback, on every run again."""
    data = bytes(range(200)) * 5
    server, dest = serve({"x.bin": data}), tmp_path / "x.bin"
    for damaged in ('"v1"\n', "\ufffd"):
        (tmp_path / "x.bin.part").write_bytes(data[:300])
        (tmp_path / "x.bin.part.url").write_text(f"{server.url}/x.bin\n{damaged}")
        assert prepare_data.download(f"{server.url}/x.bin", dest, retries=0, overwrite=True) is True
        assert dest.read_bytes() == data and server.requests[-1] == ("x.bin", None)  # from its first byte
        assert "x.bin.part: its x.bin.part.url is damaged (the file's version, " in capsys.readouterr().err


def test_two_data_sets_in_one_folder_are_refused_not_mixed(serve, tmp_path, capsys, offline_gpt2):
    """Tiny Shakespeare prepared into a folder of FineWeb-Edu shards: a run read both (each split's shards by their
    names' end), trained on the two and evaluated on the first by name, with exit 0."""
    folder = tmp_path / "mix"
    folder.mkdir()
    write_shard(folder / "finewebedu_val_000000.bin", [1, 2, 3] * 50)
    write_shard(folder / "finewebedu_train_000001.bin", [1, 2, 3] * 500)
    server = serve({"input.txt": b"To be, or not to be.\n" * 20})
    err = error_of(prepare_data.main, ["shakespeare", "--data-dir", str(folder), "--url", f"{server.url}/input.txt"],
                   capsys)
    assert err == f"prepare_data.py: error: {folder} holds the token shards of other data (finewebedu_*): give " \
        "shakespeare a --data-dir of its own"
    assert server.requests == [] and sorted(p.name for p in folder.iterdir()) == [
        "finewebedu_train_000001.bin", "finewebedu_val_000000.bin"]
    write_shard(folder / "shakespeare_train_000000.bin", [4, 5] * 500)  # (put there by hand)
    with pytest.raises(DataError, match=r"mix holds the token shards of 2 data sets \(finewebedu_\*, shakespeare_\*\)"):
        load_tokens(folder, "val")


def test_a_vocabulary_fetch_that_stalls_is_one_line_not_a_hang(tmp_path, monkeypatch):
    """tiktoken's own fetch waits forever for a server that answers nothing; gpt2_encoding's gives up after its
    timeout, and leaves tiktoken's fetch as it found it, two threads loading at once too."""
    read_file, local = tiktoken.load.read_file, tmp_path / "encoder.json"
    local.write_bytes(b"{}")
    with socket.socket() as silent:  # it listens, so a connection is made, and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/vocab.bpe"
        monkeypatch.setattr(tiktoken, "get_encoding",  # (a local path, read as before, then the URL)
                            lambda name: [tiktoken.load.read_file(p) for p in (str(local), url)])
        errors = []

        def load():
            try:
                gpt2_encoding(timeout=0.2)
            except Exception as e:
                errors.append(e)

        # two at once, in threads: without a timeout the test fails, where it would hang
        loads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
        for t in loads:
            t.start()
        for t in loads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in loads), "no timeout: the fetch waits for the silent server"
    assert len(errors) == 2 and all(isinstance(e, DataError) and str(e).startswith(
        "tiktoken could not load the GPT-2 vocabulary (downloaded on first use): ") for e in errors)
    assert all("Read timed out" in str(e) for e in errors) and tiktoken.load.read_file is read_file
