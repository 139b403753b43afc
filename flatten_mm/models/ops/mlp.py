"""The token MLP (fc1, GELU, fc2) chunked over tokens, forward and backward."""
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


# tokens per chunk of TokenMlpFn: a chunk's hidden activations (2048 x 4C) are a
# scratch buffer small enough to be reused warm by every chunk, and its products
# still large enough for BLAS (the timings behind the figure: docs/benchmarks.md)
MLP_CHUNK_ROWS = 2048


def token_mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, chunk: int,
              hidden: Optional[Tensor] = None) -> Tensor:
    """``fc2(gelu(fc1(x)))`` on (..., C) tokens, ``chunk`` tokens at a time, the
    hidden activations in one scratch buffer reused by every chunk. With
    ``hidden`` (N, D) for the N tokens, the pre-activations fc1(x) are kept there."""
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    n = x.shape[0]
    scratch = x.new_empty(min(chunk, n), w1.shape[0])
    out = x.new_empty(n, w2.shape[0])
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        act = scratch[:e - s]
        if hidden is not None:
            torch.ops.aten.gelu.out(torch.addmm(b1, x[s:e], w1.t(), out=hidden[s:e]), out=act)
        else:
            torch.ops.aten.gelu_(torch.addmm(b1, x[s:e], w1.t(), out=act))
        torch.addmm(b2, act, w2.t(), out=out[s:e])
    return out.view(*lead, w2.shape[0])


class TokenMlpFn(torch.autograd.Function):
    """:func:`token_mlp` with a chunked backward.

    The hidden activations (4C per token) exist one chunk at a time, in
    scratch buffers reused by every chunk, instead of as whole-map tensors:
    a fresh allocation of whole-map size is new pages from the kernel, whose
    first touch is paid on top of the arithmetic (docs/benchmarks.md).
    Only x and the pre-activation fc1(x) are saved; backward recomputes the
    GELU chunk by chunk (the plain MLP keeps the activation as well).

    Args (forward): x (..., C), w1 (D, C), b1 (D,), w2 (C', D), b2 (C',), and
    the tokens per chunk.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor,
                chunk: int) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        hidden = x2.new_empty(x2.shape[0], w1.shape[0])
        out = token_mlp(x, w1, b1, w2, b2, chunk, hidden)
        ctx.save_for_backward(x2, hidden, w1, w2)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x2, hidden, w1, w2 = ctx.saved_tensors
        need_x, need_w1, need_b1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        n, chunk = x2.shape[0], ctx.chunk
        grad_x = torch.empty_like(x2) if need_x else None
        grad_w1 = torch.zeros_like(w1) if need_w1 else None
        grad_w2 = torch.zeros_like(w2) if need_w2 else None
        grad_b1 = w1.new_zeros(w1.shape[0]) if need_b1 else None
        act_buf = x2.new_empty(min(chunk, n), w1.shape[0]) if need_w2 else None
        grad_buf = x2.new_empty(min(chunk, n), w1.shape[0])
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h, g = hidden[s:e], g2[s:e]
            if need_w2:
                grad_w2.addmm_(g.t(), torch.ops.aten.gelu.out(h, out=act_buf[:e - s]))
            grad_h = torch.mm(g, w2, out=grad_buf[:e - s])
            torch.ops.aten.gelu_backward.grad_input(grad_h, h, grad_input=grad_h)  # in place
            if need_b1:
                grad_b1 += grad_h.sum(0)
            if need_w1:
                grad_w1.addmm_(grad_h.t(), x2[s:e])
            if need_x:
                torch.mm(grad_h, w1, out=grad_x[s:e])
        grad_b2 = g2.sum(0) if need_b2 else None
        if grad_x is not None:
            grad_x = grad_x.view(grad_out.shape[:-1] + (x2.shape[1],))
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None
