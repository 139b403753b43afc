"""FLatten-CSwin backbone.

Module names follow the official release (``stage1_conv_embed``,
``stage{i}.{j}``, ``merge{i}``), so the released ImageNet checkpoint loads
with one renaming (:func:`~flatten_mm.conversion.cswin_convert`: the fused
``qkv`` and the ``proj`` that the release keeps at block level in its linear
blocks move into the block's :class:`FocusedLinearAttention` on load).

Focused linear (``L``) stages attend globally, as the released models were
pretrained (their linear stripe width equals the stage's resolution: one
branch over the whole map), with CSWin's LePE added to the attention and its
DWC. Softmax (``S``) stages are CSWin's cross-shaped windows: half the heads
attend within vertical stripes of width ``split_size``, half within
horizontal ones, each with its LePE; the last stage (and any stage whose
stripe covers the pretraining map) has one branch over the whole map. Stripes
that do not divide the map are padded at the bottom/right and the padded
tokens are masked out of the softmax, so results do not depend on padding.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ...conversion import cswin_convert
from ..attention import FocusedLinearAttention
from ..utils import (HWShape, map_to_tokens, pad_to_multiple, size_cached, stage_grid,
                     strided_conv, tokens_to_map)
from ..layers import (DropPath, Mlp, additive_key_mask, check_stage_list, drop_path_rates,
                      softmax_attention, window_key_mask, window_merge, window_partition)
from ..ops.conv import depthwise_conv_module
from .base import Stage, StageOutput, SwinLikeBackbone
from .checks import check_no_unknown_args


class LePEAttention(nn.Module):
    """CSWin's softmax attention within stripes (or over the whole map), plus
    its locally-enhanced positional encoding: a 3x3 depth-wise conv of V
    within each stripe (``get_v``, zero-padded at the stripe's borders).

    Args:
        embed_dims (int): channels of this branch.
        num_heads (int): heads of this branch.
        stripe (int, optional): stripe width; None attends over the whole map.
        vertical (bool): vertical stripes (full height, ``stripe`` columns)
            or horizontal ones (``stripe`` rows, full width).
        attn_drop (float): dropout on the attention weights. Default: 0.
    """

    def __init__(self, embed_dims: int, num_heads: int, stripe: Optional[int] = None,
                 vertical: bool = True, attn_drop: float = 0.):
        super().__init__()
        self.num_heads = num_heads
        self.stripe = stripe
        self.vertical = vertical
        self.attn_drop = attn_drop
        self.get_v = nn.Conv2d(embed_dims, embed_dims, 3, padding=1, groups=embed_dims)

    def extra_repr(self) -> str:
        kind = 'whole map' if self.stripe is None else \
            f"{'vertical' if self.vertical else 'horizontal'} stripes of {self.stripe}"
        return f'num_heads={self.num_heads}, {kind}'

    def window(self, hw_shape: HWShape) -> HWShape:
        H, W = hw_shape
        if self.stripe is None:
            return (H, W)
        return (H, self.stripe) if self.vertical else (self.stripe, W)

    @staticmethod
    def padding_mask(hw_shape: HWShape, window: HWShape, layout, batch: int, dtype, device):
        """(B * nW, 1, 1, n) additive mask, -inf at padded keys; None without padding."""
        return additive_key_mask(window_key_mask(hw_shape, window, layout, batch, device), dtype)

    def forward(self, qkv: Tensor) -> Tensor:
        """(B, H, W, 3, C) map of q, k, v (C channels each; any strides, C's
        contiguous) -> (B, H, W, C)."""
        B, H, W, _, C = qkv.shape
        h = self.num_heads
        window = self.window((H, W))
        windows, layout = window_partition(qkv, window, (0, 0))
        Bw, n = windows.shape[:2]
        q, k, v = windows.view(Bw, n, 3, h, C // h).permute(2, 0, 3, 1, 4)
        mask = size_cached(
            self, ('mask', (H, W), B, q.dtype, q.device),
            lambda: self.padding_mask((H, W), window, layout, B, q.dtype, q.device))
        out = softmax_attention(q, k, v, mask, self.attn_drop if self.training else 0.)
        out = out.transpose(1, 2).reshape(Bw, n, C)
        # LePE: V of each stripe as a map; padded V is zero, as the conv's own padding.
        # Taken from v (a view of the windows), its gradient joins v's before the
        # backward of the q, k, v split, which writes one tensor.
        v_tokens = v.transpose(1, 2).flatten(2)
        out = out + depthwise_conv_module(self.get_v, v_tokens, window)
        return window_merge(out, window, (H, W), layout)


class CSwinBlock(nn.Module):
    """norm1 -> attention -> proj, norm2 -> MLP, both residual.

    A linear (``L``) block is one :class:`FocusedLinearAttention` over the
    whole map with LePE (``attns.0``, holding its own q/kv/proj). A softmax
    (``S``) block projects q, k, v (``qkv``), splits channels and heads into
    a vertical- and a horizontal-stripe branch (``attns.0``, ``attns.1``), or
    keeps one branch over the whole map (``stripe=None``), and projects the
    concatenation (``proj``).
    """

    def __init__(self, embed_dims: int, num_heads: int, attn_type: str,
                 stripe: Optional[int], pos_grid: HWShape, focusing_factor: float,
                 kernel_size: int, mlp_ratio: float = 4., qkv_bias: bool = True,
                 drop: float = 0., attn_drop: float = 0., drop_path: float = 0.,
                 attn_design: str = 'focused'):
        super().__init__()
        self.linear = attn_type == 'L'
        self.norm1 = nn.LayerNorm(embed_dims)
        if self.linear:
            self.attns = nn.ModuleList([FocusedLinearAttention(
                embed_dims, num_heads, qkv_bias=qkv_bias, focusing_factor=focusing_factor,
                kernel_size=kernel_size, pos_grid=pos_grid, proj_drop=drop, lepe=True,
                design=attn_design)])
        else:
            if stripe is None:
                branches = [LePEAttention(embed_dims, num_heads, None, attn_drop=attn_drop)]
            else:
                if num_heads % 2:
                    raise ValueError(f'a stripe block splits its heads between two branches: '
                                     f'num_heads must be even, got {num_heads}')
                branches = [LePEAttention(embed_dims // 2, num_heads // 2, stripe, vertical,
                                          attn_drop) for vertical in (True, False)]
            self.qkv = nn.Linear(embed_dims, 3 * embed_dims, bias=qkv_bias)
            self.attns = nn.ModuleList(branches)
            self.proj = nn.Linear(embed_dims, embed_dims)
            self.proj_drop = nn.Dropout(drop)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(embed_dims)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop)

    def attention(self, x: Tensor, hw_shape: HWShape) -> Tensor:
        if self.linear:
            return self.attns[0](x, hw_shape)
        B, N, C = x.shape
        H, W = hw_shape
        parts = len(self.attns)
        # branch b takes the b-th channel slice of each of q, k and v, as a view:
        # unbind's backward writes both branches' gradients into one tensor
        qkv = self.qkv(x).view(B, H, W, 3, parts, C // parts).unbind(4)
        out = torch.cat([branch(part) for branch, part in zip(self.attns, qkv)], dim=-1)
        return self.proj_drop(self.proj(out.reshape(B, N, C)))

    def forward(self, x: Tensor, hw_shape: HWShape) -> Tensor:
        x = self.drop_path(self.attention(self.norm1(x), hw_shape), x)
        return self.drop_path(self.mlp(self.norm2(x)), x)


class ConvStem(nn.Sequential):
    """Conv2d(7, stride 4, padding 2) + LayerNorm on tokens, indexed 0 and 2
    as the release's ``stage1_conv_embed``. The input is padded at the
    bottom/right to a multiple of 4, so the grid is ceil(H / 4) x ceil(W / 4)."""

    def __init__(self, in_channels: int, embed_dims: int):
        super().__init__(nn.Conv2d(in_channels, embed_dims, 7, 4, 2), nn.Identity(),
                         nn.LayerNorm(embed_dims))

    def forward(self, x: Tensor) -> Tuple[Tensor, HWShape]:
        x = strided_conv(self[0], pad_to_multiple(x, 4))
        return self[2](map_to_tokens(x)), (x.shape[2], x.shape[3])


class MergeBlock(nn.Module):
    """Conv2d(3, stride 2, padding 1) + LayerNorm between stages: a grid of
    H x W becomes ceil(H / 2) x ceil(W / 2)."""

    def __init__(self, in_dims: int, out_dims: int):
        super().__init__()
        self.conv = nn.Conv2d(in_dims, out_dims, 3, 2, 1)
        self.norm = nn.LayerNorm(out_dims)

    def forward(self, x: Tensor, hw_shape: HWShape) -> Tuple[Tensor, HWShape]:
        x = strided_conv(self.conv, tokens_to_map(x, hw_shape))
        return self.norm(map_to_tokens(x)), (x.shape[2], x.shape[3])


class CSwinStage(Stage):
    """Stage i of FLatten-CSwin: the merge block ``merge{i}`` (not for the
    first stage), then the blocks ``stage{i+1}``."""

    def __init__(self, index: int):
        entry = [f'merge{index}'] if index else []
        super().__init__(index, entry + [f'stage{index + 1}', f'norm{index}'],
                         f'stage{index + 1}')

    def forward(self, backbone: 'FLattenCSwin', x: Tensor, hw_shape: HWShape) -> StageOutput:
        if self.index:
            x, hw_shape = getattr(backbone, f'merge{self.index}')(x, hw_shape)
        blocks = getattr(backbone, f'stage{self.index + 1}')
        return self.run_blocks(backbone, blocks, x, hw_shape), hw_shape


class FLattenCSwin(SwinLikeBackbone):
    """FLatten-CSwin: CSWin Transformer with focused linear attention.

    Args:
        arch (str): ``tiny``, ``small`` or ``base``. Default: ``tiny``.
        in_channels (int): image channels. Default: 3.
        embed_dims (int, optional): channels of stage 1 (doubled per stage).
        depths, num_heads (Sequence[int], optional): per stage overrides.
        attn_type (str): one letter per stage, ``L`` focused linear (global,
            with LePE) or ``S`` CSWin's softmax stripes. Default: ``LLSS``
            (as released).
        split_size (Sequence[int]): stripe widths of the softmax stages.
            Default: (1, 2, 7, 7) (CSWin's; (1, 2, 12, 12) for the 384 model).
        pretrain_img_size (int | tuple): resolution of pretraining; the linear
            attention's positional encodings live on the stage grids at this
            resolution and are resized to each input, and a softmax stage whose
            stripe covers its pretraining grid has one branch. Default: 224.
        focusing_factor (float): p of the focused mapping. Default: 3.
        kernel_size (int): odd kernel of the rank-restoring DWC, 0 for none
            (designs with a DWC: focused, angular). Default: 5.
        attn_design (str): the formula of the ``L`` stages' attention:
            ``focused`` (FLatten's), ``relu``, ``efficient``, ``hydra``,
            ``angular`` or ``efficientvit`` (docs/attention_designs.md).
            Default: ``focused``.
        mlp_ratio (float): MLP hidden ratio. Default: 4.
        qkv_bias (bool): bias in the qkv projections. Default: True.
        drop_rate, attn_drop_rate (float): dropout rates, in [0, 1); the
            attention dropout acts in ``S`` stages only (see
            :class:`FLattenPVT`). Default: 0.
        drop_path_rate (float): stochastic depth, linear over blocks, in
            [0, 1). Default: 0.2 (the release's for tiny).
        out_indices (int | Sequence[int]): stages whose (LayerNorm-ed) maps are
            returned, increasing; negative ones count from the last. Default: (0, 1, 2, 3).
        frozen_stages (int): -1 freezes nothing; k >= 0 freezes the stem and
            the first k stages (with their merge blocks). Default: -1.
        norm_eval, with_cp, init_cfg: as :class:`FLattenPVT`.
    """
    first_conv = 'stage1_conv_embed.0'
    arch_zoo = {
        'tiny': dict(embed_dims=64, depths=[2, 4, 18, 1], num_heads=[2, 4, 8, 16]),
        'small': dict(embed_dims=64, depths=[2, 4, 32, 2], num_heads=[2, 4, 8, 16]),
        'base': dict(embed_dims=96, depths=[3, 6, 29, 2], num_heads=[4, 8, 16, 32]),
    }

    def __init__(self,
                 arch: str = 'tiny',
                 in_channels: int = 3,
                 embed_dims: Optional[int] = None,
                 depths: Optional[Sequence[int]] = None,
                 num_heads: Optional[Sequence[int]] = None,
                 attn_type: str = 'LLSS',
                 split_size: Sequence[int] = (1, 2, 7, 7),
                 pretrain_img_size=224,
                 focusing_factor: float = 3,
                 kernel_size: int = 5,
                 attn_design: str = 'focused',
                 mlp_ratio: float = 4.,
                 qkv_bias: bool = True,
                 drop_rate: float = 0.,
                 attn_drop_rate: float = 0.,
                 drop_path_rate: float = 0.2,
                 out_indices: Union[int, Sequence[int]] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 init_cfg: Optional[dict] = None,
                 **unknown):
        check_no_unknown_args(type(self), unknown, FLattenCSwin)
        super().__init__(init_cfg=init_cfg)
        dims, depths, num_heads, img = self._stage_settings(
            arch, embed_dims, depths, num_heads, attn_type, mlp_ratio, in_channels=in_channels,
            pretrain_img_size=pretrain_img_size, focusing_factor=focusing_factor,
            kernel_size=kernel_size, drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
            drop_path_rate=drop_path_rate, attn_design=attn_design)
        attn_type = self.attn_type
        split_size = check_stage_list('split_size', split_size, 4, positive_ints=True)

        self.stage1_conv_embed = ConvStem(in_channels, dims[0])
        dpr = drop_path_rates(drop_path_rate, sum(depths))
        for i in range(4):
            grid = stage_grid(img, i)
            # one branch over the whole map in the last stage, and where a
            # stripe covers the pretraining grid (the release's rule)
            whole = i == 3 or split_size[i] >= max(grid)
            if attn_type[i] == 'S' and not whole and num_heads[i] % 2:
                raise ValueError(f'num_heads {num_heads}: stage {i + 1} has two stripe '
                                 'branches, which split its heads, so they must be even')
            if i > 0:
                setattr(self, f'merge{i}', MergeBlock(dims[i - 1], dims[i]))
            setattr(self, f'stage{i + 1}', nn.ModuleList([
                CSwinBlock(dims[i], num_heads[i], attn_type[i],
                           None if whole else split_size[i], pos_grid=grid,
                           focusing_factor=focusing_factor, kernel_size=kernel_size,
                           mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate,
                           attn_drop=attn_drop_rate, drop_path=dpr[sum(depths[:i]) + j],
                           attn_design=attn_design)
                for j in range(depths[i])]))
        self._add_output_norms(out_indices)
        self.stages = nn.ModuleList(CSwinStage(i) for i in range(4))
        self._setup_outputs_and_freezing(out_indices, frozen_stages, norm_eval, with_cp)

    def stem_modules(self) -> List[nn.Module]:
        return [self.stage1_conv_embed]

    convert_official = staticmethod(cswin_convert)

    def stem(self, x: Tensor) -> StageOutput:
        return self.stage1_conv_embed(x)
