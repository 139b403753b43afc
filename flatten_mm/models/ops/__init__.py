"""The attention core: one op (:func:`focused_linear_attention`) with backends,
and the other hand-written autograd functions of the layers.

Layout: ``reference`` (the formula), ``autograd`` (the PyTorch-ops backend),
``dispatch`` (the entry point and the backend switch), ``triton_backend`` and
``triton_kernels`` (fused Triton kernels, registered when triton imports),
``triton_conv`` and ``triton_conv_kernels`` (the fused out + DWC(V) on CUDA),
``local`` and ``triton_fused`` (the attention and the DWC(V) term as one call,
fused on CUDA), ``conv`` and ``mlp`` (the DWC and the chunked token MLP).
"""
from .autograd import FocusedLinearAttentionFn
from .conv import DepthwiseConvFn, depthwise_conv, depthwise_conv_add
from .dispatch import (available_backends, choose_backend, focused_linear_attention,
                       get_backend, in_fp32, register_backend, set_backend, use_backend)
from .dispatch import apply_environment as _apply_environment
from .local import attention_with_local_term
from .mlp import MLP_CHUNK_ROWS, TokenMlpFn, token_mlp
from .reference import EPS, focusing_map, linear_attention

from . import triton_backend  # noqa: F401  (registers 'triton' where triton is installed)
from . import triton_conv  # noqa: F401  (and its fused depth-wise conv)
from . import triton_fused  # noqa: F401  (and both as one op)

_apply_environment()

__all__ = [
    'EPS', 'focusing_map', 'linear_attention', 'focused_linear_attention', 'set_backend',
    'get_backend', 'use_backend', 'available_backends', 'choose_backend', 'register_backend', 'in_fp32',
    'FocusedLinearAttentionFn', 'DepthwiseConvFn', 'depthwise_conv', 'depthwise_conv_add',
    'attention_with_local_term',
    'TokenMlpFn', 'token_mlp', 'MLP_CHUNK_ROWS'
]
