"""FLatten-DeiT as a timm model: the softmax variant is timm's DeiT (same
weights, same logits), the classifier API on class-token features,
forward_intermediates / pruning / features_only over blocks, and one
checkpoint for the classifier and the dense backbone."""
import pytest
import timm
import torch

import flatten_mm  # noqa: F401  (registers the models in timm)
from flatten_mm import FLattenDeiT
from flatten_mm.checkpoint import load_checkpoint_file

SMALL = dict(embed_dims=32, num_heads=2, depth=4, drop_path_rate=0.)


def small(**kw):
    return timm.create_model('flatten_deit_tiny', **dict(SMALL, **kw))


def randomize(model):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


@pytest.mark.parametrize('arch', ['tiny', 'small', 'base'])
def test_softmax_variant_is_timms_deit(arch):
    """attn_type='S' has exactly the parameters of timm's DeiT, under the
    same names; FLatten-DeiT adds per block a DWC (d*k*k + d), the scale (C)
    and the positional encoding (196 C)."""
    with torch.device('meta'):
        deit = timm.create_model(f'deit_{arch}_patch16_224')
        ours = timm.create_model(f'flatten_deit_{arch}', attn_type='S')
        flatten = timm.create_model(f'flatten_deit_{arch}')
    assert {k: v.shape for k, v in ours.state_dict().items()} == \
        {k: v.shape for k, v in deit.state_dict().items()}
    C, h = deit.embed_dim, deit.blocks[0].attn.num_heads
    d = C // h
    extra = 12 * (d * 25 + d + C + 196 * C)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(flatten) == count(deit) + extra


def test_softmax_variant_gives_timms_deit_logits():
    deit = randomize(timm.create_model('deit_tiny_patch16_224', depth=3)).eval()
    ours = timm.create_model('flatten_deit_tiny', attn_type='S', depth=3).eval()
    ours.load_state_dict(deit.state_dict())  # strict: the same names
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), deit(x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.forward_features(x), deit.forward_features(x),
                                   rtol=1e-4, atol=1e-5)


def test_head_pooling_and_reset():
    model = randomize(small()).eval()
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert feats.shape == (2, 1 + 4 * 6, 32)  # class token first, NLC
        pre = model.forward_head(feats, pre_logits=True)
        torch.testing.assert_close(pre, feats[:, 0])
        torch.testing.assert_close(model(x), model.head(pre))
        model.reset_classifier(0, 'avg')
        torch.testing.assert_close(model(x), feats[:, 1:].mean(1))
        model.reset_classifier(0, '')
        torch.testing.assert_close(model(x), feats)
        model.reset_classifier(5, 'token')
        assert model(x).shape == (2, 5)
    with pytest.raises(ValueError, match=r"global_pool must be one of \('token', 'avg', ''\), "
                                         r"got 'max'"):
        model.reset_classifier(0, 'max')
    with pytest.raises(ValueError, match=r"global_pool must be one of \('avg', ''\), "
                                         r"got 'token'"):
        small(with_cls_token=False)
    assert small(with_cls_token=False, global_pool='avg')(x).shape == (2, 1000)
    assert {'cls_token', 'pos_embed'} <= model.no_weight_decay()


def test_forward_intermediates_and_pruning():
    model = randomize(small()).train()
    x = torch.randn(1, 3, 70, 90)
    with torch.no_grad():
        final, inter = model.eval().forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert [tuple(t.shape) for t in inter] == [(1, 32, 5, 6)] * 4
        normed = model.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)
        want = model.norm(inter[-1].flatten(2).transpose(1, 2))
        torch.testing.assert_close(normed[0].flatten(2).transpose(1, 2), want)
        _, early = model.forward_intermediates(x, indices=[1], stop_early=True)
        torch.testing.assert_close(early[0], inter[1])
    assert model.train().prune_intermediate_layers([0, 1], prune_norm=True) == [0, 1]
    assert len(model.blocks) == 2 and len(model.feature_info) == 2
    got = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    sum(g.square().mean() for g in got).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


def test_features_only_gives_stride_16_maps_of_blocks():
    model = timm.create_model('flatten_deit_tiny', features_only=True, depth=6,
                              out_indices=(1, 5)).eval()
    assert model.feature_info.reduction() == [16, 16]
    with torch.no_grad():
        feats = model(torch.randn(1, 3, 50, 33))
    assert [tuple(f.shape) for f in feats] == [(1, 192, 4, 3)] * 2
    assert not any('head' in n or n.startswith('norm') for n, _ in model.named_parameters())


def test_features_only_default_blocks_follow_the_depth():
    """features_only's default blocks are the quarter ends of the depth asked
    for (they were those of 12 blocks whatever the depth: an index error)."""
    m = timm.create_model('flatten_deit_tiny', depth=6, features_only=True)
    assert m.feature_info.module_name() == ['blocks.0', 'blocks.2', 'blocks.3', 'blocks.5']
    assert [o.shape for o in m(torch.randn(1, 3, 32, 48))] == [(1, 192, 2, 3)] * 4


def test_timm_checkpoint_loads_into_the_dense_backbone(tmp_path):
    """One checkpoint for both: every tensor of the dense backbone (with its
    final norm) comes from the classifier's file, and only the head is left
    over; the dense maps equal the classifier's intermediates."""
    model = randomize(small()).eval()
    path = str(tmp_path / 'flatten_deit.pth')
    torch.save(model.state_dict(), path)
    dense = FLattenDeiT(**SMALL, final_norm=True, out_indices=(1, 3),
                        init_cfg=dict(type='Pretrained', checkpoint=path))
    dense.init_weights()
    ckpt = load_checkpoint_file(path)
    assert set(dense.state_dict()) == {k for k in ckpt if not k.startswith('head.')}
    for key, value in dense.state_dict().items():
        assert torch.equal(value, ckpt[key]), key
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        maps = dense.eval()(x)
        inter = model.forward_intermediates(x, indices=[1, 3], norm=True,
                                            intermediates_only=True)
    for m, f in zip(maps, inter):
        torch.testing.assert_close(m, f)
    # without the final norm, the classifier's norm is left over (and said so)
    plain = FLattenDeiT(**SMALL, init_cfg=dict(type='Pretrained', checkpoint=path))
    plain.init_weights()
    assert 'norm.weight' not in plain.state_dict()
