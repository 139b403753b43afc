"""flatten_mm: FLatten (Focused Linear Attention, ICCV 2023) backbones for
mmdet, mmsegmentation and timm.

Importing the package registers ``FLattenPVT``, ``FLattenPVTv2``,
``FLattenSwin``, ``FLattenCSwin`` and ``FLattenDeiT`` in mmdet's, mmseg's and mmpretrain's ``MODELS`` (whichever are installed) and
the ImageNet classifiers in timm, and lets mmengine load its own checkpoints
under torch >= 2.6 (see :func:`flatten_mm.checkpoint.patch_mmengine_loading`), so ``custom_imports=dict(imports=['flatten_mm'])``
in a config is all an OpenMMLab project needs.
"""
import torch

from .version import __version__, check_torch

check_torch(torch.__version__)  # before the modules that need its APIs

from .checkpoint import load_checkpoint_file, load_pretrained, patch_mmengine_loading
from .engine import (EagerOptimizerStepHook, EmptyDatasetHook, PlainParamGroupsHook,
                     RandomStateHook, patch_empty_dataset_error, setup_distributed)
from .models import (FLattenCSwin, FLattenDeiT, FLattenPVT, FLattenPVTv2, FLattenSwin,
                     FocusedLinearAttention, focusing_map, linear_attention)
from .registry import register_openmmlab, register_timm

register_openmmlab()
register_timm()
patch_mmengine_loading()
patch_empty_dataset_error()

__all__ = ['__version__', 'FocusedLinearAttention', 'focusing_map', 'linear_attention',
           'FLattenPVT', 'FLattenPVTv2', 'FLattenSwin', 'FLattenCSwin', 'FLattenDeiT',
           'load_checkpoint_file',
           'load_pretrained', 'EmptyDatasetHook', 'PlainParamGroupsHook',
           'EagerOptimizerStepHook', 'RandomStateHook', 'setup_distributed']
