"""Focused Linear Attention (FLatten, ICCV 2023): the op and the module.

Every backbone of flatten_mm uses :class:`FocusedLinearAttention`. The module
needs only torch (and mmengine's logger for load-time messages), so it can be
benchmarked on a machine without mmcv, mmdet or mmseg.

Notation: x is (B, N, C) on an H x W grid, h heads of d = C / h channels,
n keys (n = N, or fewer with spatial reduction).
"""
import collections
import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from .ops import EPS, DepthwiseConvFn, FocusedLinearAttentionFn

HWShape = Tuple[int, int]


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{name} must be an int >= {minimum}, got {value!r}')
    return value


def to_2tuple_checked(name: str, value) -> HWShape:
    """Turn an int or a pair of ints into a validated (h, w) tuple."""
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2:
        raise ValueError(f'{name} must be an int or a pair of ints, got {value!r}')
    return (check_positive_int(name, pair[0]), check_positive_int(name, pair[1]))


def focusing_map(x: Tensor, scale: Tensor, focusing_factor: float) -> Tensor:
    """The focused mapping phi_p over the last dimension (FLATTEN.md §2.4).

    ``a = (ReLU(x) + eps) / scale``; ``phi(x) = ||a|| * a**p / ||a**p||``.
    The direction of ``a`` is sharpened toward its largest channels while its
    norm is kept. ``a / max(a)`` is raised to the power instead of ``a``: the
    ratio is the same, and the power can no longer overflow.
    """
    a = (F.relu(x) + EPS) / scale
    a_max = a.amax(dim=-1, keepdim=True)
    u = a / a_max
    u_p = u.pow(focusing_factor)
    # ||a|| * u^p / ||u^p||, with ||a|| = a_max * ||u||
    gain = a_max * torch.linalg.vector_norm(u, dim=-1, keepdim=True) / \
        torch.linalg.vector_norm(u_p, dim=-1, keepdim=True)
    return u_p * gain


def linear_attention(q: Tensor, k: Tensor, v: Tensor, num_heads: int,
                     key_mask: Optional[Tensor] = None) -> Tensor:
    """Normalised linear attention per head (FLATTEN.md §2.5).

    Args:
        q (Tensor): phi(Q), shape (B, N, C).
        k (Tensor): phi(K), shape (B, n, C).
        v (Tensor): V, shape (B, n, C).
        num_heads (int): heads h; C is split into h groups of d channels.
        key_mask (Tensor, optional): (B, n) bool, True for real keys. Masked
            keys are left out of the K/V sums and of the mean normaliser.

    Returns:
        Tensor: (B, N, C), row i equal to
        ``sum_j (q_i . k_j) v_j / sum_j (q_i . k_j)`` up to the eps of the
        normaliser.
    """
    B, N, C = q.shape
    n = k.shape[1]
    d = C // num_heads
    if key_mask is None:
        count = torch.full((B, 1, 1), float(n), dtype=q.dtype, device=q.device)
    else:
        # zero phi(K) at masked keys: they then drop out of sum_j k_j v_j and
        # of the key mean, whatever V holds there
        m = key_mask.to(q.dtype).unsqueeze(-1)
        k = k * m
        count = m.sum(dim=1, keepdim=True)
    qh = q.view(B, N, num_heads, d)
    kh = k.view(B, n, num_heads, d)
    vh = v.view(B, n, num_heads, d)
    k_mean = kh.sum(dim=1) / count  # (B, h, d)
    kv = torch.einsum('bnhd,bnhe->bhde', kh, vh) / count.unsqueeze(-1)
    z = 1.0 / (torch.einsum('bnhd,bhd->bnh', qh, k_mean) + EPS)
    out = torch.einsum('bnhd,bhde->bnhe', qh, kv) * z.unsqueeze(-1)
    return out.reshape(B, N, C)


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


def resize_parts(tokens: Tensor, src: HWShape, dst: HWShape) -> Tuple[Optional[Tensor], Tensor]:
    """Bilinear resizing of (B, h*w, C) tokens from ``src`` to ``dst`` in two
    factors: the tokens resized along columns, G (B, h, W*C), and the row
    weights R (H, h), None when the rows keep their number. The resized
    tokens are ``R @ G``; G is small (h rows), so a caller can add ``R @ G``
    to a full-size tensor in one pass without making it (:func:`add_resized`)."""
    B, _, C = tokens.shape
    grid = tokens.reshape(B, src[0], src[1], C)
    if src[1] != dst[1]:
        grid = torch.matmul(resize_matrix(src[1], dst[1], tokens), grid)  # (B, h, W, C)
    rows = None if src[0] == dst[0] else resize_matrix(src[0], dst[0], tokens)
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


def eval_cached(module: nn.Module, key: tuple, make, params: Tuple[Tensor, ...] = ()):
    """``make()``, computed once per ``key`` while ``module`` is in eval mode
    and no gradient is recorded (inference), else every call.

    For what depends only on the input size and on ``params`` (resized
    positional encodings, masks, window layouts); the parameters' storage and
    version counters are part of the key, so loading weights, an optimizer
    step or ``.to()`` invalidate an entry. The last four keys are kept;
    switching to training mode drops them.
    """
    if module.training or torch.is_grad_enabled() or torch.compiler.is_compiling() \
            or torch.jit.is_tracing() or is_fx_symbolic_tracing():
        if module.training:
            module.__dict__.pop('_eval_cache', None)
        return make()
    full = (key, torch.is_inference_mode_enabled()) + tuple(
        (p.data_ptr(), p._version, p.dtype, p.device) for p in params)
    cache = module.__dict__.setdefault('_eval_cache', collections.OrderedDict())
    if full in cache:
        cache.move_to_end(full)
        return cache[full]
    value = cache[full] = make()
    while len(cache) > 4:
        cache.popitem(last=False)
    return value


def tokens_to_map(x: Tensor, hw_shape: HWShape) -> Tensor:
    """(B, N, C) tokens -> a (B, C, H, W) map; for contiguous tokens a
    channels-last view of their memory.

    Made by ``reshape`` + ``permute``: ``transpose(1, 2).reshape`` gives the
    same strides except a batch stride of C when B = 1, which mkldnn does not
    take for channels-last, and its convolutions then fall back to a path
    several times slower (docs/design.md, docs/benchmarks.md)."""
    B, _, C = x.shape
    return x.reshape(B, hw_shape[0], hw_shape[1], C).permute(0, 3, 1, 2)


def map_to_tokens(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H*W, C) tokens: a view of a channels-last map
    (what convolutions on :func:`tokens_to_map` return), else a copy."""
    return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, x.shape[1])


def spatial_reduce(x: Tensor, hw_shape: HWShape, sr: nn.Conv2d, norm: nn.LayerNorm
                   ) -> Tuple[Tensor, HWShape]:
    """PVT's key/value reduction: strided conv + LayerNorm on a (B, N, C) map.

    A map whose sides are not multiples of the stride is first extended by
    replicating its last row/column, so every pixel is summarised (the
    release, at its fixed training size, never needed this) and maps smaller
    than the stride still give one key.
    """
    B, N, C = x.shape
    ratio = sr.stride[0]
    x = tokens_to_map(x, hw_shape)
    pad_h, pad_w = -hw_shape[0] % ratio, -hw_shape[1] % ratio
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h), mode='replicate')
    x = sr(x)
    grid = (x.shape[2], x.shape[3])
    return norm(map_to_tokens(x)), grid


def add_projections(module: nn.Module, embed_dims: int, qkv_bias: bool,
                    sr_ratio: int, proj_drop: float) -> None:
    """The projections PVT-style attention layers share, named as released:
    ``q``, ``kv``, ``proj`` (+ dropout), and with ``sr_ratio > 1`` the key/value
    reduction ``sr`` (strided conv) and ``norm``."""
    module.q = nn.Linear(embed_dims, embed_dims, bias=qkv_bias)
    module.kv = nn.Linear(embed_dims, embed_dims * 2, bias=qkv_bias)
    module.proj = nn.Linear(embed_dims, embed_dims)
    module.proj_drop = nn.Dropout(proj_drop)
    if sr_ratio > 1:
        module.sr = nn.Conv2d(embed_dims, embed_dims, sr_ratio, stride=sr_ratio)
        module.norm = nn.LayerNorm(embed_dims)


class FocusedLinearAttention(nn.Module):
    """Focused linear attention with depth-wise-conv rank restoration.

    Parameter names follow the official release (``q``, ``kv``, ``proj``,
    ``sr``, ``norm``, ``dwc``, ``scale``, ``positional_encoding``); a
    checkpoint with a fused ``qkv`` projection (FLatten-Swin) is split on load.

    Args:
        embed_dims (int): channels C.
        num_heads (int): heads h; C must be divisible by h.
        qkv_bias (bool): bias in the q and kv projections. Default: True.
        sr_ratio (int): spatial reduction of keys and values by a strided
            conv + LayerNorm (as PVT). Default: 1 (every query sees every token).
        focusing_factor (float): the power p of the focused mapping. Default: 3.
        kernel_size (int): odd kernel of the depth-wise conv on V. Default: 5.
        pos_grid (int | tuple[int, int]): the key grid (h, w) on which the
            learnable positional encoding is defined, i.e. the key grid at the
            pretraining resolution. It is resized bilinearly to the key grid of
            each input. Default: 14.
        attn_drop (float): kept for interface parity with softmax attention;
            linear attention forms no attention matrix, so it must be 0.
        proj_drop (float): dropout after the output projection. Default: 0.
        lepe (bool): also add CSWin's locally-enhanced positional encoding,
            a 3x3 depth-wise conv over all C channels of V (``get_v``), as
            FLatten-CSwin does; needs ``sr_ratio=1``. Default: False.
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
                 lepe: bool = False):
        super().__init__()
        check_positive_int('embed_dims', embed_dims)
        check_positive_int('num_heads', num_heads)
        if embed_dims % num_heads:
            raise ValueError(f'embed_dims ({embed_dims}) must be divisible by '
                             f'num_heads ({num_heads})')
        check_positive_int('sr_ratio', sr_ratio)
        check_positive_int('kernel_size', kernel_size)
        if kernel_size % 2 == 0:
            raise ValueError(f'kernel_size must be odd (the DWC keeps the grid '
                             f'size), got {kernel_size}')
        if not isinstance(focusing_factor, (int, float)) or focusing_factor <= 0:
            raise ValueError(f'focusing_factor must be a number > 0, got '
                             f'{focusing_factor!r}')
        if attn_drop:
            raise ValueError(f'attn_drop must be 0 for linear attention (no '
                             f'attention matrix is formed), got {attn_drop}')
        if lepe and sr_ratio > 1:
            raise ValueError(f'lepe needs sr_ratio=1 (it is a conv on V on the query '
                             f'grid), got sr_ratio={sr_ratio}')
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.head_dims = embed_dims // num_heads
        self.sr_ratio = sr_ratio
        self.focusing_factor = focusing_factor
        self.kernel_size = kernel_size
        self.pos_grid = to_2tuple_checked('pos_grid', pos_grid)

        add_projections(self, embed_dims, qkv_bias, sr_ratio, proj_drop)
        # one depth-wise conv of d channels, shared by all heads
        self.dwc = nn.Conv2d(self.head_dims, self.head_dims, kernel_size,
                             padding=kernel_size // 2, groups=self.head_dims)
        if lepe:
            self.get_v = nn.Conv2d(embed_dims, embed_dims, 3, padding=1, groups=embed_dims)
        self.scale = nn.Parameter(torch.zeros(1, 1, embed_dims))
        self.positional_encoding = nn.Parameter(
            torch.zeros(1, self.pos_grid[0] * self.pos_grid[1], embed_dims))
        self._register_load_state_dict_pre_hook(self._convert_official)

    def extra_repr(self) -> str:
        return (f'embed_dims={self.embed_dims}, num_heads={self.num_heads}, '
                f'sr_ratio={self.sr_ratio}, focusing_factor={self.focusing_factor}, '
                f'kernel_size={self.kernel_size}, pos_grid={self.pos_grid}')

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling
        raise RuntimeError(
            'FLatten models do not support torch.jit.script (deprecated by PyTorch, and '
            'their attention is a custom autograd function it cannot compile); use '
            'torch.compile, torch.export or torch.onnx.export (any input size), or '
            'torch.jit.trace (the traced input size only)')

    def positional_encoding_for(self, grid: HWShape) -> Tensor:
        """The positional encoding resized to a key grid, (1, h*w, C)."""
        return resize_tokens(self.positional_encoding, self.pos_grid, grid)

    def add_positional_encoding_(self, k: Tensor, grid: HWShape) -> Tensor:
        """k (B, h*w, C) plus the positional encoding resized to ``grid``, in place."""
        pe = self.positional_encoding
        parts = eval_cached(self, ('pe', tuple(grid)),
                            lambda: resize_parts(pe, self.pos_grid, grid), (pe,))
        return add_resized(k, parts, inplace=True)

    def project_qkv(self, x: Tensor, hw_shape: HWShape) -> Tuple[Tensor, Tensor, Tensor, HWShape]:
        """q (B, N, C), k and v (B, n, C) before the focused mapping, and the key grid.

        k and v are two products rather than slices of one, so each is a
        fresh contiguous tensor: the positional encoding is added in place,
        and slicing's backward (a zero-filled buffer per slice) is avoided.
        """
        q = self.q(x)
        if self.sr_ratio > 1:
            x, grid = spatial_reduce(x, hw_shape, self.sr, self.norm)
        else:
            grid = tuple(hw_shape)
        C = self.embed_dims
        w, b = self.kv.weight, self.kv.bias
        k = F.linear(x, w[:C], None if b is None else b[:C])
        v = F.linear(x, w[C:], None if b is None else b[C:])
        k = self.add_positional_encoding_(k, grid)
        return q, k, v, grid

    def depthwise_conv(self, v: Tensor, grid: HWShape, hw_shape: HWShape) -> Tensor:
        """DWC(V) on the query grid, (B, N, C). One d-channel kernel per head.

        The conv runs on V's own memory as a channels-last map, and its
        output is channels-last too, i.e. (B, N, C) tokens again: no copies."""
        v_map = tokens_to_map(v, grid)
        if tuple(grid) != tuple(hw_shape):
            v_map = F.interpolate(v_map, size=tuple(hw_shape), mode='bilinear',
                                  align_corners=False)
        weight = self.dwc.weight.repeat(self.num_heads, 1, 1, 1)
        bias = self.dwc.bias.repeat(self.num_heads)
        if hasattr(self, 'get_v'):
            # DWC(V) + LePE(V) is one depth-wise conv: both are centred and
            # zero-padded, so their kernels add (the smaller one zero-padded)
            k = max(weight.shape[-1], 3)
            weight = F.pad(weight, [(k - weight.shape[-1]) // 2] * 4) + \
                F.pad(self.get_v.weight, [(k - 3) // 2] * 4)
            bias = bias + self.get_v.bias
        return map_to_tokens(DepthwiseConvFn.apply(v_map, weight, bias))

    def forward(self, x: Tensor, hw_shape: HWShape, key_mask: Optional[Tensor] = None) -> Tensor:
        """
        Args:
            x (Tensor): (B, N, C) tokens, row-major on ``hw_shape``.
            hw_shape (tuple[int, int]): (H, W) with H * W = N.
            key_mask (Tensor, optional): (B, N) bool, False for padding
                tokens, which then take no part in any query's attention
                (only with ``sr_ratio=1``).

        Returns:
            Tensor: (B, N, C).
        """
        if x.dim() != 3 or x.shape[-1] != self.embed_dims:
            raise ValueError(f'x must be (B, N, {self.embed_dims}), got {tuple(x.shape)}')
        H, W = hw_shape
        if H * W != x.shape[1]:
            raise ValueError(f'hw_shape {tuple(hw_shape)} does not match N={x.shape[1]}')
        if key_mask is not None and self.sr_ratio > 1:
            raise ValueError('key_mask needs sr_ratio=1: reduced keys mix padded '
                             f'and real tokens (sr_ratio={self.sr_ratio})')
        q, k, v, grid = self.project_qkv(x, hw_shape)
        if key_mask is not None:
            v = v * key_mask.unsqueeze(-1).to(v.dtype)
        out = self.attend(q, k, v, key_mask, consume_qk=True)  # q, k are ours
        out = out.add_(self.depthwise_conv(v, grid, hw_shape))  # attend's own buffer
        return self.proj_drop(self.proj(out))

    @torch.no_grad()
    def attention_weights(self, x: Tensor, hw_shape: HWShape,
                          queries: Tensor) -> Tuple[Tensor, Tensor, HWShape]:
        """The attention rows of chosen queries, written out explicitly.

        The focused term of the output for query i is ``sum_j w_ij v_j`` with
        ``w_ij = phi(q_i).phi(k_j) / (n * (phi(q_i).mean_j phi(k_j) + eps))``
        per head (rows sum to 1 up to eps); the DWC term is not attention and
        is left out. For comparison, ``softmax(q_i.k_j / sqrt(d))`` on the
        same q and k (before the focused mapping) is returned too.

        Args:
            x (Tensor): (1, N, C) tokens on ``hw_shape``.
            queries (Tensor): (P,) token indices of the queries.

        Returns:
            tuple: focused weights (P, heads, n), softmax weights (P, heads,
            n), and the key grid (h, w) with h * w = n.
        """
        if x.dim() != 3 or x.shape[0] != 1:
            raise ValueError(f'attention_weights takes one image, x of shape (1, N, C); '
                             f'got {tuple(x.shape)}')
        q, k, _, grid = self.project_qkv(x, hw_shape)
        q, k = q[0, queries], k[0]
        scale = F.softplus(self.scale).view(-1)
        phi_q = focusing_map(q, scale, self.focusing_factor)
        phi_k = focusing_map(k, scale, self.focusing_factor)
        P, n, h, d = q.shape[0], k.shape[0], self.num_heads, self.head_dims
        phi_q, phi_k = phi_q.view(P, h, d), phi_k.view(n, h, d)
        scores = torch.einsum('phd,nhd->phn', phi_q, phi_k)
        norm = torch.einsum('phd,hd->ph', phi_q, phi_k.mean(0)) + EPS
        focused = scores / (n * norm.unsqueeze(-1))
        logits = torch.einsum('phd,nhd->phn', q.view(P, h, d), k.view(n, h, d))
        softmax = (logits * d ** -0.5).softmax(-1)
        return focused, softmax, grid

    def attend(self, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
               consume_qk: bool = False) -> Tensor:
        """Focused mapping and linear attention, in fp32 under half precision.
        With ``consume_qk``, q and k may be overwritten when no gradient is
        recorded."""
        dtype = v.dtype
        ct = torch.promote_types(dtype, torch.float32)
        with torch.autocast(device_type=q.device.type, enabled=False):
            s_inv = 1.0 / F.softplus(self.scale.to(ct)).view(-1)
            out = FocusedLinearAttentionFn.apply(q.to(ct), k.to(ct), v.to(ct), s_inv,
                                                 self.focusing_factor, self.num_heads, key_mask,
                                                 consume_qk)
        return out.to(dtype)

    def _convert_official(self, state_dict, prefix, *args, **kwargs):
        """Load pre-hook: split a fused ``qkv`` projection into ``q`` and ``kv``
        and resize a positional encoding defined on another grid."""
        C = self.embed_dims
        for kind in ('weight', 'bias'):
            fused = state_dict.pop(f'{prefix}qkv.{kind}', None)
            if fused is not None:
                state_dict[f'{prefix}q.{kind}'] = fused[:C]
                state_dict[f'{prefix}kv.{kind}'] = fused[C:]
        key = f'{prefix}positional_encoding'
        pe = state_dict.get(key)
        if pe is not None and pe.dim() == 3 and pe.shape[-1] == C \
                and pe.shape[1] != self.positional_encoding.shape[1]:
            side = int(round(pe.shape[1] ** 0.5))
            if side * side == pe.shape[1]:
                state_dict[key] = resize_tokens(pe.float(), (side, side),
                                                self.pos_grid).to(pe.dtype)
                from mmengine.logging import print_log
                print_log(f'{key}: resized the positional encoding from '
                          f'{side}x{side} to {self.pos_grid[0]}x{self.pos_grid[1]}',
                          logger='current')


def reference_forward(module: FocusedLinearAttention, x: Tensor, hw_shape: HWShape) -> Tensor:
    """The module's forward written step by step in the op order of the
    official release (ReLU, +eps, /scale, norms, power, renormalise, mean,
    two n^-1/2-scaled matmuls, DWC on (B*h, d, H, W)); V is resized to the
    query grid in 2-D. Slow; kept as the yardstick for tests and benchmarks.
    """
    B, N, C = x.shape
    h, d = module.num_heads, module.head_dims
    q = module.q(x)
    if module.sr_ratio > 1:
        x, grid = spatial_reduce(x, hw_shape, module.sr, module.norm)
    else:
        grid = tuple(hw_shape)
    k, v = module.kv(x).chunk(2, dim=-1)
    k = k + module.positional_encoding_for(grid)
    n = k.shape[1]
    scale = F.softplus(module.scale)
    q = (F.relu(q) + EPS) / scale
    k = (F.relu(k) + EPS) / scale
    q_norm = q.norm(dim=-1, keepdim=True)
    k_norm = k.norm(dim=-1, keepdim=True)
    q = q ** module.focusing_factor
    k = k ** module.focusing_factor
    q = q / q.norm(dim=-1, keepdim=True) * q_norm
    k = k / k.norm(dim=-1, keepdim=True) * k_norm
    q = q.reshape(B, N, h, d).permute(0, 2, 1, 3)
    k = k.reshape(B, n, h, d).permute(0, 2, 1, 3)
    v = v.reshape(B, n, h, d).permute(0, 2, 1, 3)
    z = 1 / (q @ k.mean(dim=-2, keepdim=True).transpose(-2, -1) + EPS)
    kv = (k.transpose(-2, -1) * n ** -0.5) @ (v * n ** -0.5)
    out = (q @ kv * z).transpose(1, 2).reshape(B, N, C)
    v_map = v.transpose(-2, -1).reshape(B * h, d, grid[0], grid[1])
    if tuple(grid) != tuple(hw_shape):
        v_map = F.interpolate(v_map, size=tuple(hw_shape), mode='bilinear', align_corners=False)
    out = out + module.dwc(v_map).reshape(B, C, N).transpose(1, 2)
    if hasattr(module, 'get_v'):  # FLatten-CSwin's LePE, over all C channels of V
        lepe = module.get_v(v.transpose(-2, -1).reshape(B, C, grid[0], grid[1]))
        out = out + lepe.reshape(B, C, N).transpose(1, 2)
    return module.proj_drop(module.proj(out))
