"""The depth-wise convolution of V, with a hand-written weight gradient on CPUs,
:func:`depthwise_conv_tokens`, such a conv of tokens (also PVTv2's MLP), and
:func:`depthwise_conv_add`, the attention output plus that conv, whose fused
form (:mod:`.triton_conv`) the attention backend switch chooses."""
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..utils import (autocast_input, in_export_trace, is_exporting, map_to_tokens,
                     must_call, tokens_to_map)
from .dispatch import backend_of, register_backend, register_op_pair


class DepthwiseConvFn(torch.autograd.Function):
    """``F.conv2d(x, weight, bias, padding=k // 2, groups=C)``, with the weight
    gradient as one grouped convolution of x by the output gradient, in place of
    mkldnn's own depth-wise weight gradient (see docs/benchmarks.md for the timings).

    x is saved in the layout it comes in (V's own channels-last memory from
    the attention module: no new bytes); backward takes a transient NCHW copy
    of it for the weight gradient.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return F.conv2d(x, weight, bias, padding=weight.shape[-1] // 2, groups=x.shape[1])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        B, C, H, W = x.shape
        k = weight.shape[-1]
        pad = k // 2
        # under autocast the forward ran in half precision: so does the backward
        dtype = grad_out.dtype
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = F.conv2d(grad_out, weight.to(dtype).flip(2, 3), padding=pad, groups=C)
            grad_x = grad_x.to(x.dtype)
        if ctx.needs_input_grad[1]:
            # x as a plain (NCHW) map, zero-padded by the conv itself: no
            # padded copy of x is made (the timings behind the choice: docs/benchmarks.md)
            xc = x.to(dtype).contiguous()
            grad_w = F.conv2d(xc.view(1, B * C, H, W), grad_out.reshape(B * C, 1, H, W),
                              padding=pad, groups=B * C)
            grad_w = grad_w.view(B, C, 1, k, k).sum(0, dtype=weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad_out.sum((0, 2, 3), dtype=weight.dtype)
        return grad_x, grad_w, grad_b


def plain_depthwise_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.conv2d(x, weight, bias, padding=k // 2, groups=C)``."""
    return F.conv2d(x, weight, bias, padding=weight.shape[-1] // 2, groups=x.shape[1])


def depthwise_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.conv2d(x, weight, bias, padding=k // 2, groups=C)`` on any device.

    On CPUs through :class:`DepthwiseConvFn`. Elsewhere the plain conv, whose
    backward is the library's own depth-wise kernels (cuDNN on CUDA for a
    channels-last map): there, :class:`DepthwiseConvFn`'s weight gradient, a
    grouped convolution with an H x W kernel, would fall to a generic kernel.
    """
    if x.device.type == 'cpu' and not in_export_trace():
        return DepthwiseConvFn.apply(x, weight, bias)
    return plain_depthwise_conv(x, weight, bias)


def _tokens_conv_impl(x: Tensor, weight: Tensor, H: int, W: int) -> Tensor:
    """The conv (no bias) of tokens x (B, H*W, C), as contiguous tokens."""
    return map_to_tokens(plain_depthwise_conv(tokens_to_map(x, (H, W)), weight, None)).contiguous()


def _tokens_conv_fake(x: Tensor, weight: Tensor, H: int, W: int) -> Tensor:
    return x.new_empty(x.shape)


def _tokens_conv_backward_impl(grad: Tensor, x: Tensor, weight: Tensor, H: int, W: int,
                               need_x: bool, need_w: bool) -> Tuple[Tensor, Tensor]:
    """Gradients for x and the weight (an empty tensor for one not needed):
    the library's conv backward on channels-last views, as in eager mode."""
    pad = weight.shape[-1] // 2
    grad_x, grad_w, _ = torch.ops.aten.convolution_backward(
        tokens_to_map(grad, (H, W)), tokens_to_map(x, (H, W)), weight, None, [1, 1], [pad, pad],
        [1, 1], False, [0, 0], x.shape[-1], [need_x, need_w, False])
    return (map_to_tokens(grad_x).contiguous() if need_x else x.new_empty(0),
            grad_w.contiguous() if need_w else weight.new_empty(0))


def _tokens_conv_backward_fake(grad: Tensor, x: Tensor, weight: Tensor, H: int, W: int,
                               need_x: bool, need_w: bool) -> Tuple[Tensor, Tensor]:
    return (x.new_empty(x.shape if need_x else 0),
            weight.new_empty(weight.shape if need_w else 0))


def _tokens_conv_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, weight, H, W = inputs
    ctx.save_for_backward(x, weight)
    ctx.hw_shape = (H, W)


def _tokens_conv_backward(ctx: Any, grad: Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    grad_x, grad_w = torch.ops.flatten_mm.depthwise_conv_backward(
        grad, x, weight, *ctx.hw_shape, need_x, need_w)
    return grad_x if need_x else None, grad_w if need_w else None, None, None


register_op_pair('depthwise_conv', (_tokens_conv_impl, _tokens_conv_fake),
                 (_tokens_conv_backward_impl, _tokens_conv_backward_fake),
                 (_tokens_conv_backward, _tokens_conv_setup))


def compiled_for_gpu(x: Tensor) -> bool:
    """Whether x is in a graph torch.compile traces for a GPU (not a CPU); not
    under torch.export, whose graphs keep the plain conv for other consumers."""
    return torch.compiler.is_compiling() and not is_exporting() and x.device.type != 'cpu'


def depthwise_conv_tokens(x: Tensor, hw_shape: Tuple[int, int], weight: Tensor,
                          bias: Optional[Tensor]) -> Tensor:
    """The depth-wise conv (padding K // 2) of tokens x (B, H*W, C) on the
    (H, W) grid, as tokens: :func:`depthwise_conv` of a channels-last view of x.

    In a graph torch.compile traces for a GPU (:func:`compiled_for_gpu`), instead the custom op
    ``flatten_mm::depthwise_conv`` (the same library kernels, each way; the
    bias added outside it, where Inductor fuses it with what follows): the
    Inductor of torch 2.14 lowers a depth-wise conv's backward with the map
    and its gradient copied into the stride order of the weight's gradient,
    which for a (C, 1, K, K) weight is neither channels-last nor NCHW, and
    the gradient copied back: three extra passes over the map (torch 2.11
    kept the conv's own strides: there the op moves the same bytes;
    docs/benchmarks.md, "The compiled step")."""
    if compiled_for_gpu(x):
        return depthwise_conv_op(x, hw_shape, weight, bias)
    return map_to_tokens(depthwise_conv(tokens_to_map(x, hw_shape), weight, bias))


def depthwise_conv_module(conv: nn.Conv2d, x: Tensor, hw_shape: Tuple[int, int]) -> Tensor:
    """``conv`` (a depth-wise ``nn.Conv2d`` with padding K // 2) of tokens x on
    the ``hw_shape`` grid, as tokens: the module on a channels-last view of x,
    or in a graph compiled for a GPU the custom op with its weights (see
    :func:`depthwise_conv_tokens`) if the module is a plain one: not a
    subclass (fake-quantised, adapted), no hooks, the op's own conv."""
    if compiled_for_gpu(x) and is_plain_depthwise(conv):
        return depthwise_conv_op(x, hw_shape, conv.weight, conv.bias)
    return map_to_tokens(conv(tokens_to_map(x, hw_shape)))


def is_plain_depthwise(conv: nn.Module) -> bool:
    """Whether ``conv`` is a plain ``nn.Conv2d`` the op may stand in for (not
    one the layer must call: :func:`~flatten_mm.models.utils.must_call`) that
    computes what the op computes: depth-wise, a square odd kernel, stride 1,
    zero padding K // 2."""
    if type(conv) is not nn.Conv2d or must_call(conv):  # (an nn.Linear is plain too)
        return False
    k = conv.kernel_size[0]
    return (conv.groups == conv.in_channels == conv.out_channels and conv.kernel_size == (k, k)
            and k % 2 == 1 and conv.padding == (k // 2, k // 2) and conv.stride == (1, 1)
            and conv.dilation == (1, 1) and conv.padding_mode == 'zeros')


def depthwise_conv_op(x: Tensor, hw_shape: Tuple[int, int], weight: Tensor,
                      bias: Optional[Tensor]) -> Tensor:
    """:func:`depthwise_conv_tokens` by the custom op, any device, cast as
    autocast casts a conv's operands."""
    x, weight = autocast_input(x), autocast_input(weight)
    out = torch.ops.flatten_mm.depthwise_conv(x, weight, *hw_shape)
    return out if bias is None else out + autocast_input(bias)


Extra = Optional[Tuple[Tensor, Optional[Tensor]]]  # a second kernel (C, 1, K', K') and its bias


def padded_to(weight: Tensor, k: int) -> Tensor:
    """A (C, 1, K, K) kernel centred in k x k zeros; itself, not a copy, if
    K == k (a pad by nothing is still a copy, a kernel launch on a GPU): not to
    be written into. In a graph traced for export (:func:`.utils.in_export_trace`),
    zeros concatenated on each side: torch.onnx's TorchScript exporter does not
    know the kernel's shape after a ``Pad`` and refused the conv (CSwin's LePE merge)."""
    pad = (k - int(weight.shape[-1])) // 2
    if not pad:
        return weight
    if not in_export_trace():
        return F.pad(weight, [pad] * 4)
    for dim in (2, 3):
        zeros = weight.new_zeros(weight.shape[:dim] + (pad,) + weight.shape[dim + 1:])
        weight = torch.cat([zeros, weight, zeros], dim)
    return weight


def merged_kernel(C: int, weight: Tensor, bias: Optional[Tensor], extra: Extra = None
                  ) -> Tuple[Tensor, Optional[Tensor]]:
    """One (C, 1, K, K) depth-wise kernel and (C,) bias from a local term's
    parts: ``weight`` (C', 1, K1, K1) and ``bias`` (C',) serve each of the C / C'
    groups of channels (one head's DWC for every head; C' = C: one kernel per
    channel), plus ``extra`` (weight (C, 1, K2, K2), bias: CSwin's LePE).
    Both are centred, zero-padded convs, so their kernels add, the smaller
    zero-padded to K = max(K1, K2). The parts themselves where they are one
    kernel over C channels."""
    # (ints: channel counts and kernel sizes are the parameters', and a jit
    # trace, as the TorchScript ONNX exporter's, then keeps the kernel's shape)
    if weight.shape[0] != C:
        groups = int(C) // int(weight.shape[0])
        weight = weight.repeat(groups, 1, 1, 1)
        bias = None if bias is None else bias.repeat(groups)
    if extra is None:
        return weight, bias
    k = max(int(weight.shape[-1]), int(extra[0].shape[-1]))
    weight = padded_to(weight, k) + padded_to(extra[0], k)
    if extra[1] is not None:
        bias = extra[1] if bias is None else bias + extra[1]
    return weight, bias


def torch_conv_add(out: Tensor, x: Tensor, hw_shape: Tuple[int, int], weight: Tensor,
                   bias: Optional[Tensor], extra: Extra = None, inplace: bool = True) -> Tensor:
    """:func:`depthwise_conv_add` by PyTorch ops: the parts merged into one
    kernel (:func:`merged_kernel`), the conv on a channels-last view of x,
    added to out's grid rows in place (or not)."""
    weight, bias = merged_kernel(x.shape[-1], weight, bias, extra)
    local = depthwise_conv_tokens(x, hw_shape, weight, bias)
    P = out.shape[1] - local.shape[1]
    if not inplace:
        return out + local if not P else torch.cat([out[:, :P], out[:, P:] + local], 1)
    (out[:, P:] if P else out).add_(local)
    return out


def depthwise_conv_add(out: Tensor, x: Tensor, hw_shape: Tuple[int, int], weight: Tensor,
                       bias: Optional[Tensor], extra: Extra = None) -> Tensor:
    """``out + conv2d(x, w, b, padding=K // 2, groups=C)`` for tokens x (B, H*W, C)
    on the (H, W) grid: the attention output plus DWC(V). ``out`` may hold P
    prefix tokens first, (B, P + H*W, C): they get no conv term. The kernel
    (w, b) is given as parts (:func:`merged_kernel`): ``weight`` (C', 1, K, K)
    and ``bias`` (C',) for every group of C' channels (C' = C, or a head's
    width), plus an optional ``extra`` (weight, bias) over all C channels
    (CSwin's LePE). A fused backend reads the parts where they are; the
    PyTorch form merges them first (a repeat, a pad and two adds a call, and
    their backward).

    Op ``'conv_add'`` of the backend switch (:func:`.dispatch.set_backend`): a
    backend's fused form where it has one (``'triton'``, registered with the
    tensors ``'auto'`` sends it: ``supports(out, x, weight, bias, extra)``),
    else :func:`torch_conv_add`, adding in place into ``out``.
    """
    return backend_of('conv_add', out, x, weight, bias, extra)(out, x, hw_shape, weight, bias,
                                                               extra)


register_backend('torch', torch_conv_add, op='conv_add')
