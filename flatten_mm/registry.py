"""Puts the FLatten backbones into the registries of whatever is installed:
mmdet's, mmseg's and mmpretrain's ``MODELS`` (as ``FLattenPVT``,
``FLattenPVTv2``, ``FLattenSwin``, ``FLattenCSwin``, ``FLattenDeiT``) and timm's model registry (the ImageNet classifiers).

Each library is optional: an environment with only mmseg, only timm, or none
of them (a bare torch + mmengine machine) imports flatten_mm all the same.
"""
import importlib
import importlib.util
from typing import List

from .models.backbones import FLattenCSwin, FLattenDeiT, FLattenPVT, FLattenPVTv2, FLattenSwin

BACKBONES = (FLattenPVT, FLattenPVTv2, FLattenSwin, FLattenCSwin, FLattenDeiT)
OPENMMLAB_SCOPES = ('mmdet', 'mmseg', 'mmpretrain')

# timm model name -> (classifier kind, arch, extra kwargs): what tools need to
# build the dense backbone of a timm name without timm; the timm models
# themselves are the @register_model functions of flatten_mm/timm_models.py
TIMM_MODELS = {
    'flatten_pvt_tiny': ('pvt', 'tiny', {}),
    'flatten_pvt_small': ('pvt', 'small', {}),
    'flatten_pvt_medium': ('pvt', 'medium', {}),
    'flatten_pvt_large': ('pvt', 'large', {}),
    'flatten_pvt_v2_b0': ('pvtv2', 'b0', {}),
    'flatten_pvt_v2_b1': ('pvtv2', 'b1', {}),
    'flatten_pvt_v2_b2': ('pvtv2', 'b2', {}),
    'flatten_pvt_v2_b3': ('pvtv2', 'b3', {}),
    'flatten_pvt_v2_b4': ('pvtv2', 'b4', {}),
    'flatten_pvt_v2_b5': ('pvtv2', 'b5', {}),
    'flatten_swin_tiny': ('swin', 'tiny', {}),
    'flatten_swin_small': ('swin', 'small', {}),
    'flatten_swin_base': ('swin', 'base', {}),
    'flatten_swin_base_384': ('swin', 'base', dict(pretrain_img_size=384, window_size=12)),
    'flatten_cswin_tiny': ('cswin', 'tiny', {}),
    'flatten_cswin_small': ('cswin', 'small', {}),
    'flatten_cswin_base': ('cswin', 'base', {}),
    'flatten_cswin_base_384': ('cswin', 'base', dict(pretrain_img_size=384,
                                                     split_size=(1, 2, 12, 12))),
    'flatten_deit_tiny': ('deit', 'tiny', {}),
    'flatten_deit_small': ('deit', 'small', {}),
    'flatten_deit_base': ('deit', 'base', {}),
}


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


def register_timm() -> bool:
    """Register the classifiers in timm (importing
    :mod:`flatten_mm.timm_models` does); False when timm is not installed or
    cannot take them."""
    if importlib.util.find_spec('timm') is None:
        return False
    try:
        from . import timm_models  # noqa: F401  (its @register_model functions register them)
    except ImportError:  # a timm too old for these models (or broken): no timm names
        return False
    register_fx_leaves()
    return True


def register_fx_leaves() -> None:
    """Tell timm's torch.fx tracer (``timm.layers.create_feature_extractor``)
    which parts to keep whole: those whose control flow depends on the input
    size or dtype (padding to a multiple of a stride, window partitions,
    positional-encoding resizes, the attention core's hand-written autograd,
    drop path's residual add). Everything between them is traced."""
    from timm.layers import register_notrace_function, register_notrace_module

    from .models.attention import FocusedLinearAttention
    from .models.resize import add_resized, cached_resize_parts, resize_parts, resize_weights
    from .models.backbones.flatten_cswin import ConvStem, CSwinBlock
    from .models.backbones.flatten_deit import ViTPatchEmbed
    from .models.backbones.flatten_swin import PatchMerging, SwinBlock
    from .models.layers import DropPath, PatchEmbed, SpatialReductionAttention, check_images
    for module in (PatchEmbed, FocusedLinearAttention, SpatialReductionAttention, DropPath,
                   SwinBlock, PatchMerging, ConvStem, CSwinBlock, ViTPatchEmbed):
        register_notrace_module(module)
    for function in (cached_resize_parts, resize_parts, resize_weights, add_resized,
                     check_images):
        register_notrace_function(function)
