"""ImageNet-style pretraining with mmpretrain, end to end on CPU: our
ImageNet config trains on the shapes classification split, evaluates top-1,
and its checkpoint initialises a detector's backbone."""
import json
import os.path as osp
import re

import pytest
import torch

from demo_runs import ROOT, run
from flatten_mm import load_checkpoint_file

TRAIN = osp.join(ROOT, 'tools/train.py')
CLS = osp.join(ROOT, 'configs/flatten_pvtv2/flatten-pvtv2-b0_8xb128_in1k.py')
DET = osp.join(ROOT, 'configs/demo/mask-rcnn_flatten-pvt-t_fpn_shapes.py')
CLASSES = "['circle','square','triangle']"


def cls_options(shapes):
    # two epochs of 3 steps: one of warm-up, one of cosine decay
    options = ['train_cfg.max_epochs=2', 'param_scheduler.0.end=1', 'param_scheduler.1.begin=1',
               'default_hooks.logger.interval=1',
               'model.head.num_classes=3', 'data_preprocessor.num_classes=3',
               'val_evaluator.topk=[1]', 'test_evaluator.topk=[1]']
    for loader, split in (('train_dataloader', 'train'), ('val_dataloader', 'val'),
                          ('test_dataloader', 'val')):
        options += [f'{loader}.batch_size=8', f'{loader}.num_workers=0',
                    f'{loader}.persistent_workers=False',
                    f'{loader}.dataset.data_root={shapes}/cls', f'{loader}.dataset.split={split}',
                    f'{loader}.dataset.metainfo.classes={CLASSES}']
    return ['--cfg-options', *options]


@pytest.mark.heavy(27)
def test_pretrain_then_initialise_the_demo_detector(shapes, tmp_path):
    work = str(tmp_path / 'cls')
    log = run(TRAIN, CLS, '--work-dir', work, *cls_options(shapes), cwd=ROOT)
    assert re.search(r'Epoch\(train\) +\[2\]\[3/3\].*loss: [0-9.]+', log), log[-2000:]
    top1 = float(re.findall(r'accuracy/top1: ([0-9.]+)', log)[-1])
    assert 0 <= top1 <= 100
    ckpt = osp.join(work, 'epoch_2.pth')
    state = load_checkpoint_file(ckpt)['state_dict']
    metrics = str(tmp_path / 'metrics.json')
    run(osp.join(ROOT, 'tools/test.py'), CLS, ckpt, '--work-dir', str(tmp_path / 'test'),
        '--metrics-out', metrics, *cls_options(shapes), cwd=ROOT)
    # the same weights on the same split (the log rounds to 4 decimals)
    assert abs(json.load(open(metrics))['accuracy/top1'] - top1) < 1e-3
    assert {k.split('.')[0] for k in state} == {'backbone', 'head'}

    # the pretrained backbone initialises the demo detector's: nothing missing or
    # unexpected but the classifier's head (our loader raises otherwise)
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmdet.registry import MODELS
    init_default_scope('mmdet')
    cfg = Config.fromfile(DET)
    cfg.model.backbone = dict(type='FLattenPVTv2', arch='b0',
                              init_cfg=dict(type='Pretrained', checkpoint=ckpt))
    cfg.model.neck.in_channels = [32, 64, 160, 256]
    detector = MODELS.build(cfg.model)
    detector.init_weights()
    backbone = detector.backbone.state_dict()
    assert backbone.keys() == {k[len('backbone.'):] for k in state if k.startswith('backbone.')}
    for key, value in backbone.items():
        torch.testing.assert_close(value, state[f'backbone.{key}'], msg=key)
