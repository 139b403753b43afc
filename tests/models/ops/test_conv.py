"""The depth-wise conv of tokens (flatten_mm/models/ops/conv.py): the custom op
``flatten_mm::depthwise_conv`` that graphs compiled for a GPU take, against the
plain conv, and what it spares Inductor's backward."""
import pytest
import torch

from conv_checks import conv_of_tokens, outputs_and_grads
from flatten_mm.models.ops.conv import depthwise_conv_op, depthwise_conv_tokens


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
    try:  # compiled afresh: the caches' keys do not hold the op's schema
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            got = run(torch.compile(mlp, fullgraph=True))
    finally:
        torch._dynamo.reset()
    assert taken and all(taken)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_frozen_weight_takes_no_weight_gradient():
    """The backward op computes only the gradients autograd asks for."""
    torch.manual_seed(0)
    hw, C = (4, 6), 8
    x = torch.randn(2, 24, C, requires_grad=True)
    weight, bias = torch.randn(C, 1, 3, 3), torch.randn(C)
    g = torch.randn(2, 24, C)
    got, = torch.autograd.grad(depthwise_conv_op(x, hw, weight, bias), x, g)
    want, = torch.autograd.grad(conv_of_tokens(x, hw, weight, bias), x, g)
    torch.testing.assert_close(got, want)
    grad_x, grad_w = torch.ops.flatten_mm.depthwise_conv_backward(g, x, weight, *hw, True, False)
    assert grad_w.numel() == 0 and grad_x.shape == x.shape


def test_op_only_where_a_compiled_gpu_graph_takes_it(monkeypatch):
    """Taken in graphs compiled for a GPU (a non-CPU tensor; here 'meta'), not
    under torch.export nor on CPUs; and only for a plain depth-wise conv: the
    modules of PVTv2's MLP and CSWin's LePE are, a subclass or a hooked module
    is not (the module then runs itself)."""
    from torch import nn
    from flatten_mm.models.backbones.flatten_cswin import LePEAttention
    from flatten_mm.models.layers import Mlp
    from flatten_mm.models.ops import conv
    on_gpu, on_cpu = torch.empty(1, device='meta'), torch.empty(1)
    assert not conv.compiled_for_gpu(on_gpu)
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    assert conv.compiled_for_gpu(on_gpu) and not conv.compiled_for_gpu(on_cpu)
    monkeypatch.setattr(conv, 'is_exporting', lambda: True)
    assert not conv.compiled_for_gpu(on_gpu)
    assert conv.is_plain_depthwise(Mlp(8, 16, with_dwconv=True).dwconv.dwconv)
    assert conv.is_plain_depthwise(LePEAttention(8, 2, 1).get_v)

    class Quantised(nn.Conv2d):
        pass
    hooked = nn.Conv2d(8, 8, 3, padding=1, groups=8)
    hooked.register_forward_hook(lambda *args: None)
    for other in (Quantised(8, 8, 3, padding=1, groups=8), hooked,
                  nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=0, groups=8),
                  nn.Conv2d(8, 8, 3, padding=1, groups=8, stride=2),
                  nn.Conv2d(8, 8, (3, 5), padding=(1, 2), groups=8)):
        assert not conv.is_plain_depthwise(other), other
