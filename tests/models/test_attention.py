import re

import pytest
import torch
import torch.nn.functional as F

from flatten_mm import FocusedLinearAttention
from flatten_mm.analysis import reference_forward
from flatten_mm.conversion import fit_to_model, swin_convert
from flatten_mm.models.ops import EPS
from flatten_mm.models.resize import resize_tokens

from backbone_checks import OpLog, calls_of


def make_module(C=32, heads=1, sr=1, grid=(6, 7), **kw):
    m = FocusedLinearAttention(C, heads, sr_ratio=sr, pos_grid=grid, **kw).double()
    with torch.no_grad():  # non-trivial values for every parameter
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def explicit_attention(m, x, hw):
    """phi(Q) phi(K)^T row-normalised, applied to V, plus DWC: the slow way."""
    B, N, C = x.shape
    h, d = m.num_heads, m.head_dims
    q = m.q(x)
    if m.sr_ratio > 1:
        r = m.sr_ratio
        xm = x.transpose(1, 2).reshape(B, C, *hw)
        xm = F.pad(xm, (0, -hw[1] % r, 0, -hw[0] % r), mode='replicate')
        kx = m.norm(m.sr(xm).flatten(2).transpose(1, 2))
        grid = (-(-hw[0] // r), -(-hw[1] // r))
    else:
        kx, grid = x, hw
    kv = m.kv(kx)
    k, v = kv[..., :C], kv[..., C:]
    pe = F.interpolate(m.positional_encoding.transpose(1, 2).reshape(1, C, *m.pos_grid),
                       size=grid, mode='bilinear', align_corners=False)
    k = k + pe.flatten(2).transpose(1, 2)
    s = F.softplus(m.scale)

    def phi(t):
        a = (torch.relu(t) + EPS) / s
        ap = a ** m.focusing_factor
        return ap / ap.norm(dim=-1, keepdim=True) * a.norm(dim=-1, keepdim=True)

    fq, fk = phi(q), phi(k)
    out = torch.zeros_like(q)
    for i in range(h):
        sl = slice(i * d, (i + 1) * d)
        A = fq[..., sl] @ fk[..., sl].transpose(1, 2)  # (B, N, n)
        # row-normalised; the release's stable normaliser adds eps to the
        # mean, i.e. n * eps to the row sum
        A = A / (A.sum(-1, keepdim=True) + A.shape[-1] * EPS)
        out[..., sl] = A @ v[..., sl]
    vm = v.transpose(1, 2).reshape(B, C, *grid)
    if grid != hw:
        vm = F.interpolate(vm, size=hw, mode='bilinear', align_corners=False)
    for i in range(h):  # the d-channel DWC, head by head
        sl = slice(i * d, (i + 1) * d)
        out[..., sl] += m.dwc(vm[:, sl]).flatten(2).transpose(1, 2)
    return m.proj(out)


@pytest.mark.parametrize('heads,sr,hw', [(1, 1, (6, 7)), (4, 1, (9, 5)), (1, 2, (8, 10)),
                                         (4, 2, (12, 14)), (2, 3, (9, 9)),
                                         (2, 2, (7, 9)), (1, 4, (3, 2))])
def test_linear_form_equals_explicit_matrix(heads, sr, hw):
    m = make_module(C=32, heads=heads, sr=sr, grid=(4, 5))
    x = torch.randn(2, hw[0] * hw[1], 32, dtype=torch.float64)
    got = m(x, hw)
    want = explicit_attention(m, x, hw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference_forward(m, x, hw), want, rtol=1e-5, atol=1e-5)


def test_float32_matches_reference():
    m = make_module(C=64, heads=2, grid=(8, 8)).float()
    x = torch.randn(2, 100, 64)
    torch.testing.assert_close(m(x, (10, 10)), reference_forward(m, x, (10, 10)),
                               rtol=1e-5, atol=1e-5)


def test_focusing_sharpens_and_keeps_norm():
    from flatten_mm import focusing_map
    x = torch.tensor([[1.0, 2.0, 4.0]], dtype=torch.float64)
    out = focusing_map(x, torch.ones(3, dtype=torch.float64), 3)
    a = torch.relu(x) + EPS
    torch.testing.assert_close(out.norm(), a.norm())
    # direction of a**3: the largest channel's share grows
    assert out[0, 2] / out[0, 0] == pytest.approx((4 + EPS) ** 3 / (1 + EPS) ** 3)


def test_positional_encoding_resized_in_2d():
    m = make_module(C=8, heads=1, grid=(2, 3))
    with torch.no_grad():
        # a ramp along the width only: a 2-D resize keeps rows identical
        m.positional_encoding.copy_(torch.tensor([0., 1., 2.]).repeat(2).view(1, 6, 1).expand(1, 6, 8))
    pe = m.positional_encoding_for((4, 6)).view(4, 6, 8)
    assert torch.equal(pe[0], pe[3])
    assert pe[0, 0, 0] == 0 and pe[0, -1, 0] == 2


def test_key_mask_excludes_padding():
    from flatten_mm import focusing_map
    m = make_module(C=16, heads=2, grid=(4, 4))
    x = torch.randn(1, 16, 16, dtype=torch.float64)
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[0, [3, 7, 11, 12, 13, 14, 15]] = False  # bottom row and right column padded
    real = mask[0]
    got = m(x.masked_fill(~mask[..., None], 0), (4, 4), mask)
    # whatever the padded tokens hold, real tokens see the same result
    junk = m(x.masked_fill(~mask[..., None], 50.), (4, 4), mask)
    torch.testing.assert_close(got[mask], junk[mask])
    # and it is attention over the 9 real keys only, computed explicitly
    q, k, v, _ = m.project_qkv(x, (4, 4))
    s = F.softplus(m.scale)
    fq, fk = focusing_map(q, s, 3), focusing_map(k, s, 3)
    v = v * mask[..., None]
    out = torch.zeros_like(q)
    for sl in (slice(0, 8), slice(8, 16)):
        A = fq[0, :, sl] @ fk[0, real][:, sl].T
        A = A / (A.sum(-1, keepdim=True) + real.sum() * EPS)
        out[0, :, sl] = A @ v[0, real][:, sl]
        out[0, :, sl] += m.dwc(v[0, :, sl].T.reshape(1, 8, 4, 4)).flatten(2)[0].T
    torch.testing.assert_close(got[mask], m.proj(out)[mask])


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision_autocast_is_finite(dtype):
    m = FocusedLinearAttention(64, 2, pos_grid=(8, 8))
    x = torch.randn(2, 64, 64) * 100
    with torch.autocast('cpu', dtype=dtype):
        out = m(x, (8, 8))
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    ref = m(x, (8, 8))
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.05


@pytest.mark.parametrize('sr_ratio', [1, 2])
def test_projections_cast_their_input_once_under_autocast(sr_ratio):
    """q, k and v are products of one input (k and v of the reduced tokens
    where keys are reduced): under autocast each input is cast once, not once
    per product or for the key reduction's conv (a pass over the tokens each,
    and another per gradient); x's gradient stays
    fp32. (Autocast caches the casts of leaf tensors only: x here is not one.)"""
    class Fp32Norm(torch.nn.Module):  # CUDA's autocast runs LayerNorm in fp32, CPU's not
        def __init__(self, norm):
            super().__init__()
            self.norm = norm

        def forward(self, t):
            return self.norm(t).float()
    layer = FocusedLinearAttention(16, 2, sr_ratio=sr_ratio)
    if sr_ratio > 1:
        layer.norm = Fp32Norm(layer.norm)
    leaf = torch.randn(2, 6 * 8, 16, requires_grad=True)
    x, outs = leaf * 1, []
    with torch.autocast('cpu', dtype=torch.bfloat16):
        calls = calls_of(torch.ops.aten._to_copy, lambda: outs.append(layer(x, (6, 8))))
    out = outs[0]
    # x, or a view of it (the key reduction's conv takes x as a map)
    casts = ['x' if args[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
             else tuple(args[0].shape) for args in calls if args[0].dtype == torch.float32]
    assert casts.count('x') == 1, casts
    assert casts.count((2, 12, 16)) == (sr_ratio > 1), casts  # the reduced tokens
    out.float().sum().backward()
    assert leaf.grad.dtype == torch.float32 and torch.isfinite(leaf.grad).all()


def test_gradients_reach_every_parameter():
    m = make_module(C=16, heads=2, sr=2, grid=(3, 3)).float()
    x = torch.randn(2, 36, 16, requires_grad=True)
    m(x, (6, 6)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


@pytest.mark.parametrize('kwargs,match', [
    (dict(embed_dims=30, num_heads=4), 'divisible'),
    (dict(embed_dims=32, num_heads=4, kernel_size=4), 'kernel_size must be odd'),
    (dict(embed_dims=32, num_heads=4, kernel_size=-1), 'kernel_size must be odd .* or 0 for no DWC; got -1'),
    (dict(embed_dims=32, num_heads=4, kernel_size=2.0), 'kernel_size .* got 2.0'),
    (dict(embed_dims=32, num_heads=4, design='softmax'), "design must be one of .*'focused'.*got 'softmax'"),
    (dict(embed_dims=32, num_heads=4, sr_ratio=0), 'sr_ratio'),
    (dict(embed_dims=32, num_heads=4, focusing_factor=-1), 'focusing_factor'),
    (dict(embed_dims=32, num_heads=4, pos_grid=(3, 0)), 'pos_grid'),
    (dict(embed_dims=32, num_heads=4, attn_drop=0.1), 'attn_drop'),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FocusedLinearAttention(**kwargs)


def test_bad_input_shapes():
    m = FocusedLinearAttention(32, 4)
    with pytest.raises(ValueError, match=r'hw_shape \(5, 5\) does not match N=24'):
        m(torch.randn(1, 24, 32), (5, 5))
    with pytest.raises(ValueError, match=r'x must be \(B, N, 32\)'):
        m(torch.randn(1, 25, 16), (5, 5))
    with pytest.raises(ValueError, match=r'key_mask must be bool .* got torch.float32 \(1, 25\)'):
        m(torch.randn(1, 25, 32), (5, 5), torch.ones(1, 25))  # a float mask: was taken
    # an empty batch, no tokens, negative sides whose product is N: failed deep inside
    for x, hw in ((torch.randn(0, 16, 32), (4, 4)), (torch.randn(1, 0, 32), (0, 4)),
                  (torch.randn(1, 16, 32), (-4, -4))):
        named = re.escape(f'got x {tuple(x.shape)}, hw_shape {hw}')
        with pytest.raises(ValueError, match='at least one image and hw_shape be positive, '
                                             + named):
            m(x, hw)


def test_fused_qkv_checkpoint_is_split():
    m = FocusedLinearAttention(16, 2, pos_grid=(4, 4))
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    qkv_w = torch.cat([sd.pop('q.weight'), sd.pop('kv.weight')]) + 1
    qkv_b = torch.cat([sd.pop('q.bias'), sd.pop('kv.bias')]) + 1
    sd['qkv.weight'], sd['qkv.bias'] = qkv_w, qkv_b
    m.load_state_dict(swin_convert(sd))  # what a FLatten-Swin model applies on load
    torch.testing.assert_close(m.q.weight, qkv_w[:16])
    torch.testing.assert_close(m.kv.bias, qkv_b[16:])


def test_positional_encoding_of_other_grid_is_resized_on_load():
    m = FocusedLinearAttention(8, 1, pos_grid=(4, 4))
    sd = m.state_dict()
    sd['positional_encoding'] = torch.ones(1, 64, 8)  # an 8x8 grid
    m.load_state_dict(fit_to_model(sd, m))  # what every FLatten model applies on load
    torch.testing.assert_close(m.positional_encoding, torch.ones(1, 16, 8))


@pytest.mark.parametrize('src,dst', [((2, 3), (4, 6)), ((7, 5), (3, 9)), ((5, 5), (5, 8)),
                                     ((1, 4), (3, 2)), ((6, 4), (6, 4))])
def test_resize_tokens_equals_bilinear_interpolate(src, dst):
    tokens = torch.randn(2, src[0] * src[1], 3, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, dst[0] * dst[1], 3, dtype=torch.float64)
    got = resize_tokens(tokens, src, dst)
    grid = tokens.transpose(1, 2).reshape(2, 3, *src)
    want = F.interpolate(grid, size=dst, mode='bilinear', align_corners=False)
    want = want.flatten(2).transpose(1, 2)
    torch.testing.assert_close(got, want)
    g_got, = torch.autograd.grad(got, tokens, grad)
    g_want, = torch.autograd.grad(want, tokens, grad)
    torch.testing.assert_close(g_got, g_want)


@pytest.mark.parametrize('dst', [(6, 5), (4, 5)])  # rows resized or not: baddbmm or add
@pytest.mark.parametrize('x_dtype', [torch.float32, torch.bfloat16])
def test_add_resized_under_autocast_as_x_plus_interpolate(dst, x_dtype):
    """x + the resized fp32 parameter under bf16 autocast, as
    ``x + F.interpolate(...)``: fp32 (a bf16 x is promoted, as PVT's and
    DeiT's residual stream is in the official models) and unrounded, and a
    new tensor (x is the residual stream, which autograd keeps). Before: the
    resized copy rounded to bf16 (error up to 9e-3 for N(0, 1) values), the
    out-of-place sum with resized rows bf16 (1.4e-2), and a bf16 x's sum
    bf16. (k plus its encoding goes in place into the q, k, v product:
    :func:`add_resized_to_block_`, below.)"""
    from flatten_mm.models.resize import add_resized, resize_parts
    pos = torch.randn(1, 4 * 7, 8)
    x = torch.randn(2, dst[0] * dst[1], 8).to(x_dtype)
    grid = pos.transpose(1, 2).reshape(1, 8, 4, 7)
    want = x.float() + F.interpolate(grid, size=dst, mode='bilinear',
                                     align_corners=False).flatten(2).transpose(1, 2)
    kept = x.clone()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        parts = resize_parts(pos, (4, 7), dst)
        got = add_resized(x, parts)
    assert parts[1].dtype == got.dtype == torch.float32
    assert got.data_ptr() != x.data_ptr() and torch.equal(x, kept)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('dst', [(6, 5), (4, 5)])  # rows resized or not
@pytest.mark.parametrize('prefix', [0, 1])
def test_add_resized_to_block_writes_in_place_in_training(dst, prefix):
    """k's positional encoding goes into k's columns of the q, k, v product in
    place, in training too: values and gradients as the out-of-place sum of
    the block, no other column or prefix row touched, and no copy of the
    product's gradient in backward (an in-place add on a view would clone it)."""
    from flatten_mm.models.resize import add_resized_to_block_, resize_parts
    B, n, C = 2, prefix + dst[0] * dst[1], 8
    pos = torch.randn(1, 4 * 7, C, requires_grad=True)
    leaf = torch.randn(B * n, 3 * C, requires_grad=True)
    x = leaf * 1
    ptr = x.data_ptr()
    got = add_resized_to_block_(x, resize_parts(pos, (4, 7), dst), dst, C, B).view(B, n, 3 * C)
    assert got.data_ptr() == ptr
    want = (leaf * 1).view(B, n, 3 * C)
    want = torch.cat([want[..., :C], torch.cat([want[:, :prefix, C:2 * C], want[:, prefix:, C:2 * C]
                      + resize_tokens(pos, (4, 7), dst)], 1), want[..., 2 * C:]], -1)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(got)
    with OpLog() as log:
        got.backward(grad)
    assert not {'clone', 'copy_', 'new_zeros'} & set(log.names), log.names
    got_grads = (leaf.grad.clone(), pos.grad.clone())
    leaf.grad = pos.grad = None
    want.backward(grad)
    torch.testing.assert_close(got_grads[0], leaf.grad)
    torch.testing.assert_close(got_grads[1], pos.grad)


def test_resize_runs_on_the_meta_device():
    """Shapes without data (meta tensors), where torch.autocast cannot even be
    turned off: the resize and the sum keep working."""
    from flatten_mm.models.resize import add_resized, resize_parts
    pos = torch.randn(1, 4 * 7, 8, device='meta')
    assert resize_tokens(pos, (4, 7), (6, 5)).shape == (1, 30, 8)
    x = torch.randn(2, 30, 8, device='meta', dtype=torch.bfloat16)
    out = add_resized(x, resize_parts(pos, (4, 7), (6, 5)))
    assert out.shape == (2, 30, 8) and out.dtype == torch.float32


def test_layer_compiles_whole_where_dynamo_cannot_trace_the_autocast_query(monkeypatch):
    """The dynamo of torch 2.11 (the torch of the H200 figures) cannot trace
    ``torch.amp.is_autocast_available``; the layer asks it before each
    autocast-off region, so the answer must reach the graph as a constant:
    with the query hidden from dynamo, fullgraph still holds under autocast
    (resized positional encoding, reduced keys) and equals eager."""
    available = torch.amp.is_autocast_available
    monkeypatch.setattr(torch.amp, 'is_autocast_available', torch._dynamo.disable(available))
    layer = FocusedLinearAttention(16, 2, sr_ratio=2, pos_grid=3).train()
    x = torch.randn(2, 7 * 9, 16)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend='eager')
    with torch.autocast('cpu', dtype=torch.bfloat16):
        want, got = layer(x, (7, 9)), compiled(x, (7, 9))
    torch.testing.assert_close(got, want)
    assert got.dtype == torch.bfloat16


@pytest.mark.parametrize('sr_ratio,qkv_bias', [(1, True), (2, True), (1, False)])
def test_projections_are_one_product_per_input(sr_ratio, qkv_bias):
    """q, k and v are one product of x by the q and kv weights stacked (with
    reduced keys: q one product of x, k and v one of the reduced tokens),
    split: the backward takes one product for each input's gradient and one
    for the weights' (before: three each, two sums of x's gradient and a
    zero-filled buffer per weight slice). Under autocast each weight (and
    bias) is cast once, its gradient cast back once: autocast would cast a
    slice of a weight, and its gradient, apart. Values as the two modules."""
    layer = FocusedLinearAttention(32, 2, sr_ratio=sr_ratio, qkv_bias=qkv_bias, pos_grid=(6, 8))
    x = torch.randn(2, 48, 32, requires_grad=True)
    outs = []

    def forward():
        with torch.autocast('cpu', dtype=torch.bfloat16):
            outs.append(layer(x, (6, 8)))
    # the weights as the products take them: transposed, (C_in, C_out)
    widths = sorted([tuple(a[2].shape) for a in calls_of(torch.ops.aten.addmm, forward)] +
                    [tuple(a[1].shape) for a in calls_of(torch.ops.aten.mm, forward)])
    assert widths == ([(32, 32), (32, 96)] if sr_ratio == 1 else  # proj's (32, 32)
                      [(32, 32), (32, 32), (32, 64)]), widths
    outs.clear()
    forward_casts = [tuple(a[0].shape) for a in calls_of(torch.ops.aten._to_copy, forward)]
    grad_out = torch.randn_like(outs[0], dtype=torch.float32)
    backward = calls_of(torch.ops.aten._to_copy, lambda: outs[0].float().backward(grad_out))
    backward_casts = [tuple(a[0].shape) for a in backward]
    stacked = (96, ) if sr_ratio == 1 else (64, )  # kv's 2C outputs, with q's C
    for shape in ((*stacked, 32), stacked) if qkv_bias else ((*stacked, 32), ):
        assert forward_casts.count(shape) == 1, (shape, forward_casts)
        assert backward_casts.count(shape) == 1, (shape, backward_casts)
    # proj's weight, and with reduced keys q's
    assert forward_casts.count((32, 32)) == 1 + (sr_ratio > 1), forward_casts
    outs.clear()
    mm_backward = calls_of(torch.ops.aten.mm, lambda: (forward(), outs[-1].float().backward(
        grad_out)))
    # proj, and each product's input and weight gradients (the forward's mm too)
    assert len(mm_backward) == 2 + 2 + 2 * (sr_ratio > 1) + (not qkv_bias) * (len(widths) - 1)
    assert layer.kv.weight.grad.dtype == torch.float32 and layer.kv.weight.grad.abs().sum() > 0
    assert layer.q.weight.grad.abs().sum() > 0
    # the values: the layer's two projections applied one by one
    with torch.no_grad():
        q, k, v, grid = layer.project_qkv(x, (6, 8))
        xk = x if sr_ratio == 1 else layer.norm(layer.sr(x.transpose(1, 2).reshape(
            2, 32, 6, 8)).flatten(2).transpose(1, 2))
        torch.testing.assert_close(q, layer.q(x))
        k_want, v_want = layer.kv(xk).chunk(2, -1)
        torch.testing.assert_close(v, v_want)
        torch.testing.assert_close(k, k_want + resize_tokens(layer.positional_encoding,
                                                             (6, 8), grid))


def test_torch_func_grad_through_the_positional_encoding_add():
    """torch.func's transforms take the in-place add of k's positional
    encoding (AddToBlock has a setup_context): gradients of a design whose core
    is plain PyTorch equal autograd's."""
    from torch.func import functional_call, grad
    m = FocusedLinearAttention(16, 2, design='relu', pos_grid=(3, 4))
    x = torch.randn(1, 30, 16)
    params = dict(m.named_parameters())
    got = grad(lambda p: functional_call(m, p, (x, (5, 6))).sum())(params)
    want = torch.autograd.grad(m(x, (5, 6)).sum(), list(params.values()))
    for name, w in zip(params, want):
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6)
    assert got['positional_encoding'].abs().sum() > 0


def test_half_k_plus_its_encoding_is_rounded_once():
    """A bf16 k plus its fp32 positional encoding: the encoding is resized in
    fp32 and the sum rounded to bf16 once (no half copy of the resized
    encoding, no cast each way), also in training; its gradient stays fp32."""
    from flatten_mm.models.resize import add_resized_to_block_, resize_parts
    pos = torch.randn(1, 4 * 7, 8, requires_grad=True)
    x = torch.randn(2 * 30, 24).to(torch.bfloat16).requires_grad_()
    want = x.detach().float().view(2, 30, 24)[..., 8:16] + resize_tokens(pos, (4, 7), (6, 5))
    product = x * 1
    got = add_resized_to_block_(product, resize_parts(pos, (4, 7), (6, 5)), (6, 5), 8, 2)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(2, 30, 24)[..., 8:16], want.detach().to(torch.bfloat16))
    got.float().sum().backward()
    assert pos.grad.dtype == torch.float32 and torch.isfinite(pos.grad).all()


@pytest.mark.parametrize('kwargs,fused', [
    (dict(), True),  # FLatten-PVT's and -Swin's layers: DWC, keys on the query grid
    (dict(lepe=True), True),  # FLatten-CSwin's: DWC + LePE
    (dict(kernel_size=0, lepe=True), True),  # LePE alone
    (dict(kernel_size=0), False),  # no local term
    (dict(sr_ratio=2), False),  # reduced keys: V resized first
    (dict(num_prefix_tokens=1), True),  # DeiT's class token (no DWC term for it)
    (dict(design='angular'), False),  # another design's core
])
def test_which_layers_take_one_call(monkeypatch, kwargs, fused):
    """An unmasked call takes the one call where the layer's attention is the
    focused core with a local term on the query grid; a masked call, or any
    call with ``fuse_local_term`` off, two ops. Same output either way."""
    from flatten_mm.models import attention
    from flatten_mm.models.ops import attention_with_local_term as real
    layer = FocusedLinearAttention(16, 2, **kwargs)
    assert attention.fuses_local_term(layer) == fused
    calls = []
    monkeypatch.setattr(attention, 'attention_with_local_term',
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randn(2, layer.num_prefix_tokens + 20, 16)
    with torch.no_grad():
        one = layer(x, (4, 5))
        assert len(calls) == fused
        layer(x, (4, 5), torch.ones(2, x.shape[1], dtype=torch.bool) if not
              layer.sr_ratio > 1 else None)
        layer.fuse_local_term = False
        two = layer(x, (4, 5))
    assert len(calls) == fused
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_a_replaced_attend_or_projection_is_not_bypassed():
    """A layer whose attend or project_qkv is replaced, on the instance or in a
    subclass, takes the two ops (the one call would bypass the replacement)."""
    from flatten_mm.models.attention import fuses_local_term

    class Other(FocusedLinearAttention):
        def attend(self, q, k, v, key_mask, overwrite_qk=False, grids=None):
            return q * 0

    layer = FocusedLinearAttention(16, 2)
    assert fuses_local_term(layer)
    layer.project_qkv = lambda x, hw: FocusedLinearAttention.project_qkv(layer, x, hw)
    assert not fuses_local_term(layer)
    other = Other(16, 2)
    assert not fuses_local_term(other)
    x = torch.randn(1, 20, 16)
    with torch.no_grad():  # the output is the DWC term alone: the subclass's core ran
        from flatten_mm.models.attention import add_local_term
        v = other.project_qkv(x, (4, 5))[2]
        want = other.proj(add_local_term(other, torch.zeros(1, 20, 16), v, (4, 5), (4, 5)))
        torch.testing.assert_close(other(x, (4, 5)), want)
