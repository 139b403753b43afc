"""FocusedLinearAttention with prefix tokens (a class token before the grid's):
forward and every gradient against the formula written out by hand."""
import pytest
import torch
import torch.nn.functional as F

from flatten_mm import FocusedLinearAttention
from flatten_mm.analysis import reference_forward
from flatten_mm.models.ops import EPS

from backbone_checks import calls_of


def make_module(C=24, heads=3, grid=(4, 5), prefix=1, **kw):
    m = FocusedLinearAttention(C, heads, pos_grid=grid, num_prefix_tokens=prefix, **kw).double()
    with torch.no_grad():  # non-trivial values for every parameter
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def by_hand(m, x, hw):
    """The prefix-token rule from the formula: every token (prefix ones
    included) is a key and a value of phi(Q) phi(K)^T row-normalised; the
    positional encoding (resized in 2-D) is added to the grid's keys only; the
    DWC of the grid's V is added to the grid's rows, nothing to the prefix rows."""
    B, N, C = x.shape
    P, h, d = m.num_prefix_tokens, m.num_heads, m.head_dims
    q, (k, v) = m.q(x), m.kv(x).chunk(2, -1)
    pe = F.interpolate(m.positional_encoding.transpose(1, 2).reshape(1, C, *m.pos_grid),
                       size=hw, mode='bilinear', align_corners=False)
    k = torch.cat([k[:, :P], k[:, P:] + pe.flatten(2).transpose(1, 2)], 1)
    s = F.softplus(m.scale)

    def phi(t):
        a = (torch.relu(t) + EPS) / s
        ap = a ** m.focusing_factor
        return ap / ap.norm(dim=-1, keepdim=True) * a.norm(dim=-1, keepdim=True)

    fq, fk = phi(q), phi(k)
    heads = []
    for i in range(h):
        sl = slice(i * d, (i + 1) * d)
        A = fq[..., sl] @ fk[..., sl].transpose(1, 2)  # (B, N, N), prefix keys included
        A = A / (A.sum(-1, keepdim=True) + N * EPS)
        attn = A @ v[..., sl]
        vm = v[:, P:, sl].transpose(1, 2).reshape(B, d, *hw)
        dwc = m.dwc(vm).flatten(2).transpose(1, 2)
        heads.append(attn + torch.cat([torch.zeros_like(attn[:, :P]), dwc], 1))
    return m.proj(torch.cat(heads, -1))


@pytest.mark.parametrize('heads,prefix,hw', [(1, 1, (3, 5)), (3, 1, (4, 5)), (3, 2, (7, 6)),
                                             (3, 1, (1, 1))])
def test_prefix_tokens_forward_and_gradients_equal_the_formula(heads, prefix, hw):
    m = make_module(heads=heads, prefix=prefix)
    x = torch.randn(2, prefix + hw[0] * hw[1], 24, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, prefix + hw[0] * hw[1], 24, dtype=torch.float64)

    def run(fn):
        m.zero_grad()
        x.grad = None
        out = fn(m, x, hw)
        (out * g).sum().backward()
        return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in m.named_parameters()}
    got, got_x, got_p = run(lambda m, x, hw: m(x, hw))
    for fn in (by_hand, reference_forward):
        want, want_x, want_p = run(fn)
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(got_x, want_x, rtol=1e-7, atol=1e-9)
        for name, grad in want_p.items():
            torch.testing.assert_close(got_p[name], grad, rtol=1e-7, atol=1e-9, msg=name)


def test_prefix_token_takes_part_in_every_query():
    """Changing only the class token's input changes the grid's outputs (it
    is a key and a value for them) and its own row."""
    m = make_module()
    x = torch.randn(1, 1 + 20, 24, dtype=torch.float64)
    y = x.clone()
    y[:, 0] += 1
    with torch.no_grad():
        a, b = m(x, (4, 5)), m(y, (4, 5))
    assert ((a - b).abs().amax(-1) > 1e-6).all()


def test_no_prefix_tokens_is_the_plain_layer():
    m0 = make_module(prefix=0)
    x = torch.randn(2, 20, 24, dtype=torch.float64)
    torch.testing.assert_close(m0(x, (4, 5)), reference_forward(m0, x, (4, 5)))


@pytest.mark.parametrize('kwargs,match', [
    (dict(num_prefix_tokens=-1), 'num_prefix_tokens must be an int >= 0, got -1'),
    (dict(num_prefix_tokens=1.5), 'num_prefix_tokens must be an int >= 0, got 1.5'),
    (dict(num_prefix_tokens=1, sr_ratio=2), 'num_prefix_tokens needs sr_ratio=1.*got sr_ratio=2'),
])
def test_bad_prefix_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FocusedLinearAttention(16, 2, **kwargs)


def test_input_without_the_prefix_tokens_is_rejected():
    m = make_module()
    with pytest.raises(ValueError, match=r'hw_shape \(4, 5\) and 1 prefix token\(s\) does '
                                         r'not match N=20'):
        m(torch.randn(1, 20, 24, dtype=torch.float64), (4, 5))


def test_grid_tokens_split_off_without_a_zero_filled_gradient():
    """The grid's keys and values are split off the prefix tokens, not sliced:
    a slice's backward fills a zero tensor of the whole sequence's size per
    slice (two a layer, each then summed into the sequence's gradient)."""
    m = make_module().train()
    x = torch.randn(2, 1 + 20, 24, dtype=torch.float64, requires_grad=True)
    out = m(x * 1, (4, 5))
    filled = [tuple(args[1]) for args in
              calls_of(torch.ops.aten.slice_backward, lambda: out.sum().backward())]
    assert (2, 21, 24) not in filled, filled  # weights' halves (kv) are small
