"""What a user gets from tools/train.py for a config or data that cannot work:
an error whose last line names the problem (not a shape mismatch or a hang)."""
import os
import os.path as osp
import subprocess
import sys

import pytest

from demo_runs import ROOT, seg_options
from official_format import write_official_checkpoint

import flatten_mm  # noqa: F401,E402  (registers the timm names the checkpoints are made from)

SEG = osp.join(ROOT, 'configs/demo/fpn_flatten-pvt-t_shapes.py')


def train_error(*args, cwd=ROOT, **env):
    """Run tools/train.py (with these environment variables), expect it to fail,
    return its last output line."""
    env = dict(os.environ, PYTHONWARNINGS='ignore', **env)
    proc = subprocess.run([sys.executable, osp.join(ROOT, 'tools/train.py'), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return [line for line in proc.stderr.splitlines() if line.strip()][-1]


def config_with_backbone(tmp_path, **backbone):
    path = tmp_path / 'bad_config.py'
    path.write_text(f'_base_ = [{SEG!r}]\nmodel = dict(backbone=dict(**{backbone!r}))\n')
    return str(path)


def test_unknown_backbone_option(shapes, tmp_path):
    cfg = config_with_backbone(tmp_path, window_sz=7)
    last = train_error(cfg, '--work-dir', str(tmp_path / 'w'), *seg_options(shapes, 1))
    assert last == "TypeError: FLattenPVT got unexpected argument(s) 'window_sz'; it takes " \
        'arch, in_channels, embed_dims, depths, num_heads, mlp_ratios, attn_type, sr_ratios, ' \
        'focusing_factor, kernel_size, attn_design, pretrain_img_size, qkv_bias, drop_rate, ' \
        'attn_drop_rate, drop_path_rate, out_indices, frozen_stages, norm_eval, with_cp, init_cfg'


def test_wrong_arch(shapes, tmp_path):
    cfg = config_with_backbone(tmp_path, arch='huge')
    last = train_error(cfg, '--work-dir', str(tmp_path / 'w'), *seg_options(shapes, 1))
    assert last == "ValueError: arch must be one of ['large', 'medium', 'small', 'tiny'], " \
        "got 'huge'"


def test_missing_checkpoint(shapes, tmp_path):
    missing = str(tmp_path / 'flatten_pvt_tiny.pth')
    cfg = config_with_backbone(tmp_path, init_cfg=dict(_delete_=True, type='Pretrained',
                                                        checkpoint=missing))
    last = train_error(cfg, '--work-dir', str(tmp_path / 'w'), *seg_options(shapes, 1))
    assert last.endswith(f'checkpoint file not found: {missing}')


def test_checkpoint_of_another_architecture(shapes, tmp_path):
    swin = str(tmp_path / 'flatten_swin_tiny.pth')
    write_official_checkpoint(swin, 'flatten_swin_tiny')
    cfg = config_with_backbone(tmp_path, init_cfg=dict(_delete_=True, type='Pretrained',
                                                        checkpoint=swin))
    last = train_error(cfg, '--work-dir', str(tmp_path / 'w'), *seg_options(shapes, 1))
    assert f'{swin} does not fit FLattenPVT' in last
    assert 'Is it a checkpoint of another architecture?' in last


def test_empty_dataset(shapes, tmp_path):
    empty = tmp_path / 'empty'
    for d in ('images/training', 'annotations/training', 'images/validation',
              'annotations/validation'):
        (empty / d).mkdir(parents=True)
    opts = seg_options(shapes, 1)
    opts = [o.replace(f'{shapes}/ade/', f'{empty}/') for o in opts]
    last = train_error(SEG, '--work-dir', str(tmp_path / 'w'), *opts)
    assert 'the dataset holds no samples (BaseSegDataset' in last
    assert f"data_root='{empty}/'" in last


def test_amp_without_gpu_says_so(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip('a GPU is present: --amp works')
    last = train_error(SEG, '--amp', '--work-dir', str(tmp_path / 'w'))
    assert "--amp needs a GPU: mmengine's AmpOptimWrapper does not run on the CPU" in last


def test_setuptools_without_pkg_resources_says_so(shapes, tmp_path):
    """setuptools 82 removed pkg_resources, through which mmengine looks up the
    package of an ``mmdet::`` / ``mmseg::`` base (every config here has one)."""
    blocker = tmp_path / 'site' / 'pkg_resources'
    blocker.mkdir(parents=True)  # as if setuptools >= 82: no such module
    (blocker / '__init__.py').write_text(
        "raise ModuleNotFoundError(\"No module named 'pkg_resources'\", name='pkg_resources')\n")
    path = os.pathsep.join([str(tmp_path / 'site'), os.environ.get('PYTHONPATH', '')])
    last = train_error(SEG, '--work-dir', str(tmp_path / 'w'), *seg_options(shapes, 1),
                       PYTHONPATH=path)
    assert last.startswith(f"ModuleNotFoundError: {SEG} inherits an installed package's "
                           'configs, which mmengine looks up through pkg_resources'), last
    assert last.endswith('(setuptools 82 removed it): pip install "setuptools<82"'), last
