"""The attention and its local term as one call (``ops.local``): its PyTorch
form and its checks (which layers take it: tests/models/test_attention.py)."""
import pytest
import torch

from flatten_mm.models import FocusedLinearAttention
from flatten_mm.models.designs import local_kernel
from flatten_mm.models.ops import (attention_with_local_term, depthwise_conv_add,
                                   focused_linear_attention, use_backend)
from flatten_mm.models.ops import dispatch


def test_torch_form_is_the_two_ops_in_turn():
    """On the 'torch' backend: the attention of the product's thirds plus the
    DWC of its last, the same values as the two ops called apart (output and
    every gradient)."""
    torch.manual_seed(0)
    layer = FocusedLinearAttention(32, 2, lepe=True)
    qkv = torch.randn(2, 30, 96, requires_grad=True)
    weight, bias, extra = local_kernel(layer)
    leaves = [qkv, layer.scale, weight, bias, *extra]
    g = torch.randn(2, 30, 32)
    with use_backend('torch'):
        out = attention_with_local_term(qkv, layer.scale, 3.0, 2, (5, 6), weight, bias, extra)
        got = [out, *torch.autograd.grad(out, leaves, g)]
        q, k, v = qkv.split(32, -1)
        ref = depthwise_conv_add(focused_linear_attention(q, k, v, layer.scale, 3.0, 2), v,
                                 (5, 6), weight, bias, extra)
        want = [ref, *torch.autograd.grad(ref, leaves, g)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backend_switch_chooses_its_form(monkeypatch):
    """'reference' has no fused form: the call takes the two ops, each on the
    'reference' backend; CPU tensors under 'auto' take the 'torch' form."""
    chosen = []
    choose = dispatch.choose
    monkeypatch.setattr(dispatch, 'choose', lambda op, *args: chosen.append(
        (op, choose(op, *args))) or chosen[-1][1])
    layer = FocusedLinearAttention(16, 1)
    qkv = torch.randn(1, 12, 48)
    with use_backend('reference'):
        attention_with_local_term(qkv, layer.scale, 3.0, 1, (3, 4), *local_kernel(layer))
    with use_backend('auto'):
        attention_with_local_term(qkv, layer.scale, 3.0, 1, (3, 4), *local_kernel(layer))
    assert chosen == [('attention_local', 'torch'), ('attention', 'reference'),
                      ('conv_add', 'torch'), ('attention_local', 'torch'),
                      ('attention', 'torch'), ('conv_add', 'torch')]


def test_bad_product_named():
    layer = FocusedLinearAttention(16, 1)
    kernel = local_kernel(layer)
    with pytest.raises(ValueError, match=r'qkv must be \(B, P \+ H\*W, 3C\) with \(H, W\) = '
                                         r'\(3, 4\), got \(1, 12, 47\)'):
        attention_with_local_term(torch.randn(1, 12, 47), layer.scale, 3.0, 1, (3, 4), *kernel)
    with pytest.raises(ValueError, match=r'got \(1, 11, 48\)'):  # fewer tokens than H*W
        attention_with_local_term(torch.randn(1, 11, 48), layer.scale, 3.0, 1, (3, 4), *kernel)
    with pytest.raises(ValueError, match=r'got \(12, 48\)'):
        attention_with_local_term(torch.randn(12, 48), layer.scale, 3.0, 1, (3, 4), *kernel)
