"""Triton kernels of the focused linear attention core (design: :mod:`.triton_backend`).

Imported by :mod:`.triton_backend` on the first call, not at package import:
``triton.jit`` decides at decoration time whether kernels run compiled or under
the CPU interpreter (``TRITON_INTERPRET=1``), so the choice is the one in force
at the first call.

Notation (autograd.py's): per token row x of q or k over all C channels,
``a = (relu(x) + eps) * s_inv``, ``m = max(a)``, ``u = (a / m)^p``,
``t = |u|``, ``c = |a| / t``, so ``phi(x) = c * u``. Per head of d channels,
``KV = sum_j kappa_j u_j v_j^T`` and ``km = sum_j kappa_j u_j`` with
``kappa_j = c_j mask_j / count``; for a query, ``den = c (u . km) + eps``,
``w = c / den`` and ``out = w (u KV)``.

The ``@triton.jit`` functions carry no Python type hints: Triton reads a
parameter's annotation as a compile-time type (``tl.constexpr`` marks those).
"""
import os
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import interpreter
from .dispatch import exact_fp32
from .reference import EPS

_EPS = tl.constexpr(EPS)


@triton.jit
def _focus(x, s_inv, m, cmask, p):
    """a and u = (a / m)^p of a (rows, BD) block of fp32 x; u is 0 in padded channels.

    The power as exp2(p log2(a / m)): a / m is in (0, 1], so u is too, for any p.
    """
    a = (tl.maximum(x, 0.0) + _EPS) * s_inv[None, :]
    ratio = tl.where(cmask[None, :], a / m[:, None], 1.0)
    u = tl.where(cmask[None, :], tl.exp2(p * tl.log2(ratio)), 0.0)
    return a, u


@triton.jit
def _load_rows(ptr, b, tok, col0, cols, L, D, stride_b, stride_n):
    """The (BLOCK_N, BD) block of tokens ``tok`` and head channels ``col0 + cols``
    of image b, 0 outside the tensor, in the tensor's dtype."""
    mask = (tok < L)[:, None] & (cols < D)[None, :]
    ptrs = (ptr + b.to(tl.int64) * stride_b + tok.to(tl.int64)[:, None] * stride_n + col0 +
            cols[None, :])
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_rows(ptr, val, b, tok, col0, cols, L, D, stride_b, stride_n):
    """Store a (BLOCK_N, BD) block where :func:`_load_rows` loads it."""
    mask = (tok < L)[:, None] & (cols < D)[None, :]
    ptrs = (ptr + b.to(tl.int64) * stride_b + tok.to(tl.int64)[:, None] * stride_n + col0 +
            cols[None, :])
    tl.store(ptrs, val.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_stat(stats_ptr, plane, b, tok, L, R):
    """Row statistic ``plane`` (0: m, 1: c, 2: t) of tokens ``tok`` of image b
    (planes of R = B * L rows); 1 past the last token, so nothing divides by 0."""
    return tl.load(stats_ptr + plane * R + b * L + tok, mask=tok < L, other=1.0)


@triton.jit
def _load_state(ptr, bh, cols, D):
    """The (BD, BD) fp32 state of (image, head) bh, 0 in padded rows and columns
    (offsets in int64: windows x heads x d^2 passes 2^31 at d = 128 and 2^17
    windowed (image, head) pairs)."""
    mask = (cols < D)[:, None] & (cols < D)[None, :]
    base = bh.to(tl.int64) * D * D
    return tl.load(ptr + base + cols[:, None] * D + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_state(ptr, vec_ptr, slot, cols, cmask, D, state, vec):
    """A (D, D) state and its (D,) vector into slot ``slot`` of the partials."""
    smask = cmask[:, None] & cmask[None, :]
    base = slot.to(tl.int64) * D * D  # as in _load_state
    tl.store(ptr + base + cols[:, None] * D + cols[None, :], state, mask=smask)
    tl.store(vec_ptr + slot * D + cols, vec, mask=cmask)


@triton.jit
def _whole_row_stats(x, s_inv, cmask, p):
    """m, c, t and u of a block of whole rows (every channel of the mapping's norm)."""
    a = tl.where(cmask[None, :], (tl.maximum(x, 0.0) + _EPS) * s_inv[None, :], 0.0)
    m = tl.max(a, axis=1)
    _, u = _focus(x, s_inv, m, cmask, p)
    ratio = a / m[:, None]  # |a| = m |a / m|: no square of a large or tiny a
    t = tl.sqrt(tl.sum(u * u, axis=1))
    c = m * tl.sqrt(tl.sum(ratio * ratio, axis=1)) / t
    return m, c, t, u


@triton.jit
def _store_stats(stats_ptr, m, c, t, rows, rmask, R):
    """Row statistics m, c, t into their planes (R rows each)."""
    tl.store(stats_ptr + rows, m, mask=rmask)
    tl.store(stats_ptr + R + rows, c, mask=rmask)
    tl.store(stats_ptr + 2 * R + rows, t, mask=rmask)


@triton.jit
def _block_focus(x, s_inv, stats_ptr, b, tok, L, R, cmask, p, WHOLE_ROWS: tl.constexpr):
    """c and u of a block of one head's channels. With WHOLE_ROWS (one head: the
    block holds whole rows) the statistics are computed here and stored for
    backward, instead of loaded: the one-head (PVT) layers skip the statistics pass."""
    if WHOLE_ROWS:
        m, c, t, u = _whole_row_stats(x, s_inv, cmask, p)
        _store_stats(stats_ptr, m, c, t, b * L + tok, tok < L, R)
    else:
        c = _load_stat(stats_ptr, 1, b, tok, L, R)
        _, u = _focus(x, s_inv, _load_stat(stats_ptr, 0, b, tok, L, R), cmask, p)
    return c, u


@triton.jit
def _inverse_scale(scale_ptr, offs, mask):
    """s_inv = 1 / softplus(x) of the layer's raw scale x at ``offs`` (1 outside
    ``mask``), and ds_inv / dx = -s_inv^2 sigmoid(x), in fp32. Softplus as
    torch's: x past 20 is its own, else log(1 + e) for e = exp(x) times
    e / ((1 + e) - 1), which restores the digits of a tiny e that 1 + e rounds
    off (log1p); torch's gradient is then 1, else e / (1 + e)."""
    x = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    big = x > 20.0
    e = tl.exp(tl.minimum(x, 20.0))
    e1 = 1.0 + e
    tiny = e1 == 1.0
    log1p = tl.where(tiny, e, tl.log(e1) * (e / tl.where(tiny, 1.0, e1 - 1.0)))
    s_inv = tl.where(mask, 1.0 / tl.where(big, x, log1p), 1.0)
    return s_inv, -s_inv * s_inv * tl.where(big, 1.0, e / e1)


@triton.jit
def _inverse_scale_kernel(scale_ptr, s_inv_ptr, C, BLOCK: tl.constexpr):
    """s_inv of the layer's C raw scales (:func:`_inverse_scale`), once per call
    for every later kernel: made in each, it stayed live across their loops
    (spilled registers of the state pass on sm_100 to sm_120)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s_inv, _ = _inverse_scale(scale_ptr, offs, offs < C)
    tl.store(s_inv_ptr + offs, s_inv, mask=offs < C)


@triton.jit
def _store_scale_grad(ds_ptr, ds, scale_ptr, chunk, bh, col0, cols, cmask, D):
    """A chunk's partial gradient ``ds`` of s_inv for one (image, head), taken on
    to the raw scale (times ds_inv / dx, :func:`_inverse_scale`; linear, so the
    partials' sum is the scale's gradient), chunk-major as both passes'
    partials: one sum over them."""
    _, ds_dx = _inverse_scale(scale_ptr, col0 + cols, cmask)
    tl.store(ds_ptr + (chunk * tl.num_programs(0) + bh) * D + cols, ds * ds_dx, mask=cmask)


@triton.jit
def _head_program(s_inv_ptr, h, D, BD: tl.constexpr):
    """What a program over (image * head, ...) starts from: its image b, its
    head's first channel col0, the padded channel range and its mask, and the
    head's slice of s_inv (1 in padded channels)."""
    bh = tl.program_id(0)
    col0 = (bh % h) * D
    cols = tl.arange(0, BD)
    cmask = cols < D
    s_inv = tl.load(s_inv_ptr + col0 + cols, mask=cmask, other=1.0)
    return bh, bh // h, col0, cols, cmask, s_inv


@triton.jit
def _row_stats_kernel(x_ptr, s_inv_ptr, stats_ptr, R, L, C, stride_b, stride_n, p,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """m, c and t of BLOCK_R rows, each over all C channels (the norms span the heads)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < R
    cmask = cols < C
    b = rows // L
    ptrs = (x_ptr + b.to(tl.int64)[:, None] * stride_b +
            (rows % L).to(tl.int64)[:, None] * stride_n + cols[None, :])
    x = tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    s_inv = tl.load(s_inv_ptr + cols, mask=cmask, other=1.0)
    m, c, t, _ = _whole_row_stats(x, s_inv, cmask, p)
    _store_stats(stats_ptr, m, c, t, rows, rmask, R)


@triton.jit
def _kv_state_kernel(k_ptr, v_ptr, mask_ptr, stats_ptr, s_inv_ptr, kv_ptr, km_ptr, n, h, D,
                     stride_kb, stride_kn, stride_vb, stride_vn, stride_mb, p, blocks_per_prog,
                     HAS_MASK: tl.constexpr, WHOLE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BD: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """Partial sums of one chunk of keys: sum phi_j v_j^T and sum phi_j over real keys
    (the division by the count is the caller's), into slot (bh, chunk) of the partials."""
    bh, b, col0, cols, cmask, s_inv = _head_program(s_inv_ptr, h, D, BD)
    chunk = tl.program_id(1)
    acc = tl.zeros([BD, BD], dtype=tl.float32)
    ksum = tl.zeros([BD], dtype=tl.float32)
    for i in range(blocks_per_prog):
        tok = (chunk * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = tok < n
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + b * stride_mb + tok, mask=tok < n, other=0) != 0)
        x = _load_rows(k_ptr, b, tok, col0, cols, n, D, stride_kb, stride_kn).to(tl.float32)
        c, u = _block_focus(x, s_inv, stats_ptr, b, tok, n, n * (tl.num_programs(0) // h), cmask,
                            p, WHOLE_ROWS)
        phi = u * tl.where(keep, c, 0.0)[:, None]
        vv = _load_rows(v_ptr, b, tok, col0, cols, n, D, stride_vb, stride_vn)
        vv = tl.where(keep[:, None], vv, 0.0).to(DOT_DTYPE)  # no NaN of padded values
        acc = tl.dot(tl.trans(phi.to(DOT_DTYPE)), vv, acc, input_precision=PREC)
        ksum += tl.sum(phi, axis=0)
    _store_state(kv_ptr, km_ptr, bh * tl.num_programs(1) + chunk, cols, cmask, D, acc, ksum)


@triton.jit
def _output_kernel(q_ptr, stats_ptr, s_inv_ptr, kv_ptr, km_ptr, out_ptr, N, h, D, stride_qb,
                   stride_qn, stride_ob, stride_on, p, WHOLE_ROWS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BD: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   PREC: tl.constexpr):
    """out = w (u KV) for one block of queries and one head, the mapping applied on load."""
    bh, b, col0, cols, cmask, s_inv = _head_program(s_inv_ptr, h, D, BD)
    tok = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    R = N * (tl.num_programs(0) // h)
    x = _load_rows(q_ptr, b, tok, col0, cols, N, D, stride_qb, stride_qn).to(tl.float32)
    c, u = _block_focus(x, s_inv, stats_ptr, b, tok, N, R, cmask, p, WHOLE_ROWS)
    kv = _load_state(kv_ptr, bh, cols, D)
    km = tl.load(km_ptr + bh * D + cols, mask=cmask, other=0.0)
    w = c / (c * tl.sum(u * km[None, :], axis=1) + _EPS)
    o = tl.dot(u.to(DOT_DTYPE), kv.to(DOT_DTYPE), input_precision=PREC) * w[:, None]
    _store_rows(out_ptr, o, b, tok, col0, cols, N, D, stride_ob, stride_on)


@triton.jit
def _state_sum_kernel(part_ptr, vec_part_ptr, mask_ptr, out_ptr, vec_ptr, inv_ptr, chunks, n, h,
                      D, stride_mb, inv_n, HAS_MASK: tl.constexpr, BD: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """The (D, D) state and (D,) vector of one (image, head): its chunks' partials
    added in order (deterministic, unlike atomics), times 1 / the image's real
    key count (``inv_n`` without a mask; 1 for a gradient's partials). One
    launch for what were two sums, two scalings and the count's own ops. With
    a mask, each image's first head stores that 1 / count in ``inv_ptr`` (B,),
    for the backward's key passes."""
    bh = tl.program_id(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    state = tl.zeros([BD, BD], dtype=tl.float32)
    vec = tl.zeros([BD], dtype=tl.float32)
    for c in range(chunks):
        state += _load_state(part_ptr, bh * chunks + c, cols, D)
        vec += tl.load(vec_part_ptr + (bh * chunks + c) * D + cols, mask=cmask, other=0.0)
    inv = inv_n
    if HAS_MASK:  # 1 / max(count, 1): an image without keys has zero sums anyway
        count = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n, BLOCK_M):
            tok = start + tl.arange(0, BLOCK_M)
            keep = tl.load(mask_ptr + (bh // h) * stride_mb + tok, mask=tok < n, other=0)
            count += (keep != 0).to(tl.float32)
        # correctly rounded, as torch's 1 / count the key passes load (a GPU's
        # 1.0 / x is approximate, to 2 ulp)
        inv = tl.math.div_rn(1.0, tl.maximum(tl.sum(count, axis=0), 1.0))
        tl.store(inv_ptr + bh // h, inv, mask=bh % h == 0)
    _store_state(out_ptr, vec_ptr, bh, cols, cmask, D, state * inv, vec * inv)


@triton.jit
def _map_backward(x, a, u, c, t, grad_u, grad_c, s_inv, p):
    """Gradients for x and (per element, to be summed over rows) s_inv, given those for
    u at fixed c (grad_u, a block) and for c (grad_c, per row).

    phi = c u does not depend on m (the factors m^-p of u and m^p of c cancel), so m
    is held constant: u = (a / m)^p, c = |a| / |u|. With Gt = grad_u - grad_c c u / t^2
    (u's total gradient), dL/da = p Gt u / a + grad_c a / (c t^2).
    """
    gt = grad_u - (grad_c * c / (t * t))[:, None] * u
    grad_a = p * gt * (u / a) + (grad_c / (c * t * t))[:, None] * a
    grad_x = tl.where(x > 0, grad_a * s_inv[None, :], 0.0)
    return grad_x, grad_a * (tl.maximum(x, 0.0) + _EPS)


@triton.jit
def _query_terms(q_ptr, g_ptr, stats_ptr, s_inv, kv_t, km, b, tok, col0, cols, N, R, D,
                 stride_qb, stride_qn, stride_gb, stride_gn, p, DOT_DTYPE: tl.constexpr,
                 PREC: tl.constexpr):
    """Backward quantities of one block of queries and one head: x, g, a, u, c, t,
    w (0 past the last token), A = g KV^T (gradient of u KV), the gradient gd of
    u . km, and the row's share of the gradient of c (gy eps / den^2, gy that of
    w); kv_t is KV^T as a dot operand."""
    x = _load_rows(q_ptr, b, tok, col0, cols, N, D, stride_qb, stride_qn).to(tl.float32)
    g = _load_rows(g_ptr, b, tok, col0, cols, N, D, stride_gb, stride_gn)
    m = _load_stat(stats_ptr, 0, b, tok, N, R)
    c = _load_stat(stats_ptr, 1, b, tok, N, R)
    t = _load_stat(stats_ptr, 2, b, tok, N, R)
    a, u = _focus(x, s_inv, m, cols < D, p)
    den = c * tl.sum(u * km[None, :], axis=1) + _EPS
    w = tl.where(tok < N, c / den, 0.0)
    grad_uk = tl.dot(g.to(DOT_DTYPE), kv_t, input_precision=PREC)
    gy = tl.sum(u * grad_uk, axis=1)
    gd = -gy * c * c / (den * den)  # w = c / (c dot + eps): dw/ddot = -c^2 / den^2
    return x, g, a, u, c, t, w, grad_uk, gd, gy * _EPS / (den * den)


@triton.jit
def _state_grad_step(u, w, g, gd, dkv, dkm, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """dKV += (w u)^T g and dkm += gd u over one block of queries."""
    dkv = tl.dot(tl.trans((u * w[:, None]).to(DOT_DTYPE)), g.to(DOT_DTYPE), dkv,
                 input_precision=PREC)
    return dkv, dkm + tl.sum(u * gd[:, None], axis=0)


@triton.jit
def _query_chunk_program(s_inv_ptr, kv_ptr, km_ptr, N, h, D, BD: tl.constexpr,
                         DOT_DTYPE: tl.constexpr):
    """What a backward program over (image * head, chunk of queries) starts from:
    :func:`_head_program`'s values, its chunk, the row count R of the statistics
    planes, the head's KV transposed (dot operand) and km."""
    bh, b, col0, cols, cmask, s_inv = _head_program(s_inv_ptr, h, D, BD)
    kv_t = tl.trans(_load_state(kv_ptr, bh, cols, D)).to(DOT_DTYPE)
    km = tl.load(km_ptr + bh * D + cols, mask=cmask, other=0.0)
    return (bh, b, col0, cols, cmask, s_inv, tl.program_id(1), N * (tl.num_programs(0) // h),
            kv_t, km)


@triton.jit
def _query_state_grad_kernel(q_ptr, g_ptr, stats_ptr, s_inv_ptr, kv_ptr, km_ptr, gc_ptr, dkv_ptr,
                             dkm_ptr, N, h, D, stride_qb, stride_qn, stride_gb, stride_gn, p,
                             blocks_per_prog, BLOCK_N: tl.constexpr, BD: tl.constexpr,
                             DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """Backward pass 1 over one chunk of queries and one head: partial gradients of
    KV (sum_i w_i u_i g_i^T) and km (sum_i gd_i u_i), and each row's share of the
    gradient of c (gy eps / den^2; the caller sums it over heads) into gc (B, N, h)."""
    bh, b, col0, cols, cmask, s_inv, chunk, R, kv_t, km = _query_chunk_program(
        s_inv_ptr, kv_ptr, km_ptr, N, h, D, BD, DOT_DTYPE)
    dkv = tl.zeros([BD, BD], dtype=tl.float32)
    dkm = tl.zeros([BD], dtype=tl.float32)
    for i in range(blocks_per_prog):
        tok = (chunk * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        _, g, _, u, _, _, w, _, gd, c_share = _query_terms(
            q_ptr, g_ptr, stats_ptr, s_inv, kv_t, km, b, tok, col0, cols, N, R, D,
            stride_qb, stride_qn, stride_gb, stride_gn, p, DOT_DTYPE, PREC)
        tl.store(gc_ptr + (b * N + tok) * h + bh % h, c_share, mask=tok < N)
        dkv, dkm = _state_grad_step(u, w, g, gd, dkv, dkm, DOT_DTYPE, PREC)
    _store_state(dkv_ptr, dkm_ptr, bh * tl.num_programs(1) + chunk, cols, cmask, D, dkv, dkm)


@triton.jit
def _row_sum_over_heads(gc_ptr, b, tok, L, h, BH: tl.constexpr):
    """Sum over the h heads of each row's share of the gradient of c, (B, L, h) fp32."""
    heads = tl.arange(0, BH)
    mask = (tok < L)[:, None] & (heads < h)[None, :]
    part = tl.load(gc_ptr + (b * L + tok)[:, None] * h + heads[None, :], mask=mask, other=0.0)
    return tl.sum(part, axis=1)


@triton.jit
def _query_grad_kernel(q_ptr, g_ptr, stats_ptr, s_inv_ptr, scale_ptr, kv_ptr, km_ptr, gc_ptr,
                       dq_ptr, ds_ptr, dkv_ptr, dkm_ptr, N, h, D, stride_qb, stride_qn, stride_gb,
                       stride_gn, stride_db, stride_dn, p, blocks_per_prog,
                       WHOLE_ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr,
                       DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """Backward pass 2 over one chunk of queries and one head: dq, and the chunk's
    partial gradient of the raw scale for the head's channels. u's gradient is
    w A + gd km (A, gd recomputed: cheaper than storing a (B, N, C) fp32 buffer).
    With WHOLE_ROWS (one head) a row's gradient of c is its own share, so this
    pass also does pass 1's work (partials of dKV and dkm) and pass 1 is skipped:
    q and g are read once."""
    bh, b, col0, cols, cmask, s_inv, chunk, R, kv_t, km = _query_chunk_program(
        s_inv_ptr, kv_ptr, km_ptr, N, h, D, BD, DOT_DTYPE)
    ds = tl.zeros([BD], dtype=tl.float32)
    dkv = tl.zeros([BD, BD], dtype=tl.float32)
    dkm = tl.zeros([BD], dtype=tl.float32)
    for i in range(blocks_per_prog):
        tok = (chunk * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        x, g, a, u, c, t, w, grad_uk, gd, c_share = _query_terms(
            q_ptr, g_ptr, stats_ptr, s_inv, kv_t, km, b, tok, col0, cols, N, R, D,
            stride_qb, stride_qn, stride_gb, stride_gn, p, DOT_DTYPE, PREC)
        grad_u = w[:, None] * grad_uk + gd[:, None] * km[None, :]
        if WHOLE_ROWS:
            grad_c = c_share
            dkv, dkm = _state_grad_step(u, w, g, gd, dkv, dkm, DOT_DTYPE, PREC)
        else:
            grad_c = _row_sum_over_heads(gc_ptr, b, tok, N, h, BH)
        grad_x, grad_s = _map_backward(x, a, u, c, t, grad_u, grad_c, s_inv, p)
        _store_rows(dq_ptr, grad_x, b, tok, col0, cols, N, D, stride_db, stride_dn)
        ds += tl.sum(grad_s, axis=0)
    slot = bh * tl.num_programs(1) + chunk
    _store_scale_grad(ds_ptr, ds, scale_ptr, chunk, bh, col0, cols, cmask, D)
    if WHOLE_ROWS:
        _store_state(dkv_ptr, dkm_ptr, slot, cols, cmask, D, dkv, dkm)


@triton.jit
def _key_terms(k_ptr, v_ptr, mask_ptr, stats_ptr, s_inv, dkv_op, dkm, inv_count, b, tok,
               col0, cols, n, R, D, stride_kb, stride_kn, stride_vb, stride_vn, stride_mb, p,
               HAS_MASK: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """Backward quantities of one block of keys and one head: x, a, u, c, t,
    share (mask / count), and Bm = v dKV^T + dkm (u's gradient over kappa);
    dkv_op is dKV as a dot operand."""
    keep = tok < n
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + b * stride_mb + tok, mask=tok < n, other=0) != 0)
    share = tl.where(keep, inv_count, 0.0)
    x = _load_rows(k_ptr, b, tok, col0, cols, n, D, stride_kb, stride_kn).to(tl.float32)
    m = _load_stat(stats_ptr, 0, b, tok, n, R)
    c = _load_stat(stats_ptr, 1, b, tok, n, R)
    t = _load_stat(stats_ptr, 2, b, tok, n, R)
    a, u = _focus(x, s_inv, m, cols < D, p)
    vv = _load_rows(v_ptr, b, tok, col0, cols, n, D, stride_vb, stride_vn)
    vv = tl.where(keep[:, None], vv, 0.0).to(DOT_DTYPE)
    bm = tl.dot(vv, tl.trans(dkv_op), input_precision=PREC) + dkm[None, :]
    return x, a, u, c, t, share, bm


@triton.jit
def _value_grad(u, c, share, bm, dkv_op, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """dv = kappa (u dKV) of a block of keys, and each row's share of the gradient
    of c (share u . Bm)."""
    dv = tl.dot(u.to(DOT_DTYPE), dkv_op, input_precision=PREC) * (c * share)[:, None]
    return dv, share * tl.sum(u * bm, axis=1)


@triton.jit
def _key_value_grad_kernel(k_ptr, v_ptr, mask_ptr, stats_ptr, s_inv_ptr, dkv_ptr, dkm_ptr,
                           inv_count_ptr, inv_n, gc_ptr, dv_ptr, n, h, D, stride_kb, stride_kn,
                           stride_vb, stride_vn, stride_mb, stride_db, stride_dn, p,
                           HAS_MASK: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr,
                           DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """Backward pass 3 over one block of keys and one head: dv = kappa (u dKV), and
    each row's share of the gradient of c (share u . Bm) into gc (B, n, h)."""
    bh, b, col0, cols, cmask, s_inv = _head_program(s_inv_ptr, h, D, BD)
    tok = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dkv_op = _load_state(dkv_ptr, bh, cols, D).to(DOT_DTYPE)
    dkm = tl.load(dkm_ptr + bh * D + cols, mask=cmask, other=0.0)
    inv_count = inv_n  # 1 / n; with a mask the image's own count's
    if HAS_MASK:
        inv_count = tl.load(inv_count_ptr + b)
    _, _, u, c, _, share, bm = _key_terms(
        k_ptr, v_ptr, mask_ptr, stats_ptr, s_inv, dkv_op, dkm, inv_count, b, tok, col0,
        cols, n,
        n * (tl.num_programs(0) // h), D, stride_kb, stride_kn, stride_vb, stride_vn, stride_mb,
        p, HAS_MASK, DOT_DTYPE, PREC)
    dv, c_share = _value_grad(u, c, share, bm, dkv_op, DOT_DTYPE, PREC)
    _store_rows(dv_ptr, dv, b, tok, col0, cols, n, D, stride_db, stride_dn)
    tl.store(gc_ptr + (b * n + tok) * h + bh % h, c_share, mask=tok < n)


@triton.jit
def _key_grad_kernel(k_ptr, v_ptr, mask_ptr, stats_ptr, s_inv_ptr, scale_ptr, dkv_ptr, dkm_ptr,
                     inv_count_ptr, inv_n, gc_ptr, dk_ptr, ds_ptr, dv_ptr, n, h, D, stride_kb,
                     stride_kn, stride_vb, stride_vn, stride_mb, stride_db, stride_dn, stride_eb,
                     stride_en, p, blocks_per_prog, HAS_MASK: tl.constexpr,
                     WHOLE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr,
                     BH: tl.constexpr, DOT_DTYPE: tl.constexpr, PREC: tl.constexpr):
    """Backward pass 4 over one chunk of keys and one head: dk (u's gradient kappa Bm,
    c's the row sum over heads of gc), and the chunk's partial gradient of the raw scale.
    With WHOLE_ROWS (one head) c's gradient is the row's own share, so this pass
    also writes dv (pass 3's work, skipped then): k and v are read once."""
    bh, b, col0, cols, cmask, s_inv = _head_program(s_inv_ptr, h, D, BD)
    chunk = tl.program_id(1)
    dkv_op = _load_state(dkv_ptr, bh, cols, D).to(DOT_DTYPE)
    dkm = tl.load(dkm_ptr + bh * D + cols, mask=cmask, other=0.0)
    inv_count = inv_n  # 1 / n; with a mask the image's own count's
    if HAS_MASK:
        inv_count = tl.load(inv_count_ptr + b)
    ds = tl.zeros([BD], dtype=tl.float32)
    for i in range(blocks_per_prog):
        tok = (chunk * blocks_per_prog + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        x, a, u, c, t, share, bm = _key_terms(
            k_ptr, v_ptr, mask_ptr, stats_ptr, s_inv, dkv_op, dkm, inv_count, b, tok, col0,
            cols,
            n, n * (tl.num_programs(0) // h), D, stride_kb, stride_kn, stride_vb, stride_vn,
            stride_mb, p, HAS_MASK, DOT_DTYPE, PREC)
        if WHOLE_ROWS:
            dv, grad_c = _value_grad(u, c, share, bm, dkv_op, DOT_DTYPE, PREC)
            _store_rows(dv_ptr, dv, b, tok, col0, cols, n, D, stride_eb, stride_en)
        else:
            grad_c = _row_sum_over_heads(gc_ptr, b, tok, n, h, BH)
        grad_x, grad_s = _map_backward(x, a, u, c, t, (c * share)[:, None] * bm, grad_c, s_inv, p)
        _store_rows(dk_ptr, grad_x, b, tok, col0, cols, n, D, stride_db, stride_dn)
        ds += tl.sum(grad_s, axis=0)
    _store_scale_grad(ds_ptr, ds, scale_ptr, chunk, bh, col0, cols, cmask, D)


# ---------------------------------------------------------------- launchers

def _interpreting() -> bool:
    return os.environ.get('TRITON_INTERPRET', '0') == '1'


INTERPRETED = _interpreting()  # fixed when triton.jit decorated the kernels above
if INTERPRETED:  # the interpreter patches triton.language once a launch, not once a call
    interpreter.install()
# Eight warps: with four, a program's (BLOCK_N, BD) fp32 blocks, its d x d state
# and the mapping's temporaries overflow the register file (spills) at d = 64.
NUM_WARPS = 8
# Compile options every launch here and in the conv kernels names: FMA
# contraction (a * b + c rounded once), which every kernel was built, checked and
# timed with. Triton up to 3.8 defaults to it; 3.9 warns at the first build when
# a launch leaves it to the default, and 3.10's default turns it off.
COMPILE_OPTIONS = dict(enable_fp_fusion=True)
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second (and third) axis
_DEVICES = {}


def _properties(device: torch.device) -> Tuple[int, Tuple[int, int]]:
    """Multiprocessor count and compute capability of a CUDA device, asked once
    per device; off CUDA (the interpreter) an H100/H200's, 132 and (9, 0)."""
    if device.type != 'cuda':
        return 132, (9, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEVICES:
        props = torch.cuda.get_device_properties(index)
        _DEVICES[index] = props.multi_processor_count, (props.major, props.minor)
    return _DEVICES[index]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device``: the chunked sweeps aim at a few programs per
    multiprocessor."""
    return _properties(device)[0]


def capability(device: torch.device) -> Tuple[int, int]:
    """Compute capability of ``device`` (tiling choices that differ by GPU generation)."""
    return _properties(device)[1]


def parse_tiling(text: str) -> dict:
    """The tiling override ``FLATTEN_MM_TRITON_TILING`` holds, e.g.
    ``'block=64,bwd_block=32,warps=4,per_sm=8'``: forward and backward tokens per
    block (powers of two, 16-512), warps per program (1-16, a power of two) and
    the programs per multiprocessor the chunked sweeps aim at (1-64). For
    timing sweeps on a GPU; keys left out keep :func:`plan`'s choice."""
    allowed = dict(block=(16, 512, True), bwd_block=(16, 512, True), warps=(1, 16, True),
                   per_sm=(1, 64, False))
    tiling = {}
    for item in filter(None, (part.strip() for part in text.split(','))):
        key, _, value = item.partition('=')
        if key not in allowed or not value.strip().isdigit():
            raise ValueError(f'FLATTEN_MM_TRITON_TILING takes key=integer items with keys '
                             f'{sorted(allowed)}, got {item!r} in {text!r}')
        low, high, power = allowed[key]
        n = int(value)
        if not low <= n <= high or (power and n & (n - 1)):
            raise ValueError(f'FLATTEN_MM_TRITON_TILING: {key} must be '
                             f'{"a power of two " if power else ""}in [{low}, {high}], got {n}')
        tiling[key] = n
    return tiling


_TILING = {}


def tiling() -> dict:
    """The override from ``FLATTEN_MM_TRITON_TILING``, read at the first plan (a bad
    value raises there, naming it, rather than when the kernels import)."""
    if 'parsed' not in _TILING:
        _TILING['parsed'] = parse_tiling(os.environ.get('FLATTEN_MM_TRITON_TILING', ''))
    return _TILING['parsed']


class Plan(NamedTuple):
    """How one call is tiled: tokens per block, blocks per program of the chunked
    kernels, chunks per (image, head), the padded head width, the dots' operands
    and their precision, and warps per program."""
    block_n: int
    blocks_per_prog: int
    chunks: int
    bd: int
    dot_dtype: object
    precision: str
    warps: int = NUM_WARPS


def fit_grid(tokens: int, block_n: int) -> int:
    """``block_n``, doubled until the blocks of ``tokens`` fit the grid's second
    axis (the output and key-value gradient passes put them there), which CUDA
    caps at :data:`MAX_GRID_Y` programs: at 16-token blocks (exact fp32, d = 64)
    an image of 4096 x 4096 has 2^20 stage-1 tokens, 65,536 blocks."""
    while triton.cdiv(tokens, block_n) > MAX_GRID_Y:
        block_n *= 2
    return block_n


def plan(tokens: int, bh: int, d: int, dtype: torch.dtype, sms: int = 132,
         backward: bool = False) -> Plan:
    """Tiling of a (B * h)-by-``tokens`` sweep for head width d.

    Blocks of 128 tokens for d <= 32, 64 for d <= 64, 32 above; for exact fp32
    dots (computed on CUDA cores, in registers) 1024 / d_padded tokens, at least
    16: the token block times the state width held about constant so the kernels
    stay within the registers (at d = 64, 32-token blocks made the one-head
    output kernel spill; ``tools/analysis_tools/kernel_resources.py`` reports
    each kernel's registers and spills). ``backward`` halves the block (at least
    16): the gradient passes hold several more blocks live (x, a, u, A, the
    mapping's gradient); at full blocks they spilled at real sizes on sm_90 and
    sm_80, at half blocks on neither (130-223 registers on sm_90, bf16).
    Chunks of blocks per program so that (image, head, chunk) programs about fill
    the GPU (a few per multiprocessor) without many partial states to add up.
    Under the interpreter, blocks of 16 tokens and two per program, so that the
    tests' small shapes cross block and chunk borders. :func:`tiling` (from
    ``FLATTEN_MM_TRITON_TILING``, :func:`parse_tiling`) overrides the GPU's choices.
    """
    bd = max(16, triton.next_power_of_2(d))
    exact = exact_fp32(dtype)
    override = tiling()
    if INTERPRETED:
        block_n, per = fit_grid(tokens, 16), 2
    else:
        block_n = override.get('block') or (max(16, 1024 // bd) if exact else
                                          32 if bd > 64 else 4096 // bd)
        if backward:
            block_n = override.get('bwd_block') or max(16, block_n // 2)
        block_n = fit_grid(tokens, block_n)
        blocks = triton.cdiv(tokens, block_n)
        per = max(1, triton.cdiv(blocks, max(1, triton.cdiv(override.get('per_sm', 4) * sms,
                                                            bh))))
    chunks = max(1, triton.cdiv(tokens, block_n * per))
    # bf16 operands for bf16 (fp32's exponent range); fp16 inputs get tf32 dots
    # instead: fp16's precision without its range (the states and u^p of a large
    # p leave it). tl.dot on bf16 is wrong under the interpreter: fp32 there.
    bf16 = dtype == torch.bfloat16 and not INTERPRETED
    return Plan(block_n, per, chunks, bd, tl.bfloat16 if bf16 else tl.float32,
                'ieee' if exact else 'tf32', override.get('warps', NUM_WARPS))


def row_stats(x: Tensor, s_inv: Tensor, p: float, launch: bool = True) -> Tensor:
    """(3, B, L) fp32 planes m, c, t of the rows of x (B, L, C); without ``launch``
    only the buffer (a token kernel that sees whole rows fills it)."""
    B, L, C = x.shape
    stats = torch.empty((3, B, L), dtype=torch.float32, device=x.device)
    if not launch:
        return stats
    block_c = triton.next_power_of_2(C)
    block_r = max(1, min(64, 4096 // block_c))
    grid = (triton.cdiv(B * L, block_r), )
    _row_stats_kernel[grid](x, s_inv, stats, B * L, L, C, x.stride(0), x.stride(1), p,
                            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=NUM_WARPS,
                            **COMPILE_OPTIONS)
    return stats


def _mask_args(key_mask: Optional[Tensor], fallback: Tensor) -> Tuple[Tensor, int, bool]:
    """Pointer, batch stride and presence of the key mask (uint8 view, no copy)."""
    if key_mask is None:
        return fallback, 0, False
    mask = key_mask.contiguous().view(torch.uint8)
    return mask, mask.stride(0), True


def check_inv_count(key_mask: Optional[Tensor], inv_count: Optional[Tensor], B: int) -> None:
    """ValueError unless, with a key mask, ``inv_count`` is a (B,) tensor (1 /
    each image's key count: the kernels read B values)."""
    if key_mask is not None and (inv_count is None or tuple(inv_count.shape) != (B, )):
        got = None if inv_count is None else tuple(inv_count.shape)
        raise ValueError(f'with a key mask, inv_count must be ({B},): 1 / each image\'s key '
                         f'count, got {got}')


def summed_states(part: Tensor, vec_part: Tensor, shape: Tuple[int, int, int], bd: int,
                  key_mask: Optional[Tensor] = None, n: int = 1,
                  inv_count: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(B, h, d, d) states and (B, h, d) vectors from their chunks' partials
    ((B * h, chunks, d, d), (B * h, chunks, d)), divided by each image's real
    key count (``n`` keys without ``key_mask``; n = 1: a plain sum), whose
    inverse goes into ``inv_count`` (B,) with a mask (an image without keys:
    1, its sums being 0); ``bd``: the padded head width of the partials' plan."""
    B, h, d = shape
    state = torch.empty((B, h, d, d), dtype=torch.float32, device=part.device)
    vec = torch.empty((B, h, d), dtype=torch.float32, device=part.device)
    mask, stride_m, has_mask = _mask_args(key_mask, vec_part)
    _state_sum_kernel[(B * h, )](
        part, vec_part, mask, state, vec, inv_count if has_mask else vec, part.shape[1], n, h,
        d, stride_m, 1.0 / n, HAS_MASK=has_mask, BD=bd, BLOCK_M=1024,
        num_warps=NUM_WARPS, **COMPILE_OPTIONS)
    return state, vec


def _launch_opts(pl: Plan) -> dict:
    """The compile-time arguments every token kernel takes from its plan."""
    return dict(BLOCK_N=pl.block_n, BD=pl.bd, DOT_DTYPE=pl.dot_dtype, PREC=pl.precision,
                num_warps=pl.warps, **COMPILE_OPTIONS)


def inverse_scale(scale: Tensor) -> Tensor:
    """(C,) fp32 1 / softplus(scale) of the layer's raw (C,) scale, one launch."""
    C = scale.numel()
    s_inv = torch.empty(C, dtype=torch.float32, device=scale.device)
    block = min(1024, triton.next_power_of_2(C))
    _inverse_scale_kernel[(triton.cdiv(C, block), )](scale, s_inv, C, BLOCK=block,
                                                     num_warps=NUM_WARPS, **COMPILE_OPTIONS)
    return s_inv


def forward(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, p: float,
            num_heads: int, key_mask: Optional[Tensor]) -> Tuple[Tensor, ...]:
    """out (B, N, C) in v's dtype, and what backward needs: KV (B, h, d, d) and
    km (B, h, d) (fp32, divided by the key count), the row statistics of q and
    k, s_inv = 1 / softplus(scale) of the layer's raw (C,) ``scale`` (any
    float dtype; fp32 (C,), :func:`inverse_scale`), and with ``key_mask`` each
    image's 1 / its key count (fp32 (B,); (0,) without)."""
    B, N, C = q.shape
    n, h = k.shape[1], num_heads
    d = C // h
    f32 = dict(dtype=torch.float32, device=q.device)
    s_inv = inverse_scale(scale)
    whole = h == 1  # the token kernels see whole rows: they make the statistics
    stats_q, stats_k = (row_stats(x, s_inv, p, not whole) for x in (q, k))
    kp = plan(n, B * h, d, v.dtype, sm_count(k.device))
    kv_part = torch.empty((B * h, kp.chunks, d, d), **f32)
    km_part = torch.empty((B * h, kp.chunks, d), **f32)
    mask, stride_m, has_mask = _mask_args(key_mask, stats_k)
    _kv_state_kernel[(B * h, kp.chunks)](
        k, v, mask, stats_k, s_inv, kv_part, km_part, n, h, d, k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), stride_m, p, kp.blocks_per_prog, HAS_MASK=has_mask,
        WHOLE_ROWS=whole, **_launch_opts(kp))
    # with a key mask each image's 1 / count, for the backward (no torch ops there)
    inv_count = torch.empty((B if key_mask is not None else 0, ), **f32)
    kv, km = summed_states(kv_part, km_part, (B, h, d), kp.bd, key_mask, n, inv_count)
    qp = plan(N, B * h, d, v.dtype, sm_count(q.device))
    out = torch.empty((B, N, C), dtype=v.dtype, device=q.device)
    _output_kernel[(B * h, triton.cdiv(N, qp.block_n))](
        q, stats_q, s_inv, kv, km, out, N, h, d, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), p, WHOLE_ROWS=whole, **_launch_opts(qp))
    return out, kv, km, stats_q, stats_k, s_inv, inv_count


def fuses_query_passes(cap: Tuple[int, int]) -> bool:
    """Whether a GPU of compute capability ``cap`` runs the one-head query
    gradient as one pass that also makes the state gradients: where that pass
    fits in the registers. It does on sm_90 (warpgroup MMA) and sm_100-110
    (Blackwell's tensor-memory MMA); on GPUs with only the warp-level MMA it
    spills, and the two passes do not (ptxas at d = 64, bf16: 224 bytes a
    thread on sm_80, 212 on sm_120 and sm_121, the RTX 50 series;
    ``kernel_resources.py``)."""
    return 9 <= cap[0] <= 11


def _query_backward(g: Tensor, q: Tensor, s_inv: Tensor, scale: Tensor, kv: Tensor, km: Tensor,
                    stats_q: Tensor, p: float, h: int, qp: Plan, ds: Tensor, dq: Tensor
                    ) -> Tuple[Tensor, Tensor]:
    """dq (written into ``dq``) and the gradients of KV and km; the chunks'
    partial gradients of the raw scale through q into ``ds`` (qp.chunks, B * h,
    d). One head, where :func:`fuses_query_passes`: one pass (the dq pass makes
    the partials too); else two."""
    B, N, C = q.shape
    d, fused = C // h, h == 1 and fuses_query_passes(capability(q.device))
    f32 = dict(dtype=torch.float32, device=q.device)
    dkv_part = torch.empty((B * h, qp.chunks, d, d), **f32)
    dkm_part = torch.empty((B * h, qp.chunks, d), **f32)
    grid = (B * h, qp.chunks)
    gc = dkm_part  # read only without the fused pass
    if not fused:
        gc = torch.empty((B, N, h), **f32)
        _query_state_grad_kernel[grid](
            q, g, stats_q, s_inv, kv, km, gc, dkv_part, dkm_part, N, h, d, q.stride(0),
            q.stride(1), g.stride(0), g.stride(1), p, qp.blocks_per_prog, **_launch_opts(qp))
    _query_grad_kernel[grid](
        q, g, stats_q, s_inv, scale, kv, km, gc, dq, ds, dkv_part, dkm_part, N, h, d,
        q.stride(0), q.stride(1), g.stride(0), g.stride(1), dq.stride(0), dq.stride(1), p,
        qp.blocks_per_prog, WHOLE_ROWS=fused, BH=triton.next_power_of_2(h), **_launch_opts(qp))
    return summed_states(dkv_part, dkm_part, (B, h, d), qp.bd)


def _key_backward(k: Tensor, v: Tensor, s_inv: Tensor, scale: Tensor, dkv: Tensor, dkm: Tensor,
                  stats_k: Tensor, p: float, h: int, key_mask: Optional[Tensor],
                  inv_count: Tensor, kp: Plan, ds: Tensor, dk: Tensor, dv: Tensor) -> None:
    """dk and dv, into ``dk`` and ``dv``, from the gradients of KV and km; the
    chunks' partial gradients of the raw scale through k into ``ds`` (kp.chunks,
    B * h, d). One head: one pass (the dk pass writes dv too); else two. Each
    key's share is the scalar 1 / n without a key mask, with one its image's
    1 / count, ``inv_count`` (B,) from the forward's state sum."""
    B, n, C = k.shape
    d, whole = C // h, h == 1
    f32 = dict(dtype=torch.float32, device=k.device)
    mask, stride_m, has_mask = _mask_args(key_mask, stats_k)
    inv = stats_k if key_mask is None else inv_count  # (a stand-in: unread)
    gc = inv  # read only with several heads
    if not whole:
        gc = torch.empty((B, n, h), **f32)
        _key_value_grad_kernel[(B * h, triton.cdiv(n, kp.block_n))](
            k, v, mask, stats_k, s_inv, dkv, dkm, inv, 1.0 / n, gc, dv, n, h, d, k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), stride_m, dv.stride(0), dv.stride(1), p,
            HAS_MASK=has_mask, **_launch_opts(kp))
    _key_grad_kernel[(B * h, kp.chunks)](
        k, v, mask, stats_k, s_inv, scale, dkv, dkm, inv, 1.0 / n, gc, dk, ds, dv, n, h, d,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), stride_m, dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1), p, kp.blocks_per_prog, HAS_MASK=has_mask, WHOLE_ROWS=whole,
        BH=triton.next_power_of_2(h), **_launch_opts(kp))


def backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: Tensor, s_inv: Tensor,
             kv: Tensor, km: Tensor, stats_q: Tensor, stats_k: Tensor, inv_count: Tensor,
             p: float, num_heads: int, key_mask: Optional[Tensor],
             grads: Optional[Tuple[Tensor, Tensor, Tensor]] = None) -> Tuple[Tensor, ...]:
    """Gradients for q, k, v and the raw scale (fp32, (C,)) given that of out
    (``s_inv`` and ``inv_count``: the forward's); q's, k's and v's written into
    ``grads`` if given (tensors of their shapes and dtypes, unit channel stride:
    column slices of one buffer, :mod:`.triton_fused`). The query and key passes
    write their chunks' partial gradients of the scale (through s_inv and
    softplus: :func:`_store_scale_grad`) into one buffer, chunk-major, so that
    one sum gives the scale's."""
    B, N, C = q.shape
    h, n = num_heads, k.shape[1]
    d = C // h
    check_inv_count(key_mask, inv_count, B)  # the forward's (0,) without a mask: not read
    qp = plan(N, B * h, d, v.dtype, sm_count(q.device), backward=True)
    kp = plan(n, B * h, d, v.dtype, sm_count(k.device), backward=True)
    ds = torch.empty((qp.chunks + kp.chunks, B * h, d), dtype=torch.float32, device=q.device)
    dq, dk, dv = grads if grads is not None else (x.new_empty(x.shape) for x in (q, k, v))
    dkv, dkm = _query_backward(grad_out, q, s_inv, scale, kv, km, stats_q, p, h, qp,
                               ds[:qp.chunks], dq)
    _key_backward(k, v, s_inv, scale, dkv, dkm, stats_k, p, h, key_mask, inv_count, kp,
                  ds[qp.chunks:], dk, dv)
    return dq, dk, dv, ds.view(-1, B, h, d).sum((0, 1)).reshape(C)
