"""FLatten-DeiT as a dense backbone: any input size, training, the class
token, frozen blocks, checkpoints, inference caches and argument errors."""
import copy

import pytest
import torch

from flatten_mm import FLattenDeiT, FocusedLinearAttention

from backbone_checks import (TRAIN_SIZES, assert_caches_reused,
                             assert_cp_gives_same_gradients, assert_trains_at_every_size,
                             small_backbone)


def small(**kw):
    return small_backbone('deit', **kw)


@pytest.mark.parametrize('attn_type', ['L', 'LSLL'])
@pytest.mark.parametrize('hw', [(97, 131), (224, 224), (9, 5), (1, 1), (16, 33)])
def test_any_input_size(attn_type, hw):
    m = small(attn_type=attn_type).eval()
    with torch.no_grad():
        outs = m(torch.randn(2, 3, *hw))
    assert len(outs) == 2
    for o in outs:
        assert tuple(o.shape) == (2, 32, -(-hw[0] // 16), -(-hw[1] // 16))
        assert torch.isfinite(o).all() and o.is_contiguous()


def test_presets_at_224():
    assert [(FLattenDeiT.arch_zoo[a]['embed_dims'], FLattenDeiT.arch_zoo[a]['num_heads'])
            for a in ('tiny', 'small', 'base')] == [(192, 3), (384, 6), (768, 12)]
    m, dims = FLattenDeiT(arch='tiny').eval(), 192
    assert m.depth == 12 and m.out_indices == (2, 5, 8, 11) and m.pos_grid == (14, 14)
    layers = [b.attn for b in m.blocks]
    assert all(isinstance(a, FocusedLinearAttention) and a.num_prefix_tokens == 1
               and a.kernel_size == 5 and a.focusing_factor == 3 for a in layers)
    with torch.no_grad():
        outs = m(torch.randn(1, 3, 224, 224))
    assert [tuple(o.shape) for o in outs] == [(1, dims, 14, 14)] * 4


def test_trains_at_every_size():
    assert_trains_at_every_size(small(attn_type='LSLL'), TRAIN_SIZES[::3], strides=(16, 16))


def test_with_cp_gives_same_gradients():
    assert_cp_gives_same_gradients(small, torch.randn(2, 3, 40, 56))


def test_softmax_deit_is_the_same_class():
    m = small(attn_type='S')
    assert not any(isinstance(x, FocusedLinearAttention) for x in m.modules())
    assert all(hasattr(b.attn, 'qkv') for b in m.blocks)


def test_class_token_outputs_and_without_class_token():
    m = small(out_type='cls_token', out_indices=(0, 3)).eval()
    x = torch.randn(2, 3, 40, 56)
    with torch.no_grad():
        outs = m(x)
    assert [tuple(o.shape) for o in outs] == [(2, 32)] * 2
    bare = small(with_cls_token=False).eval()
    assert not hasattr(bare, 'cls_token')
    assert all(b.attn.num_prefix_tokens == 0 for b in bare.blocks
               if isinstance(b.attn, FocusedLinearAttention))
    with torch.no_grad():
        assert [tuple(o.shape) for o in bare(x)] == [(2, 32, 3, 4)] * 2


def test_final_norm_applies_to_the_last_block_only():
    m = small(final_norm=False, out_indices=(3,)).eval()
    normed = small(final_norm=True, out_indices=(3,)).eval()
    state = m.state_dict()
    normed.load_state_dict(dict(state, **{f'norm.{k}': v for k, v in
                                          normed.norm.state_dict().items()}))
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        raw, out = m(x)[0], normed(x)[0]
    want = normed.norm(raw.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(raw.shape)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize('frozen', [0, 2, 4])
def test_frozen_blocks(frozen):
    m = small(frozen_stages=frozen).train()
    stem = [m.patch_embed.proj.weight, m.pos_embed, m.cls_token]
    assert all(not p.requires_grad for p in stem)
    for i, block in enumerate(m.blocks):
        assert all(p.requires_grad == (i >= frozen) for p in block.parameters())
        assert block.training == (i >= frozen)


def test_state_dict_round_trip_and_other_pretraining_size():
    m = small().eval()
    other = small()
    other.load_state_dict(m.state_dict())  # strict
    x = torch.randn(1, 3, 50, 70)
    with torch.no_grad():
        for a, b in zip(m(x), other.eval()(x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # learnt at 224 (14x14), loaded into a model pretrained at 384 (24x24): resized
    big = small(pretrain_img_size=384)
    big.load_state_dict(m.state_dict())
    assert big.pos_embed.shape == (1, 1 + 24 * 24, 32)
    torch.testing.assert_close(big.pos_embed[:, 0], m.pos_embed[:, 0])


def test_inference_caches_never_stale():
    """Per-size caches are reused in inference, never served after the
    weights change in place (EMA / mean-teacher updates through .data)."""
    assert_caches_reused(small())
    student = small()
    teacher = copy.deepcopy(student).eval()
    x = torch.randn(1, 3, 45, 67)
    with torch.no_grad():
        teacher(x)
        for t, s in zip(teacher.parameters(), student.parameters()):
            t.data.mul_(0.5).add_(s.data + torch.randn_like(s), alpha=0.5)
        fresh = small().eval()
        fresh.load_state_dict(teacher.state_dict())
        for a, b in zip(teacher(x), fresh(x)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_registered_in_mmdet_and_mmseg():
    for scope in ('mmdet', 'mmseg', 'mmpretrain'):
        registry = pytest.importorskip(f'{scope}.registry').MODELS
        assert registry.get('FLattenDeiT') is FLattenDeiT


@pytest.mark.parametrize('kwargs,match', [
    (dict(arch='huge'), r"arch must be one of \['base', 'small', 'tiny'\], got 'huge'"),
    (dict(arch=dict(embed_dims=32, depth=2)), 'arch as a dict takes embed_dims, num_heads, '
                                              'depth'),
    (dict(embed_dims=30, num_heads=4), r'embed_dims \(30\) must be divisible by num_heads'),
    (dict(depth=0), 'depth must be an int >= 1, got 0'),
    (dict(attn_type='X'), r"letter for all\).*got 'X'$"),
    (dict(attn_type='LX'),
     r"attn_type must be a string of 12 letters \(or one letter for all\).*got 'LX'"),
    (dict(attn_type='LLS'), "attn_type must be a string of 12 letters.*got 'LLS'"),
    (dict(patch_size=0), 'patch_size must be an int >= 1, got 0'),
    (dict(patch_size=300), r'patch_size must be at most the pretraining size \(224, 224\)'),
    (dict(out_type='map'), r"out_type must be one of \('featmap', 'cls_token'\), got 'map'"),
    (dict(out_type='cls_token', with_cls_token=False), 'needs with_cls_token=True'),
    (dict(out_indices=(12,)), r'out_indices must be stage indices in -12..11.*got \(12,\)'),
    (dict(frozen_stages=13), 'frozen_stages must be an int in -1..12.*got 13'),
    (dict(kernel_size=4), 'kernel_size must be odd.*got 4'),
    (dict(mlp_ratio=0), 'mlp_ratio must be a finite number > 0, got 0'),
    (dict(attn_drop_rate=0.1), 'attn_drop_rate must be 0 without softmax'),
])
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FLattenDeiT(**kwargs)
