"""The ``'triton'`` form of :func:`.local.attention_with_local_term`: the
attention kernels (:mod:`.triton_kernels`) and the fused DWC's
(:mod:`.triton_conv_kernels`) in one pair of ``torch.library`` custom ops,
``flatten_mm::triton_attention_local`` and its ``_backward``.

It takes the layer's (B, N, 3C) product itself, not q, k and v: the
gradient it returns is that product's, so nothing joins three gradients
afterwards. Forward: the attention writes out, then the conv kernel adds
DWC(v) (and the bias) into out in place. Backward: the attention's passes
write dq, dk and dv into the column thirds of one (B, N, 3C) buffer, then
the conv's input-gradient kernel adds its part of v's gradient into the dv
third in place (each element read and written by the same program), and the
weight-gradient sweep makes the kernel parts' gradients. Against the two ops
(:mod:`.triton_backend`, :mod:`.triton_conv`), the backward has no ``cat`` and
no ``add`` of v's two gradients; the forward and the kernels are the same
(v's gradient is rounded twice, the attention's part as it is stored and then
the sum, where the two ops rounded each part and their sum).

``'auto'`` takes it where it would take both ops' Triton forms; its first use
of a configuration is checked against the two ops' PyTorch forms
(:func:`_agrees_on_first_use`), and a failure on its first call falls back to
the two ops.
"""
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from . import triton_backend as tb
from . import triton_conv as tc
from .conv import Extra
from .dispatch import register_backend, register_op_pair, use_backend
from .local import grid_rows, split_qkv, torch_attention_local

_KERNELS = {}  # 'ran': the op has run (run_guarded)


@tb.kernel_impl
def _forward_impl(qkv: Tensor, scale: Tensor, weight: Tensor, bias: Tensor,
                  extra_weight: Optional[Tensor], extra_bias: Optional[Tensor], H: int, W: int,
                  focusing_factor: float, num_heads: int
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """out = attention + DWC(v), and the attention's fp32 KV, km, row
    statistics of q and k and s_inv, which backward takes."""
    q, k, v = split_qkv(tb.channel_rows(qkv))
    out, kv, km, stats_q, stats_k, s_inv, _ = tb.kernels().forward(
        q, k, v, scale.reshape(-1).contiguous(), focusing_factor, num_heads, None)
    grid = grid_rows(out, (H, W))  # (prefix tokens take no conv term)
    tc.kernels().conv_add(grid_rows(v, (H, W)), weight.contiguous(), bias.contiguous(), grid,
                          (H, W), out=grid, extra=tc.extra_part(extra_weight, extra_bias))
    return out, kv, km, stats_q, stats_k, s_inv


def _forward_fake(qkv: Tensor, scale: Tensor, weight: Tensor, bias: Tensor,
                  extra_weight: Optional[Tensor], extra_bias: Optional[Tensor], H: int, W: int,
                  focusing_factor: float, num_heads: int
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v = split_qkv(qkv)
    return tb._forward_fake(q, k, v, scale, focusing_factor, num_heads, None)[:6]


@tb.kernel_impl
def _backward_impl(grad: Tensor, qkv: Tensor, scale: Tensor, weight: Tensor, bias: Tensor,
                   extra_weight: Optional[Tensor], extra_bias: Optional[Tensor], s_inv: Tensor,
                   kv: Tensor, km: Tensor, stats_q: Tensor, stats_k: Tensor, H: int, W: int,
                   focusing_factor: float, num_heads: int
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of qkv, the raw scale and the kernel's parts (empty for an
    absent extra part)."""
    grad, qkv = tb.channel_rows(grad), tb.channel_rows(qkv)
    q, k, v = split_qkv(qkv)
    grad_qkv = qkv.new_empty(qkv.shape)
    grads = split_qkv(grad_qkv)  # dq, dk, dv: the buffer's column thirds
    ds = tb.kernels().backward(grad, q, k, v, scale.reshape(-1).contiguous(), s_inv, kv, km,
                               stats_q, stats_k, s_inv.new_empty(0), focusing_factor, num_heads,
                               None, grads=grads)[3]
    extra = tc.extra_part(extra_weight, extra_bias)
    weight, bias = weight.contiguous(), bias.contiguous()
    conv, hw = tc.kernels(), (H, W)
    grad, v, dv = (grid_rows(t, hw) for t in (grad, v, grads[2]))  # the grid's rows
    conv.conv_add(grad, weight, None, dv, hw, flip=True, out=dv, extra=extra)  # in place
    parts = conv.weight_grad(grad, v, weight, bias, hw, extra)
    if extra is None:
        parts = (*parts, weight.new_empty(0), bias.new_empty(0))
    return (grad_qkv, ds.view(scale.shape).to(scale.dtype), *parts)


def _backward_fake(grad: Tensor, qkv: Tensor, scale: Tensor, weight: Tensor, bias: Tensor,
                   extra_weight: Optional[Tensor], extra_bias: Optional[Tensor], s_inv: Tensor,
                   kv: Tensor, km: Tensor, stats_q: Tensor, stats_k: Tensor, H: int, W: int,
                   focusing_factor: float, num_heads: int
                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    parts = tc._backward_fake(grad, grad, weight, bias, extra_weight, extra_bias, H, W)[1:]
    return (qkv.new_empty(qkv.shape), scale.new_empty(scale.shape), *parts)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    qkv, scale, weight, bias, extra_weight, extra_bias, H, W, p, h = inputs
    _, kv, km, stats_q, stats_k, s_inv = output
    ctx.save_for_backward(qkv, scale, weight, bias, extra_weight, extra_bias, s_inv, kv, km,
                          stats_q, stats_k)
    ctx.args = H, W, p, h
    ctx.mark_non_differentiable(kv, km, stats_q, stats_k, s_inv)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for those


def _backward(ctx: Any, grad: Optional[Tensor], *_: Optional[Tensor]) -> tuple:
    """Autograd formula of the forward op: the backward op (none for an absent
    extra part)."""
    if grad is None:
        return (None, ) * 10
    saved = ctx.saved_tensors
    grads = torch.ops.flatten_mm.triton_attention_local_backward(grad, *saved, *ctx.args)
    if saved[4] is None:
        grads = (*grads[:4], None, None)
    return tuple(grads) + (None, ) * 4


def _kernels_op(qkv: Tensor, scale: Tensor, focusing_factor: float, num_heads: int,
                hw_shape: Tuple[int, int], weight: Tensor, bias: Tensor,
                extra: Extra) -> Tensor:
    """The forward op's output."""
    return torch.ops.flatten_mm.triton_attention_local(
        qkv, scale, weight, bias, *(extra or (None, None)), hw_shape[0], hw_shape[1],
        float(focusing_factor), int(num_heads))[0]


def _agrees_on_first_use(qkv: Tensor, scale: Tensor, focusing_factor: float, num_heads: int,
                         hw_shape: Tuple[int, int], weight: Tensor, bias: Tensor,
                         extra: Extra) -> bool:
    """:func:`.triton_backend.agrees_once` for the op itself (its in-place conv
    into v's gradient and its writes into the product's gradient are not the
    two ops' code): against the two ops' PyTorch forms, with the attention
    kernels' tolerance. A configuration is the two ops' keys together; the
    probe takes the conv check's images (enough for a row block to span two)."""
    B, N, C3 = qkv.shape
    C, h, parts = C3 // 3, num_heads, (weight, bias, *(extra or ()))
    key = ('attention_local', qkv.device, qkv.dtype, C // h, h == 1, C,
           tb.exact_fp32(qkv.dtype), scale.dtype, N > hw_shape[0] * hw_shape[1],  # prefix
           tuple((tuple(t.shape), t.dtype) for t in parts))
    if tb.settled(key):
        return True
    if N < 2:  # one key: q's and k's gradients are eps-sized noise, no test
        return True
    n = min(B, -(-2 * tc.kernels().conv_plan(1, C).block_p // N))

    def theirs(qkv: Tensor, scale: Tensor, weight: Tensor, bias: Tensor, *extra: Tensor
               ) -> Tensor:
        with use_backend('torch'):  # the two ops' PyTorch forms
            return torch_attention_local(qkv, scale, focusing_factor, h, hw_shape, weight,
                                         bias, extra or None)
    return tb.agrees_once(
        key, lambda *t: _kernels_op(t[0], t[1], focusing_factor, h, hw_shape, t[2], t[3],
                                    t[4:] or None),
        theirs, (qkv[:n], scale, *parts),
        ('out', 'qkv', 'scale', 'weight', 'bias', 'extra weight', 'extra bias'),
        'attention and depth-wise conv kernels', f'head width {C // h}, {h} heads, C={C}',
        tol=tb.agree_tol(qkv.dtype))


def triton_attention_local(qkv: Tensor, scale: Tensor, focusing_factor: float, num_heads: int,
                           hw_shape: Tuple[int, int], weight: Tensor, bias: Optional[Tensor],
                           extra: Extra = None, overwrite_qk: bool = False) -> Tensor:
    """The fused op (:func:`.local.attention_with_local_term`'s signature;
    ``overwrite_qk`` is moot: q and k are only read)."""
    q, k, v = split_qkv(qkv)
    tb.check_dtypes(q, k, v)
    tb.check_head_dim(q.shape[-1], num_heads)
    tc.check_conv_call(v, grid_rows(v, hw_shape), hw_shape, weight, bias, extra)
    args = (qkv, scale, focusing_factor, num_heads, hw_shape, weight, bias, extra)
    return tb.run_guarded(_KERNELS, 'attention and depth-wise conv kernels',
                          lambda: _kernels_op(*args), lambda: _agrees_on_first_use(*args),
                          lambda: torch_attention_local(*args, overwrite_qk))


def supports(q: Tensor, k: Tensor, v: Tensor, num_heads: int, weight: Tensor,
             bias: Optional[Tensor], extra: Extra = None) -> bool:
    """``'auto'`` takes the fused op (for the product's thirds q, k, v) where it
    takes both ops' Triton forms."""
    return tb.supports(q, k, v, None, num_heads) and tc.supports(v, v, weight, bias, extra)


if tb.AVAILABLE:  # flatten_mm::triton_attention_local and its _backward
    register_op_pair('triton_attention_local', (_forward_impl, _forward_fake),
                     (_backward_impl, _backward_fake), (_backward, _setup_context))
    register_backend('triton', triton_attention_local, auto=supports, op='attention_local')
