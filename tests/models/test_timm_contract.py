"""timm's model contract for every flatten_* name: pretrained cfgs, the
classifier API (forward_features / forward_head / reset_classifier /
global_pool), gradient checkpointing, forward_intermediates and
prune_intermediate_layers, features_only, and no parameter left unused."""
import re

import pytest
import timm
import torch
from timm.models._features import FeatureGetterNet, FeatureHookNet

import flatten_mm  # noqa: F401  (registers the models in timm)
from flatten_mm.registry import TIMM_MODELS

NAMES = sorted(TIMM_MODELS)
# one small model per family (one or two blocks per stage) for the API checks
SMALL = {
    'flatten_pvt_tiny': dict(depths=[1, 1, 1, 1]),
    'flatten_pvt_v2_b0': dict(depths=[1, 1, 1, 1]),
    'flatten_swin_tiny': dict(embed_dims=32, depths=[2, 2, 2, 2], num_heads=[1, 2, 4, 8]),
    'flatten_cswin_tiny': dict(embed_dims=16, depths=[1, 1, 1, 1], num_heads=[2, 2, 4, 4]),
    'flatten_deit_tiny': dict(embed_dims=32, num_heads=2, depth=4),
}
# the four-stage pyramids (strides 4 to 32); FLatten-DeiT (one stride-16 grid,
# a stage per block) has its own versions of their shape checks in test_deit_timm.py
PYRAMIDS = sorted(n for n in SMALL if not n.startswith('flatten_deit'))


def is_deit(name):
    return name.startswith('flatten_deit')


def small(name, **kw):
    return timm.create_model(name, **SMALL[name], drop_path_rate=0., **kw)


def spatial(model, out):
    """(H, W) of unpooled features in the model's output_fmt."""
    return tuple(out.shape[2:4]) if model.output_fmt == 'NCHW' else tuple(out.shape[1:3])


@pytest.mark.parametrize('name', NAMES)
def test_pretrained_cfg_is_complete(name):
    with torch.device('meta'):
        model = timm.create_model(name)
    cfg = model.pretrained_cfg
    size = 384 if name.endswith('_384') else 224
    assert cfg['input_size'] == (3, size, size)
    # DeiT's features are tokens, not a map to pool (timm's ViTs give no pool_size)
    assert cfg['pool_size'] == (None if is_deit(name) else (size // 32, size // 32))
    assert cfg['fixed_input_size'] is False
    state = model.state_dict()
    assert f"{cfg['first_conv']}.weight" in state and f"{cfg['classifier']}.weight" in state
    assert model.first_conv == cfg['first_conv']  # the conv every load fits to in_chans
    assert model.num_features == model.head_hidden_size == model.embed_dims[-1] > 0
    assert [i['reduction'] for i in model.feature_info] == \
        ([16] * 12 if is_deit(name) else [4, 8, 16, 32])
    assert [i['num_chs'] for i in model.feature_info] == list(model.embed_dims)
    modules = dict(model.named_modules())
    assert all(i['module'] in modules for i in model.feature_info)


@pytest.mark.parametrize('name', NAMES)
def test_every_parameter_gets_a_gradient(name):
    """timm's backward check on every arch: no parameter that forward does
    not use (DDP without find_unused_parameters fails on one)."""
    model = timm.create_model(name, num_classes=7, drop_path_rate=0.).train()
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7)
    out.square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize('name', PYRAMIDS)
def test_head_pooling_and_reset(name):
    model = small(name).eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        feats = model.forward_features(x)
        assert spatial(model, feats) == model.pretrained_cfg['pool_size']
        channels = feats.shape[1] if model.output_fmt == 'NCHW' else feats.shape[-1]
        assert channels == model.num_features
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (2, model.head_hidden_size)
        logits = model(x)
        torch.testing.assert_close(logits, model.head(pre))
        model.reset_classifier(0)
        assert model.num_classes == 0
        torch.testing.assert_close(model(x), pre)
        model.reset_classifier(0, '')
        torch.testing.assert_close(model(x), feats)
        model.reset_classifier(5, 'avg')
        assert model(x).shape == (2, 5) and model.get_classifier().out_features == 5
        bare = small(name, num_classes=0, global_pool='').eval()
        assert bare(x).shape == feats.shape
    with pytest.raises(ValueError, match="global_pool must be 'avg' or ''"):
        model.reset_classifier(0, 'max')


@pytest.mark.parametrize('name', sorted(SMALL))
def test_grad_checkpointing_gives_same_outputs_and_gradients(name):
    model = small(name, num_classes=3).train()
    x = torch.randn(2, 3, 64, 96)

    def run():
        model.zero_grad()
        out = model(x)
        out.sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]
    want, want_grads = run()
    model.set_grad_checkpointing()
    assert model.with_cp
    got, got_grads = run()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name', PYRAMIDS)
def test_forward_intermediates(name):
    model = small(name).eval()
    x = torch.randn(1, 3, 70, 90)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert [tuple(t.shape[1:]) for t in inter] == [
            (c, -(-70 // s), -(-90 // s)) for c, s in zip(model.embed_dims, (4, 8, 16, 32))]
        only = model.forward_intermediates(x, indices=[1, -1], intermediates_only=True)
        torch.testing.assert_close(only[0], inter[1])
        torch.testing.assert_close(only[1], inter[3])
        last_two = model.forward_intermediates(x, indices=2, intermediates_only=True)
        assert [t.shape[1] for t in last_two] == model.embed_dims[2:]
        _, early = model.forward_intermediates(x, indices=[0], stop_early=True)
        torch.testing.assert_close(early[0], inter[0])
    with pytest.raises(ValueError, match='indices must be stage indices'):
        model.forward_intermediates(x, indices=[4])
    with pytest.raises(ValueError, match="output_fmt must be 'NCHW'"):
        model.forward_intermediates(x, output_fmt='NHWC')


@pytest.mark.parametrize('name', PYRAMIDS)
def test_prune_intermediate_layers_leaves_no_unused_parameter(name):
    model = small(name).train()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        want = model.forward_intermediates(x.clone(), indices=[0, 1], intermediates_only=True)
    assert model.prune_intermediate_layers([0, 1], prune_norm=True) == [0, 1]
    assert model.num_stages == 2 and len(model.feature_info) == 2
    got = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    sum(g.square().mean() for g in got).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize('name', PYRAMIDS)
def test_features_only(name):
    model = small(name, features_only=True, out_indices=(1, 3)).eval()
    assert model.feature_info.reduction() == [8, 32]
    x = torch.randn(1, 3, 96, 64)
    with torch.no_grad():
        feats = model(x)
    assert [tuple(f.shape[1:]) for f in feats] == [
        (c, 96 // s, 64 // s) for c, s in zip(model.feature_info.channels(), (8, 32))]
    # stages after the last one taken are gone, and so is the head
    assert not any('head' in n for n, _ in model.named_parameters())


@pytest.mark.parametrize('feature_cls', ['hook', 'fx', 'dict', 'list', FeatureHookNet])
def test_features_only_refuses_other_feature_classes(feature_cls):
    """timm's other feature classes take the outputs of the modules
    feature_info names: tokens without their grid here, or for the hook
    class no features at all (its hooks sat on lists of blocks that are
    never called: PVT, Swin and CSwin gave empty lists). They stop with the
    value named; the getter (the default, and by name or class) gives maps."""
    with pytest.raises(ValueError, match=f"flatten_pvt_tiny: features_only takes "
                       f"feature_cls='getter' .*, got {re.escape(repr(feature_cls))}"):
        small('flatten_pvt_tiny', features_only=True, feature_cls=feature_cls)
    for getter in ('Getter', FeatureGetterNet):
        model = small('flatten_pvt_tiny', features_only=True, feature_cls=getter)
        assert isinstance(model, FeatureGetterNet)
        assert model(torch.randn(1, 3, 64, 64))[0].shape == (1, 64, 16, 16)


def test_registered_names_match_the_table_tools_use():
    """registry.TIMM_MODELS (what tools build a timm name's dense backbone
    from, without timm) lists exactly the registered models, each with the
    arch and options of its @register_model function."""
    from flatten_mm import FLattenCSwin, FLattenDeiT, FLattenPVT, FLattenPVTv2, FLattenSwin
    assert sorted(timm.list_models('flatten_*')) == NAMES
    dense_cls = dict(pvt=FLattenPVT, pvtv2=FLattenPVTv2, swin=FLattenSwin, cswin=FLattenCSwin,
                     deit=FLattenDeiT)
    for name in NAMES:
        kind, arch, extra = TIMM_MODELS[name]
        with torch.device('meta'):
            model = timm.create_model(name)
            dense = dense_cls[kind](arch=arch, **extra)
        assert isinstance(model, dense_cls[kind]) and model.arch == arch
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        for key, value in dense.state_dict().items():
            if not key.startswith('norm') or kind == 'pvtv2':
                assert shapes[key] == value.shape, (name, key)
@pytest.mark.parametrize('name', sorted(SMALL))
def test_empty_batches_rejected(name):
    model = small(name).eval()
    for shape in ((0, 3, 32, 32), (1, 3, 0, 32)):
        with pytest.raises(ValueError, match='expected a non-empty batch of images'):
            model(torch.randn(shape))
        with pytest.raises(ValueError, match='expected a non-empty batch of images'):
            model.forward_intermediates(torch.randn(shape))


@pytest.mark.parametrize('name', sorted(SMALL))
def test_img_size_sets_the_positional_terms_size(name):
    """timm's ``img_size``: the size the positional terms are defined for (the
    models take any input size), i.e. our ``pretrain_img_size``."""
    a = small(name, img_size=320)
    b = small(name, pretrain_img_size=320)
    shapes = {k: v.shape for k, v in b.state_dict().items()}
    assert {k: v.shape for k, v in a.state_dict().items()} == shapes
    assert shapes != {k: v.shape for k, v in small(name).state_dict().items()}
    with pytest.raises(TypeError, match='img_size or pretrain_img_size, not both'):
        small(name, img_size=320, pretrain_img_size=384)


def test_img_size_of_a_384_model():
    """A variant's own size (384) gives way to the caller's img_size."""
    def shapes(**kwargs):
        with torch.device('meta'):
            model = timm.create_model('flatten_swin_base_384', **kwargs)
        return {k: v.shape for k, v in model.state_dict().items()}
    assert shapes(img_size=512) == shapes(pretrain_img_size=512) != shapes()
