"""The attention core's single entry point: backend choice and the switch."""
import os
import subprocess
import sys

import pytest
import torch

from flatten_mm.models import ops
from flatten_mm.models.ops import (available_backends, choose_backend, focused_linear_attention,
                                   get_backend, set_backend, use_backend)


def inputs(dtype=torch.float64, n=9):
    torch.manual_seed(0)
    q = torch.randn(2, 11, 8, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, n, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    scale = torch.randn(1, 1, 8, dtype=dtype, requires_grad=True)
    return q, k, v, scale


def test_auto_takes_the_torch_backend_on_cpu():
    q, k, v, _ = inputs()
    assert get_backend() == 'auto'
    assert choose_backend(q, k, v, None, 2) == 'torch'


@pytest.mark.parametrize('mask', [False, True])
def test_backends_agree_with_gradients(mask):
    q, k, v, scale = inputs()
    key_mask = torch.arange(9).expand(2, 9) < torch.tensor([[9], [5]]) if mask else None
    results = {}
    for name in ('reference', 'torch'):
        with use_backend(name):
            assert choose_backend(q, k, v, key_mask, 2) == name
            out = focused_linear_attention(q, k, v, scale, 3, 2, key_mask)
        grads = torch.autograd.grad(out, (q, k, v, scale), torch.ones_like(out))
        results[name] = (out, *grads)
    for a, b in zip(results['reference'], results['torch']):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_half_inputs_give_half_outputs_near_fp32():
    q, k, v, scale = (t.detach() for t in inputs(torch.float32))
    want = focused_linear_attention(q, k, v, scale, 3, 2)
    got = focused_linear_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale, 3, 2)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()) < 2e-2


def test_switch_rejects_unknown_names_and_restores():
    with pytest.raises(ValueError, match=r"one of \('auto', .*got 'fast'"):
        set_backend('fast')
    with use_backend('reference'):
        assert get_backend() == 'reference'
        with pytest.raises(RuntimeError):
            with use_backend('torch'):
                raise RuntimeError('inside')
        assert get_backend() == 'reference'
    assert get_backend() == 'auto'
    assert {'auto', 'reference', 'torch'} <= set(available_backends())


def test_environment_variable_sets_the_switch():
    code = 'from flatten_mm.models.ops import get_backend; print(get_backend())'
    env = dict(os.environ, FLATTEN_MM_ATTN_BACKEND='reference')
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == 'reference'
    env['FLATTEN_MM_ATTN_BACKEND'] = 'nope'
    bad = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "got 'nope'" in bad.stderr


def test_module_forward_goes_through_the_switch():
    from flatten_mm import FocusedLinearAttention
    m = FocusedLinearAttention(8, 2, pos_grid=(3, 4)).double()
    x = torch.randn(2, 12, 8, dtype=torch.float64)
    calls = []
    original = ops.dispatch._BACKENDS['attention']['reference']
    ops.register_backend('reference', lambda *a: calls.append(1) or original(*a))
    try:
        with use_backend('reference'):
            ref = m(x, (3, 4))
    finally:
        ops.register_backend('reference', original)
    assert calls == [1]
    torch.testing.assert_close(m(x, (3, 4)), ref)


@pytest.mark.parametrize('backend', ['auto', 'torch', 'reference'])
def test_bad_calls_get_a_clear_error_on_every_backend(backend):
    """Checked once for all backends: before, num_heads not dividing C made the
    torch backend return fewer channels (C=8, 3 heads: 6), and the others
    failed inside their reshapes or divided by zero."""
    q, k, v, scale = inputs()
    mask = torch.ones(2, 9, dtype=torch.bool)
    bad = [
        (dict(num_heads=3), r'num_heads must be a positive divisor of C=8, got 3'),
        (dict(num_heads=0), r'num_heads .* got 0'),
        (dict(focusing_factor=0.), r'focusing_factor must be a positive number, got 0\.0'),
        (dict(focusing_factor=float('nan')), r'focusing_factor .* got nan'),
        (dict(scale=scale[..., :4]), r'scale must hold C=8 elements, got shape \(1, 1, 4\)'),
        (dict(k=k[..., :4], v=v[..., :4]), r'must share batch and channels'),
        (dict(k=k[:, :0], v=v[:, :0]), r'at least one image and one token'),
        (dict(q=q[:0], k=k[:0], v=v[:0]), r'at least one image and one token'),
        (dict(key_mask=mask[:, :4]), r'key_mask must be bool of shape \(2, 9\), got '
                                     r'torch.bool \(2, 4\)'),
        (dict(key_mask=mask.float()), r'key_mask must be bool .* got torch.float32'),
    ]
    for change, message in bad:
        call = dict(q=q, k=k, v=v, scale=scale, focusing_factor=3.0, num_heads=2, key_mask=None)
        call.update(change)
        with use_backend(backend), pytest.raises(ValueError, match=message):
            focused_linear_attention(**call)


@pytest.mark.parametrize('backend', [b for b in ('reference', 'torch', 'triton')
                                     if b in available_backends()])
def test_an_image_whose_keys_are_all_masked_gets_a_zero_term(backend):
    """No key takes part: the attention term is 0 (the sums are empty), as for
    torch's softmax attention over keys all masked out; before, 0 / 0 made it
    NaN on every backend, and NaN gradients. The other image is unaffected."""
    q, k, v, scale = (t.detach().float().requires_grad_() for t in inputs())
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1] = False
    with use_backend(backend):
        out = focused_linear_attention(q, k, v, scale, 3.0, 2, mask)
        alone = focused_linear_attention(q[:1], k[:1], v[:1], scale, 3.0, 2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[:1], alone, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, scale))
    assert all(torch.isfinite(g).all() for g in grads)
    assert not grads[0][1].any() and not grads[2][1].any()
