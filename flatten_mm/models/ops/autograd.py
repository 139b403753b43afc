"""Autograd functions behind :class:`FocusedLinearAttention`'s fast path.

Written by hand because autograd on the plain formula keeps about a dozen
(B, N, C) intermediates alive for backward and spends most of its time in
element-wise passes over them. These functions keep only what backward
cannot cheaply rebuild:

* :class:`FocusedLinearAttentionFn` saves the raw q, k and v (tensors the
  caller holds anyway) and recomputes the focused mapping in backward. Its
  gradients are derived in closed form below.

Notation as in ``attention.py``: q (B, N, C), k and v (B, n, C), h heads of d
channels, p the focusing factor, eps = 1e-6.

Forward, per token x (a row of q or k):
    a = (relu(x) + eps) * s_inv               s_inv = 1 / softplus(scale)
    m = max(a),  u = (a / m)^p,  r = |a| = m |a / m|,  t = |u|,  c = r / t,
    so phi(x) = c * u
Dividing by the row's max before the power keeps u <= 1 with max(u) = 1, so
nothing can overflow and t >= 1 cannot underflow, for any p (dividing by
|a| instead let every u fall below fp32's range from p ~ 40: NaN outputs).

For queries only the direction u matters up to the normaliser's eps, so per
head, with KV = sum_j kappa_j u_j v_j^T and km = sum_j kappa_j u_j
(kappa_j = c_j / n, or c_j m_j / sum(m) with a key mask m):
    dot_i = u_i . km,  w_i = c_i / (c_i dot_i + eps),  out_i = w_i (u_i KV)
which equals sum_j phi(q_i).phi(k_j) v_j / (phi(q_i) . mean_j phi(k_j) + eps).
"""
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..utils import autocast_off
from .reference import EPS


def heads_mm(x: Tensor, m: Tensor) -> Tensor:
    """Per-head ``x_h @ m_h``: x (B, N, h*d), m (B, h, d, e) -> (B, N, h*e), a new tensor.

    One product per head on strided column slices, written into its slice of
    the output: no permuted copies of x or of the result (an einsum makes
    both, i.e. two more (B, N, C) buffers per call).
    """
    B, N, _ = x.shape
    h, d, e = m.shape[1:]
    if h == 1:
        return torch.bmm(x, m[:, 0])
    if torch.compiler.is_compiling():  # compilers take no strided out=: the functional form
        return torch.einsum('bnhd,bhde->bnhe', x.view(B, N, h, d), m).reshape(B, N, h * e)
    out = x.new_empty(B, N, h * e)
    for i in range(h):
        torch.bmm(x[..., i * d:(i + 1) * d], m[:, i], out=out[..., i * e:(i + 1) * e])
    return out


def heads_outer(x: Tensor, y: Tensor, num_heads: int) -> Tensor:
    """Per-head ``x_h^T @ y_h`` summed over tokens: (B, n, h*d), (B, n, h*e) -> (B, h, d, e),
    one product per head on strided column slices (no permuted copies)."""
    d, e = x.shape[-1] // num_heads, y.shape[-1] // num_heads
    return torch.stack([torch.bmm(x[..., i * d:(i + 1) * d].transpose(1, 2),
                                  y[..., i * e:(i + 1) * e]) for i in range(num_heads)], 1)


# heads_dot and heads_weighted_sum loop over (image, head) pairs up to this
# many (windowed attention can bring hundreds of windows)
HEADS_DOT_MAX_LOOP = 32


def loop_over_heads(batch: int, num_heads: int) -> bool:
    """Whether heads_dot / heads_weighted_sum take one matrix-vector product per
    image and head rather than one batched expression: not for many windows,
    not under compilers, not in traced graphs (which must not bake the batch
    size into a loop)."""
    return (batch * num_heads <= HEADS_DOT_MAX_LOOP and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing())


def heads_dot(x: Tensor, vec: Tensor, num_heads: int) -> Tensor:
    """Per-head dot products of the rows of x (B, N, h*d) with vec (B, 1, h*d) -> (B, N, h).

    One matrix-vector product per image and head on x's strided column slice,
    written into a row of a (B, h, N) buffer (returned transposed, as a view):
    a product with a (h*d, h) block-diagonal matrix instead would multiply by
    h times as many (zero) weights, in a shape of h output columns that BLAS
    runs poorly.
    """
    B, N, C = x.shape
    h, d = num_heads, C // num_heads
    if h == 1:
        return torch.bmm(x, vec.transpose(1, 2))
    if not loop_over_heads(B, h):
        return torch.linalg.vecdot(x.view(B, N, h, d), vec.view(B, 1, h, d))
    out = x.new_empty(B, h, N)
    for b in range(B):
        for i in range(h):
            torch.mv(x[b, :, i * d:(i + 1) * d], vec[b, 0, i * d:(i + 1) * d], out=out[b, i])
    return out.transpose(1, 2)


def heads_weighted_sum(weights: Tensor, x: Tensor) -> Tensor:
    """Per head, sum_n weights[n, i] x[n, head i]: (B, N, h), (B, N, h*d) -> (B, 1, h*d),
    by matrix-vector products as :func:`heads_dot` (the transposed problem)."""
    B, N, h = weights.shape
    d = x.shape[-1] // h
    if h == 1:
        return torch.bmm(weights.transpose(1, 2), x)
    if not loop_over_heads(B, h):
        return torch.einsum('bnh,bnhd->bhd', weights, x.view(B, N, h, d)).reshape(B, 1, h * d)
    out = x.new_empty(B, 1, h * d)
    for b in range(B):
        for i in range(h):
            torch.mv(x[b, :, i * d:(i + 1) * d].t(), weights[b, :, i],
                     out=out[b, 0, i * d:(i + 1) * d])
    return out


class Focused(NamedTuple):
    """The focused mapping of rows x in the factors of the module docstring:
    phi(x) = (scaled_norm / sharpened_norm) * sharpened. The fields are the
    tensors :func:`focus` computed (no copies)."""
    scaled: Optional[Tensor]  # a = (relu(x) + eps) * s_inv; None unless focus kept it
    scaled_norm: Tensor  # r = |a|, (..., 1)
    sharpened: Tensor  # u = (a / max(a))^p, the direction sharpened, largest element 1
    sharpened_norm: Tensor  # t = |u|, (..., 1)


def focus(x: Tensor, s_inv: Tensor, p: float, keep_a: bool = True, in_place: bool = False,
          buffers: Optional[Tuple[Tensor, Tensor]] = None) -> Focused:
    """The focused mapping's a, r, u, t (module docstring) as :class:`Focused`;
    u = (a / max(a))^p, r = |a|.

    ``a = max(x * s_inv + eps * s_inv, eps * s_inv)``, which is
    ``(relu(x) + eps) * s_inv`` as s_inv > 0, in two passes and one buffer
    (x's own with ``in_place``). Without ``keep_a``, u is computed in a's
    buffer and a is returned as None. ``buffers`` (two tensors of x's shape
    whose contents are no longer needed) take a and u instead of new ones;
    the a buffer goes unused with ``in_place``, the u buffer without ``keep_a``.
    """
    eps_s = EPS * s_inv
    a_buf, u_buf = buffers if buffers is not None else (None, None)
    a = torch.addcmul(eps_s, x, s_inv, out=x if in_place else a_buf).clamp_min_(eps_s)
    a_max = a.amax(dim=-1, keepdim=True)
    u = torch.div(a, a_max, out=u_buf) if keep_a else a.div_(a_max)
    r = torch.linalg.vector_norm(u, dim=-1, keepdim=True).mul_(a_max)  # |a|
    u = u.pow_(p)
    t = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    return Focused(a if keep_a else None, r, u, t)


def focus_backward(x: Tensor, s_inv: Tensor, p: float, parts: Focused,
                   grad_u: Tensor, grad_c: Tensor) -> Tuple[Tensor, Tensor]:
    """Gradients for x and s_inv given those for u (at fixed c) and for c;
    ``parts`` is ``focus(x, s_inv, p)``.

    With G = grad_u - (grad_c c / t^2) u (u's total gradient at fixed r,
    through t) and S = sum(G u):
    dL/da = p G u / a + (grad_c / t) a / r - [the max's entry] p S / max(a).
    The last term is zero: everything downstream depends on u and c only
    through phi = c u (queries: out = phi KV / (phi . km + eps), the eps
    included; keys: KV and km are sums of kappa u = share * phi), and
    phi = |a| u / |u| does not depend on the divisor of a, so
    S = c sum(dL/dphi u) - grad_c c = 0 identically; it is not computed
    (rounding noise times p otherwise). ``grad_u`` and ``parts``' a are
    overwritten.
    """
    a, r, u, t = parts
    c = r / t
    gu = grad_u.addcmul_(u, grad_c * c / (t * t), value=-1).mul_(u)  # G u, in place
    grad_a_p = gu.div_(a).addcmul_(a, grad_c / (t * r * p))  # dL/da / p
    grad_s_inv = a.mul_(grad_a_p).sum((0, 1)) * (p / s_inv)  # a is not needed any more
    grad_x = grad_a_p.mul_(p * s_inv)
    # relu's gradient, in place
    torch.ops.aten.threshold_backward.grad_input(grad_x, x, 0, grad_input=grad_x)
    return grad_x, grad_s_inv


class FocusedLinearAttentionFn(torch.autograd.Function):
    """out = focused linear attention of raw (projected) q, k, v; see the module docstring.

    Args (forward): q (B, N, C), k (B, n, C), v (B, n, C), s_inv (C,),
    focusing_factor, num_heads, key_mask (B, n) bool or None, and
    overwrite_qk: when no gradient is needed, q and k may be overwritten (the
    focused mapping then runs in their buffers instead of new ones; not while
    compiling, where out= into their strided views would break the graph).
    """

    @staticmethod
    def _keys(k: Tensor, s_inv: Tensor, p: float, key_mask: Optional[Tensor], keep_a: bool,
              in_place: bool = False, buffers: Optional[Tuple[Tensor, Tensor]] = None):
        """u and c of the keys, and kappa's other factor: 1 / n, or mask / count."""
        parts = focus(k, s_inv, p, keep_a, in_place, buffers)
        _, rk, uk, tk = parts
        if key_mask is None:
            share = k.new_full((1, 1, 1), 1.0 / k.shape[1])
        else:
            m = key_mask.to(k.dtype).unsqueeze(-1)
            share = m / m.sum(1, keepdim=True).clamp_min(1)  # no key: 0, no 0/0
        return parts, rk / tk, share

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, s_inv: Tensor, focusing_factor: float,
                num_heads: int, key_mask: Optional[Tensor], overwrite_qk: bool) -> Tensor:
        B, N, C = q.shape
        p, h = focusing_factor, num_heads
        # nothing saved; compilers take no out= into q's and k's strided views
        in_place = overwrite_qk and not any(ctx.needs_input_grad[:4]) and \
            not torch.compiler.is_compiling()
        parts_k, ck, share = FocusedLinearAttentionFn._keys(k, s_inv, p, key_mask, False,
                                                            in_place)
        uk = parts_k.sharpened.mul_(ck * share)  # kappa * u
        km = uk.sum(1, keepdim=True)  # (B, 1, C)
        kv = heads_outer(uk, v, h)  # (B, h, d, d)
        del uk, parts_k
        _, rq, uq, tq = focus(q, s_inv, p, keep_a=False, in_place=in_place)
        cq = rq / tq
        den = cq * heads_dot(uq, km, h) + EPS  # (B, N, h)
        w = cq / den
        out = heads_mm(uq, kv)  # a new tensor, weighted in place
        out.view(B, N, h, -1).mul_(w.unsqueeze(-1))
        # den is (B, N, h), small: backward need not redo its per-head products
        ctx.save_for_backward(q, k, v, s_inv, kv, km, den, key_mask)
        ctx.focusing_factor, ctx.num_heads = p, h
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        # the forward ran without autocast (fp32 sums); a backward called
        # inside an autocast region must not cast its products to half
        with autocast_off(grad_out.device.type):
            return FocusedLinearAttentionFn._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: Tensor):
        q, k, v, s_inv, kv, km, den, key_mask = ctx.saved_tensors
        p, h = ctx.focusing_factor, ctx.num_heads
        B, N, C = q.shape
        g = grad_out.contiguous()

        # queries: out = w * (u KV), w = c / (c * dot + eps), dot = u . km
        parts_q = focus(q, s_inv, p)
        a_q, rq, uq, tq = parts_q
        cq = rq / tq
        w = cq / den
        gw = torch.mul(g.view(B, N, h, -1), w.unsqueeze(-1)).view(B, N, C)
        grad_kv = heads_outer(uq, gw, h)
        g_kvt = heads_mm(g, kv.transpose(-1, -2))  # g KV^T, (B, N, C)
        # g.(u KV) per head, the product in gw's buffer (free now)
        grad_w = torch.mul(g_kvt, uq, out=gw).view(B, N, h, -1).sum(-1)
        grad_w_den2 = grad_w / (den * den)
        grad_cq = (grad_w_den2 * EPS).sum(-1, keepdim=True)
        grad_dot = -grad_w_den2 * cq * cq  # (B, N, h)
        grad_km = heads_weighted_sum(grad_dot, uq)  # (B, 1, C)
        grad_uq = g_kvt.view(B, N, h, -1).mul_(w.unsqueeze(-1)).addcmul_(
            grad_dot.unsqueeze(-1), km.view(B, 1, h, -1)).view(B, N, C)
        del g_kvt
        grad_q, grad_s_inv = focus_backward(q, s_inv, p, parts_q, grad_uq, grad_cq)
        del grad_uq, parts_q

        # keys: KV = sum_j kappa_j u_j v_j^T, km = sum_j kappa_j u_j, kappa = c / n (masked);
        # when k has q's shape, their focused mapping reuses the queries' buffers
        same = k.shape == q.shape
        parts_k, ck, share = FocusedLinearAttentionFn._keys(
            k, s_inv, p, key_mask, True, buffers=(a_q, uq) if same else None)
        del a_q, uq
        uk = parts_k.sharpened
        kappa = ck * share
        grad_v = heads_mm(uk, grad_kv).mul_(kappa)
        grad_uk = heads_mm(v, grad_kv.transpose(-1, -2)).add_(grad_km)
        gu = torch.mul(grad_uk, uk, out=gw if same else None)
        grad_ck = gu.sum(-1, keepdim=True).mul_(share)
        del uk, gu, gw
        grad_k, grad_s_inv_k = focus_backward(k, s_inv, p, parts_k, grad_uk.mul_(kappa), grad_ck)
        return grad_q, grad_k, grad_v, grad_s_inv + grad_s_inv_k, None, None, None, None
