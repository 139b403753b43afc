"""Every argument is checked when the backbone is built, with an error that
names it and says what is allowed; empty inputs are rejected at the entry
(issue 23: these failed deep inside, at the first training step, or were
silently ignored)."""
import os
import re
import warnings

import pytest
import torch

from backbone_checks import FAMILIES, small_backbone

OUT_INDICES = (r'out_indices must be stage indices in -4..3 \(negative: from the last\), distinct '
               r'and increasing')


@pytest.mark.parametrize('kwargs,match', [
    (dict(pretrain_img_size=31), 'pretrain_img_size must be an int >= 32, got 31'),
    (dict(pretrain_img_size=(224, 16)), 'pretrain_img_size must be an int >= 32, got 16'),
    (dict(pretrain_img_size=(224, 224, 224)), 'pretrain_img_size must be an int or a pair'),
    (dict(drop_path_rate=1.5), r'drop_path_rate must be a number in \[0, 1\), got 1.5'),
    (dict(drop_path_rate=-0.1), r'drop_path_rate must be a number in \[0, 1\), got -0.1'),
    (dict(drop_path_rate=1.0), r'drop_path_rate must be a number in \[0, 1\), got 1.0'),
    (dict(drop_rate=1.0), r'drop_rate must be a number in \[0, 1\), got 1.0'),
    (dict(attn_drop_rate=-0.5), r'attn_drop_rate must be a number in \[0, 1\), got -0.5'),
    (dict(attn_drop_rate=0.9, attn_type='LLLL'), 'attn_drop_rate must be 0 without softmax'),
    (dict(out_indices=-5), OUT_INDICES + r'.*got -5$'),
    (dict(out_indices=(0, -4)), OUT_INDICES + r'.*got \(0, -4\)'),
    (dict(out_indices=(3, 0)), OUT_INDICES + r'.*got \(3, 0\)'),
    (dict(out_indices=(0, 0)), OUT_INDICES + r'.*got \(0, 0\)'),
    (dict(out_indices=()), OUT_INDICES),
    (dict(out_indices=(0, 4)), OUT_INDICES),
    (dict(out_indices=(True,)), OUT_INDICES),
    (dict(focusing_factor=float('nan')), 'focusing_factor must be a finite number > 0, got nan'),
    (dict(focusing_factor=float('inf')), 'focusing_factor must be a finite number'),
    (dict(focusing_factor=0), 'focusing_factor must be a finite number'),
    (dict(kernel_size=4), 'kernel_size must be odd'),
    (dict(in_channels=0), 'in_channels must be an int >= 1, got 0'),
    (dict(frozen_stages=True), r'frozen_stages must be an int in -1..4'),
    (dict(depths=[1, 0, 1, 1]), r'depths must be positive ints, got \[1, 0, 1, 1\]'),
])
@pytest.mark.parametrize('family', FAMILIES)
def test_bad_arguments_fail_at_build_time(family, kwargs, match):
    with pytest.raises(ValueError, match=match):
        small_backbone(family, **kwargs)


@pytest.mark.parametrize('family', FAMILIES)
def test_out_indices_as_one_index_or_counted_from_the_end(family):
    """As mmseg's and mmpretrain's ViT take them (configs ported from them)."""
    assert small_backbone(family, out_indices=-1).out_indices == (3, )
    assert small_backbone(family, out_indices=2).out_indices == (2, )
    assert small_backbone(family, out_indices=[1, -1]).out_indices == (1, 3)


@pytest.mark.parametrize('family', FAMILIES)
def test_stage_heads_and_mlp_ratio(family):
    pvt = family.startswith('pvt')
    heads = dict(num_heads=[1, 2, 3, 5]) if pvt else dict(num_heads=[2, 2, 4, 5])
    with pytest.raises(ValueError, match=r'embed_dims \(\d+\) must be divisible by num_heads '
                                         r'\(5\) at stage 4'):
        small_backbone(family, **heads)
    ratio = dict(mlp_ratios=[4, 4, 0.001, 4]) if pvt else dict(mlp_ratio=0.001)
    name = 'mlp_ratios' if pvt else 'mlp_ratio'
    with pytest.raises(ValueError, match=f'{name} must give every MLP a hidden layer'):
        small_backbone(family, **ratio)
    ratio = dict(mlp_ratios=[4, 4, -1, 4]) if pvt else dict(mlp_ratio=float('nan'))
    with pytest.raises(ValueError, match=f'{name} must be a finite number > 0'):
        small_backbone(family, **ratio)


@pytest.mark.parametrize('family', FAMILIES)
def test_attn_drop_rate_on_linear_stages_warns(family):
    with pytest.warns(UserWarning, match=re.escape(
            "attn_drop_rate=0.1 applies to the softmax (S) stages only; the focused linear (L) "
            "stages of attn_type='LLSS' form no attention matrix")):
        small_backbone(family, attn_type='LLSS', attn_drop_rate=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        small_backbone(family, attn_type='SSSS', attn_drop_rate=0.1)
        small_backbone(family, attn_type='LLSS', attn_drop_rate=0.)


@pytest.mark.parametrize('shape', [(0, 3, 64, 64), (1, 3, 0, 64), (2, 3, 64, 0), (1, 3, 0, 0)])
@pytest.mark.parametrize('family', FAMILIES)
def test_empty_batches_and_images_rejected(family, shape):
    m = small_backbone(family)
    msg = re.escape('expected a non-empty batch of images (B, C, H, W) with B >= 1, H >= 1 '
                    f'and W >= 1, got shape {shape}')
    for mode in (m.train, m.eval):
        mode()
        with pytest.raises(ValueError, match=msg):
            m(torch.randn(shape))


@pytest.mark.parametrize('family', FAMILIES)
def test_valid_edge_arguments(family):
    m = small_backbone(family, pretrain_img_size=32, drop_path_rate=0.99, out_indices=[1, 3])
    assert m.out_indices == (1, 3)
    outs = m(torch.randn(1, 3, 33, 17))
    assert [o.shape[-2:] for o in outs] == [(5, 3), (2, 1)]


@pytest.mark.parametrize('family', FAMILIES + ('deit',))
def test_unknown_argument_named_with_what_the_backbone_takes(family):
    with pytest.raises(TypeError) as info:
        small_backbone(family, window_sz=7)
    msg = str(info.value)
    name = {'pvt': 'FLattenPVT', 'pvtv2': 'FLattenPVTv2', 'swin': 'FLattenSwin',
            'cswin': 'FLattenCSwin', 'deit': 'FLattenDeiT'}[family]
    assert msg.startswith(f"{name} got unexpected argument(s) 'window_sz'; it takes arch, "
                          'in_channels, embed_dims, ')
    assert msg.endswith(', with_cp, init_cfg')  # nothing about softmax backbones


@pytest.mark.parametrize('config,ours', [
    ('swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', 'FLattenSwin'),
    ('pvt/retinanet_pvt-t_fpn_1x_coco.py', 'FLattenPVT'),
    ('pvt/retinanet_pvtv2-b0_fpn_1x_coco.py', 'FLattenPVTv2')])
def test_softmax_backbone_arguments_say_how_to_replace_it(config, ours):
    """A config that inherits mmdet's Swin or PVT and changes only the
    backbone's type hands on that backbone's arguments: the error names those
    a FLatten backbone does not take, renamings, and ``_delete_=True``."""
    import mmdet
    from mmengine.config import Config
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules()
    cfg = Config.fromfile(os.path.join(os.path.dirname(mmdet.__file__), '.mim/configs', config))
    backbone = dict(cfg.model.backbone, type=ours)
    with pytest.raises(TypeError) as info:
        MODELS.build(backbone)
    msg = str(info.value)
    upstream = {'FLattenSwin': "'convert_weights', 'patch_norm', 'qk_scale' are arguments",
                'FLattenPVT': "'num_layers' is 'depths' here. 'num_layers' is an argument",
                'FLattenPVTv2': "'num_layers' is 'depths' here. 'num_layers' is an argument"}
    assert f'{ours} got unexpected argument(s) ' in msg and upstream[ours] in msg
    assert msg.endswith(f"of a softmax backbone (mmdet's, mmseg's or mmpretrain's Swin, PVT "
                        f"or ViT): a config that inherits one should replace it with "
                        f"backbone=dict(_delete_=True, type='{ours}', ...)")


@pytest.mark.parametrize('name', ['flatten_pvt_tiny', 'flatten_swin_tiny', 'flatten_deit_tiny'])
def test_timm_classifier_lists_its_and_the_backbones_arguments(name):
    """A classifier hands what it does not take itself on to its backbone: the
    error lists both (timm's in_chans, not the in_channels it sets from it)."""
    import timm
    with pytest.raises(TypeError) as info:
        timm.create_model(name, window_sz=7)
    msg = str(info.value)
    assert "Classifier got unexpected argument(s) 'window_sz'; it takes arch, num_classes, " \
        'global_pool, in_chans, embed_dims, ' in msg
    assert msg.endswith('drop_path_rate, out_indices, frozen_stages, norm_eval, with_cp, init_cfg')
    assert 'in_channels' not in msg and 'final_norm' not in msg
