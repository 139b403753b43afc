"""The backbones are reachable from mmdet's and mmseg's registries and from
timm, and run at odd input sizes when built from there."""
import importlib

import pytest
import torch

import flatten_mm
from flatten_mm import registry


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg', 'mmpretrain'])
@pytest.mark.parametrize('cfg', [
    dict(type='FLattenPVT', arch='tiny'),
    dict(type='FLattenPVTv2', arch='b0'),
    dict(type='FLattenSwin', arch='tiny', depths=[2, 2, 2, 2]),
    dict(type='FLattenCSwin', arch='tiny', depths=[1, 2, 2, 1]),
])
def test_build_from_openmmlab_registry_at_odd_sizes(scope, cfg):
    MODELS = importlib.import_module(f'{scope}.registry').MODELS
    model = MODELS.build(cfg).eval()
    assert type(model).__name__ == cfg['type']
    for hw in [(333, 517), (97, 131)]:
        with torch.no_grad():
            outs = model(torch.randn(1, 3, *hw))
        assert len(outs) == 4
        for o, s in zip(outs, (4, 8, 16, 32)):
            assert tuple(o.shape[2:]) == (-(-hw[0] // s), -(-hw[1] // s))
            assert not torch.isnan(o).any()


def test_unknown_option_is_named():
    from mmdet.registry import MODELS
    with pytest.raises(TypeError, match='window_sz'):
        MODELS.build(dict(type='FLattenSwin', window_sz=7))


def test_each_library_is_optional(monkeypatch):
    real = importlib.import_module

    def no_mmseg(name, *args, **kwargs):
        if name.startswith('mmseg'):
            raise ImportError('No module named mmseg')
        return real(name, *args, **kwargs)
    monkeypatch.setattr(registry.importlib, 'import_module', no_mmseg)
    assert registry.register_openmmlab() == ['mmdet', 'mmpretrain']


def test_version_and_exports():
    assert flatten_mm.__version__.count('.') == 2
    assert set(flatten_mm.registry.TIMM_MODELS) >= {'flatten_pvt_tiny', 'flatten_swin_base_384'}


def test_roi_align_reads_backbone_maps_correctly():
    """mmcv's compiled RoIAlign reads raw NCHW memory; a channels-last view
    would make it gather wrong values without any error."""
    from mmcv.ops import roi_align
    from mmdet.registry import MODELS
    model = MODELS.build(dict(type='FLattenPVT', arch='tiny')).eval()
    with torch.no_grad():
        feat = model(torch.randn(1, 3, 64, 64))[0]
    rois = torch.tensor([[0., 2., 3., 40., 50.]])
    got = roi_align(feat, rois, (7, 7), 0.25, 2, 'avg', True)
    want = roi_align(feat.contiguous(memory_format=torch.contiguous_format).clone(), rois,
                     (7, 7), 0.25, 2, 'avg', True)
    torch.testing.assert_close(got, want)
    assert got.abs().sum() > 0
