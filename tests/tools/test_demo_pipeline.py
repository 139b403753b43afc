"""The demo path end to end on tiny data: make the data, train a few
iterations with tools/train.py, evaluate with tools/test.py (real metrics,
pictures), and draw predictions with tools/infer.py."""
import json
import os
import os.path as osp
import re

import pytest

from demo_runs import ROOT, det_options, losses, run, seg_options


def test_data_is_deterministic_and_complete(shapes, tmp_path):
    coco = json.load(open(osp.join(shapes, 'annotations/instances_val.json')))
    assert len(coco['images']) == 6 and {c['name'] for c in coco['categories']} == \
        {'circle', 'square', 'triangle'}
    assert all(a['area'] > 0 and len(a['bbox']) == 4 for a in coco['annotations'])
    again = tmp_path / 'again'
    run(osp.join(ROOT, 'tools/make_demo_data.py'), str(again), '--train', '24', '--val', '6',
        '--size', '64', cwd=ROOT)
    assert open(osp.join(shapes, 'annotations/instances_val.json')).read() == \
        open(again / 'annotations/instances_val.json').read()
    train = json.load(open(osp.join(shapes, 'annotations/instances_train.json')))
    assert len(os.listdir(osp.join(shapes, 'ade/annotations/training'))) == 24
    assert train['annotations'][0]['segmentation'] != coco['annotations'][0]['segmentation']


@pytest.mark.heavy(37)
def test_detection_demo_trains_evaluates_and_draws(shapes, tmp_path):
    cfg = osp.join(ROOT, 'configs/demo/mask-rcnn_flatten-pvt-t_fpn_shapes.py')
    work = str(tmp_path / 'det')
    log = run(osp.join(ROOT, 'tools/train.py'), cfg, '--work-dir', work,
              *det_options(shapes, 12), 'model.train_cfg.rpn_proposal.max_per_img=100', cwd=ROOT)
    loss = losses(log)
    assert len(loss) == 12
    assert sum(loss[-3:]) < sum(loss[:3])
    assert 'coco/bbox_mAP' in log and 'coco/segm_mAP' in log
    ckpt = osp.join(work, 'iter_12.pth')
    metrics_file = str(tmp_path / 'det.json')
    run(osp.join(ROOT, 'tools/test.py'), cfg, ckpt, '--work-dir', work, '--show-dir', 'pics',
        '--metrics-out', metrics_file, *det_options(shapes, 12), cwd=ROOT)
    metrics = json.load(open(metrics_file))
    assert 0.0 <= metrics['coco/bbox_mAP'] <= 1.0 and 'coco/segm_mAP' in metrics
    pics = [f for d, _, fs in os.walk(work) if d.endswith('pics') for f in fs]
    assert len(pics) == 6
    out = str(tmp_path / 'infer')
    image = osp.join(shapes, 'images/val/00000.jpg')
    run(osp.join(ROOT, 'tools/infer.py'), cfg, ckpt, image, '--out-dir', out, cwd=ROOT)
    assert os.listdir(osp.join(out, 'vis')) == ['00000.jpg']


@pytest.mark.parametrize('config', ['fpn_flatten-pvt-t_shapes.py', 'fpn_flatten-pvtv2-b0_shapes.py',
                                    'upernet_flatten-swin-t_shapes.py'])
@pytest.mark.heavy(25)
def test_segmentation_demo_trains_and_evaluates(shapes, tmp_path, config):
    cfg = osp.join(ROOT, 'configs/demo', config)
    work = str(tmp_path / 'seg')
    log = run(osp.join(ROOT, 'tools/train.py'), cfg, '--work-dir', work,
              *seg_options(shapes, 10), cwd=ROOT)
    loss = losses(log)
    assert len(loss) == 10
    assert sum(loss[-3:]) < sum(loss[:3])
    miou = re.findall(r'mIoU: ([0-9.]+)', log)
    assert miou and 0.0 <= float(miou[-1]) <= 100.0
    if config.startswith('fpn'):
        out = str(tmp_path / 'infer')
        image = osp.join(shapes, 'ade/images/validation/00001.jpg')
        run(osp.join(ROOT, 'tools/infer.py'), cfg, osp.join(work, 'iter_10.pth'), image,
            '--out-dir', out, cwd=ROOT)
        assert os.listdir(osp.join(out, 'vis')) == ['00001.jpg']
