"""The reference formula of focused linear attention (FLATTEN.md §2.4-2.5),
written plainly with autograd: the yardstick every fast backend is tested against."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

EPS = 1e-6

def focusing_map(x: Tensor, scale: Tensor, focusing_factor: float) -> Tensor:
    """The focused mapping phi_p over the last dimension (FLATTEN.md §2.4).

    ``a = (ReLU(x) + eps) / scale``; ``phi(x) = ||a|| * a**p / ||a**p||``.
    The direction of ``a`` is sharpened toward its largest channels while its
    norm is kept. ``a / max(a)`` is raised to the power instead of ``a``: the
    ratio is the same, and the power can no longer overflow.
    """
    a = (F.relu(x) + EPS) / scale
    a_max = a.amax(dim=-1, keepdim=True)
    u = a / a_max
    u_p = u.pow(focusing_factor)
    # ||a|| * u^p / ||u^p||, with ||a|| = a_max * ||u||
    gain = a_max * torch.linalg.vector_norm(u, dim=-1, keepdim=True) / \
        torch.linalg.vector_norm(u_p, dim=-1, keepdim=True)
    return u_p * gain


def linear_attention(q: Tensor, k: Tensor, v: Tensor, num_heads: int,
                     key_mask: Optional[Tensor] = None) -> Tensor:
    """Normalised linear attention per head (FLATTEN.md §2.5).

    Args:
        q (Tensor): phi(Q), shape (B, N, C).
        k (Tensor): phi(K), shape (B, n, C).
        v (Tensor): V, shape (B, n, C).
        num_heads (int): heads h; C is split into h groups of d channels.
        key_mask (Tensor, optional): (B, n) bool, True for real keys. Masked
            keys are left out of the K/V sums and of the mean normaliser.

    Returns:
        Tensor: (B, N, C), row i equal to
        ``sum_j (q_i . k_j) v_j / sum_j (q_i . k_j)`` up to the eps of the
        normaliser.
    """
    B, N, C = q.shape
    n = k.shape[1]
    d = C // num_heads
    if key_mask is None:
        # n as a factor, not a fill value: a jit trace records it as a size read
        count = q.new_ones(B, 1, 1) * n
    else:
        # zero phi(K) at masked keys: they then drop out of sum_j k_j v_j and
        # of the key mean, whatever V holds there
        m = key_mask.to(q.dtype).unsqueeze(-1)
        k = k * m
        count = m.sum(dim=1, keepdim=True).clamp_min(1)  # no key: the term is 0, no 0/0
    # per head (B, h, tokens, d); products as matmuls, which ONNX has at every
    # opset (Einsum from opset 12; mmdeploy's configs export at 11)
    qh, kh, vh = (t.view(B, -1, num_heads, d).transpose(1, 2) for t in (q, k, v))
    count = count.unsqueeze(1)  # (B, 1, 1, 1)
    k_mean = kh.sum(dim=2, keepdim=True) / count  # (B, h, 1, d)
    kv = torch.matmul(kh.transpose(2, 3), vh) / count  # (B, h, d, d)
    z = 1.0 / (torch.matmul(qh, k_mean.transpose(2, 3)) + EPS)  # (B, h, N, 1)
    out = torch.matmul(qh, kv) * z
    return out.transpose(1, 2).reshape(B, N, C)
