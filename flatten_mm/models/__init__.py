from .attention import FocusedLinearAttention
from .ops import focusing_map, linear_attention
from .backbones import FLattenCSwin, FLattenDeiT, FLattenPVT, FLattenPVTv2, FLattenSwin

__all__ = ['FocusedLinearAttention', 'focusing_map', 'linear_attention',
           'FLattenPVT', 'FLattenPVTv2', 'FLattenSwin', 'FLattenCSwin', 'FLattenDeiT']
