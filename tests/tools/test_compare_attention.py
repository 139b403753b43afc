"""tools/analysis_tools/compare_attention.py: one row per design with real
numbers, on the tiny shapes data; bad design specs stop it before training."""
import argparse
import csv
import importlib.util
import json
import os
import os.path as osp

import pytest

from demo_runs import ROOT, run

TOOL = osp.join(ROOT, 'tools/analysis_tools/compare_attention.py')
CONFIG = osp.join(ROOT, 'configs/demo/flatten-swin-t_shapes-cls.py')


def load_tool():
    spec = importlib.util.spec_from_file_location('compare_attention', TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def data_options(shapes):
    return ['--cfg-options', f'train_dataloader.dataset.data_root={shapes}/cls/',
            f'val_dataloader.dataset.data_root={shapes}/cls/', 'train_dataloader.batch_size=4',
            'default_hooks.logger.interval=1']


def two_designs():
    """Two designs that own different parameters."""
    return ['focused', 'relu']


def test_two_designs_give_one_row_each_with_real_numbers(shapes, tmp_path):
    work = tmp_path / 'compare'
    designs = two_designs()
    out = run(TOOL, CONFIG, '--designs', *designs, '--iters', '3', '--work-dir', str(work),
              *data_options(shapes), cwd=ROOT)
    rows = list(csv.DictReader(open(work / 'results.csv')))
    assert [r['design'] for r in rows] == designs
    for r in rows:
        assert float(r['train_step_s']) > 0 and float(r['infer_ms_per_img']) > 0
        assert float(r['flops_G']) > 0 and r['shape'] == '64x64'
        assert r['metric'] == 'accuracy/top1' and 0 <= float(r['value']) <= 100
        assert osp.isdir(r['work_dir']) and osp.dirname(r['work_dir']) == str(work)
    assert rows[0]['params_M'] != rows[1]['params_M']
    assert rows[0]['attn_design'] == 'focused'
    table = out[out.index('| design |'):]
    assert all(f'| {d} |' in table for d in designs)
    assert len(json.load(open(work / 'results.json'))) == 2
    assert (work / 'results.png').is_file()
    assert not list(work.glob('*/*.pth'))  # no checkpoints unless --keep-checkpoints


@pytest.mark.parametrize('designs, message', [
    (['focused', 'nosuch'], r"unknown attention design 'nosuch' in 'nosuch'; choose from "
                            r"\[.*'focused'.*\]"),
    (['focused:alpha=2'], r"knob 'alpha' in 'focused:alpha=2': design 'focused' takes "
                          r"\['focusing_factor', 'kernel_size'\]"),
    (['focused:kernel_size=x'], r"knob kernel_size='x' in 'focused:kernel_size=x': not an integer"),
    (['focused:focusing_factor'], r"knob 'focusing_factor' \(write knob=value\)"),
    (['focused', 'focused'], r"design spec 'focused' is given twice"),
    (['focused:focusing_factor=2', 'focused:focusing_factor=2.0'],
     r"design spec 'focused:focusing_factor=2.0' is given twice "
     r"\(as 'focused:focusing_factor=2'\)"),
    (['focused', 'focused:'], r"empty knob list in 'focused:': write focused:knob=value"),
    (['focused:kernel_size=3,kernel_size=5'],
     r"knob 'kernel_size' is given twice in 'focused:kernel_size=3,kernel_size=5'"),
    (['focused', 'focused:focusing_factor=-1'],
     r"design 'focused:focusing_factor=-1': the model does not build: .*focusing_factor"),
])
def test_bad_specs_stop_before_any_training(shapes, tmp_path, designs, message):
    work = tmp_path / 'compare'
    with pytest.raises(SystemExit, match=message):
        load_tool().main([CONFIG, '--designs', *designs, '--iters', '1',
                          '--work-dir', str(work), *data_options(shapes)])
    assert not list(work.glob('*/*/*.log'))  # no run started


def test_knobs_go_with_their_designs():
    """focusing_factor is the focused design's; kernel_size (0: no DWC) that
    of every design with a DWC (focused, angular)."""
    tool = load_tool()
    designs = tool.known_designs()
    with pytest.raises(ValueError, match=r"knob 'kernel_size' in 'relu:kernel_size=3': design "
                                         r"'relu' takes no knobs"):
        tool.parse_spec('relu:kernel_size=3', designs)
    with pytest.raises(ValueError, match=r"knob 'focusing_factor' in 'angular:focusing_factor=2': "
                                         r"design 'angular' takes \['kernel_size'\]"):
        tool.parse_spec('angular:focusing_factor=2', designs)
    assert tool.parse_spec('angular:kernel_size=0', designs).knobs == {'kernel_size': 0}
    spec = tool.parse_spec('focused:focusing_factor=2,kernel_size=3', designs)
    assert spec.knobs == {'focusing_factor': 2.0, 'kernel_size': 3}
    assert spec.slug == 'focused_focusing_factor-2_kernel_size-3'


def test_specs_set_the_backbone_arguments(shapes, tmp_path):
    """attn_design and the knobs land in model.backbone of each run's config,
    with the run's iterations, seed, determinism and work dir."""
    tool = load_tool()
    _, args = tool.parse_args([CONFIG, '--designs', 'x', '--iters', '7', '--seed', '3',
                               '--work-dir', str(tmp_path), *data_options(shapes)])
    spec = tool.parse_spec('focused:kernel_size=0', tool.known_designs())
    cfg = tool.run_config(args, spec)
    assert cfg.model.backbone.attn_design == 'focused' and cfg.model.backbone.kernel_size == 0
    assert cfg.train_cfg.max_iters == 7 and cfg.train_cfg.val_interval == 7
    assert cfg.randomness == dict(seed=3, deterministic=True)
    assert cfg.work_dir == str(tmp_path / 'focused_kernel_size-0')
    assert cfg.default_hooks.checkpoint is None


@pytest.mark.parametrize('model', ['swin', 'deit'])
def test_an_epoch_based_config_runs_by_iterations(tmp_path, model):
    """The ImageNet configs (epochs) become --iters iterations, their
    epoch-stepped schedulers stepped per iteration."""
    tool = load_tool()
    config = osp.join(ROOT, f'configs/attention_designs/flatten-{model}-t_hydra-attn_8xb128_in1k.py')
    _, args = tool.parse_args([config, '--iters', '5', '--work-dir', str(tmp_path)])
    cfg = tool.run_config(args, tool.parse_spec('hydra', tool.known_designs()))
    assert cfg.model.backbone.attn_design == 'hydra'
    assert cfg.train_cfg == dict(type='IterBasedTrainLoop', max_iters=5, val_interval=5)
    assert all(s.convert_to_iter_based for s in cfg.param_scheduler if s.get('by_epoch', True))
    assert cfg.log_processor.by_epoch is False and cfg.default_hooks.checkpoint is None


def test_runs_are_deterministic_without_stopping_on_cuda(shapes, tmp_path, monkeypatch):
    """mmengine's deterministic=True stops a CUDA run at its first matmul
    unless CUBLAS_WORKSPACE_CONFIG is set, and at any op without a deterministic
    kernel (bilinear resizing's backward): the tool sets the variable and
    keeps deterministic algorithms in warn-only mode."""
    import torch
    tool = load_tool()
    monkeypatch.delenv('CUBLAS_WORKSPACE_CONFIG', raising=False)
    _, args = tool.parse_args([CONFIG, '--iters', '1', '--work-dir', str(tmp_path),
                               *data_options(shapes)])
    cfg = tool.run_config(args, tool.parse_spec('focused', tool.known_designs()))
    was = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        tool.build_runner(cfg)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ['CUBLAS_WORKSPACE_CONFIG'] == ':4096:8'
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@pytest.mark.parametrize('metrics, picked', [
    (dict(aAcc=80.0, mIoU=40.0, mAcc=50.0), ('mIoU', 40.0)),
    (dict(aAcc=80.0, mDice=45.0, mAcc=50.0), ('mDice', 45.0)),  # iou_metrics=['mDice']
    (dict(aAcc=80.0, mFscore=47.0, mPrecision=48.0, mRecall=46.0, mAcc=50.0),
     ('mFscore', 47.0)),
    ({'accuracy/top1': 70.0, 'accuracy/top5': 90.0}, ('accuracy/top1', 70.0)),
    (dict(aAcc=80.0), ('aAcc', 80.0)),
    ({}, (None, None)),
])
def test_metric_is_the_first_after_the_pixel_accuracy(metrics, picked):
    """mmseg's IoUMetric with mDice or mFscore: its figure, not aAcc (which
    was reported when mIoU was not asked for)."""
    tool = load_tool()
    assert tool.pick_metric(metrics) == picked
    assert tool.pick_metric(metrics, 'mAcc' if 'mAcc' in metrics else None) == \
        (('mAcc', 50.0) if 'mAcc' in metrics else picked)


def test_finished_runs_are_written_before_a_later_run_fails(tmp_path, monkeypatch):
    """The table files are written after each run: a run that fails (out of
    memory, a bad --metric) keeps the rows of the runs before it (they were
    all lost)."""
    tool = load_tool()
    specs = [tool.parse_spec(t, tool.known_designs()) for t in ('focused', 'relu')]
    cfgs = [argparse.Namespace(work_dir=str(tmp_path / s.slug)) for s in specs]
    monkeypatch.setattr(tool, 'prepare', lambda args: [
        (s, c, dict(params_M=1.0, flops_G=2.0, shape='64x64')) for s, c in zip(specs, cfgs)])

    def train_one(spec, cfg, cost, metric=None):
        if spec.design == 'relu':
            raise RuntimeError('out of memory')
        return dict(design=spec.text, attn_design=spec.design, knobs='', **cost,
                    train_step_s=0.5, infer_ms_per_img=3.0, metric='mIoU', value=41.5,
                    all_metrics={}, work_dir=cfg.work_dir)
    monkeypatch.setattr(tool, 'train_one', train_one)
    with pytest.raises(RuntimeError, match='out of memory'):
        tool.main([CONFIG, '--designs', 'focused', 'relu', '--work-dir', str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / 'results.csv')))
    assert [(r['design'], r['value'], r['shape']) for r in rows] == [('focused', '41.5', '64x64')]


def test_epoch_based_checkpoints_at_evaluations_not_every_iteration(tmp_path):
    """--keep-checkpoints with an ImageNet config: its checkpoint interval of
    1 (epoch) became 1 iteration, a checkpoint per step; now one per
    evaluation."""
    tool = load_tool()
    config = osp.join(ROOT, 'configs/attention_designs/flatten-deit-t_hydra-attn_8xb128_in1k.py')
    _, args = tool.parse_args([config, '--iters', '6', '--val-interval', '3',
                               '--keep-checkpoints', '--work-dir', str(tmp_path)])
    cfg = tool.run_config(args, tool.parse_spec('hydra', tool.known_designs()))
    assert cfg.default_hooks.checkpoint.by_epoch is False
    assert cfg.default_hooks.checkpoint.interval == 3


def test_a_missing_config_is_named(tmp_path, capsys):
    """(was a FileNotFoundError traceback from mmengine)"""
    missing = str(tmp_path / 'nosuch.py')
    with pytest.raises(SystemExit):
        load_tool().main([missing, '--iters', '1', '--work-dir', str(tmp_path)])
    assert f'config not found: {missing}' in capsys.readouterr().err


def test_weights_of_one_design_are_not_started_from_by_another(tmp_path):
    """The ADE20K configs start from ImageNet weights of their own design: the
    tool refuses specs whose parameters those weights do not fit (another
    design, another DWC kernel), before anything is built, and takes the
    config's own design or a run from scratch."""
    tool = load_tool()
    designs = tool.known_designs()
    config = osp.join(ROOT, 'configs/attention_designs/'
                            'upernet_flatten-swin-t_relu-attn_8xb2-160k_ade20k-512x512.py')
    _, args = tool.parse_args([config, '--iters', '5', '--work-dir', str(tmp_path)])
    ckpt = 'work_dirs/flatten-swin-t_relu-attn_8xb128_in1k/epoch_300.pth'
    with pytest.raises(SystemExit, match=(
            rf"design 'hydra': the model starts from '{ckpt}', weights of "
            r"attn_design='relu', kernel_size=5, which do not fit attn_design='hydra'; "
            r"compare from scratch with --cfg-options model.backbone.init_cfg=None")):
        tool.run_config(args, tool.parse_spec('hydra', designs))
    assert tool.run_config(args, tool.parse_spec('relu', designs)).model.backbone.attn_design \
        == 'relu'
    focused = osp.join(ROOT, 'configs/flatten_swin/upernet_flatten-swin-t_8xb2-160k_ade20k-'
                             '512x512.py')
    _, args = tool.parse_args([focused, '--iters', '5', '--work-dir', str(tmp_path)])
    with pytest.raises(SystemExit, match=r"which do not fit kernel_size=3"):
        tool.run_config(args, tool.parse_spec('focused:kernel_size=3', designs))
    _, args = tool.parse_args([focused, '--iters', '5', '--work-dir', str(tmp_path),
                               '--cfg-options', 'model.backbone.init_cfg=None'])
    assert tool.run_config(args, tool.parse_spec('angular', designs)).model.backbone \
        .attn_design == 'angular'
