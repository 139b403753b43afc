import os
import os.path as osp

import pytest
import torch

from demo_runs import ROOT, heavy_first, run, worker_threads

# Without CUDA the Triton kernels run under Triton's CPU interpreter. The switch
# must be on before triton is first imported (by any test, or by torch itself):
# triton's own library functions are decorated then, and decorated compiled
# functions cannot be called from interpreted kernels.
if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')

# Under pytest-xdist (`make test` runs `pytest -n 2`) the workers share the cores:
# each worker, and every script a test starts (it inherits OMP_NUM_THREADS), gets
# its share as torch's thread count, not the whole machine each.
_share = worker_threads(os.environ)
if _share is not None:
    os.environ['OMP_NUM_THREADS'] = str(_share)
    torch.set_num_threads(_share)


def pytest_collection_modifyitems(items):
    heavy_first(items)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:  # a tool run in-process set its own
        torch.set_num_threads(threads)


@pytest.fixture(scope='session')
def shapes(tmp_path_factory):
    """Tiny shapes data: 24 training and 6 validation images of 64x64."""
    out = tmp_path_factory.mktemp('shapes')
    run(osp.join(ROOT, 'tools/make_demo_data.py'), str(out), '--train', '24', '--val', '6',
        '--size', '64', cwd=ROOT)
    return str(out)
