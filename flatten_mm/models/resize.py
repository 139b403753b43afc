"""Bilinear resizing of token grids (positional encodings, position embeddings)
as small products with the resize weights: the same numbers as
``F.interpolate(mode='bilinear', align_corners=False)``, with a transposed
product as backward instead of a slow scatter."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .utils import HWShape, autocast_off, param_cached, size_cached, sizes_symbolic


def resize_matrix(src: int, dst: int, like: Tensor) -> Tensor:
    """(dst, src) weights of 1-D linear resizing from ``src`` to ``dst``
    samples, in ``like``'s dtype and on its device: as
    ``F.interpolate(..., mode='linear', align_corners=False)``, output i reads
    the source position ``pos = max((i + 0.5) * src / dst - 0.5, 0)`` (pixel
    centres) from its samples ``lo = floor(pos)`` and ``lo + 1`` (clamped at
    the last one) with weights ``1 - frac`` and ``frac``.

    Tensor ops on integers (``pos = n / (2 dst)`` with
    ``n = max((2i + 1) src - dst, 0)``), exact up to the one rounding of the
    weights: no Python loop, no tensor from a Python list and no cache, so
    torch.compile traces it on every device and with symbolic sizes (a
    tensor built from a list was a graph break on non-CPU devices, and a
    crash once sizes became symbolic; docs/design.md)."""
    # (where, not clamp: ONNX clips integers from opset 12 only; mmdeploy exports at 11)
    d, last = 2 * dst, src - 1
    n = (2 * torch.arange(dst, device=like.device) + 1) * src - dst
    n = torch.where(n > 0, n, 0)
    lo = torch.div(n, d, rounding_mode='floor')
    inside = lo < last  # else pos is at or past the last sample: weight 1 there
    lo = torch.where(inside, lo, last)
    hi = torch.where(lo + 1 < last, lo + 1, last)
    # fp32 (or fp64) arithmetic holds the integers exactly, half may not
    num = torch.where(inside, n - lo * d, 0).to(torch.promote_types(like.dtype, torch.float32))
    frac = (num / d).to(like.dtype)[:, None]
    rest = ((d - num) / d).to(like.dtype)[:, None]
    cols = torch.arange(src, device=like.device)
    return (cols == lo[:, None]) * rest + (cols == hi[:, None]) * frac


def resize_weights(src: HWShape, dst: HWShape, like: Tensor
                   ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The row weights (H, h) and column weights (W, w) of resizing a grid
    from ``src`` to ``dst``, in ``like``'s dtype and device; None for an axis
    that keeps its size. They depend on the sizes only: what a module's
    cache may hold (:func:`~flatten_mm.models.utils.size_cached`)."""
    same = (False, False) if sizes_symbolic(*dst) else (src[0] == dst[0], src[1] == dst[1])
    rows = None if same[0] else resize_matrix(src[0], dst[0], like)
    cols = None if same[1] else resize_matrix(src[1], dst[1], like)
    return rows, cols


def resize_parts(tokens: Tensor, src: HWShape, dst: HWShape,
                 weights: Optional[Tuple[Optional[Tensor], Optional[Tensor]]] = None
                 ) -> Tuple[Optional[Tensor], Tensor]:
    """Bilinear resizing of (B, h*w, C) tokens from ``src`` to ``dst`` in two
    factors: the tokens resized along columns, G (B, h, W*C), and the row
    weights R (H, h), None when the rows keep their number. The resized
    tokens are ``R @ G``; G is small (h rows), so a caller can add ``R @ G``
    to a full-size tensor in one pass without making it (:func:`add_resized`).
    ``weights``: :func:`resize_weights` of these sizes, if the caller has them."""
    B, _, C = tokens.shape
    rows, cols = resize_weights(src, dst, tokens) if weights is None else weights
    grid = tokens.reshape(B, src[0], src[1], C)
    if cols is not None:
        # in the tokens' dtype, as F.interpolate: autocast would round an fp32
        # parameter's resized copy to half
        with autocast_off(tokens.device.type):
            grid = torch.matmul(cols, grid)  # (B, h, W, C)
    return rows, grid.reshape(B, src[0], dst[1] * C)


def resize_tokens(tokens: Tensor, src: HWShape, dst: HWShape) -> Tensor:
    """Resize (B, h*w, C) tokens laid on ``src`` to ``dst`` (bilinear,
    ``align_corners=False``, as ``F.interpolate``) on the token layout: one
    small product per axis with the resize weights, whose backward is the
    transposed product (``F.interpolate``'s CPU backward is a slow scatter)."""
    if not sizes_symbolic(*dst) and tuple(src) == tuple(dst):
        return tokens
    rows, cols = resize_parts(tokens, src, dst)
    with autocast_off(tokens.device.type):  # as resize_parts
        out = cols if rows is None else torch.matmul(rows, cols)
    return out.reshape(tokens.shape[0], dst[0] * dst[1], tokens.shape[-1])


def add_resized(x: Tensor, parts: Tuple[Optional[Tensor], Tensor]) -> Tensor:
    """``x + R @ G`` for ``parts = resize_parts(...)`` and x (B, H*W, C), a new
    tensor: the resized tokens themselves are never made (one pass over x
    instead of three; two where x is promoted, the sum then made in place in
    the promoted copy). The sum has the dtype of ``x + resized``, autocast or
    not: a half x plus an fp32 embedding is fp32 (the residual stream stays
    fp32 under autocast, as in the official models), and autocast does not
    make the fused ``baddbmm`` half. (Into a block of a tensor in place:
    :func:`add_resized_to_block_`.)"""
    rows, cols = parts
    B = x.shape[0]
    dtype = torch.promote_types(x.dtype, cols.dtype)
    cols = cols.to(dtype)
    x3 = x.view(B, -1, cols.shape[-1])
    promoted = x3.dtype != dtype  # then a new tensor, which the sum can go into
    x3 = x3.to(dtype)
    with autocast_off(x.device.type):
        if rows is None:
            out = x3.add_(cols) if promoted else x3 + cols
        else:
            args = (rows.to(dtype).expand(B, -1, -1), cols.expand(B, -1, -1))
            out = x3.baddbmm_(*args) if promoted else torch.baddbmm(x3, *args)
    return out.view(x.shape)


def key_block(x: Tensor, images: int, n: int, c0: int, c: int) -> Tensor:
    """The view ``x[:, -n:, c0:c0 + c]`` of x (B, L, W) given as (B * L, W)."""
    L = x.shape[0] // images
    return x.view(images, L, -1)[:, L - n:, c0:c0 + c]


class AddToBlock(torch.autograd.Function):
    """``x[:, -n:, c0:c0 + c] += addend`` for x (B, L, W) given as a (B * L, W)
    tensor and an addend (1, n, c), in place also where autograd records: x's
    gradient passes through unchanged, the addend's is that block of it
    summed over the images. (An in-place add on a view would make autograd
    clone x's whole gradient in backward: x must be no view, and no tensor a
    recorded op saved, as its values change.)"""

    @staticmethod
    def forward(x: Tensor, addend: Tensor, c0: int, images: int) -> Tensor:
        key_block(x, images, addend.shape[1], c0, addend.shape[2]).add_(addend)
        return x

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:  # (as torch.func needs)
        x, addend, c0, images = inputs
        ctx.mark_dirty(x)
        ctx.block = (images, addend.shape[1], c0, addend.shape[2])
        ctx.addend_dtype = addend.dtype

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[Tensor, Optional[Tensor], None, None]:
        addend = None
        if ctx.needs_input_grad[1]:  # summed in the addend's dtype: no cast after
            addend = key_block(grad.contiguous(), *ctx.block).sum(0, keepdim=True,
                                                                  dtype=ctx.addend_dtype)
        return grad, addend, None, None


def add_resized_to_block_(x: Tensor, parts: Tuple[Optional[Tensor], Tensor], grid: HWShape,
                          c0: int, images: int) -> Tensor:
    """x (B, L, W), given as a (B * L, W) tensor of its own (no view), with
    the tokens ``R @ G`` (``parts = resize_parts(...)`` of a (1, h*w, c)
    parameter to ``grid`` (H, W); H*W <= L) added in place to its last H*W
    rows, columns c0 to c0 + c (the layer's k within its q, k, v product): no
    new tensor, in training too (:class:`AddToBlock`; where autograd records
    nothing, its forward alone). Under ``torch.jit.trace`` (saved graphs cannot
    hold a custom Function) a new tensor: torch.onnx's exporter dropped the add
    into a view, from every graph. The resized tokens are
    made once for all images (G has one), in G's dtype, or x's if wider: the
    sum is rounded to a half x once, and no cast is made either way."""
    rows, cols = parts
    with autocast_off(x.device.type):
        cols = cols.to(torch.promote_types(x.dtype, cols.dtype))
        resized = cols if rows is None else torch.matmul(rows.to(cols.dtype), cols)
    resized = resized.view(1, grid[0] * grid[1], -1)
    if torch.jit.is_tracing():  # out of place: torch.onnx dropped an add into a view of x
        L, W = x.shape[0] // images, x.shape[1]
        block = F.pad(resized, (c0, W - c0 - resized.shape[2], L - resized.shape[1], 0))
        return (x.view(images, L, W) + block).view(x.shape)
    if torch.is_grad_enabled() and (x.requires_grad or resized.requires_grad):
        return AddToBlock.apply(x, resized, c0, images)
    return AddToBlock.forward(x, resized, c0, images)


def cached_resize_parts(module: nn.Module, key: tuple, tokens: Tensor, src: HWShape,
                        dst: HWShape) -> Tuple[Optional[Tensor], Tensor]:
    """:func:`resize_parts` of a parameter ``tokens`` (a positional encoding or
    embedding of ``module``) from ``src`` to ``dst``, cached: the resize
    weights by size (``size_cached``, in training too), in inference the
    parts while the parameter keeps its values (``param_cached``). ``dst``
    stays as given: under fx tracing it is a proxy (no cache then), which
    cannot be iterated."""
    def make():
        weights = size_cached(module, ('resize weights', key, dst, tokens.dtype, tokens.device),
                              lambda: resize_weights(src, dst, tokens))
        return resize_parts(tokens, src, dst, weights)
    return param_cached(module, ('resized', key, dst), make, (tokens,))
