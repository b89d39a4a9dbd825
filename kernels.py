"""
Fast routing for LIMe: one opaque op, `lime::route`, that torch.compile keeps inside a single
graph. It has a plain PyTorch implementation (the CPU path, and the fallback everywhere) and
Triton kernels for CUDA. `route_reference` in lime.py is the specification; the tests hold
both implementations here to it, the Triton kernels through Triton's CPU interpreter (with fp32 dot
operands there: the bf16 ones, LOW_PRECISION_DOTS, run only in the CUDA tests).

Push, not pull. The reference builds layer l's K/V by pulling its sources,
kv~_l = sum_{j <= l} R^(l)_j kv_j. Here layer j pushes instead: as soon as kv_j exists it
finishes its own routed K/V and adds its share to the running sum of every later layer
that reads it, in one op:

    route(kv, w, partials)[i] = partials[i] + w[i] @ kv        (at every position, over heads)

with kv = kv_j. The targets t_i are layer j itself and every later pushed layer that reads it
(for `lime`: j + 1, ..., L - 1, then j). w[i] = R^(t_i)_j, and partials[i] is the sum so far for
t_i; a target whose first source is layer j has none, and lime.Routing puts those last.

The sum is the same as pulling; the backward is what changes. A partial's gradient passes through
untouched (no copy). The gradient of kv_j is sum_i w[i]^T g_i over the gradients g_i of the outputs,
all of which exist by the time autograd reaches layer j: one kernel reads each g_i once and writes
grad kv_j once.
Pulling in the forward makes the backward push instead: every layer would read-modify-write
the gradients of all its sources, or autograd would add up l + 1 materialised pieces.

Traffic for `lime` with L layers, in slots (a slot is one layer's K/V, B*T*n_kv_head*2*head_dim
values: 100 MB in bf16 at the 150M shape with micro-batch 16 x 2048):
    forward    layer 0 reads kv_0 and writes L outputs; layer j > 0 reads kv_j and L - j partials
               and writes L - j outputs:     L + 1 + sum_{j=1}^{L-1} (2 (L - j) + 1)  = 156 at L = 12
    backward   layer j reads its L - j output gradients and kv_j, writes grad kv_j:
                                             sum_{j=0}^{L-1} (L - j + 2)              = 102 at L = 12
               plus grad w's per-tile shares, written and summed: 0.19 slot per output  ~ 15 at L = 12
    relaunch   a layer with more than NMAX = 8 outputs (layers 0-3 at L = 12) launches each kernel again:
               the forward reads kv_j once more, the backward kv_j and grad kv_j (1 + 3)  = 16 at L = 12
               (none with NMAX = 0, whose kernels loop over every output in one launch)
That is about 290 slot passes, 29 GB at the 150M shape: some 10 ms at 3 TB/s (a count, not a
measurement). Memory: kv_j is saved once per layer (one slot per layer: 12 x 100 MB at 150M), and
a partial lives only until its layer has run.

`python bench.py --device cuda --kernels` times the op alone, in GB/s against a plain copy; README
"Performance" has what it measured.

NOTE under bf16 the running sums are stored in bf16, so layer l's routed K/V is rounded once per
source summed into it (l + 1 times for `lime`) rather than once (and grad kv_j once more where the
backward relaunches). Measured on a
CPU at bench.py's 12-layer shape with bf16 autocast, the logits differ from fp32 by at most 0.0147
with this op and 0.0155 with route_reference.
"""

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch come without Triton: the plain path needs none
    triton = None

# LIME_TRITON: auto (Triton for CUDA tensors), 0 (plain PyTorch everywhere), or 1 (Triton for every
# tensor; on the CPU that needs TRITON_INTERPRET=1, which is how the tests run the kernels)
USE_TRITON = os.environ.get("LIME_TRITON", "auto")
# outputs per kernel launch, the loop over them unrolled: a source with more readers launches again and rereads kv.
# 0: one launch takes every output, looping over tables of their addresses (bench.py --kernels --sweep tries 8 and 0)
NMAX = 8
COLUMNS, NUM_WARPS = 256, 4  # a tile is about COLUMNS (position, e) pairs wide; warps per program
# the backward's grad-w product, (KP x columns) @ (columns x KP), as SPLIT products over a share of the columns each,
# one batched dot (a power of 2): fewer registers a thread than the one long product of 1 (README "Performance")
SPLIT = 1
# 1: where n_kv is a power of 2 below 16 (8 at the 1B GQA shape and the deep one), a tile's 16 rows hold the heads of
# 16 / n_kv positions, not one position's heads padded with zero rows (half the rows at 8 heads: masked loads and
# stores, a dot and registers half spent on zeros). The kernels see G = 16 / n_kv positions as one of G * n_kv heads,
# mixed by w[i] G times on the diagonal (_w_tile), where G divides B*T (kernels.packing). Elsewhere it changes nothing.
# NOTE 0 * inf is NaN in the dot: an inf or NaN in one position's K/V (or gradient) spreads to those packed with it,
# another sequence's first position too, where unpacked it stays in its own (either way the loss is then NaN)
PACK = 0
# bf16 K/V: the dot operands stay bf16, w cast to bf16 as the plain path does; accumulation is fp32 either
# way. False converts the operands to fp32 first (tf32 dots): a much slower backward (bench.py --kernels)
LOW_PRECISION_DOTS = True
# LIME_TILE: COLUMNS/NUM_WARPS/NMAX/SPLIT/PACK for this process, as bench.py --kernels --sweep names a tile (e.g.
# 256/4/0/4/1): a tile tried, or kept for one GPU, without editing this file
KNOBS = ("COLUMNS", "NUM_WARPS", "NMAX", "SPLIT", "PACK")  # a tile's knobs, in that order
TILE = os.environ.get("LIME_TILE")


def tile_problem(tile):
    """What is wrong with a LIME_TILE value (a message), or None."""
    parts = tile.split("/")
    if len(parts) != len(KNOBS) or not all(part.isascii() and part.isdigit() for part in parts):
        return f"LIME_TILE={tile!r}: five whole numbers, {'/'.join(KNOBS)}, e.g. 256/4/8/1/0"
    columns, warps, nmax, split, pack = map(int, parts)
    if not all(0 < n and n & (n - 1) == 0 for n in (columns, warps, split)) or not 16 <= columns <= 4096 \
            or warps > 32 or nmax > 64 or pack > 1:
        return (f"LIME_TILE={tile!r}: COLUMNS (16 to 4096), NUM_WARPS (32 at most) and SPLIT are powers of 2, "
                "NMAX 0 to 64, PACK 0 or 1")
    return None


if TILE and not tile_problem(TILE):  # (a bad one is refused as a script picks its device: setting_problem)
    COLUMNS, NUM_WARPS, NMAX, SPLIT, PACK = map(int, TILE.split("/"))


def setting_problem(device):
    """What is wrong with LIME_TRITON or LIME_TILE for a run on `device` (a message), or None: checked as a script
    picks its device (cli.pick_device), where a bad value would otherwise be a traceback from Triton or silently
    the default."""
    if TILE and (problem := tile_problem(TILE)):
        return problem
    if USE_TRITON not in ("auto", "0", "1"):
        return f"LIME_TRITON={USE_TRITON!r}: choose from auto (Triton on CUDA), 0 (plain PyTorch) or 1 (Triton always)"
    if USE_TRITON == "1" and triton is None:
        return "LIME_TRITON=1: this Python has no Triton (CUDA builds of torch bring it; or pip install triton)"
    if USE_TRITON == "1" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"LIME_TRITON=1 on {device}: Triton runs there only through its CPU interpreter, so set "
                "TRITON_INTERPRET=1 too (slow: how the tests run the kernels)")
    return None


def use_triton(t):
    if triton is None or t.dtype == torch.float64:  # (the kernels' dots take fp32 at most: a .double() model's K/V)
        return False
    return USE_TRITON == "1" or (USE_TRITON == "auto" and t.is_cuda)


@torch.library.custom_op("lime::route", mutates_args=())
def route(kv: Tensor, w: Tensor, partials: list[Tensor]) -> list[Tensor]:
    """kv (B, T, n_kv, E), w (n_out, n_kv, n_kv) -> n_out tensors like kv: w[i] @ kv at every position,
    plus partials[i] (a running sum like kv) for the first len(partials) outputs."""
    if use_triton(kv):
        return _route_triton(kv.contiguous(), w.contiguous(), [p.contiguous() for p in partials])
    x = kv.reshape(-1, *kv.shape[-2:])  # (B*T, n_kv, E)
    outs = []
    for i, wi in enumerate(w.to(kv.dtype)):
        wi = wi.expand(x.shape[0], *wi.shape)  # the same (n_kv, n_kv) mixing at every position
        out = torch.baddbmm(partials[i].reshape(x.shape), wi, x) if i < len(partials) else torch.bmm(wi, x)
        outs.append(out.view(kv.shape))  # fresh and contiguous, as the fake says: torch.compile relies on it
    return outs


@route.register_fake
def _(kv, w, partials):
    return [kv.new_empty(kv.shape) for _ in range(w.shape[0])]


@torch.library.custom_op("lime::route_backward", mutates_args=())
def route_backward(grads: list[Tensor], kv: Tensor, w: Tensor, need_w: bool) -> tuple[Tensor, Tensor]:
    """The gradients of `route`'s kv and w from its outputs' gradients (grad w is zeros unless need_w)."""
    if use_triton(kv):
        return _route_backward_triton([g.contiguous() for g in grads], kv.contiguous(), w.contiguous(), need_w)
    x = kv.reshape(-1, *kv.shape[-2:])  # (B*T, n_kv, E)
    grads = [g.reshape(x.shape) for g in grads]  # each (B*T, n_kv, E)
    wt = w.to(kv.dtype).transpose(1, 2)  # (n_out, n_kv, n_kv): wt[i] = w[i]^T
    grad_kv = torch.bmm(wt[0].expand(x.shape[0], *wt[0].shape), grads[0])
    for wi, g in zip(wt[1:], grads[1:]):  # grad kv = sum_i w[i]^T g_i
        grad_kv.baddbmm_(wi.expand(x.shape[0], *wi.shape), g)
    grad_w = w.new_zeros(w.shape)  # contiguous, as the fake says (zeros_like would keep a transposed w's strides)
    if need_w:  # grad w[i] = sum over positions of g_i @ kv^T, in fp32 (fp64 for fp64 K/V)
        acc = torch.promote_types(kv.dtype, torch.float32)
        xt = x.to(acc).transpose(1, 2)  # (B*T, E, n_kv)
        grad_w = torch.stack([torch.bmm(g.to(acc), xt).sum(0) for g in grads])  # (n_out, n_kv, n_kv)
    return grad_kv.view(kv.shape), grad_w.to(w.dtype)  # contiguous, as the fake says


@route_backward.register_fake
def _(grads, kv, w, need_w):
    return kv.new_empty(kv.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output):
    kv, w, partials = inputs
    ctx.save_for_backward(kv, w)  # kv_j, saved once: every later layer's share of it is computed here
    ctx.n_partials = len(partials)


def _backward(ctx, grads):
    kv, w = ctx.saved_tensors
    need_w = ctx.needs_input_grad[1]  # not where all of w is fixed: `average`'s
    grad_kv, grad_w = route_backward(list(grads), kv, w, need_w)
    return grad_kv, grad_w if need_w else None, list(grads[:ctx.n_partials])  # partials: passed through


route.register_autograd(_backward, setup_context=_setup_context)


# -----------------------------------------------------------------------------
# Triton kernels. A program takes a tile of BP positions: kv[pos] is an (n_kv, E) matrix, so the
# tile is (KP, BP * BE) with a row per head and a column per (position, e), and it is one
# contiguous stretch of memory. Mixing heads is then a (KP, KP) @ (KP, BP * BE) product.
# NOTE tl.dot needs every side >= 16 (Triton 3.6), so heads are padded with zeros to KP >= 16 (or, with PACK, the
# rows filled with the heads of the next positions: the kernels take G positions as one of G * n_kv heads). LOWP
# keeps bf16 operands in the dots; without it they go to fp32 first, which Triton's CPU interpreter needs,
# since it cannot multiply bf16 matrices (the tests run the kernels there in fp32 dots).

if triton is not None:

    @triton.jit
    def _tile(tile, P, NKV: tl.constexpr, E: tl.constexpr, KP: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr):
        head = tl.arange(0, KP)
        col = tl.arange(0, BP * BE)
        pos, e = tile * BP + col // BE, col % BE
        offs = pos[None, :] * (NKV * E) + head[:, None] * E + e[None, :]  # kv is (P, NKV, E), contiguous
        mask = (head[:, None] < NKV) & (pos[None, :] < P) & (e[None, :] < E)
        return offs, mask

    @triton.jit
    def _w_tile(NKV: tl.constexpr, KP: tl.constexpr, G: tl.constexpr):
        """Where a tile's (KP, KP) mixing matrix reads w[i], of K = NKV / G heads: in its top left, zeros around it; or
        packed (G > 1), G times on its diagonal, once for each position taken as one (block-diagonal), so that each is
        mixed alone. -> the offsets of w[i], of w[i] transposed (element (k, h) is w[i, h, k]), and their mask."""
        head = tl.arange(0, KP)
        if G == 1:
            w_offs, wt_offs = head[:, None] * NKV + head[None, :], head[None, :] * NKV + head[:, None]
            w_mask = (head[:, None] < NKV) & (head[None, :] < NKV)
        else:
            tl.static_assert(KP == NKV, "packed: G positions fill the tile's rows, no padding")
            K: tl.constexpr = NKV // G
            h, position = head % K, head // K
            w_offs, wt_offs = h[:, None] * K + h[None, :], h[None, :] * K + h[:, None]
            w_mask = position[:, None] == position[None, :]
        return w_offs, wt_offs, w_mask

    @triton.jit
    def _at(table, i, like, ALIGNED: tl.constexpr):
        """Entry i of a table of addresses (NMAX = 0), as a pointer to `like`'s element type."""
        p = tl.load(table + i).to(tl.pointer_type(like.dtype.element_ty))
        # NOTE an address loaded from memory says nothing of its alignment, where Triton finds that of a pointer
        # argument itself: without the hint every load and store of it is one element wide, not 16 bytes
        return tl.multiple_of(p, 16) if ALIGNED else p

    @triton.jit
    def _fwd_one(x, w_i, out_i, partial_i, i, n_partial, offs, mask, w_offs, w_mask, PREC: tl.constexpr):
        wi = tl.load(w_i + w_offs, mask=w_mask, other=0.0).to(x.dtype)
        y = tl.dot(wi, x, input_precision=PREC)  # (KP, BP * BE)
        if i < n_partial:
            y += tl.load(partial_i + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_i + offs, y.to(out_i.dtype.element_ty), mask=mask)

    @triton.jit
    def _route_fwd(kv, w, outs, partials, n_out, n_partial, P, NKV: tl.constexpr, E: tl.constexpr,
                   KP: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr, G: tl.constexpr, NMAX: tl.constexpr,
                   ALIGNED: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
        offs, mask = _tile(tl.program_id(0), P, NKV, E, KP, BE, BP)
        x = tl.load(kv + offs, mask=mask, other=0.0)  # read once for all outputs
        if not LOWP:
            x = x.to(tl.float32)
        w_offs, _, w_mask = _w_tile(NKV, KP, G)
        K: tl.constexpr = NKV // G  # w is (n_out, K, K)
        if NMAX == 0:  # outs, partials: tables of addresses; a loop that runs n_out times
            for i in range(n_out):
                _fwd_one(x, w + i * K * K, _at(outs, i, kv, ALIGNED), _at(partials, i, kv, ALIGNED), i,
                         n_partial, offs, mask, w_offs, w_mask, PREC)
        else:  # outs, partials: tuples of NMAX pointers; the loop unrolled
            for i in tl.static_range(NMAX):
                if i < n_out:
                    _fwd_one(x, w + i * K * K, outs[i], partials[i], i, n_partial, offs, mask, w_offs, w_mask, PREC)

    @triton.jit
    def _bwd_one(acc, xt, g_i, w, grad_w, i, n_total, offs, mask, w_offs, wt_offs, w_mask, NKV: tl.constexpr,
                 G: tl.constexpr, NEED_W: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr):
        g = tl.load(g_i + offs, mask=mask, other=0.0)  # read once for both gradients
        if not LOWP:
            g = g.to(tl.float32)
        K: tl.constexpr = NKV // G  # the heads of one position: w is (n_out, K, K)
        wt = tl.load(w + i * K * K + wt_offs, mask=w_mask, other=0.0).to(g.dtype)
        acc += tl.dot(wt, g, input_precision=PREC)
        if NEED_W:  # this tile's share of grad w[i] = g_i @ x^T, summed over the tiles by torch
            if SPLIT == 1:
                gw = tl.dot(g, xt, input_precision=PREC)  # (KP, KP)
            else:  # (KP, C) -> (SPLIT, KP, C / SPLIT): a batch of shorter products, then their sum
                g3 = tl.permute(tl.reshape(g, (g.shape[0], SPLIT, g.shape[1] // SPLIT)), (1, 0, 2))
                gw = tl.sum(tl.dot(g3, xt, input_precision=PREC), axis=0)  # (SPLIT, KP, KP) -> (KP, KP)
            share = grad_w + (tl.program_id(0) * n_total + i) * K * K
            if G == 1:
                tl.store(share + w_offs, gw, mask=w_mask)
            else:  # packed (PACK): the G blocks on gw's diagonal (w_mask), one a position, summed (the others mix two)
                blocks = tl.reshape(tl.where(w_mask, gw, 0.0), (G, K, G, K))
                h = tl.arange(0, K)
                tl.store(share + h[:, None] * K + h[None, :], tl.sum(tl.sum(blocks, axis=2), axis=0))
        return acc

    @triton.jit
    def _route_bwd(kv, w, grads, grad_kv, grad_w, n_out, n_total, P, NKV: tl.constexpr, E: tl.constexpr,
                   KP: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr, G: tl.constexpr, NMAX: tl.constexpr,
                   ALIGNED: tl.constexpr, NEED_W: tl.constexpr, SPLIT: tl.constexpr, ACCUMULATE: tl.constexpr,
                   PREC: tl.constexpr, LOWP: tl.constexpr):
        offs, mask = _tile(tl.program_id(0), P, NKV, E, KP, BE, BP)
        w_offs, wt_offs, w_mask = _w_tile(NKV, KP, G)
        acc = tl.zeros((KP, BP * BE), tl.float32)
        if ACCUMULATE:  # an earlier launch covered the first NMAX outputs
            acc += tl.load(grad_kv + offs, mask=mask, other=0.0).to(tl.float32)
        xt = 0  # (read only for NEED_W)
        if NEED_W:
            x = tl.load(kv + offs, mask=mask, other=0.0)
            if not LOWP:
                x = x.to(tl.float32)
            xt = tl.trans(x)  # (C, KP), C = BP * BE columns
            if SPLIT > 1:  # (KP, C) -> (SPLIT, C / SPLIT, KP)
                xt = tl.permute(tl.reshape(x, (KP, SPLIT, BP * BE // SPLIT)), (1, 2, 0))
        if NMAX == 0:  # grads: a table of addresses; a loop that runs n_out times
            for i in range(n_out):
                acc = _bwd_one(acc, xt, _at(grads, i, kv, ALIGNED), w, grad_w, i, n_total, offs, mask, w_offs,
                               wt_offs, w_mask, NKV, G, NEED_W, SPLIT, PREC, LOWP)
        else:  # grads: a tuple of NMAX pointers; the loop unrolled
            for i in tl.static_range(NMAX):
                if i < n_out:
                    acc = _bwd_one(acc, xt, grads[i], w, grad_w, i, n_total, offs, mask, w_offs, wt_offs, w_mask,
                                   NKV, G, NEED_W, SPLIT, PREC, LOWP)
        tl.store(grad_kv + offs, acc.to(grad_kv.dtype.element_ty), mask=mask)


def packing(kv, pack=None):
    """G, how many positions the kernels take as one (PACK, or `pack`): 16 / n_kv where n_kv is a power of 2 below 16
    and G divides the positions, else 1."""
    n_kv, E = kv.shape[-2:]
    G = 16 // n_kv if (PACK if pack is None else pack) and n_kv < 16 and 16 % n_kv == 0 else 1
    return G if kv.numel() // (n_kv * E) % G == 0 else 1


def _launch_shape(kv, tensors):
    """Block sizes and choices: G positions taken as one (packing), their G * n_kv heads padded to KP, E to BE, BP such
    positions per tile (COLUMNS columns); ALIGNED where every tensor a launch reaches starts on 16 bytes (a contiguous
    view need not), as a table's addresses then say."""
    G = packing(kv)
    n_kv, E = G * kv.shape[-2], kv.shape[-1]
    assert kv.numel() < 2**31, "int32 offsets in the kernels"
    BE = triton.next_power_of_2(E)
    lowp = LOW_PRECISION_DOTS and kv.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") != "1"
    return dict(NKV=n_kv, E=E, KP=max(16, triton.next_power_of_2(n_kv)), BE=BE, BP=max(1, COLUMNS // BE), G=G,
                NMAX=NMAX, ALIGNED=all(t.data_ptr() % 16 == 0 for t in tensors),
                PREC="ieee" if kv.dtype == torch.float32 else "tf32", LOWP=lowp, num_warps=NUM_WARPS,
                # NOTE a * b + c as one rounding (FMA), as the kernels were tested and timed on a GPU: said, not left
                # to Triton's default, which 3.10 turns off (3.9 warns of it once, as a process first compiles one)
                enable_fp_fusion=True)


def _split(meta):
    """SPLIT, or fewer shares where the tile is narrow: tl.dot on a GPU takes products of 16 columns or more (the
    interpreter takes any)."""
    return max(1, min(SPLIT, meta["BP"] * meta["BE"] // 16))


def _chunks(n):
    """The outputs each launch takes, (start, end): NMAX at a time, or all n at once where NMAX is 0."""
    step = NMAX or max(n, 1)
    return [(start, min(n, start + step)) for start in range(0, n, step)]


def _pointers(tensors, n, filler):
    """One launch's n outputs, partials or gradients: a tuple of NMAX (slots past the tensors, filler's, are never
    touched), or for NMAX = 0 a table of their n addresses on the device.
    NOTE a table holds bare addresses, which keep nothing alive: the tensors are the caller's until the kernel has run
    (the launch is on the current stream, as is every later use of their memory)."""
    assert all(t.dtype == filler.dtype for t in tensors), "a table's addresses are read as the K/V's dtype"
    tensors = tuple(tensors) + (filler,) * ((NMAX or n) - len(tensors))
    if NMAX:
        return tensors
    # NOTE a copy to the GPU from pageable memory waits until the GPU has run all it was given, every layer, forward
    # and backward; from pinned memory it waits for nothing (the pinned buffer is kept until the copy has run)
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, pin_memory=filler.is_cuda)
    return table.to(filler.device, non_blocking=True)


def _route_triton(kv, w, partials):
    outs = [torch.empty_like(kv) for _ in range(w.shape[0])]
    meta = _launch_shape(kv, [kv, *outs, *partials])
    P = kv.numel() // (meta["NKV"] * meta["E"])  # positions, B*T (packed: B*T / G, each G positions)
    for a, b in _chunks(len(outs)):
        part = partials[a:b]
        _route_fwd[(triton.cdiv(P, meta["BP"]),)](kv, w[a:], _pointers(outs[a:b], b - a, kv),
                                                   _pointers(part, b - a, kv), b - a, len(part), P, **meta)
    return outs


def _route_backward_triton(grads, kv, w, need_w):
    grad_kv = torch.empty_like(kv)
    meta = _launch_shape(kv, [kv, grad_kv, *grads])
    P = kv.numel() // (meta["NKV"] * meta["E"])
    programs = triton.cdiv(P, meta["BP"])
    # one (n_kv, n_kv) share of every grad w[i] per program, in fp32: 2 n_kv / (G BP E) of the bytes of the
    # program's g_i tile (9% at 150M), then read once more by the sum. One writer per share: no atomics,
    # so the sum is the same at every run
    gw = torch.empty(programs if need_w else 1, len(grads), *w.shape[1:], device=kv.device, dtype=torch.float32)
    assert gw.numel() < 2**31, "int32 offsets in the kernels"
    for a, b in _chunks(len(grads)):
        _route_bwd[(programs,)](kv, w[a:], _pointers(grads[a:b], b - a, kv), grad_kv, gw[:, a:], b - a, len(grads),
                                P, NEED_W=need_w, SPLIT=_split(meta), ACCUMULATE=a > 0, **meta)
    return grad_kv, gw.sum(0).to(w.dtype) if need_w else w.new_zeros(w.shape)
