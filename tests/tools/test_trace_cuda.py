"""tools/analysis_tools/trace_cuda.py: every family traced for CUDA without a GPU
(fake CUDA tensors), in one graph with the Triton ops the GPU path takes, in the
dtype asked for.

Without this, the CUDA path's graph breaks show only on a GPU: the CPU path
never reaches the Triton backend's choice (the fp32 TF32 read that broke every
fp32 CUDA layer's graph passed every CPU test)."""
import sys

import pytest

from flatten_mm.models.ops import available_backends

from analysis_tool import load_tool

pytestmark = pytest.mark.skipif('triton' not in available_backends(), reason='needs triton')


# linear-attention blocks of each tiny model: the attention op and the fused out +
# DWC(V) op each, or both as one op (none of these layers has a key mask or
# reduced keys: all take the one op)
BLOCKS = {'flatten-swin-t': (0, 0, 4), 'flatten-pvt-t': (0, 0, 8),
          'flatten-pvtv2-b1': (0, 0, 8), 'flatten-cswin-t': (0, 0, 6),
          'timm:flatten_deit_tiny': (0, 0, 12)}


@pytest.mark.heavy(28)
def test_every_family_traces_for_cuda_in_one_graph(tmp_path):
    tool = load_tool('trace_cuda')
    rows = tool.main(['--models', *BLOCKS, '--size', '64x96', '--dtypes', 'fp32',
                      '--batch', '1', '--out', str(tmp_path / 'rows.json')])
    rows += tool.main(['--models', 'flatten-swin-t', '--size', '64x96', '--dtypes', 'bf16',
                       '--batch', '1'])
    for row in rows:
        attention, conv, fused = BLOCKS[row['model']]
        assert row['status'] == 'ok', row
        assert row['ops'].get('flatten_mm.triton_focused_attention', 0) == attention, row
        assert row['ops'].get('flatten_mm.triton_local_conv_add', 0) == conv, row
        assert row['ops'].get('flatten_mm.triton_attention_local', 0) == fused, row
        # bf16 autocast really casts in the trace (without a GPU it turns itself off)
        assert row['attention_dtypes'] == [f'torch.{ {"fp32": "float32", "bf16": "bfloat16"}[row["dtype"]]}'], row
    assert (tmp_path / 'rows.json').exists()


def test_a_break_fails_the_run(monkeypatch):
    """A graph break is reported with its cause, and the exit status is 1."""
    import torch

    from flatten_mm.models.ops import dispatch
    tool = load_tool('trace_cuda')
    # the setting read as before the fix: dynamo cannot trace the C getter
    monkeypatch.setattr(dispatch, '_cuda_matmul_is_ieee',
                        lambda: torch.backends.cuda.matmul.fp32_precision == 'ieee')
    row = tool.trace('flatten-pvt-t', [32, 32], 'fp32', 1)
    assert row['status'] == 'failed' and 'fp32_precision' in row['error'], row
    with pytest.raises(SystemExit) as exc:
        tool.main(['--models', 'flatten-pvt-t', '--size', '32', '--dtypes', 'fp32',
                   '--batch', '1'])
    assert exc.value.code == 1


@pytest.mark.heavy(21)
def test_compiled_on_the_cuda_path_one_graph_per_size(monkeypatch):
    """Compiled at two sizes and back at the first: two graphs. Nothing on the CUDA
    path is guarded on but the sizes (the conv's first-use check once imported
    its kernels inside the trace, and the guard on that recompiled every graph).
    The kernels' lazy state as in a fresh process, whatever ran before."""
    from flatten_mm.models.ops import triton_backend, triton_conv
    monkeypatch.setattr(triton_backend, '_KERNELS', {})
    monkeypatch.setattr(triton_conv, '_KERNELS', {})
    tool = load_tool('trace_cuda')
    for name in ('flatten-pvt-t', 'flatten-swin-t'):
        row = tool.count_graphs(name, [[64, 96], [64, 80]], 'fp32', 1)
        assert row['status'] == 'ok' and row['graphs'] == 2, row


@pytest.mark.heavy(23)
def test_a_training_step_on_the_cuda_path_makes_nothing_of_the_size_again():
    """At mmdet's detection size and batch: the second training forward serves
    the resize weights of every positional encoding and the windows' masks from
    the cache: no arange, comparison or where (a dozen tiny kernels a layer,
    made every step before). The Triton ops count as the kernels they launch
    (``launch_count.py``). Swin and PVT dispatch fewer ops (kernel launches,
    where steps are short) than their softmax forms; FLatten-CSwin-T's six
    linear blocks about twelve more each than the stripes they replace (four
    kernels and the partial states' sums where a stripe has one fused kernel,
    terms made from parameters each training step). The backward makes no
    zero-filled gradients for the attention op's states (they were four a
    layer). Where steps are long,
    bytes read and written bound the GPU's time: every family's training step
    reads and writes fewer than its softmax form's (measured 0.356×, 0.378×,
    0.679×, 0.994×, bounds about 4% above, none for CSwin; the core on PyTorch
    ops, in fp32 as before its Triton path, would exceed them all), and keeps
    fewer bytes for the backward (CSwin 0.95×: its SSSS form keeps the whole
    q, k, v projection, of which its horizontal stripes are views). CSWin's
    stripes take q, k and v as views, so their backward writes one gradient,
    no zero-filled selects (before the views the two steps moved 33.7 and
    36.6 GB). Fake tensors cost the same at any size."""
    tool = load_tool('trace_cuda')
    pairs = [('flatten-pvt-t', 'pvt-t'), ('flatten-pvtv2-b1', 'pvtv2-b1'),
             ('flatten-swin-t', 'swin-t'), ('flatten-cswin-t', 'cswin-t')]
    rows = tool.main(['--models', *[m for pair in pairs for m in pair], '--size', '800x1333',
                      '--dtypes', 'bf16', '--batch', '2', '--count-ops'])
    steps = {row['model']: row for row in rows}
    ops = {model: row['forward'] for model, row in steps.items()}
    pvt = ops['flatten-pvt-t']['op_calls']  # the Triton ops by their kernels' launches
    assert pvt['triton::kv_state'] == pvt['triton::output'] == pvt['triton::conv_add'] == 8
    assert 'aten::view' not in pvt and not any(op.startswith('prim::') for op in pvt)
    backward = steps['flatten-pvt-t']['backward']['op_calls']
    assert backward['triton::key_grad'] == backward['triton::conv_weight_grad'] == 8
    assert not any(op.startswith('flatten_mm::triton') for op in {**pvt, **backward})
    assert 'aten::zeros' not in backward
    # the kernels take the raw scale: no op makes 1 / softplus(scale) or its gradient
    assert not {'aten::softplus', 'aten::reciprocal'} & set(pvt), pvt
    assert not {'aten::softplus_backward', 'aten::neg'} & set(backward), backward
    for ours, theirs in pairs:
        calls = ops[ours]['op_calls']
        assert not {'aten::arange', 'aten::eq', 'aten::where', 'aten::lt'} & set(calls), ours
        if ours != 'flatten-cswin-t':
            assert ops[ours]['ops'] < ops[theirs]['ops'], (ours, ops[ours]['ops'],
                                                           ops[theirs]['ops'])
    assert ops['flatten-cswin-t']['ops'] <= ops['cswin-t']['ops'] + 6 * 12
    # softmax stages as the GPU runs them: one fused kernel, no score written
    swin = ops['flatten-swin-t']['op_calls']
    assert swin['aten::_scaled_dot_product_efficient_attention'] == 8, swin
    assert not {'aten::_softmax', 'aten::_safe_softmax'} & set(swin)

    def step_bytes(model):
        return steps[model]['forward']['bytes'] + steps[model]['backward']['bytes']
    ratios = {ours: step_bytes(ours) / step_bytes(theirs) for ours, theirs in pairs}
    bounds = {'flatten-pvt-t': 0.37, 'flatten-pvtv2-b1': 0.395, 'flatten-swin-t': 0.71,
              'flatten-cswin-t': 1.0}
    assert all(ratios[m] < bound for m, bound in bounds.items()), ratios
    for model, bound in (('flatten-cswin-t', 32.6e9), ('cswin-t', 32.8e9)):  # 32.1, 32.3
        assert step_bytes(model) < bound, (model, step_bytes(model))
        assert 'aten::select_backward' not in steps[model]['backward']['op_calls'], model
    assert ops['flatten-swin-t']['bytes'] == sum(ops['flatten-swin-t']['op_bytes'].values())
    # the activations kept for backward (measured 0.36x, 0.42x, 0.86x, 0.95x)
    saved = {ours: steps[ours]['saved_bytes'] / steps[theirs]['saved_bytes']
             for ours, theirs in pairs}
    bounds = {'flatten-pvt-t': 0.37, 'flatten-pvtv2-b1': 0.43, 'flatten-swin-t': 0.88,
              'flatten-cswin-t': 0.97}
    assert all(saved[m] < bound for m, bound in bounds.items()), saved


def test_run_backward_gives_the_engines_gradients():
    """The counts' backward (autograd's nodes called from Python) gives the
    gradients autograd's engine gives: a backbone with custom autograd
    functions (the CPU path's core and DWC), broadcasts, in-place updates of
    views, padded windows and inputs used several times."""
    import torch
    tool = load_tool('trace_cuda')
    torch.manual_seed(0)
    model = tool.build_model('flatten-swin-t')
    model.train()
    loss = tool.training_loss(model(torch.randn(1, 3, 61, 83)))
    params = list(model.parameters())
    want = torch.autograd.grad(loss, params, retain_graph=True)
    tool.run_backward(loss)
    for p, g in zip(params, want):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-9)


RELEASE_STAND_IN = """
import timm.models
import torch


@timm.models.register_model  # as the authors' code: over flatten_mm's registration
def flatten_pvt_tiny(**kwargs):
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 4, 4), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 10))
"""


def test_counts_the_authors_release_after_ours(tmp_path, monkeypatch):
    """``release:NAME`` from a checkout of the authors' repository (a stand-in
    with its layout). Importing it registers its names with timm over ours, so
    its models are counted last, whatever the order asked: ``timm:NAME`` is
    still flatten_mm's (its attention ops on the CUDA path)."""
    import timm
    tool = load_tool('trace_cuda')
    models = tmp_path / 'release' / 'models'
    models.mkdir(parents=True)
    (models / '__init__.py').write_text('')
    (models / 'flatten_pvt.py').write_text(RELEASE_STAND_IN)
    import flatten_mm  # noqa: F401  (registers ours)
    entry = timm.models.model_entrypoint('flatten_pvt_tiny')
    monkeypatch.setattr(sys, 'path', sys.path[:])  # the tool puts the checkout first
    try:
        rows = tool.main(['--models', 'release:flatten_pvt_tiny', 'timm:flatten_pvt_tiny',
                          '--size', '64', '--dtypes', 'bf16', '--batch', '1', '--count-ops',
                          '--release-dir', str(tmp_path / 'release')])
    finally:  # the stand-in out of timm's registry and of the imported modules
        timm.models.register_model(entry)
        for name in [m for m in sys.modules if m == 'models' or m.startswith('models.')]:
            del sys.modules[name]
    assert [row['model'] for row in rows] == ['timm:flatten_pvt_tiny', 'release:flatten_pvt_tiny']
    assert rows[0]['forward']['op_calls']['triton::output'] == 8  # our attention's kernels
    assert not any('triton' in op for op in rows[1]['forward']['op_calls'])
    assert rows[1]['backward']['op_calls']['aten::convolution_backward'] == 1


def test_compiled_step_counts_inductors_kernels_for_a_gpu():
    """``--count-ops --compiled``: Inductor lowers a training step on fake CUDA
    tensors to the kernels an sm_90 GPU would run, without one. Its count is
    exact where it can be checked by hand (an elementwise chain and its mean:
    forward, one kernel reading x and w and writing the loss; backward, one
    kernel reading x again, w and the loss's gradient and writing w's), and the
    FLatten layer's Triton ops stay one op each way (to Inductor: extern
    kernels; the row counts what they launch)."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flatten_mm import FocusedLinearAttention
    tool = load_tool('trace_cuda')

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return (torch.relu(x * self.w + 1) * 3,)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Conv2d(3, 32, 4, 4)
            self.attn = FocusedLinearAttention(32, 2, pos_grid=4)

        def forward(self, x):
            x = self.embed(x)
            return (self.attn(x.flatten(2).transpose(1, 2), x.shape[2:]),)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    shape = (2, 3, 16, 24)
    chain = tool.Autocast(tool.to_fake_cuda(Chain(), fake_mode), torch.float32)
    forward, backward = tool.compile_step(chain, fake_mode, shape)
    numel = 2 * 3 * 16 * 24
    assert forward['bytes'] == numel * 4 + 4 * 2, forward  # x and w read, the loss written
    assert backward['bytes'] == numel * 4 + 4 * 3, backward
    assert len(forward['kernels']) == len(backward['kernels']) == 1
    layer = tool.Autocast(tool.to_fake_cuda(Layer(), fake_mode), torch.bfloat16)
    forward, backward = tool.compile_step(layer, fake_mode, shape)
    labels = [label for label, _ in forward['kernels']]
    # the attention and its DWC term as one op (no key mask, reduction or prefix)
    assert labels.count('torch.ops.flatten_mm.triton_attention_local.default') == 1, labels
    assert [label for label, _ in backward['kernels']].count(
        'torch.ops.flatten_mm.triton_attention_local_backward.default') == 1
    assert forward['bytes'] == sum(size for _, size in forward['kernels'])
    # the row counts each Triton op by its kernels' launches instead
    launched, ops = tool.graph_launches(forward['module'])
    assert ops == 1
    assert {op: n for op, n in launched.calls.items() if op.startswith('triton::')} == {
        'triton::inverse_scale': 1, 'triton::row_stats': 2, 'triton::kv_state': 1,
        'triton::state_sum': 1, 'triton::output': 1, 'triton::conv_add': 1}
    launched, ops = tool.graph_launches(backward['module'])
    assert ops == 1 and launched.calls['triton::key_grad'] == 1
    assert launched.calls['triton::conv_weight_grad'] == 1


def test_compiled_depthwise_conv_backward_copies_no_map():
    """PVTv2's MLP (fc1, 3x3 depth-wise conv, GELU, fc2) compiled for an sm_90
    GPU, bf16: the conv is one op each way, and its backward makes no copy of
    the hidden map. With the plain conv, Inductor (torch 2.14) copied the map
    and its gradient into the stride order of the (C, 1, 3, 3) weight's
    gradient and the gradient back: the backward then moved 9.1 GB at the
    stage-1 shape below (8 images of 200 x 334 tokens), now 6.9 GB."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flatten_mm.models.layers import Mlp
    tool = load_tool('trace_cuda')

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Mlp(64, 512, with_dwconv=True)

        def forward(self, x):
            return (x + self.mlp(x, (200, 334)),)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    block = tool.Autocast(tool.to_fake_cuda(Block(), fake_mode), torch.bfloat16)
    forward, backward = tool.compile_step(block, fake_mode, (8, 200 * 334, 64))
    labels = [label for label, _ in forward['kernels'] + backward['kernels']]
    assert labels.count('torch.ops.flatten_mm.depthwise_conv.default') == 1, labels
    assert labels.count('torch.ops.flatten_mm.depthwise_conv_backward.default') == 1, labels
    assert not any('aten.convolution' in label for label in labels), labels
    hidden = 8 * 200 * 334 * 512 * 2  # bytes of the bf16 hidden map
    # 12.6 passes over the map (16.6 with the copies): the products of fc1 and
    # fc2 (4), GELU recomputed and its gradient (5), the conv's backward (3),
    # the bias's sum (1), less what is smaller than the map
    assert backward['bytes'] < 13 * hidden, backward['bytes'] / hidden


def test_attention_layer_keeps_a_quarter_of_the_references_bytes():
    """``--core-cases``: one layer at the stage-1 and stage-2 shapes of
    800x1333, batch 16, bf16 (the issue's core target: at most 0.25x of the
    reference's bytes kept for backward; measured 0.241x and 0.238x). What the
    Triton path keeps is q, k, v and the output projection's input (bf16, one
    map each) and fp32 row statistics and states: at least four maps. Its
    training step reads and writes 0.235x the reference's bytes at both shapes
    (the Triton ops by their launches; the target, 3x the reference's speed,
    is 0.33x of its time), about 63 maps of the layer's input (71 with the
    attention and its DWC as two ops: their backward's cat and add)."""
    tool = load_tool('trace_cuda')
    rows = tool.main(['--core-cases', '200x334x96x3', '100x167x192x6', '--dtypes', 'bf16',
                      '--batch', '16'])
    for row, (n, c) in zip(rows, [(200 * 334, 96), (100 * 167, 192)]):
        assert row['saved_ratio'] <= 0.25, row
        assert 4 * 16 * n * c * 2 <= row['triton_saved_bytes'] <= 4.3 * 16 * n * c * 2, row
        assert 60 * 16 * n * c * 2 <= row['triton_step_bytes'], row
        assert row['step_ratio'] < 0.25, row


def test_python_grad_is_autograd_grad():
    """The backward the counts and the compiled trace take: autograd.grad's
    gradients for inputs that are not leaves, several outputs (one given a
    gradient), a node with two outputs, an input that takes no part, and a
    single tensor as inputs."""
    import torch
    tool = load_tool('trace_cuda')
    a = torch.randn(5, 3, requires_grad=True)
    hidden = a * 2
    left, right = hidden.split([1, 2], dim=1)
    unused = torch.randn(2, requires_grad=True)
    outputs = [(left.exp() * right).sum(), right.square()]
    grads = [None, torch.randn(5, 2)]
    inputs = [hidden, a, unused]
    want = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    got = tool.python_grad(outputs, inputs, grads)
    for w, g in zip(want, got):
        assert (w is None) == (g is None)
        if w is not None:
            torch.testing.assert_close(g, w)
    torch.testing.assert_close(tool.python_grad(outputs[0], a)[0],
                               torch.autograd.grad(outputs[0], a, retain_graph=True)[0])


def test_python_grad_passes_what_the_engine_passes_to_a_custom_function():
    """A custom Function's backward gets zeros for an output without a
    gradient, or None where it set ``set_materialize_grads(False)`` (under
    ``materialize_choice_kept``, as the counts run): the engine's choice, so
    the counts see the fills the engine makes, and only those."""
    import torch
    tool = load_tool('trace_cuda')
    seen = {}

    def function(materialize):
        class Two(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.set_materialize_grads(materialize)
                return x * 2, x * 3

            @staticmethod
            def backward(ctx, ga, gb):
                seen[materialize] = gb
                return 2 * ga
        return Two
    x = torch.randn(4, requires_grad=True)
    with tool.materialize_choice_kept():
        for materialize in (True, False):
            a, _ = function(materialize).apply(x)
            torch.autograd.grad(a.sum(), x, retain_graph=True)
            engine = seen.pop(materialize)
            got = tool.python_grad(a.sum(), x)
            assert (seen[materialize] is None) == (engine is None) == (not materialize)
            torch.testing.assert_close(got[0], torch.full((4, ), 2.))


def test_reduced_keys_take_the_fused_dwc_under_autocast():
    """A layer with reduced keys (``sr_ratio=2``) resizes V to the query grid
    before its DWC. CUDA's autocast resizes a bf16 V in fp32 (so the backward
    sums V's gradient in fp32); the result goes back to V's dtype, so the fused
    DWC op (out and V of one dtype) runs, not casts, a convolution and an add:
    one ``triton::conv_add`` each way, the only convolution the key reduction's."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flatten_mm import FocusedLinearAttention
    tool, pb = load_tool('trace_cuda'), load_tool('profile_backbone')
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    layer = tool.to_fake_cuda(FocusedLinearAttention(32, 2, sr_ratio=2, pos_grid=(6, 8)),
                              fake_mode)
    with tool.counting_on_fake_gpu(fake_mode) as inside:
        x = torch.randn(2, 48, 32, device='cuda', requires_grad=True)
        losses = []

        def forward():
            with torch.autocast('cuda', dtype=torch.bfloat16):
                losses.append(layer(x, (6, 8)).float().mean())
        forward()
        losses.clear()
        log = []
        calls = pb.tally_ops(forward, inside, log).calls
        back = pb.tally_ops(lambda: tool.run_backward(losses[0]), inside, log).calls
    assert calls.get('triton::conv_add') == 1 and calls['aten::convolution'] == 1, calls
    # one in-place add, k's positional encoding into the k, v product (the torch DWC adds another)
    assert calls['aten::add_'] == 1 and back['triton::conv_weight_grad'] == 1, (calls, back)
    assert [half for name, _, _, half in log if name.startswith('aten::upsample')] == [False] * 2
