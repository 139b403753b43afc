"""Puts the FLatten backbones into the registries of whatever is installed:
mmdet's, mmseg's and mmpretrain's ``MODELS`` (as ``FLattenPVT``,
``FLattenPVTv2``, ``FLattenSwin``, ``FLattenCSwin``) and timm's model registry (the ImageNet classifiers).

Each library is optional: an environment with only mmseg, only timm, or none
of them (a bare torch + mmengine machine) imports flatten_mm all the same.
"""
import importlib
from functools import partial
from typing import List

from .models.backbones import FLattenCSwin, FLattenPVT, FLattenPVTv2, FLattenSwin

BACKBONES = (FLattenPVT, FLattenPVTv2, FLattenSwin, FLattenCSwin)
OPENMMLAB_SCOPES = ('mmdet', 'mmseg', 'mmpretrain')

# timm model name -> (classifier kind, arch, extra kwargs)
TIMM_MODELS = {
    **{f'flatten_pvt_{a}': ('pvt', a, {}) for a in ('tiny', 'small', 'medium', 'large')},
    **{f'flatten_pvt_v2_{a}': ('pvtv2', a, {}) for a in ('b0', 'b1', 'b2', 'b3', 'b4', 'b5')},
    **{f'flatten_swin_{a}': ('swin', a, {}) for a in ('tiny', 'small', 'base')},
    'flatten_swin_base_384': ('swin', 'base', dict(pretrain_img_size=384, window_size=12)),
    **{f'flatten_cswin_{a}': ('cswin', a, {}) for a in ('tiny', 'small', 'base')},
    'flatten_cswin_base_384': ('cswin', 'base', dict(pretrain_img_size=384,
                                                     split_size=(1, 2, 12, 12))),
}
FIRST_CONV = {'pvt': 'patch_embed1.proj', 'pvtv2': 'patch_embed1.proj',
              'swin': 'patch_embed.proj', 'cswin': 'stage1_conv_embed.0'}
# the models the authors released ImageNet-1K weights for
RELEASED = ('flatten_pvt_tiny', 'flatten_pvt_v2_b0', 'flatten_swin_tiny',
            'flatten_swin_small', 'flatten_swin_base', 'flatten_swin_base_384',
            'flatten_cswin_tiny')


def register_openmmlab() -> List[str]:
    """Register the backbones in mmdet / mmseg / mmpretrain ``MODELS``;
    returns the scopes done."""
    done = []
    for scope in OPENMMLAB_SCOPES:
        try:
            registry = importlib.import_module(f'{scope}.registry').MODELS
        except ImportError:
            continue
        for cls in BACKBONES:
            registry.register_module(module=cls, force=True)
        done.append(scope)
    return done


def _create_timm_model(variant: str, pretrained: bool = False, **kwargs):
    from timm.models import build_model_with_cfg

    from .models.classifiers import (FLattenCSwinClassifier, FLattenPVTClassifier,
                                     FLattenPVTv2Classifier, FLattenSwinClassifier)
    kind, arch, extra = TIMM_MODELS[variant]
    cls = {'pvt': FLattenPVTClassifier, 'pvtv2': FLattenPVTv2Classifier,
           'swin': FLattenSwinClassifier, 'cswin': FLattenCSwinClassifier}[kind]
    kwargs = {**extra, **kwargs}
    return build_model_with_cfg(
        cls, variant, pretrained, arch=arch,
        pretrained_filter_fn=checkpoint_filter_fn,
        # features_only: timm's getter over forward_intermediates, after
        # prune_intermediate_layers has dropped what the features do not use
        feature_cfg=dict(feature_cls='getter', out_indices=(0, 1, 2, 3)),
        **kwargs)


def checkpoint_filter_fn(state_dict: dict, model) -> dict:
    """timm's filter for official weights: take ``state_dict['model']`` if
    nested, drop what the model leaves out of the release (FLatten-PVT's
    unused final norm) and the head when the class count differs. Official
    names are ours, and the fused Swin ``qkv`` is split when the model loads it.
    An mmpretrain classifier's checkpoint (``backbone.*``, ``head.fc.*``) is
    renamed to ours."""
    from .checkpoint import extract_state_dict, unwrap_state_dict
    from .models.classifiers import from_mmpretrain, is_mmpretrain_classifier
    nested = unwrap_state_dict(state_dict)
    if is_mmpretrain_classifier(nested):
        state_dict = from_mmpretrain(nested, model)
    sd = extract_state_dict(state_dict)
    for key in getattr(model, 'unused_official', ()):
        sd.pop(key, None)
    head = sd.get('head.weight')
    if head is not None and head.shape[0] != getattr(model, 'num_classes', head.shape[0]):
        sd = {k: v for k, v in sd.items() if not k.startswith('head.')}
    return sd


def register_timm() -> bool:
    """Register the classifiers in timm; False when timm is not installed."""
    try:
        from timm.models import generate_default_cfgs, register_model
    except ImportError:
        return False
    from timm.models._registry import _model_entrypoints
    cfgs = {}
    for name in TIMM_MODELS:
        size = 384 if name.endswith('_384') else 224
        cfgs[f'{name}.in1k' if name in RELEASED else name] = dict(
            url='', num_classes=1000, input_size=(3, size, size),
            pool_size=(size // 32, size // 32), fixed_input_size=False,
            crop_pct=1.0 if size == 384 else 0.9, interpolation='bicubic',
            mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
            first_conv=FIRST_CONV[TIMM_MODELS[name][0]],
            classifier='head', license='mit')
    globals()['default_cfgs'] = generate_default_cfgs(cfgs)  # read by register_model
    register_fx_leaves()
    for name in TIMM_MODELS:
        if name in _model_entrypoints:
            continue
        fn = partial(_create_timm_model, name)
        fn.__name__ = name
        fn.__module__ = __name__
        fn.__doc__ = f'{name}: FLatten ImageNet classifier (flatten_mm).'
        globals()[name] = fn
        register_model(fn)
    return True


def register_fx_leaves() -> None:
    """Tell timm's torch.fx tracer (``create_feature_extractor``,
    ``features_only=True, feature_cls='fx'``) which parts to keep whole: those
    whose control flow depends on the input size (padding to a multiple of a
    stride, window partitions, positional-encoding resizes, the attention
    core's hand-written autograd). Everything between them is traced."""
    from timm.layers import register_notrace_function, register_notrace_module

    from .models.attention import FocusedLinearAttention
    from .models.resize import add_resized, resize_parts, resize_weights
    from .models.backbones.flatten_cswin import ConvStem, CSwinBlock
    from .models.backbones.flatten_pvt import PatchEmbed
    from .models.backbones.flatten_swin import PatchMerging, SwinBlock
    from .models.layers import SpatialReductionAttention, check_images
    for module in (PatchEmbed, FocusedLinearAttention, SpatialReductionAttention,
                   SwinBlock, PatchMerging, ConvStem, CSwinBlock):
        register_notrace_module(module)
    for function in (resize_parts, resize_weights, add_resized, check_images):
        register_notrace_function(function)
