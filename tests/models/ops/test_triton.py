"""The 'triton' backend of the attention core against the reference formula.

Without CUDA the kernels run under Triton's CPU interpreter (conftest.py), so the
shapes are tiny; the interpreter tiles by 16 tokens, two blocks per program, so
N = 37 crosses block and chunk borders. Errors are measured as
``||x - ref||_F / ||ref||_F`` over the whole tensor, the reference in float64
on the same (rounded) inputs.

Tolerances: fp32 1e-4. Half precision stores q, k, v, out and the gradients in
16 bits and takes 16-bit dot operands (u, phi, the states): each rounding costs
at most one unit roundoff (fp16 2^-11 ~ 4.9e-4, bf16 2^-8 ~ 3.9e-3), and a
gradient passes through a few of them, so fp16 is held to 5e-3 and bf16 to
3e-2 (about ten units; a wrong formula is off by O(1)).
"""
import pytest
import torch
import torch.nn.functional as F

from flatten_mm.models.ops import available_backends, focused_linear_attention, use_backend
from flatten_mm.models.ops import triton_backend as tb

pytestmark = pytest.mark.skipif(not tb.AVAILABLE, reason='triton does not import')

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
NAMES = ('out', 'q', 'k', 'v', 'scale')


def inputs(B, N, n, C, dtype, masked=False, device=DEVICE):
    """q, k, v (rounded to dtype), scale (fp32), key mask, output gradient."""
    q = torch.randn(B, N, C, device=device).to(dtype)
    k = torch.randn(B, n, C, device=device).to(dtype)
    v = torch.randn(B, n, C, device=device).to(dtype)
    scale = (0.5 * torch.randn(1, 1, C, device=device))
    mask = None
    if masked:  # padded tail keys, as a padded window, and a few random holes
        mask = torch.rand(B, n, device=device) > 0.2
        mask[:, -(n // 4 + 1):] = False
        mask[:, 0] = True
    g = torch.randn(B, N, C, device=device)
    return q, k, v, scale, mask, g


def run(backend, q, k, v, scale, p, h, mask, g, dtype=None):
    """Output and gradients for q, k, v and scale of one backend (inputs cast to dtype)."""
    ts = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    s = scale.detach().to(dtype or scale.dtype).requires_grad_()
    with use_backend(backend):
        out = focused_linear_attention(ts[0], ts[1], ts[2], s, p, h, mask)
    return [out] + list(torch.autograd.grad(out, ts + [s], g.to(out.dtype)))


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def check(dtype, B, N, n, C, h, p, masked, tol=None):
    q, k, v, scale, mask, g = inputs(B, N, n, C, dtype, masked)
    got = run('triton', q, k, v, scale, p, h, mask, g)
    ref = run('reference', q, k, v, scale, p, h, mask, g, torch.float64)
    assert got[0].dtype == dtype and got[0].shape == (B, N, C)
    for name, x, r in zip(NAMES, got, ref):
        assert x.shape == r.shape, name
        assert torch.isfinite(x).all(), name
        err = rel_err(x, r)
        assert err < (tol or TOL[dtype]), f'{name}: relative error {err:.2e}'


@pytest.mark.parametrize('B,N,n,C,h,p,masked', [
    (2, 37, 37, 64, 2, 3.0, True),  # key mask with padded keys, batch 2, d = 32
    (2, 37, 10, 48, 2, 3.0, False),  # reduced keys (n != N), d = 24
    (1, 37, 37, 32, 1, 1.0, False),  # one head, p = 1
    (2, 21, 21, 24, 1, 50.0, True),  # p = 50: finite and equal
    (1, 37, 9, 96, 3, 3.0, True),  # three heads, reduced and masked keys
    (1, 5, 3, 8, 2, 2.0, False),  # d = 4: padded far up to 16
])
def test_fp32_matches_reference(B, N, n, C, h, p, masked):
    check(torch.float32, B, N, n, C, h, p, masked)


@pytest.mark.parametrize('B,N,n,C,h,p,masked', [
    (2, 37, 37, 64, 2, 3.0, True),
    (1, 37, 10, 24, 1, 50.0, False),
])
def test_fp16_matches_reference(B, N, n, C, h, p, masked):
    check(torch.float16, B, N, n, C, h, p, masked)


def test_bf16_matches_reference():
    # under the interpreter bf16 loads and stores, fp32 dot operands (tl.dot on
    # bf16 is wrong there); on CUDA the real bf16 dots
    check(torch.bfloat16, 2, 37, 37, 64, 2, 3.0, True)
