"""ImageNet classifiers over the dense backbones, as released by the authors,
with timm's model interface.

Each classifier *is* its dense backbone (a subclass) plus the released head,
so both share every module, and the official parameter names load strictly.
"""
from typing import List, Optional, Set, Tuple, Union

from torch import Tensor, nn

from ..checkpoint import load_checkpoint_file
from ..conversion import classifier_state_dict, other_class_count, unfit, without_head
from .ops.local import grid_rows
from .utils import HWShape
from .layers import check_images, stage_output
from .backbones.flatten_cswin import FLattenCSwin
from .backbones.flatten_deit import FLattenDeiT
from .backbones.flatten_pvt import FLattenPVT, FLattenPVTv2
from .backbones.flatten_swin import FLattenSwin

# parameters that take no weight decay (timm's optimizer factory reads
# ``no_weight_decay()``): positional terms and the focusing scale
NO_WEIGHT_DECAY = ('positional_encoding', 'scale', 'relative_position_bias_table')


def take_indices(num_stages: int, indices: Optional[Union[int, List[int]]]) -> List[int]:
    """timm's convention: None -> every stage, an int n -> the last n stages,
    a list -> those stages (negative ones counted from the end)."""
    if indices is None:
        return list(range(num_stages))
    if isinstance(indices, int):
        if not 0 < indices <= num_stages:
            raise ValueError(f'indices must take 1..{num_stages} stages, got {indices}')
        return list(range(num_stages - indices, num_stages))
    taken = [i + num_stages if i < 0 else i for i in indices]
    if not taken or any(not 0 <= i < num_stages for i in taken):
        raise ValueError(f'indices must be stage indices in -{num_stages}..{num_stages - 1}, '
                         f'got {list(indices)}')
    return taken


class ClassifierMixin:
    """Head, pooling and timm's classifier interface over the backbone's
    ``forward_stages`` (each stage's tokens) and ``final_features`` (the
    unpooled features of the last stage, in ``output_fmt``)."""
    num_features: int
    head: nn.Module
    output_fmt: str = 'NCHW'
    # the dense backbone's name for the final norm (None: the body has it, or none)
    dense_final_norm: Optional[str] = None
    # backbone arguments the classifier sets (in_channels from timm's in_chans)
    fixed_init_args: Tuple[str, ...] = ('in_channels',)

    def _build_head(self, num_classes: int, global_pool: str = 'avg'):
        self.check_global_pool(global_pool)
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = self.embed_dims[-1]
        self.global_pool = global_pool
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self.feature_info = [dict(num_chs=c, reduction=self.stage_reduction(stage),
                                  module=stage.output_name)
                             for stage, c in zip(self.stages, self.embed_dims)]

    def check_global_pool(self, global_pool: str) -> None:
        if global_pool not in ('avg', ''):
            raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")

    def stage_reduction(self, stage) -> int:
        """The stride of a stage's output (feature_info): 4, 8, 16, 32."""
        return 4 * 2 ** stage.index

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None):
        self._build_head(num_classes, self.global_pool if global_pool is None else global_pool)

    def set_grad_checkpointing(self, enable: bool = True):
        self.with_cp = enable

    def no_weight_decay(self) -> Set[str]:
        return {n for n, _ in self.named_parameters()
                if n.rsplit('.', 1)[-1] in NO_WEIGHT_DECAY or n.startswith('pos_embed')}

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        spatial = (2, 3) if self.output_fmt == 'NCHW' else (1, 2)
        if self.global_pool == 'avg':
            x = x.mean(spatial)
        elif self.output_fmt == 'NCHW' and not pre_logits and self.num_classes:
            x = x.permute(0, 2, 3, 1)  # per-position logits need channels last
        return x if pre_logits else self.head(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """Unpooled features of the last stage, in ``output_fmt``."""
        for _, tokens, hw_shape in self.forward_stages(check_images(x)):
            pass
        return self.final_features(tokens, hw_shape)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def forward_intermediates(self, x: Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False,
                              output_fmt: str = 'NCHW', intermediates_only: bool = False
                              ) -> Union[List[Tensor], Tuple[Tensor, List[Tensor]]]:
        """timm's intermediate-feature API: NCHW maps of the stages in
        ``indices`` (see :func:`take_indices`), and unless
        ``intermediates_only`` the final features as :meth:`forward_features`
        gives them (``stop_early``: those of the last stage taken).
        ``norm`` applies the final norm to the last stage's map, if the model
        has one."""
        if output_fmt != 'NCHW':
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        taken = take_indices(self.num_stages, indices)
        last = max(taken) if stop_early or intermediates_only else self.num_stages - 1
        intermediates = []
        for i, tokens, hw_shape in self.forward_stages(check_images(x), last):
            if i in taken:
                intermediates.append(self.intermediate_map(
                    tokens, hw_shape, norm and i == self.num_stages - 1))
        if intermediates_only:
            return intermediates
        # the final norm belongs to the last stage: not applied when stopped early
        return self.final_features(tokens, hw_shape, last == self.num_stages - 1), intermediates

    def intermediate_map(self, tokens: Tensor, hw_shape: HWShape, norm: bool) -> Tensor:
        """A stage's tokens as :meth:`forward_intermediates` returns them: an
        NCHW map of its grid's tokens (after the final norm with ``norm``)."""
        tokens = self.norm(tokens) if norm else tokens
        return stage_output(grid_rows(tokens, hw_shape), hw_shape)

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1,
                                  prune_norm: bool = False, prune_head: bool = True) -> List[int]:
        """Drop the stages after the last of ``indices`` (and the final norm
        with ``prune_norm``, the head with ``prune_head``), so no parameter
        is left that forward does not use. Returns the stage indices."""
        taken = take_indices(self.num_stages, indices)
        self.prune_stages(max(taken) + 1)
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, '')
        else:
            self.feature_info = self.feature_info[:self.num_stages]
        return taken

    def load_pretrained(self, path: str) -> None:
        """timm's ``custom_load`` hook: load any released file (or an
        mmpretrain checkpoint) through the safe loader
        (``pretrained_cfg_overlay=dict(file=..., custom_load=True)``), adapted
        as timm's own loader adapts weights, which this hook replaces: the
        first conv to ``in_chans`` (by timm's rule, as every load fits it:
        :func:`~flatten_mm.conversion.fit_input_conv`) and, for another class
        count, the head left as initialised. Anything else that does not fit
        raises, as a strict load."""
        sd = classifier_state_dict(load_checkpoint_file(path), self)
        head_left = other_class_count(sd, self)  # then the head keeps its initialisation
        sd = without_head(sd) if head_left else sd
        missing, unexpected = self.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not (head_left and k.startswith('head.'))]
        if missing or unexpected:
            raise unfit(path, self, missing, unexpected)


class PyramidClassifierMixin(ClassifierMixin):
    """The classifiers of FLatten-PVT and -PVTv2: the pyramid, average
    pooling, head (the PVTv2 stage norms are part of the body)."""
    norm = nn.Identity()  # forward_intermediates(norm=True) has no norm to apply

    def __init__(self, arch: str, num_classes: int = 1000, global_pool: str = 'avg',
                 in_chans: int = 3, **kwargs):
        super().__init__(arch=arch, in_channels=in_chans, **kwargs)
        self._build_head(num_classes, global_pool)
        self.default_init()

    def final_features(self, tokens: Tensor, hw_shape: HWShape, norm: bool = True) -> Tensor:
        return stage_output(tokens, hw_shape)


class FLattenPVTClassifier(PyramidClassifierMixin, FLattenPVT):
    """FLatten-PVT classifier (see :class:`PyramidClassifierMixin`).

    The release also defines a final ``norm`` that its forward never applies;
    it is left out here (a parameter without gradient breaks DDP without
    ``find_unused_parameters``), and dropped from released checkpoints on load.
    """
    unused_official = ('norm.weight', 'norm.bias')

    def __init__(self, arch: str = 'tiny', **kwargs):
        super().__init__(arch=arch, **kwargs)

    def convert_official(self, state_dict: dict) -> dict:
        return {k: v for k, v in super().convert_official(state_dict).items()
                if k not in self.unused_official}


class FLattenPVTv2Classifier(PyramidClassifierMixin, FLattenPVTv2):
    """FLatten-PVTv2 classifier (see :class:`PyramidClassifierMixin`)."""

    def __init__(self, arch: str = 'b0', **kwargs):
        super().__init__(arch=arch, **kwargs)


class SwinLikeClassifierMixin(ClassifierMixin):
    """The classifiers of the Swin-like backbones: a final LayerNorm (the
    dense backbone's last output norm, ``norm3``), average pooling, head.
    Features are channels-last (NHWC), as timm's Swin gives them; the stage
    outputs (features_only, forward_intermediates) are not normalised."""
    output_fmt = 'NHWC'
    dense_final_norm = 'norm3'

    def __init__(self, arch: str = 'tiny', num_classes: int = 1000, global_pool: str = 'avg',
                 in_chans: int = 3, **kwargs):
        super().__init__(arch=arch, in_channels=in_chans, **kwargs)
        self.norm = nn.LayerNorm(self.embed_dims[-1])
        self._build_head(num_classes, global_pool)
        self.default_init()

    def _add_output_norms(self, out_indices):
        pass  # one final norm instead

    def final_features(self, tokens: Tensor, hw_shape: HWShape, norm: bool = True) -> Tensor:
        if norm:
            tokens = self.norm(tokens)
        return tokens.view(tokens.shape[0], hw_shape[0], hw_shape[1], -1)


class FLattenSwinClassifier(SwinLikeClassifierMixin, FLattenSwin):
    """FLatten-Swin classifier (see :class:`SwinLikeClassifierMixin`)."""


class FLattenCSwinClassifier(SwinLikeClassifierMixin, FLattenCSwin):
    """FLatten-CSwin classifier (see :class:`SwinLikeClassifierMixin`)."""


class FLattenDeiTClassifier(ClassifierMixin, FLattenDeiT):
    """FLatten-DeiT classifier, as DeiT (no distillation token): the blocks,
    the final LayerNorm (``norm``, the dense backbone's with
    ``final_norm=True``), the class token's features (``global_pool='token'``;
    or the patch tokens' mean, ``'avg'``), the linear head.

    Features (``forward_features``) are the normalised tokens (B, 1 + H*W, C),
    class token first, as timm's ViT gives them; ``forward_intermediates`` and
    features_only give NCHW maps of the patch tokens of blocks (stride 16).
    """
    output_fmt = 'NLC'
    dense_final_norm = 'norm'
    fixed_init_args = ('in_channels', 'final_norm')

    def __init__(self, arch: str = 'tiny', num_classes: int = 1000, global_pool: str = 'token',
                 in_chans: int = 3, **kwargs):
        super().__init__(arch=arch, in_channels=in_chans, final_norm=True, **kwargs)
        self._build_head(num_classes, global_pool)
        self.default_init()

    def check_global_pool(self, global_pool: str) -> None:
        pools = ('token', 'avg', '') if self.with_cls_token else ('avg', '')
        if global_pool not in pools:
            raise ValueError(f'global_pool must be one of {pools}, got {global_pool!r}')

    def stage_reduction(self, stage) -> int:
        return self.patch_size  # every block's tokens are on the patch grid

    def no_weight_decay(self) -> Set[str]:
        return super().no_weight_decay() | ({'cls_token'} if self.with_cls_token else set())

    def final_features(self, tokens: Tensor, hw_shape: HWShape, norm: bool = True) -> Tensor:
        return self.norm(tokens) if norm else tokens

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == 'token':
            x = x[:, 0]
        elif self.global_pool == 'avg':
            x = x[:, self.num_prefix_tokens:].mean(1)
        return x if pre_logits else self.head(x)
