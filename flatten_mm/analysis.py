"""Measuring models: FLOPs with mmengine's analyzer, and bytes saved for backward.

FLOPs follow the OpenMMLab convention (mmengine's ``FlopAnalyzer``, as
mmdet's ``get_flops.py``): one multiply-accumulate of a linear layer, matmul
or convolution counts as one FLOP, and element-wise work (activations,
normalisation, softmax) counts nothing. The two autograd functions of the
attention core get handles that count them the same way:

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
"""
from collections import Counter
from typing import Callable, Dict, Iterable, Tuple

import torch
from torch import Tensor, nn

#: element-wise operations of the focused mapping per element of q or k:
#: ReLU, +eps, x1/scale, square-accumulate for |a|, /|a|, the power (counted
#: as one), square-accumulate for |u|, and the final scaling by |a|/|u|.
FOCUS_OPS_PER_ELEMENT = 8


def _shape(value) -> Tuple[int, ...]:
    from mmengine.analysis.jit_handles import get_shape
    return tuple(get_shape(value))


def focused_linear_attention_flops(inputs, outputs) -> Counter:
    """mmengine FLOP handle for ``FocusedLinearAttentionFn``."""
    B, N, C = _shape(inputs[0])
    n = _shape(inputs[1])[1]
    num_heads = outputs[0].node().scalar_args()[1]
    d = C // num_heads
    return Counter({'focused_linear_attention':
                    B * (n * C * d + n * C + N * C + N * C * d)})


def depthwise_conv_flops(inputs, outputs) -> Counter:
    """mmengine FLOP handle for ``DepthwiseConvFn``."""
    B, C, H, W = _shape(outputs[0])
    k = _shape(inputs[1])[-1]
    return Counter({'conv': B * C * H * W * k * k})


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
    'prim::PythonOp.DepthwiseConvFn': depthwise_conv_flops,
}


def flop_analyzer(model: nn.Module, inputs):
    """An mmengine ``FlopAnalyzer`` that knows the attention core's ops."""
    from mmengine.analysis import FlopAnalyzer
    analyzer = FlopAnalyzer(model, inputs)
    analyzer.set_op_handle(**FLOP_HANDLES)
    analyzer.unsupported_ops_warnings(False)
    analyzer.uncalled_modules_warnings(False)
    return analyzer


def focusing_ops(model: nn.Module, forward: Callable[[], object]) -> int:
    """Element-wise operations of every focused mapping run by ``forward()``.

    Counts ``FOCUS_OPS_PER_ELEMENT`` per element of q and of k in each
    :class:`~flatten_mm.FocusedLinearAttention` of ``model``.
    """
    from .models.attention import FocusedLinearAttention
    total = 0

    def hook(module, args, kwargs, output):
        nonlocal total
        x = args[0]
        hw = args[1] if len(args) > 1 else kwargs['hw_shape']
        keys = x.shape[0] * x.shape[1]
        if module.sr_ratio > 1:
            keys = x.shape[0] * (-(-hw[0] // module.sr_ratio)) * (-(-hw[1] // module.sr_ratio))
        total += FOCUS_OPS_PER_ELEMENT * module.embed_dims * (x.shape[0] * x.shape[1] + keys)

    handles = [m.register_forward_hook(hook, with_kwargs=True)
               for m in model.modules() if isinstance(m, FocusedLinearAttention)]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    return total


def saved_tensor_bytes(fn: Callable[[], object],
                       exclude: Iterable[Tensor] = ()) -> Tuple[object, int]:
    """Run ``fn()`` and count the bytes autograd keeps for its backward.

    Unique storages of the tensors packed by autograd are summed once each
    (views of one tensor count once); storages of ``exclude`` (inputs and
    parameters) are left out.

    Returns:
        tuple: ``fn()``'s result and the byte count.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: Dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())

