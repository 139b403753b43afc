"""Build-time checks of the arguments every backbone family takes: an error
names the argument and what is allowed, before anything fails deep inside."""
import inspect
import numbers
import warnings
from typing import List, Tuple

from ..designs import check_design, check_kernel_size
from ..layers import check_attn_type, check_stage_list
from ..utils import HWShape, check_heads, check_number, check_positive_int, to_2tuple_checked

# the last stage's stride: the pretraining grid of every stage needs a token
PRETRAIN_MIN_SIZE = 32


def check_stages(attn_type: str, embed_dims, depths, num_heads, mlp_ratios=None,
                 num_stages: int = 4, **int_lists) -> dict:
    """The per-stage arguments every family takes, validated: ``attn_type``
    (one L/S letter per stage), ``embed_dims``, ``depths``, ``num_heads`` and
    any ``int_lists`` (sr_ratios, split_size) as positive ints per stage,
    each stage's dims divisible by its heads, ``mlp_ratios`` (one number, or
    one per stage) giving every MLP a hidden layer. Returns them as lists
    (``mlp_ratios`` per stage), keyed by name."""
    out = dict(attn_type=check_attn_type(attn_type, num_stages))
    for name, values in dict(embed_dims=embed_dims, depths=depths, num_heads=num_heads,
                             **int_lists).items():
        out[name] = check_stage_list(name, values, num_stages, positive_ints=True)
    for i, (dims, heads) in enumerate(zip(out['embed_dims'], out['num_heads'])):
        check_heads(dims, heads, f' at stage {i + 1} (embed_dims {out["embed_dims"]}, '
                                 f'num_heads {out["num_heads"]})')
    if mlp_ratios is not None:
        name = 'mlp_ratios' if isinstance(mlp_ratios, (list, tuple)) else 'mlp_ratio'
        ratios = check_stage_list(name, mlp_ratios, num_stages) if name == 'mlp_ratios' \
            else [mlp_ratios] * num_stages
        for dims, r in zip(out['embed_dims'], ratios):
            check_number(name, r, low_open=True)
            if int(dims * r) < 1:
                raise ValueError(f'{name} must give every MLP a hidden layer: int(embed_dims '
                                 f'* ratio) is 0 for embed_dims {dims}, got {mlp_ratios!r}')
        out['mlp_ratios'] = ratios
    return out


# arguments of the softmax backbones a config may inherit (mmdet's, mmseg's and
# mmpretrain's SwinTransformer, PyramidVisionTransformer(V2), PCPVT and
# VisionTransformer) that the FLatten backbones do not take: their architecture
# is fixed (patch sizes, strides, norms, activations) or the name is another here
UPSTREAM_ONLY = frozenset((
    'act_cfg', 'convert_weights', 'frozen_exclude', 'img_size', 'interpolate_mode',
    'layer_cfgs', 'layer_scale_init_value', 'norm_after_stage', 'norm_cfg', 'num_fcs',
    'num_layers', 'num_stages', 'out_after_downsample', 'out_origin', 'output_cls_token',
    'pad_small_map', 'paddings', 'patch_bias', 'patch_cfg', 'patch_norm', 'patch_pad',
    'patch_size', 'patch_sizes', 'pre_norm', 'pretrained', 'qk_scale', 'stage_cfgs',
    'strides', 'use_abs_pos_embed', 'use_conv_ffn'))
# an upstream name -> ours, where a FLatten backbone takes the same thing
RENAMED = {'num_layers': ('depths', 'depth'), 'img_size': ('pretrain_img_size',),
           'mlp_ratio': ('mlp_ratios',), 'mlp_ratios': ('mlp_ratio',)}


def init_arguments(cls: type, owner: type) -> List[str]:
    """The named arguments ``cls`` takes: those of each ``__init__`` along its
    MRO down to ``owner``'s (subclasses hand the others on in ``**kwargs``),
    less those a subclass sets itself (``cls.fixed_init_args``: a timm
    classifier's ``in_channels``, which it takes as ``in_chans``)."""
    names: List[str] = []
    for c in cls.__mro__[:cls.__mro__.index(owner) + 1]:
        if '__init__' in vars(c):
            names += [n for n, p in inspect.signature(c.__init__).parameters.items()
                      if n != 'self' and p.kind is p.POSITIONAL_OR_KEYWORD and n not in names]
    return [n for n in names if n not in getattr(cls, 'fixed_init_args', ())]


def check_no_unknown_args(cls: type, unknown: dict, owner: type) -> None:
    """A TypeError naming the arguments in ``unknown`` that ``cls`` does not
    take (``owner``'s ``__init__`` got them in ``**unknown``), the ones it
    does, renamings (mmdet's PVT ``num_layers`` is ``depths`` here), and, for
    arguments of the softmax backbone a config inherits, how to replace that
    backbone (``_delete_=True``)."""
    if not unknown:
        return
    takes = init_arguments(cls, owner)
    names = sorted(unknown)
    msg = (f'{cls.__name__} got unexpected argument(s) {", ".join(map(repr, names))}; '
           f'it takes {", ".join(takes)}')
    for name in names:
        ours = [n for n in RENAMED.get(name, ()) if n in takes]
        if ours:
            msg += f'. {name!r} is {ours[0]!r} here'
    upstream = [n for n in names if n in UPSTREAM_ONLY]
    if upstream:
        what = 'is an argument' if len(upstream) == 1 else 'are arguments'
        msg += (f'. {", ".join(map(repr, upstream))} {what} of a softmax backbone '
                "(mmdet's, mmseg's or mmpretrain's Swin, PVT or ViT): a config that inherits "
                f"one should replace it with backbone=dict(_delete_=True, type='{cls.__name__}', "
                "...)")
    raise TypeError(msg)


def check_backbone_args(attn_type: str, in_channels: int, pretrain_img_size,
                        focusing_factor: float, kernel_size: int, drop_rate: float,
                        attn_drop_rate: float, drop_path_rate: float,
                        attn_design: str = 'focused') -> HWShape:
    """The scalar arguments every family takes, validated (``attn_design``:
    one of :data:`~flatten_mm.models.designs.DESIGNS`, the formula of the
    ``L`` stages); returns ``pretrain_img_size`` as (h, w).

    ``attn_drop_rate`` drops softmax attention weights, which only ``S``
    stages form: with no ``S`` stage a non-zero rate is an error, and with
    some ``L`` stages a UserWarning says that they do not use it."""
    check_positive_int('in_channels', in_channels)
    img = to_2tuple_checked('pretrain_img_size', pretrain_img_size, PRETRAIN_MIN_SIZE)
    check_number('focusing_factor', focusing_factor, low_open=True)
    check_kernel_size(kernel_size)
    check_design(attn_design, 'attn_design')
    for name, rate in (('drop_rate', drop_rate), ('attn_drop_rate', attn_drop_rate),
                       ('drop_path_rate', drop_path_rate)):
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or \
                not 0 <= rate < 1:
            raise ValueError(f'{name} must be a number in [0, 1), got {rate!r}')
    if attn_drop_rate and 'S' not in attn_type:
        raise ValueError(f'attn_drop_rate must be 0 without softmax (S) stages: linear '
                         f'attention forms no attention matrix to drop from '
                         f'(attn_type={attn_type!r}), got {attn_drop_rate}')
    if attn_drop_rate and 'L' in attn_type:
        warnings.warn(f'attn_drop_rate={attn_drop_rate} applies to the softmax (S) stages '
                      f'only; the focused linear (L) stages of attn_type={attn_type!r} form '
                      'no attention matrix and do not use it', UserWarning, stacklevel=3)
    return img


def check_out_indices(out_indices, num_stages: int = 4) -> Tuple[int, ...]:
    """``out_indices`` as a tuple: one stage index or a non-empty sequence of
    distinct ones in increasing order (the order of the returned maps); negative
    ones count from the last stage, as mmseg's and mmpretrain's ViT take them."""
    values = [out_indices] if isinstance(out_indices, int) else out_indices
    if isinstance(values, (list, tuple)) and values and all(
            isinstance(i, int) and not isinstance(i, bool) for i in values):
        values = tuple(i + num_stages if i < 0 else i for i in values)
        if all(0 <= i < num_stages for i in values) and list(values) == sorted(set(values)):
            return values
    raise ValueError(f'out_indices must be stage indices in -{num_stages}..{num_stages - 1} '
                     f'(negative: from the last), distinct and increasing, one or a tuple '
                     f'or list (e.g. (0, 1, 2, 3), (2,) or -1), got {out_indices!r}')


def check_init_cfg(init_cfg) -> List[dict]:
    """None, a dict or a list of dicts (mmengine's forms); at most one
    ``Pretrained``, which names its checkpoint (else the error would come at
    init_weights). Returns the dicts, as a list."""
    cfgs = [] if init_cfg is None else init_cfg if isinstance(init_cfg, list) else [init_cfg]
    if not all(isinstance(c, dict) for c in cfgs):
        raise ValueError(f'init_cfg must be None, a dict or a list of dicts, got {init_cfg!r}')
    pretrained = [cfg for cfg in cfgs if cfg.get('type') == 'Pretrained']
    if len(pretrained) > 1:
        raise ValueError(f'init_cfg holds {len(pretrained)} Pretrained entries, at most one '
                         f'is allowed: {init_cfg!r}')
    for cfg in pretrained:
        if not cfg.get('checkpoint'):
            raise ValueError("init_cfg of type 'Pretrained' needs a 'checkpoint' path, "
                             f'got {cfg!r}')
    return cfgs
