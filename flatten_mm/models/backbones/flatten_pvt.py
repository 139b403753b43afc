"""FLatten-PVT and FLatten-PVTv2 backbones.

Module names follow the official release (``patch_embed{i}``,
``pos_embed{i}``, ``block{i}``, ``norm{i}``), so the released ImageNet
checkpoints load without renaming.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import FocusedLinearAttention
from ..resize import add_resized, resize_parts, resize_weights
from ..utils import HWShape, eval_cached, param_cached
from ..layers import (DropPath, Mlp, SpatialReductionAttention, check_attn_type, check_images,
                      drop_path_rates, stage_output)
from .base import FLattenBackbone, check_backbone_args, check_stages

SOFTMAX_SR_RATIOS = (8, 4, 2, 1)


class PatchEmbed(nn.Module):
    """Patch embedding: conv (kernel ``patch_size`` with ``stride``) + LayerNorm.

    PVT uses non-overlapping patches (kernel = stride); the input is padded at
    the bottom/right to a multiple of the stride, so every pixel is covered and
    the output grid is ceil(H / stride) x ceil(W / stride). PVTv2 uses
    overlapping patches (kernel > stride, padding kernel // 2).
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
            pad_h = -x.shape[2] % self.stride
            pad_w = -x.shape[3] % self.stride
            if pad_h or pad_w:
                x = F.pad(x, (0, pad_w, 0, pad_h))
        x = self.proj(x)
        hw_shape = (x.shape[2], x.shape[3])
        return self.norm(x.flatten(2).transpose(1, 2)), hw_shape


class PVTBlock(nn.Module):
    """norm1 -> attention (focused linear ``L`` or softmax SRA ``S``) ->
    norm2 -> MLP, both residual, with stochastic depth."""

    def __init__(self, embed_dims: int, num_heads: int, mlp_ratio: float,
                 attn_type: str, sr_ratio: int, pos_grid: HWShape,
                 focusing_factor: float, kernel_size: int, qkv_bias: bool = True,
                 drop: float = 0., attn_drop: float = 0., drop_path: float = 0.,
                 with_dwconv: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=1e-6)
        if attn_type == 'L':
            self.attn = FocusedLinearAttention(
                embed_dims, num_heads, qkv_bias=qkv_bias, sr_ratio=sr_ratio,
                focusing_factor=focusing_factor, kernel_size=kernel_size,
                pos_grid=(max(pos_grid[0] // sr_ratio, 1), max(pos_grid[1] // sr_ratio, 1)),
                proj_drop=drop)
        else:
            self.attn = SpatialReductionAttention(
                embed_dims, num_heads, qkv_bias=qkv_bias, sr_ratio=sr_ratio,
                attn_drop=attn_drop, proj_drop=drop)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop, with_dwconv)

    def forward(self, x: Tensor, hw_shape: HWShape) -> Tensor:
        x = self.drop_path(self.attn(self.norm1(x), hw_shape), x)
        return self.drop_path(self.mlp(self.norm2(x), hw_shape), x)


class FLattenPyramid(FLattenBackbone):
    """The pyramid body shared by FLatten-PVT (v1) and FLatten-PVTv2.

    Subclasses set ``arch_zoo`` and ``version`` (1 or 2). See
    :class:`FLattenPVT` for the arguments.
    """
    version: int = 1

    def __init__(self,
                 arch: str = 'tiny',
                 in_channels: int = 3,
                 embed_dims: Optional[Sequence[int]] = None,
                 depths: Optional[Sequence[int]] = None,
                 num_heads: Optional[Sequence[int]] = None,
                 mlp_ratios: Optional[Sequence[float]] = None,
                 attn_type: str = 'LLLL',
                 sr_ratios: Optional[Sequence[int]] = None,
                 focusing_factor: float = 3,
                 kernel_size: int = 5,
                 pretrain_img_size=224,
                 qkv_bias: bool = True,
                 drop_rate: float = 0.,
                 attn_drop_rate: float = 0.,
                 drop_path_rate: float = 0.1,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 init_cfg: Optional[dict] = None,
                 **unknown):
        if unknown:  # name the class the user asked for, not this base class
            raise TypeError(f'{type(self).__name__} got unexpected argument(s) '
                            f'{", ".join(map(repr, sorted(unknown)))}; see its docstring '
                            'for the arguments it takes')
        super().__init__(init_cfg=init_cfg)
        preset = self.arch_settings(arch, embed_dims=embed_dims, depths=depths,
                                    num_heads=num_heads, mlp_ratios=mlp_ratios)
        attn_type = check_attn_type(attn_type, 4)
        if sr_ratios is None:
            sr_ratios = [1 if t == 'L' else r for t, r in zip(attn_type, SOFTMAX_SR_RATIOS)]
        stages = check_stages(attn_type, preset['embed_dims'], preset['depths'],
                              preset['num_heads'], preset['mlp_ratios'], sr_ratios=sr_ratios)
        embed_dims, depths, num_heads, mlp_ratios, sr_ratios = (stages[k] for k in (
            'embed_dims', 'depths', 'num_heads', 'mlp_ratios', 'sr_ratios'))
        img = check_backbone_args(attn_type, in_channels, pretrain_img_size, focusing_factor,
                                  kernel_size, drop_rate, attn_drop_rate, drop_path_rate)
        self.arch = arch
        self.embed_dims = embed_dims
        self.depths = depths
        self.attn_type = attn_type
        self.num_stages = 4

        # the token grid of each stage at the pretraining resolution
        self.pos_grids = [(img[0] // (4 * 2 ** i), img[1] // (4 * 2 ** i)) for i in range(4)]
        dpr = drop_path_rates(drop_path_rate, sum(depths))
        cur = 0
        in_dims = in_channels
        for i in range(4):
            stride = 4 if i == 0 else 2
            if self.version == 1:
                embed = PatchEmbed(in_dims, embed_dims[i], stride, stride)
            else:
                embed = PatchEmbed(in_dims, embed_dims[i], 7 if i == 0 else 3, stride)
            grid = self.pos_grids[i]
            setattr(self, f'patch_embed{i + 1}', embed)
            if self.version == 1:
                setattr(self, f'pos_embed{i + 1}',
                        nn.Parameter(torch.zeros(1, grid[0] * grid[1], embed_dims[i])))
            setattr(self, f'block{i + 1}', nn.ModuleList([
                PVTBlock(embed_dims[i], num_heads[i], mlp_ratios[i], attn_type[i],
                         sr_ratios[i], grid, focusing_factor, kernel_size, qkv_bias,
                         drop_rate, attn_drop_rate, dpr[cur + j],
                         with_dwconv=self.version == 2)
                for j in range(depths[i])]))
            if self.version == 2:
                setattr(self, f'norm{i + 1}', nn.LayerNorm(embed_dims[i], eps=1e-6))
            cur += depths[i]
            in_dims = embed_dims[i]
        self.pos_drop = nn.Dropout(drop_rate)
        self._setup_common(out_indices, frozen_stages, norm_eval, with_cp)

    def stage_modules(self, i: int) -> List[nn.Module]:
        names = [f'patch_embed{i + 1}', f'block{i + 1}', f'norm{i + 1}', f'pos_embed{i + 1}']
        return [getattr(self, n) for n in names if hasattr(self, n)]

    def default_init(self):
        super().default_init()
        if self.version == 1:
            for i in range(4):
                nn.init.trunc_normal_(getattr(self, f'pos_embed{i + 1}'), std=.02)

    def forward_stage(self, i: int, x: Tensor) -> Tuple[Tensor, HWShape]:
        """Run stage i on an image / feature map (B, C, H, W); returns its
        tokens (B, N, C') and grid."""
        x, hw_shape = getattr(self, f'patch_embed{i + 1}')(x)
        if self.version == 1:
            pos = getattr(self, f'pos_embed{i + 1}')
            parts = param_cached(self, (i, hw_shape), lambda: resize_parts(
                pos, self.pos_grids[i], hw_shape, eval_cached(
                    self, ('weights', i, hw_shape, pos.dtype, pos.device),
                    lambda: resize_weights(self.pos_grids[i], hw_shape, pos))), (pos,))
            x = self.pos_drop(add_resized(x, parts))
        for block in getattr(self, f'block{i + 1}'):
            x = self.run_block(block, x, hw_shape)
        if self.version == 2:
            x = getattr(self, f'norm{i + 1}')(x)
        return x, hw_shape

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """
        Args:
            x (Tensor): images (B, C, H, W), any H and W.

        Returns:
            tuple[Tensor]: feature maps (B, C_i, ceil(H / s_i), ceil(W / s_i))
            at strides s_i = 4, 8, 16, 32 for the stages in ``out_indices``.
        """
        x = check_images(x)
        outs = []
        for i in range(self.num_stages):
            tokens, hw_shape = self.forward_stage(i, x)
            x = stage_output(tokens, hw_shape)
            if i in self.out_indices:
                outs.append(x)
        return tuple(outs)


class FLattenPVT(FLattenPyramid):
    """FLatten-PVT: PVT v1 with focused linear attention (FLatten, ICCV 2023).

    Args:
        arch (str): ``tiny``, ``small``, ``medium`` or ``large``; the explicit
            arguments below override the preset. Default: ``tiny``.
        in_channels (int): image channels. Default: 3.
        embed_dims, depths, num_heads, mlp_ratios (Sequence, optional): per
            stage overrides of the preset.
        attn_type (str): one letter per stage, ``L`` focused linear attention
            or ``S`` PVT's softmax spatial-reduction attention. Default: LLLL.
        sr_ratios (Sequence[int], optional): key reduction per stage. Default:
            1 for ``L`` stages (every query sees every token, as released) and
            PVT's 8, 4, 2, 1 for ``S`` stages.
        focusing_factor (float): p of the focused mapping. Default: 3.
        kernel_size (int): odd kernel of the rank-restoring DWC. Default: 5.
        pretrain_img_size (int | tuple): resolution the position embeddings
            and encodings were learnt at; they are resized to each input.
            At least 32 (every stage needs a token). Default: 224.
        qkv_bias (bool): bias in q/kv projections. Default: True.
        drop_rate (float): dropout rate, in [0, 1). Default: 0.
        attn_drop_rate (float): dropout on the attention weights of the
            softmax (``S``) stages, in [0, 1). Linear (``L``) stages form no
            attention matrix: non-zero with no ``S`` stage is an error, and
            with some ``L`` stages a UserWarning says they ignore it. Default: 0.
        drop_path_rate (float): stochastic depth, linear over blocks, in
            [0, 1). Default: 0.1.
        out_indices (Sequence[int]): stages whose maps are returned, distinct
            and in increasing order (a tuple or list, e.g. ``(3,)``).
        frozen_stages (int): -1 freezes nothing; k >= 0 freezes the first k
            stages (with their patch embeddings). Default: -1.
        norm_eval (bool): keep normalisation layers in eval mode. Default: False.
        with_cp (bool): gradient checkpointing per block. Default: False.
        init_cfg (dict, optional): ``dict(type='Pretrained', checkpoint=PATH)``
            loads an official ImageNet checkpoint (``{'model': state_dict}``).
    """
    version = 1
    ignore_unexpected = (r'head\.', r'norm\.')  # the classifier and its unused norm
    arch_zoo = {
        name: dict(embed_dims=[64, 128, 320, 512], num_heads=[1, 2, 5, 8],
                   mlp_ratios=[8, 8, 4, 4], depths=depths)
        for name, depths in (('tiny', [2, 2, 2, 2]), ('small', [3, 4, 6, 3]),
                             ('medium', [3, 4, 18, 3]), ('large', [3, 8, 27, 3]))
    }


class FLattenPVTv2(FLattenPyramid):
    """FLatten-PVTv2: PVTv2 (overlapping patch embedding, depth-wise conv in
    the MLP, a LayerNorm after each stage) with focused linear attention.

    Arguments as :class:`FLattenPVT`; ``arch`` is one of ``b0`` ... ``b5``.
    Heads are 1, 2, 5, 8 per stage in every preset (head dimension 32 for b0,
    64 for b1-b5), which gives the released parameter counts.
    """
    version = 2
    arch_zoo = {
        'b0': dict(embed_dims=[32, 64, 160, 256], num_heads=[1, 2, 5, 8],
                   mlp_ratios=[8, 8, 4, 4], depths=[2, 2, 2, 2]),
        **{name: dict(embed_dims=[64, 128, 320, 512], num_heads=[1, 2, 5, 8],
                      mlp_ratios=ratios, depths=depths)
           for name, depths, ratios in (
               ('b1', [2, 2, 2, 2], [8, 8, 4, 4]), ('b2', [3, 4, 6, 3], [8, 8, 4, 4]),
               ('b3', [3, 4, 18, 3], [8, 8, 4, 4]), ('b4', [3, 8, 27, 3], [8, 8, 4, 4]),
               ('b5', [3, 6, 40, 3], [4, 4, 4, 4]))},
    }
