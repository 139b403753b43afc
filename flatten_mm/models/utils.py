"""Small helpers every backbone and layer shares: argument checks, the token
<-> map layouts, the stage-output layout and the inference cache."""
import collections
import operator
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

HWShape = Tuple[int, int]

def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f'{name} must be an int >= {minimum}, got {value!r}')
    return value


def to_2tuple_checked(name: str, value) -> HWShape:
    """Turn an int or a pair of ints into a validated (h, w) tuple."""
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2:
        raise ValueError(f'{name} must be an int or a pair of ints, got {value!r}')
    return (check_positive_int(name, pair[0]), check_positive_int(name, pair[1]))


# Under torch.compile (not torch.export), the backbones specialise their graph
# to the image height and width: a new size is traced anew with constant
# sizes, as with dynamic=False, instead of automatic dynamic shapes turning
# every size symbolic (traced several minutes for a small model, as every
# stage's size nests the previous one's padding and window arithmetic; and it
# crashed Inductor on CUDA at 800x1333). Set to False to try dynamic shapes.
STATIC_IMAGE_SIZES = True


def specialize_image_size(x: Tensor) -> Tensor:
    """``x`` (B, C, H, W); while torch.compile traces it, H and W become
    compile-time constants (guarded) when :data:`STATIC_IMAGE_SIZES` is set."""
    if STATIC_IMAGE_SIZES and torch.compiler.is_compiling() \
            and not torch.compiler.is_exporting():
        # operator.index needs a Python int: dynamo specialises the symbol
        operator.index(x.shape[-2]), operator.index(x.shape[-1])
    return x


def eval_cached(module: nn.Module, key: tuple, make, params: Tuple[Tensor, ...] = ()):
    """``make()``, computed once per ``key`` while ``module`` is in eval mode
    and no gradient is recorded (inference), else every call.

    For what depends only on the input size and on ``params`` (resized
    positional encodings, masks, window layouts); the parameters' storage and
    version counters are part of the key, so loading weights, an optimizer
    step or ``.to()`` invalidate an entry. The last four keys are kept;
    switching to training mode drops them.
    """
    if module.training or torch.is_grad_enabled() or torch.compiler.is_compiling() \
            or torch.jit.is_tracing() or is_fx_symbolic_tracing():
        if module.training:
            module.__dict__.pop('_eval_cache', None)
        return make()
    full = (key, torch.is_inference_mode_enabled()) + tuple(
        (p.data_ptr(), p._version, p.dtype, p.device) for p in params)
    cache = module.__dict__.setdefault('_eval_cache', collections.OrderedDict())
    if full in cache:
        cache.move_to_end(full)
        return cache[full]
    value = cache[full] = make()
    while len(cache) > 4:
        cache.popitem(last=False)
    return value


def tokens_to_map(x: Tensor, hw_shape: HWShape) -> Tensor:
    """(B, N, C) tokens -> a (B, C, H, W) map; for contiguous tokens a
    channels-last view of their memory.

    Made by ``reshape`` + ``permute``: ``transpose(1, 2).reshape`` gives the
    same strides except a batch stride of C when B = 1, which mkldnn does not
    take for channels-last, and its convolutions then fall back to a path
    several times slower (docs/design.md, docs/benchmarks.md)."""
    B, _, C = x.shape
    return x.reshape(B, hw_shape[0], hw_shape[1], C).permute(0, 3, 1, 2)


def map_to_tokens(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H*W, C) tokens: a view of a channels-last map
    (what convolutions on :func:`tokens_to_map` return), else a copy."""
    return x.permute(0, 2, 3, 1).reshape(x.shape[0], -1, x.shape[1])


def spatial_reduce(x: Tensor, hw_shape: HWShape, sr: nn.Conv2d, norm: nn.LayerNorm
                   ) -> Tuple[Tensor, HWShape]:
    """PVT's key/value reduction: strided conv + LayerNorm on a (B, N, C) map.

    A map whose sides are not multiples of the stride is first extended by
    replicating its last row/column, so every pixel is summarised (the
    release, at its fixed training size, never needed this) and maps smaller
    than the stride still give one key.
    """
    B, N, C = x.shape
    ratio = sr.stride[0]
    x = tokens_to_map(x, hw_shape)
    pad_h, pad_w = -hw_shape[0] % ratio, -hw_shape[1] % ratio
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h), mode='replicate')
    x = sr(x)
    grid = (x.shape[2], x.shape[3])
    return norm(map_to_tokens(x)), grid


def add_projections(module: nn.Module, embed_dims: int, qkv_bias: bool,
                    sr_ratio: int, proj_drop: float) -> None:
    """The projections PVT-style attention layers share, named as released:
    ``q``, ``kv``, ``proj`` (+ dropout), and with ``sr_ratio > 1`` the key/value
    reduction ``sr`` (strided conv) and ``norm``."""
    module.q = nn.Linear(embed_dims, embed_dims, bias=qkv_bias)
    module.kv = nn.Linear(embed_dims, embed_dims * 2, bias=qkv_bias)
    module.proj = nn.Linear(embed_dims, embed_dims)
    module.proj_drop = nn.Dropout(proj_drop)
    if sr_ratio > 1:
        module.sr = nn.Conv2d(embed_dims, embed_dims, sr_ratio, stride=sr_ratio)
        module.norm = nn.LayerNorm(embed_dims)
