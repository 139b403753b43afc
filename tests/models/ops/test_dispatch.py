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
