import pytest
import torch

from flatten_mm import FLattenPVT, FLattenPVTv2

from backbone_checks import (assert_autocast_finite, assert_caches_reused,
                             assert_cp_gives_same_gradients, assert_trains_at_every_size)


def small_pvt(cls=FLattenPVT, **kw):
    kw.setdefault('embed_dims', [16, 32, 48, 64])
    kw.setdefault('num_heads', [1, 2, 3, 4])
    kw.setdefault('depths', [1, 1, 1, 1])
    kw.setdefault('arch', 'tiny' if cls is FLattenPVT else 'b0')
    m = cls(**kw)
    m.init_weights()
    return m


@pytest.mark.parametrize('cls', [FLattenPVT, FLattenPVTv2])
@pytest.mark.parametrize('attn_type', ['LLLL', 'SSLL'])
@pytest.mark.parametrize('hw', [(97, 131), (64, 64), (9, 5)])
def test_any_input_size(cls, attn_type, hw):
    m = small_pvt(cls, attn_type=attn_type).eval()
    with torch.no_grad():
        outs = m(torch.randn(2, 3, *hw))
    assert [o.shape[1] for o in outs] == [16, 32, 48, 64]
    for o, s in zip(outs, (4, 8, 16, 32)):
        assert tuple(o.shape[2:]) == (-(-hw[0] // s), -(-hw[1] // s))
        assert torch.isfinite(o).all()
        # plain NCHW memory: compiled ops such as mmcv's CPU RoIAlign read it raw
        assert o.is_contiguous()


@pytest.mark.parametrize('cls', [FLattenPVT, FLattenPVTv2])
@pytest.mark.parametrize('attn_type', ['LLLL', 'SSLL'])
def test_trains_at_every_size(cls, attn_type):
    assert_trains_at_every_size(small_pvt(cls, attn_type=attn_type))


def test_out_indices():
    m = small_pvt(out_indices=(1, 3)).eval()
    outs = m(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [32, 64]


def test_gradients_reach_every_parameter():
    m = small_pvt(attn_type='LLSS', drop_path_rate=0.0)
    outs = m(torch.randn(2, 3, 64, 96))
    sum(o.square().mean() for o in outs).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_frozen_stages():
    m = small_pvt(frozen_stages=2)
    m.train()
    frozen = [n for n, p in m.named_parameters() if not p.requires_grad]
    assert frozen and all(n.split('.')[0] in ('patch_embed1', 'pos_embed1', 'block1',
                                               'patch_embed2', 'pos_embed2', 'block2')
                          for n in frozen)
    assert all(p.requires_grad for n, p in m.named_parameters() if n.startswith('block3'))
    assert not m.block1.training and m.block3.training
    outs = m(torch.randn(1, 3, 64, 64))
    sum(o.sum() for o in outs).backward()
    assert m.block1[0].attn.q.weight.grad is None
    assert m.block3[0].attn.q.weight.grad is not None


def test_with_cp_gives_same_gradients():
    assert_cp_gives_same_gradients(small_pvt, torch.randn(2, 3, 64, 64))


@pytest.mark.parametrize('kwargs,match', [
    (dict(arch='huge'), r"arch must be one of \['large', 'medium', 'small', 'tiny'\], got 'huge'"),
    (dict(attn_type='LLL'), "attn_type must be a string of 4 letters.*got 'LLL'"),
    (dict(attn_type='LLXL'), "each L .* or S .*got 'LLXL'"),
    (dict(embed_dims=[64, 128, 320, 510]), 'must be divisible by num_heads'),
    (dict(kernel_size=4), 'kernel_size must be odd'),
    (dict(depths=[2, 2, 2]), 'depths must have 4 entries'),
    (dict(out_indices=(0, 4)), r'out_indices must be stage indices in -4..3'),
    (dict(frozen_stages=7), 'frozen_stages must be an int in -1..4'),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FLattenPVT(**kwargs)


def test_bad_arch_v2():
    with pytest.raises(ValueError, match=r"arch must be one of \['b0', .*'b5'\], got 'tiny'"):
        FLattenPVTv2(arch='tiny')


def test_bad_input():
    m = small_pvt()
    with pytest.raises(ValueError, match=r'expected images \(B, C, H, W\), got shape \(3, 64, 64\)'):
        m(torch.randn(3, 64, 64))


@pytest.mark.parametrize('cls', [FLattenPVT, FLattenPVTv2])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_autocast_scaled_inputs_are_finite(cls, dtype):
    assert_autocast_finite(small_pvt(cls), dtype, torch.randn(1, 3, 64, 64) * 100)


@pytest.mark.parametrize('cls', [FLattenPVT, FLattenPVTv2])
def test_caches_size_dependent_tensors(cls):
    assert_caches_reused(small_pvt(cls))


def test_weights_of_another_pretraining_size_are_resized():
    """PVT's position embeddings, like every positional encoding, learnt at 224
    load into a model pretrained at another size resized bilinearly (they once
    failed to load, naming a size mismatch)."""
    import torch.nn.functional as F
    kw = dict(embed_dims=[16, 32, 48, 64], num_heads=[1, 2, 3, 4], depths=[1, 1, 1, 1])
    small_model, big = FLattenPVT(**kw), FLattenPVT(**kw, pretrain_img_size=320)
    small_model.init_weights()
    big.load_state_dict(small_model.state_dict())
    for i, side in enumerate((56, 28, 14, 7)):
        own, new = getattr(small_model, f'pos_embed{i + 1}'), getattr(big, f'pos_embed{i + 1}')
        grid = (320 // 4 // 2 ** i, ) * 2
        expected = F.interpolate(own.reshape(1, side, side, -1).permute(0, 3, 1, 2), size=grid,
                                 mode='bilinear', align_corners=False)
        torch.testing.assert_close(new, expected.flatten(2).transpose(1, 2))


def test_each_version_builds_without_arguments():
    """Without ``arch`` each version builds its smallest preset (PVTv2 took
    PVT's 'tiny' and refused it)."""
    assert FLattenPVT().arch == 'tiny' and FLattenPVTv2().arch == 'b0'
    assert FLattenPVTv2().embed_dims == [32, 64, 160, 256]
