"""Whole backbones on the Triton kernels against themselves on the 'torch' backend.

The kernel tests take one layer at a time. Here each family's blocks compose
the kernels as a GPU runs them: the one op of attention and local term in
every linear layer (PVT's and PVTv2's stages with their MLPs and the conv of
PVTv2's, Swin's global stages, CSwin's with LePE, DeiT's class token), then the
softmax stages, in training mode at an odd size, outputs and every parameter's
gradient. Without CUDA the kernels run under Triton's CPU interpreter
(conftest.py); with CUDA tensors, tests/models/test_tooling.py's
``test_cuda_equals_cpu`` checks the same models against the CPU.
"""
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flatten_mm.models import FocusedLinearAttention
from flatten_mm.models.ops import triton_backend as tb
from flatten_mm.models.ops import use_backend

from backbone_checks import FAMILIES, assert_grads_close, loss_and_grads, small_backbone

pytestmark = pytest.mark.skipif(not tb.AVAILABLE, reason='triton does not import')


class Ops(TorchDispatchMode):
    """Counts the flatten_mm ops a step dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == 'flatten_mm':
            name = func.overloadpacket.__name__
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def run(model, x, backend: str, autocast: bool = False):
    """Outputs and gradients of a training step on ``backend``; on 'triton' a
    fallback to the 'torch' backend (a failing first call warns) is an error."""
    with use_backend(backend), warnings.catch_warnings(), Ops() as ops:
        warnings.simplefilter('error', RuntimeWarning)
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            outs, grads = loss_and_grads(model, x)
    return outs, grads, ops.counts


@pytest.mark.parametrize('family', [*FAMILIES, 'deit'])
def test_backbone_on_the_kernels_equals_the_torch_backend(family):
    """fp32: outputs and gradients to 1e-4 relative (the kernels sum in
    another order; measured 3e-6 at most). Every linear layer took the one op
    each way, so the kernels, not a fallback, made the step."""
    torch.manual_seed(0)
    model = small_backbone(family, drop_path_rate=0.).train()
    linear = sum(isinstance(m, FocusedLinearAttention) for m in model.modules())
    x = torch.randn(2, 3, 29, 37, generator=torch.Generator().manual_seed(1))
    want, want_grads, _ = run(model, x, 'torch')
    got, got_grads, ops = run(model, x, 'triton')
    assert linear > 0
    assert ops['triton_attention_local'] == ops['triton_attention_local_backward'] == linear
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() < 1e-4
    assert_grads_close(got_grads, want_grads, 1e-4)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm().clamp(min=1e-30)).item()


def test_backbone_on_the_kernels_under_bf16_autocast():
    """bf16 autocast, as users train: each output and gradient within 3e-2
    relative of the fp32 step (test_triton.py's bf16 tolerance: a few bf16
    roundings, 2^-8 each), or no more than three times as far from it as the
    'torch' backend's bf16 step (test_triton_random.py's rule: LayerNorm
    biases' and q's gradients sum many rounded terms and are 3e-2 to 4e-2 off
    on 'torch' too; measured at most 1.3 times the 'torch' error here, 1.5 for
    FLatten-Swin). FLatten-CSwin: its linear layers carry LePE too."""
    torch.manual_seed(0)
    model = small_backbone('cswin', drop_path_rate=0.).train()
    x = torch.randn(2, 3, 29, 37, generator=torch.Generator().manual_seed(1))
    exact, exact_grads, _ = run(model, x, 'torch')
    plain, plain_grads, _ = run(model, x, 'torch', autocast=True)
    got, got_grads, ops = run(model, x, 'triton', autocast=True)
    assert ops['triton_attention_local_backward'] > 0
    pairs = [(f'output {i}', a, b, c) for i, (a, b, c) in enumerate(zip(got, plain, exact))]
    pairs += [(n, got_grads[n], plain_grads[n], g) for n, g in exact_grads.items()]
    for name, a, b, want in pairs:
        err, err_torch = relative_error(a, want), relative_error(b, want)
        assert err < 3e-2 or err < 3 * err_torch, f'{name}: {err:.2e} (torch {err_torch:.2e})'
