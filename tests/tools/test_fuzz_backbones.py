"""tools/analysis_tools/fuzz_backbones.py: random cases pass against the
float64 reference formula, and a wrong CPU path is caught."""
import os.path as osp
import sys

import pytest
import torch

from demo_runs import ROOT

sys.path.insert(0, osp.join(ROOT, 'tools/analysis_tools'))
import fuzz_backbones  # noqa: E402


def test_random_cases_pass(capsys):
    assert fuzz_backbones.main(['--cases', '6', '--seed', '3']) == 0
    assert capsys.readouterr().out.splitlines()[-1] == '6 cases, 0 failed (seed 3, cpu)'


def path_off(monkeypatch, backend: str = 'torch') -> None:
    """Every op's ``backend`` (``torch``: the CPU path) returns its results 20 % off."""
    from flatten_mm.models.ops import dispatch
    for backends in dispatch._BACKENDS.values():
        fn = backends[backend]

        def off(*args, _fn=fn, **kwargs):
            out = _fn(*args, **kwargs)
            return out * 1.2 if out is not None else out
        monkeypatch.setitem(backends, backend, off)


def linear_cases(seed: int, families=fuzz_backbones.FAMILIES, cases: int = 6) -> tuple:
    """Of the first ``cases`` cases ``seed`` draws, those with focused linear
    (L) stages, those of them in fp32 with FLatten's design (the attention op's;
    other designs take other ops), and those of them that take a Triton kernel:
    FLatten's design, or a design with a depth-wise conv on V (``kernel_size``
    above 0), whose add the Triton conv kernel makes."""
    import random
    from flatten_mm.models.designs import DESIGNS
    rng = random.Random(seed)
    drawn = [fuzz_backbones.random_case(rng, families) for _ in range(cases)]
    linear = {i for i, c in enumerate(drawn) if 'L' in c['kwargs']['attn_type']}
    design = {i: drawn[i]['kwargs'].get('attn_design', 'focused') for i in linear}
    kernels = {i for i in linear if design[i] == 'focused' or (
        DESIGNS[design[i]].dwc and drawn[i]['kwargs']['kernel_size'] > 0)}
    return linear, {i for i in linear if design[i] == 'focused'
                    and drawn[i]['precision'] == 'fp32'}, kernels


def test_a_wrong_cpu_path_is_caught(monkeypatch, capsys):
    """The CPU backends' results 20 % off: every fp32 case with focused
    linear (L) stages in the paper's design fails, no case with softmax stages
    only does. (A bf16 case fails only where the error shows above bf16's
    own: at these widths the attention adds little to the residual stream,
    and 20 % there moved the outputs of two bf16 cases by 0.2-0.6 %, bf16's
    rounding by 0.7-2 %.)"""
    path_off(monkeypatch)
    # the first seed from 89 that draws fp32 cases with L stages and a case
    # without (which seed does changes as the tool draws more)
    seed, (linear, fp32, _) = next((s, k) for s in range(89, 189)
                                for k in [linear_cases(s, ('pvt', ))]
                                if k[1] and k[0] < set(range(6)))
    assert fuzz_backbones.main(['--cases', '6', '--seed', str(seed), '--families', 'pvt']) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = {int(line.split()[1]) for line in lines[:-1]}
    assert fp32 <= failed <= linear
    assert lines[-1] == f'6 cases, {len(failed)} failed (seed {seed}, cpu)'


@pytest.mark.parametrize('wrong', [False, True])
def test_one_released_architecture(monkeypatch, capsys, wrong):
    """``--arch``: FLatten-PVT-T as released (here at 32x48), trained in
    fp32, passes; with the CPU path 20 % off it fails."""
    if wrong:
        path_off(monkeypatch)
    argv = ['--arch', 'pvt:tiny', '--size', '32x48', '--precision', 'fp32']
    assert fuzz_backbones.main(argv) == int(wrong)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith('pvt:tiny 32x48 train fp32: ')
    assert line.endswith('passed (cpu)') != wrong, line
    for bad, message in ((['--arch', 'vit:tiny'], "argument --arch: FAMILY:ARCH with"),
                         (['--arch', 'pvt:tiny', '--size', '64x'],
                          'argument --size: a size is S or HxW')):
        with pytest.raises(SystemExit):
            fuzz_backbones.main(bad)
        assert message in capsys.readouterr().err


# six small cases (the interpreter is slow) of four families: three in fp32 with
# L stages in FLatten's design and one trained in bf16 with checkpointing; which
# seed does changes as the tool draws more
TRITON_SEED = 203


@pytest.mark.parametrize('backend, fault', [('auto-interpreted', None), ('triton', 'off'),
                                            ('auto-interpreted', 'check')])
def test_the_triton_kernels_in_random_cases(monkeypatch, capsys, backend, fault):
    """The GPU's path (here under Triton's interpreter) in six random cases of
    four families (PVT, DeiT, Swin, PVTv2): ``--backend auto-interpreted`` (per
    call as on a GPU, each configuration's first call checked against the
    torch backend) passes them. With the Triton ops 20 % off (``--backend
    triton``: the kernels, unchecked) every fp32 case with L stages in FLatten's
    design fails, and no case without L stages does; where the first-use check
    sends the process to the torch backend (every check's bound below zero),
    exactly the cases with L stages that take a kernel fail (FLatten's design,
    or another with a depth-wise conv on V), each saying so."""
    from flatten_mm.models.ops import triton_backend
    if not triton_backend.AVAILABLE:
        pytest.skip('triton does not import')
    if fault == 'off':
        path_off(monkeypatch, 'triton')
    if fault == 'check':
        monkeypatch.setattr(triton_backend, 'AGREE_TOL',
                            dict.fromkeys(triton_backend.AGREE_TOL, -1.))
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if device == 'cuda' and backend != 'triton':
        backend = 'auto'  # the same on a GPU
    argv = ['--cases', '6', '--seconds', '1e9', '--seed', str(TRITON_SEED), '--backend', backend,
            '--device', device]
    assert fuzz_backbones.main(argv) == int(fault is not None)
    lines = capsys.readouterr().out.splitlines()
    failed = {int(line.split()[1]) for line in lines[:-1]}
    linear, fp32, kernels = linear_cases(TRITON_SEED)
    assert len(fp32) >= 3 and len(kernels) > len(fp32)  # (half precision too)
    assert fp32 <= failed <= linear if fault == 'off' else \
        failed == (kernels if fault else set())
    assert ['first-use check left the kernels' in line for line in lines[:-1]] == \
        [fault == 'check'] * len(failed)
    assert not triton_backend.INTERPRETER_AS_GPU['on']  # for these cases only
    where = f'{device}{", " + backend if backend != "auto" else ""}'
    assert lines[-1] == f'6 cases, {len(failed)} failed (seed {TRITON_SEED}, {where})'


def test_cases_are_drawn_from_every_family_and_mode():
    import random
    from flatten_mm.models.designs import DESIGNS
    rng = random.Random(0)
    cases = [fuzz_backbones.random_case(rng) for _ in range(300)]
    assert {c['family'] for c in cases} == set(fuzz_backbones.FAMILIES)
    assert {c['mode'] for c in cases} == set(fuzz_backbones.MODES)
    assert {c['precision'] for c in cases} == set(fuzz_backbones.PRECISIONS)
    assert {c['warm']['autocast'] for c in cases if c['warm']} == {None, 'bf16', 'fp16'}
    half_models = [c for c in cases if c['warm'] and c['precision'].endswith('-weights')]
    assert half_models and all(  # a model in half precision: its own autocast only
        c['warm']['autocast'] in (None, c['precision'][:4]) for c in half_models)
    assert {c['channels_last'] for c in cases} == {True, False}
    assert {c['transposed'] for c in cases if not c['channels_last']} == {True, False}
    assert {c['kwargs']['with_cp'] for c in cases} == {True, False}
    assert {c['kwargs']['with_cp'] for c in cases if c['mode'] != 'train'} == {False}
    assert {c['warm'] is None for c in cases} == {True, False}
    assert {c['fx'] for c in cases} == {True, False}
    assert any(c['fx'] and c['kwargs']['with_cp'] for c in cases)
    assert {c['kwargs'].get('attn_design', 'focused') for c in cases} == set(DESIGNS)
    assert {c['kwargs']['in_channels'] for c in cases} == {1, 3, 4}
    assert {c['kwargs']['qkv_bias'] for c in cases} == {True, False}
    assert {'pretrain_img_size' in c['kwargs'] for c in cases} == {True, False}
    assert {c['kwargs'].get('frozen_stages', -1) for c in cases} == {-1, 0, 1, 2, 3, 4}
    assert {c['kwargs'].get('norm_eval', False) for c in cases} == {True, False}
    assert {c['kwargs']['drop_path_rate'] > 0 for c in cases} == {True, False}
    assert {c['mode'] for c in cases if c['kwargs']['drop_path_rate'] > 0} == set(
        fuzz_backbones.MODES) - {'train'}
    assert {min(c['kwargs'].get('out_indices', [0])) < 0 for c in cases} == {True, False}
    assert {len(c['kwargs'].get('out_indices', [])) for c in cases} == {0, 1, 2, 3, 4}
    deit = [c['kwargs'] for c in cases if c['family'] == 'deit']
    assert {k['patch_size'] for k in deit} == {8, 16}
    assert {(k['with_cls_token'], k['out_type']) for k in deit} == {
        (True, 'cls_token'), (True, 'featmap'), (False, 'featmap')}
    assert {k['final_norm'] for k in deit} == {True, False}
    assert min(min(c['size']) for c in cases if c['family'] == 'deit') < 16
    assert {s for c in cases if c['family'] == 'cswin'
            for s in c['kwargs']['split_size'][:3]} == set(range(1, 8))
    assert {c['kwargs'].get('mlp_ratio', c['kwargs'].get('mlp_ratios', [1])[0])
            for c in cases} == {1., 2., 4.}
    for c in cases[:20]:  # every draw builds
        fuzz_backbones.build(c)


def test_a_non_finite_gradient_fails():
    """NaN would hide in Python's max: errors() counts it as inf."""
    ref = ([('output 0', torch.ones(3))],
           [('input', torch.ones(3)), ('a', torch.ones(3)), ('b', torch.ones(3))])
    got = ([('output 0', torch.ones(3))], [('input', torch.ones(3)), ('a', torch.ones(3)),
                                           ('b', torch.tensor([1., float('nan'), 1.]))])
    assert fuzz_backbones.errors(got, ref) == (0., 'output 0', float('inf'), 'b')
    got[0][0] = ('output 0', torch.tensor([float('nan'), 1., 1.]))
    assert fuzz_backbones.errors(got, ref)[:2] == (float('inf'), 'output 0')


@pytest.mark.parametrize('autocast', [False, True])
def test_a_fault_of_shared_code_is_caught(monkeypatch, autocast):
    """A fault in code the reference formula runs too (here PVT's key
    reduction's channels reversed under bf16 autocast, as a PyTorch kernel
    could go wrong) hides in the model's outputs and in the comparison with the
    reference formula in the same precision. The attention layer's own
    output shows it, over the cap on output errors."""
    from flatten_mm.models import utils
    plain = utils.strided_conv

    def reversed_in_bf16(conv, x):
        out = plain(conv, x)
        return out.flip(1) if torch.is_autocast_enabled('cpu') else out
    monkeypatch.setattr(utils, 'strided_conv', reversed_in_bf16)
    case = dict(family='pvt', batch=2, size=(40, 24), mode='eval-nograd',
                precision='bf16' if autocast else 'fp32',
                channels_last=False, warm=None, kwargs=dict(
                    embed_dims=[16, 32, 48, 64], num_heads=[1, 2, 3, 4], depths=[1, 1, 1, 1],
                    sr_ratios=[8, 4, 2, 1], attn_type='SSSS', drop_path_rate=0.))
    problem = fuzz_backbones.check_case(case, 'cpu', 1e-4)
    if not autocast:
        assert problem is None
        return
    words = problem.split()
    assert words[:2] == ['bf16', 'outputs'] and words[3] == '(block1.0.attn);', problem
    assert float(words[2]) > fuzz_backbones.OUTPUT_CAP[True]
    assert float(words[-1]) > fuzz_backbones.OUTPUT_CAP[True]  # the reference formula's too


@pytest.mark.parametrize('fx,fault_in_graphs', [(False, True), (True, True), (True, False)])
def test_a_fault_of_fx_graphs_is_caught(monkeypatch, fx, fault_in_graphs):
    """A case traced as timm's fx feature extractor traces runs the graph:
    CSwin's merges reversing their channels in fx graphs only fail the traced
    case and not the eager one. Without that fault the traced case passes, in
    bf16 at an input 8 pixels wide (graphs once kept the plain merge conv
    there, whose weight gradients PyTorch's CPU bf16 kernel gets wrong: NaN,
    inf or huge in most runs, not in all, so that fault is not the one made
    here)."""
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing
    from flatten_mm.models import utils
    from flatten_mm.models.backbones import flatten_cswin

    def reversed_in_graphs(conv, x):
        out = utils.strided_conv(conv, x)
        return out.flip(1) if is_fx_symbolic_tracing() else out
    if fault_in_graphs:
        monkeypatch.setattr(flatten_cswin, 'strided_conv', reversed_in_graphs)
    case = dict(family='cswin', batch=2, size=(64, 8), mode='train', precision='bf16',
                channels_last=False, warm=None, fx=fx, kwargs=dict(
                    embed_dims=16, num_heads=[2, 2, 4, 4], depths=[1, 1, 1, 1],
                    attn_type='LLLS', drop_path_rate=0.))
    problem = fuzz_backbones.check_case(case, 'cpu', 1e-4)
    if fx and fault_in_graphs:
        words = (problem or '').split()
        assert words[:2] == ['bf16', 'outputs'] and float(words[2]) > 0.1, problem
    else:
        assert problem is None, problem


@pytest.mark.parametrize('stale', [False, True])
def test_a_cache_that_outlives_new_weights_is_caught(monkeypatch, stale):
    """A first call at the case's size caches PVT's resized positional
    encodings (inference on CPU); the weights then change in place. The case
    passes, and fails where the cache ignores the new values."""
    from flatten_mm.models import layers, resize, utils
    if stale:
        def by_key_only(module, key, make, params):
            return utils.size_cached(module, ('by key only', key), make)
        for module in (resize, layers):
            monkeypatch.setattr(module, 'param_cached', by_key_only)
    nograd = dict(batch=1, size=(40, 40), mode='eval-nograd')
    case = dict(nograd, precision='fp32', family='pvt', channels_last=False,
                warm=dict(nograd, autocast=None), kwargs=dict(
        embed_dims=[8, 16, 24, 32], num_heads=[1, 2, 3, 4], depths=[1, 1, 1, 1],
        attn_type='LLLL', drop_path_rate=0.))
    problem = fuzz_backbones.check_case(case, 'cpu', 1e-4)
    assert (problem is not None) == stale, problem
    if stale:
        assert problem.startswith('fp32 outputs ')
        assert float(problem.split()[2].rstrip(',')) > 1e-3
