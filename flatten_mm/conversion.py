"""Weight conversion: the release's checkpoints into our models, and our
classifiers to and from mmpretrain's; timm's filter, which picks the one a
file needs.

Our parameter names are the release's except where the release lays a module
out differently. Each family's renaming is one function on a whole state dict
(as mmdet's ``swin_converter`` / ``pvt_convert``), idempotent, so it is
harmless on our own checkpoints:

* :func:`pvt_convert` (FLatten-PVT, -PVTv2): the release's names are ours.
* :func:`swin_convert`: the linear attention's fused ``qkv`` is split into
  ``q`` and ``kv``; the stored cyclic-shift masks (``attn_mask``) are dropped
  (our windows need none).
* :func:`cswin_convert`: a linear block's ``qkv`` and ``proj``, which the
  release keeps beside its attention, move into it (``qkv`` split).
* FLatten-DeiT (never released) has timm's DeiT names: nothing to rename.

Then :func:`fit_to_model` resizes what was learnt at another size to the
model's (positional encodings, relative-position bias tables), and
:func:`convert_on_load`, the load-state-dict pre-hook every FLatten backbone
registers (one, on the model), applies both to whatever is loaded into it.
"""
import re
from typing import Dict

import torch
import torch.nn.functional as F
from mmengine.logging import print_log
from torch import Tensor, nn

from .checkpoint import extract_state_dict, unwrap_state_dict
from .models.attention import FocusedLinearAttention
from .models.layers import WindowSoftmaxAttention
from .models.resize import resize_tokens
from .models.utils import HWShape

StateDict = Dict[str, Tensor]


def linear_attention_prefixes(state_dict: StateDict):
    """Key prefixes of the focused linear attention layers in ``state_dict``:
    those holding a ``scale`` (no other layer has one)."""
    return [k[:-len('scale')] for k in state_dict if k == 'scale' or k.endswith('.scale')]


def split_fused_qkv(state_dict: StateDict, prefix: str = '') -> StateDict:
    """``{prefix}qkv.*`` (3C rows) -> ``{prefix}q.*`` (C) and ``{prefix}kv.*`` (2C), in place."""
    for kind in ('weight', 'bias'):
        fused = state_dict.pop(f'{prefix}qkv.{kind}', None)
        if fused is not None:
            C = fused.shape[0] // 3
            state_dict[f'{prefix}q.{kind}'] = fused[:C]
            state_dict[f'{prefix}kv.{kind}'] = fused[C:]
    return state_dict


def pvt_convert(state_dict: StateDict) -> StateDict:
    """FLatten-PVT / -PVTv2 release -> ours: the same names."""
    return state_dict


def swin_convert(state_dict: StateDict) -> StateDict:
    """FLatten-Swin release -> ours: fused ``qkv`` of each linear attention
    split, the shift masks (``attn_mask`` buffers) dropped."""
    state_dict = {k: v for k, v in state_dict.items() if not re.search(r'(^|\.)attn_mask$', k)}
    for prefix in linear_attention_prefixes(state_dict):
        split_fused_qkv(state_dict, prefix)
    return state_dict


def cswin_convert(state_dict: StateDict) -> StateDict:
    """FLatten-CSwin release -> ours: a linear block's ``qkv`` and ``proj``
    (block level in the release) moved into its attention ``attns.0``,
    ``qkv`` split."""
    state_dict = dict(state_dict)
    for prefix in linear_attention_prefixes(state_dict):
        block = prefix[:-len('attns.0.')] if prefix.endswith('attns.0.') else None
        if block is None:
            continue
        for name in ('qkv', 'proj'):
            for kind in ('weight', 'bias'):
                value = state_dict.pop(f'{block}{name}.{kind}', None)
                if value is not None:
                    state_dict[f'{prefix}{name}.{kind}'] = value
        split_fused_qkv(state_dict, prefix)
    return state_dict


def fit_grid_tokens(tokens: Tensor, own: Tensor, grid: HWShape, key: str,
                    num_prefix: int = 0) -> Tensor:
    """Tokens (1, P + s*s, C) learnt on another square grid (a positional
    encoding, DeiT's position embedding with P = 1 class slot), their grid
    part resized (bilinear) to ``grid``, the model's (``own`` its tensor);
    anything else as it is (a mismatch is then load_state_dict's to report)."""
    if tokens.dim() != 3 or tokens.shape[-1] != own.shape[-1] or \
            tokens.shape[1] == own.shape[1]:
        return tokens
    side = int(round((tokens.shape[1] - num_prefix) ** 0.5))
    if side * side != tokens.shape[1] - num_prefix:
        return tokens
    print_log(f'{key}: resized from {side}x{side} to {grid[0]}x{grid[1]}', logger='current')
    resized = resize_tokens(tokens[:, num_prefix:].float(), (side, side), grid)
    return torch.cat([tokens[:, :num_prefix].float(), resized], 1).to(tokens.dtype)


def fit_bias_table(table: Tensor, layer: WindowSoftmaxAttention) -> Tensor:
    """A relative-position bias table learnt for another square window (7 for
    the 224 model, fine-tuned at 384 with 12) resized bicubically, as Swin
    does; anything else as it is."""
    own = layer.relative_position_bias_table
    if table.shape == own.shape or table.dim() != 2 or table.shape[1] != own.shape[1]:
        return table
    side = int(round(table.shape[0] ** 0.5))
    if side * side != table.shape[0]:
        return table  # not a square window: left for load_state_dict to report
    wh, ww = layer.window_size
    grid = table.t().reshape(1, -1, side, side).float()
    grid = F.interpolate(grid, size=(2 * wh - 1, 2 * ww - 1), mode='bicubic',
                         align_corners=False)
    return grid.reshape(own.shape[1], -1).t().to(table.dtype)


def fit_input_conv(weight: Tensor, conv: nn.Module, key: str) -> Tensor:
    """An RGB model's first conv weight (O, 3, k, k) for ``conv``, the model's
    conv on images of other channels, by timm's rule (``adapt_input_conv``),
    so the mm path loads as timm's does: one channel takes the sum of the
    three (a grey image gives what the RGB model gives for it in all three);
    more take the three in turn, scaled by 3 / channels (for 6, two stacked
    copies of an RGB image give what the RGB model gives for it). Anything
    else (another conv's weight, a checkpoint of other image channels) as it
    is, for the load to report."""
    own = getattr(conv, 'weight', None)
    if own is None or weight.dim() != 4 or weight.shape[1] != 3 or own.shape[1] == 3 or \
            weight.shape[0] != own.shape[0] or weight.shape[2:] != own.shape[2:]:
        return weight
    channels = own.shape[1]
    w = weight.float()
    fitted = w.sum(1, keepdim=True) if channels == 1 else \
        w[:, torch.arange(channels) % 3] * (3 / channels)
    print_log(f'{key}: fitted from 3 to {channels} image channels', logger='current')
    return fitted.to(weight.dtype)


def fit_to_model(state_dict: StateDict, model: nn.Module) -> StateDict:
    """Resize, in place, the tensors of ``state_dict`` that ``model`` holds
    at another size: its first conv's weight (an RGB model's, to the model's
    image channels: :func:`fit_input_conv`), its absolute position
    embeddings (the model's ``position_embeddings()``: PVT's, DeiT's),
    positional encodings of its focused linear attention layers (to their
    ``pos_grid``) and bias tables of its softmax window attention (to their
    window; the index buffer is then the model's own)."""
    first = getattr(model, 'first_conv', '')
    if first and f'{first}.weight' in state_dict:
        key = f'{first}.weight'
        state_dict[key] = fit_input_conv(state_dict[key], model.get_submodule(first), key)
    for key, grid, num_prefix in getattr(model, 'position_embeddings', tuple)():
        if key in state_dict:
            state_dict[key] = fit_grid_tokens(state_dict[key], model.get_parameter(key), grid,
                                              key, num_prefix)
    for name, layer in model.named_modules():
        prefix = f'{name}.' if name else ''
        if isinstance(layer, FocusedLinearAttention):
            key = f'{prefix}positional_encoding'
            if key in state_dict:
                state_dict[key] = fit_grid_tokens(state_dict[key], layer.positional_encoding,
                                                  layer.pos_grid, key)
        elif isinstance(layer, WindowSoftmaxAttention):
            key = f'{prefix}relative_position_bias_table'
            if key in state_dict:
                resized = fit_bias_table(state_dict[key], layer)
                if resized is not state_dict[key] and f'{prefix}relative_position_index' \
                        in state_dict:
                    state_dict[f'{prefix}relative_position_index'] = \
                        layer.relative_position_index
                state_dict[key] = resized
    return state_dict


def convert_on_load(model: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """The load-state-dict pre-hook of every FLatten backbone (and classifier):
    the keys under ``prefix`` go through the model's ``convert_official``
    (its family's renaming) and :func:`fit_to_model`, in place. It runs once,
    at the model, before any of its layers loads."""
    own = {k[len(prefix):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefix)}
    own = fit_to_model(model.convert_official(own), model)
    state_dict.update({prefix + k: v for k, v in own.items()})


def to_mmpretrain(model: nn.Module) -> StateDict:
    """The state dict of the mmpretrain ``ImageClassifier`` equal to the
    timm classifier ``model``: its dense backbone with ``out_indices=(3,)``
    (``backbone.*``, the final norm as that backbone's output norm), a GAP
    neck and a ``LinearClsHead`` (``head.fc.*``); for FLatten-DeiT the backbone
    with its last block, ``final_norm=True`` (``norm``) and
    ``out_type='cls_token'``, no neck (configs/flatten_deit)."""
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
    """Whether ``state_dict`` is an mmpretrain ``ImageClassifier``'s."""
    return 'head.fc.weight' in state_dict and any(k.startswith('backbone.') for k in state_dict)


def from_mmpretrain(state_dict: StateDict, model: nn.Module) -> StateDict:
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


def checkpoint_filter_fn(state_dict: dict, model: nn.Module, strict: bool = True) -> StateDict:
    """timm's filter for official weights: take ``state_dict['model']`` if
    nested, rename an mmpretrain classifier's checkpoint (``backbone.*``,
    ``head.fc.*``) to ours, and drop the head when the class count differs.
    The release's own layout is converted when the model loads it
    (:func:`convert_on_load`). timm loads non-strictly when the class count
    differs and with ``features_only``; with ``strict`` (timm's
    ``pretrained_strict``, bound by the model functions) all but the head
    must fit as in a strict load, so weights of another size of the family
    never load in part."""
    sd = classifier_state_dict(state_dict, model)
    if other_class_count(sd, model):
        sd = without_head(sd)
    if strict:
        check_body_keys(sd, model)
    return sd


def check_body_keys(state_dict: StateDict, model: nn.Module) -> None:
    """Raise unless ``state_dict`` (in the release's names or ours) holds
    exactly ``model``'s weights, the classifier's ``head.*`` aside."""
    def body(keys):
        return {k for k in keys if not k.startswith('head.')}
    own, held = body(model.state_dict()), body(model.convert_official(dict(state_dict)))
    missing, unexpected = sorted(own - held), sorted(held - own)
    if missing or unexpected:
        raise unfit('the checkpoint', model, missing, unexpected,
                    ' (pretrained_strict=False loads what fits)')


def unfit(source: str, model: nn.Module, missing: list, unexpected: list,
          hint: str = '') -> RuntimeError:
    """The error for weights of ``source`` that do not fit ``model``: the first
    keys it lacks and has in excess, and how many."""
    return RuntimeError(f'{source} does not fit {type(model).__name__}: missing '
                        f'{missing[:8] or "none"}, unexpected {unexpected[:8] or "none"} '
                        f'({len(missing)} and {len(unexpected)} keys){hint}')


def classifier_state_dict(state_dict: dict, model: nn.Module) -> StateDict:
    """The tensors of a loaded checkpoint for the classifier ``model``: nested
    ones taken out, an mmpretrain classifier's renamed to ours."""
    nested = unwrap_state_dict(state_dict)
    if is_mmpretrain_classifier(nested):
        state_dict = from_mmpretrain(nested, model)
    return extract_state_dict(state_dict)


def without_head(state_dict: StateDict) -> StateDict:
    """``state_dict`` without the classifier's ``head.*``."""
    return {k: v for k, v in state_dict.items() if not k.startswith('head.')}


def other_class_count(state_dict: StateDict, model: nn.Module) -> bool:
    """Whether ``state_dict``'s head has another class count than ``model``'s."""
    head = state_dict.get('head.weight')
    return head is not None and head.shape[0] != getattr(model, 'num_classes', head.shape[0])
