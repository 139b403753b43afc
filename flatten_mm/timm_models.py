"""The FLatten ImageNet classifiers as timm models, one ``@register_model``
function per name, as timm's own model files do.

Importing this module registers them, so it needs timm; ``flatten_mm``
imports it when timm is installed (:func:`flatten_mm.registry.register_timm`).
``default_cfgs`` is read by timm's ``register_model``: ``.in1k`` marks the
models the authors released ImageNet-1K weights for (no download URL: the
files are loaded from a path, ``pretrained_cfg_overlay=dict(file=...)``).
"""
from functools import partial
from typing import Optional

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import FeatureGetterNet

from .conversion import checkpoint_filter_fn
from .models.backbones.flatten_deit import quarter_ends
from .models.classifiers import (FLattenCSwinClassifier, FLattenDeiTClassifier,
                                 FLattenPVTClassifier, FLattenPVTv2Classifier,
                                 FLattenSwinClassifier)


def _cfg(first_conv: str, size: int = 224, **kwargs) -> dict:
    cfg = dict(url='', num_classes=1000, input_size=(3, size, size),
               pool_size=(size // 32, size // 32), fixed_input_size=False,
               crop_pct=1.0 if size == 384 else 0.9, interpolation='bicubic',
               mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
               first_conv=first_conv, classifier='head', license='mit')
    return dict(cfg, **kwargs)


default_cfgs = generate_default_cfgs({
    'flatten_pvt_tiny.in1k': _cfg('patch_embed1.proj'),
    'flatten_pvt_small': _cfg('patch_embed1.proj'),
    'flatten_pvt_medium': _cfg('patch_embed1.proj'),
    'flatten_pvt_large': _cfg('patch_embed1.proj'),
    'flatten_pvt_v2_b0.in1k': _cfg('patch_embed1.proj'),
    'flatten_pvt_v2_b1': _cfg('patch_embed1.proj'),
    'flatten_pvt_v2_b2': _cfg('patch_embed1.proj'),
    'flatten_pvt_v2_b3': _cfg('patch_embed1.proj'),
    'flatten_pvt_v2_b4': _cfg('patch_embed1.proj'),
    'flatten_pvt_v2_b5': _cfg('patch_embed1.proj'),
    'flatten_swin_tiny.in1k': _cfg('patch_embed.proj'),
    'flatten_swin_small.in1k': _cfg('patch_embed.proj'),
    'flatten_swin_base.in1k': _cfg('patch_embed.proj'),
    'flatten_swin_base_384.in1k': _cfg('patch_embed.proj', size=384),
    'flatten_cswin_tiny.in1k': _cfg('stage1_conv_embed.0'),
    'flatten_cswin_small': _cfg('stage1_conv_embed.0'),
    'flatten_cswin_base': _cfg('stage1_conv_embed.0'),
    'flatten_cswin_base_384': _cfg('stage1_conv_embed.0', size=384),
    # FLatten-DeiT: no released weights; DeiT's evaluation settings (crop 0.875)
    'flatten_deit_tiny': _cfg('patch_embed.proj', pool_size=None, crop_pct=0.875),
    'flatten_deit_small': _cfg('patch_embed.proj', pool_size=None, crop_pct=0.875),
    'flatten_deit_base': _cfg('patch_embed.proj', pool_size=None, crop_pct=0.875),
})


def check_feature_cls(variant: str, kwargs: dict) -> None:
    """ValueError where ``features_only`` asks for another feature class than
    timm's getter: the hook, fx, dict and list classes take the outputs of
    the modules ``feature_info`` names, and a stage's modules give tokens
    without their grid (or a list of blocks that is never called: hooks on it
    gave no features at all), not the maps the getter returns."""
    feature_cls = kwargs.get('feature_cls', 'getter')
    if kwargs.get('features_only') and not (
            isinstance(feature_cls, str) and feature_cls.lower() == 'getter'
            or isinstance(feature_cls, type) and issubclass(feature_cls, FeatureGetterNet)):
        raise ValueError(
            f"{variant}: features_only takes feature_cls='getter' (the default: NCHW maps "
            f"of the stages), got {feature_cls!r}; for a torch.fx graph of the classifier "
            f"use timm.layers.create_feature_extractor")


def _create(cls, variant: str, pretrained: bool = False, out_indices=(0, 1, 2, 3),
            img_size=None, defaults: Optional[dict] = None, **kwargs):
    """``defaults``: the variant's settings, which the caller's ``kwargs`` override."""
    if img_size is not None:  # timm's name: here the size the positional terms are
        if 'pretrain_img_size' in kwargs:  # defined for (any input size runs)
            raise TypeError(f'{variant}: give img_size or pretrain_img_size, not both '
                            f'(got {img_size!r} and {kwargs["pretrain_img_size"]!r})')
        kwargs['pretrain_img_size'] = img_size
    kwargs = dict(defaults or {}, **kwargs)
    check_feature_cls(variant, kwargs)
    return build_model_with_cfg(
        cls, variant, pretrained,
        # timm loads another class count non-strictly: the filter checks the rest
        pretrained_filter_fn=partial(checkpoint_filter_fn,
                                     strict=kwargs.get('pretrained_strict', True)),
        # features_only: timm's getter over forward_intermediates, after
        # prune_intermediate_layers has dropped what the features do not use
        feature_cfg=dict(feature_cls='getter', out_indices=out_indices),
        **kwargs)


@register_model
def flatten_pvt_tiny(pretrained: bool = False, **kwargs) -> FLattenPVTClassifier:
    """FLatten-PVT-T (released weights)."""
    return _create(FLattenPVTClassifier, 'flatten_pvt_tiny', pretrained, arch='tiny', **kwargs)


@register_model
def flatten_pvt_small(pretrained: bool = False, **kwargs) -> FLattenPVTClassifier:
    """FLatten-PVT-S."""
    return _create(FLattenPVTClassifier, 'flatten_pvt_small', pretrained, arch='small', **kwargs)


@register_model
def flatten_pvt_medium(pretrained: bool = False, **kwargs) -> FLattenPVTClassifier:
    """FLatten-PVT-M."""
    return _create(FLattenPVTClassifier, 'flatten_pvt_medium', pretrained, arch='medium',
                   **kwargs)


@register_model
def flatten_pvt_large(pretrained: bool = False, **kwargs) -> FLattenPVTClassifier:
    """FLatten-PVT-L."""
    return _create(FLattenPVTClassifier, 'flatten_pvt_large', pretrained, arch='large', **kwargs)


@register_model
def flatten_pvt_v2_b0(pretrained: bool = False, **kwargs) -> FLattenPVTv2Classifier:
    """FLatten-PVTv2-B0 (released weights)."""
    return _create(FLattenPVTv2Classifier, 'flatten_pvt_v2_b0', pretrained, arch='b0', **kwargs)


@register_model
def flatten_pvt_v2_b1(pretrained: bool = False, **kwargs) -> FLattenPVTv2Classifier:
    """FLatten-PVTv2-B1."""
    return _create(FLattenPVTv2Classifier, 'flatten_pvt_v2_b1', pretrained, arch='b1', **kwargs)


@register_model
def flatten_pvt_v2_b2(pretrained: bool = False, **kwargs) -> FLattenPVTv2Classifier:
    """FLatten-PVTv2-B2."""
    return _create(FLattenPVTv2Classifier, 'flatten_pvt_v2_b2', pretrained, arch='b2', **kwargs)


@register_model
def flatten_pvt_v2_b3(pretrained: bool = False, **kwargs) -> FLattenPVTv2Classifier:
    """FLatten-PVTv2-B3."""
    return _create(FLattenPVTv2Classifier, 'flatten_pvt_v2_b3', pretrained, arch='b3', **kwargs)


@register_model
def flatten_pvt_v2_b4(pretrained: bool = False, **kwargs) -> FLattenPVTv2Classifier:
    """FLatten-PVTv2-B4."""
    return _create(FLattenPVTv2Classifier, 'flatten_pvt_v2_b4', pretrained, arch='b4', **kwargs)


@register_model
def flatten_pvt_v2_b5(pretrained: bool = False, **kwargs) -> FLattenPVTv2Classifier:
    """FLatten-PVTv2-B5."""
    return _create(FLattenPVTv2Classifier, 'flatten_pvt_v2_b5', pretrained, arch='b5', **kwargs)


@register_model
def flatten_swin_tiny(pretrained: bool = False, **kwargs) -> FLattenSwinClassifier:
    """FLatten-Swin-T (released weights)."""
    return _create(FLattenSwinClassifier, 'flatten_swin_tiny', pretrained, arch='tiny', **kwargs)


@register_model
def flatten_swin_small(pretrained: bool = False, **kwargs) -> FLattenSwinClassifier:
    """FLatten-Swin-S (released weights)."""
    return _create(FLattenSwinClassifier, 'flatten_swin_small', pretrained, arch='small',
                   **kwargs)


@register_model
def flatten_swin_base(pretrained: bool = False, **kwargs) -> FLattenSwinClassifier:
    """FLatten-Swin-B (released weights)."""
    return _create(FLattenSwinClassifier, 'flatten_swin_base', pretrained, arch='base', **kwargs)


@register_model
def flatten_swin_base_384(pretrained: bool = False, **kwargs) -> FLattenSwinClassifier:
    """FLatten-Swin-B at 384², softmax windows of 12 (released weights)."""
    return _create(FLattenSwinClassifier, 'flatten_swin_base_384', pretrained, arch='base',
                   defaults=dict(pretrain_img_size=384, window_size=12), **kwargs)


@register_model
def flatten_cswin_tiny(pretrained: bool = False, **kwargs) -> FLattenCSwinClassifier:
    """FLatten-CSwin-T (released weights)."""
    return _create(FLattenCSwinClassifier, 'flatten_cswin_tiny', pretrained, arch='tiny',
                   **kwargs)


@register_model
def flatten_cswin_small(pretrained: bool = False, **kwargs) -> FLattenCSwinClassifier:
    """FLatten-CSwin-S."""
    return _create(FLattenCSwinClassifier, 'flatten_cswin_small', pretrained, arch='small',
                   **kwargs)


@register_model
def flatten_cswin_base(pretrained: bool = False, **kwargs) -> FLattenCSwinClassifier:
    """FLatten-CSwin-B."""
    return _create(FLattenCSwinClassifier, 'flatten_cswin_base', pretrained, arch='base',
                   **kwargs)


@register_model
def flatten_cswin_base_384(pretrained: bool = False, **kwargs) -> FLattenCSwinClassifier:
    """FLatten-CSwin-B at 384², softmax stripes of 1, 2, 12, 12."""
    return _create(FLattenCSwinClassifier, 'flatten_cswin_base_384', pretrained, arch='base',
                   defaults=dict(pretrain_img_size=384, split_size=(1, 2, 12, 12)), **kwargs)


def _deit(variant: str, arch: str, pretrained: bool, **kwargs) -> FLattenDeiTClassifier:
    # features_only: the last block of each quarter by default (the dense
    # backbone's: blocks 3, 6, 9 and 12 of 12), of the depth asked for
    depth = kwargs.get('depth') or FLattenDeiTClassifier.arch_zoo[arch]['depth']
    kwargs.setdefault('out_indices', quarter_ends(depth))
    return _create(FLattenDeiTClassifier, variant, pretrained, arch=arch, **kwargs)


@register_model
def flatten_deit_tiny(pretrained: bool = False, **kwargs) -> FLattenDeiTClassifier:
    """FLatten-DeiT-T: DeiT-Tiny (192 wide, 3 heads, 12 blocks) with focused
    linear attention."""
    return _deit('flatten_deit_tiny', 'tiny', pretrained, **kwargs)


@register_model
def flatten_deit_small(pretrained: bool = False, **kwargs) -> FLattenDeiTClassifier:
    """FLatten-DeiT-S (384 wide, 6 heads)."""
    return _deit('flatten_deit_small', 'small', pretrained, **kwargs)


@register_model
def flatten_deit_base(pretrained: bool = False, **kwargs) -> FLattenDeiTClassifier:
    """FLatten-DeiT-B (768 wide, 12 heads)."""
    return _deit('flatten_deit_base', 'base', pretrained, **kwargs)
