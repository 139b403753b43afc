import os
import os.path as osp

import pytest
import torch

# Without CUDA the Triton kernels run under Triton's CPU interpreter. The switch
# must be on before triton is first imported (by any test, or by torch itself):
# triton's own library functions are decorated then, and decorated compiled
# functions cannot be called from interpreted kernels.
if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

from demo_runs import ROOT, run


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope='session')
def shapes(tmp_path_factory):
    """Tiny shapes data: 24 training and 6 validation images of 64x64."""
    out = tmp_path_factory.mktemp('shapes')
    run(osp.join(ROOT, 'tools/make_demo_data.py'), str(out), '--train', '24', '--val', '6',
        '--size', '64', cwd=ROOT)
    return str(out)
