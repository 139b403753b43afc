"""The ``'triton'`` form of the attention output's local term: ``out + DWC(V)``
(the layer's depth-wise conv, with CSwin's LePE folded in; prefix tokens
such as a class token take none) as one fused
Triton kernel, and its backward, as ``torch.library`` custom ops.

Why a kernel of its own: on CUDA the plain path is a conv on a (B, C, H, W)
view of V (cuDNN's depth-wise kernels, or PyTorch's generic one), written
out, then read again by the in-place add into the attention output. The
kernel reads V's token rows where they are, sums the K x K taps in fp32, adds
the bias and the attention output, and writes the sum once (rounded once):
per element one read of V and out and one write, instead of a conv's write
and an add's three passes. Swin's windows (7 x 7 grids, thousands per batch)
are rows of one sweep, not thousands of tiny images.

The conv's kernel comes in parts (:func:`.conv.merged_kernel`): the DWC's
d-channel kernel and bias, which every head shares, and CSwin's LePE (its own
3 x 3 kernel per channel); the kernels read each channel's taps from the parts,
so no merged kernel is built (on the PyTorch path a repeat, a pad and two adds
each call, and their backward).

Backward: out's gradient passes through; V's is the same kernel with the
kernel rotated by 180 degrees (no bias, no addend); the weight and bias
gradients are one sweep over the rows that reads each block of the output
gradient once for all K x K taps, in chunks whose fp32 partials one more
launch sums and splits into the parts' gradients (the shared kernel's summed
over the heads).

:func:`.conv.depthwise_conv_add` takes this form under the ``'triton'`` backend,
and under ``'auto'`` for CUDA tensors on sm_80 and later
(:func:`.triton_backend.auto_runs_on`), each first configuration checked against
the PyTorch path as the attention kernels are (:func:`.triton_backend.agrees_once`).
"""
from types import ModuleType
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .conv import Extra, torch_conv_add
from .dispatch import register_backend, register_op_pair
from .triton_backend import (AVAILABLE, DTYPES, agrees_once, auto_runs_on, channel_rows,
                             kernel_impl, lazy_module, run_guarded, settled)

_KERNELS = {}


def kernels() -> ModuleType:
    """The conv kernels module, imported on first use."""
    return lazy_module(_KERNELS, 'triton_conv_kernels')


@kernel_impl
def _add_impl(out: Tensor, x: Tensor, weight: Tensor, bias: Tensor, extra_weight: Optional[Tensor],
              extra_bias: Optional[Tensor], H: int, W: int) -> Tensor:
    """out (B, P + H*W, C) with DWC(x) added to its last H*W rows (the grid's;
    P prefix tokens, a class token, are copied); the kernel in parts."""
    out = channel_rows(out)
    P = out.shape[1] - H * W
    result = torch.empty(out.shape, dtype=out.dtype, device=out.device)
    if P:
        result[:, :P] = out[:, :P]
    kernels().conv_add(channel_rows(x), weight.contiguous(), bias.contiguous(), out[:, P:], (H, W),
                       out=result[:, P:], extra=extra_part(extra_weight, extra_bias))
    return result


def extra_part(weight: Optional[Tensor], bias: Optional[Tensor]
               ) -> Optional[Tuple[Tensor, Tensor]]:
    """The extra part (contiguous), or None."""
    return None if weight is None else (weight.contiguous(), bias.contiguous())


def _add_fake(out: Tensor, x: Tensor, weight: Tensor, bias: Tensor,
              extra_weight: Optional[Tensor], extra_bias: Optional[Tensor], H: int, W: int
              ) -> Tensor:
    return out.new_empty(out.shape)


@kernel_impl
def _backward_impl(grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor,
                   extra_weight: Optional[Tensor], extra_bias: Optional[Tensor], H: int, W: int
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of x and of the kernel's parts (empty for an absent extra part)."""
    ks, x = kernels(), channel_rows(x)
    grad = channel_rows(grad)[:, grad.shape[1] - H * W:]  # the grid's rows
    extra = extra_part(extra_weight, extra_bias)
    weight, bias = weight.contiguous(), bias.contiguous()
    grad_x = ks.conv_add(grad, weight, None, None, (H, W), flip=True, dtype=x.dtype, extra=extra)
    grads = ks.weight_grad(grad, x, weight, bias, (H, W), extra)
    return (grad_x, *grads) if extra else (grad_x, *grads, weight.new_empty(0),
                                           bias.new_empty(0))


def _backward_fake(grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor,
                   extra_weight: Optional[Tensor], extra_bias: Optional[Tensor], H: int, W: int
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    extra = (weight.new_empty(0), bias.new_empty(0)) if extra_weight is None else \
        (extra_weight.new_empty(extra_weight.shape), extra_bias.new_empty(extra_bias.shape))
    return (x.new_empty(x.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape),
            *extra)


def _setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    _, x, weight, bias, extra_weight, extra_bias, H, W = inputs
    ctx.save_for_backward(x, weight, bias, extra_weight, extra_bias)
    ctx.hw = H, W


def _backward(ctx: Any, grad: Tensor) -> tuple:
    """out's gradient is the output's; the rest from the backward op (none for
    an absent extra part)."""
    x, weight, bias, extra_weight, extra_bias = ctx.saved_tensors
    grads = torch.ops.flatten_mm.triton_local_conv_add_backward(
        grad, x, weight, bias, extra_weight, extra_bias, *ctx.hw)
    if extra_weight is None:
        grads = (*grads[:3], None, None)
    return (grad, ) + tuple(grads) + (None, None)


def check_conv_call(out: Tensor, x: Tensor, hw: Tuple[int, int], weight: Tensor,
                    bias: Optional[Tensor], extra: Extra = None) -> None:
    """ValueError naming the value unless x is (B, H*W, C) and out (B, P + H*W, C)
    of x's dtype (a supported one), weight (C', 1, K, K) with K odd and C' dividing
    C, bias (C',), and the extra part, if any, (C, 1, K', K') with K' odd and
    bias (C,)."""
    if x.dim() != 3 or out.dim() != 3 or x.shape[1] != hw[0] * hw[1] or \
            out.shape[0] != x.shape[0] or out.shape[2] != x.shape[2] or \
            out.shape[1] < x.shape[1]:
        raise ValueError(f'x must be (B, H*W, C) with (H, W) = {tuple(hw)} and out (B, P + H*W, '
                         f'C), got out {tuple(out.shape)}, x {tuple(x.shape)}')
    C = x.shape[-1]
    check_kernel_part('weight', weight, bias, C, shared=True)
    if extra is not None:
        check_kernel_part('extra weight', extra[0], extra[1], C, shared=False)
    if x.dtype not in DTYPES or out.dtype != x.dtype:
        raise ValueError(f"the 'triton' depth-wise conv takes out and x of one dtype in "
                         f'{DTYPES}, got out {out.dtype}, x {x.dtype}')


def check_kernel_part(name: str, weight: Tensor, bias: Optional[Tensor], C: int,
                      shared: bool) -> None:
    """ValueError unless ``weight`` is (C', 1, K, K) with K odd, C' = C or (if
    ``shared``) a divisor of C, and ``bias`` (C',)."""
    Cw, K = (weight.shape[0], weight.shape[-1]) if weight.dim() == 4 else (0, 0)
    fits = Cw > 0 and (C % Cw == 0 if shared else Cw == C)
    if not fits or weight.shape[1:] != (1, K, K) or K % 2 == 0:
        allowed = f'a divisor of C={C}' if shared else f'= C = {C}'
        raise ValueError(f"the 'triton' depth-wise conv's {name} must be (C', 1, K, K) with "
                         f"C' {allowed} and K odd, got {tuple(weight.shape)}")
    if bias is None or bias.shape != (Cw, ):
        raise ValueError(f"the 'triton' depth-wise conv's {name} needs a bias of shape ({Cw},), "
                         f'got {None if bias is None else tuple(bias.shape)}')


def triton_conv_add(out: Tensor, x: Tensor, hw: Tuple[int, int], weight: Tensor,
                    bias: Optional[Tensor], extra: Extra = None) -> Tensor:
    """``out + DWC(x)`` by the fused op (:func:`.conv.depthwise_conv_add`'s signature),
    a new tensor. Its fallback does not write into ``out`` either: a caller may hand
    it a view it must not write (the @identity bound of benchmark_backbone.py hands q)."""
    check_conv_call(out, x, hw, weight, bias, extra)
    parts = (weight, bias, *(extra or (None, None)))
    return run_guarded(
        _KERNELS, 'depth-wise conv kernel',
        lambda: torch.ops.flatten_mm.triton_local_conv_add(out, x, *parts, hw[0], hw[1]),
        lambda: _agrees_on_first_use(out, x, hw, weight, bias, extra),
        lambda: torch_conv_add(out, x, hw, weight, bias, extra, inplace=False))


def _agrees_on_first_use(out: Tensor, x: Tensor, hw: Tuple[int, int], weight: Tensor,
                         bias: Tensor, extra: Extra) -> bool:
    """:func:`.triton_backend.agrees_once` for the fused conv: a configuration is
    the device, x's dtype, the parts' shapes and dtypes, C (which sets the
    channel blocks) and whether out has prefix rows; the probe takes enough
    images for a row block to span two of them (Swin's 49-token windows), at
    least one."""
    B, L, C = x.shape
    parts = (weight, bias, *(extra or ()))
    key = ('conv', x.device, x.dtype, C, out.shape[1] > L,  # prefix rows
           tuple((tuple(t.shape), t.dtype) for t in parts))
    if settled(key):  # (and under compile no kernels import traced: a guard on it
        return True   # recompiled every graph once the kernels ran)
    n = min(B, -(-2 * kernels().conv_plan(1, C).block_p // L))
    ks = ' + '.join(f'{t.shape[-1]}x{t.shape[-1]}' for t in parts[::2])
    return agrees_once(key,
                       lambda o, v, w, b, *e: torch.ops.flatten_mm.triton_local_conv_add(
                           o, v, w, b, *(e or (None, None)), *hw),
                       lambda o, v, w, b, *e: torch_conv_add(o, v, hw, w, b, e or None,
                                                             inplace=False),
                       (out[:n], x[:n], *parts),
                       ('result', 'out', 'x', 'weight', 'bias', 'extra weight', 'extra bias'),
                       'depth-wise conv kernels', f'{ks} kernel, C={C}')


def supports(out: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor],
             extra: Extra = None) -> bool:
    """``'auto'`` takes the fused op for tokens of one supported dtype with
    biases (the extra part's too) where :func:`.triton_backend.auto_runs_on`
    their device (CUDA)."""
    return (auto_runs_on(x.device) and x.dim() == 3 and x.dtype in DTYPES and
            out.dtype == x.dtype and bias is not None and
            (extra is None or extra[1] is not None))


if AVAILABLE:  # flatten_mm::triton_local_conv_add and its _backward (the kernel in parts;
    # the op named triton_conv_add before took one merged kernel: a new schema, a new name)
    register_op_pair('triton_local_conv_add', (_add_impl, _add_fake),
                     (_backward_impl, _backward_fake), (_backward, _setup_context))
    register_backend('triton', triton_conv_add, auto=supports, op='conv_add')
