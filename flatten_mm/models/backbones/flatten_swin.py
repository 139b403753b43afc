"""FLatten-Swin backbone.

Module names follow the official release (``patch_embed``,
``layers.{i}.blocks.{j}``, ``layers.{i}.downsample``), so the released
ImageNet checkpoints load with one renaming (:func:`~flatten_mm.conversion.swin_convert`:
the fused ``qkv`` of the linear attention blocks is split on load).

Linear-attention (``L``) stages attend globally by default: the released
models were pretrained with one window covering the whole map and no shift,
and the cost is linear in the number of tokens. ``linear_window`` switches
them to (shifted) windows. Softmax (``S``) stages use Swin's shifted windows.
Shifted windows are a regular partition of the map padded at the top/left, and
every padded token is masked out of attention, so no token ever attends across
the image border and results do not depend on how much was padded.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch.nn.functional as F
from torch import Tensor, nn

from ...conversion import swin_convert
from ..attention import FocusedLinearAttention
from ..utils import (HWShape, branch_on_sizes, size_cached, sizes_symbolic, stage_grid,
                     to_2tuple_checked)
from ..layers import (DropPath, Mlp, PatchEmbed, WindowSoftmaxAttention, drop_path_rates,
                      window_key_mask, window_merge, window_partition)
from .base import Stage, StageOutput, SwinLikeBackbone
from .checks import check_no_unknown_args


class SwinBlock(nn.Module):
    """A Swin block whose attention is focused linear (``L``) or softmax (``S``).

    Args:
        window (tuple[int, int] | None): window size; None attends globally
            (``L`` only).
        shift (bool): shift the windows by half a window (odd blocks), unless
            the map fits in one window.
        pos_grid (tuple[int, int]): reference grid of the linear attention's
            positional encoding.
    """

    def __init__(self, embed_dims: int, num_heads: int, attn_type: str,
                 window: Optional[HWShape], shift: bool, pos_grid: HWShape,
                 focusing_factor: float, kernel_size: int, mlp_ratio: float = 4.,
                 qkv_bias: bool = True, drop: float = 0., attn_drop: float = 0.,
                 drop_path: float = 0., attn_design: str = 'focused'):
        super().__init__()
        self.window = window
        self.shift = shift and window is not None
        self.linear = attn_type == 'L'
        self.norm1 = nn.LayerNorm(embed_dims)
        if self.linear:
            self.attn = FocusedLinearAttention(
                embed_dims, num_heads, qkv_bias=qkv_bias, focusing_factor=focusing_factor,
                kernel_size=kernel_size, pos_grid=pos_grid, proj_drop=drop, design=attn_design)
        else:
            self.attn = WindowSoftmaxAttention(embed_dims, num_heads, window, qkv_bias,
                                               attn_drop, drop)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(embed_dims)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop)

    def attention(self, x: Tensor, hw_shape: HWShape) -> Tensor:
        if self.window is None:
            return self.attn(x, hw_shape)
        (H, W), (wh, ww) = hw_shape, self.window
        fits = False  # whether the map fits in one window: no shift, and L attends globally
        if self.linear or self.shift:  # (other blocks compute the same either way)
            x, fits = branch_on_sizes(x, (H <= wh) & (W <= ww))
        if self.linear and fits:
            return self.attn(x, hw_shape)  # one window: the whole map
        offset = (wh - wh // 2, ww - ww // 2) if self.shift and not fits else (0, 0)
        if not self.linear:
            return self.attn(x, hw_shape, offset)
        B = x.shape[0]
        windows, layout = window_partition(x.view(B, H, W, x.shape[-1]), self.window, offset)
        mask = size_cached(self, ('mask', tuple(hw_shape), layout, B, x.device),
                           lambda: window_key_mask(hw_shape, self.window, layout, B, x.device))
        windows = self.attn(windows, self.window, mask)
        return window_merge(windows, self.window, hw_shape, layout).reshape(x.shape)

    def forward(self, x: Tensor, hw_shape: HWShape) -> Tensor:
        x = self.drop_path(self.attention(self.norm1(x), hw_shape), x)
        return self.drop_path(self.mlp(self.norm2(x)), x)


class PatchMerging(nn.Module):
    """2x2 neighbourhood concat + LayerNorm + linear 4C -> 2C (Swin's order:
    offsets (0, 0), (1, 0), (0, 1), (1, 1) in (row, column)); odd maps are
    zero-padded at the bottom/right.

    The concat is one permuted copy of the map rather than four strided slices:
    a slice's backward writes a zero-filled map of the input's size, and
    autograd then sums the four (about 4% of FLatten-Swin-T's training
    traffic at 800x1333, docs/benchmarks.md)."""

    def __init__(self, embed_dims: int):
        super().__init__()
        self.norm = nn.LayerNorm(4 * embed_dims)
        self.reduction = nn.Linear(4 * embed_dims, 2 * embed_dims, bias=False)

    def forward(self, x: Tensor, hw_shape: HWShape) -> Tuple[Tensor, HWShape]:
        B, _, C = x.shape
        H, W = hw_shape
        x = x.view(B, H, W, C)
        if sizes_symbolic(H, W) or H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        h, w = (H + 1) // 2, (W + 1) // 2
        # (B, h, row offset, w, column offset, C) -> (B, h, w, column offset, row offset, C)
        x = x.reshape(B, h, 2, w, 2, C).permute(0, 1, 3, 4, 2, 5).reshape(B, h * w, 4 * C)
        return self.reduction(self.norm(x)), (h, w)


class SwinLayer(nn.Module):
    """The release's ``layers.{i}``: the blocks of stage i and the patch
    merging that follows them (run by stage i + 1, see :class:`SwinStage`)."""

    def __init__(self, blocks: List[SwinBlock], downsample: Optional[PatchMerging]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.downsample = downsample


class SwinStage(Stage):
    """Stage i of FLatten-Swin: the patch merging recorded at the end of
    ``layers.{i-1}`` (not for the first stage), then the blocks of
    ``layers.{i}``. Freezing stage i freezes all of ``layers.{i}``, its
    patch merging included, as mmdet's Swin does."""

    def __init__(self, index: int):
        entry = (f'layers.{index - 1}.downsample',) if index else ()
        super().__init__(index, (f'layers.{index}', f'norm{index}'), f'layers.{index}', entry)

    def forward(self, backbone: 'FLattenSwin', x: Tensor, hw_shape: HWShape) -> StageOutput:
        if self.index:
            x, hw_shape = backbone.layers[self.index - 1].downsample(x, hw_shape)
        return self.run_blocks(backbone, backbone.layers[self.index].blocks, x, hw_shape), hw_shape


class FLattenSwin(SwinLikeBackbone):
    """FLatten-Swin: Swin Transformer with focused linear attention.

    Args:
        arch (str): ``tiny``, ``small`` or ``base``. Default: ``tiny``.
        in_channels (int): image channels. Default: 3.
        embed_dims (int, optional): channels of stage 1 (doubled per stage).
        depths, num_heads (Sequence[int], optional): per stage overrides.
        attn_type (str): one letter per stage, ``L`` focused linear or ``S``
            softmax window attention. Default: ``LLSS`` (as released).
        window_size (int): window of the softmax stages. Default: 7 (12 for
            the 384 model).
        linear_window (int, optional): window of the linear stages; None
            (default) attends globally, as the released models did at 224².
        pretrain_img_size (int | tuple): resolution of pretraining; the linear
            attention's positional encodings live on the stage grids at this
            resolution and are resized to each input. Default: 224.
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
            [0, 1). Default: 0.2.
        out_indices (int | Sequence[int]): stages whose (LayerNorm-ed) maps are
            returned, increasing; negative ones count from the last. Default: (0, 1, 2, 3).
        frozen_stages (int): -1 freezes nothing; k >= 0 freezes the patch
            embedding and the first k stages. Default: -1.
        norm_eval, with_cp, init_cfg: as :class:`FLattenPVT`.
    """
    arch_zoo = {
        'tiny': dict(embed_dims=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24]),
        'small': dict(embed_dims=96, depths=[2, 2, 18, 2], num_heads=[3, 6, 12, 24]),
        'base': dict(embed_dims=128, depths=[2, 2, 18, 2], num_heads=[4, 8, 16, 32]),
    }

    def __init__(self,
                 arch: str = 'tiny',
                 in_channels: int = 3,
                 embed_dims: Optional[int] = None,
                 depths: Optional[Sequence[int]] = None,
                 num_heads: Optional[Sequence[int]] = None,
                 attn_type: str = 'LLSS',
                 window_size: int = 7,
                 linear_window: Optional[int] = None,
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
        check_no_unknown_args(type(self), unknown, FLattenSwin)
        super().__init__(init_cfg=init_cfg)
        dims, depths, num_heads, img = self._stage_settings(
            arch, embed_dims, depths, num_heads, attn_type, mlp_ratio, in_channels=in_channels,
            pretrain_img_size=pretrain_img_size, focusing_factor=focusing_factor,
            kernel_size=kernel_size, drop_rate=drop_rate, attn_drop_rate=attn_drop_rate,
            drop_path_rate=drop_path_rate, attn_design=attn_design)
        attn_type = self.attn_type
        window = to_2tuple_checked('window_size', window_size)
        lin_window = None if linear_window is None else \
            to_2tuple_checked('linear_window', linear_window)

        self.patch_embed = PatchEmbed(in_channels, dims[0], 4, 4)
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = drop_path_rates(drop_path_rate, sum(depths))
        self.layers = nn.ModuleList()
        for i in range(4):
            grid = stage_grid(img, i)
            stage_window = lin_window if attn_type[i] == 'L' else window
            blocks = [SwinBlock(dims[i], num_heads[i], attn_type[i], stage_window,
                                shift=j % 2 == 1, pos_grid=grid,
                                focusing_factor=focusing_factor, kernel_size=kernel_size,
                                mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate,
                                attn_drop=attn_drop_rate, attn_design=attn_design,
                                drop_path=dpr[sum(depths[:i]) + j])
                      for j in range(depths[i])]
            self.layers.append(SwinLayer(blocks, PatchMerging(dims[i]) if i < 3 else None))
        self._add_output_norms(out_indices)
        self.stages = nn.ModuleList(SwinStage(i) for i in range(4))
        self._setup_outputs_and_freezing(out_indices, frozen_stages, norm_eval, with_cp)

    convert_official = staticmethod(swin_convert)

    def stem_modules(self) -> List[nn.Module]:
        return [self.patch_embed, self.pos_drop]

    def stem(self, x: Tensor) -> StageOutput:
        x, hw_shape = self.patch_embed(x)
        return self.pos_drop(x), hw_shape
