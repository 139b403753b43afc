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
 the demo-sized classifiers (configs/attention_designs)  names = {osp.relpath(c, osp.join(ROOT, 'configs')) for c in CONFIGS}
 the demo-sized classifiers (configs/attention_designs)  assert {
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvt/mask-rcnn_flatten-pvt-t_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvt/mask-rcnn_flatten-pvt-s_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvt/mask-rcnn_flatten-pvt-m_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvt/retinanet_flatten-pvt-t_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvt/retinanet_flatten-pvt-s_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvt/fpn_flatten-pvt-t_4xb4-80k_ade20k-512x512.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvt/fpn_flatten-pvt-s_4xb4-80k_ade20k-512x512.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvt/fpn_flatten-pvt-m_4xb4-80k_ade20k-512x512.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_swin/mask-rcnn_flatten-swin-t_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_swin/mask-rcnn_flatten-swin-s_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_swin/mask-rcnn_flatten-swin-t_fpn_ms-crop-3x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-512x512.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_swin/upernet_flatten-swin-s_8xb2-160k_ade20k-512x512.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_pvtv2/mask-rcnn_flatten-pvtv2-b2_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_cswin/mask-rcnn_flatten-cswin-t_fpn_1x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_cswin/mask-rcnn_flatten-cswin-t_fpn_ms-crop-3x_coco.py',
 the demo-sized classifiers (configs/attention_designs)      'flatten_cswin/upernet_flatten-cswin-t_8xb2-160k_ade20k-512x512.py',
 the demo-sized classifiers (configs/attention_designs)      'demo/mask-rcnn_flatten-pvt-t_fpn_shapes.py',
 the demo-sized classifiers (configs/attention_designs)      'demo/fpn_flatten-pvt-t_shapes.py',
 the demo-sized classifiers (configs/attention_designs)      'demo/mask-rcnn_flatten-pvtv2-b0_fpn_shapes.py',
 the demo-sized classifiers (configs/attention_designs)      'demo/fpn_flatten-pvtv2-b0_shapes.py',
 the demo-sized classifiers (configs/attention_designs)      'demo/upernet_flatten-swin-t_shapes.py',
 the demo-sized classifiers (configs/attention_designs)  } <= names


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.relpath(p, ROOT))
def test_config_builds_and_runs_forward(path):
 the demo-sized classifiers (configs/attention_designs)  cfg = Config.fromfile(path)
 the demo-sized classifiers (configs/attention_designs)  scope = cfg.default_scope
 the demo-sized classifiers (configs/attention_designs)  assert scope in ('mmdet', 'mmseg', 'mmpretrain')
 the demo-sized classifiers (configs/attention_designs)  if scope == 'mmpretrain':  # the demo-sized classifiers (configs/attention_designs)
 the demo-sized classifiers (configs/attention_designs)      return check_classifier(cfg)
 the demo-sized classifiers (configs/attention_designs)  init_default_scope(scope)
 the demo-sized classifiers (configs/attention_designs)  with DefaultScope.overwrite_default_scope(scope):
 the demo-sized classifiers (configs/attention_designs)      from mmengine.registry import MODELS
 the demo-sized classifiers (configs/attention_designs)      model = MODELS.build(cfg.model).eval()
 the demo-sized classifiers (configs/attention_designs)      H, W = 96, 128
 the demo-sized classifiers (configs/attention_designs)      x = torch.rand(1, 3, H, W) * 255
 the demo-sized classifiers (configs/attention_designs)      meta = dict(img_shape=(H, W), ori_shape=(H, W), pad_shape=(H, W),
 the demo-sized classifiers (configs/attention_designs)                  batch_input_shape=(H, W), scale_factor=(1.0, 1.0))
 the demo-sized classifiers (configs/attention_designs)      if scope == 'mmdet':
 the demo-sized classifiers (configs/attention_designs)          from mmdet.structures import DetDataSample
 the demo-sized classifiers (configs/attention_designs)          sample = DetDataSample(metainfo=meta)
 the demo-sized classifiers (configs/attention_designs)      else:
 the demo-sized classifiers (configs/attention_designs)          from mmseg.structures import SegDataSample
 the demo-sized classifiers (configs/attention_designs)          sample = SegDataSample(metainfo=meta)
 the demo-sized classifiers (configs/attention_designs)      with torch.no_grad():
 the demo-sized classifiers (configs/attention_designs)          data = model.data_preprocessor(dict(inputs=[x[0]], data_samples=[sample]))
 the demo-sized classifiers (configs/attention_designs)          results = model(**data, mode='predict')
 the demo-sized classifiers (configs/attention_designs)  assert len(results) == 1
 the demo-sized classifiers (configs/attention_designs)  if scope == 'mmdet':
 the demo-sized classifiers (configs/attention_designs)      pred = results[0].pred_instances
 the demo-sized classifiers (configs/attention_designs)      assert pred.bboxes.shape[-1] == 4 and torch.isfinite(pred.bboxes).all()
 the demo-sized classifiers (configs/attention_designs)  else:
 the demo-sized classifiers (configs/attention_designs)      seg = results[0].pred_sem_seg.data
 the demo-sized classifiers (configs/attention_designs)      assert seg.shape[-2:] == (H, W)


def check_classifier(cfg):
 the demo-sized classifiers (configs/attention_designs)  init_default_scope('mmpretrain')
 the demo-sized classifiers (configs/attention_designs)  from mmpretrain.registry import MODELS
 the demo-sized classifiers (configs/attention_designs)  from mmpretrain.structures import DataSample
 the demo-sized classifiers (configs/attention_designs)  cfg.model.setdefault('data_preprocessor', cfg.data_preprocessor)  # as the Runner does
 the demo-sized classifiers (configs/attention_designs)  model = MODELS.build(cfg.model).eval()
 the demo-sized classifiers (configs/attention_designs)  x = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8)
 the demo-sized classifiers (configs/attention_designs)  with torch.no_grad():
 the demo-sized classifiers (configs/attention_designs)      data = model.data_preprocessor(dict(inputs=[x], data_samples=[DataSample()]))
 the demo-sized classifiers (configs/attention_designs)      results = model(**data, mode='predict')
 the demo-sized classifiers (configs/attention_designs)  assert len(results) == 1
 the demo-sized classifiers (configs/attention_designs)  assert results[0].pred_score.shape == (cfg.model.head.num_classes, )
