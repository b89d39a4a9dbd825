"""
What every command here shares: bad input as one line with its exit code, config fields that
are command-line flags, files read and written whole or not at all, and the device.

Exit codes, the same in every script:
  2  the command line is wrong: an unknown flag or a bad value, flags that clash, or an output
     that would replace something (a run, a data folder) without --overwrite; or the output is
     another process's (a folder a run trains in, or a file it wrote while this command ran);
  1  something the command reads is missing or broken: a file that is absent, empty, cut short,
     corrupt, or of another run or regime (data, a checkpoint, a log, a summary); a download that
     failed; a file, or the output, that cannot be written (a full disk); a loss that is not finite; another process
     of a run under torchrun gone;
  128 + the signal number after an interruption: 130 for Ctrl-C, 143 for SIGTERM (129 for SIGHUP, the terminal
     closed, in train.py and grid.py, which save a checkpoint first).
Each ends with one line on stderr, and what was there before stays as it was.
"""

import argparse
import errno
import fcntl
import glob
import json
import os
import re
import resource
import select
import signal
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import field, fields
from pathlib import Path

MAIN = getattr(sys.modules["__main__"], "__file__", None)  # None in a notebook or `python -c`
SCRIPT = Path(MAIN or "").name  # "train.py" when that one runs


def interrupted_while_starting(signum, frame):
    if "RANK" not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0":  # (torchrun signals each: said once a
        print(f"{SCRIPT}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)  # machine, as one_line_errors)
    os._exit(128 + signum)


# NOTE a script imports this module before torch, which takes seconds to load: a Ctrl-C meanwhile is one
# line too, not a traceback, and so is a SIGTERM, not a silent exit. one_line_errors puts Python's own handler back
# once the script runs
if MAIN and Path(MAIN).resolve().parent == Path(__file__).resolve().parent and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, interrupted_while_starting)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupted_while_starting)

import torch  # noqa: E402


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM (`kill`, a cluster scheduler) as an exception: what is under way unwinds (a
    temporary file goes), then one line and exit 128 + the signal (one_line_errors)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum, frame):
    raise Interrupted(signum)


class UsageError(ValueError):
    """The command line is wrong: one line, exit code 2, nothing written."""


class DataError(Exception):
    """Something the command reads is missing or broken, a problem the user can fix: one line, exit code 1."""


class Unreadable(DataError):
    """A file that this user may not read, or that a failing disk cannot give: not damaged (it may be whole)."""


def default_shown(text, value):
    """Whether --help writes a flag's default after its help text ("[0.9]"): where it has one to show (not None,
    nor "") and the text does not say its own ("(default out/<preset>-<router>)")."""
    return value is not None and value != "" and "(default" not in text


class Help(argparse.RawDescriptionHelpFormatter):
    """The description as written, and a flag's default after its help where default_shown says so, as train.py
    writes it ("[0.9]"); not a switch's False."""
    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if action.option_strings and default is not False and default != argparse.SUPPRESS and \
                default_shown(text, default):
            text += " [%(default)s]"
        return text


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class=Help, **kwargs):  # (analyze.py's subcommands too)
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message):  # one line, like every other bad input, not argparse's usage block
        raise UsageError(message)

    def given(self, argv=None):
        """The dests of the flags that the command line `argv` (by default sys.argv) names, whatever their
        values. For a flag that another mode would ignore: comparing its value with its default instead
        would let it through when given at its default value (`--shards=32`). For flags that store a value
        (store, store_true): an append or count action would start from the marker below."""
        unset = object()  # parsed into a namespace that has every dest already, argparse sets no defaults
        dests = dict.fromkeys(vars(self.parse_args(argv)), unset)
        return {k for k, v in vars(self.parse_args(argv, argparse.Namespace(**dests))).items() if v is not unset}


def a_path(text):
    """argparse's type for a path flag: an empty one (a $VARIABLE not set) is a mistake, not the default or "here"."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path (a $VARIABLE that is not set?)")
    return text


def fail(script, message, code, say=True):
    """One line on stderr (unless `say` is False: another process says it), then exit with `code`."""
    if say:
        print(f"{script}: {message}", file=sys.stderr)
    sys.exit(code)


def first_line(e):
    """An exception's message in one line: its first, or its type's name where it says nothing."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def lost_peer(e):
    """What a failed collective of torch.distributed says, in short, where another process of the run is gone: gloo's
    'Connection closed by peer [127.0.0.1]:61068' (a RuntimeError whose text begins with its place in gloo's
    transport; a peer that hangs past gloo's timeout says so the same way); None for any other error."""
    m = re.match(r"\[[^\]]*gloo/transport/[^\]]*\]\s*(.+)", str(e), re.S)
    return m and "gloo: " + m[1].splitlines()[0].split(". ")[0][:200]


@contextmanager
def one_line_errors(script, data_hint=lambda e: "", interrupted="", elsewhere=lambda: False):
    """Bad usage, a data problem or an interruption inside ends the script with one line and its
    exit code. data_hint(e): what to add to a DataError's message; `interrupted`: what to say after
    Ctrl-C or SIGTERM (an exception with `signum`, as train.py's signal handler raises); elsewhere(): whether
    another process says the line of a UsageError, a DataError or a signal (train.py under torchrun: one of each
    machine's, which torchrun signals all at once)."""
    own = signal.getsignal(signal.SIGINT) is interrupted_while_starting  # (a script's own process: not a test's)
    if own:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # from here on, KeyboardInterrupt
    term = signal.getsignal(signal.SIGTERM)
    if term in (signal.SIG_DFL, interrupted_while_starting):
        signal.signal(signal.SIGTERM, raise_interrupted)  # the same for SIGTERM, which would kill it in silence
    for stream in (sys.stdout, sys.stderr):  # a path's undecodable bytes (\udcff) or a '±' that the output's encoding
        if hasattr(stream, "reconfigure"):  # lacks print escaped, not as a UnicodeEncodeError once the work is done
            stream.reconfigure(errors="backslashreplace")
    try:
        yield
        sys.stdout.flush()  # here, not as Python exits: there, a write that fails (a full disk) is 2 lines and exit 120
    except UsageError as e:
        fail(script, f"error: {e}", 2, not elsewhere())
    except DataError as e:
        fail(script, f"error: {e}{data_hint(e)}", 1, not elsewhere())
    except RuntimeError as e:  # out of memory: CUDA's (torch.OutOfMemoryError, a RuntimeError) or a CPU allocator's
        if lost := lost_peer(e):  # (torchrun: rank 0 says it, if it is not the one gone; torchrun names that one)
            fail(script, f"error: another process of this run is gone or not answering ({lost})", 1,
                 os.environ.get("RANK", "0") == "0")
        if str(e).startswith("Symlink loop from "):  # Path.resolve() before Python 3.13, on a path given or read
            fail(script, f"error: cannot follow {str(e).removeprefix('Symlink loop from ')}: a symbolic link on the "
                         "way leads back to itself", 1)
        # torch.compile needs a C compiler (inductor's C++, Triton's launcher), which slim images lack; any other
        # failure of the compiler stays a traceback: a bug (a fork's method, say) to see
        no_compiler = re.search(r"InvalidCxxCompiler|No working C\+\+ compiler|Failed to find C compiler", str(e))
        if no_compiler:
            fail(script, f"error: no C compiler ({no_compiler[0]}), which torch.compile and the Triton kernels need: "
                         "install gcc, or give --compile=off (and on CUDA set LIME_TRITON=0) to run without it", 1)
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise  # any other RuntimeError is a fault to see
        out_of_memory(script, e)
    except MemoryError as e:  # numpy's or Python's own (a batch of rows too large to draw)
        out_of_memory(script, e)
    except PermissionError as e:  # a path under a folder this user may not enter (Path.exists raises then), say
        if e.filename is None:
            raise  # not a file's (a signal to another user's process): a fault to see
        shut = next((p for p in reversed(Path(e.filename).parents) if os.path.isdir(p) and not os.access(p, os.X_OK)),
                    None)
        fail(script, f"error: {e.filename}: {e.strerror}" + (f" (this user may not enter {shut})" if shut else ""), 1)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        fail(script, f"interrupted ({signal.Signals(signum).name}){interrupted}", 128 + signum, not elsewhere())
    except BrokenPipeError:
        if not stdout_closed():
            raise  # another pipe (a worker's): a fault to see
        # what reads the output has closed it (`| head`): stop without a word, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (else Python's flush at exit fails again)
        sys.exit(128 + signal.SIGPIPE)
    except OSError as e:
        if type(e) is OSError and e.filename is not None and e.errno in CANNOT_WRITE:  # a folder made on a full disk
            fail(script, f"error: cannot write {e.filename}: {e.strerror}", 1)
        if not (what := output_failed(e)):
            raise  # any other: a fault to see
        try:  # what is left in stdout's buffer goes nowhere (else Python's flush at exit fails again)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # (no real stdout: a test's capture)
            pass
        fail(script, f"error: {what}", 1)
    finally:
        if own and script == SCRIPT:  # the script is done (not a main() that another program of ours calls): Python
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # takes 0.3 s to shut down, where a Ctrl-C printed a traceback
        signal.signal(signal.SIGTERM, term)  # as it was: main() may run again, in a test or a notebook


def out_of_memory(script, e):
    fail(script, f"error: out of memory ({' '.join(str(e).split()) or type(e).__name__}): a smaller "
                 "--micro-batch-size, --block-size or model needs less", 1)


# what a write says on a full disk (ENOSPC; EDQUOT: a quota's), past a file's size limit (EFBIG: `ulimit -f`), on a file
# system mounted read-only (EROFS)
CANNOT_WRITE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def output_failed(e):
    """What went wrong, where `e` is what a write to the output raises when it cannot be written (`> log` on a full
    disk, or on a disk that fails: EIO): an OSError of no file's. (Every write of a file of ours says its name:
    atomic_write, a run's log, a download's .part.) None for any other error."""
    if type(e) is not OSError or e.filename is not None:
        return None
    if e.errno in CANNOT_WRITE:
        return f"cannot write the output ({e.strerror})"
    # NOTE a read that fails says no file's name either (numpy's, a torch.load's): EIO may be either, so say both
    return e.errno == errno.EIO and "input/output error, writing the output or reading a file (a failing disk, or a " \
        "terminal gone)" or None


def stdout_closed():
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its end)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, ValueError, OSError):  # no poll (Windows), or no real stdout (a test's capture)
        return False


def is_accuracy(key):
    """Whether a metric's name is an accuracy's: acc (ProsQA), acc_4 (a tier's), val_acc_4 (on the validation split)."""
    return re.fullmatch(r"(val_)?acc(_\d+)?", key) is not None


def shown(value, most=80):
    """A config's value in a line: its repr, cut short past `most` characters (a run's shards: a dict of 99 files)."""
    text = repr(value)
    return text if len(text) <= most else text[:most - 3] + "..."


def show_value(key, value):
    """An accuracy in percent ('31.0%'), as the README shows them, anything else to 4 decimals ('0.2653').
    summary.json and log.jsonl keep accuracies as fractions."""
    return f"{100 * value:.1f}%" if is_accuracy(key) else f"{value:.4f}"


def show_metrics(metrics):
    """'val_loss 0.2653, val_ppl 1.3038, acc_4 31.0%'."""
    return ", ".join(f"{k} {show_value(k, v)}" for k, v in metrics.items())


# -----------------------------------------------------------------------------
# Config fields that are flags


def option(default, help, **rules):
    """A config field with its help text, which becomes its command-line flag's, and what else is said
    of its value: rule=POSITIVE or NON_NEGATIVE (any (text, test) pair) or choices=(...), which
    check_fields() enforces; resume="may change" (train.py: a resumed run may give it anew); data=a class of
    data set (runs.py: a flag for data of that class only, data.TaskRows say); path=True: a file or folder,
    whose flag refuses an empty value (a $VARIABLE not set) rather than take it for the default."""
    return field(default=default, metadata=dict(help=help, **rules))


POSITIVE = ("positive", lambda x: 0 < x < float("inf"))  # (written so that a NaN fails too, and infinity)
NON_NEGATIVE = (">= 0", lambda x: 0 <= x < float("inf"))
SEED = ("in 0 .. 2**63 - 1", lambda x: 0 <= x < 2**63)  # what torch.manual_seed and numpy both take
SIZE = ("in 1 .. 2**31 - 1", lambda x: 0 < x < 2**31)  # a dimension torch can hold: a typo of 20 digits is one line


def check_fields(config, name=str):
    """A ValueError for the first field of `config` whose value breaks its rule or is not among its choices."""
    for f in fields(config):
        value, rule, choices = getattr(config, f.name), f.metadata.get("rule"), f.metadata.get("choices")
        if rule and not rule[1](value):
            what = "finite" if value in (float("inf"), -float("inf")) else rule[0]
            raise ValueError(f"{name(f.name)} must be {what}, got {value}")
        if choices and value not in choices:
            raise ValueError(f"{name(f.name)}={value!r}: choose from {', '.join(choices)}")


# -----------------------------------------------------------------------------
# Files


def failure(e):
    """A failed request in a few words: "Failed to resolve 'host' ([Errno -2] Name or service not known)". requests'
    own text repeats the URL and every layer that wrapped the cause, some 300 characters for a machine offline."""
    cause = e.args[0] if e.args and isinstance(e.args[0], Exception) else e  # requests wraps urllib3's error
    cause = getattr(cause, "reason", None) or cause  # urllib3's MaxRetryError wraps the cause again
    texts = [str(a) for a in cause.args if isinstance(a, (str, BaseException)) and str(a)] or [type(cause).__name__]
    words = []
    for text in texts:  # 'Connection aborted.' and its cause, each without "HTTPSConnection(host='...', port=443): "
        text = text.split("): ", 1)[-1]
        words += [] if any(text in w for w in words) else [text]  # (not a cause its message already names)
    return " ".join(words)


def same_folder(a, b):
    """Whether paths a and b are one folder by any name (a trailing slash, a symlink); False where either is missing."""
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def hold_folder(folder, whose, wait=False):
    """Hold `folder` (made if it is not there) for this process until the descriptor returned is closed, or the
    process ends, however it ends (the system lets go of a dead process's flock: none is left behind). Held by
    another, a UsageError that says `whose` it may be; with `wait`, a line that says so, and then the wait until the
    other lets go. Two runs writing one folder would leave a log, a checkpoint and a summary of either."""
    return held_folder(folder, whose, wait)[0]


def held_folder(folder, whose, wait=False):
    """hold_folder's descriptor, and whether this call made the folder."""
    while True:
        made = not os.path.lexists(folder)
        Path(folder).mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(folder, os.O_RDONLY)
        except FileNotFoundError:  # (removed by its maker since mkdir)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                os.close(fd)
                raise UsageError(f"{folder} is in use by another process ({whose})") from None
            print(f"{folder} is in use by another process ({whose}): waiting for it", flush=True)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:  # (Ctrl-C while waiting)
                os.close(fd)
                raise
        except OSError:  # a file system without locks (some network ones): not held, as before there were any
            pass
        if held_there(fd, folder):
            return fd, made
        os.close(fd)  # NOTE the one it waited for removed the folder it made (cut short before it wrote): held, that
        # is gone, and a folder made anew at the path is not held: held again, then


def refuse_held(folder, whose):
    """hold_folder's UsageError where another process holds `folder`; else nothing, nothing held and no folder made."""
    if Path(folder).is_dir():
        os.close(hold_folder(folder, whose))


def being_written(folder):
    """Whether another process holds `folder` to write it (hold_folder: prepare_data.py), as a shared flock finds,
    let go at once (readers at once do not hold one another up). None there, or not a folder: no."""
    try:  # NOTE O_DIRECTORY: a FIFO by that name would block a plain open until something wrote to it
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a file system without locks
        pass
    finally:
        os.close(fd)
    return False


def refuse_writing(folder, whose="a prepare_data.py preparing it? wait for it to end"):
    """For a reader of `folder` (data a run reads): hold_folder's UsageError where another process writes it."""
    if being_written(folder):
        raise UsageError(f"{folder} is in use by another process ({whose})")


@contextmanager
def holding(folder, whose, wait=False):
    """hold_folder(folder, whose, wait) for the body of a `with`; a folder it made is removed after it if still empty
    (made for nothing, a command that failed: it goes again)."""
    fd, made = held_folder(folder, whose, wait)
    try:
        yield
    finally:
        try:
            if made and os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)
        finally:
            os.close(fd)


def held_there(fd, folder):
    """Whether the folder that hold_folder's `fd` holds is still the one at `folder` (not removed or replaced as this
    process waited for it: a lock on a folder gone holds nothing there)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(folder))
    except FileNotFoundError:
        return False


def file_state(path):
    """(inode, size, time of the last change) of the file at `path`, None where there is none: a file written since
    (replaced, appended to, deleted or new) compares unequal."""
    try:
        s = os.stat(path)
    except OSError:  # (none by that name, or none to read)
        return None
    return s.st_ino, s.st_size, s.st_mtime_ns


def folder_problem(path):
    """Why `path` cannot be a folder to write in (its first existing part is a file, say), or None."""
    for p in [Path(path), *Path(path).parents]:  # (os.path's tests: False under a folder this user may not enter,
        if os.path.islink(p) and not os.path.exists(p):  # which is named next, where Path's raise a PermissionError)
            return f"{p} is a symbolic link to nothing (or back to itself)"  # (mkdir would find the name taken)
        if os.path.exists(p):
            if not p.is_dir():  # (a FIFO or a device is no file either)
                return f"{p} is a file, not a folder" if p.is_file() else f"{p} is not a folder"
            return None if os.access(p, os.W_OK | os.X_OK) else f"{p} is not writable"
    return None


def check_a_file(path, then=""):
    """A DataError where `path` exists but is no regular file: a FIFO, whose read would wait for a writer forever, or
    a folder, which nothing could replace; or a symbolic link to nothing, which exists() calls missing: a read of it
    fails, and a write goes wherever it points. `then` ends the message where it is no link: what to do."""
    if Path(path).exists() and not Path(path).is_file():
        raise DataError(f"{path} is not a file{then}")
    if Path(path).is_symlink() and not Path(path).exists():
        raise DataError(f"{path} is a symbolic link to nothing (or back to itself): move it away")


def read_json(path, keys=()):
    """The JSON object in `path`, with `keys` among its keys; a DataError naming the file otherwise
    (missing, empty, cut short, not JSON, or not what this repo writes)."""
    path = Path(path)
    check_a_file(path)
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise DataError(f"no {path}") from None
    except OSError as e:
        raise Unreadable(f"{path} cannot be read ({e.strerror})") from None
    except (UnicodeDecodeError, ValueError) as e:  # a JSONDecodeError is a ValueError
        raise DataError(f"{path} is " + ("empty" if path.exists() and not path.stat().st_size else
                                         f"not valid JSON ({str(e).splitlines()[0]})")) from None
    except RecursionError:  # brackets nested deeper than Python's parser goes ([[[[...): no file of ours
        raise DataError(f"{path} is not what this repo writes: nested too deeply to read") from None
    if not isinstance(value, dict):
        raise DataError(f"{path} is not what this repo writes: not a JSON object")
    missing = [k for k in keys if k not in value]
    if missing:
        raise DataError(f"{path} is not what this repo writes: it has no {missing[0]!r}")
    return value


# what fsync says on a file system that cannot sync (ENOTSUP and EOPNOTSUPP are one code on Linux, two on macOS)
CANNOT_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def atomic_write(path, write):
    """Call write(f) on a temporary file beside `path`, then rename it into place: a reader sees
    the old file or the new one, never half of one, even after a crash. The temporary file is this process's own, so two
    processes writing one file (two runs that generate their preset's data at once) do not collide."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    problem = folder_problem(path.parent) or \
        (path.exists() and not path.is_file() and f"{path} is not a file")  # (a file where a folder should be, say;
    if problem:  # a folder where the file should be, or a device: /dev/null, which a rename would replace, as root)
        raise DataError(f"cannot write {path}: {problem}")
    # what a process killed while writing left goes first: on a full disk, its space (a checkpoint's: GBs) is this one's
    for stale in path.parent.glob(f"{glob.escape(path.name)}.*.tmp"):
        pid = stale.name[len(path.name) + 1:-len(".tmp")]
        if pid.isdigit() and not running(int(pid)) and not stale.is_dir():  # (a folder by that name is none of ours)
            try:
                stale.unlink(missing_ok=True)
            except OSError:  # another user's, in a folder they share: theirs to remove, and no reason not to write
                pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            try:
                os.fsync(f.fileno())  # on disk before it takes the name: after a power cut, the old file or the new one
            except OSError as e:
                if e.errno not in CANNOT_SYNC:  # (a file system that cannot: as it is, then)
                    raise
        os.replace(tmp, path)
        sync_folder(path.parent)  # the rename too: else a crash can leave the old name, or none for a new file
    except OSError as e:  # a full disk, say
        raise DataError(f"cannot write {path}: {e.strerror or e}") from None
    except RuntimeError as e:  # how torch.save says the same
        cause = e.__context__  # the error of its write, if any, says why ("No space left on device"); torch's own
        if isinstance(cause, OSError):  # only where it stopped ("unexpected pos 523328 vs 523216")
            raise DataError(f"cannot write {path}: {cause.strerror or cause}") from None
        raise DataError(f"cannot write {path}: {first_line(e)}") from None
    finally:
        tmp.unlink(missing_ok=True)


def sync_folder(folder):
    """fsync a folder, so that the names in it are on disk; where the OS cannot, nothing (no O_DIRECTORY: Windows; a
    folder it may not read; a file system that cannot sync one: EINVAL, ENOTSUP, or EBADF on some)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except (AttributeError, PermissionError):
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (*CANNOT_SYNC, errno.EBADF):
            raise
    finally:
        os.close(fd)


def running(pid):
    """Whether process `pid` is running (on Windows, where signal 0 is Ctrl-C: assumed so)."""
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


# -----------------------------------------------------------------------------
# The device


DEVICES = "auto (cuda, then mps, then cpu), cpu, cuda, cuda:N or mps"  # what pick_device takes, for a flag's help


def pick_device(name):
    """auto: cuda, then mps, then cpu. A device this machine does not have is a UsageError, and so is a
    LIME_TRITON that cannot run on it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    m = re.fullmatch(r"cpu|mps|cuda(?::(\d+))?", name)
    if m is None:
        raise UsageError(f"--device={name!r}: choose from auto, cpu, cuda, cuda:N, mps")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device={name}: " + ("this torch is a CPU-only build" if torch.version.cuda is None
                                                   else "no CUDA device is visible"))
    if m[1] and int(m[1]) >= (n := torch.cuda.device_count()):
        raise UsageError(f"--device={name}: this machine has {n} CUDA device{'s' * (n != 1)}, numbered from 0")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device=mps: MPS is not available on this machine")
    import kernels  # (here, not above: a script that picks no device need not load Triton)
    if problem := kernels.setting_problem(name):
        raise UsageError(problem)
    return name


COMPILE = ("auto", "on", "off")  # --compile's choices: auto is on for CUDA (see compiles)


def compiles(choice, device):
    """Whether --compile=`choice` compiles on `device`: on, or auto on CUDA."""
    return choice == "on" or (choice == "auto" and device.startswith("cuda"))


def dtype_for(device, choice="auto"):
    """--dtype's answer on `device`: auto is bfloat16 on CUDA (as training there uses), else float32."""
    return choice if choice != "auto" else "bfloat16" if device.startswith("cuda") else "float32"


def autocast_for(device, dtype="auto"):
    """bf16 autocast where dtype_for says bfloat16 (auto: on CUDA); else full precision."""
    bf16 = dtype_for(device, dtype) == "bfloat16"
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if bf16 else nullcontext()


def seed_draws(device, seed):
    """torch.manual_seed for the CPU and `device` alone. NOTE torch.manual_seed also queues the seed for every backend
    not started (CUDA, XPU, MTIA on a CPU-only run), formatting a stack trace for each: a millisecond a call, which a
    micro-step of a small model on a CPU notices."""
    torch.random.default_generator.manual_seed(seed)
    if device.startswith("cuda"):
        torch.cuda.manual_seed_all(seed)  # (as torch.manual_seed: started by now, so nothing is queued)
    elif device == "mps":
        torch.mps.manual_seed(seed)


def synchronize(device):
    """Wait for the device, so that a timer read next sees finished work (a CPU never lags)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def peak_memory(device):
    """The most memory this process has held, in bytes: CUDA's allocator on a GPU, else the peak resident size."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # NOTE ru_maxrss is in bytes on macOS, KiB on Linux


# dense bf16 peak of known accelerators, by a fragment of torch.cuda.get_device_name(); others show no MFU
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12)]


def peak_flops(device, dtype):
    """Dense bf16 peak FLOP/s of a known CUDA device; None (no MFU shown) for anything else."""
    if not device.startswith("cuda") or dtype != "bfloat16":
        return None
    return next((f for key, f in PEAK_FLOPS if key in torch.cuda.get_device_name(device)), None)
