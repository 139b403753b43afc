import pytest
import torch
import torch.nn.functional as F

from flatten_mm import FLattenCSwin
from flatten_mm.conversion import cswin_convert
from flatten_mm.models.backbones.flatten_cswin import CSwinBlock, LePEAttention

from backbone_checks import (assert_autocast_finite, assert_caches_reused,
                             assert_cp_gives_same_gradients, assert_trains_at_every_size)


def small_cswin(**kw):
    kw.setdefault('embed_dims', 16)
    kw.setdefault('num_heads', [2, 2, 4, 4])
    kw.setdefault('depths', [1, 2, 2, 1])
    m = FLattenCSwin(**kw)
    m.init_weights()
    return m


def test_release_layout_of_stages():
    """LLSS at 224: linear stages global (with LePE), stage 3 two stripe
    branches of width 7 (half the channels and heads each), stage 4 one
    branch over the whole map; SSSS: stripes of 1 and 2 in stages 1-2."""
    m = FLattenCSwin(arch='tiny')
    assert m.stage1[0].linear and m.stage2[0].linear
    assert m.stage1[0].attns[0].pos_grid == (56, 56) and hasattr(m.stage1[0].attns[0], 'get_v')
    vertical, horizontal = m.stage3[0].attns
    assert (vertical.stripe, vertical.vertical, horizontal.vertical) == (7, True, False)
    assert vertical.get_v.in_channels == 128 and vertical.num_heads == 4
    assert len(m.stage4[0].attns) == 1 and m.stage4[0].attns[0].stripe is None
    softmax = FLattenCSwin(arch='tiny', attn_type='SSSS')
    assert [softmax.stage1[0].attns[0].stripe, softmax.stage2[0].attns[0].stripe] == [1, 2]


@pytest.mark.parametrize('kw', [{}, dict(attn_type='SSSS'), dict(attn_type='LLLL')])
@pytest.mark.parametrize('hw', [(97, 131), (64, 64), (13, 6)])
def test_any_input_size(kw, hw):
    m = small_cswin(**kw).eval()
    with torch.no_grad():
        outs = m(torch.randn(2, 3, *hw))
    assert [o.shape[1] for o in outs] == [16, 32, 64, 128]
    for o, s in zip(outs, (4, 8, 16, 32)):
        assert tuple(o.shape[2:]) == (-(-hw[0] // s), -(-hw[1] // s))
        assert torch.isfinite(o).all()
        assert o.is_contiguous()


@pytest.mark.parametrize('kw', [{}, dict(attn_type='SSSS')])
def test_trains_at_every_size(kw):
    assert_trains_at_every_size(small_cswin(**kw))


def explicit_stripe_attention(branch, qkv, cols):
    """Softmax attention + LePE among the real tokens of one vertical stripe
    (columns ``cols``), written out: no padding anywhere."""
    H = qkv.shape[1]
    c = qkv.shape[-1] // 3
    h = branch.num_heads
    stripe = qkv[0, :, cols]  # (H, w, 3c)
    w = stripe.shape[1]
    q, k, v = stripe.reshape(H * w, 3, h, c // h).permute(1, 2, 0, 3)
    attn = ((q @ k.transpose(-2, -1)) * (c // h) ** -0.5).softmax(-1)
    out = (attn @ v).transpose(0, 1).reshape(H, w, c)
    lepe = F.conv2d(stripe[..., 2 * c:].permute(2, 0, 1)[None], branch.get_v.weight,
                    branch.get_v.bias, padding=1, groups=c)[0].permute(1, 2, 0)
    return out + lepe


@pytest.mark.parametrize('W', [10, 5])
def test_padded_stripes_equal_explicit_attention_on_real_tokens(W):
    """Vertical stripes of 7 on a map 10 (or 5) wide: the last stripe is
    padded; its padded keys get no weight and its LePE sees zeros beyond the
    real columns, exactly as a stripe of the real width alone would."""
    branch = LePEAttention(8, 2, stripe=7, vertical=True).eval()
    torch.nn.init.normal_(branch.get_v.weight)
    qkv = torch.randn(1, 6, W, 24)
    with torch.no_grad():
        got = branch(qkv.unflatten(-1, (3, 8)))[0]
        for start in range(0, W, 7):
            cols = slice(start, min(start + 7, W))
            torch.testing.assert_close(got[:, cols], explicit_stripe_attention(branch, qkv, cols),
                                       rtol=1e-5, atol=1e-5)


def test_horizontal_stripes_are_the_transpose_of_vertical_ones():
    vertical = LePEAttention(8, 2, stripe=3, vertical=True).eval()
    horizontal = LePEAttention(8, 2, stripe=3, vertical=False).eval()
    horizontal.load_state_dict(vertical.state_dict())
    # a symmetric 3x3 kernel: the conv commutes with the transpose
    with torch.no_grad():
        k = vertical.get_v.weight
        k.copy_((k + k.transpose(2, 3)) / 2)
        horizontal.get_v.weight.copy_(k)
        qkv = torch.randn(2, 5, 8, 24)
        qkv = qkv.unflatten(-1, (3, 8))
        torch.testing.assert_close(horizontal(qkv.transpose(1, 2)),
                                   vertical(qkv).transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_linear_block_loads_release_projections():
    """The release keeps a linear block's fused qkv and its proj at block
    level; they land in the block's attention (q and kv split)."""
    block = CSwinBlock(16, 2, 'L', None, pos_grid=(4, 4), focusing_factor=3, kernel_size=5)
    sd = {k: v.clone() for k, v in block.state_dict().items()}
    attn = {k: sd.pop(f'attns.0.{k}') for k in ('q.weight', 'q.bias', 'kv.weight', 'kv.bias',
                                                 'proj.weight', 'proj.bias')}
    sd['qkv.weight'] = torch.cat([attn['q.weight'], attn['kv.weight']]) + 1
    sd['qkv.bias'] = torch.cat([attn['q.bias'], attn['kv.bias']]) + 1
    sd['proj.weight'], sd['proj.bias'] = attn['proj.weight'] + 2, attn['proj.bias'] + 2
    block.load_state_dict(cswin_convert(sd))  # what FLattenCSwin applies on load
    torch.testing.assert_close(block.attns[0].q.weight, attn['q.weight'] + 1)
    torch.testing.assert_close(block.attns[0].kv.bias, attn['kv.bias'] + 1)
    torch.testing.assert_close(block.attns[0].proj.weight, attn['proj.weight'] + 2)


def test_gradients_frozen_and_cp():
    m = small_cswin(drop_path_rate=0., frozen_stages=2)
    m.train()
    frozen = [m.stage1_conv_embed, m.stage1, m.merge1, m.stage2, m.norm0, m.norm1]
    assert not any(p.requires_grad for f in frozen for p in f.parameters())
    assert all(p.requires_grad for p in m.merge2.parameters())
    outs = m(torch.randn(2, 3, 64, 64))
    sum(o.square().mean() for o in outs).backward()
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert_cp_gives_same_gradients(small_cswin, torch.randn(1, 3, 64, 64))


@pytest.mark.parametrize('kwargs,match', [
    (dict(arch='large'), r"arch must be one of \['base', 'small', 'tiny'\], got 'large'"),
    (dict(attn_type='LLS'), 'attn_type must be a string of 4 letters'),
    (dict(num_heads=[2, 4, 7, 16]), 'divisible by num_heads'),
    (dict(embed_dims=63, num_heads=[3, 3, 3, 3], attn_type='LLSS'),
     'stage 3 has two stripe branches'),
    (dict(split_size=(1, 2, 7)), 'split_size must have 4 entries'),
    (dict(split_size=(1, 2, 0, 7)), 'split_size must be positive ints'),
    (dict(kernel_size=4), 'kernel_size must be odd'),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FLattenCSwin(**kwargs)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_autocast_scaled_inputs_are_finite(dtype):
    assert_autocast_finite(small_cswin(), dtype, torch.randn(1, 3, 64, 64) * 100)


@pytest.mark.parametrize('attn_type', ['LLSS', 'SSSS'])
def test_caches_size_dependent_tensors(attn_type):
    assert_caches_reused(small_cswin(attn_type=attn_type))


@pytest.mark.parametrize('stripe', [2, 3])
def test_stripe_branches_on_views_equal_branches_on_copies(stripe):
    """A softmax block hands each branch strided views into its q, k, v
    projection (horizontal stripes stay views, padded or not); the branches
    on contiguous copies of the same slices give the same output and
    gradients, in training mode, on a 9x7 map that stripes of 2 pad both ways
    and stripes of 3 only vertically."""
    torch.manual_seed(0)
    block = CSwinBlock(16, 4, 'S', stripe, (8, 8), 3., 5).train()
    x = torch.randn(2, 9 * 7, 16, requires_grad=True)

    def on_copies(x):
        qkv = block.qkv(x).view(2, 9, 7, 3, 2, 8)
        out = torch.cat([branch(qkv[:, :, :, :, b].contiguous())
                         for b, branch in enumerate(block.attns)], dim=-1)
        return block.proj(out.reshape(2, 9 * 7, 16))

    got, want = block.attention(x, (9, 7)), on_copies(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(got)
    inputs = [x, *block.attns.parameters(), *block.qkv.parameters()]
    for a, b in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
