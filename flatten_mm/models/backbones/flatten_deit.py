"""FLatten-DeiT: DeiT (a plain ViT with a class token) whose blocks attend
with focused linear attention.

The paper reports FLatten-DeiT but its authors released no code for it; this
is our construction. Every block's softmax attention is replaced by
:class:`~flatten_mm.models.attention.FocusedLinearAttention` (p = 3, a 5x5
DWC on V over the patch grid). The class token is one more key and value:
it enters phi(K)^T V and the normaliser like any token, gets no positional
encoding of the layer (that lives on the grid) and no DWC term (it has no
place on the grid). ``attn_type='S'`` gives the softmax DeiT in the same class.

Module names are timm's DeiT names (``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.{i}``, ``norm``), so a softmax DeiT checkpoint of
timm loads into ``attn_type='S'``. Each block is a stage of
:class:`~flatten_mm.models.backbones.base.FLattenBackbone`: ``out_indices``
and ``frozen_stages`` count blocks, and every output is a stride-16 map.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..attention import FocusedLinearAttention
from ..layers import (DropPath, Mlp, check_attn_type, check_images, drop_path_rates,
                      softmax_attention, stage_output)
from ..resize import add_resized, cached_resize_parts
from ..utils import (HWShape, check_heads, check_number, check_positive_int, map_to_tokens,
                     pad_to_multiple, strided_conv)
from .base import FLattenBackbone, Stage, StageOutput
from .checks import check_backbone_args, check_no_unknown_args

OUT_TYPES = ('featmap', 'cls_token')


def arch_from_dict(arch: dict, overrides: dict) -> dict:
    """An ``arch`` given as a dict (``embed_dims``, ``num_heads``, ``depth``,
    optionally ``mlp_ratio``), with the non-None ``overrides`` applied."""
    if set(arch) - set(overrides) or not {'embed_dims', 'num_heads', 'depth'} <= set(arch):
        raise ValueError(f'arch as a dict takes embed_dims, num_heads, depth and '
                         f'optionally mlp_ratio, got {arch!r}')
    preset = dict(dict(mlp_ratio=4.), **arch)
    preset.update({k: v for k, v in overrides.items() if v is not None})
    return preset


def quarter_ends(depth: int) -> tuple:
    """The last block of each quarter of ``depth`` blocks: (2, 5, 8, 11) for 12."""
    return tuple(sorted({max(depth * q // 4 - 1, 0) for q in range(1, 5)}))


class ViTPatchEmbed(nn.Module):
    """Non-overlapping patches by a strided conv (``proj``), no norm, as
    DeiT. Images are padded at the bottom/right to a multiple of the patch,
    so the grid is ceil(H / p) x ceil(W / p) and every token covers real pixels."""

    def __init__(self, in_channels: int, embed_dims: int, patch_size: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, embed_dims, patch_size, stride=patch_size)

    def forward(self, x: Tensor):
        x = strided_conv(self.proj, pad_to_multiple(x, self.patch_size))
        return map_to_tokens(x).contiguous(), (x.shape[2], x.shape[3])


class GlobalSoftmaxAttention(nn.Module):
    """ViT's softmax attention over all tokens (``S`` blocks), timm's names
    (fused ``qkv``, ``proj``)."""

    def __init__(self, embed_dims: int, num_heads: int, qkv_bias: bool = True,
                 attn_drop: float = 0., proj_drop: float = 0.):
        super().__init__()
        check_heads(embed_dims, num_heads)
        self.num_heads = num_heads
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(embed_dims, embed_dims * 3, bias=qkv_bias)
        self.proj = nn.Linear(embed_dims, embed_dims)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor, hw_shape: Optional[HWShape] = None) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        out = softmax_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, C)))


class DeiTBlock(nn.Module):
    """Pre-norm ViT block: norm1 -> attention (focused linear ``L`` or
    softmax ``S``) -> norm2 -> MLP, both residual, with stochastic depth."""

    def __init__(self, embed_dims: int, num_heads: int, mlp_ratio: float, attn_type: str,
                 pos_grid: HWShape, num_prefix_tokens: int, focusing_factor: float,
                 kernel_size: int, qkv_bias: bool = True, drop: float = 0.,
                 attn_drop: float = 0., drop_path: float = 0., attn_design: str = 'focused'):
        super().__init__()
        self.norm1 = nn.LayerNorm(embed_dims, eps=1e-6)
        if attn_type == 'L':
            self.attn = FocusedLinearAttention(
                embed_dims, num_heads, qkv_bias=qkv_bias, focusing_factor=focusing_factor,
                kernel_size=kernel_size, pos_grid=pos_grid, proj_drop=drop,
                num_prefix_tokens=num_prefix_tokens, design=attn_design)
        else:
            self.attn = GlobalSoftmaxAttention(embed_dims, num_heads, qkv_bias, attn_drop, drop)
        self.drop_path = DropPath(drop_path)
        self.norm2 = nn.LayerNorm(embed_dims, eps=1e-6)
        self.mlp = Mlp(embed_dims, int(embed_dims * mlp_ratio), drop)

    def forward(self, x: Tensor, hw_shape: HWShape) -> Tensor:
        x = self.drop_path(self.attn(self.norm1(x), hw_shape), x)
        return self.drop_path(self.mlp(self.norm2(x)), x)


class BlockStage(Stage):
    """Block i of FLatten-DeiT as a stage: tokens (class token first) in,
    tokens out, on the same grid."""

    def __init__(self, index: int):
        super().__init__(index, [f'blocks.{index}'], output_name=f'blocks.{index}')

    def forward(self, backbone: 'FLattenDeiT', x: Tensor, hw_shape: HWShape) -> StageOutput:
        block = getattr(backbone.blocks, str(self.index))
        return backbone.run_block(block, x, hw_shape), hw_shape


class FLattenDeiT(FLattenBackbone):
    """FLatten-DeiT: DeiT with focused linear attention in its blocks.

    Args:
        arch (str | dict): ``tiny`` (192 wide, 3 heads), ``small`` (384, 6)
            or ``base`` (768, 12), 12 blocks, MLP ratio 4; or a dict with
            ``embed_dims``, ``num_heads``, ``depth`` (and ``mlp_ratio``).
            The explicit arguments below override it. Default: ``tiny``.
        in_channels (int): image channels. Default: 3.
        embed_dims, num_heads, depth (int, optional), mlp_ratio (float,
            optional): overrides of the preset.
        attn_type (str): ``L`` (focused linear attention) or ``S`` (DeiT's
            softmax attention) for every block, or one letter per block.
            Default: ``L``.
        patch_size (int): side of the square patches (the stride of every
            output). Default: 16.
        focusing_factor (float): p of the focused mapping. Default: 3.
        kernel_size (int): odd kernel of the rank-restoring DWC, 0 for none
            (designs with a DWC: focused, angular). Default: 5.
        attn_design (str): the formula of the ``L`` blocks' attention:
            ``focused`` (FLatten's), ``relu``, ``efficient``, ``hydra``,
            ``angular`` or ``efficientvit`` (docs/attention_designs.md).
            Default: ``focused``.
        pretrain_img_size (int | tuple): the resolution the position
            embedding and the layers' positional encodings were learnt at;
            both are resized bilinearly to each input's grid. Default: 224.
        qkv_bias (bool): bias in the q/k/v projections. Default: True.
        with_cls_token (bool): prepend the class token to the patch tokens.
            Default: True.
        final_norm (bool): a LayerNorm (``norm``) on the last block's output.
            Default: False.
        out_type (str): ``featmap``: NCHW maps of the patch tokens of the
            blocks in ``out_indices``; ``cls_token``: their class tokens
            (B, C), for image classifiers. Default: ``featmap``.
        drop_rate (float): dropout rate, in [0, 1). Default: 0.
        attn_drop_rate (float): dropout on the softmax weights of ``S``
            blocks, in [0, 1) (an error with no ``S`` block). Default: 0.
        drop_path_rate (float): stochastic depth, linear over the blocks,
            in [0, 1). Default: 0.1.
        out_indices (int | Sequence[int], optional): blocks whose outputs are
            returned, distinct and increasing (negative: counted from the last).
            Default: the last block of each quarter of the depth, (2, 5, 8, 11)
            for 12 blocks.
        frozen_stages (int): -1 freezes nothing; k >= 0 freezes the patch
            and position embeddings, the class token and the first k blocks.
            Default: -1.
        norm_eval (bool): keep normalisation layers in eval mode. Default: False.
        with_cp (bool): gradient checkpointing per block. Default: False.
        init_cfg (dict, optional): ``dict(type='Pretrained', checkpoint=PATH)``
            loads a checkpoint of our timm classifier (or an mmpretrain one).
    """
    ignore_unexpected = (r'head\.',)
    arch_zoo = {
        'tiny': dict(embed_dims=192, num_heads=3, depth=12, mlp_ratio=4.),
        'small': dict(embed_dims=384, num_heads=6, depth=12, mlp_ratio=4.),
        'base': dict(embed_dims=768, num_heads=12, depth=12, mlp_ratio=4.),
    }

    def __init__(self,
                 arch: Union[str, dict] = 'tiny',
                 in_channels: int = 3,
                 embed_dims: Optional[int] = None,
                 num_heads: Optional[int] = None,
                 depth: Optional[int] = None,
                 mlp_ratio: Optional[float] = None,
                 attn_type: str = 'L',
                 patch_size: int = 16,
                 focusing_factor: float = 3,
                 kernel_size: int = 5,
                 attn_design: str = 'focused',
                 pretrain_img_size=224,
                 qkv_bias: bool = True,
                 with_cls_token: bool = True,
                 final_norm: bool = False,
                 out_type: str = 'featmap',
                 drop_rate: float = 0.,
                 attn_drop_rate: float = 0.,
                 drop_path_rate: float = 0.1,
                 out_indices: Union[int, Sequence[int], None] = None,
                 frozen_stages: int = -1,
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 init_cfg: Optional[dict] = None,
                 **unknown):
        check_no_unknown_args(type(self), unknown, FLattenDeiT)
        super().__init__(init_cfg=init_cfg)
        self._settings(arch, embed_dims, num_heads, depth, mlp_ratio, attn_type)
        img = check_backbone_args(self.attn_type, in_channels, pretrain_img_size,
                                  focusing_factor, kernel_size, drop_rate, attn_drop_rate,
                                  drop_path_rate, attn_design)
        self._check_options(patch_size, img, with_cls_token, final_norm, out_type)
        self.pos_grid = (img[0] // patch_size, img[1] // patch_size)
        self.num_prefix_tokens = int(with_cls_token)
        dims = self.embed_dims[0]
        self.patch_embed = ViTPatchEmbed(in_channels, dims, patch_size)
        if with_cls_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, dims))
        # DeiT's layout: one slot for the class token, then the grid's
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.pos_grid[0] * self.pos_grid[1],
                                                  dims))
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.ModuleList(
            DeiTBlock(dims, self.num_heads, self.mlp_ratio, t, self.pos_grid,
                      self.num_prefix_tokens, focusing_factor, kernel_size, qkv_bias,
                      drop_rate, attn_drop_rate, rate, attn_design)
            for t, rate in zip(self.attn_type, drop_path_rates(drop_path_rate, self.depth)))
        if final_norm:
            self.norm = nn.LayerNorm(dims, eps=1e-6)
        self.stages = nn.ModuleList(BlockStage(i) for i in range(self.depth))
        out_indices = quarter_ends(self.depth) if out_indices is None else out_indices
        self._setup_outputs_and_freezing(out_indices, frozen_stages, norm_eval, with_cp,
                                         num_stages=self.depth)

    def _settings(self, arch, embed_dims, num_heads, depth, mlp_ratio, attn_type) -> None:
        """Validated width, heads, depth, MLP ratio and per-block attention
        of ``arch`` with the overrides, set on the model."""
        overrides = dict(embed_dims=embed_dims, num_heads=num_heads, depth=depth,
                         mlp_ratio=mlp_ratio)
        preset = arch_from_dict(arch, overrides) if isinstance(arch, dict) else \
            self.arch_settings(arch, **overrides)
        self.depth = check_positive_int('depth', preset['depth'])
        check_heads(preset['embed_dims'], preset['num_heads'])
        self.mlp_ratio = check_number('mlp_ratio', preset['mlp_ratio'], low_open=True)
        if int(preset['embed_dims'] * self.mlp_ratio) < 1:
            raise ValueError(f'mlp_ratio must give the MLP a hidden layer: int(embed_dims * '
                             f'mlp_ratio) is 0, got {self.mlp_ratio!r}')
        self.attn_type = check_attn_type(attn_type, self.depth, one_for_all=True)
        self.arch = arch
        self.num_heads = preset['num_heads']
        self.embed_dims = [preset['embed_dims']] * self.depth  # per stage (block), as the others
        self.num_stages = self.depth

    def _check_options(self, patch_size: int, img: HWShape, with_cls_token: bool,
                       final_norm: bool, out_type: str) -> None:
        check_positive_int('patch_size', patch_size)
        if patch_size > min(img):
            raise ValueError(f'patch_size must be at most the pretraining size {img} (the '
                             f'position embedding needs a token), got {patch_size}')
        if out_type not in OUT_TYPES:
            raise ValueError(f'out_type must be one of {OUT_TYPES}, got {out_type!r}')
        if out_type == 'cls_token' and not with_cls_token:
            raise ValueError("out_type='cls_token' needs with_cls_token=True")
        self.patch_size = patch_size
        self.with_cls_token = bool(with_cls_token)
        self.final_norm = bool(final_norm)
        self.out_type = out_type
        # what a classifier's checkpoint holds and this model may not
        self.ignore_unexpected = (r'head\.',) + (() if final_norm else (r'norm\.',)) + \
            (() if with_cls_token else (r'cls_token$',))

    def stem_modules(self) -> list:
        return [self.patch_embed, self.pos_embed, self.pos_drop] + \
            ([self.cls_token] if self.with_cls_token else [])

    def stem(self, x: Tensor) -> StageOutput:
        """Patch embedding, the position embedding resized to the grid, the
        class token (with its own position embedding) in front."""
        x, hw_shape = self.patch_embed(x)
        # cached on a submodule: fx passes the root to a leaf function by name ('')
        parts = cached_resize_parts(self.patch_embed, 'pos_embed', self.pos_embed[:, 1:],
                                    self.pos_grid, hw_shape)
        x = add_resized(x, parts)
        if self.with_cls_token:
            cls = (self.cls_token + self.pos_embed[:, :1]).to(x.dtype)
            x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x), hw_shape

    def forward(self, x: Tensor):
        """
        Args:
            x (Tensor): images (B, C, H, W), any H and W.

        Returns:
            tuple[Tensor]: per block in ``out_indices``, the map (B, C,
            ceil(H / p), ceil(W / p)) of its patch tokens (``featmap``), or
            its class token (B, C) (``cls_token``).
        """
        outs = []
        for i, tokens, hw_shape in self.forward_stages(check_images(x)):
            if i in self.out_indices:
                if self.final_norm and i == self.num_stages - 1:
                    tokens = self.norm(tokens)
                outs.append(tokens[:, 0] if self.out_type == 'cls_token' else
                            stage_output(tokens[:, self.num_prefix_tokens:], hw_shape))
        return tuple(outs)

    def convert_official(self, state_dict: dict) -> dict:
        """Our (timm's) names: nothing renamed."""
        return state_dict

    def position_embeddings(self) -> List[Tuple[str, HWShape, int]]:
        """The position embedding, its grid and its class slot: weights learnt
        on another grid are resized to it on loading."""
        return [('pos_embed', self.pos_grid, 1)]

    def default_init(self):
        super().default_init()
        nn.init.trunc_normal_(self.pos_embed, std=.02)
        if self.with_cls_token:
            nn.init.normal_(self.cls_token, std=1e-6)
