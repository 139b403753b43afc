"""The attention and its local term as one Triton op (``triton_fused``) against
the two Triton ops it replaces and the 'torch' backend.

Without CUDA the kernels run under Triton's CPU interpreter (conftest.py). The
one op runs the two ops' kernels on the same inputs, so its output and the
gradients of q, k, the scale and the conv's kernel are theirs bit for bit; v's
gradient is the sum of the same two terms, the conv's added in fp32 to the
stored attention term (two roundings, where the two ops rounded each term and
then their sum): within two units of the dtype's roundoff of it (fp32 2^-24,
bf16 2^-8), asserted at 1e-6 and 1e-2 relative.
"""
import warnings

import pytest
import torch

from flatten_mm.models import FocusedLinearAttention
from flatten_mm.models.designs import local_kernel
from flatten_mm.models.ops import attention_with_local_term, use_backend
from flatten_mm.models.ops import triton_backend as tb
from flatten_mm.models.ops import triton_conv as tc
from flatten_mm.models.ops import triton_fused as tf
from flatten_mm.models.ops.local import torch_attention_local

from backbone_checks import OpLog

pytestmark = pytest.mark.skipif(not tb.AVAILABLE, reason='triton does not import')

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
NAMES = ('out', 'qkv', 'scale', 'weight', 'bias', 'extra weight', 'extra bias')


def make(B, hw, C, h, K, lepe, dtype=torch.float32, prefix=0):
    """A layer's product (in ``dtype``; the parameters fp32, as under autocast)
    with ``prefix`` tokens before the grid's, its parameters as leaves, and an
    output gradient."""
    torch.manual_seed(0)
    layer = FocusedLinearAttention(C, h, kernel_size=K, lepe=lepe).to(DEVICE)
    with torch.no_grad():
        layer.scale.normal_()
        for p in (*layer.dwc.parameters(), *(layer.get_v.parameters() if lepe else ())):
            p.normal_()
    N = prefix + hw[0] * hw[1]
    qkv = torch.randn(B, N, 3 * C, device=DEVICE).to(dtype).requires_grad_()
    weight, bias, extra = local_kernel(layer)
    g = torch.randn(B, N, C, device=DEVICE).to(dtype)
    return layer, qkv, (weight, bias, extra), g


def outputs_and_grads(fn, qkv, scale, h, hw, kernel, g):
    """fn's output and the gradients of qkv, the scale and the kernel's parts."""
    weight, bias, extra = kernel
    out = fn(qkv, scale, 3.0, h, hw, weight, bias, extra)
    leaves = [qkv, scale, weight, bias, *(extra or ())]
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


@pytest.mark.parametrize('B,hw,C,h,K,lepe,dtype,prefix', [
    (2, (5, 7), 32, 2, 5, False, torch.float32, 0),  # Swin's and PVT's: DWC, two heads
    (3, (6, 5), 32, 2, 5, True, torch.float32, 0),  # CSwin's: DWC + LePE
    (1, (4, 6), 16, 1, 3, False, torch.float32, 0),  # one head: the fused token passes
    (2, (3, 9), 48, 3, 5, True, torch.bfloat16, 0),  # bf16, three heads
    (2, (4, 5), 32, 2, 5, False, torch.float32, 1),  # DeiT's class token: no DWC term
    (2, (3, 5), 32, 2, 3, True, torch.bfloat16, 2),  # two prefix tokens, LePE, bf16
])
def test_matches_the_two_ops(B, hw, C, h, K, lepe, dtype, prefix):
    """Output and every gradient against the two Triton ops (bit for bit but v's
    gradient, see the module docstring) and against the 'torch' backend."""
    layer, qkv, kernel, g = make(B, hw, C, h, K, lepe, dtype, prefix)

    def call(fn):
        return outputs_and_grads(fn, qkv, layer.scale, h, hw, kernel, g)
    with use_backend('triton'):
        fused = call(attention_with_local_term)
        apart = call(torch_attention_local)  # the two ops, each its Triton form
    # (PyTorch's conv takes the fp32 kernel with half tokens as autocast casts it)
    with use_backend('torch'), torch.autocast(qkv.device.type, dtype=dtype,
                                              enabled=dtype != torch.float32):
        plain = call(attention_with_local_term)
    for name, a, b, c in zip(NAMES, fused, apart, plain):
        if name == 'qkv':
            q, k, v = a.split(C, -1)
            qb, kb, vb = b.split(C, -1)
            assert torch.equal(q, qb) and torch.equal(k, kb), name
            err = ((v.double() - vb.double()).norm() / vb.double().norm()).item()
            assert err < (1e-6 if dtype == torch.float32 else 1e-2), err
        else:
            assert torch.equal(a, b), name
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert ((a.double() - c.double()).norm() / c.double().norm()).item() < tol, name


@pytest.mark.parametrize('lepe', [False, True])
def test_a_layer_is_one_op_each_way(lepe):
    """An unmasked layer between its projections: the forward's one op, and the
    backward's one op, with no cat of q's, k's and v's gradients and no add of
    v's two."""
    layer = FocusedLinearAttention(32, 2, lepe=lepe).to(DEVICE)
    x = torch.randn(2, 30, 32, device=DEVICE, requires_grad=True)
    with use_backend('triton'), OpLog() as log:
        y = layer(x, (5, 6))
    assert 'triton_attention_local' in log.names and 'cat' in log.names  # (q and kv weights)
    assert not {'triton_focused_attention', 'triton_local_conv_add'} & set(log.names)
    with OpLog() as log:
        y.sum().backward()
    # (two ops: their backward ops, then the add of v's gradients and the cat)
    assert log.names.count('triton_attention_local_backward') == 1
    assert 'cat' not in log.names and 'add' not in log.names, log.names


@pytest.mark.parametrize('lepe', [False, True])
def test_opcheck(lepe):
    """Schema, fake implementations, autograd registration and AOT dispatch of both ops."""
    layer, qkv, (weight, bias, extra), g = make(2, (5, 3), 32, 2, 3, lepe)
    extra = extra or (None, None)
    args = [qkv, layer.scale, weight, bias, *extra, 5, 3, 3.0, 2]
    torch.library.opcheck(torch.ops.flatten_mm.triton_attention_local.default, args)
    _, *kept = torch.ops.flatten_mm.triton_attention_local(*args)
    saved = [qkv.detach(), layer.scale.detach(), weight.detach(), bias.detach(),
             *(t if t is None else t.detach() for t in extra)]
    torch.library.opcheck(torch.ops.flatten_mm.triton_attention_local_backward.default,
                          [g, *saved, kept[4], *kept[:4], 5, 3, 3.0, 2])


def test_compile_fullgraph_one_op_each():
    """torch.compile(fullgraph=True) of a layer sees the forward op, AOT
    autograd's backward graph the backward op; results equal eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def record(gm, _):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == 'call_function'})
        return make_boxed_func(gm.forward)
    layer = FocusedLinearAttention(32, 2, lepe=True).to(DEVICE)
    x = torch.randn(2, 30, 32, device=DEVICE)
    torch._dynamo.reset()
    results = []
    with use_backend('triton'):
        compiled = torch.compile(layer, fullgraph=True,
                                 backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        for fn in (compiled, layer):
            layer.zero_grad()
            y = fn(x, (5, 6))
            y.pow(2).sum().backward()
            results.append([y.detach()] + [p.grad.clone() for p in layer.parameters()])
    torch._dynamo.reset()
    assert any('flatten_mm.triton_attention_local.default' in s for s in graphs)
    assert any('flatten_mm.triton_attention_local_backward.default' in s for s in graphs)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('prefix', [0, 1])
def test_first_use_checked_once_and_a_wrong_kernel_falls_back(monkeypatch, prefix):
    """Under 'auto' a configuration's first call is checked against the two ops'
    PyTorch forms (once); a wrong attention kernel, or a wrong in-place conv
    into v's gradient (the op's own code), warns with the errors, returns the
    PyTorch result and sends the process to the 'torch' backend."""
    monkeypatch.setattr(tb, 'get_backend', lambda: 'auto')
    monkeypatch.setattr(tb, '_AGREED', set())
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    monkeypatch.setattr(tf, '_KERNELS', {})
    layer, qkv, (weight, bias, extra), _ = make(2, (5, 7), 32, 2, 5, True, prefix=prefix)
    args = (qkv.detach(), layer.scale, 3.0, 2, (5, 7), weight, bias, extra)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        got = tf.triton_attention_local(*args)
        tf.triton_attention_local(*args)
    (key, ) = tb._AGREED
    assert key[0] == 'attention_local' and key[8] == bool(prefix)  # (prefix rows)
    with use_backend('torch'):
        want = torch_attention_local(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if prefix:  # (the wrong kernels once, without a prefix: the interpreter is slow)
        return
    conv = tc.kernels()
    real = conv.conv_add

    def wrong_in_place(*a, **kw):  # the backward's conv of the gradient into dv, doubled
        return real(*a, **kw) if not kw.get('flip') else kw['out'].mul_(2)
    monkeypatch.setattr(conv, 'conv_add', wrong_in_place)
    monkeypatch.setattr(tb, '_AGREED', set())
    with pytest.warns(RuntimeWarning, match=r'conv kernels disagree .*qkv'):
        got = tf.triton_attention_local(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not tb._KERNELS['importable']
    monkeypatch.setattr(conv, 'conv_add', real)
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    kernels = tb.kernels()
    forward = kernels.forward
    monkeypatch.setattr(kernels, 'forward', lambda *a: (forward(*a)[0] * 1.5, *forward(*a)[1:]))
    monkeypatch.setattr(tb, '_AGREED', set())
    with pytest.warns(RuntimeWarning, match=r'conv kernels disagree .*relative errors out'):
        got = tf.triton_attention_local(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_clear_errors():
    layer, qkv, (weight, bias, _), _ = make(1, (4, 4), 16, 1, 5, False)
    with use_backend('triton'):
        with pytest.raises(ValueError, match=r"takes .*got q in torch.float64"):
            attention_with_local_term(qkv.double(), layer.scale, 3.0, 1, (4, 4), weight, bias)
        with pytest.raises(ValueError, match=r"bias of shape \(16,\), got None"):
            attention_with_local_term(qkv, layer.scale, 3.0, 1, (4, 4), weight, None)
        # the attention's own checks (the kernels would leave channels unset, or read
        # past the scale)
        with pytest.raises(ValueError, match=r'num_heads must be a positive divisor of C=16'):
            attention_with_local_term(qkv, layer.scale, 3.0, 3, (4, 4), weight, bias)
        with pytest.raises(ValueError, match=r'scale must hold C=16 elements, got shape \(8,\)'):
            attention_with_local_term(qkv, torch.zeros(8), 3.0, 1, (4, 4), weight, bias)
        with pytest.raises(ValueError, match=r'focusing_factor must be a positive number'):
            attention_with_local_term(qkv, layer.scale, -1.0, 1, (4, 4), weight, bias)
        wide = torch.randn(1, 16, 3 * 256)
        with pytest.raises(ValueError, match=r'head widths up to 128, got d=256'):
            attention_with_local_term(wide, torch.zeros(256), 3.0, 1, (4, 4),
                                      torch.zeros(256, 1, 3, 3), torch.zeros(256))


def test_export():
    """torch.export of a layer keeps the one op, and the program computes eager's output."""
    layer = FocusedLinearAttention(32, 2, lepe=True).to(DEVICE).eval()
    x = torch.randn(2, 30, 32, device=DEVICE)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x, (5, 6))
    with use_backend('triton'):
        ep = torch.export.export(Layer(), (x, ))
        want = layer(x, (5, 6))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == 'call_function']
    assert 'flatten_mm.triton_attention_local.default' in targets
    torch.testing.assert_close(ep.module()(x), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('B,hw,C,h,lepe', [
    (8, (200, 334), 64, 1, False),  # FLatten-PVT-T's stage 1 at 800 x 1333
    (2, (100, 167), 192, 6, False),  # FLatten-Swin-T's stage 2
    (8, (200, 334), 64, 2, True),  # FLatten-CSwin-T's stage 1
    (64, (14, 14), 384, 6, False),  # FLatten-DeiT-S at 224: a class token first
])
def test_cuda_real_sizes(B, hw, C, h, lepe):
    """The GPU's tiling at real sizes, bf16: the one op against the two Triton ops."""
    prefix = 1 if hw == (14, 14) else 0
    layer, qkv, kernel, g = make(B, hw, C, h, 5, lepe, torch.bfloat16, prefix)
    with use_backend('triton'):
        fused = outputs_and_grads(attention_with_local_term, qkv, layer.scale, h, hw, kernel, g)
        apart = outputs_and_grads(torch_attention_local, qkv, layer.scale, h, hw, kernel, g)
    for name, a, b in zip(NAMES, fused, apart):
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < (1e-2 if name == 'qkv' else 1e-6), (name, err)
