"""Bilinear resizing of token grids (positional encodings, position embeddings)
as small products with the resize weights: the same numbers as
``F.interpolate(mode='bilinear', align_corners=False)``, with a transposed
product as backward instead of a slow scatter."""
import functools
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from .utils import HWShape, inference_cached, param_cached


@functools.lru_cache(maxsize=256)
def linear_resize_taps(src: int, dst: int) -> Tuple[List[int], List[int], List[float]]:
    """1-D linear resizing from ``src`` to ``dst`` samples as two taps per
    output: ``out[i] = lerp(x[lo[i]], x[hi[i]], frac[i])``, with the source
    positions of ``F.interpolate(..., mode='linear', align_corners=False)``
    (pixel centres, clamped at the first sample).

    Plain Python numbers, cached: tensors made once and cached would carry
    the mode they were made in (an inference tensor breaks later training
    steps; a fake tensor from torch.export's tracing ends up in the program).
    """
    lo, hi, frac = [], [], []
    for i in range(dst):
        pos = max((i + 0.5) * src / dst - 0.5, 0.0)
        j = min(int(pos), src - 1)
        lo.append(j)
        hi.append(min(j + 1, src - 1))
        frac.append(pos - j if j < src - 1 else 0.0)
    return lo, hi, frac


@functools.lru_cache(maxsize=256)
def linear_resize_weights(src: int, dst: int) -> Tuple[float, ...]:
    """The (dst, src) matrix of :func:`linear_resize_taps`, row-major: at
    most two non-zero weights per row, ``1 - frac`` and ``frac``."""
    lo, hi, frac = linear_resize_taps(src, dst)
    weights = [0.0] * (dst * src)
    for i, (a, b, f) in enumerate(zip(lo, hi, frac)):
        weights[i * src + a] += 1.0 - f
        weights[i * src + b] += f
    return tuple(weights)


def resize_matrix(src: int, dst: int, like: Tensor) -> Tensor:
    """(dst, src) linear-resize weights as a tensor of ``like``'s dtype and device."""
    # dynamo traces through the cache anyway (and warns): call the plain function
    weights = (linear_resize_weights.__wrapped__ if torch.compiler.is_compiling()
               else linear_resize_weights)
    return torch.tensor(weights(src, dst), dtype=like.dtype, device=like.device).view(dst, src)


def resize_weights(src: HWShape, dst: HWShape, like: Tensor
                   ) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The row weights (H, h) and column weights (W, w) of resizing a grid
    from ``src`` to ``dst``, in ``like``'s dtype and device; None for an axis
    that keeps its size. They depend on the sizes only: what an inference
    cache may hold (:func:`~flatten_mm.models.utils.inference_cached`)."""
    rows = None if src[0] == dst[0] else resize_matrix(src[0], dst[0], like)
    cols = None if src[1] == dst[1] else resize_matrix(src[1], dst[1], like)
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
        grid = torch.matmul(cols, grid)  # (B, h, W, C)
    return rows, grid.reshape(B, src[0], dst[1] * C)


def resize_tokens(tokens: Tensor, src: HWShape, dst: HWShape) -> Tensor:
    """Resize (B, h*w, C) tokens laid on ``src`` to ``dst`` (bilinear,
    ``align_corners=False``, as ``F.interpolate``) on the token layout: one
    small product per axis with the resize weights, whose backward is the
    transposed product (``F.interpolate``'s CPU backward is a slow scatter)."""
    if tuple(src) == tuple(dst):
        return tokens
    rows, cols = resize_parts(tokens, src, dst)
    out = cols if rows is None else torch.matmul(rows, cols)
    return out.reshape(tokens.shape[0], dst[0] * dst[1], tokens.shape[-1])


def add_resized(x: Tensor, parts: Tuple[Optional[Tensor], Tensor],
                inplace: bool = False) -> Tensor:
    """``x + R @ G`` for ``parts = resize_parts(...)`` and x (B, H*W, C), in
    place or not: the resized tokens themselves are never made (one pass over
    x instead of three)."""
    rows, cols = parts
    B = x.shape[0]
    cols = cols.to(x.dtype)  # x may be half (autocast): the parts follow it
    x3 = x.view(B, -1, cols.shape[-1])
    if rows is None:
        out = x3.add_(cols) if inplace else x3 + cols
    else:
        args = (rows.to(x.dtype).expand(B, -1, -1), cols.expand(B, -1, -1))
        out = x3.baddbmm_(*args) if inplace else torch.baddbmm(x3, *args)
    return out.view(x.shape)


def cached_resize_parts(module: nn.Module, key: tuple, tokens: Tensor, src: HWShape,
                        dst: HWShape) -> Tuple[Optional[Tensor], Tensor]:
    """:func:`resize_parts` of a parameter ``tokens`` (a positional encoding or
    embedding of ``module``) from ``src`` to ``dst``, cached in inference:
    the resize weights by size (``inference_cached``), the parts while the
    parameter keeps its values (``param_cached``). ``dst`` stays as given: under
    fx tracing it is a proxy (no cache then), which cannot be iterated."""
    def make():
        weights = inference_cached(module, ('resize weights', key, dst, tokens.dtype,
                                            tokens.device),
                                   lambda: resize_weights(src, dst, tokens))
        return resize_parts(tokens, src, dst, weights)
    return param_cached(module, ('resized', key, dst), make, (tokens,))
