"""tools/analysis_tools/fuzz_backbones.py: random cases pass against the
float64 reference formula, and a wrong CPU path is caught."""
import os.path as osp
import sys

import pytest

from demo_runs import ROOT

sys.path.insert(0, osp.join(ROOT, 'tools/analysis_tools'))
import fuzz_backbones  # noqa: E402


def test_random_cases_pass(capsys):
    assert fuzz_backbones.main(['--cases', '6', '--seed', '3']) == 0
    assert capsys.readouterr().out.splitlines()[-1] == '6 cases, 0 failed (seed 3, cpu)'


def test_a_wrong_cpu_path_is_caught(monkeypatch, capsys):
    """The CPU backends' results 20 % off: exactly the cases with focused
    linear (L) stages fail, the ones with softmax stages only pass."""
    import random
    from flatten_mm.models.ops import dispatch
    for op, backends in dispatch._BACKENDS.items():
        fn = backends['torch']

        def off(*args, _fn=fn, **kwargs):
            out = _fn(*args, **kwargs)
            return out * 1.2 if out is not None else out
        monkeypatch.setitem(backends, 'torch', off)
    rng = random.Random(3)
    linear = {i for i in range(6) if 'L' in fuzz_backbones.random_case(
        rng, ('pvt',))['kwargs']['attn_type']}
    assert 0 < len(linear) < 6
    assert fuzz_backbones.main(['--cases', '6', '--seed', '3', '--families', 'pvt']) == 1
    lines = capsys.readouterr().out.splitlines()
    assert {int(line.split()[1]) for line in lines[:-1]} == linear
    assert lines[-1] == f'6 cases, {len(linear)} failed (seed 3, cpu)'


def test_cases_are_drawn_from_every_family_and_mode():
    import random
    rng = random.Random(0)
    cases = [fuzz_backbones.random_case(rng) for _ in range(200)]
    assert {c['family'] for c in cases} == set(fuzz_backbones.FAMILIES)
    assert {c['mode'] for c in cases} == set(fuzz_backbones.MODES)
    assert {c['autocast'] for c in cases} == {True, False}
    for c in cases[:20]:  # every draw builds
        fuzz_backbones.build(c)


def test_a_non_finite_gradient_fails():
    """NaN would hide in Python's max: errors() counts it as inf."""
    import torch
    ref = ([torch.ones(3)], [('input', torch.ones(3)), ('a', torch.ones(3)), ('b', torch.ones(3))])
    got = ([torch.ones(3)], [('input', torch.ones(3)), ('a', torch.ones(3)),
                             ('b', torch.tensor([1., float('nan'), 1.]))])
    assert fuzz_backbones.errors(got, ref) == (0., float('inf'), 'b')
    got[0][0] = torch.tensor([float('nan'), 1., 1.])
    assert fuzz_backbones.errors(got, ref)[0] == float('inf')
