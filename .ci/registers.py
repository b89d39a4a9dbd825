"""The Triton routing kernels compiled for an H100/H200 (sm_90) on this machine, which needs no GPU: the registers a
thread of each kernel takes, and the bytes it spills, at each tile, specialized as a launch on a GPU specializes them
(every address on 16 bytes, the position count a multiple of 16). Registers decide how many programs a multiprocessor
holds (65536 registers, 64 warps), and so the bytes in flight of a kernel that memory bounds: a lead for a tile, not a
timing (bench.py --kernels --sweep times them on a GPU).

    python .ci/registers.py                          # the kernels' tile, at the 150M (12 kv heads) and 1B GQA (8) slots
    python .ci/registers.py --sweep --shape 1b       # every tile bench.py's --sweep times, at the 1B GQA slot
    LIME_TILE=256/4/0/4/1 python .ci/registers.py    # one tile, as kernels.py takes it

Needs Triton with its NVIDIA backend (pip's triton, and CUDA builds of torch, bring it, cuobjdump included).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # (before Triton is imported: interpreted kernels compile to nothing)

import torch  # noqa: E402

import kernels  # noqa: E402
from bench import SHAPES, sweep_tiles  # noqa: E402

# among the NVIDIA tools that pip's Triton brings along
CUOBJDUMP = Path(getattr(kernels.triton, "__file__", ".")).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class Target:
    """Stands in for Triton's CUDA driver, which needs a GPU, where a launch asks what to compile for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)  # sm_90: H100, H200

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compiled(which, n_kv, E, n=8):
    """One kernel, forward or backward, at kernels.py's knobs as they are, for lime's layer with n outputs."""
    kv = torch.empty(1024, n_kv, E, dtype=torch.bfloat16)  # positions a multiple of 16, on 16 bytes, as on a GPU
    meta = kernels._launch_shape(kv, [kv])
    P = kv.numel() // (meta["NKV"] * E)  # positions, or groups of G of them (PACK)
    pointers = kernels._pointers([kv] * n, n, kv) if kernels.NMAX else torch.empty(n, dtype=torch.int64)
    w = torch.empty(n, n_kv, n_kv)
    if which == "forward":
        return kernels._route_fwd.warmup(kv, w, pointers, pointers, n, n - 1, P, grid=(1,), **meta)
    return kernels._route_bwd.warmup(kv, w, pointers, kv, torch.empty(1, n, n_kv, n_kv), n, n, P, NEED_W=True,
                                     SPLIT=kernels._split(meta), ACCUMULATE=False, grid=(1,), **meta)


def resources(kernel):
    """(registers a thread, bytes of stack a thread: its spills) of a compiled kernel, as cuobjdump reads its binary."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        done = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", done.stdout)
    if not found:
        fail(f"{CUOBJDUMP} read no registers off the binary: {(done.stderr or done.stdout).strip()[:200]}")
    return int(found[1]), int(found[2])


def programs(registers, warps):
    """Programs a multiprocessor holds (sm_90): by registers, allocated 8 at a time a thread, from each of its 4
    quarters' 16384 (a warp's in one quarter); by warps, 64; by programs, 32."""
    warps_a_quarter = 16384 // (-(-registers // 8) * 8 * 32)
    return min(4 * warps_a_quarter // warps, 64 // warps, 32)


def fail(message):
    print(f"registers.py: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="every tile bench.py's --sweep times, not the kernels' own")
    p.add_argument("--shape", choices=("150m", "1b"), help="one slot's kernels only (default: both)")
    args = p.parse_args(argv)
    if kernels.triton is None:
        fail("this Python has no Triton (pip install triton)")
    if not CUOBJDUMP.exists():
        fail(f"this Triton has no NVIDIA backend with its tools ({CUOBJDUMP})")
    if problem := kernels.setting_problem("cuda"):  # (LIME_TILE's, or LIME_TRITON's)
        fail(problem)
    from triton.runtime import driver
    driver.set_active(Target())  # (for this process, which launches nothing)
    chosen = tuple(getattr(kernels, name) for name in kernels.KNOBS)
    print(f"Triton {kernels.triton.__version__}, sm_90, bf16 K/V, dot operands "
          f"{'bf16' if kernels.LOW_PRECISION_DOTS else 'fp32'}; tile: {'/'.join(kernels.KNOBS)}; registers a thread "
          "(programs a multiprocessor holds), bytes of stack (spills)")
    for shape in [args.shape] if args.shape else ["150m", "1b"]:
        n_kv, E = SHAPES[shape]["n_kv_head"], 2 * SHAPES[shape]["n_embd"] // SHAPES[shape]["n_head"]
        print(f"{shape}: {n_kv} kv heads of {E} values")
        for tile in sweep_tiles(torch.empty(1024, n_kv, E, device="meta")) if args.sweep else [chosen]:
            kernels.__dict__.update(zip(kernels.KNOBS, tile))
            row = []
            for which in ("forward", "backward"):
                registers, spilled = resources(compiled(which, n_kv, E))
                row.append(f"{which} {registers:3d} ({programs(registers, kernels.NUM_WARPS)}) {spilled:4d} B")
            print(f"  {'/'.join(map(str, tile)):>12}  " + "   ".join(row), flush=True)


if __name__ == "__main__":
    main()
