"""tools/analysis_tools: get_flops, benchmark_attention, benchmark_backbone."""
import copy
import csv
import json
import os.path as osp

import pytest
import torch

from analysis_tool import load_tool
from backbone_checks import OpLog

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))


def test_get_flops_of_flatten_pvt_tiny_matches_the_official_count(tmp_path):
    tool = load_tool('get_flops')
    out = tmp_path / 'flops.json'
    result = tool.main(['--timm', 'flatten_pvt_tiny', '--shape', '224', '--out', str(out)])
    # 2.05 G measured with mmengine's counter on the official model
    assert abs(result['flops'] / 1e9 - 2.05) < 0.005
    # the release's 12,150,504 less its final norm (512 + 512), which forward never uses
    assert result['params'] == 12_150_504 - 1024
    assert json.loads(out.read_text())['flops'] == result['flops']


def test_get_flops_of_a_config_and_bad_input(capsys):
    tool = load_tool('get_flops')
    result = tool.main([osp.join(ROOT, 'configs/demo/fpn_flatten-pvt-t_shapes.py'),
                        '--shape', '64', '96'])
    assert result['flops'] > 0 and result['flops_by_operator']['focused_linear_attention'] > 0
    with pytest.raises(SystemExit, match='unknown --backbone'):
        tool.main(['--backbone', 'FLattenViT'])
    with pytest.raises(SystemExit):
        tool.main(['--backbone', 'FLattenPVT', '--timm', 'flatten_pvt_tiny'])


def test_benchmark_attention_reports_ratios(tmp_path):
    tool = load_tool('benchmark_attention')
    rows = tool.main(['--cases', '12x16x32x2', '--repeats', '1', '--variants', 'fast',
                      'autograd', 'fast-conv2d', 'two-ops', 'projections',
                      '--out', str(tmp_path / 'r.json')])
    (row,) = rows
    for name in ('fast', 'autograd', 'fast-conv2d', 'two-ops'):
        assert row[f'{name}_rel_error'] < 1e-5
    module = tool.FocusedLinearAttention(32, 2)  # two ops in a copy sharing the parameters
    two = tool.two_ops_layer(module)
    assert not two.fuse_local_term and module.fuse_local_term and two.scale is module.scale
    # also compiled (the copy made outside the compiled step)
    (row3,) = tool.main(['--cases', '12x16x32x2', '--repeats', '1', '--variants', 'fast',
                         'two-ops', '--compile', 'eager'])
    assert row3['two-ops_rel_error'] < 1e-5
    # the projections alone: timed and their saved bytes counted, no error (another output)
    assert row['projections_ms'] > 0 and 'projections_rel_error' not in row
    assert 0 < row['projections_saved_ratio'] < row['reference_saved_ratio']
    assert row['fast_saved_ratio'] < 0.4 and row['reference_saved_ratio'] == 1
    assert row['fast_ms'] > 0 and row['reference_time_ratio'] == 1
    # with key reduction the projections take k and v from the reduced tokens, as the layer does
    module = tool.FocusedLinearAttention(32, 2, sr_ratio=2)
    seen = []
    # (the reduction's norm: its output tokens are what k and v are projected from)
    module.norm.register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
    out = tool.projections_forward(module, torch.randn(1, 12 * 16, 32), (12, 16))
    assert out.shape == (1, 12 * 16, 32) and seen == [6 * 8]
    # --batch: images per step; what backward keeps grows with them
    (row2,) = tool.main(['--cases', '12x16x32x2', '--repeats', '1', '--batch', '2'])
    assert row2['batch'] == 2 and row2['fast_rel_error'] < 1e-5
    # per image: q, k, v (one product) and proj's input, four (N, C) fp32 maps and a
    # little; once: the stacked q and kv weights (3C x C) the product saves, and small ones
    per_image = (row2['fast_saved_MiB'] - row['fast_saved_MiB']) * 2 ** 20
    once = row['fast_saved_MiB'] * 2 ** 20 - per_image
    assert 4 * 12 * 16 * 32 * 4 <= per_image < 4.2 * 12 * 16 * 32 * 4
    assert 3 * 32 * 32 * 4 <= once < 3 * 32 * 32 * 4 + 16 * 1024
    with pytest.raises(SystemExit):
        tool.main(['--cases', '12x16x30x4'])  # C not divisible by heads


@pytest.mark.heavy(26)
def test_benchmark_backbone_interleaves_writes_and_survives_oom(tmp_path):
    tool = load_tool('benchmark_backbone')
    rows = tool.main(['--models', 'flatten-pvt-t', 'pvt-t', '--sizes', '64', '--modes', 'fwdbwd',
                      '--rounds', '2', '--iters', '1', '--warmup', '0', '--threads', '1',
                      '--out-dir', str(tmp_path)])
    by_model = {r['model']: r for r in rows}
    assert by_model['flatten-pvt-t']['status'] == 'ok'
    assert len(by_model['flatten-pvt-t']['times_ms']) == 2  # one per round
    assert by_model['flatten-pvt-t']['baseline'] == 'pvt-t'
    assert by_model['flatten-pvt-t']['time_ratio'] > 0
    assert len(by_model['flatten-pvt-t']['cpu_ms']) == 2
    assert by_model['flatten-pvt-t']['cpu_ratio'] > 0
    # one step per fresh process (no warm-up): it touches memory for the first
    # time, its output maps at least
    assert len(by_model['pvt-t']['faulted_MiB']) == 2
    assert by_model['pvt-t']['faulted_median_MiB'] > 0
    assert by_model['pvt-t']['saved_MiB'] > 0
    assert (tmp_path / 'results.png').stat().st_size > 0
    with open(tmp_path / 'results.csv') as f:
        assert {r['model'] for r in csv.DictReader(f)} == {'flatten-pvt-t', 'pvt-t'}

    # a case that cannot fit is reported, not fatal: give the subprocess a
    # little more address space than this process uses once it has imported
    # and built what the worker does (run alone, this test imports less)
    tool.build_model('pvt-t')
    with open('/proc/self/status') as f:
        vm = int(f.read().split('VmSize:')[1].split()[0]) * 1024
    spec = dict(model='pvt-t', size=[2048, 2048], mode='fwdbwd', dtype='fp32', device='cpu',
                threads=1, iters=1, warmup=0, mem_limit_gb=vm / 2 ** 30 + 1)
    assert tool.run_case(spec, timeout=300)['status'] == 'out of memory'
    with pytest.raises(SystemExit):
        tool.main(['--models', 'vit-b'])


def test_benchmark_backbone_paired_steps(tmp_path, capsys):
    """--paired: one live worker per model, steps interleaved; the ratios are
    medians of step-by-step ratios, wall time and CPU time, with their ranges."""
    tool = load_tool('benchmark_backbone')
    rows = tool.main(['--models', 'flatten-pvt-t', 'pvt-t', '--sizes', '48', '--modes', 'fwd',
                      '--rounds', '1', '--iters', '3', '--warmup', '0', '--threads', '1',
                      '--paired', '--batch', '2', '--out-dir', str(tmp_path)])
    row = {r['model']: r for r in rows}['flatten-pvt-t']
    assert row['status'] == 'ok' and row['batch'] == 2
    with open(tmp_path / 'results.csv') as f:
        assert {r['batch'] for r in csv.DictReader(f)} == {'2'}
    assert len(row['times_ms']) == len(row['cpu_ms']) == len(row['faulted_MiB']) == 3
    lo, hi = row['ratio_range']
    assert 0 < lo <= row['time_ratio'] <= hi
    lo, hi = row['cpu_ratio_range']
    assert 0 < lo <= row['cpu_ratio'] <= hi
    out = capsys.readouterr().out
    assert 'CPU-time x baseline' in out and 'MiB faulted per step' in out


def test_benchmarks_compile_before_timing():
    """--compile [BACKEND]: the layer's paths and the backbones run compiled
    (compiled at the warm-up steps, which --compile therefore needs), the
    forward (no gradient) with no graph break."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # nothing compiled earlier in the process is reused
    counters.clear()
    attention = load_tool('benchmark_attention')
    (row,) = attention.main(['--cases', '12x16x32x2', '--repeats', '1', '--mode', 'fwd',
                             '--compile', 'aot_eager'])
    assert row['compiled'] == 'aot_eager' and row['fast_rel_error'] < 1e-5
    backbone = load_tool('benchmark_backbone')
    torch._dynamo.reset()
    case = backbone.Case(dict(model='flatten-pvt-t', size=[32, 32], mode='fwd', dtype='fp32',
                              device='cpu', compile='aot_eager'))
    assert isinstance(case.model, torch._dynamo.eval_frame.OptimizedModule)
    assert case.step().wall_s > 0
    assert not counters['graph_break'], dict(counters['graph_break'])
    for tool in (attention, backbone):
        with pytest.raises(SystemExit):
            tool.main(['--compile', '--warmup', '0'])


def test_get_flops_of_flatten_cswin_tiny_and_its_softmax_form():
    """FLatten-CSwin-T at 224: the release's parameter count; FLOPs 4.34 G
    (the paper gives 4.3 G), a little below CSWin's stripes in every stage."""
    tool = load_tool('get_flops')
    flatten = tool.main(['--timm', 'flatten_cswin_tiny', '--shape', '224'])
    assert flatten['params'] == 21_201_768
    assert abs(flatten['flops'] / 1e9 - 4.34) < 0.01
    assert flatten['flops_by_operator']['focused_linear_attention'] > 0
    softmax = tool.main(['--backbone', 'FLattenCSwin', '--attn-type', 'SSSS', '--shape', '224'])
    assert 'focused_linear_attention' not in softmax['flops_by_operator']
    assert softmax['flops_by_operator']['softmax_attention'] > 0
    assert flatten['flops'] < softmax['flops']
    with pytest.raises(SystemExit, match='attn_type must be a string of 4 letters'):
        tool.main(['--backbone', 'FLattenCSwin', '--attn-type', 'LLS'])


def test_benchmark_backbone_knows_cswin_and_its_baseline():
    tool = load_tool('benchmark_backbone')
    assert {'flatten-cswin-t', 'cswin-t'} <= set(tool.model_names())
    assert tool.baseline_of('flatten-cswin-t') == 'cswin-t'
    flatten, softmax = tool.build_model('flatten-cswin-t'), tool.build_model('cswin-t')
    assert (flatten.attn_type, softmax.attn_type) == ('LLSS', 'SSSS')
    assert type(flatten) is type(softmax) and flatten.arch == softmax.arch == 'tiny'


def test_benchmark_backbone_identity_variant_skips_the_core_only(monkeypatch):
    """NAME@identity (the bound a faster core cannot beat) runs every layer but
    the attention core: no backend is called; on the CPU's 'torch' backend the
    output is a copy of the query."""
    from flatten_mm.models.ops import dispatch
    tool = load_tool('benchmark_backbone')
    assert tool.baseline_of('flatten-pvt-t@identity') == 'pvt-t'
    torch.manual_seed(0)
    full = tool.build_model('flatten-pvt-t')
    torch.manual_seed(0)
    bound = tool.build_model('flatten-pvt-t@identity')
    layer = next(m for m in bound.modules() if hasattr(m, 'project_qkv'))
    q = torch.randn(1, 5, layer.embed_dims)
    out = layer.attend(q, q[:, :2], q[:, :2], None)  # a new tensor, as a core writes
    assert torch.equal(out, q) and out.data_ptr() != q.data_ptr()
    image = torch.randn(1, 3, 64, 96)
    expected = full(image)
    calls = []
    monkeypatch.setattr(dispatch, 'backend_of', lambda *a: calls.append(a))
    outs = bound(image)
    assert not calls
    assert [o.shape for o in outs] == [o.shape for o in expected]
    assert not torch.allclose(outs[0], expected[0], atol=1e-3)
    with pytest.raises(ValueError, match='NAME@identity'):
        tool.check_model_name('swin-t@identity')


def test_benchmark_backbone_identity_variant_on_the_fused_conv_is_one_op():
    """Where the fused conv op takes the local term (forced 'triton' here, under
    the interpreter), the free core hands it q itself: the layer makes that one
    op, reading q and V, as a fused layer with a free core would, and equals
    the same bound on the 'torch' backend (a copy of q, the conv added in place)."""
    from flatten_mm.models import FocusedLinearAttention
    from flatten_mm.models.ops import triton_backend, use_backend
    if not triton_backend.AVAILABLE:
        pytest.skip('triton does not import')
    tool = load_tool('benchmark_backbone')
    torch.manual_seed(0)
    layer = tool.with_attention_variant(FocusedLinearAttention(16, 2, lepe=True), 'identity')
    x = torch.randn(2, 5 * 7, 16)
    q = torch.randn(1, 5, 16)
    results = {}
    for backend in ('torch', 'triton'):
        with use_backend(backend):
            assert (layer.attend(q, q, q, None) is q) == (backend == 'triton')
            xb = x.clone().requires_grad_()
            with OpLog() as log:
                out = layer(xb, (5, 7))
                out.square().sum().backward()
        results[backend] = out, xb.grad, [name for name in log.names
                                          if name.startswith('triton') or name == 'clone']
    # on the fused op the layer's one op each way, no copy of q (the 'torch' step's
    # conv adds into a copy of q; its other copies are its conv's own)
    assert results['triton'][2] == ['triton_local_conv_add', 'triton_local_conv_add_backward']
    assert set(results['torch'][2]) == {'clone'}
    torch.testing.assert_close(results['triton'][0], results['torch'][0])
    torch.testing.assert_close(results['triton'][1], results['torch'][1])
    # no local term: nothing writes into q on any backend
    bare = tool.with_attention_variant(FocusedLinearAttention(16, 2, kernel_size=0), 'identity')
    assert bare.attend(q, q, q, None) is q


def test_benchmark_backbone_torch_variant_runs_the_torch_backend(monkeypatch):
    """NAME@torch: every attention op of the model runs on the 'torch' backend
    even where the override says 'triton' (which CPU tensors cannot run without
    the interpreter), with the same output as the model on 'torch'; the
    override is back afterwards. flatten-X is compared with it when both are
    timed."""
    from flatten_mm.models.ops import dispatch
    tool = load_tool('benchmark_backbone')
    torch.manual_seed(0)
    plain = tool.build_model('flatten-pvt-t')
    torch.manual_seed(0)
    on_torch = tool.build_model('flatten-pvt-t@torch')
    image = torch.randn(1, 3, 64, 96)
    with dispatch.use_backend('torch'):
        expected = plain(image)
    chosen = []
    choose = dispatch.choose
    monkeypatch.setattr(dispatch, 'choose', lambda op, *args: chosen.append(
        (op, choose(op, *args))) or chosen[-1][1])
    with dispatch.use_backend('triton'):
        outs = on_torch(image)
        assert dispatch.get_backend() == 'triton'
    assert sorted(set(chosen)) == [('attention', 'torch'), ('attention_local', 'torch'),
                                   ('conv_add', 'torch')]
    # each of PVT-T's 8 layers (no key reduction in FLatten-PVT) takes its two ops
    # through the one call, whose 'torch' form is chosen first
    assert [op for op, _ in chosen] == ['attention_local', 'attention', 'conv_add'] * 8
    for out, ref in zip(outs, expected):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    spec = dict(size=[64, 96], mode='fwdbwd', dtype='bf16', device='cuda', status='ok')
    rows = tool.summarise([dict(spec, model=m, times_ms=[t]) for m, t in
                           (('flatten-pvt-t', 50.), ('flatten-pvt-t@torch', 80.), ('pvt-t', 100.))])
    baselines = {r['model']: (r['baseline'], r.get('time_ratio')) for r in rows}
    assert baselines['flatten-pvt-t'] == ('flatten-pvt-t@torch', 0.625)
    assert baselines['flatten-pvt-t@torch'] == ('pvt-t', 0.8)
    with pytest.raises(ValueError, match='NAME@torch'):
        tool.check_model_name('pvt-t@torch')
    copied = copy.deepcopy(on_torch)  # its layers run themselves, not the original's
    layer = next(m for m in copied.modules() if hasattr(m, 'project_qkv'))
    assert layer.forward.__self__ is layer
    # NAME@reference: the same formula by the reference code, also bound per layer
    torch.manual_seed(0)
    reference = tool.build_model('flatten-pvt-t@reference')
    layer = next(m for m in copy.deepcopy(reference).modules() if hasattr(m, 'project_qkv'))
    assert layer.forward.__self__ is layer
    with torch.no_grad():  # eval: no stochastic depth
        for out, ref in zip(reference.eval()(image), plain.eval()(image)):
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_benchmark_stages_times_each_swin_stage():
    tool = load_tool('benchmark_stages')
    # the grids of an 800x1333 image: 4x4 patches (1333 padded to 1336), then odd sides padded
    assert tool.stage_grids((800, 1333), 4) == [(200, 334), (100, 167), (50, 84), (25, 42)]
    rows = tool.main(['--size', '64x96', '--rounds', '1', '--threads', '1', '--mode', 'fwd'])
    assert [r['grid'] for r in rows] == [(16, 24), (8, 12), (4, 6), (2, 3)]
    assert all(r['ratio'] > 0 and min(r['ms']) > 0 for r in rows)
    # the attention halves alone, in training: both models' halves run and keep the shape
    rows = tool.main(['--size', '64x96', '--rounds', '1', '--threads', '1', '--part', 'attention'])
    assert len(rows) == 4 and all(min(r['ms']) > 0 for r in rows)
    flatten, swin = (tool.build_model(n) for n in ('flatten-swin-t', 'swin-t'))
    for name, model in (('flatten-swin-t', flatten), ('swin-t', swin)):
        block = tool.stage_blocks(name, model)[0][0]
        x = torch.randn(1, 16 * 24, 96)
        block.eval()
        with torch.no_grad():  # the block is its attention half h, then h + mlp(norm2(h))
            h = tool.attention_half(block, x, (16, 24))
            rest = (h + block.mlp(block.norm2(h)) if name == 'flatten-swin-t'
                    else block.ffn(block.norm2(h), identity=h))
            torch.testing.assert_close(block(x, (16, 24)), rest)
        assert not torch.equal(h, x)
    with pytest.raises(SystemExit):
        tool.main(['--models', 'flatten-pvt-t', 'pvt-t'])


def test_get_flops_compares_flatten_deit_with_deit(capsys):
    """FLatten-DeiT-T next to DeiT-T (--compare-softmax): the softmax form has
    DeiT-T's parameters (5.72 M, as timm's deit_tiny_patch16_224) and 1.26 G
    FLOPs (the paper gives 5.7 M / 1.3 G); the focused form costs less."""
    tool = load_tool('get_flops')
    result = tool.main(['--timm', 'flatten_deit_tiny', '--compare-softmax'])
    softmax = result['softmax']
    assert softmax['attn_type'] == 'S' * 12 and softmax['params'] == 5_717_416
    assert abs(softmax['flops'] / 1e9 - 1.258) < 0.005
    assert result['params'] == 5_717_416 + 12 * (64 * 26 + 192 + 196 * 192)
    assert result['flops'] < softmax['flops']
    assert 'softmax' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main(['configs/flatten_deit/upernet_flatten-deit-s_mln_8xb2-160k_ade20k-512x512.py',
                   '--compare-softmax'])


def test_profile_backbone_sums_op_times_into_families(tmp_path):
    tool = load_tool('profile_backbone')
    out = tmp_path / 'prof.json'
    families = tool.main(['--models', 'flatten-pvtv2-b0', '--size', '64x96', '--mode', 'fwdbwd',
                          '--threads', '1', '--out', str(out)])
    fam = families['flatten-pvtv2-b0']
    assert fam['matmul'] > 0 and fam['conv'] > 0 and fam['norm'] > 0
    result = json.loads(out.read_text())['results'][0]
    assert result['device'] == 'cpu' and result['dtype'] == 'fp32' and result['batch'] == 1
    assert sum(fam.values()) == pytest.approx(sum(result['ops'].values()))
    # ops one step dispatches: kernels only (no views, no prim::device), backward included
    calls = result['op_calls']
    assert calls['aten::addmm'] > 0 and calls['aten::mm'] > 0 and calls['aten::convolution'] > 0
    assert not {'aten::view', 'aten::t', 'aten::expand'} & set(calls)
    assert not any(op.startswith('prim::') for op in calls)
    assert set(result['op_bytes']) == set(calls) and result['flops'] > 0


def test_tally_ops_counts_the_bytes_each_op_reads_and_writes_and_its_flops():
    tool = load_tool('profile_backbone')
    x, w, b, y = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16), torch.randn(4, 8)
    tally = tool.tally_ops(lambda: torch.nn.functional.linear(x, w, b))
    assert tally.calls == {'aten::addmm': 1}  # the transpose of w makes no kernel
    # reads b (16), x (32), w's transpose (128), writes (4, 16): fp32 bytes
    assert tally.bytes == {'aten::addmm': 4 * (16 + 32 + 128 + 64)}
    assert tally.flops == {'aten::addmm': 2 * 4 * 8 * 16}
    tally = tool.tally_ops(lambda: (y.add_(x), x.relu()))
    # y read and written, x read; relu reads x, writes a fresh tensor; no FLOPs formula
    assert tally.bytes == {'aten::add_': 4 * 32 * 3, 'aten::relu': 4 * 32 * 2}
    assert tally.flops == {}
    # an op counted by what a function of its arguments runs instead (a custom
    # op's host code): the launches it returns and its ATen ops, where a
    # .contiguous() or .to() that returns its input makes no kernel
    # (an out= op returns its output argument, written: counted)
    z = torch.empty(4, 8)
    inside = {'aten::relu': lambda t: (t.contiguous(), t.to(t.dtype), t.mul(2),
                                       torch.mul(t, 2, out=z), [('k', 5)])[-1]}
    tally = tool.tally_ops(lambda: (y.add_(x), x.relu()), inside)
    assert tally.calls == {'aten::add_': 1, 'aten::mul': 2, 'k': 1}
    # (the out= one: t read, z as argument and as output, as an in-place op's)
    assert tally.bytes == {'aten::add_': 4 * 32 * 3, 'aten::mul': 4 * 32 * 2 + 4 * 32 * 3, 'k': 5}
    # a depth-wise conv's gradients (input and weight) cost twice its forward
    # (torch's own backward formula ignores groups: 32x that here)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1, groups=64)
    out = conv(torch.randn(2, 64, 8, 8, requires_grad=True))
    tally = tool.tally_ops(lambda: out.sum().backward())
    assert tally.flops['aten::convolution_backward'] == 2 * (2 * 2 * 64 * 8 * 8 * 9)


def test_profile_backbone_takes_gpu_time_of_ops_and_the_core_op():
    """On CUDA each op's time is the GPU time of the kernels it launched; the
    attention core's Triton op counts as attention (a stand-in profile)."""
    from types import SimpleNamespace
    tool = load_tool('profile_backbone')
    events = [SimpleNamespace(key='aten::mm', self_cpu_time_total=50.0,
                              self_device_time_total=2000.0),
              SimpleNamespace(key='flatten_mm::triton_focused_attention', self_cpu_time_total=30.0,
                              self_device_time_total=1000.0),
              SimpleNamespace(key='aten::view', self_cpu_time_total=5.0,
                              self_device_time_total=0.0),
              SimpleNamespace(key='cudaLaunchKernel', self_cpu_time_total=80.0,
                              self_device_time_total=0.0)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert tool.leaf_self_times(prof, 'cuda') == {'aten::mm': 2.0,
                                                  'flatten_mm::triton_focused_attention': 1.0}
    assert tool.leaf_self_times(prof, 'cpu') == {
        'aten::mm': 0.05, 'flatten_mm::triton_focused_attention': 0.03, 'aten::view': 0.005}
    assert tool.family_of('flatten_mm::triton_focused_attention_backward') == 'attention'
    assert tool.family_of('flatten_mm::triton_local_conv_add_backward') == 'conv'
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # named, before any subprocess starts
            tool.main(['--device', 'cuda', '--models', 'flatten-swin-t'])


def test_benchmark_backbone_times_timm_classifiers_against_timm_softmax(tmp_path, capsys):
    """timm:NAME: the whole classifier; ours against timm's softmax model, with
    the throughput (batch over the median step)."""
    tool = load_tool('benchmark_backbone')
    assert tool.baseline_of('timm:flatten_swin_tiny') == 'timm:swin_tiny_patch4_window7_224'
    assert tool.baseline_of('timm:flatten_pvt_v2_b1') == 'timm:pvt_v2_b1'
    assert tool.baseline_of('timm:flatten_pvt_tiny') is None  # PVT v1 is not in timm
    rows = tool.main(['--models', 'timm:flatten_deit_tiny', 'timm:deit_tiny_patch16_224',
                      '--sizes', '224', '--modes', 'fwdbwd', '--rounds', '1', '--iters', '2',
                      '--warmup', '0', '--threads', '1', '--paired', '--batch', '2',
                      '--out-dir', str(tmp_path)])
    row = {r['model']: r for r in rows}['timm:flatten_deit_tiny']
    assert row['status'] == 'ok' and row['baseline'] == 'timm:deit_tiny_patch16_224'
    assert row['images_per_s'] == pytest.approx(2e3 / row['median_ms'])
    assert row['time_ratio'] > 0
    assert 'images/s' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tool.main(['--models', 'timm:no_such_model'])


RELEASE_STAND_IN = """
import json
import os

import torch


def flatten_pvt_tiny(**kwargs):
    with open(os.environ['RELEASE_ARGS'], 'w') as f:
        json.dump(kwargs, f)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 4, 4), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 1000))
"""


def test_benchmark_backbone_times_the_authors_release(tmp_path, monkeypatch):
    """release:NAME: the authors' classifier from a checkout of their repository (a
    stand-in with its layout here, whose builder records its arguments), built with
    the arguments of their cfgs and compared with ours (their time over ours)."""
    tool = load_tool('benchmark_backbone')
    models = tmp_path / 'release' / 'models'
    models.mkdir(parents=True)
    (models / '__init__.py').write_text('')
    (models / 'flatten_pvt.py').write_text(RELEASE_STAND_IN)
    monkeypatch.setenv('RELEASE_ARGS', str(tmp_path / 'args.json'))
    rows = tool.main(['--models', 'release:flatten_pvt_tiny', 'timm:flatten_pvt_tiny',
                      '--release-dir', str(tmp_path / 'release'), '--sizes', '64',
                      '--modes', 'fwd', '--rounds', '1', '--iters', '1', '--threads', '1',
                      '--out-dir', str(tmp_path / 'out')])
    row = {r['model']: r for r in rows}['release:flatten_pvt_tiny']
    assert row['status'] == 'ok' and row['baseline'] == 'timm:flatten_pvt_tiny'
    assert row['time_ratio'] > 0
    # the release's cfgs/flatten_pvt_t.yaml: linear attention in every stage, unreduced keys
    assert json.loads((tmp_path / 'args.json').read_text()) == dict(
        focusing_factor=3, kernel_size=5, drop_path_rate=0.1, attn_type='LLLL',
        la_sr_ratios='1111')
    for argv in (['--models', 'release:flatten_pvt_tiny'],  # no checkout given
                 ['--models', 'release:flatten_swin_tiny', '--release-dir',
                  str(tmp_path / 'release')],  # the checkout lacks models/flatten_swin.py
                 ['--models', 'release:flatten_deit_tiny']):  # not released
        with pytest.raises(SystemExit):
            tool.main(argv)


@pytest.mark.heavy(31)
def test_check_compile_counts_graphs_and_compares_with_eager(tmp_path):
    """Two sizes, then the first again: two graphs, no break, and the compiled
    outputs and gradients equal eager's (aot_eager: dynamo's tracing and AOT
    autograd without Inductor's C++ build)."""
    tool = load_tool('check_compile')
    out = tmp_path / 'compile.json'
    (row,) = tool.main(['--models', 'flatten-pvtv2-b0', '--sizes', '64x96', '72x80',
                        '--backend', 'aot_eager', '--iters', '1', '--out', str(out)])
    assert row['graphs'] == 2 and row['graph_breaks'] == 0 and row['ok']
    assert row['output_error'] < 1e-5 and row['grad_error'] < 1e-5
    assert len(row['first_steps_s']) == 3 and row['compiled_step_s'] > 0
    assert json.loads(out.read_text())[0]['graphs'] == 2
    with pytest.raises(SystemExit):
        tool.main(['--models', 'flatten-vit-b'])


def test_check_compile_judges_half_precision_against_fp32():
    """fp32: compiled within --tol of eager. bf16/fp16, where two roundings of
    one step differ by the precision's own error (3.7e-2 in the gradients of
    eager PVTv2-B1 against fp32): compiled as close to an fp32 step as eager
    is, within --tol-factor."""
    tool = load_tool('check_compile')
    args = tool.parse_args(['--models', 'flatten-pvt-t'])
    assert tool.within_tolerance(dict(output_error=2e-5, grad_error=8e-5), args)
    assert not tool.within_tolerance(dict(output_error=2e-5, grad_error=2e-4), args)
    half = dict(output_error=6e-3, grad_error=3.3e-2, eager_error_fp32=3.7e-2)
    assert tool.within_tolerance(dict(half, compiled_error_fp32=4.1e-2), args)
    assert not tool.within_tolerance(dict(half, compiled_error_fp32=0.3), args)
    assert not tool.within_tolerance(
        dict(half, compiled_error_fp32=4.1e-2),
        tool.parse_args(['--models', 'flatten-pvt-t', '--tol-factor', '1.0']))
