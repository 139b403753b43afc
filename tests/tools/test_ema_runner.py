"""mmengine's EMAHook in a real Runner on the demo detector: validation of the
EMA model (its weights swapped in with ``.data.copy_``) gives the predictions
that testing the saved EMA checkpoint gives in a fresh process (issue 23)."""
import os.path as osp
import pickle

import pytest
import torch

from demo_runs import ROOT, run

CONFIG = '''
_base_ = {base!r}
custom_hooks = [dict(type='EMAHook', momentum=0.5, priority=49)]
model = dict(test_cfg=dict(rcnn=dict(score_thr=0.0, max_per_img=10)))
train_dataloader = dict(batch_size=2, dataset=dict(data_root={root!r}))
val_dataloader = dict(batch_size=3, dataset=dict(data_root={root!r}, indices=3))
test_dataloader = val_dataloader
val_evaluator = dict(_delete_=True, type='DumpDetResults', out_file_path={val!r})
test_evaluator = dict(_delete_=True, type='DumpDetResults', out_file_path={test!r})
train_cfg = dict(max_iters=2, val_interval=2)
param_scheduler = []
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=2))
'''


@pytest.mark.heavy(20)
def test_ema_validation_equals_testing_the_ema_checkpoint(shapes, tmp_path):
    pytest.importorskip('mmdet')
    val, test = str(tmp_path / 'val.pkl'), str(tmp_path / 'test.pkl')
    cfg = tmp_path / 'ema.py'
    cfg.write_text(CONFIG.format(base=osp.join(ROOT, 'configs/demo/mask-rcnn_flatten-pvt-t_'
                                               'fpn_shapes.py'),
                                 root=shapes + '/', val=val, test=test))
    work = str(tmp_path / 'work')
    run(osp.join(ROOT, 'tools/train.py'), str(cfg), '--work-dir', work, cwd=ROOT)
    ckpt = torch.load(osp.join(work, 'iter_2.pth'), map_location='cpu', weights_only=False)
    # the EMA weights differ from the trained ones: a stale swap would show
    # (the checkpoint's state_dict holds the EMA weights, ema_state_dict the trained ones)
    other = {k[len('module.'):]: v for k, v in ckpt['ema_state_dict'].items()}
    assert sum(not torch.equal(v, other[k]) for k, v in ckpt['state_dict'].items()) > 100
    run(osp.join(ROOT, 'tools/test.py'), str(cfg), osp.join(work, 'iter_2.pth'),
        '--work-dir', work, cwd=ROOT)
    with open(val, 'rb') as f:
        got = pickle.load(f)
    with open(test, 'rb') as f:
        want = pickle.load(f)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        a, b = a['pred_instances'], b['pred_instances']
        assert len(a['scores']) > 0
        for key in ('bboxes', 'scores', 'labels'):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)
