"""tools/analysis_tools/compare_attention.py: one row per design with real
numbers, on the tiny shapes data; bad design specs stop it before training."""
import csv
import importlib.util
import json
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
    designs = load_tool().known_designs()
    return ['focused', 'relu'] if 'relu' in designs else ['focused', 'focused:kernel_size=3']


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
    (['focused', 'focused:focusing_factor=-1'],
     r"design 'focused:focusing_factor=-1': the model does not build: .*focusing_factor"),
])
def test_bad_specs_stop_before_any_training(shapes, tmp_path, designs, message):
    work = tmp_path / 'compare'
    with pytest.raises(SystemExit, match=message):
        load_tool().main([CONFIG, '--designs', *designs, '--iters', '1',
                          '--work-dir', str(work), *data_options(shapes)])
    assert not list(work.glob('*/*/*.log'))  # no run started


def test_a_knob_of_another_design_is_refused():
    tool = load_tool()
    designs = ('focused', 'relu')
    with pytest.raises(ValueError, match=r"knob 'kernel_size' in 'relu:kernel_size=3': design "
                                         r"'relu' takes no knobs"):
        tool.parse_spec('relu:kernel_size=3', designs)
    spec = tool.parse_spec('focused:focusing_factor=2,kernel_size=3', designs)
    assert spec.knobs == {'focusing_factor': 2.0, 'kernel_size': 3}
    assert spec.slug == 'focused_focusing_factor-2_kernel_size-3'
