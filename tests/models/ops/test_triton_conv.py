"""The fused ``out + DWC(V)`` of the 'triton' backend against PyTorch's conv.

Without CUDA the kernels run under Triton's CPU interpreter (conftest.py), which
tiles by 16 rows and 16 channels, two row blocks per weight-gradient chunk, so
the small shapes below cross row, channel, image and chunk borders. Errors are
``||x - ref||_F / ||ref||_F``, the reference in float64 on the same (rounded)
inputs.

Tolerances: the kernel sums the K x K taps in fp32 and rounds each result once
to the tensor's dtype, so fp32 is held to 1e-5 and half precision to about
two units of its roundoff (fp16 2^-11, bf16 2^-8): 1e-3 and 8e-3. The weight
and bias gradients are fp32 sums whatever the inputs: 1e-5.
"""
import contextlib

import pytest
import torch

from backbone_checks import OpLog
from conv_checks import conv_of_tokens, outputs_and_grads
from flatten_mm.models import FocusedLinearAttention
from flatten_mm.models.ops import depthwise_conv_add, use_backend
from flatten_mm.models.ops import triton_backend as tb
from flatten_mm.models.ops import dispatch
from flatten_mm.models.ops import triton_conv as tc

pytestmark = pytest.mark.skipif(not tb.AVAILABLE, reason='triton does not import')

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
NAMES = ('result', 'out', 'x', 'weight', 'bias')


def reference(out, x, hw, weight, bias):
    """The formula: NCHW conv in the inputs' dtype (float64 for the reference)."""
    return out + conv_of_tokens(x, hw, weight, bias)


def make(B, hw, C, K, dtype, device=DEVICE):
    L = hw[0] * hw[1]
    # x a strided view (the value half of one projection), as a layer's v may be
    x = torch.randn(B, L, 2 * C, device=device).to(dtype)[..., C:]
    out = torch.randn(B, L, C, device=device).to(dtype)
    weight = torch.randn(C, 1, K, K, device=device) / K
    bias = torch.randn(C, device=device)
    return out, x, weight, bias, torch.randn(B, L, C, device=device).to(dtype)


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize('B,hw,C,K,dtype', [
    (2, (5, 7), 24, 5, torch.float32),  # odd grid, channels across two blocks of 16
    (6, (7, 7), 32, 5, torch.float32),  # Swin windows: images share row blocks
    (1, (9, 4), 16, 3, torch.float32),  # LePE's 3 x 3, one image
    (2, (3, 3), 16, 7, torch.float32),  # a kernel wider than the grid
    (1, (1, 1), 16, 5, torch.float32),  # one token
    (2, (6, 5), 24, 5, torch.float16),
    (2, (6, 5), 24, 5, torch.bfloat16),
])
def test_matches_conv2d(B, hw, C, K, dtype):
    out, x, weight, bias, g = make(B, hw, C, K, dtype)
    with use_backend('triton'):
        got = outputs_and_grads(lambda *t: depthwise_conv_add(t[0], t[1], hw, t[2], t[3]),
                    (out, x, weight, bias), g)
    ref = outputs_and_grads(lambda *t: reference(t[0], t[1], hw, t[2], t[3]),
                [t.double() for t in (out, x, weight, bias)], g)
    assert got[0].dtype == dtype and got[2].dtype == dtype and got[3].dtype == torch.float32
    for name, a, r in zip(NAMES, got, ref):
        assert a.shape == r.shape, name
        tol = TOL[torch.float32] if name in ('weight', 'bias') else TOL[dtype]
        assert rel_err(a, r) < tol, f'{name}: {rel_err(a, r):.2e}'


@pytest.mark.parametrize('backend', ['torch', 'triton'])
def test_prefix_tokens_take_no_conv(backend):
    """out (B, P + H*W, C): a class token first is copied, the grid's rows take
    the conv; gradients flow to every row of out."""
    out, x, weight, bias, g = make(2, (5, 3), 16, 3, torch.float32)
    out = torch.cat([torch.randn(2, 1, 16), out], 1)
    g = torch.cat([torch.randn(2, 1, 16), g], 1)

    def ref(o, x, w, b):
        return torch.cat([o[:, :1], reference(o[:, 1:], x, (5, 3), w, b)], 1)
    with use_backend(backend):
        got = outputs_and_grads(
            lambda *t: depthwise_conv_add(t[0].clone(), t[1], (5, 3), t[2], t[3]),
            (out, x, weight, bias), g)
    want = outputs_and_grads(ref, (out, x, weight, bias), g)
    for name, a, r in zip(NAMES, got, want):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=name)


def test_torch_path_in_place_and_choice(monkeypatch):
    """'torch' adds in place into out (as before the fused form); 'auto' keeps
    CPU tensors there and takes the fused op where it supports the call."""
    out, x, weight, bias, _ = make(2, (5, 7), 24, 5, torch.float32)
    want = reference(out, x, (5, 7), weight, bias)
    for name in ('torch', 'auto'):
        o = out.clone()
        with use_backend(name):
            got = depthwise_conv_add(o, x, (5, 7), weight, bias)
        assert got is o and torch.allclose(got, want, atol=1e-5)
    # the interpreter standing in for a GPU 'auto' supports (first-use state isolated)
    monkeypatch.setattr(tb, '_AGREED', set())
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    monkeypatch.setitem(dispatch._AUTO['conv_add'], 'triton', lambda *a: True)
    with use_backend('auto'):
        got = depthwise_conv_add(out, x, (5, 7), weight, bias)
    assert got is not out and torch.allclose(got, want, atol=1e-5)


def lepe_part(C, K=3, device=DEVICE):
    """A LePE-like extra part: (C, 1, K, K) weight and (C,) bias."""
    return torch.randn(C, 1, K, K, device=device) / K, torch.randn(C, device=device)


@pytest.mark.parametrize('C,wc,K1,K2,dtype', [
    (24, 8, 5, 3, torch.float32),  # CSwin: a head's 5 x 5 DWC for 3 heads, plus LePE
    (32, 16, 5, None, torch.float32),  # Swin / PVT: the DWC of 2 heads, no LePE
    (16, 8, 1, 3, torch.float32),  # the DWC smaller than LePE's kernel
    (16, 16, 3, 3, torch.float32),  # one head, kernels of one size
    (48, 16, 5, 3, torch.bfloat16),  # channels across blocks of 16, half precision
])
def test_kernel_parts_match_the_merged_conv(C, wc, K1, K2, dtype):
    """The kernel in parts (shared by the heads, plus an extra per channel), read
    where they are: output and every part's gradient equal the merged kernel's
    conv (:func:`merged_kernel`) in float64; each gradient in its part's shape."""
    from flatten_mm.models.ops.conv import merged_kernel
    out, x, _, _, g = make(3, (5, 7), C, 1, dtype)
    parts = [torch.randn(wc, 1, K1, K1, device=DEVICE) / K1, torch.randn(wc, device=DEVICE)]
    if K2:
        parts += list(lepe_part(C, K2))

    def ours(o, v, w, b, *e):
        return depthwise_conv_add(o, v, (5, 7), w, b, tuple(e) or None)

    def ref(o, v, w, b, *e):
        return reference(o, v, (5, 7), *merged_kernel(C, w, b, tuple(e) or None))
    with use_backend('triton'):
        got = outputs_and_grads(ours, (out, x, *parts), g)
    want = outputs_and_grads(ref, [t.double() for t in (out, x, *parts)], g)
    names = NAMES + ('extra weight', 'extra bias')
    for name, a, r, t in zip(names, got, want, (out, out, x, *parts)):
        assert a.shape == t.shape, name
        tol = TOL[torch.float32] if name.endswith(('weight', 'bias')) else TOL[dtype]
        assert rel_err(a, r) < tol, f'{name}: {rel_err(a, r):.2e}'


@pytest.mark.parametrize('C,wc', [(48, 16), (24, 8)])  # 3 groups: a padded group row
def test_weight_gradient_sums_chunks_in_blocks(monkeypatch, C, wc):
    """The chunk sum loads blocks of chunks (a GPU's hundreds of chunks in a
    few loads): with tiles so small that it takes several blocks, the last one
    partly past the chunks, every part's gradient is still the merged conv's."""
    from flatten_mm.models.ops.conv import merged_kernel
    ks = tc.kernels()
    monkeypatch.setattr(ks, 'GRAD_SUM_TILE', 2 * ks.triton.next_power_of_2(C))
    out, x, _, _, g = make(5, (6, 7), C, 1, torch.float32)
    parts = [torch.randn(wc, 1, 5, 5, device=DEVICE) / 5, torch.randn(wc, device=DEVICE),
             *lepe_part(C)]
    chunks = ks.conv_plan(5 * 42, C).chunks
    assert chunks >= 5 and chunks % 2 == 1  # blocks of 2 chunks: the last one half past
    with use_backend('triton'):
        got = outputs_and_grads(lambda o, v, w, b, e, eb: depthwise_conv_add(
            o, v, (6, 7), w, b, (e, eb)), (out, x, *parts), g)
    want = outputs_and_grads(lambda o, v, w, b, e, eb: reference(
        o, v, (6, 7), *merged_kernel(C, w, b, (e, eb))), [t.double() for t in (out, x, *parts)], g)
    for name, a, r in zip(NAMES + ('extra weight', 'extra bias'), got, want):
        assert rel_err(a, r) < TOL[torch.float32], f'{name}: {rel_err(a, r):.2e}'


def test_the_layers_local_term_is_one_op_each_way():
    """A CSwin layer's DWC + LePE on the fused path: the forward dispatches the
    op alone and the backward its backward op alone, where the merged kernel
    took a repeat, a pad and two adds forward and their backward (sums over the
    heads, the pad's slice) each step."""
    from flatten_mm.models.designs import local_kernel
    layer = FocusedLinearAttention(32, 2, lepe=True).to(DEVICE)
    out, x, _, _, g = make(2, (5, 7), 32, 1, torch.float32)
    x.requires_grad_()
    with use_backend('triton'), OpLog() as log:
        y = depthwise_conv_add(out, x, (5, 7), *local_kernel(layer))
    assert log.names == ['triton_local_conv_add'], log.names
    with OpLog() as log:
        y.backward(g)
    # (and the leaves' detach as their .grad is set: no kernel)
    ops = [op for op in log.names if op != 'detach']
    assert ops == ['triton_local_conv_add_backward'], log.names
    assert layer.dwc.weight.grad.shape == (16, 1, 5, 5) and layer.get_v.bias.grad.shape == (32, )


def test_clear_errors():
    out, x, weight, bias, _ = make(1, (4, 4), 16, 5, torch.float32)
    with use_backend('triton'):
        with pytest.raises(ValueError, match=r'\(H, W\) = \(4, 5\)'):
            depthwise_conv_add(out, x, (4, 5), weight, bias)
        with pytest.raises(ValueError, match=r'got out \(1, 15, 16\), x \(1, 16, 16\)'):
            depthwise_conv_add(out[:, 1:], x, (4, 4), weight, bias)
        with pytest.raises(ValueError, match=r'K odd, got \(16, 1, 4, 4\)'):
            depthwise_conv_add(out, x, (4, 4), weight[..., :4, :4], bias)
        with pytest.raises(ValueError, match=r"C' a divisor of C=16 and K odd, got \(6, 1, 5"):
            depthwise_conv_add(out, x, (4, 4), weight[:6], bias[:6])
        with pytest.raises(ValueError,
                           match=r"extra weight must .*C' = C = 16 .*got \(8, 1, 3, 3\)"):
            depthwise_conv_add(out, x, (4, 4), weight, bias, (weight[:8, :, :3, :3], bias[:8]))
        with pytest.raises(ValueError, match=r"C' a divisor of C=16 and K odd, got \(0, 1, 5, 5\)"):
            depthwise_conv_add(out, x, (4, 4), weight[:0], bias[:0])
        with pytest.raises(ValueError, match=r"C' a divisor of C=16 and K odd, got \(16, 25\)"):
            depthwise_conv_add(out, x, (4, 4), weight.view(16, 25), bias)
        with pytest.raises(ValueError, match=r"extra weight needs a bias of shape \(16,\), got "
                                             r"\(8,\)"):
            depthwise_conv_add(out, x, (4, 4), weight, bias, (weight[..., :3, :3], bias[:8]))
        with pytest.raises(ValueError, match=r'bias of shape \(16,\), got None'):
            depthwise_conv_add(out, x, (4, 4), weight, None)
        with pytest.raises(ValueError, match='got out torch.float64'):
            depthwise_conv_add(out.double(), x, (4, 4), weight, bias)


@pytest.mark.parametrize('kwargs,hw,masked', [
    (dict(embed_dims=64, num_heads=2), (7, 7), True),  # a Swin window layer, padded keys
    (dict(embed_dims=32, num_heads=1, sr_ratio=2), (5, 7), False),  # PVT: V resized
    (dict(embed_dims=64, num_heads=2, lepe=True), (6, 5), False),  # CSwin: DWC + LePE
    (dict(embed_dims=32, num_heads=2, num_prefix_tokens=1), (4, 4), False),  # DeiT's class token
])
def test_layer_same_under_both_backends(kwargs, hw, masked):
    """The whole layer in training mode, output and every parameter's gradient:
    'triton' (attention and the fused local term) equals 'torch'."""
    layer = FocusedLinearAttention(**kwargs).to(DEVICE)
    P = layer.num_prefix_tokens
    x = torch.randn(3, P + hw[0] * hw[1], layer.embed_dims, device=DEVICE)
    mask = None
    if masked:
        mask = torch.ones(3, x.shape[1], dtype=torch.bool, device=DEVICE)
        mask[0, -9:] = False
    results = []
    for name in ('torch', 'triton'):
        layer.zero_grad()
        with use_backend(name):
            y = layer(x, hw, mask)
        y.backward(torch.cos(torch.arange(y.numel(), device=DEVICE)).view_as(y))
        results.append([y.detach()] + [p.grad.clone() for p in layer.parameters()])
    for (name, _), a, b in zip([('out', None)] + list(layer.named_parameters()), *results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_layer_under_bf16_autocast():
    """As users train: under bf16 autocast (V and out in bf16, the conv's weight in
    fp32) both backends agree to bf16's rounding in output and every gradient
    (measured 4e-3 to 1e-2; a wrong term is off by O(1))."""
    layer = FocusedLinearAttention(64, 2, lepe=True).to(DEVICE)
    x = torch.randn(3, 30, 64, device=DEVICE)
    results = []
    for name in ('torch', 'triton'):
        layer.zero_grad()
        with use_backend(name), torch.autocast(x.device.type, dtype=torch.bfloat16):
            y = layer(x, (6, 5))
        assert y.dtype == torch.bfloat16
        y.float().pow(2).sum().backward()
        results.append([y.float().detach()] + [p.grad.clone() for p in layer.parameters()])
    for (name, _), a, b in zip([('out', None)] + list(layer.named_parameters()), *results):
        assert rel_err(a, b.double()) < 3e-2, name


@pytest.mark.parametrize('lepe', [False, True])
def test_opcheck(lepe):
    """Schema, fake implementation, autograd registration and AOT dispatch of both
    ops, the kernel one part (a head's, shared) or two (and LePE's)."""
    out, x, weight, bias, g = make(2, (5, 3), 16, 3, torch.float32)
    parts = [weight[:8], bias[:8], *(lepe_part(16) if lepe else (None, None))]
    parts = [t if t is None else t.detach().requires_grad_() for t in parts]
    args = [out.requires_grad_(), x.requires_grad_(), *parts, 5, 3]
    torch.library.opcheck(torch.ops.flatten_mm.triton_local_conv_add.default, args)
    torch.library.opcheck(torch.ops.flatten_mm.triton_local_conv_add_backward.default,
                          [g, x.detach()] + [t if t is None else t.detach() for t in parts] +
                          [5, 3])


def test_compile_fullgraph_one_op_each():
    """torch.compile(fullgraph=True) of the layer's local term sees the forward op,
    and AOT autograd's backward graph the backward op; results equal eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def record(gm, _):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == 'call_function'})
        return make_boxed_func(gm.forward)

    def f(out, x, weight, bias):
        return depthwise_conv_add(out * 2, x, (5, 7), weight, bias)

    tensors = make(2, (5, 7), 24, 5, torch.float32)
    torch._dynamo.reset()
    with use_backend('triton'):
        compiled = torch.compile(f, fullgraph=True,
                                 backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        got = outputs_and_grads(compiled, tensors[:4], tensors[4])
        want = outputs_and_grads(f, tensors[:4], tensors[4])
    assert any('flatten_mm.triton_local_conv_add.default' in s for s in graphs)
    assert any('flatten_mm.triton_local_conv_add_backward.default' in s for s in graphs)
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, msg=name)


def test_first_use_checked_and_a_wrong_kernel_falls_back(monkeypatch):
    """Under 'auto' the first call of a configuration is checked against PyTorch's
    conv (once); a kernel that computes wrong warns with the errors, returns
    PyTorch's result without writing into out, as the op, and the process leaves
    the 'triton' backend."""
    monkeypatch.setattr(tb, 'get_backend', lambda: 'auto')
    monkeypatch.setattr(tb, '_AGREED', set())
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    out, x, weight, bias, _ = make(2, (5, 7), 24, 5, torch.float32)
    want, want_out = reference(out, x, (5, 7), weight, bias), out.clone()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        got = tc.triton_conv_add(out, x, (5, 7), weight, bias)
        tc.triton_conv_add(out, x, (5, 7), weight, bias)
    assert tb._AGREED == {('conv', x.device, torch.float32, 24, False,
                           (((24, 1, 5, 5), torch.float32), ((24, ), torch.float32)))}
    assert torch.allclose(got, want, atol=1e-5)
    kernels = tc.kernels()
    real = kernels.conv_add
    monkeypatch.setattr(kernels, 'conv_add', lambda *a, **kw: real(*a, **kw) * 1.5)
    with pytest.warns(RuntimeWarning, match=r'conv kernels disagree .*3x3 kernel, C=24.* result'):
        got = tc.triton_conv_add(out, x, (5, 7), weight[..., 1:4, 1:4], bias)
    assert torch.equal(out, want_out) and got.data_ptr() != out.data_ptr()
    assert torch.allclose(got, reference(out, x, (5, 7), weight[..., 1:4, 1:4], bias),
                          atol=1e-5) and not tb._KERNELS['importable']


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('B,hw,C,dtype', [
    (8, (200, 334), 64, torch.bfloat16),  # PVT-T stage 1 at 800 x 1333
    (1392, (7, 7), 96, torch.bfloat16),  # Swin-T stage-1 windows, one image
    (2, (100, 167), 128, torch.float32),
])
def test_cuda_real_sizes(B, hw, C, dtype):
    """GPU tiling (64 rows, 32-64 channels, chunked weight gradient) at real sizes."""
    out, x, weight, bias, g = make(B, hw, C, 5, dtype)
    with use_backend('triton'):
        got = outputs_and_grads(lambda *t: depthwise_conv_add(t[0], t[1], hw, t[2], t[3]),
                    (out, x, weight, bias), g)
    ref = outputs_and_grads(lambda *t: reference(t[0], t[1], hw, t[2], t[3]),
                [t.double() for t in (out, x, weight, bias)], g)
    for name, a, r in zip(NAMES, got, ref):
        tol = 1e-4 if name in ('weight', 'bias') else TOL[dtype]
        assert rel_err(a, r) < tol, f'{name}: {rel_err(a, r):.2e}'


def test_first_use_probe_spans_images_and_a_failing_backward_falls_back(monkeypatch):
    """The first-use probe takes enough images for a row block to span two (small
    windows); a backward kernel that cannot be built (first built in the probe)
    warns and leaves for PyTorch instead of failing the step."""
    monkeypatch.setattr(tb, 'get_backend', lambda: 'auto')
    monkeypatch.setattr(tb, '_AGREED', set())
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    kernels = tc.kernels()
    seen = []
    real = kernels.conv_add
    monkeypatch.setattr(kernels, 'conv_add', lambda x, *a, **kw: seen.append(x.shape[0]) or
                        real(x, *a, **kw))
    out, x, weight, bias, _ = make(5, (3, 3), 16, 3, torch.float32)  # 9-token windows
    tc.triton_conv_add(out, x, (3, 3), weight, bias)
    block_p = kernels.conv_plan(1, 16).block_p
    assert seen[1] == -(-2 * block_p // 9) == 4 and len(tb._AGREED) == 1  # 4 windows probed

    def broken(*args):
        raise RuntimeError('cannot build _conv_weight_grad_kernel')
    monkeypatch.setattr(kernels, 'weight_grad', broken)
    out, x, weight, bias, _ = make(2, (5, 7), 24, 5, torch.float32)
    with pytest.warns(RuntimeWarning, match='conv kernels failed on their first check'):
        got = tc.triton_conv_add(out.clone(), x, (5, 7), weight, bias)
    assert torch.allclose(got, reference(out, x, (5, 7), weight, bias), atol=1e-5)
    assert not tb._KERNELS['importable']


def test_kernels_launch_on_their_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: every op's kernels (attention
    and conv, forward and backward) launch inside ``on_device`` of their input,
    so a model on cuda:1 runs on cuda:1 whatever the current device is."""
    entered, real = [], tb.on_device

    def recording(device):
        entered.append(device)
        return contextlib.nullcontext()
    monkeypatch.setattr(tb, 'on_device', recording)  # kernel_impl's, for all six ops
    layer = FocusedLinearAttention(32, 2).to(DEVICE)
    x = torch.randn(2, 20, 32, device=DEVICE)
    with use_backend('triton'):
        layer(x, (4, 5)).sum().backward()
        assert entered == [x.device] * 2  # the attention with its DWC as one op; backward
        layer.fuse_local_term = False
        layer(x, (4, 5)).sum().backward()
    assert entered == [x.device] * 6  # then as two: attention, conv; their backwards
    assert isinstance(real(torch.device('cpu')), contextlib.nullcontext)
    guard = real(torch.device('cuda', 1))  # made, not entered: no GPU needed
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
