"""The attention designs (flatten_mm/models/designs.py): each formula against
a reference written here from its paper's definition (the explicit N x n
similarity matrix where one exists), in float64, outputs and gradients, with
key masks, reduced keys, odd N, one head, batch 2; the layer per design
(against a reference forward written here), its state-dict keys, its FLOP
count, and every design in every backbone family."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from flatten_mm.models.attention import FocusedLinearAttention
from flatten_mm.models.designs import (DESIGNS, angular_attention, efficient_attention,
                                       efficientvit_attention, hydra_attention,
                                       relu_attention)

EPS = 1e-6
NAMES = tuple(DESIGNS)


def split(x, h):
    B, N, C = x.shape
    return x.reshape(B, N, h, C // h).permute(0, 2, 1, 3)


def merge(x):
    B, h, N, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, N, h * d)


def row_normalised(sim, v, mask, eps):
    """sum_j s_ij v_j / (sum_j s_ij + eps) over the real keys; sim (B, h, N, n)."""
    if mask is not None:
        sim = sim * mask[:, None, None, :].to(sim.dtype)
    return (sim @ v) / (sim.sum(-1, keepdim=True) + eps)


def naive_relu(q, k, v, h, mask=None, eps=EPS):
    sim = F.relu(split(q, h)) @ F.relu(split(k, h)).transpose(-1, -2)
    return merge(row_normalised(sim, split(v, h), mask, eps))


def naive_efficient(q, k, v, h, mask=None):
    rho_q = torch.exp(split(q, h))
    rho_q = rho_q / rho_q.sum(-1, keepdim=True)  # each query over its channels
    ek = torch.exp(split(k, h))
    if mask is not None:
        ek = ek * mask[:, None, :, None].to(ek.dtype)
    rho_k = ek / ek.sum(-2, keepdim=True)  # each key channel over the tokens
    weights = rho_q @ rho_k.transpose(-1, -2)  # (B, h, N, n): rows sum to 1
    return merge(weights @ split(v, h))


def naive_hydra(q, k, v, mask=None):
    qn = q / q.pow(2).sum(-1, keepdim=True).sqrt()
    kn = k / k.pow(2).sum(-1, keepdim=True).sqrt()
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for t in range(k.shape[1]):
            if mask is None or mask[b, t]:
                out[b] += qn[b] * (kn[b, t] * v[b, t])  # per channel: its own head
    return out


def naive_angular(q, k, v, h, mask=None):
    qh, kh = split(q, h), split(k, h)
    qh = qh / qh.norm(dim=-1, keepdim=True)
    kh = kh / kh.norm(dim=-1, keepdim=True)
    sim = 0.5 + (qh @ kh.transpose(-1, -2)) / math.pi
    return merge(row_normalised(sim, split(v, h), mask, EPS))


FORMULAS = {
    'relu': (relu_attention, naive_relu),
    'efficient': (efficient_attention, naive_efficient),
    'hydra': (hydra_attention, lambda q, k, v, h, mask=None: naive_hydra(q, k, v, mask)),
    'angular': (angular_attention, naive_angular),
    'efficientvit': (efficientvit_attention,
                     lambda q, k, v, h, mask=None: naive_relu(q, k, v, h, mask, 1e-15)),
}
# (batch, queries, keys, channels, heads, masked)
CASES = [(2, 13, 13, 12, 3, True), (2, 15, 4, 8, 2, False), (1, 7, 7, 6, 1, True),
         (2, 9, 9, 4, 1, False)]


def inputs(B, N, n, C, masked, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, m, C, generator=g, dtype=torch.float64)
               for m in (N, n, n))
    mask = None
    if masked:
        mask = torch.rand(B, n, generator=g) > 0.4
        mask[:, 0] = True
    return q, k, v, mask


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('name', sorted(FORMULAS))
def test_formula_matches_naive_reference(name, case):
    B, N, n, C, h, masked = case
    fast, naive = FORMULAS[name]
    q, k, v, mask = inputs(B, N, n, C, masked)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fast(q, k, v, h, mask)
    ref = naive(q, k, v, h, mask)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    if mask is not None:  # a masked key's value takes no part
        v2 = v.detach().clone()
        v2[~mask] = 1e3
        torch.testing.assert_close(fast(q, k, v2, h, mask), out, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('name', sorted(FORMULAS))
def test_formula_gradcheck(name):
    fast, _ = FORMULAS[name]
    q, k, v, mask = inputs(2, 5, 5, 4, True, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: fast(q, k, v, 2, mask), (q, k, v))


def test_efficient_rows_sum_to_one_and_angular_weights_positive():
    q, k, v, _ = inputs(1, 6, 6, 4, False)
    ones = torch.ones_like(v)
    torch.testing.assert_close(efficient_attention(q, k, ones, 2), ones)
    torch.testing.assert_close(angular_attention(q, k, ones, 2), ones, rtol=1e-5, atol=1e-5)


def test_half_precision_sums_in_fp32():
    q, k, v, _ = inputs(1, 9, 9, 8, False)
    for name, (fast, _) in FORMULAS.items():
        ref = fast(q, k, v, 2)
        out = fast(*(t.to(torch.bfloat16) for t in (q, k, v)), 2)
        assert out.dtype == torch.bfloat16, name
        torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.05)


# ---- the layer -----------------------------------------------------------


def layer(name, sr=1, heads=2, C=8, kernel_size=3, lepe=False, grid=(5, 7)):
    torch.manual_seed(0)
    kgrid = tuple(-(-s // sr) for s in grid)
    m = FocusedLinearAttention(C, heads, sr_ratio=sr, design=name, kernel_size=kernel_size,
                               pos_grid=kgrid, lepe=lepe).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def reference_layer_forward(m, x, hw, mask=None):
    """The layer written out from the design docs, with the naive formulas."""
    q = m.q(x)
    xk, grid = x, tuple(hw)
    if m.sr_ratio > 1:
        xm = x.transpose(1, 2).reshape(x.shape[0], -1, *hw)
        xm = F.pad(xm, (0, -hw[1] % m.sr_ratio, 0, -hw[0] % m.sr_ratio), mode='replicate')
        xm = m.sr(xm)
        grid = xm.shape[-2:]
        xk = m.norm(xm.flatten(2).transpose(1, 2))
    k, v = m.kv(xk).chunk(2, dim=-1)
    k = k + m.positional_encoding  # pos_grid is the key grid here
    if mask is not None:
        v = v * mask[..., None].to(v.dtype)
    h, name = m.num_heads, m.attn_design
    if name == 'efficientvit':
        out = reference_efficientvit(m, q, k, v, hw, grid, mask)
    else:
        out = FORMULAS[name][1](q, k, v, h, mask)
    B, C = x.shape[0], x.shape[-1]
    if hasattr(m, 'dwc') or hasattr(m, 'get_v'):
        vm = v.transpose(1, 2).reshape(B, C, *grid)
        if tuple(grid) != tuple(hw):
            vm = F.interpolate(vm, size=tuple(hw), mode='bilinear', align_corners=False)
        local = 0
        if hasattr(m, 'dwc'):  # one d-channel kernel per head
            local = m.dwc(vm.reshape(B * h, C // h, *hw)).reshape(B, C, *hw)
        if hasattr(m, 'get_v'):
            local = local + m.get_v(vm)
        # efficientvit: CSwin's LePE joins its first scale (the one on V itself)
        local = F.pad(local.flatten(2).transpose(1, 2), (0, out.shape[-1] - C))
        out = out + local
    return m.proj(out)


def reference_efficientvit(m, q, k, v, hw, grid, mask):
    """Both scales; the aggregation as EfficientViT's one conv over the 3C
    channels [q, k, v] where q and k, v share a grid."""
    if mask is not None:
        q, k = q * mask[..., None], k * mask[..., None]
    B, C, h = q.shape[0], q.shape[-1], m.num_heads
    if tuple(grid) == tuple(hw):
        qkv = torch.cat([q, k, v], -1).transpose(1, 2).reshape(B, 3 * C, *hw)
        q2, k2, v2 = m.aggreg(qkv).flatten(2).transpose(1, 2).chunk(3, dim=-1)
    else:  # the conv on q's map (zeros for k, v) and on k's and v's (zeros for q)
        zeros = q.new_zeros(*q.shape[:2], 2 * C)

        def agg(t, g):
            return m.aggreg(t.transpose(1, 2).reshape(B, 3 * C, *g)).flatten(2).transpose(1, 2)
        q2 = agg(torch.cat([q, zeros], -1), hw)[..., :C]
        k2, v2 = agg(torch.cat([torch.zeros_like(k), k, v], -1), grid)[..., C:].chunk(2, -1)
    return torch.cat([naive_relu(q, k, v, h, mask, 1e-15),
                      naive_relu(q2, k2, v2, h, mask, 1e-15)], -1)


LAYER_CASES = [dict(sr=1, heads=2, masked=True), dict(sr=2, heads=2, masked=False),
               dict(sr=1, heads=1, masked=False), dict(sr=1, heads=2, lepe=True, masked=True)]


@pytest.mark.parametrize('case', LAYER_CASES, ids=str)
@pytest.mark.parametrize('name', [n for n in NAMES if n != 'focused'])
def test_layer_matches_reference_forward(name, case):
    case = dict(case)
    masked = case.pop('masked')
    hw = (5, 7)
    m = layer(name, grid=hw, **case)
    x = torch.randn(2, hw[0] * hw[1], 8, dtype=torch.float64, requires_grad=True)
    mask = None
    if masked:
        mask = torch.ones(2, hw[0] * hw[1], dtype=torch.bool)
        mask[1, -9:] = False  # padding at the end of the second window
    out = m(x, hw, mask)
    ref = reference_layer_forward(m, x, hw, mask)
    rows = slice(None) if mask is None else mask  # padded queries are discarded
    torch.testing.assert_close(out[rows], ref[rows], rtol=1e-9, atol=1e-11)
    g = torch.randn_like(out) * (1 if mask is None else mask[..., None])
    params = [p for p in m.parameters()]
    grads = torch.autograd.grad(out, [x] + params, g)
    refs = torch.autograd.grad(ref, [x] + params, g, allow_unused=True)
    for (pname, _), a, b in zip([('x', x)] + list(m.named_parameters()), grads, refs):
        assert b is not None, pname
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=pname)


def adapt(module, how):
    """``module`` (a Linear or Conv2d) with an adapter's extra term, a fixed
    product (1x1, at the conv's stride) that mixes all its input channels: a
    subclass with its own forward (``how='subclass'``, as LoRA layers,
    quantised ones), or its forward replaced on the instance (``'instance'``)."""
    conv = isinstance(module, torch.nn.Conv2d)
    n_in = module.in_channels if conv else module.in_features
    n_out = module.out_channels if conv else module.out_features
    mix = 0.3 * torch.randn(n_out, n_in, *((1, 1) if conv else ()), dtype=torch.float64)

    def extra(x):
        return F.conv2d(x, mix, stride=module.stride) if conv else F.linear(x, mix)
    if how == 'instance':
        plain = module.forward
        module.forward = lambda x: plain(x) + extra(x)
        return
    cls = type(module)
    module.__class__ = type(f'Adapted{cls.__name__}', (cls,),
                            {'forward': lambda self, x: cls.forward(self, x) + extra(x)})


@pytest.mark.parametrize('how', ['subclass', 'instance'])
@pytest.mark.parametrize('case', [dict(sr=1, lepe=True, masked=True), dict(sr=2, lepe=False)],
                         ids=str)
@pytest.mark.parametrize('name', [n for n in NAMES if n != 'focused'])
def test_adapted_submodules_are_called(name, case, how):
    """Every Linear and Conv2d of the layer adapted (an extra term that mixes
    channels, parts of EfficientViT's aggregation included): the layer calls
    them, where it would otherwise apply their weights itself (the q, kv
    product, the DWC and LePE, the aggregation), and equals the reference that
    calls every module, with its gradients. (The focused design, in every
    backbone: tests/models/test_tooling.py.)"""
    hw = (5, 7)
    m = layer(name, grid=hw, sr=case['sr'], lepe=case['lepe'])
    for sub in list(m.modules()):
        if type(sub) in (torch.nn.Linear, torch.nn.Conv2d):
            adapt(sub, how)
    x = torch.randn(2, hw[0] * hw[1], 8, dtype=torch.float64, requires_grad=True)
    mask = None
    if case.get('masked'):
        mask = torch.ones(2, hw[0] * hw[1], dtype=torch.bool)
        mask[1, -9:] = False
    rows = slice(None) if mask is None else mask
    out, ref = m(x, hw, mask)[rows], reference_layer_forward(m, x, hw, mask)[rows]
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    g, params = torch.randn_like(out), [x] + list(m.parameters())
    for a, b in zip(torch.autograd.grad(out, params, g),
                    torch.autograd.grad(ref, params, g, allow_unused=True)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_focused_keeps_its_state_dict_keys_and_outputs():
    from flatten_mm.analysis import reference_forward
    m = FocusedLinearAttention(8, 2, pos_grid=(5, 7)).double()
    assert list(m.state_dict()) == ['scale', 'positional_encoding', 'q.weight', 'q.bias',
                                    'kv.weight', 'kv.bias', 'proj.weight', 'proj.bias',
                                    'dwc.weight', 'dwc.bias']
    sr = FocusedLinearAttention(8, 2, pos_grid=(5, 7), sr_ratio=2)
    assert list(sr.state_dict())[8:] == ['sr.weight', 'sr.bias', 'norm.weight', 'norm.bias',
                                         'dwc.weight', 'dwc.bias']
    lepe = FocusedLinearAttention(8, 2, pos_grid=(5, 7), lepe=True)
    assert list(lepe.state_dict())[8:] == ['dwc.weight', 'dwc.bias', 'get_v.weight',
                                           'get_v.bias']
    x = torch.randn(2, 35, 8, dtype=torch.float64)
    torch.testing.assert_close(m(x, (5, 7)), reference_forward(m, x, (5, 7)))


@pytest.mark.parametrize('name', NAMES)
def test_each_design_owns_its_parameters(name):
    keys = set(layer(name, kernel_size=3).state_dict())
    assert ('scale' in keys) == (name == 'focused')
    assert ('dwc.weight' in keys) == (name in ('focused', 'angular'))
    assert ('aggreg.0.weight' in keys) == (name == 'efficientvit')
    no_dwc = set(layer(name, kernel_size=0).state_dict())
    assert not any(k.startswith('dwc.') for k in no_dwc)


def test_kernel_size_zero_drops_the_dwc():
    from flatten_mm.analysis import reference_forward
    m = layer('focused', kernel_size=0)
    x = torch.randn(2, 35, 8, dtype=torch.float64)
    q, k, v, _ = m.project_qkv(x, (5, 7))
    torch.testing.assert_close(m(x, (5, 7)), m.proj(m.attend(q, k, v, None)))
    torch.testing.assert_close(m(x, (5, 7)), reference_forward(m, x, (5, 7)))


def test_efficientvit_attend_needs_grids():
    m = layer('efficientvit')
    q = torch.randn(1, 35, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="'efficientvit' needs the grids"):
        m.attend(q, q, q, None)


@pytest.mark.parametrize('sr', [1, 2])
@pytest.mark.parametrize('name', NAMES)
def test_flop_count_is_the_designs_closed_form(name, sr):
    from flatten_mm.analysis import attention_flops, flop_analyzer
    H, W, C, h = 7, 9, 16, 2
    m = FocusedLinearAttention(C, h, sr_ratio=sr, design=name, kernel_size=3,
                               pos_grid=(-(-H // sr), -(-W // sr))).eval()
    x = torch.randn(2, H * W, C)
    ops = flop_analyzer(m, (x, (H, W))).by_operator()
    core = sum(v for op, v in ops.items()
               if op in ('matmul', 'einsum', 'focused_linear_attention'))
    N, n = H * W, -(-H // sr) * -(-W // sr)
    expected = 2 * m._design.flops(N, n, C, h)
    assert core == expected
    assert attention_flops(m, lambda: m(x, (H, W))) == {name: expected}
    d = C // h
    closed = {'focused': n * C * d + n * C + N * C + N * C * d,
              'relu': (n + N) * C * (d + 1), 'efficient': (n + N) * C * d, 'hydra': n * C,
              'angular': (n + N) * h * (d + 1) ** 2,
              'efficientvit': 2 * (n + N) * C * (d + 1)}[name]
    assert expected == 2 * closed
    if name == 'efficientvit':  # the aggregation: 5x5 depth-wise + 1x1 in groups of d
        assert ops['linear'] == 2 * (N * C * C + n * C * 2 * C + N * 2 * C * C)


@pytest.mark.parametrize('name', NAMES)
def test_flop_count_counts_prefix_keys(name):
    """A class token is one more key: attention_flops counts it as the
    analyzer does (it once counted the grid's keys only)."""
    from flatten_mm.analysis import attention_flops, flop_analyzer, focusing_ops
    H, W, C, h, P = 7, 9, 16, 2, 1
    m = FocusedLinearAttention(C, h, design=name, kernel_size=3, pos_grid=(H, W),
                               num_prefix_tokens=P).eval()
    x = torch.randn(2, P + H * W, C)
    ops = flop_analyzer(m, (x, (H, W))).by_operator()
    core = sum(v for op, v in ops.items()
               if op in ('matmul', 'einsum', 'focused_linear_attention'))
    N = n = P + H * W
    assert core == 2 * m._design.flops(N, n, C, h)
    assert attention_flops(m, lambda: m(x, (H, W))) == {name: core}
    if name == 'focused':
        from flatten_mm.analysis import FOCUS_OPS_PER_ELEMENT
        assert focusing_ops(m, lambda: m(x, (H, W))) == FOCUS_OPS_PER_ELEMENT * C * 2 * (N + n)


def test_design_errors_name_the_value_and_the_designs():
    with pytest.raises(ValueError, match=r"design must be one of \('focused', 'relu', "
                                         r"'efficient', 'hydra', 'angular', 'efficientvit'\), "
                                         r"got 'linear'"):
        FocusedLinearAttention(8, 2, design='linear')


# ---- every design in every family ----------------------------------------

FAMILIES = {
    'FLattenPVT': dict(embed_dims=[8, 16, 16, 16], num_heads=[1, 2, 2, 2], depths=[1, 1, 1, 1],
                       sr_ratios=[2, 1, 1, 1]),
    'FLattenPVTv2': dict(arch='b0', embed_dims=[8, 16, 16, 16], num_heads=[1, 2, 2, 2],
                         depths=[1, 1, 1, 1]),
    'FLattenSwin': dict(embed_dims=8, num_heads=[1, 2, 2, 2], depths=[2, 2, 1, 1],
                        attn_type='LLLL', linear_window=7),
    'FLattenCSwin': dict(embed_dims=8, num_heads=[2, 2, 2, 2], depths=[1, 1, 1, 1],
                         attn_type='LLLL'),
}


def build(family, **kwargs):
    from flatten_mm.models import backbones
    return getattr(backbones, family)(**FAMILIES[family], **kwargs)


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_every_design_in_every_family_trains_at_odd_sizes(family, name):
    torch.manual_seed(0)
    model = build(family, attn_design=name).train()
    outs = model(torch.randn(1, 3, 67, 93))
    assert [tuple(o.shape[-2:]) for o in outs] == [(17, 24), (9, 12), (5, 6), (3, 3)]
    sum(o.pow(2).mean() for o in outs).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    designs = {m.attn_design for m in model.modules() if isinstance(m, FocusedLinearAttention)}
    assert designs == {name}
    other = build(family, attn_design=name)  # its checkpoints load back through the load hook
    other.load_state_dict(model.state_dict())
    for key, value in other.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_focused_is_the_default_with_its_keys(family):
    default = build(family)
    focused = build(family, attn_design='focused')
    assert list(default.state_dict()) == list(focused.state_dict())
    keys = list(default.state_dict())
    assert any(k.endswith('.scale') for k in keys) and any('.dwc.' in k for k in keys)
    relu = set(build(family, attn_design='relu').state_dict())
    assert relu == {k for k in keys if not k.endswith('.scale') and '.dwc.' not in k}


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_backbone_checks_attn_design_and_kernel_size(family):
    with pytest.raises(ValueError, match=r"attn_design must be one of \('focused'.*"
                                         r"got 'performer'"):
        build(family, attn_design='performer')
    with pytest.raises(ValueError, match=r"kernel_size must be odd .* or 0 for no DWC; got 4"):
        build(family, kernel_size=4)
    model = build(family, kernel_size=0)
    assert not any('.dwc.' in k for k in model.state_dict())


def test_timm_factory_passes_attn_design():
    timm = pytest.importorskip('timm')
    import flatten_mm  # noqa: F401  (registers the models)
    model = timm.create_model('flatten_pvt_v2_b0', attn_design='hydra', num_classes=3)
    assert {m.attn_design for m in model.modules()
            if isinstance(m, FocusedLinearAttention)} == {'hydra'}
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)


# ---- FLatten-DeiT: the designs with a class token ------------------------

@pytest.mark.parametrize('name', NAMES)
def test_every_design_in_flatten_deit_trains_with_its_class_token(name):
    """Every design runs in FLatten-DeiT's blocks, whose class token (a prefix
    token: no positional encoding, no DWC or aggregation term) takes part in
    the attention: it receives a gradient through the patch tokens' outputs."""
    from flatten_mm.models.backbones import FLattenDeiT
    torch.manual_seed(0)
    model = FLattenDeiT(embed_dims=16, num_heads=2, depth=2, out_indices=(0, 1),
                        attn_design=name).train()
    outs = model(torch.randn(2, 3, 67, 93))
    assert [tuple(o.shape) for o in outs] == [(2, 16, 5, 6)] * 2  # padded to whole patches
    sum(o.pow(2).mean() for o in outs).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert model.cls_token.grad.abs().sum() > 0
    designs = {m.attn_design for m in model.modules() if isinstance(m, FocusedLinearAttention)}
    assert designs == {name}
    with pytest.raises(ValueError, match=r"attn_design must be one of \('focused'.*got 'x'"):
        FLattenDeiT(embed_dims=16, num_heads=2, depth=2, attn_design='x')


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('shape', [(2, 20), (1, 21)])
def test_key_mask_of_the_wrong_shape_is_named(name, shape):
    """A key mask without the class token's entry, or one for the whole batch,
    is a ValueError naming both shapes in every design (it was a shape error
    from inside torch, and (1, N) ran in some designs only)."""
    m = FocusedLinearAttention(32, 4, design=name, pos_grid=4, num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r'key_mask must be bool \(B, N\) = \(2, 21\), one '
                                         r'entry per token of x, got torch.bool '
                                         + re.escape(str(shape))):
        m(torch.randn(2, 21, 32), (4, 5), torch.ones(shape, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
@pytest.mark.parametrize('name', NAMES)
def test_every_design_on_cuda_equals_cpu(name):
    """On a GPU, in training mode at an odd size (FLatten-Swin: padded windows'
    key masks): outputs and parameter gradients equal the CPU's (fp32, TF32 off);
    under bf16 autocast outputs stay finite and near fp32."""
    torch.manual_seed(0)
    model = build('FLattenSwin', attn_design=name, drop_path_rate=0.).train()
    x = torch.randn(2, 3, 67, 93)

    def run(m, images):
        m.zero_grad()
        outs = m(images)
        sum(o.pow(2).mean() for o in outs).backward()
        return [o.detach().cpu() for o in outs], {
            n: p.grad.detach().cpu() for n, p in m.named_parameters()}

    want, want_grads = run(model, x)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        got, got_grads = run(model.cuda(), x.cuda())
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-3, atol=1e-5, msg=n)
    with torch.no_grad(), torch.autocast('cuda', dtype=torch.bfloat16):
        outs = model(x.cuda())
    for a, b in zip(outs, want):
        assert torch.isfinite(a).all()
        assert ((a.float().cpu() - b).norm() / b.norm()).item() < 3e-2


@pytest.mark.parametrize('kernel_size,pads', [(5, 1), (3, 0), (1, 1)])
def test_dwc_and_lepe_merge_into_one_kernel_padding_only_the_smaller(kernel_size, pads):
    """The layer gives its local term in parts (the DWC's one head, LePE's);
    merged for the PyTorch conv, the DWC (repeated per head) and LePE's 3x3
    kernel add into one kernel of the larger size, centred; a kernel already
    of that size is not padded (a pad by nothing is a copy: a kernel launch
    every training step)."""
    from backbone_checks import calls_of
    from flatten_mm.models.designs import local_kernel
    from flatten_mm.models.ops.conv import merged_kernel
    m = FocusedLinearAttention(8, 2, pos_grid=(5, 7), lepe=True, kernel_size=kernel_size)
    weight, bias, extra = local_kernel(m)
    assert weight is m.dwc.weight and bias is m.dwc.bias
    assert extra[0] is m.get_v.weight and extra[1] is m.get_v.bias
    got = []
    assert len(calls_of(torch.ops.aten.constant_pad_nd,
                        lambda: got.extend(merged_kernel(8, weight, bias, extra)))) == pads
    k = max(kernel_size, 3)
    want = torch.zeros(8, 1, k, k)
    d, o = (k - kernel_size) // 2, (k - 3) // 2
    want[..., d:d + kernel_size, d:d + kernel_size] += m.dwc.weight.repeat(2, 1, 1, 1)
    want[..., o:o + 3, o:o + 3] += m.get_v.weight
    torch.testing.assert_close(got[0], want)
    torch.testing.assert_close(got[1], m.dwc.bias.repeat(2) + m.get_v.bias)
