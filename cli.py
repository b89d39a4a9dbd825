"""
What every command here shares: bad input as one line with its exit code, config fields that
are command-line flags, writes that never leave a half-written file, and the device.

Exit codes, the same in every script: 2 for bad usage (argparse's convention), 1 for a failure
at run time (missing data, a failed download, a NaN loss), 128 + the signal number after an
interruption (130 for Ctrl-C, 143 for SIGTERM).
"""

import argparse
import os
import re
import signal
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import field, fields
from pathlib import Path

import torch


class UsageError(ValueError):
    """Bad input: printed as one line, exit code 2, nothing written."""


class DataError(Exception):
    """Data that is missing or broken, a problem the user can fix: one line, exit code 1."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other bad input, not argparse's usage block
        raise UsageError(message)


def fail(script, message, code):
    """One line on stderr, then exit with `code`."""
    print(f"{script}: {message}", file=sys.stderr)
    sys.exit(code)


@contextmanager
def one_line_errors(script, data_hint=lambda e: "", interrupted=""):
    """Bad usage, a data problem or an interruption inside ends the script with one line and its
    exit code. data_hint(e): what to add to a DataError's message; `interrupted`: what to say after
    Ctrl-C or SIGTERM (an exception with `signum`, as train.py's signal handler raises)."""
    try:
        yield
    except UsageError as e:
        fail(script, f"error: {e}", 2)
    except DataError as e:
        fail(script, f"error: {e}{data_hint(e)}", 1)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        fail(script, f"interrupted ({signal.Signals(signum).name}){interrupted}", 128 + signum)


# -----------------------------------------------------------------------------
# Config fields that are flags


def option(default, help, **rules):
    """A config field with its help text, which becomes its command-line flag's, and what else is said
    of its value: rule=POSITIVE or NON_NEGATIVE (any (text, test) pair) or choices=(...), which
    check_fields() enforces; resume="may change" (train.py: a resumed run may give it anew)."""
    return field(default=default, metadata=dict(help=help, **rules))


POSITIVE = ("positive", lambda x: x > 0)  # (written so that a NaN fails too)
NON_NEGATIVE = (">= 0", lambda x: x >= 0)


def check_fields(config, name=str):
    """A ValueError for the first field of `config` whose value breaks its rule or is not among its choices."""
    for f in fields(config):
        value, rule, choices = getattr(config, f.name), f.metadata.get("rule"), f.metadata.get("choices")
        if rule and not rule[1](value):
            raise ValueError(f"{name(f.name)} must be {rule[0]}, got {value}")
        if choices and value not in choices:
            raise ValueError(f"{name(f.name)}={value!r}: choose from {', '.join(choices)}")


# -----------------------------------------------------------------------------
# Files


def folder_problem(path):
    """Why `path` cannot be a folder to write in (its first existing part is a file, say), or None."""
    for p in [Path(path), *Path(path).parents]:
        if p.exists():
            if not p.is_dir():
                return f"{p} is a file, not a folder"
            return None if os.access(p, os.W_OK | os.X_OK) else f"{p} is not writable"
    return None


def atomic_write(path, write):
    """Call write(f) on a temporary file beside `path`, then rename it into place: a reader sees
    the old file or the new one, never half of one."""
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
# The device


def pick_device(name):
    """auto: cuda, then mps, then cpu. A device this machine does not have is a UsageError."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    m = re.fullmatch(r"cpu|mps|cuda(?::(\d+))?", name)
    if m is None:
        raise UsageError(f"--device={name!r}: choose from auto, cpu, cuda, cuda:N, mps")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device={name}: " + ("this torch is a CPU-only build" if torch.version.cuda is None
                                                   else "no CUDA device is visible"))
    if m[1] and int(m[1]) >= torch.cuda.device_count():
        raise UsageError(f"--device={name}: there are {torch.cuda.device_count()} CUDA devices, numbered from 0")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device=mps: MPS is not available on this machine")
    return name


def autocast_for(device, dtype=None):
    """bf16 autocast if dtype is "bfloat16" (by default on CUDA, as training there uses); else full precision."""
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return torch.autocast(device.split(":")[0], dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()


def synchronize(device):
    """Wait for the device, so that a timer read next sees finished work (a CPU never lags)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# dense bf16 peak of known accelerators, by a fragment of torch.cuda.get_device_name(); others show no MFU
PEAK_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("L40S", 362e12)]


def peak_flops(device, dtype):
    """Dense bf16 peak FLOP/s of a known CUDA device; None (no MFU shown) for anything else."""
    if not device.startswith("cuda") or dtype != "bfloat16":
        return None
    return next((f for key, f in PEAK_FLOPS if key in torch.cuda.get_device_name(device)), None)
