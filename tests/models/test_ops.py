"""The hand-written autograd of the attention core against autograd on the
plain formula (reference_forward, focusing_map + linear_attention)."""
import pytest
import torch
import torch.nn.functional as F

from flatten_mm import FocusedLinearAttention, focusing_map, linear_attention
from flatten_mm.analysis import reference_forward, saved_tensor_bytes
from flatten_mm.models.ops import DepthwiseConvFn, FocusedLinearAttentionFn, TokenMlpFn, token_mlp
from flatten_mm.models.ops import autograd as ops
from flatten_mm.models.ops.autograd import heads_dot, heads_mm, heads_outer, heads_weighted_sum


def random_module(C, heads, sr=1, grid=(5, 6), dtype=torch.float64):
    m = FocusedLinearAttention(C, heads, sr_ratio=sr, pos_grid=grid).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def grads(fn, tensors):
    out = fn()
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return [out] + list(torch.autograd.grad(out, tensors, g))


@pytest.mark.parametrize('heads,sr,hw', [(1, 1, (6, 7)), (3, 1, (5, 9)), (2, 2, (7, 9)),
                                         (4, 3, (10, 8)),
                                         # one token: the output must not be a view
                                         (1, 1, (1, 1)), (2, 1, (1, 1)), (3, 1, (1, 1)),
                                         (3, 2, (1, 1))])
def test_module_gradients_match_reference(heads, sr, hw):
    m = random_module(24, heads, sr)
    x = torch.randn(2, hw[0] * hw[1], 24, dtype=torch.float64, requires_grad=True)
    params = [x] + list(m.parameters())
    fast = grads(lambda: m(x, hw), params)
    ref = grads(lambda: reference_forward(m, x, hw), params)
    names = ['out', 'x'] + [n for n, _ in m.named_parameters()]
    for name, a, b in zip(names, fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9, msg=name)


def test_masked_function_gradients_match_autograd():
    B, N, C, h = 3, 20, 12, 3
    q, k, v = (torch.randn(B, N, C, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sigma = torch.randn(C, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(B, N) > 0.4
    mask[:, 0] = True

    def plain():
        s = F.softplus(sigma)
        return linear_attention(focusing_map(q, s, 3), focusing_map(k, s, 3), v, h, mask)

    def fast():
        return FocusedLinearAttentionFn.apply(q, k, v, 1 / F.softplus(sigma), 3, h, mask, False)

    for a, b in zip(grads(fast, [q, k, v, sigma]), grads(plain, [q, k, v, sigma])):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('p', [2, 3, 4.5])
def test_function_gradcheck(p):
    q, k, v = (torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True) for _ in range(3))
    s_inv = torch.rand(6, dtype=torch.float64).add_(0.5).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *t: FocusedLinearAttentionFn.apply(*t, p, 2, None, False), (q, k, v, s_inv))


def test_depthwise_conv_gradcheck_and_value():
    x = torch.randn(2, 6, 7, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(DepthwiseConvFn.apply(x, w, b),
                               F.conv2d(x, w, b, padding=2, groups=6))
    assert torch.autograd.gradcheck(DepthwiseConvFn.apply, (x, w, b))


def test_large_activations_do_not_overflow():
    # |a| ~ 1e7: a**3 would fit in fp32 but the sum of its squares would not
    m = random_module(32, 2, dtype=torch.float32)
    x = torch.randn(1, 30, 32, requires_grad=True)
    with torch.no_grad():
        m.q.weight.mul_(1e7)
        m.kv.weight.mul_(1e7)
    out = m(x, (5, 6))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    m64 = m.double()
    ref = reference_forward(m64, x.double(), (5, 6))  # fine in float64
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_saves_at_most_40_percent_of_reference_bytes():
    m = random_module(64, 2, grid=(8, 8), dtype=torch.float32)
    x = torch.randn(1, 24 * 32, 64, requires_grad=True)
    exclude = [x, *m.parameters()]
    _, fast = saved_tensor_bytes(lambda: m(x, (24, 32)), exclude)
    _, ref = saved_tensor_bytes(lambda: reference_forward(m, x, (24, 32)), exclude)
    N, C = 24 * 32, 64
    # q, k, v (one (N, 3C) product) and the projection's input: four (N, C) fp32
    # tensors, plus small ones and the stacked q and kv weights (3C x C) the product saves
    stacked = 3 * C * C * 4
    assert 4 * N * C * 4 + stacked <= fast < 4.2 * N * C * 4 + stacked
    assert fast <= 0.4 * ref


def test_saved_bytes_linear_in_tokens_softmax_quadratic():
    """Doubling the side (4x tokens) multiplies the core's saved bytes by ~4
    and an explicit softmax attention's (mmdet PVT's nn.MultiheadAttention
    with sr 1) by ~16 (the linear terms keep it a little under)."""
    lin = FocusedLinearAttention(32, 1, pos_grid=(8, 8))
    soft = torch.nn.MultiheadAttention(32, 1, batch_first=True)

    def saved(side):
        x = torch.randn(1, side * side, 32, requires_grad=True)
        _, a = saved_tensor_bytes(lambda: lin(x, (side, side)), [x, *lin.parameters()])
        _, b = saved_tensor_bytes(lambda: soft(x, x, x)[0], [x, *soft.parameters()])
        return a, b

    (l1, s1), (l2, s2) = saved(32), saved(64)
    assert 3.8 < l2 / l1 < 4.2
    # N^2 attention weights plus linear terms: 16x in the limit
    assert 13 < s2 / s1 < 16.5


@pytest.mark.parametrize('n,chunk', [(37, 8), (5, 16), (64, 64)])
def test_token_mlp_equals_plain_mlp(n, chunk):
    """The chunked MLP: values and every gradient of fc2(gelu(fc1(x))), in
    chunks that do and do not divide the token count; saves x and fc1(x)
    only (the plain MLP also keeps the activation)."""
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(6, 24).double(), torch.nn.Linear(24, 6).double()
    x = torch.randn(2, n, 6, dtype=torch.float64, requires_grad=True)
    params = [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias]
    ref = grads(lambda: fc2(F.gelu(fc1(x))), params)
    got = grads(lambda: TokenMlpFn.apply(*params, chunk), params)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        inference = token_mlp(x.view(-1, 6), *params[1:], chunk)
    torch.testing.assert_close(inference.view_as(ref[0]), ref[0], rtol=1e-12, atol=1e-12)
    _, saved = saved_tensor_bytes(lambda: TokenMlpFn.apply(*params, chunk), params)
    _, saved_plain = saved_tensor_bytes(lambda: fc2(F.gelu(fc1(x))), params)
    assert saved == 2 * n * 24 * 8  # fc1(x) only: x is the input
    assert saved_plain >= 2 * saved


def test_token_mlp_frozen_weights():
    torch.manual_seed(0)
    fc1, fc2 = torch.nn.Linear(6, 24).double(), torch.nn.Linear(24, 6).double()
    for p in (*fc1.parameters(), *fc2.parameters()):
        p.requires_grad_(False)
    x = torch.randn(1, 9, 6, dtype=torch.float64, requires_grad=True)
    ref = torch.autograd.grad(fc2(F.gelu(fc1(x))).sum(), x)[0]
    got = torch.autograd.grad(TokenMlpFn.apply(x, fc1.weight, fc1.bias, fc2.weight,
                                               fc2.bias, 4).sum(), x)[0]
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('heads', [1, 3])
def test_core_in_inference_overwrites_only_when_allowed(heads):
    """Without gradients the core may run its focused mapping in q's and k's
    buffers (overwrite_qk): same output, and the inputs are left alone otherwise."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 11, 3 * heads, dtype=torch.float64) for _ in range(3))
    s_inv = torch.rand(3 * heads, dtype=torch.float64) + 0.5
    with torch.no_grad():
        kept = FocusedLinearAttentionFn.apply(q, k, v, s_inv, 3, heads, None, False)
        q0, k0 = q.clone(), k.clone()
        assert torch.equal(q, q0) and torch.equal(k, k0)
        consumed = FocusedLinearAttentionFn.apply(q, k, v, s_inv, 3, heads, None, True)
    torch.testing.assert_close(consumed, kept, rtol=1e-12, atol=1e-12)
    assert not torch.equal(q, q0)  # overwritten, as allowed


# (B, h): one head; a few images (one product per image and head); more
# image-head pairs than HEADS_DOT_MAX_LOOP (windowed attention: the batched form)
@pytest.mark.parametrize('B,h', [(1, 1), (2, 3), (ops.HEADS_DOT_MAX_LOOP // 2 + 1, 2)])
def test_per_head_products_equal_einsum(B, h):
    torch.manual_seed(0)
    N, d, e = 13, 4, 5
    x = torch.randn(B, N, h * d, dtype=torch.float64)
    y = torch.randn(B, N, h * e, dtype=torch.float64)
    m = torch.randn(B, h, d, e, dtype=torch.float64)
    vec = torch.randn(B, 1, h * d, dtype=torch.float64)
    w = torch.randn(B, N, h, dtype=torch.float64)
    xh, yh = x.view(B, N, h, d), y.view(B, N, h, e)
    torch.testing.assert_close(heads_mm(x, m),
                               torch.einsum('bnhd,bhde->bnhe', xh, m).reshape(B, N, h * e))
    torch.testing.assert_close(heads_outer(x, y, h), torch.einsum('bnhd,bnhe->bhde', xh, yh))
    torch.testing.assert_close(heads_dot(x, vec, h),
                               torch.einsum('bnhd,bhd->bnh', xh, vec.view(B, h, d)))
    torch.testing.assert_close(heads_weighted_sum(w, x),
                               torch.einsum('bnh,bnhd->bhd', w, xh).reshape(B, 1, h * d))


# every focusing factor the module accepts, small and large: p = 50 and 100
# made the fast path's u = (a / |a|)^p underflow to 0 (NaN outputs) in fp32
FOCUSING_FACTORS = [1, 2, 3, 10, 50, 100]


@pytest.mark.parametrize('p', FOCUSING_FACTORS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_any_focusing_factor_gives_the_reference(p, dtype):
    torch.manual_seed(0)
    m = FocusedLinearAttention(64, 2, pos_grid=(4, 5), focusing_factor=p)
    with torch.no_grad():
        for prm in m.parameters():
            prm.normal_(0, 0.3)
    x = torch.randn(2, 20, 64)
    m64 = FocusedLinearAttention(64, 2, pos_grid=(4, 5), focusing_factor=p).double()
    m64.load_state_dict(m.state_dict())
    m = m.to(dtype)
    out = m(x.to(dtype), (4, 5))
    # the reference formula in float64 on the same (rounded) weights and input
    ref = reference_forward(m64, x.to(dtype).double(), (4, 5))
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


@pytest.mark.parametrize('p', FOCUSING_FACTORS)
def test_large_focusing_factor_gradients_match_reference(p):
    """The hand-derived backward against autograd on the reference formula,
    float64, the module's gradients finite in float32 too."""
    torch.manual_seed(0)
    B, N, C, h = 2, 9, 12, 3
    q, k, v = (torch.randn(B, N, C, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sigma = torch.randn(C, dtype=torch.float64, requires_grad=True)

    def plain():
        s = F.softplus(sigma)
        return linear_attention(focusing_map(q, s, p), focusing_map(k, s, p), v, h)

    def fast():
        return FocusedLinearAttentionFn.apply(q, k, v, 1 / F.softplus(sigma), p, h, None, False)

    for a, b in zip(grads(fast, [q, k, v, sigma]), grads(plain, [q, k, v, sigma])):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    m = random_module(32, 2, dtype=torch.float32)
    m.focusing_factor = p
    x = torch.randn(1, 30, 32, requires_grad=True)
    out = m(x, (5, 6))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(prm.grad).all() for prm in m.parameters())


@pytest.mark.parametrize('p', [50, 100])
def test_large_focusing_factor_gradcheck(p):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True) for _ in range(3))
    s_inv = torch.rand(6, dtype=torch.float64).add_(0.5).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *t: FocusedLinearAttentionFn.apply(*t, p, 2, None, False), (q, k, v, s_inv))


@pytest.mark.parametrize('p', [0, -1, float('nan'), float('inf'), -float('inf'), True, '3',
                               None])
def test_focusing_factor_must_be_finite_positive(p):
    with pytest.raises(ValueError, match='focusing_factor'):
        FocusedLinearAttention(32, 2, focusing_factor=p)
