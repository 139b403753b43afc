"""The attention term and the local term of a layer as one call:
``focused_linear_attention(q, k, v) + DWC(v)`` for q, k, v the column thirds of
one (B, P + H*W, 3C) product, with every query seeing every key (no key mask,
no reduced keys); P prefix tokens (a class token) take no DWC term.

Op ``'attention_local'`` of the backend switch (:func:`.dispatch.set_backend`).
Its ``'torch'`` backend is the two ops in turn (each choosing its own backend);
the ``'triton'`` one (:mod:`.triton_fused`) runs both ops' kernels in one custom
op, whose backward writes the gradients of q, k and v into one buffer, v's two
summed in place: the two ops' backward ended in a ``cat`` of the three (the
product's gradient) and an ``add`` of v's, two passes over (B, H*W, C) maps
that this op does not make.
"""
from typing import Optional, Tuple

from torch import Tensor

from .conv import Extra, depthwise_conv_add
from .dispatch import backend_of, check_call, focused_linear_attention, register_backend


def split_qkv(qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v: the column thirds of (B, N, 3C) ``qkv``, as views."""
    return qkv.split(qkv.shape[-1] // 3, -1)


def check_local_call(qkv: Tensor, hw_shape: Tuple[int, int]) -> None:
    """ValueError naming the value unless qkv is (B, P + H*W, 3C) with P >= 0, C >= 1."""
    if qkv.dim() != 3 or qkv.shape[-1] % 3 or not qkv.shape[-1] or \
            qkv.shape[1] < hw_shape[0] * hw_shape[1]:
        raise ValueError(f'qkv must be (B, P + H*W, 3C) with (H, W) = {tuple(hw_shape)}, '
                         f'got {tuple(qkv.shape)}')


def grid_rows(x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
    """The last H*W tokens of (B, P + H*W, C') ``x``, those on the grid after P
    prefix tokens (a class token); ``x`` itself without any. A view: a split,
    whose backward writes x's gradient once, where a slice's fills a zero
    tensor of x's size and copies the gradient in."""
    P = x.shape[1] - hw_shape[0] * hw_shape[1]
    return x.split([P, x.shape[1] - P], 1)[1] if P else x


def torch_attention_local(qkv: Tensor, scale: Tensor, focusing_factor: float, num_heads: int,
                          hw_shape: Tuple[int, int], weight: Tensor, bias: Optional[Tensor],
                          extra: Extra = None, overwrite_qk: bool = False) -> Tensor:
    """The two ops in turn (:func:`attention_with_local_term`'s signature)."""
    q, k, v = split_qkv(qkv)
    out = focused_linear_attention(q, k, v, scale, focusing_factor, num_heads, None,
                                   overwrite_qk)
    return depthwise_conv_add(out, grid_rows(v, hw_shape), hw_shape, weight, bias, extra)


def attention_with_local_term(qkv: Tensor, scale: Tensor, focusing_factor: float,
                              num_heads: int, hw_shape: Tuple[int, int], weight: Tensor,
                              bias: Optional[Tensor], extra: Extra = None,
                              overwrite_qk: bool = False) -> Tensor:
    """``focused_linear_attention(q, k, v, scale, focusing_factor, num_heads) +
    depthwise_conv_add``'s DWC(v) on the ``hw_shape`` grid, for q, k, v the
    column thirds of ``qkv`` (B, P + H*W, 3C; P prefix tokens first, which take
    no DWC term); the conv's kernel in parts (``weight``, ``bias``, ``extra``:
    :func:`.conv.depthwise_conv_add`). ``overwrite_qk``: q and k may be
    overwritten when no gradient is recorded. (B, P + H*W, C) in qkv's dtype.
    A backend with a fused form (``'triton'``, registered with the tensors
    ``'auto'`` sends it: ``supports(q, k, v, num_heads, weight, bias, extra)``,
    q, k, v the thirds) takes it; otherwise the two ops, each on its own
    backend."""
    check_local_call(qkv, hw_shape)
    q, k, v = split_qkv(qkv)
    check_call(q, k, v, scale, focusing_factor, num_heads, None)
    fn = backend_of('attention_local', q, k, v, num_heads, weight, bias, extra)
    return fn(qkv, scale, focusing_factor, num_heads, hw_shape, weight, bias, extra,
              overwrite_qk)


register_backend('torch', torch_attention_local, op='attention_local')
