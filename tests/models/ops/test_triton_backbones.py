"""Whole backbones on the Triton kernels against themselves on the 'torch' backend.

The kernel tests take one layer at a time. Here each family's blocks compose
them as a GPU runs them: the one op of attention and local term in every linear
layer (PVT's and PVTv2's linear stages, Swin's global ones, CSwin's with LePE,
DeiT's class token) between the rest of the model, and the attention op and
the conv on their own where a layer has key masks (FLatten-Swin's padded
windows) or reduced keys (FLatten-PVT with ``sr_ratios``), in training mode at
an odd size, outputs and every parameter's gradient. Without CUDA the kernels run
under Triton's CPU interpreter (conftest.py); on a GPU they take CUDA tensors,
with TF32 off on both sides (tests/models/test_tooling.py's
``test_cuda_equals_cpu`` also checks similar small backbones there against
the CPU).
"""
import warnings
from collections import Counter

import pytest
import torch

from flatten_mm.models import FocusedLinearAttention
from flatten_mm.models.ops import triton_backend as tb
from flatten_mm.models.ops import use_backend

from backbone_checks import (FAMILIES, OpLog, assert_grads_close, loss_and_grads,
                             relative_error, small_backbone)

pytestmark = pytest.mark.skipif(not tb.AVAILABLE, reason='triton does not import')

DEVICE = torch.device('cuda' if torch.cuda.is_available() else 'cpu')


@pytest.fixture(autouse=True)
def _exact_fp32():
    """TF32 off (CUDA only): both backends' fp32 products and convs exact."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def run(model, x, backend: str, autocast: bool = False):
    """Outputs and gradients of a training step on ``backend`` (forced: a
    failing kernel raises, it does not fall back), and the Triton ops it
    dispatched, counted by name."""
    with use_backend(backend), OpLog() as log:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            outs, grads = loss_and_grads(model, x)
    return outs, grads, Counter(name for name in log.names if name.startswith('triton'))


# the Triton ops every linear layer takes each way: the attention and its local term
# as one, or (key masks, reduced keys) the attention's and the conv's
ONE_OP, TWO_OPS = ('triton_attention_local', ), ('triton_focused_attention',
                                                 'triton_local_conv_add')
# name: family, its options, the ops
CASES = {**{family: (family, {}, ONE_OP) for family in (*FAMILIES, 'deit')},
         'swin-windows': ('swin', dict(linear_window=4), TWO_OPS),  # padded: key masks
         'pvt-reduced-keys': ('pvt', dict(sr_ratios=[2, 2, 1, 1]), TWO_OPS)}


def steps(model, x, ops: tuple = ONE_OP, autocast: bool = False):
    """The step on 'torch' and on 'triton': the first dispatches no Triton op,
    the second ``ops`` each way in every linear layer."""
    linear = sum(isinstance(m, FocusedLinearAttention) for m in model.modules())
    assert linear > 0
    want, want_grads, plain = run(model, x, 'torch', autocast)
    got, got_grads, fused = run(model, x, 'triton', autocast)
    assert not plain, plain
    for op in ops:
        assert fused.get(op) == fused.get(f'{op}_backward') == linear, fused
    return (want, want_grads), (got, got_grads)


@pytest.mark.parametrize('case', [
    pytest.param(case, marks=pytest.mark.heavy(25)) if case == 'swin-windows' else case
    for case in sorted(CASES)])
def test_backbone_on_the_kernels_equals_the_torch_backend(case):
    """fp32: outputs and gradients to 1e-4 relative (the kernels sum in
    another order; measured a few 1e-6 at most). Besides the registered
    forms, FLatten-Swin with windowed linear stages (padded windows: key
    masks) and FLatten-PVT with reduced keys in its linear stages, whose
    layers take the attention op and the conv on their own."""
    family, options, ops = CASES[case]
    torch.manual_seed(0)
    model = small_backbone(family, drop_path_rate=0., **options).train().to(DEVICE)
    x = torch.randn(2, 3, 29, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    (want, want_grads), (got, got_grads) = steps(model, x, ops)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert relative_error(a, b) < 1e-4
    assert_grads_close(got_grads, want_grads, 1e-4)


def test_backbone_on_the_kernels_under_bf16_autocast():
    """bf16 autocast, as users train: each output and gradient within 3e-2
    relative of the fp32 step (test_triton.py's bf16 tolerance: a few bf16
    roundings, 2^-8 each), or no more than three times as far from it as the
    'torch' backend's bf16 step (test_triton_random.py's rule: LayerNorm
    parameters' and q's gradients sum many rounded terms and are 2e-2 to 4e-2
    off on 'torch' too; measured up to twice the 'torch' error here). FLatten-CSwin:
    its linear layers carry LePE too."""
    torch.manual_seed(0)
    model = small_backbone('cswin', drop_path_rate=0.).train().to(DEVICE)
    x = torch.randn(2, 3, 29, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    exact, exact_grads, _ = run(model, x, 'torch')
    (plain, plain_grads), (got, got_grads) = steps(model, x, autocast=True)
    pairs = [(f'output {i}', a, b, c) for i, (a, b, c) in enumerate(zip(got, plain, exact))]
    pairs += [(n, got_grads[n], plain_grads[n], g) for n, g in exact_grads.items()]
    for name, a, b, want in pairs:
        err, err_torch = relative_error(a, want), relative_error(b, want)
        assert err < 3e-2 or err < 3 * err_torch, f'{name}: {err:.2e} (torch {err_torch:.2e})'


@pytest.mark.parametrize('agree', [True, False], ids=['agreeing', 'disagreeing'])
def test_first_use_check_inside_gradient_checkpointing(monkeypatch, agree):
    """The first training step on 'auto' with ``with_cp`` (mmdet's option to
    save memory): each layer configuration's first-use check
    (``tb.agrees_once``) runs inside a checkpointed block's forward. Its probe
    keeps its own tensors, so the block's recomputation in the backward saves
    what its forward saved (torch raised ``CheckpointError`` on that step), and
    the step equals the step without checkpointing. Kernels that disagree (a
    GPU that computes them wrong; here every check's bound is below zero) are
    not run in the block's forward: the torch form alone is, as 'auto' runs in
    the recomputation once it has left the kernels (torch raised
    ``CheckpointError`` there too), and the step equals the torch backend's.
    The interpreter stands in for a GPU: 'auto' takes the kernels for CPU
    tensors (``tb.INTERPRETER_AS_GPU``). (All first-use checks run through one
    probe, ``tb._probe``.)"""
    monkeypatch.setattr(tb, '_AGREED', set())
    monkeypatch.setitem(tb._KERNELS, 'importable', True)
    monkeypatch.setitem(tb.INTERPRETER_AS_GPU, 'on', DEVICE.type == 'cpu')
    if not agree:
        monkeypatch.setattr(tb, 'AGREE_TOL', dict.fromkeys(tb.AGREE_TOL, -1.))
    plain = small_backbone('pvt', drop_path_rate=0.)
    checkpointed = small_backbone('pvt', drop_path_rate=0., with_cp=True)
    for model in (plain, checkpointed):
        model.prune_stages(1)  # one layer configuration: the interpreter is slow
    checkpointed.load_state_dict(plain.state_dict())
    plain.train().to(DEVICE)
    x = torch.randn(2, 3, 29, 37, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        got, got_grads, _ = run(checkpointed.train().to(DEVICE), x, 'auto')
    disagreed = [w for w in caught if 'disagree with' in str(w.message)]
    assert bool(disagreed) != agree and tb._KERNELS['importable'] == agree
    assert bool(tb._AGREED) == agree  # checked, and the kernels agreed (or none did)
    want, want_grads, _ = run(plain, x, 'triton' if agree else 'torch')
    for a, b in zip(got, want, strict=True):
        assert relative_error(a, b) < 1e-6
    assert_grads_close(got_grads, want_grads, 1e-6)
