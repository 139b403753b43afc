"""Whole layers on the 'triton' backend in random configurations (seeded),
against the same layer in float64 on the 'torch' backend.

The other tests take each feature on its own; here they meet: one head or
several of widths 8 to 64 (C up to 96), reduced keys, a class token, LePE,
0/3/5 DWC, odd grids from 1x1 to 9x9, key masks (an image with no real key
among them), inputs of several scales, focusing factors 1.5 to 6, fp32 and
bf16 autocast. Each output
and gradient (the input's, every parameter's) is within the dtype's tolerance
of float64 (test_triton.py's: 1e-4, bf16 3e-2), or no more than three times as
far from it as the torch backend in the same dtype: gradients that cancel (an
image without keys leaves q's eps-sized) are as noisy on both. Under the
interpreter the kernels take their interpreter tiling (16-token blocks, two a
program), so grids of over 32 tokens cross block and chunk borders.
"""
import random

import pytest
import torch

from flatten_mm.models import FocusedLinearAttention
from flatten_mm.models.ops import triton_backend as tb
from flatten_mm.models.ops import use_backend

pytestmark = pytest.mark.skipif(not tb.AVAILABLE, reason='triton does not import')

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
CASES = 24


def random_case(rng: random.Random) -> dict:
    """One layer configuration and its inputs."""
    h, d = rng.choice([1, 1, 2, 3, 4]), rng.choice([8, 16, 24, 32, 48, 64])
    d = min(d, 96 // h // 8 * 8)  # C <= 96: the interpreter's time grows with it
    H, W = rng.randint(1, 9), rng.randint(1, 9)
    sr = rng.choice([1, 1, 1, 2, 3])
    sr = sr if H >= sr and W >= sr else 1
    P = rng.choice([0, 0, 1]) if sr == 1 else 0
    case = dict(C=h * d, heads=h, sr=sr, k=rng.choice([0, 3, 5, 5]), P=P,
                p=rng.choice([3, 2, 6, 1.5]), pos=(rng.randint(1, 8), rng.randint(1, 8)),
                lepe=sr == 1 and rng.random() < 0.3, hw=(H, W), bf16=rng.random() < 0.3,
                seed=rng.randint(0, 10 ** 6))
    B = rng.randint(1, 3)
    case['x'] = torch.randn(B, P + H * W, h * d) * rng.choice([0.1, 1, 10])
    case['mask'] = None
    if sr == 1 and rng.random() < 0.4:
        mask = torch.rand(B, P + H * W) < 0.7
        if rng.random() < 0.3:
            mask[0] = False  # no real key
        case['mask'] = mask
    return case


def run(case: dict, backend: str, dtype: torch.dtype = torch.float32) -> dict:
    """Output, the input's and every parameter's gradient of the case's layer."""
    torch.manual_seed(case['seed'])
    layer = FocusedLinearAttention(case['C'], case['heads'], sr_ratio=case['sr'],
                                   kernel_size=case['k'], pos_grid=case['pos'], lepe=case['lepe'],
                                   num_prefix_tokens=case['P'], focusing_factor=case['p'])
    with torch.no_grad():
        layer.positional_encoding.normal_(0, 0.5)
        layer.scale.normal_(0, 0.5)
    layer = layer.to(DEVICE, dtype)
    x = case['x'].to(DEVICE, dtype).detach().clone().requires_grad_()
    mask = None if case['mask'] is None else case['mask'].to(DEVICE)
    autocast = case['bf16'] and dtype == torch.float32
    with use_backend(backend), torch.autocast(DEVICE, torch.bfloat16, enabled=autocast):
        out = layer(x, case['hw'], mask)
    g = torch.cos(torch.arange(out.numel(), device=DEVICE, dtype=torch.float64))
    (out * g.view_as(out).to(out.dtype)).sum().backward()
    found = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return dict(found, x=x.grad, out=out.detach())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize('index', range(CASES))
def test_random_layer_on_the_kernels_equals_float64(index):
    case = random_case(random.Random(1000 + index))
    ours, theirs = run(case, 'triton'), run(case, 'torch')
    truth = run(case, 'torch', torch.float64)
    assert set(ours) == set(truth), (set(ours) ^ set(truth), case)
    tol = 3e-2 if case['bf16'] else 1e-4
    errors = {name: (relative(ours[name], t), relative(theirs[name], t))
              for name, t in truth.items()}
    bad = {name: e for name, e in errors.items() if e[0] > tol and e[0] > 3 * e[1]}
    assert not bad, ({k: v for k, v in case.items() if k not in ('x', 'mask')}, bad)
