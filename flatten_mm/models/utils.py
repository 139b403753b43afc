"""Small helpers every backbone and layer shares: argument checks, the token
<-> map layouts, padding and stage grids, PVT's key reduction, the image-size
specialisation under torch.compile and the modules' tensor caches."""
import collections
import contextlib
import contextvars
import math
import numbers
import operator
import warnings
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


def check_number(name: str, value, low: float = 0., high: float = math.inf,
                 low_open: bool = False) -> float:
    """Return ``value`` if it is a finite real number (not a bool) in
    ``[low, high]`` (``(low, high]`` with ``low_open``), else raise ValueError."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and \
        math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f'{">" if low_open else ">="} {low:g}' if high == math.inf else \
            f'in {"(" if low_open else "["}{low:g}, {high:g}]'
        raise ValueError(f'{name} must be a finite number {bound}, got {value!r}')
    return value


def check_heads(embed_dims: int, num_heads: int, where: str = '') -> None:
    """embed_dims and num_heads positive ints, embed_dims a multiple of
    num_heads (``where`` names the stage in the error)."""
    check_positive_int('embed_dims', embed_dims)
    check_positive_int('num_heads', num_heads)
    if embed_dims % num_heads:
        raise ValueError(f'embed_dims ({embed_dims}) must be divisible by '
                         f'num_heads ({num_heads}){where}')


def to_2tuple_checked(name: str, value, minimum: int = 1) -> HWShape:
    """Turn an int or a pair of ints (each >= ``minimum``) into a validated
    (h, w) tuple."""
    pair = (value, value) if isinstance(value, int) else \
        tuple(value) if isinstance(value, (tuple, list)) else None
    if pair is None or len(pair) != 2:
        raise ValueError(f'{name} must be an int or a pair of ints, got {value!r}')
    return (check_positive_int(name, pair[0], minimum), check_positive_int(name, pair[1], minimum))


# Under torch.compile (not torch.export), the backbones specialise their graph
# to the image height and width: a new size is traced anew with constant
# sizes, as with dynamic=False, instead of automatic dynamic shapes turning
# every size symbolic (traced several minutes for a small model, as every
# stage's size nests the previous one's padding and window arithmetic; and it
# crashed Inductor on CUDA at 800x1333). Set to False to try dynamic shapes.
STATIC_IMAGE_SIZES = True


def specialize_image_size(x: Tensor) -> Tensor:
    """``x`` (B, C, H, W); while torch.compile traces it, H and W become
    compile-time constants (guarded) when :data:`STATIC_IMAGE_SIZES` is set;
    under ``torch.jit.trace`` see :func:`only_at_traced_size` (not in
    torch.onnx's trace: :func:`onnx_export_trace`)."""
    if STATIC_IMAGE_SIZES and torch.compiler.is_compiling() and not is_exporting():
        # operator.index needs a Python int: dynamo specialises the symbol
        operator.index(x.shape[-2]), operator.index(x.shape[-1])
    if torch.jit.is_tracing() and not onnx_export_trace():
        return only_at_traced_size(x)
    return x


def only_at_traced_size(x: Tensor) -> Tensor:
    """Images x (B, C, H, W) under ``torch.jit.trace``, as views that a traced
    graph computes only where the images have the traced H and W, and that
    stop it elsewhere. A plain trace keeps the shortcuts that the traced size
    takes (a pad by nothing, a resize to the same size: :func:`sizes_symbolic`)
    and any frozen branch: at another size it gave wrong outputs where nothing
    failed (traced at 64x64, at 64x72: FLatten-PVT-T's logits off by up to
    0.29, FLatten-DeiT-T's by 0.18).

    With H and W recorded as constants, ``expand`` fails on a side other than
    H (W) but 1, and ``reshape`` on H x W pixels of another count: together
    every other size (also in an ONNX graph, whose ``Slice`` clamps where
    ``narrow`` fails, so a side of 1 passed the narrow alone). ``expand_as``
    keeps both in the graph at no cost; the batch and channels are read
    (dynamic)."""
    H, W = torch.tensor(x.shape[-2:]).tolist()  # constants in the graph, not sizes read
    return x.reshape(x.shape[0], x.shape[1], H, W).expand_as(x.expand(-1, -1, H, W))


def is_exporting() -> bool:
    """``torch.compiler.is_exporting()``, read from the flag behind it where
    torch has one: the dynamo of torch 2.11 (the torch of the H200 figures)
    folds the function to True under torch.compile too, so there the image
    sizes went symbolic after the first recompile (slow traces, and likely the
    Inductor crash at 800x1333 of docs/design.md)."""
    flag = getattr(torch.compiler, '_is_exporting_flag', None)
    return torch.compiler.is_exporting() if flag is None else flag


def sizes_symbolic(*sizes) -> bool:
    """Whether any of ``sizes`` is symbolic (``torch.export`` with
    ``dynamic_shapes``, compiled dynamic shapes), or torch.onnx traces the
    model (:func:`onnx_export_trace`: sizes are traced values): size-dependent
    code then takes its general form (a pad by nothing, a resize to the same size, a
    mask of all-true keys), which equals the shortcut, so the program holds
    at every size rather than at those that take the example's shortcuts
    (FLatten-PVT, PVTv2 and DeiT exported at 224x224 stopped at every other
    size: their grid was the positional encoding's)."""
    return any(isinstance(s, torch.SymInt) for s in sizes) or onnx_export_trace()


def onnx_export_trace() -> bool:
    """Whether torch.onnx's TorchScript exporter (``dynamo=False``, as mmdeploy
    exports) traces the model. Its trace records the sizes read from the input
    and the arithmetic on them (they are 0-dim tensors there), so with the
    general forms of :func:`sizes_symbolic` and no image size frozen in
    Python, its graph holds at every size (``dynamic_axes``); a branch on the
    sizes is frozen, so it stops the graph where it would go the other way
    (:func:`branch_on_sizes`). A plain ``torch.jit.trace`` keeps the
    shortcuts, whose ops FLOP counters count, and its traced size
    (:func:`only_at_traced_size`)."""
    return torch.jit.is_tracing() and torch.onnx.is_in_onnx_export()


def branch_on_sizes(x: Tensor, cond) -> Tuple[Tensor, bool]:
    """``(x, cond)`` for a condition on image sizes (a bool, or a SymBool
    under torch.export, which guards on it). In a jit trace, as torch.onnx's
    (:func:`onnx_export_trace`), ``cond`` is a 0-dim bool tensor computed in
    the graph, the branch the trace takes is frozen into it, and x becomes a
    view of itself that fails, in torch and in ONNX runtimes, at sizes
    whose ``cond`` differs from the traced one (an ``expand`` of the last
    side, channels, to twice its size there; a reshape was merged into the
    next by ONNX's optimisers): the graph stops instead of running the other
    branch's inputs through this one."""
    if not isinstance(cond, Tensor):
        return x, cond
    with warnings.catch_warnings():  # the trace's bool is frozen: that is the point
        warnings.simplefilter('ignore', torch.jit.TracerWarning)
        taken, channels = bool(cond), int(x.shape[-1])
    if channels < 2:  # ONNX's Expand broadcasts a side of 1: no check
        raise ValueError(f'branch_on_sizes needs x with more than 1 channel last, got '
                         f'{channels}')
    other = 1 - cond.long() if taken else cond.long()  # 1 where they take the other
    return x.expand(*x.shape[:-1], x.shape[-1] * (1 + other)), taken


# per thread (and task), as jit tracing is: one thread's FLOP count must not
# change what another's export trace records
_OP_NODES_KEPT = contextvars.ContextVar('flatten_mm_op_nodes_kept', default=False)


def in_export_trace() -> bool:
    """Whether ``torch.jit.trace`` records a graph to be saved or exported
    (``torch.jit.save``, mmdeploy's TorchScript backend, torch.onnx's
    TorchScript exporter): such a graph holds plain ops, not a Python autograd
    function (``torch.jit.save`` refused it: "Could not export Python function
    call"; the ONNX exporter failed in its peephole pass) nor a Triton op,
    which a runtime without Python lacks. Not inside :func:`op_nodes_in_traces`."""
    return torch.jit.is_tracing() and not _OP_NODES_KEPT.get()


@contextlib.contextmanager
def op_nodes_in_traces():
    """jit traces made inside keep the attention core's ops as single nodes
    (autograd functions, custom ops): mmengine's FLOP analysis counts them by
    name (:mod:`flatten_mm.analysis`)."""
    token = _OP_NODES_KEPT.set(True)
    try:
        yield
    finally:
        _OP_NODES_KEPT.reset(token)


def _under_tensor_mode() -> bool:
    """Whether a fake or proxy tensor mode is active (``make_fx``, fake-tensor
    shape propagation): the tensors made then must not outlive it."""
    get, keys = torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey
    return get(keys.FAKE) is not None or get(keys.PROXY) is not None


class TensorCache(collections.OrderedDict):
    """A module's cached tensors: derived values, so a copy of the module
    (``copy.deepcopy``: EMA and teacher models) or a pickle of it starts
    empty. Copying them would copy stale values along, and fail for views of
    a parameter made without gradient once the parameter has been updated in
    place (autograd forbids deep-copying such a view)."""

    def __deepcopy__(self, memo) -> 'TensorCache':
        return TensorCache()

    def __reduce__(self):
        return TensorCache, ()


# the module classes whose calls a layer may replace by its own use of their
# parameters (one stacked product, a fused op, the chunked MLP): exactly these
# classes, not subclasses (LoRA layers, fake-quantised or parametrised ones)
PLAIN_MODULES = (nn.Linear, nn.Conv2d, nn.GELU, nn.Dropout)


def must_call(*modules: nn.Module) -> bool:
    """Whether a layer must call ``modules`` rather than apply their parameters
    itself (one stacked product, a fused op, the chunked MLP): one of them is
    not a plain :data:`PLAIN_MODULES` instance (an adapter such as a LoRA
    wrapper, a quantised, parametrised or otherwise derived class, a forward
    replaced on the instance), whose parameters alone do not say what it
    computes, or a call would run a hook (:func:`hooked`)."""
    return any(type(m) not in PLAIN_MODULES or 'forward' in m.__dict__
               for m in modules) or hooked(*modules)


def hooked(*modules: nn.Module) -> bool:
    """Whether a call of any of ``modules`` would run a hook: its own forward
    or backward hooks, or global module hooks. Layers that apply a submodule's
    parameters themselves call the submodule instead where it is hooked, so
    that its hooks run and see its own output (dynamo traces the hooks into a
    compiled graph). Not under ``torch.jit.trace``: FLOP counters such as
    fvcore's hook every module there to name scopes, and count the fused
    forms, which are what runs."""
    from torch.nn.modules import module as torch_module
    if torch.jit.is_tracing():
        return False
    if (torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
            or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
               or m._backward_pre_hooks for m in modules)


def _module_cache(module: nn.Module, inference_only: bool):
    """``module``'s cache (a :class:`TensorCache`), or None when nothing may be cached:
    while compiling or tracing, under a fake or proxy tensor mode, and, if
    ``inference_only``, in training mode or with gradients recorded."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or is_fx_symbolic_tracing():
        return None  # first: a trace must not touch the module's __dict__ (torch 2.11's
        # dynamo cannot trace it: a graph break in every attention layer)
    if inference_only and (module.training or torch.is_grad_enabled()) or _under_tensor_mode():
        return None
    return module.__dict__.setdefault('_tensor_cache', TensorCache())


_MISSING = object()


def _lookup(cache: collections.OrderedDict, key):
    """The entry of ``key`` (the most recent from now on), or ``_MISSING``."""
    try:
        value = cache[key]
        cache.move_to_end(key)
    except KeyError:  # absent, or evicted meanwhile by another thread (DataParallel
        return _MISSING  # replicas share their module's dict)
    return value


def _store(cache: collections.OrderedDict, key, value):
    cache[key] = value
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return value


# entries kept per module: a FLatten-PVT backbone holds two per stage and input size
CACHE_SIZE = 8


def size_cached(module: nn.Module, key: tuple, make):
    """``make()``, computed once per ``key`` and kept on ``module``, in training
    and in inference alike.

    Only for what depends on the input size alone (masks, window layouts,
    resize weights: a few dozen small kernels per layer, made every step
    otherwise), with the dtype and device it is made in as part of ``key``;
    what is made from parameters goes through :func:`param_cached`. The last
    CACHE_SIZE keys are kept. Entries made under ``torch.inference_mode``
    (inference tensors, which autograd may not save) are kept apart.
    """
    cache = _module_cache(module, inference_only=False)
    if cache is None:
        return make()
    full = (key, torch.is_inference_mode_enabled())
    value = _lookup(cache, full)
    return _store(cache, full, make()) if value is _MISSING else value


def param_cached(module: nn.Module, key: tuple, make, params: Tuple[Tensor, ...]):
    """``make()``, a value made from the tensors ``params`` (resized positional
    encodings, bias tables), cached in inference (eval mode, no gradient
    recorded) on CPUs, and served only while ``params`` still hold exactly
    the values it was made from.

    Parameter values can change in place without any trace on the parameter
    (``p.data.mul_()``, as mmdet's MeanTeacherHook updates its teacher;
    mmengine's EMAHook swaps weights with ``.data.copy_``: no new storage, no
    version bump), so an entry keeps a copy of ``params`` and each call
    compares them (``torch.equal``: one read of parameters that are small
    next to the activations). On other devices the comparison would wait for
    the device, and remaking the value costs next to nothing there: it is
    made every call.
    """
    cache = _module_cache(module, inference_only=True)
    if cache is None or any(p.device.type != 'cpu' for p in params):
        return make()
    full = (key, torch.is_inference_mode_enabled(), tuple(p.dtype for p in params))
    entry = _lookup(cache, full)
    if entry is not _MISSING and all(torch.equal(p, c) for p, c in zip(params, entry[1])):
        return entry[0]
    value = make()
    _store(cache, full, (value, tuple(p.detach().clone() for p in params)))
    return value


def autocast_off(device_type: str):
    """A context with autocast off for ``device_type``; nothing to turn off
    where there is no autocast (the meta device: ``torch.autocast`` raises
    there even when disabled)."""
    if has_autocast(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_input(x: Tensor) -> Tensor:
    """``x`` as autocast casts a matmul's input (a float other than float64 to
    the autocast dtype), for several products of one input: each would cast it
    again, a pass over x apiece (and another for each gradient)."""
    device = x.device.type
    if (has_autocast(device) and torch.is_autocast_enabled(device)
            and x.is_floating_point() and x.dtype != torch.float64):
        return x.to(torch.get_autocast_dtype(device))
    return x


@torch.compiler.assume_constant_result
def has_autocast(device_type: str) -> bool:
    """Whether ``device_type`` has autocast; a constant to torch.compile (the
    dynamo of torch 2.11, the torch of the H200 figures, cannot trace the C
    function behind it: a graph break in every attention layer)."""
    return torch.amp.is_autocast_available(device_type)


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


@torch.fx.wrap  # a call node in fx graphs: the widening depends on the input's width
def widen_narrow_half_map(x: Tensor, stride: int, room: int) -> Tensor:
    """x widened with zero columns to ``stride - room`` where it is a CPU map
    in half precision (or under CPU autocast) that a conv of that horizontal
    ``stride`` and ``room`` (twice its padding less its dilated reach) turns
    into an output one pixel wide; else x itself. See :func:`strided_conv`."""
    if x.device.type != 'cpu' or not (torch.is_autocast_enabled('cpu')
                                      or x.dtype in (torch.bfloat16, torch.float16)):
        return x
    widest = stride - room  # the widest input with an output one pixel wide
    if (x.shape[-1] + room - 1) // stride == 0 and widest > x.shape[-1]:
        x = F.pad(x, (0, widest - x.shape[-1]))
    return x


def strided_conv(conv: nn.Module, x: Tensor) -> Tensor:
    """``conv`` (a strided nn.Conv2d) of the map x. In half precision on CPU,
    a map that gives an output one pixel wide is first widened with zero
    columns to the widest input that gives that output (they stand where the
    conv's zero padding would, or past its reach, so no output changes):
    PyTorch's CPU bf16 convolution goes wrong on narrower ones (torch 2.14.1,
    bf16 autocast). Weight gradients, mostly finite and far off:
    ``Conv2d(16, 32, 3, 2, 1)`` on width 1, 75 of 100 tries off by more than
    5 %; ``Conv2d(16, 32, 7, 4, 3)`` on widths 1-3, 17 of 18. Outputs, with
    channels-last inputs, off by about 100 %: kernel = stride = 4, 8 or 16 on a
    map that wide, for some channel counts under 32 (16 for 8, 4 for 16). None
    once widened (docs/advanced.md; upstream, pytorch/pytorch#169688). Under
    fx symbolic tracing the widening is one call node, decided when the graph
    runs (a graph of the plain conv gave NaN weight gradients there)."""
    if (isinstance(conv, nn.Conv2d) and conv.padding_mode == 'zeros'
            and isinstance(conv.padding, tuple)):
        room = 2 * conv.padding[1] - conv.dilation[1] * (conv.kernel_size[1] - 1)
        x = widen_narrow_half_map(x, conv.stride[1], room)
    return conv(x)


def spatial_reduce(x: Tensor, hw_shape: HWShape, layer: nn.Module) -> Tuple[Tensor, HWShape]:
    """PVT's key/value reduction of a (B, N, C) map by ``layer``'s strided conv
    ``sr`` (stride ``layer.sr_ratio``: ``sr`` may be an adapter without a
    ``stride``) and LayerNorm ``norm``.

    A map whose sides are not multiples of the stride is first extended by
    replicating its last row/column, so every pixel is summarised (the
    release, at its fixed training size, never needed this) and maps smaller
    than the stride still give one key.
    """
    x = pad_to_multiple(tokens_to_map(x, hw_shape), layer.sr_ratio, mode='replicate')
    x = strided_conv(layer.sr, x)
    grid = (x.shape[2], x.shape[3])
    return layer.norm(map_to_tokens(x)), grid


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


def pad_to_multiple(x: Tensor, multiple: int, mode: str = 'constant') -> Tensor:
    """A (B, C, H, W) map padded at the bottom/right (zeros, or ``mode`` of
    ``F.pad``) to sides that are multiples of ``multiple``; ``x`` itself when
    they are already."""
    pad_h, pad_w = -x.shape[2] % multiple, -x.shape[3] % multiple
    if sizes_symbolic(*x.shape[2:]) or pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h), mode=mode)
    return x


def stage_grid(img_size: HWShape, stage: int) -> HWShape:
    """The token grid of stage ``stage`` (strides 4, 8, 16, 32) for images of
    ``img_size``, as the release sizes its positional terms: floor division."""
    stride = 4 * 2 ** stage
    return img_size[0] // stride, img_size[1] // stride
