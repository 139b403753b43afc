from .attention import FocusedLinearAttention, focusing_map, linear_attention
from .backbones import FLattenCSwin, FLattenPVT, FLattenPVTv2, FLattenSwin

__all__ = ['FocusedLinearAttention', 'focusing_map', 'linear_attention',
           'FLattenPVT', 'FLattenPVTv2', 'FLattenSwin', 'FLattenCSwin']
