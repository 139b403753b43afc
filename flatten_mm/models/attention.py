"""Focused Linear Attention (FLatten, ICCV 2023): the layer.

Every backbone of flatten_mm uses :class:`FocusedLinearAttention`; the
attention core it calls is :mod:`flatten_mm.models.ops`. The layer needs only
torch, so it can be benchmarked on a machine without mmcv, mmdet or mmseg.

Notation: x is (B, N, C) on an H x W grid, h heads of d = C / h channels,
n keys (n = N, or fewer with spatial reduction).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .designs import check_design, check_kernel_size, get_design, local_kernel
from .ops import attention_with_local_term, depthwise_conv_add
from .ops.conv import torch_conv_add
from .ops.local import grid_rows, split_qkv
from .resize import add_resized_to_block_, cached_resize_parts, resize_tokens
from .utils import (HWShape, add_projections, autocast_input, check_heads, check_number,
                    check_positive_int, map_to_tokens, must_call, onnx_export_trace,
                    sizes_symbolic, spatial_reduce, tokens_to_map, to_2tuple_checked)


def check_attention_args(embed_dims: int, num_heads: int, sr_ratio: int, focusing_factor: float,
                         kernel_size: int, attn_drop: float, lepe: bool,
                         design: str = 'focused', num_prefix_tokens: int = 0) -> None:
    """The checks of :class:`FocusedLinearAttention`'s arguments (ValueError)."""
    check_heads(embed_dims, num_heads)
    check_positive_int('sr_ratio', sr_ratio)
    check_positive_int('num_prefix_tokens', num_prefix_tokens, minimum=0)
    if num_prefix_tokens and sr_ratio > 1:
        raise ValueError(f'num_prefix_tokens needs sr_ratio=1 (prefix tokens have no place '
                         f'on the reduced grid), got sr_ratio={sr_ratio}')
    check_kernel_size(kernel_size)
    check_design(design)
    check_number('focusing_factor', focusing_factor, low_open=True)
    if attn_drop:
        raise ValueError(f'attn_drop must be 0 for linear attention (no '
                         f'attention matrix is formed), got {attn_drop}')
    if lepe and sr_ratio > 1:
        raise ValueError(f'lepe needs sr_ratio=1 (it is a conv on V on the query '
                         f'grid), got sr_ratio={sr_ratio}')


def check_attention_input(x: Tensor, hw_shape: HWShape, key_mask: Optional[Tensor],
                          embed_dims: int, sr_ratio: int, num_prefix_tokens: int = 0) -> None:
    """The checks of :meth:`FocusedLinearAttention.forward`'s input (ValueError)."""
    if x.dim() != 3 or x.shape[-1] != embed_dims:
        raise ValueError(f'x must be (B, N, {embed_dims}), got {tuple(x.shape)}')
    H, W = hw_shape
    if x.shape[0] < 1 or H < 1 or W < 1:
        raise ValueError(f'x must hold at least one image and hw_shape be positive, got x '
                         f'{tuple(x.shape)}, hw_shape {tuple(hw_shape)}')
    if num_prefix_tokens + H * W != x.shape[1]:
        prefix = f' and {num_prefix_tokens} prefix token(s)' if num_prefix_tokens else ''
        raise ValueError(f'hw_shape {tuple(hw_shape)}{prefix} does not match N={x.shape[1]}')
    if key_mask is not None and sr_ratio > 1:
        raise ValueError('key_mask needs sr_ratio=1: reduced keys mix padded '
                         f'and real tokens (sr_ratio={sr_ratio})')
    if key_mask is not None and (tuple(key_mask.shape) != tuple(x.shape[:2])
                                 or key_mask.dtype != torch.bool):
        raise ValueError(f'key_mask must be bool (B, N) = {tuple(x.shape[:2])}, one entry '
                         f'per token of x, got {key_mask.dtype} {tuple(key_mask.shape)}')


def add_local_term(layer: nn.Module, out: Tensor, v: Tensor, grid: HWShape,
                   hw_shape: HWShape) -> Tensor:
    """The attention term ``out`` plus the layer's DWC(V) (+ LePE) on the query
    grid, V resized from the key ``grid`` first with reduced keys
    (``sr_ratio > 1``); ``out`` itself when the layer has neither. Prefix
    tokens get no local term. With more than V's C channels (EfficientViT's scales) the first C
    take it, in place; otherwise it is one op a backend may fuse
    (:func:`~flatten_mm.models.ops.depthwise_conv_add`)."""
    modules = local_modules(layer)
    if not modules:
        return out
    v = grid_rows(v, grid)  # (prefix tokens, which need sr_ratio=1: grid is hw_shape)
    if layer.sr_ratio > 1:  # V on the reduced grid (a branch on the keys, not on sizes)
        # resized as autocast has it (CUDA's in fp32: the backward sums V's gradient
        # there), then in V's dtype again: the fused DWC takes out and V of one dtype
        v = layer.conv_on_grid(v, grid, lambda m: m, hw_shape).to(v.dtype)
    C = v.shape[-1]
    if must_call(*modules):  # their own calls: hooks run, adapters apply
        local = local_term_by_modules(layer, v, hw_shape).to(out.dtype)
        # zeros for prefix tokens and for channels beyond V's
        return out + F.pad(local, (0, out.shape[-1] - C, out.shape[1] - local.shape[1], 0))
    kernel = local_kernel(layer)
    if out.shape[-1] != C:  # in place into the first C channels
        if onnx_export_trace():  # (torch.onnx wrote the add into a slice at the traced size)
            return torch.cat([torch_conv_add(out[..., :C], v, hw_shape, *kernel, inplace=False),
                              out[..., C:]], -1)
        torch_conv_add(out[..., :C], v, hw_shape, *kernel)
        return out
    return depthwise_conv_add(out, v, hw_shape, *kernel)


def local_modules(layer: nn.Module) -> list:
    """The layer's DWC (``dwc``) and LePE (``get_v``) convs, those it has."""
    return [m for m in (getattr(layer, 'dwc', None), getattr(layer, 'get_v', None))
            if m is not None]


def local_term_by_modules(layer: nn.Module, v: Tensor, hw_shape: HWShape) -> Tensor:
    """DWC(V) (+ LePE) of v (B, H*W, C) by calls of the layer's ``dwc`` (per
    head, on (B * h, d, H, W) maps: its kernel serves every head) and
    ``get_v``, as tokens (B, H*W, C): the local term of :func:`add_local_term`
    where one of them must be called (:func:`~flatten_mm.models.utils.must_call`)."""
    B, _, C = v.shape
    v_map, terms = tokens_to_map(v, hw_shape), []
    dwc, lepe = getattr(layer, 'dwc', None), getattr(layer, 'get_v', None)
    if dwc is not None:
        d = C // layer.num_heads
        heads = v_map.reshape(B * layer.num_heads, d, *hw_shape)
        terms.append(map_to_tokens(dwc(heads).reshape(B, C, *hw_shape)))
    if lepe is not None:
        terms.append(map_to_tokens(lepe(v_map)))
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def stacked_linear(x: Tensor, *linears: nn.Linear) -> Tensor:
    """x (B, L, C') through ``linears`` as one product, their outputs side by
    side, as a (B * L, W) tensor of its own (of 3-D x, F.linear's would be a
    view of one: :func:`~flatten_mm.models.resize.add_resized_to_block_`
    writes into it). Their weights (and biases) stacked, then cast once under
    autocast; where one must be called (hooked, or not a plain ``nn.Linear``:
    :func:`~flatten_mm.models.utils.must_call`), their own calls, concatenated."""
    if must_call(*linears):
        return torch.cat([m(x) for m in linears], -1).flatten(0, -2)
    def stacked(name: str) -> Optional[Tensor]:
        ts = [getattr(m, name) for m in linears]
        t = None if ts[0] is None else torch.cat(ts) if len(ts) > 1 else ts[0]
        return None if t is None else autocast_input(t)
    return F.linear(autocast_input(x).reshape(-1, x.shape[-1]), stacked('weight'), stacked('bias'))


def stacked_qkv(layer: nn.Module, x: Tensor, hw_shape: HWShape) -> Tensor:
    """A layer's q, k and v side by side, (B, N, 3C), for keys on the query grid
    (``sr_ratio=1``): one product of x by the ``q`` and ``kv`` weights stacked,
    k with its positional encoding added in place."""
    B, C = x.shape[0], layer.embed_dims
    qkv = stacked_linear(autocast_input(x), layer.q, layer.kv)
    return layer.add_positional_encoding_(qkv, tuple(hw_shape), C, B).view(B, -1, 3 * C)


def fuses_local_term(layer: nn.Module) -> bool:
    """Whether a layer's unmasked calls take its attention and local term as one
    call (:func:`attend_with_local_term`): the focused design with a DWC or
    LePE, keys on the query grid, its own ``attend`` and ``project_qkv`` (not
    replaced in a subclass or on the instance, which the one call would
    bypass), a DWC and LePE it need not call (:func:`~flatten_mm.models.utils.must_call`),
    and ``fuse_local_term`` (a class attribute)."""
    if not (layer.fuse_local_term and layer.attn_design == 'focused' and layer.sr_ratio == 1):
        return False
    modules = local_modules(layer)
    return (bool(modules) and not must_call(*modules)
            and all(_own_method(layer, name) for name in ('attend', 'project_qkv')))


def _own_method(layer: nn.Module, name: str) -> bool:
    """Whether ``layer.name`` is :class:`FocusedLinearAttention`'s own method."""
    return name not in vars(layer) and \
        getattr(type(layer), name) is getattr(FocusedLinearAttention, name)


def owns_qk(layer: nn.Module) -> bool:
    """Whether the q and k of ``layer.project_qkv`` are views of the layer's own
    q, k, v product, which the core may overwrite in inference. With reduced keys
    q is the output of the ``q`` projection, which a forward hook may hold."""
    return layer.sr_ratio == 1 and _own_method(layer, 'project_qkv')


def attend_with_local_term(layer: nn.Module, x: Tensor, hw_shape: HWShape) -> Tensor:
    """The attention term plus DWC(V) (+ LePE) of a layer that
    :func:`fuses_local_term`, on x (B, P + H*W, C) (prefix tokens take no DWC
    term): one call
    (:func:`~flatten_mm.models.ops.attention_with_local_term`; one op each way
    on the Triton backend, which writes the product's gradient at once)."""
    return attention_with_local_term(stacked_qkv(layer, x, hw_shape), layer.scale,
                                     layer.focusing_factor, layer.num_heads, hw_shape,
                                     *local_kernel(layer), overwrite_qk=owns_qk(layer))


def refuse_torchscript(module: nn.Module):
    """``__prepare_scriptable__`` of the layer: torch.jit.script calls it on
    every submodule before compiling."""
    raise RuntimeError(
        'FLatten models do not support torch.jit.script (deprecated by PyTorch, and '
        'their attention is a custom autograd function it cannot compile); use '
        'torch.compile, torch.export or torch.onnx.export (any input size), or '
        'torch.jit.trace (the traced input size only)')


class FocusedLinearAttention(nn.Module):
    """Focused linear attention with depth-wise-conv rank restoration.

    Parameter names follow the official release (``q``, ``kv``, ``proj``,
    ``sr``, ``norm``, ``dwc``, ``scale``, ``positional_encoding``); the
    release's fused ``qkv`` (FLatten-Swin, -CSwin) is split by its model's
    conversion (:mod:`flatten_mm.conversion`).

    Args:
        embed_dims (int): channels C.
        num_heads (int): heads h; C must be divisible by h.
        qkv_bias (bool): bias in the q and kv projections. Default: True.
        sr_ratio (int): spatial reduction of keys and values by a strided
            conv + LayerNorm (as PVT). Default: 1 (every query sees every token).
        focusing_factor (float): the power p of the focused mapping. Default: 3.
        kernel_size (int): odd kernel of the depth-wise conv (DWC) on V, 0 for
            none; only designs with a DWC (focused, angular) have one. Default: 5.
        pos_grid (int | tuple[int, int]): the key grid (h, w) on which the
            learnable positional encoding is defined, i.e. the key grid at the
            pretraining resolution. It is resized bilinearly to the key grid of
            each input. Default: 14.
        attn_drop (float): kept for interface parity with softmax attention;
            linear attention forms no attention matrix, so it must be 0.
        proj_drop (float): dropout after the output projection. Default: 0.
        lepe (bool): add CSWin's locally-enhanced positional encoding (``get_v``, a 3x3
            depth-wise conv of V), as FLatten-CSwin; needs ``sr_ratio=1``. Default: False.
        design (str): the formula (:mod:`~flatten_mm.models.designs`): ``focused`` (FLatten's,
            default), ``relu``, ``efficient``, ``hydra``, ``angular``, ``efficientvit``.
        num_prefix_tokens (int): P tokens before the grid's (a class token): in φ(K)ᵀV and
            the normaliser like any token, with no positional encoding or DWC term. Default: 0.
    """

    def __init__(self,
                 embed_dims: int,
                 num_heads: int,
                 qkv_bias: bool = True,
                 sr_ratio: int = 1,
                 focusing_factor: float = 3,
                 kernel_size: int = 5,
                 pos_grid=14,
                 attn_drop: float = 0.,
                 proj_drop: float = 0.,
                 lepe: bool = False,
                 design: str = 'focused',
                 num_prefix_tokens: int = 0):
        super().__init__()
        check_attention_args(embed_dims, num_heads, sr_ratio, focusing_factor, kernel_size,
                             attn_drop, lepe, design, num_prefix_tokens)
        self.attn_design, self._design = design, get_design(design)
        self.num_prefix_tokens = num_prefix_tokens
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.sr_ratio = sr_ratio
        self.focusing_factor = focusing_factor
        self.kernel_size = kernel_size
        self.pos_grid = to_2tuple_checked('pos_grid', pos_grid)

        add_projections(self, embed_dims, qkv_bias, sr_ratio, proj_drop)
        if kernel_size and self._design.dwc:  # one d-channel depth-wise conv, shared by all heads
            self.dwc = nn.Conv2d(self.head_dims, self.head_dims, kernel_size,
                                 padding=kernel_size // 2, groups=self.head_dims)
        if lepe:
            self.get_v = nn.Conv2d(embed_dims, embed_dims, 3, padding=1, groups=embed_dims)
        self._design.add_parameters(self)  # focused: scale
        self.positional_encoding = nn.Parameter(
            torch.zeros(1, self.pos_grid[0] * self.pos_grid[1], embed_dims))

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'sr_ratio={self.sr_ratio}, focusing_factor={self.focusing_factor}, '
                f'kernel_size={self.kernel_size}, pos_grid={self.pos_grid}, '
                f'design={self.attn_design!r}')

    fuse_local_term = True  # False: two ops (attend, the local term) in every call

    __prepare_scriptable__ = refuse_torchscript  # torch.jit.script calls it on every submodule

    def positional_encoding_for(self, grid: HWShape) -> Tensor:
        """The positional encoding resized to a key grid, (1, h*w, C)."""
        return resize_tokens(self.positional_encoding, self.pos_grid, grid)

    def add_positional_encoding_(self, x: Tensor, grid: HWShape, c0: int, images: int) -> Tensor:
        """x (B, P + h*w, W) as a (B * (P + h*w), W) tensor, a product holding k
        in columns c0 to c0 + C, with the positional encoding resized to
        ``grid`` added to k's grid rows (the last h*w; prefix keys get none), in
        place (:func:`~flatten_mm.models.resize.add_resized_to_block_`)."""
        parts = cached_resize_parts(self, 'pe', self.positional_encoding, self.pos_grid, grid)
        return add_resized_to_block_(x, parts, grid, c0, images)

    def project_qkv(self, x: Tensor, hw_shape: HWShape) -> Tuple[Tensor, Tensor, Tensor, HWShape]:
        """q (B, N, C), k and v (B, n, C) before the focused mapping, and the key grid.

        One product per input, as the softmax blocks' ``qkv``: with keys on the
        query grid (``sr_ratio=1``) of x by the ``q`` and ``kv`` weights stacked;
        with reduced keys q of x, k and v of the reduced tokens. q, k, v are column
        views of it (split: the backward writes its gradient once), k with its
        positional encoding added in place. Under autocast inputs and weights are
        cast once each (autocast casts a weight's slices apart).
        """
        B, C, x = x.shape[0], self.embed_dims, autocast_input(x)  # once for q and the reduction
        if self.sr_ratio == 1:  # (stacked_qkv)
            return (*split_qkv(stacked_qkv(self, x, hw_shape)), tuple(hw_shape))
        q = self.q(x)
        x, grid = spatial_reduce(x, hw_shape, self)
        k, v = self.add_positional_encoding_(stacked_linear(x, self.kv), grid, 0, B).view(
            B, -1, 2 * C).split(C, -1)
        return q, k, v, grid

    def conv_on_grid(self, x: Tensor, grid: HWShape, conv, size: Optional[HWShape] = None
                     ) -> Tensor:
        """``conv`` (a function of a (B, C', h, w) map) of tokens x on ``grid``
        (resized bilinearly to ``size`` if given), as tokens: every conv on the grid
        (DWC, LePE, EfficientViT's aggregation). The map is a channels-last view of
        x's memory and a conv's output is channels-last too: no copies."""
        x_map = tokens_to_map(x, grid)
        if size is not None and (sizes_symbolic(*size) or tuple(grid) != tuple(size)):
            x_map = F.interpolate(x_map, size=tuple(size), mode='bilinear', align_corners=False)
        return map_to_tokens(conv(x_map))

    def forward(self, x: Tensor, hw_shape: HWShape, key_mask: Optional[Tensor] = None) -> Tensor:
        """
        Args:
            x (Tensor): (B, P + H*W, C) tokens, P = ``num_prefix_tokens``.
            hw_shape (tuple[int, int]): (H, W), the grid of the last H*W, row-major.
            key_mask (Tensor, optional): (B, N) bool, False for padding
                tokens, which then take no part in any query's attention
                (only with ``sr_ratio=1``).

        Returns:
            Tensor: (B, N, C).
        """
        P = self.num_prefix_tokens
        check_attention_input(x, hw_shape, key_mask, self.embed_dims, self.sr_ratio, P)
        if key_mask is None and fuses_local_term(self):
            return self.proj_drop(self.proj(attend_with_local_term(self, x, hw_shape)))
        q, k, v, grid = self.project_qkv(x, hw_shape)
        if key_mask is not None:
            v = v * key_mask.unsqueeze(-1).to(v.dtype)
        out = self.attend(q, k, v, key_mask, overwrite_qk=owns_qk(self), grids=(hw_shape, grid))
        out = add_local_term(self, out, v, grid, hw_shape)
        return self.proj_drop(self.proj(out))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
               overwrite_qk: bool = False, grids: Optional[Tuple[HWShape, HWShape]] = None
               ) -> Tensor:
        """The design's attention term of projected q, k, v (focused: the core op
        :func:`~flatten_mm.models.ops.focused_linear_attention`, which may overwrite q, k
        if ``overwrite_qk`` and no gradient is recorded); ``grids``: (query, key grid)."""
        return self._design.attend(self, q, k, v, key_mask, overwrite_qk, grids)
