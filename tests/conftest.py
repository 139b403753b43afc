import os.path as osp

import pytest
import torch

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
