"""Every config in configs/ loads, builds its model, and runs a forward pass
on the CPU."""
import glob
import os.path as osp

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import DefaultScope, init_default_scope

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
# the ImageNet (mmpretrain) configs are checked in tests/models/test_mmpretrain.py
CONFIGS = sorted(p for p in glob.glob(osp.join(ROOT, 'configs', '*', '*.py')) if '_in1k' not in p)


def test_configs_found():
    names = {osp.relpath(c, osp.join(ROOT, 'configs')) for c in CONFIGS}
    assert {
        'flatten_pvt/mask-rcnn_flatten-pvt-t_fpn_1x_coco.py',
        'flatten_pvt/mask-rcnn_flatten-pvt-s_fpn_1x_coco.py',
        'flatten_pvt/mask-rcnn_flatten-pvt-m_fpn_1x_coco.py',
        'flatten_pvt/retinanet_flatten-pvt-t_fpn_1x_coco.py',
        'flatten_pvt/retinanet_flatten-pvt-s_fpn_1x_coco.py',
        'flatten_pvt/fpn_flatten-pvt-t_4xb4-80k_ade20k-512x512.py',
        'flatten_pvt/fpn_flatten-pvt-s_4xb4-80k_ade20k-512x512.py',
        'flatten_pvt/fpn_flatten-pvt-m_4xb4-80k_ade20k-512x512.py',
        'flatten_swin/mask-rcnn_flatten-swin-t_fpn_1x_coco.py',
        'flatten_swin/mask-rcnn_flatten-swin-s_fpn_1x_coco.py',
        'flatten_swin/mask-rcnn_flatten-swin-t_fpn_ms-crop-3x_coco.py',
        'flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py',
        'flatten_swin/upernet_flatten-swin-s_8xb2-160k_ade20k-512x512.py',
        'flatten_pvtv2/mask-rcnn_flatten-pvtv2-b2_fpn_1x_coco.py',
        'flatten_cswin/mask-rcnn_flatten-cswin-t_fpn_1x_coco.py',
        'flatten_cswin/mask-rcnn_flatten-cswin-t_fpn_ms-crop-3x_coco.py',
        'flatten_cswin/upernet_flatten-cswin-t_8xb2-160k_ade20k-512x512.py',
        'demo/mask-rcnn_flatten-pvt-t_fpn_shapes.py',
        'demo/fpn_flatten-pvt-t_shapes.py',
        'demo/mask-rcnn_flatten-pvtv2-b0_fpn_shapes.py',
        'demo/fpn_flatten-pvtv2-b0_shapes.py',
        'demo/upernet_flatten-swin-t_shapes.py',
        'demo/flatten-swin-t_shapes-cls.py',
        'demo/fpn_flatten-pvtv2-b0_shapes-short.py',
        'attention_designs/upernet_flatten-swin-t_hydra-attn_8xb2-160k_ade20k-512x512.py',
    } <= names


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.relpath(p, ROOT))
def test_config_builds_and_runs_forward(path):
    cfg = Config.fromfile(path)
    scope = cfg.default_scope
    assert scope in ('mmdet', 'mmseg', 'mmpretrain')
    if scope == 'mmpretrain':  # the demo-sized classifier of configs/demo
        return check_classifier(cfg)
    init_default_scope(scope)
    with DefaultScope.overwrite_default_scope(scope):
        from mmengine.registry import MODELS
        model = MODELS.build(cfg.model).eval()
        H, W = 96, 128
        x = torch.rand(1, 3, H, W) * 255
        meta = dict(img_shape=(H, W), ori_shape=(H, W), pad_shape=(H, W),
                    batch_input_shape=(H, W), scale_factor=(1.0, 1.0))
        if scope == 'mmdet':
            from mmdet.structures import DetDataSample
            sample = DetDataSample(metainfo=meta)
        else:
            from mmseg.structures import SegDataSample
            sample = SegDataSample(metainfo=meta)
        with torch.no_grad():
            data = model.data_preprocessor(dict(inputs=[x[0]], data_samples=[sample]))
            results = model(**data, mode='predict')
    assert len(results) == 1
    if scope == 'mmdet':
        pred = results[0].pred_instances
        assert pred.bboxes.shape[-1] == 4 and torch.isfinite(pred.bboxes).all()
    else:
        seg = results[0].pred_sem_seg.data
        assert seg.shape[-2:] == (H, W)


def check_classifier(cfg):
    init_default_scope('mmpretrain')
    from mmpretrain.registry import MODELS
    from mmpretrain.structures import DataSample
    cfg.model.setdefault('data_preprocessor', cfg.data_preprocessor)  # as the Runner does
    model = MODELS.build(cfg.model).eval()
    x = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        data = model.data_preprocessor(dict(inputs=[x], data_samples=[DataSample()]))
        results = model(**data, mode='predict')
    assert len(results) == 1
    assert results[0].pred_score.shape == (cfg.model.head.num_classes, )
