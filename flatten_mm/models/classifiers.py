"""ImageNet classifiers over the dense backbones, as released by the authors,
with timm's model interface.

Each classifier *is* its dense backbone (a subclass) plus the released head,
so both share every module, and the official parameter names load strictly.
"""
from typing import Dict, Iterator, List, Optional, Set, Tuple, Union

from torch import Tensor, nn

from ..checkpoint import load_checkpoint_file
from .utils import HWShape
from .layers import check_images, stage_output
from .backbones.flatten_cswin import FLattenCSwin
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


def to_mmpretrain(model: nn.Module) -> Dict[str, Tensor]:
    """The state dict of the mmpretrain ``ImageClassifier`` equal to the
    timm classifier ``model``: its dense backbone with ``out_indices=(3,)``
    (``backbone.*``, the final norm as that backbone's output norm), a GAP
    neck and a ``LinearClsHead`` (``head.fc.*``)."""
    final = getattr(model, 'dense_final_norm', None)
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith('head.'):
            out['head.fc.' + key[len('head.'):]] = value
        elif final and key.startswith('norm.'):
            out[f'backbone.{final}.' + key[len('norm.'):]] = value
        else:
            out['backbone.' + key] = value
    return out


def is_mmpretrain_classifier(state_dict: dict) -> bool:
    return 'head.fc.weight' in state_dict and any(k.startswith('backbone.') for k in state_dict)


def from_mmpretrain(state_dict: Dict[str, Tensor], model: nn.Module) -> Dict[str, Tensor]:
    """An mmpretrain ``ImageClassifier`` state dict (see :func:`to_mmpretrain`)
    in the names of the timm classifier ``model``."""
    final = getattr(model, 'dense_final_norm', None)
    out = {}
    for key, value in state_dict.items():
        if key.startswith('head.fc.'):
            out['head.' + key[len('head.fc.'):]] = value
        elif final and key.startswith(f'backbone.{final}.'):
            out['norm.' + key[len(f'backbone.{final}.'):]] = value
        elif key.startswith('backbone.'):
            out[key[len('backbone.'):]] = value
    return out


class ClassifierMixin:
    """Head, pooling and timm's classifier interface over ``stage_tokens``
    (each stage's tokens) and ``final_features`` (the unpooled features of
    the last stage, in ``output_fmt``)."""
    num_features: int
    head: nn.Module
    output_fmt: str = 'NCHW'
    # the dense backbone's name for the final norm (None: the body has it, or none)
    dense_final_norm: Optional[str] = None

    def _build_head(self, num_classes: int, global_pool: str = 'avg'):
        if global_pool not in ('avg', ''):
            raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = self.embed_dims[-1]
        self.global_pool = global_pool
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self.feature_info = [dict(num_chs=c, reduction=4 * 2 ** i, module=self.stage_name(i))
                             for i, c in enumerate(self.embed_dims)]

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
        x = check_images(x)
        for _, tokens, hw_shape in self.stage_tokens(x, self.num_stages - 1):
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
        x = check_images(x)
        last = max(taken) if stop_early or intermediates_only else self.num_stages - 1
        intermediates = []
        for i, tokens, hw_shape in self.stage_tokens(x, last):
            if i in taken:
                final_norm = norm and i == self.num_stages - 1
                intermediates.append(stage_output(self.norm(tokens) if final_norm else tokens,
                                                  hw_shape))
        if intermediates_only:
            return intermediates
        # the final norm belongs to the last stage: not applied when stopped early
        return self.final_features(tokens, hw_shape, last == self.num_stages - 1), intermediates

    def prune_intermediate_layers(self, indices: Union[int, List[int]] = 1,
                                  prune_norm: bool = False, prune_head: bool = True) -> List[int]:
        """Drop the stages after the last of ``indices`` (and the final norm
        with ``prune_norm``, the head with ``prune_head``), so no parameter
        is left that forward does not use. Returns the stage indices."""
        taken = take_indices(self.num_stages, indices)
        self.drop_stages_after(max(taken))
        self.embed_dims = self.embed_dims[:max(taken) + 1]
        self.num_stages = max(taken) + 1
        self.out_indices = tuple(i for i in self.out_indices if i < self.num_stages)
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
        (``pretrained_cfg_overlay=dict(file=..., custom_load=True)``)."""
        from ..registry import checkpoint_filter_fn
        self.load_state_dict(checkpoint_filter_fn(load_checkpoint_file(path), self))


class FLattenPVTClassifier(ClassifierMixin, FLattenPVT):
    """FLatten-PVT classifier: the pyramid, average pooling, head.

    The release also defines a final ``norm`` that its forward never applies;
    it is left out here (a parameter without gradient breaks DDP without
    ``find_unused_parameters``), and dropped from released checkpoints on load.
    """
    norm = nn.Identity()  # forward_intermediates(norm=True) has no norm to apply
    unused_official = ('norm.weight', 'norm.bias')

    def __init__(self, arch: str = 'tiny', num_classes: int = 1000, global_pool: str = 'avg',
                 in_chans: int = 3, **kwargs):
        super().__init__(arch=arch, in_channels=in_chans, **kwargs)
        self._build_head(num_classes, global_pool)
        self.default_init()
        self._register_load_state_dict_pre_hook(self._drop_unused_official)

    def _drop_unused_official(self, state_dict, prefix, *args, **kwargs):
        for key in self.unused_official:
            state_dict.pop(prefix + key, None)

    @staticmethod
    def stage_name(i: int) -> str:
        return f'block{i + 1}'

    def stage_tokens(self, x: Tensor, last: int) -> Iterator[Tuple[int, Tensor, HWShape]]:
        """Yield (stage index, tokens (B, N, C), grid) for stages 0..last."""
        for i in range(last + 1):
            tokens, hw_shape = self.forward_stage(i, x)
            yield i, tokens, hw_shape
            x = stage_output(tokens, hw_shape)

    def final_features(self, tokens: Tensor, hw_shape: HWShape, norm: bool = True) -> Tensor:
        return stage_output(tokens, hw_shape)

    def drop_stages_after(self, last: int):
        for i in range(last + 2, self.num_stages + 1):
            for name in (f'patch_embed{i}', f'pos_embed{i}', f'block{i}', f'norm{i}'):
                if hasattr(self, name):
                    delattr(self, name)


class FLattenPVTv2Classifier(FLattenPVTClassifier):
    """FLatten-PVTv2 classifier (the stage norms are part of the body)."""
    version = 2
    arch_zoo = FLattenPVTv2.arch_zoo
    unused_official = ()

    def __init__(self, arch: str = 'b0', **kwargs):
        super().__init__(arch=arch, **kwargs)

    @staticmethod
    def stage_name(i: int) -> str:
        return f'norm{i + 1}'  # the stage's output is after its norm


class FinalNormClassifierMixin(ClassifierMixin):
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

    def stage_tokens(self, x: Tensor, last: int) -> Iterator[Tuple[int, Tensor, HWShape]]:
        """Yield (stage index, tokens (B, N, C), grid) for stages 0..last."""
        for i, tokens, hw_shape in self.forward_stages(x):
            yield i, tokens, hw_shape
            if i == last:
                return

    def final_features(self, tokens: Tensor, hw_shape: HWShape, norm: bool = True) -> Tensor:
        if norm:
            tokens = self.norm(tokens)
        return tokens.view(tokens.shape[0], hw_shape[0], hw_shape[1], -1)


class FLattenSwinClassifier(FinalNormClassifierMixin, FLattenSwin):
    """FLatten-Swin classifier (see :class:`FinalNormClassifierMixin`)."""

    @staticmethod
    def stage_name(i: int) -> str:
        return f'layers.{i}'

    def drop_stages_after(self, last: int):
        self.layers = self.layers[:last + 1]
        self.layers[last].downsample = None


class FLattenCSwinClassifier(FinalNormClassifierMixin, FLattenCSwin):
    """FLatten-CSwin classifier (see :class:`FinalNormClassifierMixin`)."""

    @staticmethod
    def stage_name(i: int) -> str:
        return f'stage{i + 1}'

    def drop_stages_after(self, last: int):
        for i in range(last + 1, self.num_stages):
            delattr(self, f'stage{i + 1}')
            delattr(self, f'merge{i}')
