"""Measuring and inspecting models: FLOPs with mmengine's analyzer, bytes saved
for backward, the attention weights of chosen queries, and the reference forward
of a FocusedLinearAttention in the release's op order (the tests' yardstick).

FLOPs follow the OpenMMLab convention (mmengine's ``FlopAnalyzer``, as
mmdet's ``get_flops.py``): one multiply-accumulate of a linear layer, matmul
or convolution counts as one FLOP, and element-wise work (activations,
normalisation, softmax) counts nothing. The ops of the attention core (the
torch backend's autograd function, the triton backend's custom op, the CPU
depth-wise conv) get handles that count them the same way:

* focused linear attention, per head of d channels with N queries and n keys:
  ``n*d*d`` for phi(K)^T V, ``n*d`` for the key mean, ``N*d`` for
  phi(q).mean(phi(K)) and ``N*d*d`` for phi(Q)(phi(K)^T V);
* the depth-wise conv: ``k*k`` per output element, as any convolution;
* ``F.scaled_dot_product_attention`` (softmax stages), which mmengine skips:
  ``N*n*d`` for Q K^T and as many for the weighted sum of V, per head.

The focused mapping itself is element-wise; :func:`focusing_ops` counts its
operations separately (:data:`FOCUS_OPS_PER_ELEMENT` per element of q and k),
so it can be reported next to the total without being mixed into it, just
as a softmax is not part of a softmax backbone's count.

The compared designs (``design``/``attn_design``, :mod:`flatten_mm.models.designs`)
are written in products mmengine counts itself (``matmul``, ``einsum``,
convolutions, linear layers), in the same convention; each design's
``Design.flops`` is the closed form of its attention term per image, which
:func:`attention_flops` sums over a model (tests hold the analyzer to it):

* relu, efficientvit (per scale): ``(n + N) * C * (d + 1)`` (phi(K)^T [V, 1]
  and phi(Q) times it, the ones column giving the normaliser);
* efficient: ``(n + N) * C * d``; hydra: ``n * C`` (the sum of k * v; its
  product with q is element-wise); angular: ``(n + N) * h * (d + 1)**2``
  (q and k carry one more feature each: 1 and 1/2).
"""
from collections import Counter
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .models.ops import EPS, focusing_map
from .models.utils import HWShape, op_nodes_in_traces, spatial_reduce

#: element-wise operations of the focused mapping per element of q or k:
#: ReLU, +eps, x1/scale, square-accumulate for |a|, /|a|, the power (counted
#: as one), square-accumulate for |u|, and the final scaling by |a|/|u|.
FOCUS_OPS_PER_ELEMENT = 8


def _shape(value) -> Tuple[int, ...]:
    from mmengine.analysis.jit_handles import get_shape
    return tuple(get_shape(value))


def _focused_count(q_shape: Tuple[int, ...], n: int, num_heads: int) -> Counter:
    B, N, C = q_shape
    d = C // num_heads
    return Counter({'focused_linear_attention':
                    B * (n * C * d + n * C + N * C + N * C * d)})


def focused_linear_attention_flops(inputs, outputs) -> Counter:
    """mmengine FLOP handle for ``FocusedLinearAttentionFn`` (the torch backend)."""
    return _focused_count(_shape(inputs[0]), _shape(inputs[1])[1],
                          outputs[0].node().scalar_args()[1])


def triton_focused_attention_flops(inputs, outputs) -> Counter:
    """mmengine FLOP handle for the ``flatten_mm::triton_focused_attention`` op (the
    triton backend, arguments q, k, v, scale, p, num_heads, key_mask): the
    same products, so a model counts the same on either backend."""
    return _focused_count(_shape(inputs[0]), _shape(inputs[1])[1],
                          int(inputs[5].toIValue()))


def depthwise_conv_flops(inputs, outputs) -> Counter:
    """mmengine FLOP handle for ``DepthwiseConvFn``."""
    B, C, H, W = _shape(outputs[0])
    k = _shape(inputs[1])[-1]
    return Counter({'conv': B * C * H * W * k * k})


def triton_conv_add_flops(inputs, outputs) -> Counter:
    """mmengine FLOP handle for the ``flatten_mm::triton_local_conv_add`` op (out +
    DWC(x), arguments out, x, weight, bias, extra weight or None, its bias, H,
    W): the count of the merged kernel's conv (the larger part's size), as
    :func:`depthwise_conv_flops` (the add is element-wise, not counted)."""
    B, L, C = _shape(inputs[1])
    k = max(_shape(t)[-1] for t in (inputs[2], inputs[4])
            if t.type().kind() == 'TensorType')
    return Counter({'conv': B * L * C * k * k})


def triton_attention_local_flops(inputs, outputs) -> Counter:
    """mmengine FLOP handle for the ``flatten_mm::triton_attention_local`` op
    (attention + DWC(v) of one (B, N, 3C) product; arguments qkv, scale,
    weight, bias, extra weight or None, its bias, H, W, p, num_heads): the two
    ops' counts (:func:`triton_focused_attention_flops`,
    :func:`triton_conv_add_flops`)."""
    B, N, C3 = _shape(inputs[0])
    k = max(_shape(t)[-1] for t in (inputs[2], inputs[4])
            if t.type().kind() == 'TensorType')
    return _focused_count((B, N, C3 // 3), N, int(inputs[9].toIValue())) + \
        Counter({'conv': B * N * C3 // 3 * k * k})


def sdpa_flops(inputs, outputs) -> Counter:
    """mmengine FLOP handle for ``F.scaled_dot_product_attention`` (which it
    does not count): Q K^T and the weighted sum of V."""
    q, k, v = (_shape(t) for t in inputs[:3])
    batch = 1
    for size in q[:-2]:
        batch *= size
    return Counter({'softmax_attention': batch * q[-2] * k[-2] * (q[-1] + v[-1])})


FLOP_HANDLES: Dict[str, Callable] = {
    'aten::scaled_dot_product_attention': sdpa_flops,
    'prim::PythonOp.FocusedLinearAttentionFn': focused_linear_attention_flops,
    'flatten_mm::triton_focused_attention': triton_focused_attention_flops,
    'prim::PythonOp.DepthwiseConvFn': depthwise_conv_flops,
    'flatten_mm::triton_local_conv_add': triton_conv_add_flops,
    'flatten_mm::triton_attention_local': triton_attention_local_flops,
}


def flop_analyzer(model: nn.Module, inputs):
    """An mmengine ``FlopAnalyzer`` that knows the attention core's ops: its
    trace keeps them as nodes (:func:`~flatten_mm.models.utils.op_nodes_in_traces`;
    other jit traces record their plain ops, for ``torch.jit.save`` and ONNX)."""
    from mmengine.analysis import FlopAnalyzer

    class Analyzer(FlopAnalyzer):
        def _analyze(self):  # mmengine's one call that traces the model
            with op_nodes_in_traces():
                return super()._analyze()

    analyzer = Analyzer(model, inputs)
    analyzer.set_op_handle(**FLOP_HANDLES)
    analyzer.unsupported_ops_warnings(False)
    analyzer.uncalled_modules_warnings(False)
    return analyzer


def _run_hooked(model: nn.Module, forward: Callable[[], object],
                count: Callable[[nn.Module, Tensor, HWShape], None],
                designs: Optional[Iterable[str]] = None) -> None:
    """``forward()`` without gradients, ``count(layer, x, hw_shape)`` called by
    every :class:`~flatten_mm.FocusedLinearAttention` of ``model`` it runs
    (of the given designs only, if any)."""
    from .models.attention import FocusedLinearAttention

    def hook(module, args, kwargs, output):
        count(module, args[0], args[1] if len(args) > 1 else kwargs['hw_shape'])

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()
               if isinstance(m, FocusedLinearAttention) and
               (designs is None or m.attn_design in designs)]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()


def focusing_ops(model: nn.Module, forward: Callable[[], object]) -> int:
    """Element-wise operations of every focused mapping run by ``forward()``.

    Counts ``FOCUS_OPS_PER_ELEMENT`` per element of q and of k in each
    :class:`~flatten_mm.FocusedLinearAttention` of ``model`` with the focused design.
    """
    total = 0

    def count(module: nn.Module, x: Tensor, hw: HWShape) -> None:
        nonlocal total
        keys = x.shape[0] * _key_count(module, hw)
        total += FOCUS_OPS_PER_ELEMENT * module.embed_dims * (x.shape[0] * x.shape[1] + keys)

    _run_hooked(model, forward, count, designs=('focused',))
    return total


def _key_count(module: nn.Module, hw_shape: HWShape) -> int:
    """Keys per image of a FocusedLinearAttention on an H x W grid: its
    prefix (class) tokens and the grid's, reduced by ``sr_ratio``."""
    sr = module.sr_ratio
    return getattr(module, 'num_prefix_tokens', 0) + \
        (-(-hw_shape[0] // sr)) * (-(-hw_shape[1] // sr))


def attention_flops(model: nn.Module, forward: Callable[[], object]) -> Dict[str, int]:
    """FLOPs of the attention terms (``Design.flops``: no projections, no
    convolutions) of every :class:`~flatten_mm.FocusedLinearAttention` of
    ``model`` run by ``forward()``, by design name."""
    totals: Counter = Counter()

    def count(module: nn.Module, x: Tensor, hw: HWShape) -> None:
        B, N, C = x.shape
        totals[module.attn_design] += B * module._design.flops(
            N, _key_count(module, hw), C, module.num_heads)

    _run_hooked(model, forward, count)
    return dict(totals)


def _focused_only(module: nn.Module, what: str) -> None:
    if getattr(module, 'attn_design', 'focused') != 'focused':
        raise ValueError(f'{what} writes out the focused design only, got a layer with '
                         f'design={module.attn_design!r}')


def saved_tensor_bytes(fn: Callable[[], object],
                       exclude: Iterable[Tensor] = ()) -> Tuple[object, int]:
    """Run ``fn()`` and count the bytes autograd keeps for its backward.

    Unique storages of the tensors packed by autograd are summed once each
    (views of one tensor count once); storages of ``exclude`` (inputs and
    parameters) are left out. Storages are told apart as torch's own aliasing
    checks do (``StorageWeakRef``), not by address: fake tensors (no memory,
    as ``tools/analysis_tools/trace_cuda.py`` runs models) all have address 0.

    Returns:
        tuple: ``fn()``'s result and the byte count.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    skip = {StorageWeakRef(t.untyped_storage()) for t in exclude}
    seen: Dict[StorageWeakRef, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        if key not in skip:
            seen[key] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


@torch.no_grad()
def attention_weights(module: nn.Module, x: Tensor, hw_shape: HWShape,
                      queries: Tensor) -> Tuple[Tensor, Tensor, HWShape]:
    """The attention rows of chosen queries of a
    :class:`~flatten_mm.models.attention.FocusedLinearAttention`, written out explicitly.

    The focused term of the output for query i is ``sum_j w_ij v_j`` with
    ``w_ij = phi(q_i).phi(k_j) / (n * (phi(q_i).mean_j phi(k_j) + eps))``
    per head (rows sum to 1 up to eps); the DWC term is not attention and
    is left out. For comparison, ``softmax(q_i.k_j / sqrt(d))`` on the
    same q and k (before the focused mapping) is returned too.

    Args:
        x (Tensor): (1, N, C) tokens on ``hw_shape``.
        queries (Tensor): (P,) token indices of the queries.

    Returns:
        tuple: focused weights (P, heads, n), softmax weights (P, heads,
        n), and the key grid (h, w): n = h * w, or with the layer's prefix
        tokens (a class token) n = num_prefix_tokens + h * w, the prefix keys
        first.
    """
    _focused_only(module, 'attention_weights')
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f'attention_weights takes one image, x of shape (1, N, C); '
                         f'got {tuple(x.shape)}')
    q, k, _, grid = module.project_qkv(x, hw_shape)
    q, k = q[0, queries], k[0]
    scale = F.softplus(module.scale).view(-1)
    phi_q = focusing_map(q, scale, module.focusing_factor)
    phi_k = focusing_map(k, scale, module.focusing_factor)
    P, n, h, d = q.shape[0], k.shape[0], module.num_heads, module.head_dims
    phi_q, phi_k = phi_q.view(P, h, d), phi_k.view(n, h, d)
    scores = torch.einsum('phd,nhd->phn', phi_q, phi_k)
    norm = torch.einsum('phd,hd->ph', phi_q, phi_k.mean(0)) + EPS
    focused = scores / (n * norm.unsqueeze(-1))
    logits = torch.einsum('phd,nhd->phn', q.view(P, h, d), k.view(n, h, d))
    softmax = (logits * d ** -0.5).softmax(-1)
    return focused, softmax, grid


def reference_forward(module: nn.Module, x: Tensor, hw_shape: HWShape) -> Tensor:
    """The module's forward written step by step in the op order of the
    official release (ReLU, +eps, /scale, norms, power, renormalise, mean,
    two n^-1/2-scaled matmuls, DWC on (B*h, d, H, W)); V is resized to the
    query grid in 2-D; no DWC with ``kernel_size=0``. Prefix tokens
    (``num_prefix_tokens``, a class token) take part in the attention like any
    token, with no positional encoding and no DWC term (zero rows). Slow; kept
    as the yardstick for tests and benchmarks. The focused design only.
    """
    _focused_only(module, 'reference_forward')
    B, N, C = x.shape
    h, d = module.num_heads, module.head_dims
    P = getattr(module, 'num_prefix_tokens', 0)
    q = module.q(x)
    if module.sr_ratio > 1:
        x, grid = spatial_reduce(x, hw_shape, module)
    else:
        grid = tuple(hw_shape)
    k, v = module.kv(x).chunk(2, dim=-1)
    k = k + F.pad(module.positional_encoding_for(grid), (0, 0, P, 0))
    n = k.shape[1]
    scale = F.softplus(module.scale)
    q = (F.relu(q) + EPS) / scale
    k = (F.relu(k) + EPS) / scale
    q_norm = q.norm(dim=-1, keepdim=True)
    k_norm = k.norm(dim=-1, keepdim=True)
    q = q ** module.focusing_factor
    k = k ** module.focusing_factor
    q = q / q.norm(dim=-1, keepdim=True) * q_norm
    k = k / k.norm(dim=-1, keepdim=True) * k_norm
    q = q.reshape(B, N, h, d).permute(0, 2, 1, 3)
    k = k.reshape(B, n, h, d).permute(0, 2, 1, 3)
    v = v.reshape(B, n, h, d).permute(0, 2, 1, 3)
    z = 1 / (q @ k.mean(dim=-2, keepdim=True).transpose(-2, -1) + EPS)
    kv = (k.transpose(-2, -1) * n ** -0.5) @ (v * n ** -0.5)
    out = (q @ kv * z).transpose(1, 2).reshape(B, N, C)
    v = v[:, :, P:]  # the grid's values
    v_map = v.transpose(-2, -1).reshape(B * h, d, grid[0], grid[1])
    if tuple(grid) != tuple(hw_shape):
        v_map = F.interpolate(v_map, size=tuple(hw_shape), mode='bilinear', align_corners=False)
    if hasattr(module, 'dwc'):
        out = out + F.pad(module.dwc(v_map).reshape(B, C, N - P).transpose(1, 2), (0, 0, P, 0))
    if hasattr(module, 'get_v'):  # FLatten-CSwin's LePE, over all C channels of V
        lepe = module.get_v(v.transpose(-2, -1).reshape(B, C, grid[0], grid[1]))
        out = out + F.pad(lepe.reshape(B, C, N - P).transpose(1, 2), (0, 0, P, 0))
    return module.proj_drop(module.proj(out))
