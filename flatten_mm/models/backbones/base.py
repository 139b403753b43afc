"""What every FLatten backbone shares: stages run as modules, weight
conversion on load, pretrained loading, stage freezing, norm_eval, gradient
checkpointing and the default initialisation."""
import contextlib
import math
from typing import ContextManager, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.utils.checkpoint as cp
from mmengine.model import BaseModule
from torch import Tensor, nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.modules.batchnorm import _BatchNorm

from ...checkpoint import load_pretrained
from ...conversion import convert_on_load
from ..utils import HWShape, _under_tensor_mode, check_positive_int
from ..layers import check_images, stage_output
from ..ops import get_backend, use_backend
from .checks import check_backbone_args, check_init_cfg, check_out_indices, check_stages

StageOutput = Tuple[Tensor, Optional[HWShape]]


class Stage(nn.Module):
    """One stage of a backbone: ``stage(backbone, x, hw_shape)`` takes the
    previous stage's tokens (B, N, C) on ``hw_shape`` (for the first stage,
    what the backbone's :meth:`~FLattenBackbone.stem` gives) and returns this
    stage's tokens and grid. Subclasses define :meth:`forward`.

    The parts of a stage (patch embedding, blocks, norms) stay registered on
    the backbone under the release's names, so that parameter names and
    state-dict keys are the release's: a stage holds none of them. It names
    them (``part_names``, attribute paths on the backbone: what freezing the
    stage freezes and pruning it deletes) and takes them from the backbone it
    is called with, so a part the backbone has replaced (wrapped, pruned) is
    the one that runs. ``entry_names`` are parts recorded under the previous
    stage that only this stage runs (Swin's patch merging), and
    ``output_name`` is the module whose output is the stage's (timm's
    ``feature_info``).
    """

    def __init__(self, index: int, part_names: Sequence[str], output_name: str,
                 entry_names: Sequence[str] = ()):
        super().__init__()
        self.index = index
        self.part_names = tuple(part_names)
        self.entry_names = tuple(entry_names)
        self.output_name = output_name

    def extra_repr(self) -> str:
        return f'{self.index}: ' + ', '.join(self.entry_names + self.part_names)

    def parts(self, backbone: nn.Module) -> list:
        """This stage's modules and parameters that ``backbone`` still holds."""
        found = (find_part(backbone, name) for name in self.part_names)
        return [part for part in found if part is not None]

    @staticmethod
    def run_blocks(backbone: 'FLattenBackbone', blocks, x: Tensor, hw_shape: HWShape) -> Tensor:
        """``blocks`` one after the other (through the backbone's
        gradient checkpointing when it is on)."""
        for block in blocks:
            x = backbone.run_block(block, x, hw_shape)
        return x


def find_part(module: nn.Module, name: str):
    """The module or parameter at attribute path ``name`` (``'layers.0.downsample'``)
    of ``module``; None when there is none."""
    for attr in name.split('.'):
        module = getattr(module, attr, None)
        if module is None:
            return None
    return module


def delete_part(module: nn.Module, name: str) -> None:
    """Delete the module or parameter at attribute path ``name``, if any."""
    parent, _, last = name.rpartition('.')
    owner = find_part(module, parent) if parent else module
    if owner is not None and hasattr(owner, last):
        delattr(owner, last)


def same_backend() -> Tuple[ContextManager, ContextManager]:
    """Gradient checkpointing's contexts of a block: none for its forward, and
    for its recomputation (at each backward) the attention backend override in
    force at the forward, which may have ended since (``use_backend`` around a
    forward, the backward after): on another backend the recomputed ops save
    other tensors and torch raises ``CheckpointError``."""
    return contextlib.nullcontext(), use_backend(get_backend())


class FLattenBackbone(BaseModule):
    """Base class of the dense backbones.

    A subclass builds its parts under the release's names and ``self.stages``
    (a ModuleList of :class:`Stage`), then calls
    :meth:`_setup_outputs_and_freezing`; it defines :meth:`stem` when
    something runs before the first stage, :meth:`convert_official` (its
    family's renaming in :mod:`flatten_mm.conversion`), and the key patterns
    the official classifier has and the backbone does not
    (``ignore_unexpected``) or the backbone has and the classifier does not
    (``ignore_missing``), and the name of its conv on the images
    (``first_conv``, whose weights a load fits to ``in_channels``).
    """
    ignore_unexpected: Sequence[str] = (r'head\.',)
    first_conv: str = 'patch_embed.proj'
    # tokens before the grid's in every stage (FLatten-DeiT's class token)
    num_prefix_tokens: int = 0
    ignore_missing: Sequence[str] = ()

    arch_zoo: dict = {}
    stages: nn.ModuleList

    def __init__(self, init_cfg: Optional[dict] = None):
        super().__init__(init_cfg=init_cfg)
        # whatever is loaded into the model goes through convert_official first
        self.register_load_state_dict_pre_hook(convert_on_load)

    def arch_settings(self, arch: str, **overrides) -> dict:
        """The preset of ``arch`` with the non-None ``overrides`` applied."""
        if arch not in self.arch_zoo:
            raise ValueError(f'arch must be one of {sorted(self.arch_zoo)}, got {arch!r}')
        settings = dict(self.arch_zoo[arch])
        settings.update({k: v for k, v in overrides.items() if v is not None})
        return settings

    def _setup_outputs_and_freezing(self, out_indices, frozen_stages: int, norm_eval: bool,
                                    with_cp: bool, num_stages: int = 4):
        """Check and set the options every backbone takes (which stages are
        returned, frozen, checkpointed; norms in eval mode), then freeze."""
        self.out_indices = check_out_indices(out_indices, num_stages)
        if isinstance(frozen_stages, bool) or not isinstance(frozen_stages, int) or \
                not -1 <= frozen_stages <= num_stages:
            raise ValueError(f'frozen_stages must be an int in -1..{num_stages} '
                             f'(-1: nothing frozen), got {frozen_stages!r}')
        check_init_cfg(self.init_cfg)
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self._freeze_stages()

    def stem_modules(self) -> List[nn.Module]:
        """Modules before the first stage, frozen when frozen_stages >= 0."""
        return []

    def _freeze_stages(self):
        """frozen_stages = k >= 0 freezes the stem and stages 0..k-1
        (parameters stop receiving gradients, modules stay in eval mode)."""
        if self.frozen_stages < 0:
            return
        modules = list(self.stem_modules())
        for stage in self.stages[:self.frozen_stages]:
            modules += stage.parts(self)
        for m in modules:
            if isinstance(m, nn.Parameter):
                m.requires_grad = False
                continue
            m.eval()
            for p in m.parameters():
                p.requires_grad = False

    def train(self, mode: bool = True):
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, (_BatchNorm, nn.GroupNorm, nn.LayerNorm)):
                    m.eval()
        return self

    def run_block(self, block: nn.Module, *args):
        """Call a block, through gradient checkpointing when ``with_cp``.

        A torch.fx graph (timm's ``create_feature_extractor``) holds the
        block's ops without checkpointing, as timm's own models trace: the
        same values, with the memory of ``with_cp=False``."""
        if self.with_cp and self.training and not is_fx_symbolic_tracing() and any(
                a.requires_grad for a in args if hasattr(a, 'requires_grad')):
            # (traced: torch.compile, make_fx and AOTAutograd take no context but
            # their own, and choose the backend when tracing)
            traced = torch.compiler.is_compiling() or _under_tensor_mode()
            kwargs = {} if traced else dict(context_fn=same_backend)
            return cp.checkpoint(block, *args, use_reentrant=False, **kwargs)
        return block(*args)

    def stem(self, x: Tensor) -> StageOutput:
        """What runs before the first stage: images (B, C, H, W) -> the first
        stage's input and grid. None by default (the images themselves)."""
        return x, None

    def forward_stages(self, x: Tensor, last: Optional[int] = None
                       ) -> Iterator[Tuple[int, Tensor, HWShape]]:
        """Yield (stage index, tokens (B, N, C), grid) of stages 0..``last``
        (every stage by default) for images (B, C, H, W)."""
        x, hw_shape = self.stem(x)
        for stage in self.stages:
            x, hw_shape = stage(self, x, hw_shape)
            yield stage.index, x, hw_shape
            if stage.index == last:
                return

    def output_tokens(self, i: int, tokens: Tensor) -> Tensor:
        """Stage i's tokens as :meth:`forward` returns them (identity here)."""
        return tokens

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        """
        Args:
            x (Tensor): images (B, C, H, W), any H and W.

        Returns:
            tuple[Tensor]: feature maps (B, C_i, ceil(H / s_i), ceil(W / s_i))
            at strides s_i = 4, 8, 16, 32 for the stages in ``out_indices``
            (LayerNorm-ed for the Swin-like backbones).
        """
        return tuple(stage_output(self.output_tokens(i, tokens), hw_shape)
                     for i, tokens, hw_shape in self.forward_stages(check_images(x))
                     if i in self.out_indices)

    def prune_stages(self, num_stages: int) -> None:
        """Keep the first ``num_stages`` stages: the others, and their parts,
        are deleted (so no parameter is left that forward does not use)."""
        for stage in self.stages[num_stages:]:
            for name in stage.entry_names + stage.part_names:
                delete_part(self, name)
        self.stages = self.stages[:num_stages]
        self.num_stages = num_stages
        self.embed_dims = self.embed_dims[:num_stages]
        self.out_indices = tuple(i for i in self.out_indices if i < num_stages)

    def convert_official(self, state_dict: dict) -> dict:
        """The release's state dict -> this model's names: the family's
        function of :mod:`flatten_mm.conversion`, applied on every load."""
        raise NotImplementedError

    def position_embeddings(self) -> List[Tuple[str, HWShape, int]]:
        """Absolute position embeddings, as (name, grid, class slots), that
        loading resizes to their grid (:func:`~flatten_mm.conversion.fit_to_model`):
        none here."""
        return []

    def init_weights(self):
        """The release's initialisation, then mmengine's initialisers of
        ``init_cfg`` (a dict or a list), then, as mmengine orders them, a
        ``Pretrained`` one: loaded by :func:`~flatten_mm.checkpoint.load_pretrained`
        (the release's layout converted, anything that does not fit an error),
        with its ``prefix`` if given."""
        cfgs = check_init_cfg(self.init_cfg)  # again: it may have changed since the build
        pretrained = [cfg for cfg in cfgs if cfg.get('type') == 'Pretrained']
        self.default_init()
        others = [cfg for cfg in cfgs if cfg.get('type') != 'Pretrained']
        if others:
            init_cfg, self.init_cfg = self.init_cfg, others
            try:
                super().init_weights()
            finally:
                self.init_cfg = init_cfg
        for cfg in pretrained:
            load_pretrained(self, cfg['checkpoint'], ignore_unexpected=self.ignore_unexpected,
                            ignore_missing=self.ignore_missing, prefix=cfg.get('prefix'))
        self._is_init = True

    def default_init(self):
        """Truncated-normal linear layers, unit LayerNorms, He-init convs, as
        the official FLatten models."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Conv2d):
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                nn.init.normal_(m.weight, 0, math.sqrt(2.0 / fan_out))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)


class SwinLikeBackbone(FLattenBackbone):
    """Base of FLatten-Swin and FLatten-CSwin: one base width C doubled per
    stage (C, 2C, 4C, 8C), and a LayerNorm on each dense output
    (``norm{i}``; the classifiers have one final norm instead, named ``norm``
    in the released files)."""
    # the classifier's head and final norm; the output norms of stages this
    # model does not output (a detector's backbone, loaded with fewer out_indices)
    ignore_unexpected = (r'head\.', r'norm\.', r'norm\d\.')
    ignore_missing = (r'norm\d\.',)  # the LayerNorm on each dense output

    def _stage_settings(self, arch: str, embed_dims: Optional[int], depths, num_heads,
                        attn_type: str, mlp_ratio: float, **scalars
                        ) -> Tuple[list, list, list, HWShape]:
        """Validated (dims, depths, num_heads, pretraining size) of ``arch``
        with the overrides (``scalars``: the other arguments of
        :func:`check_backbone_args`); sets ``arch``, ``embed_dims``,
        ``attn_type`` and ``num_stages``."""
        preset = self.arch_settings(arch, embed_dims=embed_dims, depths=depths,
                                    num_heads=num_heads)
        base_dims = check_positive_int('embed_dims', preset['embed_dims'])
        stages = check_stages(attn_type, [base_dims * 2 ** i for i in range(4)],
                              preset['depths'], preset['num_heads'], mlp_ratio)
        img = check_backbone_args(attn_type, **scalars)
        self.arch = arch
        self.embed_dims = stages['embed_dims']
        self.attn_type = attn_type
        self.num_stages = 4
        return stages['embed_dims'], stages['depths'], stages['num_heads'], img

    def _add_output_norms(self, out_indices):
        for i in check_out_indices(out_indices):
            setattr(self, f'norm{i}', nn.LayerNorm(self.embed_dims[i]))

    def output_tokens(self, i: int, tokens: Tensor) -> Tensor:
        norm = getattr(self, f'norm{i}', None)
        return tokens if norm is None else norm(tokens)
