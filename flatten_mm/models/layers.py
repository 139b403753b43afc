"""Building blocks shared by the FLatten backbones: patch embedding, MLPs,
softmax attention for the ``S`` stages, window partitioning with masked
padding, DropPath."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from .utils import (HWShape, add_projections, check_heads, check_positive_int, must_call,
                    onnx_export_trace, pad_to_multiple, param_cached, size_cached,
                    sizes_symbolic, spatial_reduce, specialize_image_size, strided_conv,
                    tokens_to_map)
from .ops import MLP_CHUNK_ROWS, TokenMlpFn, token_mlp
from .ops.conv import depthwise_conv_module

ATTN_TYPES = ('L', 'S')


def check_attn_type(attn_type: str, num_stages: int, one_for_all: bool = False) -> str:
    """Validate a per-stage attention string such as ``'LLSS'`` (``one_for_all``:
    one letter is taken for every stage too, and the error says so)."""
    given = attn_type
    if one_for_all and isinstance(attn_type, str) and len(attn_type) == 1:
        attn_type = attn_type * num_stages
    if not isinstance(attn_type, str) or len(attn_type) != num_stages or \
            any(c not in ATTN_TYPES for c in attn_type):
        also = ' (or one letter for all)' if one_for_all else ''
        raise ValueError(f'attn_type must be a string of {num_stages} letters{also}, '
                         f'each L (focused linear) or S (softmax), got {given!r}')
    return attn_type


def check_stage_list(name: str, values, num_stages: int, positive_ints: bool = False) -> list:
    """Validate a per-stage list (optionally of positive ints)."""
    values = list(values)
    if len(values) != num_stages:
        raise ValueError(f'{name} must have {num_stages} entries (one per stage), '
                         f'got {values!r}')
    if positive_ints and any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                             for v in values):
        raise ValueError(f'{name} must be positive ints, got {values!r}')
    return values


def check_images(x: Tensor) -> Tensor:
    """``x`` if it is a non-empty batch of images (B, C, H, W), else a
    ValueError (an empty batch or image would fail deep inside, in a reshape
    or a convolution). The sizes are not checked while compiling/exporting
    (symbolic sizes; the eager call checks them); under torch.compile they are
    specialised (:func:`.utils.specialize_image_size`)."""
    if x.dim() != 4:
        raise ValueError(f'expected images (B, C, H, W), got shape {tuple(x.shape)}')
    if not torch.compiler.is_compiling() and (x.shape[0] < 1 or x.shape[2] < 1
                                              or x.shape[3] < 1):
        raise ValueError(f'expected a non-empty batch of images (B, C, H, W) with B >= 1, '
                         f'H >= 1 and W >= 1, got shape {tuple(x.shape)}')
    return specialize_image_size(x)


def drop_path_rates(rate: float, num_blocks: int) -> list:
    """Stochastic depth rising linearly from 0 to ``rate`` over the blocks."""
    return [rate * i / max(num_blocks - 1, 1) for i in range(num_blocks)]


def stage_output(x: Tensor, hw_shape: HWShape) -> Tensor:
    """(B, N, C) tokens -> a contiguous NCHW map for necks and heads.

    The plain view of :func:`tokens_to_map` is channels-last in memory; compiled
    ops that read raw NCHW memory (mmcv's CPU RoIAlign) would then gather the
    wrong values, silently.
    """
    return tokens_to_map(x, hw_shape).contiguous()


class PatchEmbed(nn.Module):
    """Patch embedding: conv (kernel ``patch_size`` with ``stride``) + LayerNorm.

    PVT and Swin use non-overlapping patches (kernel = stride); the input is
    padded at the bottom/right to a multiple of the stride, so every pixel is
    covered and the output grid is ceil(H / stride) x ceil(W / stride). PVTv2
    uses overlapping patches (kernel > stride, padding kernel // 2).
    """

    def __init__(self, in_channels: int, embed_dims: int, patch_size: int, stride: int):
        super().__init__()
        self.stride = stride
        self.overlap = patch_size > stride
        self.proj = nn.Conv2d(in_channels, embed_dims, patch_size, stride=stride,
                              padding=patch_size // 2 if self.overlap else 0)
        self.norm = nn.LayerNorm(embed_dims)

    def forward(self, x: Tensor) -> Tuple[Tensor, HWShape]:
        if not self.overlap:
            x = pad_to_multiple(x, self.stride)
        x = strided_conv(self.proj, x)
        hw_shape = (x.shape[2], x.shape[3])
        return self.norm(x.flatten(2).transpose(1, 2)), hw_shape


class DropPath(nn.Module):
    """Stochastic depth: drops whole residual branches per sample in training.

    ``drop_path(x, residual)`` is ``residual + drop_path(x)`` in one pass
    (``addcmul`` with the per-sample scale) instead of three. The blocks pass
    their branch's output as x; the sum is a new tensor, in inference too: x
    is also the output of the branch's module, which a forward hook may hold
    (summed into x in place, it read x + residual; docs/design.md).

    Under torch.compile the rate is read from the ``keep_prob`` buffer (not
    saved in checkpoints), a tensor, instead of the Python float: the blocks'
    code is then compiled once for all rates, where a float would be a
    constant guarded per block (docs/design.md)."""

    def __init__(self, drop_prob: float = 0.):
        super().__init__()
        self.register_buffer('keep_prob', torch.ones(()), persistent=False)
        self.drop_prob = drop_prob

    @property
    def drop_prob(self) -> float:
        return self._drop_prob

    @drop_prob.setter
    def drop_prob(self, value: float) -> None:
        self._drop_prob = float(value)
        with torch.no_grad():
            self.keep_prob.fill_(1 - self._drop_prob)

    def _apply(self, fn, recurse=True):
        # .to_empty() (meta-device initialisation) leaves the buffer unset
        super()._apply(fn, recurse)
        self.drop_prob = self._drop_prob
        return self

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        compiling = torch.compiler.is_compiling()
        if not self.training or (not compiling and self.drop_prob == 0.):
            return x if residual is None else residual + x
        keep = self.keep_prob.to(x.dtype) if compiling else 1 - self.drop_prob
        scale = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep).div_(keep)
        if residual is None:
            return x * scale
        if residual.dtype != x.dtype:  # a half branch into an fp32 stream: CUDA's
            return residual + x * scale  # autocast would copy x to fp32 for addcmul
        return torch.addcmul(residual, x, scale)

    def extra_repr(self) -> str:
        return f'drop_prob={self.drop_prob}'


class Mlp(nn.Module):
    """fc1 -> [depth-wise 3x3 conv (PVTv2)] -> GELU -> fc2, with dropout."""

    def __init__(self, embed_dims: int, hidden_dims: int, drop: float = 0.,
                 with_dwconv: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(embed_dims, hidden_dims)
        if with_dwconv:
            self.dwconv = DWConv(hidden_dims)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dims, embed_dims)
        self.drop = nn.Dropout(drop)

    def forward(self, x: Tensor, hw_shape: Optional[HWShape] = None) -> Tensor:
        if self._chunked(x):
            args = (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias,
                    MLP_CHUNK_ROWS)
            return TokenMlpFn.apply(x, *args) if torch.is_grad_enabled() else token_mlp(x, *args)
        x = self.fc1(x)
        if hasattr(self, 'dwconv'):
            x = self.dwconv(x, hw_shape)
        x = self.drop(self.act(x))
        return self.drop(self.fc2(x))

    def _chunked(self, x: Tensor) -> bool:
        """Whether :class:`TokenMlpFn` runs this MLP: on CPU, in the input's
        own dtype, with nothing between fc1 and fc2 but the GELU (no depth-wise
        conv, no dropout at work), outside tracing and compiling (which see
        the plain ops), unless fc1, the GELU, dropout or fc2 must be called
        (hooked, or not the plain module: :func:`~flatten_mm.models.utils.must_call`)."""
        if torch.compiler.is_compiling() or is_fx_symbolic_tracing() or torch.jit.is_tracing():
            return False
        return (x.device.type == 'cpu' and not hasattr(self, 'dwconv')
                and not must_call(self.fc1, self.act, self.drop, self.fc2)
                and (self.drop.p == 0 or not self.training)
                and type(self.act) is nn.GELU and self.act.approximate == 'none'
                and x.dtype == self.fc1.weight.dtype
                and not torch.is_autocast_enabled('cpu'))


class DWConv(nn.Module):
    """3x3 depth-wise conv on tokens (the PVTv2 MLP); named as the release."""

    def __init__(self, channels: int):
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)

    def forward(self, x: Tensor, hw_shape: HWShape) -> Tensor:
        return depthwise_conv_module(self.dwconv, x, hw_shape)


class SpatialReductionAttention(nn.Module):
    """PVT's softmax attention with keys/values reduced by ``sr_ratio``
    (used by ``S`` stages of FLatten-PVT). Names follow the release."""

    def __init__(self, embed_dims: int, num_heads: int, qkv_bias: bool = True,
                 sr_ratio: int = 1, attn_drop: float = 0., proj_drop: float = 0.):
        super().__init__()
        check_heads(embed_dims, num_heads)
        self.num_heads = num_heads
        self.sr_ratio = check_positive_int('sr_ratio', sr_ratio)
        self.attn_drop = attn_drop
        add_projections(self, embed_dims, qkv_bias, sr_ratio, proj_drop)

    def forward(self, x: Tensor, hw_shape: HWShape) -> Tensor:
        B, N, C = x.shape
        h = self.num_heads
        q = self.q(x).view(B, N, h, C // h).transpose(1, 2)
        if self.sr_ratio > 1:
            x, _ = spatial_reduce(x, hw_shape, self)
        k, v = self.kv(x).view(B, -1, 2, h, C // h).permute(2, 0, 3, 1, 4)
        out = softmax_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))


class WindowSoftmaxAttention(nn.Module):
    """Swin's window attention with relative position bias (``S`` stages of
    FLatten-Swin). Padded keys (``key_mask`` False) get no weight."""

    def __init__(self, embed_dims: int, num_heads: int, window_size: HWShape,
                 qkv_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.):
        super().__init__()
        check_heads(embed_dims, num_heads)
        self.num_heads = num_heads
        self.window_size = tuple(window_size)
        self.attn_drop = attn_drop
        wh, ww = self.window_size
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads))
        coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww),
                                            indexing='ij')).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
        index = (rel[..., 0] + wh - 1) * (2 * ww - 1) + rel[..., 1] + ww - 1
        self.register_buffer('relative_position_index', index)
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, hw_shape: HWShape, offset: Tuple[int, int] = (0, 0)) -> Tensor:
        """
        Args:
            x (Tensor): (B, H*W, C) tokens of the whole map.
            hw_shape (tuple[int, int]): (H, W).
            offset (tuple[int, int]): the partition's shift (0 for W-MSA;
                about half a window for SW-MSA), see :func:`window_partition`.

        Returns:
            Tensor: (B, H*W, C).
        """
        B, N, C = x.shape
        H, W = hw_shape
        # project the real tokens only; windows are cut from q, k, v
        qkv = self.qkv(x).view(B, H, W, 3 * C)
        windows, layout = window_partition(qkv, self.window_size, offset)
        bias = param_cached(self, ('bias', tuple(hw_shape), layout, B, qkv.dtype),
                            lambda: self.attention_bias(hw_shape, layout, B, qkv.dtype),
                            (self.relative_position_bias_table,))
        out = window_merge(self.attend(windows, bias), self.window_size, hw_shape, layout)
        return self.proj_drop(self.proj(out.reshape(B, N, C)))

    def attention_bias(self, hw_shape: HWShape, layout: Tuple[int, int, int, int], batch: int,
                       dtype: torch.dtype) -> Tensor:
        """The relative position bias (1, h, n, n), with -inf at the padded
        keys of each window (batch * nW, h, n, n) when the partition padded.
        The additive key mask (0 or -inf, (batch * nW, 1, 1, n)) depends on
        the sizes alone and is cached (:func:`size_cached`); adding it is one fast
        pass (masked_fill is ~6x slower on CPUs)."""
        n = self.window_size[0] * self.window_size[1]
        table = self.relative_position_bias_table
        bias = table[self.relative_position_index.view(-1)].view(n, n, -1)
        bias = bias.permute(2, 0, 1).unsqueeze(0).to(dtype)
        mask = size_cached(
            self, ('mask', tuple(hw_shape), layout, batch, dtype, table.device),
            lambda: additive_key_mask(window_key_mask(
                hw_shape, self.window_size, layout, batch, table.device), dtype))
        return bias if mask is None else bias + mask

    def attend(self, qkv: Tensor, bias: Tensor) -> Tensor:
        """Softmax attention inside windows: (B', n, 3C) -> (B', n, C), with
        ``bias`` from :meth:`attention_bias`."""
        Bw, n, C3 = qkv.shape
        h = self.num_heads
        q, k, v = qkv.view(Bw, n, 3, h, C3 // (3 * h)).permute(2, 0, 3, 1, 4)
        out = softmax_attention(q, k, v, bias, self.attn_drop if self.training else 0.)
        return out.transpose(1, 2).reshape(Bw, n, C3 // 3)


def window_layout(hw_shape: HWShape, window: HWShape, offset: Tuple[int, int] = (0, 0)
                  ) -> Tuple[int, int, int, int]:
    """(top, left, Hp, Wp): the padded map of :func:`window_partition`."""
    (H, W), (wh, ww), (top, left) = hw_shape, window, offset
    return top, left, H + top + (-(top + H)) % wh, W + left + (-(left + W)) % ww


def window_partition(x: Tensor, window: HWShape, offset: Tuple[int, int] = (0, 0)
                     ) -> Tuple[Tensor, Tuple[int, int, int, int]]:
    """Split a (B, H, W, *C) map into windows, padding where needed.

    A shifted partition (Swin's SW-MSA) is a regular partition of the map
    padded by ``offset`` rows/columns at the top/left. Every window then holds
    only neighbouring tokens plus padding, so no cyclic shift and no region
    mask are needed; padded tokens are excluded through
    :func:`window_key_mask`.

    The channel dims ``C`` may be several (CSWin's (3, C) of q, k, v) and x a
    strided view: windows that are whole rows of a map needing no padding (one
    window across, ``ww == W``) are then a view of x, others one copy.

    Returns:
        windows (B * nW, wh * ww, *C) and (top, left, Hp, Wp) for
        :func:`window_merge` and :func:`window_key_mask`.
    """
    B, H, W, *C = x.shape
    wh, ww = window
    layout = top, left, Hp, Wp = window_layout((H, W), window, offset)
    if sizes_symbolic(H, W) or (Hp, Wp) != (H, W):
        x = F.pad(x, (0, 0) * len(C) + (left, Wp - W - left, top, Hp - H - top))
    windows = x.view(B, Hp // wh, wh, Wp // ww, ww, *C).transpose(2, 3)
    return windows.reshape(-1, wh * ww, *C), layout


def window_key_mask(hw_shape: HWShape, window: HWShape, layout: Tuple[int, int, int, int],
                    batch: int, device) -> Optional[Tensor]:
    """(batch * nW, wh * ww) bool, True for the real tokens of each window of
    :func:`window_partition`; None when nothing was padded (where sizes are
    symbolic, all true then: :func:`.utils.sizes_symbolic`)."""
    top, left, Hp, Wp = layout
    H, W = hw_shape
    if not sizes_symbolic(H, W) and (Hp, Wp) == (H, W):
        return None
    wh, ww = window
    # compared indices, not a slice written: no guard on the slice's bounds in an export
    rows, cols = (torch.arange(n, device=device) for n in (Hp, Wp))
    valid = ((rows >= top) & (rows < top + H))[:, None] & ((cols >= left) & (cols < left + W))
    mask = valid.view(Hp // wh, wh, Wp // ww, ww).transpose(1, 2).reshape(-1, wh * ww)
    return mask.repeat(batch, 1)


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                      dropout_p: float = 0.) -> Tensor:
    """``F.scaled_dot_product_attention`` of (..., n, d) q, k, v with an
    additive ``attn_mask``; in a graph torch.onnx traces
    (:func:`.utils.onnx_export_trace`) its formula, products and a softmax:
    ONNX has the op from opset 14 only, and mmdeploy's configs export at 11."""
    if not onnx_export_trace():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-2, -1))
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = scores.softmax(-1)
    return torch.matmul(F.dropout(probs, dropout_p) if dropout_p else probs, v)


def additive_key_mask(key_mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """(B', n) bool key mask -> (B', 1, 1, n) additive mask of ``dtype``:
    0 at real keys, -inf at padded ones; None stays None."""
    if key_mask is None:
        return None
    mask = torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device)
    return mask.masked_fill_(~key_mask, float('-inf'))[:, None, None, :]


def window_merge(windows: Tensor, window: HWShape, hw_shape: HWShape,
                 layout: Tuple[int, int, int, int]) -> Tensor:
    """Inverse of :func:`window_partition`: (B * nW, wh * ww, C) -> (B, H, W, C),
    the padded map's crop: a view, or where sizes are symbolic a copy (torch
    guards a view's strides on whether there was padding: an exported CSwin
    then stopped at sizes that padded otherwise than its example); a view in
    torch.onnx's trace (ONNX has no ``narrow_copy``; a slice there)."""
    wh, ww = window
    top, left, Hp, Wp = layout
    C = windows.shape[-1]
    x = windows.view(-1, Hp // wh, Wp // ww, wh, ww, C).transpose(2, 3).reshape(-1, Hp, Wp, C)
    if sizes_symbolic(*hw_shape) and not onnx_export_trace():  # (ONNX has no narrow_copy)
        return x.narrow_copy(1, top, hw_shape[0]).narrow_copy(2, left, hw_shape[1])
    return x[:, top:top + hw_shape[0], left:left + hw_shape[1]]
