"""ImageNet classifiers over the dense backbones, as released by the authors.

Each classifier *is* its dense backbone (a subclass) plus the released head,
so both share every module, and the official parameter names load strictly.
"""
from typing import List, Optional

from torch import Tensor, nn

from ..checkpoint import extract_state_dict, load_checkpoint_file
from .layers import stage_output
from .backbones.flatten_pvt import FLattenPVT, FLattenPVTv2
from .backbones.flatten_swin import FLattenSwin


class ClassifierMixin:
    """Head, pooling and timm's classifier interface."""
    num_features: int
    head: nn.Module

    def _build_head(self, num_classes: int, global_pool: str = 'avg'):
        if global_pool not in ('avg', ''):
            raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = self.embed_dims[-1]
        self.global_pool = global_pool
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None):
        self._build_head(num_classes, self.global_pool if global_pool is None else global_pool)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == 'avg':
            x = x.mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def dense_features(self, x: Tensor) -> List[Tensor]:
        """Stage maps (B, C, H, W) for ``out_indices``, as the dense backbone."""
        return list(self.dense_cls.forward(self, x))

    def load_pretrained(self, path: str) -> None:
        """timm's ``custom_load`` hook: load any released file through the
        safe loader (``pretrained_cfg_overlay=dict(file=..., custom_load=True)``)."""
        self.load_state_dict(extract_state_dict(load_checkpoint_file(path)))

    def feature_info_list(self) -> List[dict]:
        return [dict(num_chs=c, reduction=4 * 2 ** i, module=f'stages.{i}')
                for i, c in enumerate(self.embed_dims)]


class FLattenPVTClassifier(ClassifierMixin, FLattenPVT):
    """FLatten-PVT classifier. Like the release it defines a final ``norm``
    that its forward never applies (so released checkpoints load strictly)."""
    dense_cls = FLattenPVT

    def __init__(self, arch: str = 'tiny', num_classes: int = 1000, global_pool: str = 'avg',
                 in_chans: int = 3, **kwargs):
        super().__init__(arch=arch, in_channels=in_chans, **kwargs)
        self.norm = nn.LayerNorm(self.embed_dims[-1], eps=1e-6)
        self._build_head(num_classes, global_pool)
        self.default_init()

    def forward_features(self, x: Tensor) -> Tensor:
        for i in range(self.num_stages):
            tokens, hw_shape = self.forward_stage(i, x)
            x = stage_output(tokens, hw_shape)
        return tokens


class FLattenPVTv2Classifier(FLattenPVTClassifier):
    """FLatten-PVTv2 classifier (the stage norms are part of the body)."""
    dense_cls = FLattenPVTv2
    version = 2
    arch_zoo = FLattenPVTv2.arch_zoo

    def __init__(self, arch: str = 'b0', num_classes: int = 1000, global_pool: str = 'avg',
                 in_chans: int = 3, **kwargs):
        FLattenPVT.__init__(self, arch=arch, in_channels=in_chans, **kwargs)
        self._build_head(num_classes, global_pool)
        self.default_init()


class FLattenSwinClassifier(ClassifierMixin, FLattenSwin):
    """FLatten-Swin classifier: final LayerNorm, average pooling, head."""
    dense_cls = FLattenSwin

    def __init__(self, arch: str = 'tiny', num_classes: int = 1000, global_pool: str = 'avg',
                 in_chans: int = 3, **kwargs):
        super().__init__(arch=arch, in_channels=in_chans, **kwargs)
        self.norm = nn.LayerNorm(self.embed_dims[-1])
        self._build_head(num_classes, global_pool)
        self.default_init()

    def _add_output_norms(self, out_indices):
        pass  # the classifier's stage outputs are not normalised (timm features too)

    def forward_features(self, x: Tensor) -> Tensor:
        for i, tokens, _ in self.forward_stages(x):
            pass
        return self.norm(tokens)


class FLattenFeatures(nn.Module):
    """timm ``features_only`` wrapper: the classifier's body returning stage
    maps; its head is removed."""

    def __init__(self, model: nn.Module, out_indices=(0, 1, 2, 3), **kwargs):
        super().__init__()
        from timm.models import FeatureInfo
        model.reset_classifier(0)
        if hasattr(model, 'norm') and isinstance(model, FLattenPVTClassifier):
            del model.norm
        model._setup_common(out_indices, model.frozen_stages, model.norm_eval, model.with_cp)
        self.model = model
        self.feature_info = FeatureInfo(model.feature_info_list(), tuple(out_indices))

    def forward(self, x: Tensor) -> List[Tensor]:
        return self.model.dense_features(x)
