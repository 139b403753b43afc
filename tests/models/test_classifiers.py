"""timm classifiers: parameter counts, official-format loading, logit parity,
features_only, and agreement with the dense backbones."""
import types

import pytest
import timm
import torch

import flatten_mm  # noqa: F401  (registers the models in timm)
from flatten_mm import (FLattenCSwin, FLattenPVT, FLattenPVTv2, FLattenSwin, FocusedLinearAttention,
                        load_checkpoint_file)
from flatten_mm.models.backbones.flatten_cswin import CSwinBlock
from flatten_mm.analysis import reference_forward
from flatten_mm.models.backbones.flatten_swin import SwinBlock

from official_format import official_state_dict, randomize, write_official_checkpoint

# the official classifiers' parameter counts (FLATTEN.md §3)
OFFICIAL_PARAMS = {
    'flatten_pvt_tiny': 12150504, 'flatten_pvt_small': 21670248,
    'flatten_pvt_medium': 37242216, 'flatten_pvt_large': 50649192,
    'flatten_pvt_v2_b0': 3594824, 'flatten_pvt_v2_b1': 12931240,
    'flatten_pvt_v2_b2': 22548264, 'flatten_pvt_v2_b3': 38273832,
    'flatten_pvt_v2_b4': 51836968, 'flatten_pvt_v2_b5': 67061544,
    'flatten_swin_tiny': 29192384, 'flatten_swin_small': 50510288,
    'flatten_swin_base': 88972488,
    'flatten_cswin_tiny': 21201768, 'flatten_cswin_small': 35451752,
    'flatten_cswin_base': 74867032, 'flatten_cswin_base_384': 78369112,
}


# the release's FLatten-PVT (v1) defines a final LayerNorm of 512 channels that
# its forward never applies; ours leaves it out
UNUSED_OFFICIAL = {'flatten_pvt_tiny': 1024, 'flatten_pvt_small': 1024,
                   'flatten_pvt_medium': 1024, 'flatten_pvt_large': 1024}


@pytest.mark.parametrize('name', sorted(OFFICIAL_PARAMS))
def test_parameter_counts_equal_the_release(name):
    with torch.device('meta'):
        model = timm.create_model(name)
    used = OFFICIAL_PARAMS[name] - UNUSED_OFFICIAL.get(name, 0)
    assert sum(p.numel() for p in model.parameters()) == used


def test_all_names_registered():
    names = set(timm.list_models('flatten_*'))
    assert set(OFFICIAL_PARAMS) | {'flatten_swin_base_384'} <= names


def swin_shifted_window_reference(block, x, hw):
    """Swin's own recipe for a softmax block: cyclic shift, 7x7 windows,
    region mask of -100, relative position bias, shift back."""
    B, N, C = x.shape
    H, W = hw
    ws = block.window[0]
    attn = block.attn
    shift = ws // 2 if block.shift and (H > ws or W > ws) else 0
    t = block.norm1(x).view(B, H, W, C)
    if shift:
        t = torch.roll(t, (-shift, -shift), (1, 2))
    win = t.view(B, H // ws, ws, W // ws, ws, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, C)
    h = attn.num_heads
    q, k, v = attn.qkv(win).view(win.shape[0], ws * ws, 3, h, C // h).permute(2, 0, 3, 1, 4)
    logits = (q * (C // h) ** -0.5) @ k.transpose(-2, -1)
    bias = attn.relative_position_bias_table[attn.relative_position_index.view(-1)]
    logits = logits + bias.view(ws * ws, ws * ws, h).permute(2, 0, 1)
    if shift:
        region = torch.zeros(H, W)
        cuts = (slice(0, -ws), slice(-ws, -shift), slice(-shift, None))
        label = 0
        for hs in cuts:
            for wsl in cuts:
                region[hs, wsl] = label
                label += 1
        rw = region.view(H // ws, ws, W // ws, ws).permute(0, 2, 1, 3).reshape(-1, ws * ws)
        mask = (rw[:, None, :] != rw[:, :, None]).float() * -100.0
        logits = logits.view(B, -1, h, ws * ws, ws * ws) + mask[None, :, None]
        logits = logits.view(-1, h, ws * ws, ws * ws)
    out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(-1, ws * ws, C)
    out = attn.proj(out).view(B, H // ws, W // ws, ws, ws, C).permute(0, 1, 3, 2, 4, 5)
    out = out.reshape(B, H, W, C)
    if shift:
        out = torch.roll(out, (shift, shift), (1, 2))
    x = x + out.reshape(B, N, C)
    return x + block.mlp(block.norm2(x))


def cswin_stripe_reference(block, x, hw):
    """CSWin's own recipe for a softmax block, on maps the stripes divide:
    fused qkv split by channel halves between the vertical- and the
    horizontal-stripe branch, per stripe softmax(q k^T d^-1/2) v plus the 3x3
    conv of that stripe's V, stripes back into the map, concat, proj."""
    B, N, C = x.shape
    H, W = hw
    qkv = block.qkv(block.norm1(x)).reshape(B, N, 3, C).permute(2, 0, 1, 3)
    c = C // len(block.attns)
    outs = []
    for b, branch in enumerate(block.attns):
        hs, ws = (H, W) if branch.stripe is None else \
            (H, branch.stripe) if branch.vertical else (branch.stripe, W)
        h = branch.num_heads
        d = c // h

        def stripes(t):  # (B, N, c) -> (B * stripes, hs * ws, c)
            t = t[..., b * c:(b + 1) * c].transpose(1, 2).reshape(B, c, H // hs, hs, W // ws, ws)
            return t.permute(0, 2, 4, 3, 5, 1).reshape(-1, hs * ws, c)

        def heads(t):
            return t.reshape(-1, hs * ws, h, d).permute(0, 2, 1, 3)
        q, k, v = (stripes(t) for t in qkv)
        lepe = branch.get_v(v.transpose(1, 2).reshape(-1, c, hs, ws))
        lepe = lepe.reshape(-1, h, d, hs * ws).permute(0, 1, 3, 2)
        attn = ((heads(q) * d ** -0.5) @ heads(k).transpose(-2, -1)).softmax(-1)
        out = (attn @ heads(v) + lepe).transpose(1, 2).reshape(-1, hs * ws, c)
        out = out.view(B, H // hs, W // ws, hs, ws, c).permute(0, 1, 3, 2, 4, 5)
        outs.append(out.reshape(B, N, c))
    x = x + block.proj(torch.cat(outs, -1))
    return x + block.mlp(block.norm2(x))


def use_release_op_order(model):
    """Swap every attention for the release's recipe: the official op order
    for focused linear attention (with CSWin's LePE), cyclic shift + mask for
    Swin windows, CSWin's stripes."""
    for m in model.modules():
        if isinstance(m, FocusedLinearAttention):
            m.forward = types.MethodType(
                lambda self, x, hw, key_mask=None: reference_forward(self, x, hw), m)
        if isinstance(m, SwinBlock) and not m.linear:
            m.forward = types.MethodType(swin_shifted_window_reference, m)
        if isinstance(m, CSwinBlock) and not m.linear:
            m.forward = types.MethodType(cswin_stripe_reference, m)
    return model


@pytest.mark.parametrize('name', ['flatten_pvt_tiny', 'flatten_pvt_v2_b0', 'flatten_swin_tiny',
                                  'flatten_cswin_tiny'])
def test_official_file_loads_and_gives_release_logits(tmp_path, name):
    path = str(tmp_path / f'{name}.pth')
    source = write_official_checkpoint(path, name)
    model = timm.create_model(name, pretrained=True,
                              pretrained_cfg_overlay=dict(file=path)).eval()
    for key, value in source.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value)
    assert model.state_dict().keys() == source.state_dict().keys()
    reference = use_release_op_order(randomize(timm.create_model(name))).eval()
    reference.load_state_dict(official_state_dict(source))
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        got, want = model(x), reference(x)
    assert got.shape == (2, 1000)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-4, rel
    assert want.std() > 1e-3  # not a trivially constant output


def test_checkpoint_path_loads_strictly(tmp_path):
    path = str(tmp_path / 'swin.pth')
    source = write_official_checkpoint(path, 'flatten_swin_tiny', with_config=False)
    model = timm.create_model('flatten_swin_tiny', checkpoint_path=path)
    torch.testing.assert_close(model.layers[0].blocks[1].attn.kv.weight,
                               source.layers[0].blocks[1].attn.kv.weight)


def test_custom_load_reads_release_files_with_pickled_config(tmp_path):
    path = str(tmp_path / 'pvt.pth')
    source = write_official_checkpoint(path, 'flatten_pvt_tiny', with_config=True)
    model = timm.create_model('flatten_pvt_tiny', pretrained=True,
                              pretrained_cfg_overlay=dict(file=path, custom_load=True))
    torch.testing.assert_close(model.head.weight, source.head.weight)


@pytest.mark.parametrize('name', ['flatten_pvt_v2_b0', 'flatten_cswin_tiny'])
def test_custom_load_adapts_as_timm_loader_does(name, tmp_path):
    """Release files with a pickled config need ``custom_load``, which replaces
    timm's loader: another class count or ``in_chans`` is adapted as timm's own
    loader does it (the default path, on the same file without the config)."""
    plain, with_config = str(tmp_path / 'plain.pth'), str(tmp_path / 'config.pth')
    write_official_checkpoint(with_config, name, with_config=True)
    torch.save({'model': load_checkpoint_file(with_config)['model']}, plain)
    first = timm.create_model(name).pretrained_cfg['first_conv'] + '.weight'
    for kwargs in (dict(num_classes=10), dict(in_chans=1)):
        torch.manual_seed(0)
        ours = timm.create_model(name, pretrained=True, **kwargs, pretrained_cfg_overlay=dict(
            file=with_config, custom_load=True)).state_dict()
        torch.manual_seed(0)
        timms = timm.create_model(name, pretrained=True, **kwargs,
                                  pretrained_cfg_overlay=dict(file=plain)).state_dict()
        for key, value in timms.items():
            torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)
        assert ours[first].shape[1] == kwargs.get('in_chans', 3)
    headless = str(tmp_path / 'headless.pth')  # at the same class count: an error, as timm's
    sd = load_checkpoint_file(with_config)['model']
    torch.save({'model': {k: v for k, v in sd.items() if not k.startswith('head.')}}, headless)
    with pytest.raises(RuntimeError,
                       match=r"does not fit .*missing \['head.weight', 'head.bias'\]"):
        timm.create_model(name, pretrained=True,
                          pretrained_cfg_overlay=dict(file=headless, custom_load=True))


def test_new_class_count_drops_the_head(tmp_path):
    path = str(tmp_path / 'pvt.pth')
    source = write_official_checkpoint(path, 'flatten_pvt_tiny')
    model = timm.create_model('flatten_pvt_tiny', pretrained=True, num_classes=10,
                              pretrained_cfg_overlay=dict(file=path))
    assert model.head.out_features == 10
    torch.testing.assert_close(model.block4[1].mlp.fc2.weight, source.block4[1].mlp.fc2.weight)


def test_new_class_count_still_refuses_another_size(tmp_path):
    """For another class count, and with ``features_only``, timm loads
    non-strictly; the filter keeps all but the head strict unless the user
    asks otherwise (``pretrained_strict=False``)."""
    path = str(tmp_path / 'pvt_small.pth')
    source = write_official_checkpoint(path, 'flatten_pvt_small')  # depths 3-4-6-3, not 2-2-2-2
    for kwargs in (dict(num_classes=10), dict(features_only=True)):
        with pytest.raises(RuntimeError, match=r"does not fit FLattenPVTClassifier: missing "
                                               r"none, unexpected \['block1.2.attn"):
            timm.create_model('flatten_pvt_tiny', pretrained=True, **kwargs,
                              pretrained_cfg_overlay=dict(file=path))
    model = timm.create_model('flatten_pvt_tiny', pretrained=True, num_classes=10,
                              pretrained_cfg_overlay=dict(file=path), pretrained_strict=False)
    torch.testing.assert_close(model.block4[1].mlp.fc2.weight, source.block4[1].mlp.fc2.weight)


@pytest.mark.parametrize('name', ['flatten_swin_tiny', 'flatten_cswin_tiny'])
def test_new_class_count_and_features_load_release_files(name, tmp_path):
    """The strict filter passes the release's own files: another class count,
    ``features_only``, and an mmpretrain classifier's checkpoint of the same
    weights."""
    from flatten_mm.conversion import to_mmpretrain
    path, mmpretrain = str(tmp_path / 'release.pth'), str(tmp_path / 'mmpretrain.pth')
    source = write_official_checkpoint(path, name)
    torch.save({'state_dict': to_mmpretrain(source)}, mmpretrain)
    first = next(k for k in source.state_dict() if k.endswith('weight') and 'head' not in k)
    for file, kwargs in ((path, dict(num_classes=10)), (path, dict(features_only=True)),
                         (mmpretrain, dict(num_classes=10))):
        model = timm.create_model(name, pretrained=True, **kwargs,
                                  pretrained_cfg_overlay=dict(file=file))
        own = next(v for k, v in model.state_dict().items() if k.endswith(first))
        torch.testing.assert_close(own, source.state_dict()[first])
        if 'features_only' not in kwargs:
            assert model.head.out_features == 10


@pytest.mark.parametrize('name,dense_cls,kwargs', [
    ('flatten_pvt_tiny', FLattenPVT, dict(arch='tiny')),
    ('flatten_pvt_v2_b0', FLattenPVTv2, dict(arch='b0')),
    ('flatten_swin_tiny', FLattenSwin, dict(arch='tiny')),
    ('flatten_cswin_tiny', FLattenCSwin, dict(arch='tiny')),
])
def test_dense_backbone_and_classifier_agree(tmp_path, name, dense_cls, kwargs):
    path = str(tmp_path / f'{name}.pth')
    write_official_checkpoint(path, name)
    classifier = timm.create_model(name, pretrained=True,
                                   pretrained_cfg_overlay=dict(file=path)).eval()
    dense = dense_cls(**kwargs, init_cfg=dict(type='Pretrained', checkpoint=path))
    dense.init_weights()
    dense.eval()
    features = timm.create_model(name, pretrained=True, features_only=True,
                                 pretrained_cfg_overlay=dict(file=path)).eval()
    assert features.feature_info.reduction() == [4, 8, 16, 32]
    x = torch.randn(1, 3, 160, 192)
    with torch.no_grad():
        maps = dense(x)
        feats = features(x)
        final = classifier.forward_features(x)
    assert [tuple(m.shape[1:]) for m in maps] == [tuple(f.shape[1:]) for f in feats]
    for i, (m, f) in enumerate(zip(maps, feats)):
        if hasattr(dense, f'norm{i}') and dense_cls in (FLattenSwin, FLattenCSwin):
            f = getattr(dense, f'norm{i}')(f.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(f.shape)
        torch.testing.assert_close(m, f, rtol=1e-5, atol=1e-5)
    last = feats[-1]
    if dense_cls in (FLattenSwin, FLattenCSwin):  # NHWC features after the final norm
        last = classifier.norm(last.permute(0, 2, 3, 1))
    torch.testing.assert_close(final, last, rtol=1e-5, atol=1e-5)
