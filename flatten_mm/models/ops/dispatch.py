"""One entry point for the attention core, several backends.

:func:`focused_linear_attention` takes the projected q, k, v and the raw
``scale`` parameter and returns the focused linear attention of FLATTEN.md
§2.4-2.5 (the DWC term is the module's). Which backend computes it is chosen
per call from the tensors (device, dtype, shape), unless one process-wide
override says otherwise (:func:`set_backend`, or the environment variable
``FLATTEN_MM_ATTN_BACKEND`` read at import), as timm's fused-attention switch:

* ``'reference'``: the formula with autograd (slow; the yardstick of tests);
* ``'torch'``: hand-written autograd function on PyTorch ops, fp32 inside
  (every device; the CPU path);
* ``'triton'``: fused Triton kernels (CUDA tensors; CPU tensors only under
  ``TRITON_INTERPRET=1``), registered by :mod:`.triton_backend` when triton imports;
* ``'auto'`` (default): ``'triton'`` for CUDA tensors it supports, else ``'torch'``.

A backend is a function with :func:`focused_linear_attention`'s signature;
:func:`register_backend` adds one, with a predicate saying which calls it
takes under ``'auto'``. The same switch chooses for the layer's other op,
``'conv_add'`` (the output plus DWC(V), :func:`.conv.depthwise_conv_add`), whose
backends are ``'torch'`` and the fused ``'triton'`` (any other name: ``'torch'``).
"""
import os
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..utils import autocast_off, in_export_trace
from .autograd import FocusedLinearAttentionFn
from .reference import focusing_map, linear_attention

Backend = Callable[..., Tensor]
Supports = Callable[..., bool]

# per op ('attention': the core; 'conv_add': the output plus DWC(V), conv.py),
# backend name -> function, and the backends 'auto' may choose, in registration order
_BACKENDS: Dict[str, Dict[str, Backend]] = {}
_AUTO: Dict[str, Dict[str, Supports]] = {}
_OVERRIDE = {'name': 'auto'}


def register_backend(name: str, fn: Backend, auto: Optional[Supports] = None,
                     op: str = 'attention') -> None:
    """Add backend ``name`` of ``op``. With ``auto``, ``'auto'`` picks it for calls
    where ``auto(*args)`` is True (``(q, k, v, key_mask, num_heads)`` for the
    attention; earlier registrations win)."""
    _BACKENDS.setdefault(op, {})[name] = fn
    if auto is not None:
        _AUTO.setdefault(op, {})[name] = auto


def available_backends() -> tuple:
    """Names :func:`set_backend` takes (the attention core's backends)."""
    return ('auto', ) + tuple(_BACKENDS['attention'])


def set_backend(name: str) -> None:
    """Make every later call use backend ``name`` (``'auto'`` to choose per call)."""
    if name not in available_backends():
        raise ValueError(f'attention backend must be one of {available_backends()}, '
                         f'got {name!r}')
    _OVERRIDE['name'] = name


def get_backend() -> str:
    """The override in force (``'auto'`` when none)."""
    return _OVERRIDE['name']


class use_backend:  # noqa: N801 (a context manager, named as torch.no_grad)
    """:func:`set_backend` for the duration of a ``with`` block. It can be
    entered again (gradient checkpointing enters the one a forward made at
    each backward's recomputation), and it changes nothing where ``name`` is
    already in force (the override is process-wide: autograd's device threads
    see it)."""

    def __init__(self, name: str) -> None:
        self.name, self.previous = name, []

    def __enter__(self) -> None:
        previous = get_backend()
        if previous != self.name:
            set_backend(self.name)  # (checks the name)
        self.previous.append(previous)

    def __exit__(self, *exc) -> None:
        _OVERRIDE['name'] = self.previous.pop()


def choose(op: str, *args) -> str:
    """The backend of ``op`` a call with these arguments runs on: the override,
    or under ``'auto'`` the first backend that supports them; ``'torch'`` where
    the op has no backend of the override's name."""
    if in_export_trace():  # the formula's plain ops
        return 'reference' if 'reference' in _BACKENDS[op] else 'torch'
    name = _OVERRIDE['name']
    if name == 'auto':
        return next((c for c, supports in _AUTO.get(op, {}).items() if supports(*args)),
                    'torch')
    return name if name in _BACKENDS[op] else 'torch'


def backend_of(op: str, *args) -> Backend:
    """The function :func:`choose` picks."""
    return _BACKENDS[op][choose(op, *args)]


def choose_backend(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
                   num_heads: int) -> str:
    """The attention backend a call with these tensors runs on."""
    return choose('attention', q, k, v, key_mask, num_heads)


def focused_linear_attention(q: Tensor, k: Tensor, v: Tensor, scale: Tensor,
                             focusing_factor: float, num_heads: int,
                             key_mask: Optional[Tensor] = None,
                             overwrite_qk: bool = False) -> Tensor:
    """Focused linear attention of projected q (B, N, C), k and v (B, n, C).

    Args:
        scale (Tensor): the learnable scale parameter (C elements); the
            mapping divides by ``softplus(scale)``.
        focusing_factor (float): the power p.
        num_heads (int): heads h; C = h * d.
        key_mask (Tensor, optional): (B, n) bool, False for keys (padding)
            that take no part in any query's attention (an image without
            any key gets 0).
        overwrite_qk (bool): q and k may be overwritten when no gradient is
            recorded (saves two buffers in inference).

    Returns:
        Tensor: (B, N, C) in v's dtype.
    """
    check_call(q, k, v, scale, focusing_factor, num_heads, key_mask)
    fn = backend_of('attention', q, k, v, key_mask, num_heads)
    return fn(q, k, v, scale, focusing_factor, num_heads, key_mask, overwrite_qk)


def check_call(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, focusing_factor: float,
               num_heads: int, key_mask: Optional[Tensor]) -> None:
    """A clear error for a bad call of :func:`focused_linear_attention`, on
    every backend: their own reshapes would fail deep inside or, for
    ``num_heads`` not dividing C, return fewer channels."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f'q must be (B, N, C) and k, v (B, n, C), got q {tuple(q.shape)}, '
                         f'k {tuple(k.shape)}, v {tuple(v.shape)}')
    B, N, C = q.shape
    if k.shape[0] != B or k.shape[2] != C or min(B, N, k.shape[1]) < 1:
        raise ValueError(f'q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and '
                         f'channels and hold at least one image and one token')
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 \
            or C % num_heads:
        raise ValueError(f'num_heads must be a positive divisor of C={C}, got {num_heads!r}')
    if isinstance(focusing_factor, bool) or not isinstance(focusing_factor, (int, float)) \
            or not 0 < focusing_factor < float('inf'):
        raise ValueError(f'focusing_factor must be a positive number, got {focusing_factor!r}')
    if scale.numel() != C:
        raise ValueError(f'scale must hold C={C} elements, got shape {tuple(scale.shape)}')
    if key_mask is not None and (key_mask.dtype != torch.bool or
                                 key_mask.shape != k.shape[:2]):
        raise ValueError(f'key_mask must be bool of shape {tuple(k.shape[:2])}, got '
                         f'{key_mask.dtype} {tuple(key_mask.shape)}')


def in_fp32(fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, *args) -> Tensor:
    """``fn(q, k, v, *args)`` on fp32 copies of q, k, v (fp64 stays fp64) with
    autocast off, the output in v's dtype: the sums over tokens of every
    PyTorch-ops attention (both backends here, the compared designs) in fp32
    under half precision."""
    dtype = v.dtype
    ct = torch.promote_types(dtype, torch.float32)
    with autocast_off(q.device.type):
        out = fn(q.to(ct), k.to(ct), v.to(ct), *args)
    return out.to(dtype)


def exact_fp32(dtype: torch.dtype) -> bool:
    """Whether fp32 inputs must take exact (IEEE) dots: torch's matmul setting
    (:func:`_cuda_matmul_is_ieee`)."""
    return dtype == torch.float32 and _cuda_matmul_is_ieee()


@torch.compiler.assume_constant_result
def _cuda_matmul_is_ieee() -> bool:
    """torch's CUDA matmul setting for fp32, read through the API it was set with
    (``fp32_precision`` is ``'tf32'`` or ``'ieee'`` once either API sets it;
    reading the legacy ``allow_tf32`` after the new API raises). A constant to
    torch.compile: dynamo cannot trace the C getter behind ``fp32_precision``
    (a graph break in every fp32 CUDA layer). Each graph keeps the value it was
    traced with; dynamo's guard on the global TF32 state recompiles when the
    setting changes (an exported program keeps it)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, 'fp32_precision', 'none')
    if precision in ('tf32', 'ieee'):
        return precision == 'ieee'
    return not matmul.allow_tf32


def focusing_scale(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """softplus(scale) as (C,) in ``dtype``: the divisor of the focused mapping
    from the layer's raw ``scale`` parameter, for every backend."""
    return F.softplus(scale.to(dtype)).view(-1)


def inverse_focusing_scale(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """1 / softplus(scale), (C,) in ``dtype``: the factor the fast backends
    take. One ``reciprocal`` (``1.0 / x`` is a reciprocal and a multiply)."""
    return focusing_scale(scale, dtype).reciprocal()


def register_op_pair(name: str, forward: tuple, backward: tuple, autograd: tuple) -> None:
    """``flatten_mm::NAME`` and ``flatten_mm::NAME_backward`` as ``torch.library``
    custom ops, each from its (implementation, fake implementation), the forward's
    autograd formula from (backward function, setup_context): compilers and
    export see one opaque op each way. An op whose signature changes needs a
    new name: Inductor's on-disk caches of compiled graphs do not key on the
    schemas of the custom ops they call."""
    fwd = torch.library.custom_op(f'flatten_mm::{name}', mutates_args=())(forward[0])
    fwd.register_fake(forward[1])
    bwd = torch.library.custom_op(f'flatten_mm::{name}_backward', mutates_args=())(backward[0])
    bwd.register_fake(backward[1])
    fwd.register_autograd(autograd[0], setup_context=autograd[1])


def _torch_backend(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, focusing_factor: float,
                   num_heads: int, key_mask: Optional[Tensor], overwrite_qk: bool) -> Tensor:
    """The hand-written autograd function."""
    return in_fp32(lambda q, k, v: FocusedLinearAttentionFn.apply(
        q, k, v, inverse_focusing_scale(scale, q.dtype), focusing_factor, num_heads, key_mask,
        overwrite_qk), q, k, v)


def _reference_backend(q: Tensor, k: Tensor, v: Tensor, scale: Tensor, focusing_factor: float,
                       num_heads: int, key_mask: Optional[Tensor], overwrite_qk: bool) -> Tensor:
    """The formula with autograd."""
    def formula(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        s = focusing_scale(scale, q.dtype)
        return linear_attention(focusing_map(q, s, focusing_factor),
                                focusing_map(k, s, focusing_factor), v, num_heads, key_mask)
    return in_fp32(formula, q, k, v)


register_backend('torch', _torch_backend)
register_backend('reference', _reference_backend)


def apply_environment() -> None:
    """Take the override from ``FLATTEN_MM_ATTN_BACKEND`` if set (called once
    the package has registered its backends)."""
    name = os.environ.get('FLATTEN_MM_ATTN_BACKEND')
    if name:
        set_backend(name)
