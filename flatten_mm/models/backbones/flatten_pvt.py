"""FLatten-PVT and FLatten-PVTv2 backbones.

Module names follow the official release (``patch_embed{i}``,
``pos_embed{i}``, ``block{i}``, ``norm{i}``), so the released ImageNet
checkpoints load without renaming. The two versions differ by four named
flags of :class:`FLattenPyramid`.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ...conversion import pvt_convert
from ..attention import FocusedLinearAttention
from ..resize import add_resized, cached_resize_parts
from ..utils import HWShape, stage_grid, tokens_to_map
from ..layers import (DropPath, Mlp, PatchEmbed, SpatialReductionAttention, check_attn_type,
                      drop_path_rates)
from .base import FLattenBackbone, Stage, StageOutput
from .checks import check_backbone_args, check_no_unknown_args, check_stages

SOFTMAX_SR_RATIOS = (8, 4, 2, 1)


class PVTBlock(nn.Module):
    """norm1 -> attention (focused linear ``L`` or softmax SRA ``S``) ->
    norm2 -> MLP, both residual, with stochastic depth."""

    def __init__(self, embed_dims: int, num_heads: int, mlp_ratio: float,
                 attn_type: str, sr_ratio: int, pos_grid: HWShape,
                 focusing_factor: float, kernel_size: int, qkv_bias: bool = True,
                 drop: float = 0., attn_drop: float = 0., drop_path: float = 0.,
                 with_dwconv: bool = False, attn_design: str = 'focused'):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=1e-6)
        if attn_type == 'L':
            self.attn = FocusedLinearAttention(
                embed_dims, num_heads, qkv_bias=qkv_bias, sr_ratio=sr_ratio,
                focusing_factor=focusing_factor, kernel_size=kernel_size,
                pos_grid=(max(pos_grid[0] // sr_ratio, 1), max(pos_grid[1] // sr_ratio, 1)),
                proj_drop=drop, design=attn_design)
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


class PyramidStage(Stage):
    """Stage i of FLatten-PVT / -PVTv2: patch embedding of the previous
    stage's map (of the images for the first), the absolute position
    embedding (PVT), the blocks, the stage norm (PVTv2)."""

    def __init__(self, index: int, pos_embed: bool, stage_norm: bool):
        n = index + 1
        parts = [f'patch_embed{n}'] + ([f'pos_embed{n}', f'pos_drop{n}'] if pos_embed else [])
        parts += [f'block{n}']
        parts += [f'norm{n}'] if stage_norm else []
        super().__init__(index, parts, output_name=parts[-1])
        self.has_pos_embed, self.has_norm = pos_embed, stage_norm

    def forward(self, backbone: 'FLattenPyramid', x: Tensor,
                hw_shape: Optional[HWShape]) -> StageOutput:
        n = self.index + 1
        if hw_shape is not None:  # tokens of the previous stage, as a map (a view)
            x = tokens_to_map(x, hw_shape)
        x, hw_shape = getattr(backbone, f'patch_embed{n}')(x)
        if self.has_pos_embed:
            pos = getattr(backbone, f'pos_embed{n}')
            grid = backbone.pos_grids[self.index]
            parts = cached_resize_parts(self, self.index, pos, grid, hw_shape)
            x = getattr(backbone, f'pos_drop{n}')(add_resized(x, parts))
        x = self.run_blocks(backbone, getattr(backbone, f'block{n}'), x, hw_shape)
        if self.has_norm:
            x = getattr(backbone, f'norm{n}')(x)
        return x, hw_shape


class FLattenPyramid(FLattenBackbone):
    """The pyramid body shared by FLatten-PVT (v1) and FLatten-PVTv2.

    Subclasses set ``arch_zoo`` and the four flags in which the versions
    differ. See :class:`FLattenPVT` for the arguments.
    """
    overlapping_patch_embed: bool = False  # PVTv2: 7x7 / 3x3 convs with padding
    absolute_pos_embed: bool = True  # PVT: a learnt embedding added after each patch embedding
    stage_norm: bool = False  # PVTv2: a LayerNorm ending each stage
    mlp_dwconv: bool = False  # PVTv2: a 3x3 depth-wise conv in each MLP
    first_conv = 'patch_embed1.proj'
    default_arch: str  # the preset when ``arch`` is not given

    def __init__(self,
                 arch: Optional[str] = None,
                 in_channels: int = 3,
                 embed_dims: Optional[Sequence[int]] = None,
                 depths: Optional[Sequence[int]] = None,
                 num_heads: Optional[Sequence[int]] = None,
                 mlp_ratios: Optional[Sequence[float]] = None,
                 attn_type: str = 'LLLL',
                 sr_ratios: Optional[Sequence[int]] = None,
                 focusing_factor: float = 3,
                 kernel_size: int = 5,
                 attn_design: str = 'focused',
                 pretrain_img_size=224,
                 qkv_bias: bool = True,
                 drop_rate: float = 0.,
                 attn_drop_rate: float = 0.,
                 drop_path_rate: float = 0.1,
                 out_indices: Union[int, Sequence[int]] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 init_cfg: Optional[dict] = None,
                 **unknown):
        check_no_unknown_args(type(self), unknown, FLattenPyramid)  # names the class used
        super().__init__(init_cfg=init_cfg)
        settings = self._stage_settings(self.default_arch if arch is None else arch,
                                        embed_dims, depths, num_heads, mlp_ratios, attn_type,
                                        sr_ratios)
        img = check_backbone_args(self.attn_type, in_channels, pretrain_img_size,
                                  focusing_factor, kernel_size, drop_rate, attn_drop_rate,
                                  drop_path_rate, attn_design)
        # the token grid of each stage at the pretraining resolution
        self.pos_grids = [stage_grid(img, i) for i in range(4)]
        dpr = drop_path_rates(drop_path_rate, sum(self.depths))
        layer = dict(focusing_factor=focusing_factor, kernel_size=kernel_size,
                     qkv_bias=qkv_bias, drop=drop_rate, attn_drop=attn_drop_rate,
                     attn_design=attn_design)
        for i in range(4):
            first = sum(self.depths[:i])
            self._build_stage(i, in_channels if i == 0 else self.embed_dims[i - 1],
                              [s[i] for s in settings], dpr[first:first + self.depths[i]],
                              layer)
        self.stages = nn.ModuleList(
            PyramidStage(i, self.absolute_pos_embed, self.stage_norm) for i in range(4))
        if self.absolute_pos_embed:  # one per stage: a frozen stage's stays in eval mode
            for i in range(4):
                setattr(self, f'pos_drop{i + 1}', nn.Dropout(drop_rate))
        self._setup_outputs_and_freezing(out_indices, frozen_stages, norm_eval, with_cp)

    def _stage_settings(self, arch, embed_dims, depths, num_heads, mlp_ratios, attn_type,
                        sr_ratios) -> tuple:
        """Validated per-stage (num_heads, mlp_ratios, attn_type, sr_ratios)
        of ``arch`` with the overrides; sets ``arch``, ``embed_dims``,
        ``depths``, ``attn_type`` and ``num_stages``."""
        preset = self.arch_settings(arch, embed_dims=embed_dims, depths=depths,
                                    num_heads=num_heads, mlp_ratios=mlp_ratios)
        attn_type = check_attn_type(attn_type, 4)
        if sr_ratios is None:
            sr_ratios = [1 if t == 'L' else r for t, r in zip(attn_type, SOFTMAX_SR_RATIOS)]
        stages = check_stages(attn_type, preset['embed_dims'], preset['depths'],
                              preset['num_heads'], preset['mlp_ratios'], sr_ratios=sr_ratios)
        embed_dims, depths, num_heads, mlp_ratios, sr_ratios = (stages[k] for k in (
            'embed_dims', 'depths', 'num_heads', 'mlp_ratios', 'sr_ratios'))
        self.arch = arch
        self.embed_dims = embed_dims
        self.depths = depths
        self.attn_type = attn_type
        self.num_stages = 4
        return num_heads, mlp_ratios, attn_type, sr_ratios

    def _build_stage(self, i: int, in_dims: int, settings: list, drop_paths: List[float],
                     layer: dict) -> None:
        """Stage i's parts, under the release's names: ``patch_embed{i+1}``,
        ``pos_embed{i+1}`` (PVT), ``block{i+1}``, ``norm{i+1}`` (PVTv2)."""
        num_heads, mlp_ratio, attn_type, sr_ratio = settings
        dims, grid, n = self.embed_dims[i], self.pos_grids[i], i + 1
        stride = 4 if i == 0 else 2
        patch = (7 if i == 0 else 3) if self.overlapping_patch_embed else stride
        setattr(self, f'patch_embed{n}', PatchEmbed(in_dims, dims, patch, stride))
        if self.absolute_pos_embed:
            setattr(self, f'pos_embed{n}', nn.Parameter(torch.zeros(1, grid[0] * grid[1], dims)))
        setattr(self, f'block{n}', nn.ModuleList([
            PVTBlock(dims, num_heads, mlp_ratio, attn_type, sr_ratio, grid,
                     drop_path=drop_path, with_dwconv=self.mlp_dwconv, **layer)
            for drop_path in drop_paths]))
        if self.stage_norm:
            setattr(self, f'norm{n}', nn.LayerNorm(dims, eps=1e-6))

    convert_official = staticmethod(pvt_convert)

    def position_embeddings(self) -> List[Tuple[str, HWShape, int]]:
        """PVT's position embedding of each stage (PVTv2 has none), with its
        grid: weights learnt on another grid are resized to it on loading."""
        if not self.absolute_pos_embed:
            return []
        return [(f'pos_embed{i + 1}', self.pos_grids[i], 0) for i in range(self.num_stages)]

    def default_init(self):
        super().default_init()
        if self.absolute_pos_embed:
            for i in range(self.num_stages):
                nn.init.trunc_normal_(getattr(self, f'pos_embed{i + 1}'), std=.02)


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
        kernel_size (int): odd kernel of the rank-restoring DWC, 0 for none
            (designs with a DWC: focused, angular). Default: 5.
        attn_design (str): the formula of the ``L`` stages' attention:
            ``focused`` (FLatten's), ``relu``, ``efficient``, ``hydra``,
            ``angular`` or ``efficientvit`` (docs/attention_designs.md).
            Default: ``focused``.
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
        out_indices (int | Sequence[int]): stages whose maps are returned, distinct
            and in increasing order (one, or a tuple or list, e.g. ``(3,)``; negative
            ones count from the last).
        frozen_stages (int): -1 freezes nothing; k >= 0 freezes the first k
            stages (with their patch embeddings). Default: -1.
        norm_eval (bool): keep normalisation layers in eval mode. Default: False.
        with_cp (bool): gradient checkpointing per block. Default: False.
        init_cfg (dict, optional): ``dict(type='Pretrained', checkpoint=PATH)``
            loads an official ImageNet checkpoint (``{'model': state_dict}``).
    """
    ignore_unexpected = (r'head\.', r'norm\.')  # the classifier and its unused norm
    default_arch = 'tiny'
    arch_zoo = {
        name: dict(embed_dims=[64, 128, 320, 512], num_heads=[1, 2, 5, 8],
                   mlp_ratios=[8, 8, 4, 4], depths=depths)
        for name, depths in (('tiny', [2, 2, 2, 2]), ('small', [3, 4, 6, 3]),
                             ('medium', [3, 4, 18, 3]), ('large', [3, 8, 27, 3]))
    }


class FLattenPVTv2(FLattenPyramid):
    """FLatten-PVTv2: PVTv2 (overlapping patch embedding, depth-wise conv in
    the MLP, a LayerNorm after each stage) with focused linear attention.

    Arguments as :class:`FLattenPVT`; ``arch`` is one of ``b0`` ... ``b5``
    (default ``b0``).
    Heads are 1, 2, 5, 8 per stage in every preset (head dimension 32 for b0,
    64 for b1-b5), which gives the released parameter counts.
    """
    overlapping_patch_embed = True
    absolute_pos_embed = False
    stage_norm = True
    mlp_dwconv = True
    default_arch = 'b0'
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
