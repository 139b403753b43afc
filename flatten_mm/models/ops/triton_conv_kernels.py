"""Triton kernels of the depth-wise conv of V added to the attention output
(design: :mod:`.triton_conv`).

Tensors are token rows (B, L, C) on an H x W grid (L = H * W, row-major), with
unit channel stride and any batch and token strides: V as the layer holds it
(a channels-last map is the same memory), no NCHW copy. The conv is the
layer's: odd K x K taps per channel, zero padding K // 2, stride 1.

Imported on the first call, like :mod:`.triton_kernels` (whose interpreter
switch, multiprocessor count and compile options it shares).
"""
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_kernels import COMPILE_OPTIONS, INTERPRETED, sm_count


@triton.jit
def _tap(x_ptr, b, y, xw, rmask, chans, cmask, dy, dx, H, W, stride_b, stride_n):
    """fp32 (rows, channels) block of x at each row's grid point shifted by
    (dy, dx); 0 where the shifted point is off the grid (the zero padding)."""
    yy = y + dy
    xx = xw + dx
    ok = rmask & (yy >= 0) & (yy < H) & (xx >= 0) & (xx < W)
    offs = b.to(tl.int64) * stride_b + (yy * W + xx).to(tl.int64) * stride_n
    ptrs = x_ptr + offs[:, None] + chans[None, :]
    return tl.load(ptrs, mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _rows_program(R, L, W, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, block):
    """Rows ``block`` * BLOCK_P ... of the B * L token rows (images back to back,
    so many small windows share a program), with image, grid point and masks,
    and program_id(1)'s channel block."""
    rows = block * BLOCK_P + tl.arange(0, BLOCK_P)
    rmask = rows < R
    b = rows // L
    pix = rows % L
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return rmask, b, pix, pix // W, pix % W, chans, chans < C


@triton.jit
def _centred_tap(t, K: tl.constexpr, KS: tl.constexpr):
    """Where tap t of a K x K kernel falls in a centred KS x KS one (KS <= K):
    its index there, and whether it falls inside (t itself where KS = K: no
    index arithmetic, registers the conv's loop keeps for its taps)."""
    if KS == K:
        return t, t < K * K
    o = (K - KS) // 2
    i = t // K - o
    j = t % K - o
    return i * KS + j, (i >= 0) & (i < KS) & (j >= 0) & (j < KS)


@triton.jit
def _kernel_tap(w_ptr, e_ptr, chans, cmask, wc, t, K: tl.constexpr, K1: tl.constexpr,
                K2: tl.constexpr, HAS_EXTRA: tl.constexpr):
    """fp32 tap t (of K x K) of each channel's kernel, summed from its parts
    (:func:`.conv.merged_kernel`): channel c's group's in w (C' = ``wc``
    channels, K1 x K1: c % wc), plus with HAS_EXTRA its own in e (K2 x K2),
    each centred (0 where t falls outside it)."""
    idx, inside = _centred_tap(t, K, K1)
    w = tl.load(w_ptr + (chans % wc) * (K1 * K1) + idx, mask=cmask & inside,
                other=0.0).to(tl.float32)
    if HAS_EXTRA:
        idx2, inside2 = _centred_tap(t, K, K2)
        w += tl.load(e_ptr + chans * (K2 * K2) + idx2, mask=cmask & inside2,
                     other=0.0).to(tl.float32)
    return w


@triton.jit
def _conv_add_kernel(x_ptr, w_ptr, bias_ptr, e_ptr, ebias_ptr, base_ptr, out_ptr, R, L, H, W,
                     C, wc, stride_xb, stride_xn, stride_bb, stride_bn, stride_ob, stride_on,
                     K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, FLIP: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_BASE: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out = base + bias + conv(x) for a block of rows and channels, summed in
    fp32 and rounded once; the kernel and bias read from their parts
    (:func:`_kernel_tap`). FLIP takes the kernel rotated by 180 degrees: the
    conv's input gradient is the flipped conv of the output gradient."""
    rmask, b, pix, y, xw, chans, cmask = _rows_program(R, L, W, C, BLOCK_P, BLOCK_C,
                                                       tl.program_id(0))
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for t in range(K * K):  # a loop, not unrolled: one tap's block live at a time
        i = t // K
        j = t % K
        tap = K * K - 1 - t if FLIP else t
        w = _kernel_tap(w_ptr, e_ptr, chans, cmask, wc, tap, K, K1, K2, HAS_EXTRA)
        x = _tap(x_ptr, b, y, xw, rmask, chans, cmask, i - K // 2, j - K // 2, H, W,
                 stride_xb, stride_xn)
        acc += x * w[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + chans % wc, mask=cmask, other=0.0).to(tl.float32)
        if HAS_EXTRA:
            bias += tl.load(ebias_ptr + chans, mask=cmask, other=0.0).to(tl.float32)
        acc += bias[None, :]
    mask = rmask[:, None] & cmask[None, :]
    if HAS_BASE:
        base = base_ptr + (b.to(tl.int64) * stride_bb + pix.to(tl.int64) * stride_bn)[:, None]
        acc += tl.load(base + chans[None, :], mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + (b.to(tl.int64) * stride_ob + pix.to(tl.int64) * stride_on)[:, None]
    tl.store(out + chans[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_weight_grad_kernel(g_ptr, x_ptr, part_ptr, R, L, H, W, C, stride_gb, stride_gn,
                             stride_xb, stride_xn, blocks_per_prog, K: tl.constexpr,
                             TAPS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Partial weight and bias gradients of one chunk of rows: row t < K * K of
    the (TAPS, BLOCK_C) fp32 accumulator sums g * x shifted by tap t, row K * K
    sums g (the bias). Each block of g is read once for all taps."""
    chunk = tl.program_id(0)
    taps = tl.arange(0, TAPS)
    acc = tl.zeros((TAPS, BLOCK_C), dtype=tl.float32)
    for blk in range(blocks_per_prog):
        rmask, b, pix, y, xw, chans, cmask = _rows_program(
            R, L, W, C, BLOCK_P, BLOCK_C, chunk * blocks_per_prog + blk)
        g = _tap(g_ptr, b, y, xw, rmask, chans, cmask, 0, 0, H, W, stride_gb, stride_gn)
        for t in range(K * K):  # a loop, not unrolled (see _conv_add_kernel)
            x = _tap(x_ptr, b, y, xw, rmask, chans, cmask, t // K - K // 2, t % K - K // 2, H,
                     W, stride_xb, stride_xn)
            s = tl.sum(g * x, axis=0)
            acc = tl.where(taps[:, None] == t, acc + s[None, :], acc)
        acc = tl.where(taps[:, None] == K * K, acc + tl.sum(g, axis=0)[None, :], acc)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ptrs = part_ptr + chunk * (K * K + 1) * C + taps[:, None] * C + chans[None, :]
    tl.store(ptrs, acc, mask=(taps <= K * K)[:, None] & (chans < C)[None, :])


@triton.jit
def _conv_grad_sum_kernel(part_ptr, w_ptr, b_ptr, e_ptr, eb_ptr, chunks, C, wc,
                          K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                          HAS_EXTRA: tl.constexpr, CB: tl.constexpr, BG: tl.constexpr,
                          BW: tl.constexpr):
    """The gradients of the kernel's parts at tap t = program_id(0) (t = K * K:
    the biases) from the weight-gradient sweep's (chunks, K * K + 1, C) fp32
    partials, each where t falls inside its kernel, in the parts' dtypes. Row r
    of a (CB * BG, BW) tile is chunk r // BG's group r % BG of wc channels
    (channel (r % BG) * wc + column), CB chunks a load: summed over its chunks,
    the tile gives each channel's sum (the extra part's gradient), and that
    over the C / wc groups the shared part's. Blocks of chunks, not one at a
    time: a load per chunk, hundreds of chunks in a row, would wait on memory
    latency. In a fixed order: deterministic, unlike atomics."""
    t = tl.program_id(0)
    row = tl.arange(0, CB * BG)
    col = tl.arange(0, BW)
    grp = row % BG
    ok = (grp < C // wc)[:, None] & (col < wc)[None, :]
    offs = ((row // BG) * (K * K + 1) * C + grp * wc)[:, None] + col[None, :]
    acc = tl.zeros((CB * BG, BW), dtype=tl.float32)
    for c0 in range(0, chunks, CB):
        keep = ok & (c0 + row // BG < chunks)[:, None]
        acc += tl.load(part_ptr + t * C + c0 * (K * K + 1) * C + offs, mask=keep, other=0.0)
    per_channel = tl.sum(tl.reshape(acc, (CB, BG, BW)), axis=0)  # (BG, BW)
    shared = tl.sum(per_channel, axis=0)
    is_bias = t == K * K
    idx, inside = _centred_tap(t, K, K1)
    tl.store(w_ptr + col * (K1 * K1) + idx, shared.to(w_ptr.dtype.element_ty),
             mask=(col < wc) & inside & ~is_bias)
    tl.store(b_ptr + col, shared.to(b_ptr.dtype.element_ty), mask=(col < wc) & is_bias)
    if HAS_EXTRA:
        g = tl.arange(0, BG)
        chans = g[:, None] * wc + col[None, :]
        cmask = (g < C // wc)[:, None] & (col < wc)[None, :]
        idx2, inside2 = _centred_tap(t, K, K2)
        tl.store(e_ptr + chans * (K2 * K2) + idx2, per_channel.to(e_ptr.dtype.element_ty),
                 mask=cmask & inside2 & ~is_bias)
        tl.store(eb_ptr + chans, per_channel.to(eb_ptr.dtype.element_ty), mask=cmask & is_bias)


# ---------------------------------------------------------------- launchers

# Eight warps for a (64, <= 64) block, the taps looped: 38-80 registers on sm_90, no
# spill (kernel_resources.py). With all 25 taps unrolled, their loads were hoisted
# and spilled kilobytes; at 128 rows and four warps they took up to 235 registers.
NUM_WARPS = 8
# values a load of the weight gradient's chunk sum takes (_conv_grad_sum_kernel; a power
# of two, as the tiles' sides)
GRAD_SUM_TILE = 4096


class ConvPlan(NamedTuple):
    """Rows and channels per program, and blocks per program and chunks of the
    weight-gradient sweep."""
    block_p: int
    block_c: int
    blocks_per_prog: int
    chunks: int


def conv_plan(rows: int, C: int, sms: int = 132) -> ConvPlan:
    """Blocks of 64 rows by up to 64 channels (C = 96 takes three blocks of 32,
    no padded lanes); the weight gradient in chunks that about fill the GPU (a
    few programs per multiprocessor), whose partials torch adds. Under the
    interpreter 16 rows, 16 channels and two blocks per chunk, so the tests'
    small shapes cross every border."""
    if INTERPRETED:
        block_p, block_c, per = 16, 16, 2
    else:
        block_p = 64
        block_c = 64 if C % 64 == 0 or C > 96 else 32 if C % 32 == 0 else \
            min(64, triton.next_power_of_2(C))
        blocks = triton.cdiv(rows, block_p)
        per = max(1, triton.cdiv(blocks, max(1, 4 * sms // triton.cdiv(C, block_c))))
    return ConvPlan(block_p, block_c, per, triton.cdiv(triton.cdiv(rows, block_p), per))


def _parts(weight: Tensor, extra: Optional[Tuple[Tensor, Tensor]], C: int) -> dict:
    """The compile-time sizes of a kernel given as parts (:func:`_kernel_tap`):
    K the merged kernel's, K1 the shared part's, K2 the extra's (K1 without one)."""
    K1 = weight.shape[-1]
    K2 = K1 if extra is None else extra[0].shape[-1]
    return dict(K=max(K1, K2), K1=K1, K2=K2, HAS_EXTRA=extra is not None)


def conv_add(x: Tensor, weight: Tensor, bias: Optional[Tensor], base: Optional[Tensor],
             hw: Tuple[int, int], flip: bool = False, dtype: Optional[torch.dtype] = None,
             out: Optional[Tensor] = None, extra: Optional[Tuple[Tensor, Tensor]] = None
             ) -> Tensor:
    """(B, L, C) ``base + conv(x) + bias`` (each term optional but x) in ``dtype``
    (base's, else x's), into ``out`` if given (any batch and token strides);
    ``flip`` rotates the kernel (the input gradient). The kernel in parts
    (:func:`.conv.merged_kernel`): ``weight`` (C', 1, K1, K1) and ``bias`` (C',)
    shared by each group of C' channels, plus ``extra`` (weight (C, 1, K2,
    K2), bias (C,)) if given; all contiguous."""
    B, L, C = x.shape
    if out is None:
        out = torch.empty((B, L, C), dtype=dtype or (base if base is not None else x).dtype,
                          device=x.device)
    pl = conv_plan(B * L, C, sm_count(x.device))
    b_ = base if base is not None else out
    e, eb = extra if extra is not None else (weight, weight)
    grid = (triton.cdiv(B * L, pl.block_p), triton.cdiv(C, pl.block_c))
    _conv_add_kernel[grid](
        x, weight, bias if bias is not None else weight, e, eb, b_, out, B * L, L, hw[0], hw[1],
        C, weight.shape[0], x.stride(0), x.stride(1), b_.stride(0), b_.stride(1), out.stride(0),
        out.stride(1), FLIP=flip, HAS_BIAS=bias is not None, HAS_BASE=base is not None,
        BLOCK_P=pl.block_p, BLOCK_C=pl.block_c, num_warps=NUM_WARPS,
        **_parts(weight, extra, C), **COMPILE_OPTIONS)
    return out


def weight_grad(g: Tensor, x: Tensor, weight: Tensor, bias: Tensor, hw: Tuple[int, int],
                extra: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, ...]:
    """Gradients of the kernel's parts (:func:`conv_add`'s ``weight``, ``bias``
    and, with ``extra``, its two), each in its part's dtype and shape, given the
    output gradient g and the input x, both (B, L, C): one sweep over the rows
    writing each chunk's fp32 partials of the merged kernel and bias, then one
    launch that sums them and splits the sum into the parts."""
    B, L, C = x.shape
    sizes = _parts(weight, extra, C)
    K = sizes['K']
    pl = conv_plan(B * L, C, sm_count(x.device))
    part = torch.empty((pl.chunks, K * K + 1, C), dtype=torch.float32, device=x.device)
    _conv_weight_grad_kernel[(pl.chunks, triton.cdiv(C, pl.block_c))](
        g, x, part, B * L, L, hw[0], hw[1], C, g.stride(0), g.stride(1), x.stride(0),
        x.stride(1), pl.blocks_per_prog, K=K, TAPS=triton.next_power_of_2(K * K + 1),
        BLOCK_P=pl.block_p, BLOCK_C=pl.block_c, num_warps=NUM_WARPS, **COMPILE_OPTIONS)
    grads = [torch.empty_like(t) for t in (weight, bias, *(extra or ()))]
    e, eb = grads[2:] if extra is not None else grads[:2]
    wc = weight.shape[0]
    BG, BW = triton.next_power_of_2(C // wc), triton.next_power_of_2(wc)
    # blocks of chunks, GRAD_SUM_TILE values a load whatever the chunk count (one
    # kernel variant per C and kernel parts, not one per count; rows past it masked)
    _conv_grad_sum_kernel[(K * K + 1, )](
        part, grads[0], grads[1], e, eb, pl.chunks, C, wc, CB=max(1, GRAD_SUM_TILE // (BG * BW)),
        BG=BG, BW=BW, num_warps=NUM_WARPS, **sizes, **COMPILE_OPTIONS)
    return tuple(grads)
