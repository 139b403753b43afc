from .flatten_cswin import FLattenCSwin
from .flatten_deit import FLattenDeiT
from .flatten_pvt import FLattenPVT, FLattenPVTv2
from .flatten_swin import FLattenSwin

__all__ = ['FLattenPVT', 'FLattenPVTv2', 'FLattenSwin', 'FLattenCSwin', 'FLattenDeiT']
