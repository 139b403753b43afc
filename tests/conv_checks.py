"""What the depth-wise conv tests of tests/models/ops share: the formula on an
NCHW copy of the tokens, and a call's output with its inputs' gradients."""
import torch
import torch.nn.functional as F


def conv_of_tokens(x, hw, weight, bias):
    """The depth-wise conv (padding K // 2) of tokens x (B, H*W, C) on the hw
    grid, on an NCHW copy, in the inputs' dtype, as tokens."""
    B, L, C = x.shape
    x_map = x.transpose(1, 2).reshape(B, C, *hw)
    local = F.conv2d(x_map, weight, bias, padding=weight.shape[-1] // 2, groups=C)
    return local.flatten(2).transpose(1, 2)


def outputs_and_grads(fn, tensors, g):
    """``fn``'s result on leaf copies of ``tensors``, then their gradients for
    the output gradient ``g`` (rounded to the result's dtype)."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    result = fn(*leaves)
    return [result] + list(torch.autograd.grad(result, leaves, g.to(result.dtype)))
