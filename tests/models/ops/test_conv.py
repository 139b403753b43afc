"""The depth-wise conv of tokens (flatten_mm/models/ops/conv.py): the custom op
``flatten_mm::depthwise_conv`` that graphs compiled for a GPU take, against the
plain conv, and what it spares Inductor's backward."""
import pytest
import torch
import torch.nn.functional as F

from flatten_mm.models.ops.conv import depthwise_conv_op, depthwise_conv_tokens


def conv_of_tokens(x, hw, weight, bias):
    """The formula: the conv on an NCHW copy of the tokens."""
    B, L, C = x.shape
    x_map = x.transpose(1, 2).reshape(B, C, *hw)
    local = F.conv2d(x_map, weight, bias, padding=weight.shape[-1] // 2, groups=C)
    return local.flatten(2).transpose(1, 2)


def outputs_and_grads(fn, tensors, g):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return [out] + list(torch.autograd.grad(out, leaves, g.to(out.dtype)))


@pytest.mark.parametrize('B,hw,C,K,sliced', [(2, (5, 7), 6, 3, False), (1, (4, 9), 8, 5, True)])
def test_op_equals_the_conv(B, hw, C, K, sliced):
    """Output and the gradients of x, weight and bias, fp32, odd grids, K 3 and
    5, x whole or a channel slice (CSwin's V in its q, k, v); the op's schema,
    fake and autograd registrations by torch's opcheck."""
    torch.manual_seed(0)
    L = hw[0] * hw[1]
    base = torch.randn(B, L, 3 * C if sliced else C, dtype=torch.float64)
    weight, bias = torch.randn(C, 1, K, K, dtype=torch.float64), torch.randn(C, dtype=torch.float64)
    g = torch.randn(B, L, C, dtype=torch.float64)
    want = outputs_and_grads(lambda *t: conv_of_tokens(t[0][..., -C:], hw, t[1], t[2]),
                             (base, weight, bias), g)
    got = outputs_and_grads(lambda *t: depthwise_conv_op(t[0][..., -C:], hw, t[1], t[2]),
                            [t.float() for t in (base, weight, bias)], g.float())
    for name, a, b in zip(('out', 'x', 'weight', 'bias'), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)
    assert got[0].is_contiguous()
    x = base.float().requires_grad_()[..., -C:]
    torch.library.opcheck(torch.ops.flatten_mm.depthwise_conv.default,
                          (x, weight.float().requires_grad_(), *hw))


def test_op_casts_as_autocast_casts_a_conv():
    """Under autocast (bf16) the op's operands and result are bf16, as the
    conv's; the gradients reach the fp32 weight and bias in fp32."""
    torch.manual_seed(0)
    hw, C = (6, 5), 8
    x = torch.randn(2, 30, C)
    weight, bias = torch.randn(C, 1, 3, 3), torch.randn(C)
    g = torch.randn(2, 30, C)
    with torch.autocast('cpu', torch.bfloat16):
        want = outputs_and_grads(lambda *t: depthwise_conv_tokens(t[0], hw, t[1], t[2]),
                                 (x, weight, bias), g)
        got = outputs_and_grads(lambda *t: depthwise_conv_op(t[0], hw, t[1], t[2]),
                                (x, weight, bias), g)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.bfloat16] + [
        torch.float32] * 3
    for name, a, b in zip(('out', 'x', 'weight', 'bias'), got, want):
        # both sum the taps of bf16 operands; the bias is added in bf16 here
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 8e-3, name


def test_op_in_a_graph_inductor_compiles(monkeypatch):
    """PVTv2's MLP compiled by Inductor with the op forced (on CPU; it takes the
    op only on GPUs): output and gradients equal eager, and the compiled code's
    checks that the op's results have the strides its fake implementation
    promised pass at run time."""
    from flatten_mm.models.layers import Mlp
    from flatten_mm.models.ops import conv
    torch.manual_seed(0)
    mlp = Mlp(16, 32, with_dwconv=True)
    x = torch.randn(2, 5 * 7, 16)
    params = list(mlp.parameters())

    def run(fn):
        leaf = x.clone().requires_grad_()
        out = fn(leaf, (5, 7))
        return [out] + list(torch.autograd.grad(out.square().sum(), [leaf] + params))
    want = run(mlp)
    taken = []

    def on_gpu(t):
        taken.append(torch.compiler.is_compiling())
        return torch.compiler.is_compiling()
    monkeypatch.setattr(conv, 'compiled_for_gpu', on_gpu)
    torch._dynamo.reset()
    try:
        got = run(torch.compile(mlp, fullgraph=True))
    finally:
        torch._dynamo.reset()
    assert taken and all(taken)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
