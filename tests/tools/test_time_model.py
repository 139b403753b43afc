"""tools/analysis_tools/time_model.py: a GPU step's time modeled from its counted
ops, bytes and FLOPs, fitted on measured softmax rows."""
import csv
import json

import pytest

from analysis_tool import load_tool



tm = load_tool('time_model')


def test_a_step_takes_the_slower_of_host_and_gpu():
    p = tm.Params(bw=1e12, host=1e-3, half=1e14, fp32=1e13)
    # 2 GB of plain ops; a 16-bit and an fp32 matmul bound by their FLOPs; a 16-bit one by bytes
    prof = tm.Profile(10, 2 * 10 ** 9, [(10 ** 6, 10 ** 12, True), (10 ** 6, 10 ** 11, False),
                                        (4 * 10 ** 9, 10 ** 9, True)])
    t, host, gpu = tm.modeled_s(prof, p)
    assert gpu == pytest.approx(2e-3 + 1e-2 + 1e-2 + 4e-3)
    assert host == pytest.approx(1e-2) and t == gpu
    t, host, _ = tm.modeled_s(prof._replace(ops=100), p)
    assert t == host == pytest.approx(0.1)


def test_the_fit_finds_the_parameters_that_made_the_times():
    """Times made by the model at a grid point, each parameter binding in some
    case: the fit returns that point with no error; times made one step of
    bandwidth off, it follows them there."""
    truth = tm.Params(tm.GRID['bw'][7], tm.GRID['host'][11], tm.GRID['half'][2],
                      tm.GRID['fp32'][4])
    profiles = [tm.Profile(5000, 10 ** 6, []),                             # launch-bound
                tm.Profile(100, 10 ** 11, [(10 ** 9, 10 ** 12, True)]),    # bytes
                tm.Profile(100, 10 ** 8, [(10 ** 8, 10 ** 13, True)]),     # 16-bit FLOPs
                tm.Profile(100, 10 ** 8, [(10 ** 8, 10 ** 13, False)]),    # fp32 FLOPs
                tm.Profile(800, 3 * 10 ** 10, [(10 ** 8, 10 ** 12, False)])]
    pairs = [(prof, tm.modeled_s(prof, truth)[0]) for prof in profiles]
    params, err = tm.fit(pairs)
    assert params == truth and err < 1e-9
    off = [(prof, tm.modeled_s(prof, truth._replace(bw=tm.GRID['bw'][8]))[0])
           for prof in profiles]
    assert tm.fit(off)[0].bw == tm.GRID['bw'][8]


def write_csv(path, rows, fields=('model', 'size', 'batch', 'mode', 'dtype', 'status',
                                  'median_ms', 'compiled')):
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fields, extrasaction='ignore')
        writer.writeheader()
        writer.writerows(rows)


def test_measured_rows_need_their_batch(tmp_path):
    """Eager CUDA rows with status ok, each case once; a CSV without the batch
    column (older benchmark_backbone.py) is refused by name."""
    row = dict(model='pvt-t', size='64x64', batch=2, mode='fwd', dtype='bf16', status='ok',
               median_ms=4.0, compiled=False, device='cuda')
    write_csv(tmp_path / 'ok.csv', [row, dict(row, dtype='fp32', status='oom'),
                                    dict(row, mode='fwdbwd', compiled=True),
                                    dict(row, batch=1, device='cpu')],
              fields=('model', 'size', 'batch', 'mode', 'dtype', 'status', 'median_ms',
                      'compiled', 'device'))
    assert tm.read_measured([str(tmp_path / 'ok.csv')]) == {
        tm.case_key('pvt-t', 'fwd', 'bf16', 2, '64x64'): 0.004}
    with pytest.raises(ValueError, match='ok.csv measures .*pvt-t.* again'):
        tm.read_measured([str(tmp_path / 'ok.csv')] * 2)
    write_csv(tmp_path / 'old.csv', [row], fields=('model', 'size', 'mode', 'dtype', 'status',
                                                   'median_ms'))
    with pytest.raises(ValueError, match='old.csv has no batch column'):
        tm.read_measured([str(tmp_path / 'old.csv')])


def test_a_case_counts_as_trace_cuda_counts_it():
    """The training step's ops and bytes are ``trace_cuda.py --count-ops``'s;
    the forward (eval, no gradients) has about the training forward's FLOPs."""
    tc = load_tool('trace_cuda')
    row = tc.count_step_ops('flatten-pvt-t', [64, 96], 'bf16', 1)
    step = tm.count_case('flatten-pvt-t', 'fwdbwd', 'bf16', 1, [64, 96])
    assert step.ops == row['forward']['ops'] + row['backward']['ops']
    counted = step.plain_bytes + sum(b for b, _, _ in step.matmuls)
    assert counted == row['forward']['bytes'] + row['backward']['bytes']
    # autocast's matmuls in bf16 (the positional encodings' resize stays fp32: 6% here)
    half = sum(f for _, f, h in step.matmuls if h)
    assert half > 0.9 * sum(f for _, f, _ in step.matmuls)
    fwd = tm.count_case('flatten-pvt-t', 'fwd', 'bf16', 1, [64, 96])
    # the training forward's matmuls, less the positional encodings' column resize
    # (cached in eval; small)
    flops = sum(f for _, f, _ in fwd.matmuls)
    assert 0.97 * row['forward']['flops'] < flops <= row['forward']['flops']
    assert fwd.ops < row['forward']['ops']


STUB = {  # a flatten_mm of another day whose FLattenPVT is mmdet's PVT-T
    '__init__.py': '',
    'analysis.py': 'def saved_tensor_bytes(fn, inputs):\n    raise NotImplementedError\n',
    'models/__init__.py': '',
    'models/attention.py': 'class FocusedLinearAttention:\n    pass\n',
    'models/backbones/__init__.py': (
        'from mmdet.models.backbones import PyramidVisionTransformer\n\n\n'
        'class FLattenPVT(PyramidVisionTransformer):\n'
        '    def __init__(self, arch):\n'
        '        super().__init__(num_layers=[2, 2, 2, 2])\n\n\n'
        'FLattenPVTv2 = FLattenSwin = FLattenCSwin = FLattenPVT\n'),
}


@pytest.mark.heavy(21)
def test_measured_flatten_rows_are_counted_with_their_checkout(tmp_path):
    """``--rev-dir``'s flatten_mm builds the measured flatten models (here one
    whose FLattenPVT is mmdet's PVT-T: counted the same), the softmax ones and
    the predictions come from here; the fit and the rows' ratios follow."""
    for name, text in STUB.items():
        (tmp_path / 'rev' / 'flatten_mm' / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / 'rev' / 'flatten_mm' / name).write_text(text)
    rows = [dict(model=m, size='64x64', batch=1, mode='fwd', dtype='fp32', status='ok',
                 median_ms=ms) for m, ms in (('pvt-t', 10.0), ('flatten-pvt-t', 20.0))]
    write_csv(tmp_path / 'results.csv', rows)
    result = tm.main(['--measured', str(tmp_path / 'results.csv'), '--rev-dir',
                      str(tmp_path / 'rev'), '--models', 'flatten-pvt-t', 'pvt-t',
                      '--batch', '1', '--size', '64x64', '--modes', 'fwd', '--dtypes', 'fp32',
                      '--out', str(tmp_path / 'out.json')])
    measured = {r['model']: r for r in result['measured']}
    assert measured['flatten-pvt-t']['ops'] == measured['pvt-t']['ops']
    assert measured['flatten-pvt-t']['modeled_ratio'] == pytest.approx(1.0)
    assert measured['flatten-pvt-t']['measured_ratio'] == pytest.approx(2.0)
    assert measured['pvt-t']['error'] == pytest.approx(1.0, abs=0.05)  # fitted on it alone
    predicted = {r['model']: r for r in result['predicted']}
    assert predicted['flatten-pvt-t']['ops'] != predicted['pvt-t']['ops']  # this checkout's
    assert predicted['flatten-pvt-t']['modeled_ratio'] == pytest.approx(
        predicted['flatten-pvt-t']['modeled_ms'] / predicted['pvt-t']['modeled_ms'])
    assert json.loads((tmp_path / 'out.json').read_text())['params'] == result['params']
    with pytest.raises(RuntimeError, match='counting flatten-pvt-t failed(.|\n)*has no '
                       'flatten_mm package'):
        tm.count_all([tm.case_key('flatten-pvt-t', 'fwd', 'fp32', 1, '64x64')], str(tmp_path))
