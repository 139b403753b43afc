"""Without CUDA, the Triton kernels of these tests run under Triton's CPU
interpreter. It must be switched on before the kernels are decorated: the
'triton' backend imports them on its first call, which comes after this."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')
