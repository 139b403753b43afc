from .attention import FocusedLinearAttention, focusing_map, linear_attention
from .backbones import FLattenPVT, FLattenPVTv2, FLattenSwin

__all__ = ['FocusedLinearAttention', 'focusing_map', 'linear_attention',
           'FLattenPVT', 'FLattenPVTv2', 'FLattenSwin']
