"""Randomised differential check of the backbones against the reference formula.

    python tools/analysis_tools/fuzz_backbones.py --seconds 300 --seed 1
    python tools/analysis_tools/fuzz_backbones.py --device cuda --seconds 150 --seed 1
    python tools/analysis_tools/fuzz_backbones.py --arch swin:tiny --size 800x1333
    TRITON_INTERPRET=1 python tools/analysis_tools/fuzz_backbones.py --backend triton --seed 1
    TRITON_INTERPRET=1 python tools/analysis_tools/fuzz_backbones.py --backend auto-interpreted

Each case draws a family (PVT, PVTv2, Swin, CSwin, DeiT) with a random small
configuration (attention type per stage, key reduction, windows, CSwin's
stripes, DeiT's patch size, class token, final norm and output type, DWC
kernel size, focusing factor, MLP ratio, 8, 16 or 24 channels per head; in 50 %
of cases the stages returned drawn at random, in 30 % frozen stages and
``norm_eval``, in 30 % another attention design, in 30 % a pretraining size of
32-96; 1, 3 or 4 image channels, q/k/v biases or none), batch 1-3, an image of
1-90 pixels a side (from the patch size for DeiT), a mode (training, in 30 % of
cases with gradient checkpointing; inference under ``no_grad``,
``inference_mode``, or with gradients in eval mode, in 30 % of those with
dropout and drop-path rates, which it must skip), in 30 % of cases bf16 or fp16
autocast, in 10 % instead a model and images in bf16 or fp16 (``.half()`` or
``.bfloat16()``, as deployed), in 20 % the model and images in channels-last
layout (else in 15 % images with rows and columns swapped in memory), and in
30 % a first call on other images (at the same size or another, in any mode,
under autocast or not) followed by an in-place change of every parameter, as
an optimiser step or EMA update makes it; and in 10 % of cases the model
traced by torch.fx as timm's feature extractor traces it (:func:`fx_traced`),
its graphs run for both calls.

With ``--arch`` it checks one released architecture instead (its defaults,
batch 1, at ``--size``, 800x1333 unless given, in ``--mode`` and
``--precision``), in the same way.

It runs the model as users do (the backend chosen per call: the CPU path, or
Triton on CUDA; with ``--backend triton`` the Triton kernels on every device, on
CPU under Triton's interpreter (``TRITON_INTERPRET=1``, read when triton is
imported): the GPU's path in every draw, without a GPU; with ``--backend
auto-interpreted`` per call as on a GPU, on CPU under the interpreter: the kernels
where a GPU takes them, each configuration's first call checked against the
torch backend) and the same weights
through the attention core's reference formula in float64 on CPU (the rest of
the model in float64 too, contiguous, without the first call or checkpointing;
on CPU the DWC's add is the same torch code in both runs, on CUDA and with
``--backend triton`` the Triton kernels are checked against it). Under
``'auto'`` the kernels' first-use check runs again in every case, and a case
fails where it sends the process to the torch backend (a wrong kernel, or a
bound too tight for the case: a user would get a warning and the slower
path). It
compares the outputs, those of every attention layer (where an error shows that
the residual stream would hide) and, where gradients are taken, every gradient
(input included; relative to its norm plus 1e-3 of the largest, so that the
rounding of gradients that are zero in exact arithmetic, such as the scale's,
does not count). A case passes within three times the error of the reference
formula run in the same precision on the same device (fp32, autocast or half
weights) plus ``--tol`` for fp32 outputs, ten times that for fp32 gradients,
1e-2 in half precision: as close to exact as the plain formula is; and with
no output off by more than :data:`OUTPUT_CAP` whatever the reference formula's
error, which catches faults of code both runs share. Every case that fails (or raises where
float64 does not) is printed with what rebuilds it; the exit status is 1 if
any did.
"""
import argparse
import copy
import math
import os
import random
import sys
import time
import warnings
from typing import List, Optional, Tuple

import torch
from torch import nn

from flatten_mm import FLattenCSwin, FLattenDeiT, FLattenPVT, FLattenPVTv2, FLattenSwin
from flatten_mm.models.designs import DESIGNS
from flatten_mm.models.ops import triton_backend
from flatten_mm.models.ops.dispatch import use_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_backbone import parse_size  # noqa: E402

FAMILIES = ('pvt', 'pvtv2', 'swin', 'cswin', 'deit')
MODES = ('train', 'eval-nograd', 'eval-inference', 'eval-grad')
# bf16, fp16: the model in fp32 under autocast; -weights: the model and images
# in it, without autocast (``.bfloat16()`` / ``.half()``, as deployed)
PRECISIONS = ('fp32', 'bf16', 'fp16', 'bf16-weights', 'fp16-weights')
Named = List[Tuple[str, torch.Tensor]]
# the largest output error a case may have whatever the reference formula's own
# (a fault of code both share, such as a PyTorch kernel), in half precision
# (autocast or half weights) and in fp32: in bf16 the reference formula's
# worst attention layer of 6,753 random cases was 24 % off float64
OUTPUT_CAP = {True: 0.5, False: 1e-2}
AS_GPU = 'auto-interpreted'  # --backend: 'auto' taking the kernels for CPU tensors


def family_kwargs(rng: random.Random, family: str, width: int) -> dict:
    """Widths, heads, depths and the family's own options (key reductions,
    windows, stripes, patches, MLP ratios) of a small ``family`` model with
    ``width`` channels per head in its first stage."""
    ratio = rng.choice([1., 2., 4.])
    if family in ('pvt', 'pvtv2'):
        return dict(embed_dims=[width, 2 * width, 3 * width, 4 * width], num_heads=[1, 2, 3, 4],
                    depths=[1, 1, 1, 1], mlp_ratios=[ratio, 2 * ratio, ratio, ratio],
                    sr_ratios=[rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4]),
                               rng.choice([1, 2]), 1])
    if family == 'swin':
        return dict(embed_dims=width, num_heads=[1, 2, 2, 4], depths=[2, 2, 2, 2],
                    window_size=rng.choice([3, 4, 7]), linear_window=rng.choice([None, 5, 7]),
                    mlp_ratio=ratio)
    if family == 'cswin':
        return dict(embed_dims=2 * width, num_heads=[2, 2, 4, 4], depths=[1, 1, 1, 1],
                    split_size=[rng.randint(1, 7) for _ in range(3)] + [7], mlp_ratio=ratio)
    cls_token = rng.random() < 0.8
    return dict(embed_dims=2 * width, num_heads=2, depth=3, mlp_ratio=ratio,
                patch_size=rng.choice([8, 16, 16]), final_norm=rng.random() < 0.5,
                with_cls_token=cls_token, out_type=rng.choice(
                    ['featmap', 'featmap', 'cls_token'] if cls_token else ['featmap']))


def output_kwargs(rng: random.Random, num_stages: int) -> dict:
    """The stages returned (all, or a random increasing subset, counted from
    the first or the last), and in 30 % of cases frozen stages and
    ``norm_eval``."""
    kw: dict = {}
    if rng.random() < 0.5:
        picked = sorted(rng.sample(range(num_stages), rng.randint(1, num_stages)))
        kw['out_indices'] = [i - num_stages for i in picked] if rng.random() < 0.3 else picked
    if rng.random() < 0.3:
        kw.update(frozen_stages=rng.randint(0, num_stages), norm_eval=rng.random() < 0.5)
    return kw


def precision_dtypes(precision: str) -> Tuple[torch.dtype, Optional[torch.dtype]]:
    """The dtype of the model and images, and autocast's (None: off), of one
    of :data:`PRECISIONS`."""
    half = torch.float16 if precision.startswith('fp16') else torch.bfloat16
    if precision.endswith('-weights'):
        return half, None
    return torch.float32, None if precision == 'fp32' else half


def random_case(rng: random.Random, families=FAMILIES) -> dict:
    """A case's family, constructor arguments, input shape and layout, mode
    and precision."""
    family = rng.choice(families)
    kw = dict(kernel_size=rng.choice([0, 3, 5]), focusing_factor=rng.choice([1.5, 2, 3]),
              drop_path_rate=0.)
    stages = ''.join(rng.choice('LS') for _ in range(3 if family == 'deit' else 4))
    kw.update(family_kwargs(rng, family, width=rng.choice([8, 16, 24])))
    kw.update(output_kwargs(rng, len(stages)))
    if rng.random() < 0.3:
        kw['attn_design'] = rng.choice(sorted(DESIGNS))
    if rng.random() < 0.3:  # the grid of the positional encodings: resized, or not
        kw['pretrain_img_size'] = 16 * rng.randint(2, 6)
    kw.update(in_channels=rng.choice([3, 3, 3, 1, 4]), qkv_bias=rng.random() < 0.8)
    mode = rng.choice(MODES)
    kw['with_cp'] = mode == 'train' and rng.random() < 0.3
    if mode != 'train' and rng.random() < 0.3:  # dropouts, which inference must skip
        kw.update(drop_rate=rng.choice([.1, .5]), drop_path_rate=rng.choice([.1, .5]),
                  attn_drop_rate=rng.choice([0., .5]) if 'S' in stages else 0.)
    low = kw.get('patch_size', 1)
    size = (rng.randint(low, 90), rng.randint(low, 90))
    precision = rng.choices(PRECISIONS, weights=(12, 3, 3, 1, 1))[0]
    warm = None
    if rng.random() < 0.3:  # a first call, at this size or another, then new weights
        # (under autocast or not; a model in half precision, in its own only)
        dtype = precision_dtypes(precision)[0]
        autocasts = ('bf16', 'fp16') if dtype == torch.float32 else (precision[:4], )
        warm = dict(batch=rng.choice([1, 2, 3]), mode=rng.choice(MODES),
                    autocast=rng.choice((None, None) + autocasts),
                    size=size if rng.random() < 0.5 else (rng.randint(low, 90),
                                                          rng.randint(low, 90)))
    return dict(family=family, kwargs=dict(kw, attn_type=stages), batch=rng.choice([1, 2, 3]),
                size=size, mode=mode, precision=precision, channels_last=rng.random() < 0.2,
                transposed=rng.random() < 0.15, warm=warm,
                fx=rng.random() < 0.1)


def fx_traced(model: nn.Module) -> nn.Module:
    """``model`` as timm's torch.fx feature extractor runs it: traced with
    timm's leaf modules and functions (ours registered by flatten_mm), a graph
    for training and one for inference (torchvision's ``DualGraphModule``,
    which ``train()`` switches), each run at every size and precision."""
    from timm.layers import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import DualGraphModule
    leaves = tuple(get_notrace_modules())

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return isinstance(m, leaves) or super().is_leaf_module(m, qualname)
    training = model.training
    graphs = [Tracer(autowrap_functions=tuple(get_notrace_functions())).trace(model.train(mode))
              for mode in (True, False)]
    model.train(training)
    return DualGraphModule(model, *graphs, class_name=type(model).__name__).train(training)


def build(case: dict) -> nn.Module:
    cls = dict(pvt=FLattenPVT, pvtv2=FLattenPVTv2, swin=FLattenSwin, cswin=FLattenCSwin,
               deit=FLattenDeiT)[case['family']]
    with warnings.catch_warnings():  # that L stages skip attn_drop_rate: known
        warnings.filterwarnings('ignore', 'attn_drop_rate=', UserWarning)
        model = cls(**case['kwargs'])
    model.init_weights()
    return model


def call(model: nn.Module, x: torch.Tensor, mode: str, backend: str,
         autocast: Optional[torch.dtype]) -> Tuple[Named, Named]:
    """Outputs (float64, on CPU) of ``model`` for images ``x``, then those of
    its attention layers (every module whose class name ends in
    ``Attention``, the first call of each), and, where the mode takes them,
    the gradients of a fixed linear loss: the input's, then every
    parameter's; all by name. A layer's output shows an error the residual
    stream would hide: at these widths and initial weights an attention layer
    adds little to it."""
    model.train(mode == 'train')
    x = x.detach().clone().requires_grad_(mode in ('train', 'eval-grad'))
    context = (torch.inference_mode() if mode == 'eval-inference' else
               torch.no_grad() if mode == 'eval-nograd' else torch.enable_grad())
    layers: dict = {}

    def record(name: str):
        def hook(module, args, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            layers.setdefault(name, out.detach().double().cpu())
        return hook
    handles = [m.register_forward_hook(record(n)) for n, m in model.named_modules()
               if type(m).__name__.endswith('Attention')]
    try:
        with use_backend(backend), context, torch.autocast(
                x.device.type, autocast or torch.bfloat16, enabled=autocast is not None):
            outs = list(model(x))
    finally:
        for handle in handles:
            handle.remove()
    grads: Named = []
    if x.requires_grad:
        sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum()
            for o in outs).backward()
        grads = [('input', x.grad.double().cpu())] + sorted(  # (by name: an fx graph's
            (n, p.grad.double().cpu())  # modules are in the order the graph calls them)
            for n, p in model.named_parameters() if p.grad is not None)
    return ([(f'output {i}', o.detach().double().cpu()) for i, o in enumerate(outs)]
            + sorted(layers.items()), grads)


def run(model: nn.Module, x: torch.Tensor, mode: str, backend: str, dtype: torch.dtype,
        autocast: Optional[torch.dtype], device: str, steps: Optional[dict] = None,
        first: Optional[tuple] = None) -> Tuple[Named, Named]:
    """:func:`call` on a copy of ``model`` in ``dtype`` on ``device``. With
    ``first`` (images, mode, autocast), the copy first runs on those images;
    with ``steps`` (a tensor per parameter name), its parameters then change
    in place by them, as an optimiser or EMA updates them: what the first call
    cached must not leak into the second."""
    model = copy.deepcopy(model).to(device, dtype)
    if first is not None:
        images, first_mode, first_autocast = first
        call(model, images.to(device, dtype), first_mode, backend, first_autocast)
    if steps is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.grad = None
                p.add_(steps[name].to(p))
    return call(model, x.to(device, dtype), mode, backend, autocast)


def relative(a: torch.Tensor, b: torch.Tensor, floor: float = 0.) -> float:
    """|a - b| / (|b| + floor), inf where it is not finite (NaN would hide in max)."""
    err = ((a - b).norm() / (b.norm() + floor).clamp_min(1e-30)).item()
    return err if math.isfinite(err) else math.inf


def largest(got: Named, ref: Named, floor: float = 0.) -> Tuple[float, str]:
    """The largest relative error among tensors named alike, and the name."""
    if [n for n, _ in got] != [n for n, _ in ref]:
        return math.inf, 'the set of tensors'
    errs = [relative(a, b, floor) for (_, a), (_, b) in zip(got, ref)]
    worst = max(range(len(errs)), key=lambda i: errs[i])
    return errs[worst], ref[worst][0]


def errors(got: tuple, ref: tuple) -> Tuple[float, str, float, str]:
    """The largest relative error of the outputs (the model's and its
    attention layers') and of the gradients (see the module's docstring),
    each with the name of the tensor that has it."""
    out, out_name = largest(got[0], ref[0])
    if not ref[1]:
        return out, out_name, 0., ''
    return (out, out_name) + largest(got[1], ref[1],
                                     1e-3 * max(g.norm().item() for _, g in ref[1]))


def recorded_only(outputs: Tuple[Named, Named], names: set) -> Tuple[Named, Named]:
    """``outputs`` (as :func:`call` returns them) without the attention
    layers' outputs not in ``names``; the model's outputs all stay."""
    kept = [(n, t) for n, t in outputs[0] if n in names or n.startswith('output ')]
    return kept, outputs[1]


def in_layout(case: dict, images: torch.Tensor) -> torch.Tensor:
    """``images`` as the case lays them out in memory: channels-last, or
    with rows and columns swapped (dense, not contiguous: what a pipeline
    that transposes images leaves), or contiguous."""
    if case.get('channels_last'):
        return images.contiguous(memory_format=torch.channels_last)
    if case.get('transposed'):
        return images.transpose(2, 3).contiguous().transpose(2, 3)
    return images


def users_run(model: nn.Module, x: torch.Tensor, mode: str, backend: str, *args
              ) -> Tuple[Tuple[Named, Named], str]:
    """:func:`run` of the user's model on ``backend``, and the warning of the
    kernels' first-use check, if it sent the process to the torch backend (''
    if not). Under ``'auto'`` that check runs again in every case, at each
    configuration's first call: a disagreement there (a wrong kernel, or a
    bound too tight for the case) fails the case, where a user would get the
    warning and the slower torch backend."""
    as_gpu = triton_backend.INTERPRETER_AS_GPU
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always', RuntimeWarning)
        if backend != 'triton':
            triton_backend.reset_first_use()
        as_gpu['on'] = backend == AS_GPU  # 'auto' takes the kernels for CPU tensors
        try:
            got = run(model, x, mode, 'auto' if backend == AS_GPU else backend, *args)
        finally:
            as_gpu['on'] = False
    left = [str(w.message) for w in caught if triton_backend.LEFT_FOR_TORCH in str(w.message)]
    for w in caught:  # the others, as they would have been shown
        if triton_backend.LEFT_FOR_TORCH not in str(w.message):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return got, left[0] if left else ''


def check_case(case: dict, device: str, tol: float, backend: str = 'auto') -> Optional[str]:
    """None if the case passes, else a line saying how it failed; the
    user's run on ``backend``."""
    model = build(case)
    x = torch.randn(case['batch'], case['kwargs'].get('in_channels', 3), *case['size'])
    mode, (dtype, autocast) = case['mode'], precision_dtypes(case['precision'])
    plain = copy.deepcopy(model)  # the reference runs without checkpointing, contiguous
    plain.with_cp = False
    steps = first = None
    warm = case.get('warm')
    if warm is not None:  # new weights for every run; the first call for the user's only
        steps = {n: 0.1 * torch.randn(p.shape, dtype=torch.float64) *
                 (p.detach().double().abs().mean() + 1e-3) for n, p in model.named_parameters()}
        first = (torch.randn(warm['batch'], x.shape[1], *warm['size']), warm['mode'],
                 precision_dtypes(warm['autocast'] or 'fp32')[1])
    try:
        ref = run(plain, x, mode, 'reference', torch.float64, None, 'cpu', steps)
    except Exception as e:  # noqa: BLE001  (nothing to compare with)
        return f'the reference formula in float64 raised {type(e).__name__}: {e}'
    if case.get('channels_last'):
        model = model.to(memory_format=torch.channels_last)
    x = in_layout(case, x)
    if first is not None:
        first = (in_layout(case, first[0]),) + first[1:]
    try:
        if case.get('fx'):
            model = fx_traced(model)
        got, left = users_run(model, x, mode, backend, dtype, autocast, device, steps, first)
        base = run(plain, x.contiguous(), mode, 'reference', dtype, autocast, device, steps)
    except Exception as e:  # noqa: BLE001  (a failure to report)
        return f'raised {type(e).__name__}: {e}'
    if left:
        return f'the first-use check left the kernels: {left}'
    if case.get('fx'):  # attention layers the trace inlined have no hook that records them
        ref, base = (recorded_only(r, {name for name, _ in got[0]}) for r in (ref, base))
    (out, out_name, grad, grad_name), base = errors(got, ref), errors(base, ref)
    low = case['precision'] != 'fp32'
    slack = (1e-2, 1e-2) if low else (tol, 10 * tol)
    if out <= min(3 * base[0] + slack[0], OUTPUT_CAP[low]) and \
            grad <= 3 * base[2] + slack[1]:
        return None
    grads = f', gradients {grad:.2e} ({grad_name})' if grad_name else ''
    return (f'{case["precision"]} outputs {out:.2e} ({out_name}){grads}; the '
            f'reference formula in that precision: {base[0]:.2e}' +
            (f', {base[2]:.2e}' if grad_name else ''))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--seconds', type=float, default=60., help='time to spend (default 60)')
    parser.add_argument('--cases', type=int, default=None, help='stop after this many cases')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--device', default='cpu', help='where the model runs (cpu, cuda)')
    parser.add_argument('--families', nargs='+', choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument('--backend', choices=('auto', 'triton', AS_GPU), default='auto',
                        help="the user's run: per call (default), the Triton kernels (on "
                        f"CPU under Triton's interpreter), or {AS_GPU}: per call as on a "
                        "GPU, on CPU under the interpreter")
    parser.add_argument('--tol', type=float, default=1e-4,
                        help='fp32 outputs\' slack; ten times this for gradients (default 1e-4)')
    one = parser.add_argument_group('one released architecture instead of random cases')
    one.add_argument('--arch', type=parse_arch, help='FAMILY:ARCH, e.g. swin:tiny, pvtv2:b0')
    one.add_argument('--size', type=parse_size, default=[800, 1333],
                     help='HxW (default 800x1333)')
    one.add_argument('--mode', choices=MODES, default='train')
    one.add_argument('--precision', choices=PRECISIONS, default='bf16',
                     help='bf16, fp16: autocast; -weights: the model in that type, '
                     'without autocast (default bf16)')
    return parser.parse_args(argv)


def parse_arch(text: str) -> Tuple[str, str]:
    family, _, arch = text.partition(':')
    if family not in FAMILIES or not arch:
        raise argparse.ArgumentTypeError(f'FAMILY:ARCH with FAMILY one of {FAMILIES}, e.g. '
                                         f'swin:tiny, got {text!r}')
    return family, arch


def arch_case(args: argparse.Namespace) -> dict:
    """The case of ``--arch``: a released architecture (its defaults, no
    drop path), batch 1, at ``--size`` in ``--mode`` and ``--precision``."""
    family, arch = args.arch
    return dict(family=family, kwargs=dict(arch=arch, drop_path_rate=0.), batch=1,
                size=tuple(args.size), mode=args.mode, precision=args.precision,
                channels_last=False, warm=None)


def check_backend(args: argparse.Namespace) -> None:
    """SystemExit where ``--backend`` cannot run as asked."""
    if args.backend != 'auto' and not triton_backend.AVAILABLE:
        raise SystemExit(f'--backend {args.backend}: triton does not import')
    on_cpu = not args.device.startswith('cuda')
    if args.backend == AS_GPU and not on_cpu:
        raise SystemExit(f'--backend {AS_GPU} runs on CPU; on a GPU --backend auto is the same')
    if on_cpu and args.backend != 'auto' and os.environ.get('TRITON_INTERPRET') != '1':
        raise SystemExit(f"--backend {args.backend} on a CPU runs Triton's interpreter: start "
                         "the tool with TRITON_INTERPRET=1 (triton reads it when it is imported)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith('cuda'):  # exact fp32 products, as the reference's
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    check_backend(args)
    where = args.device + ('' if args.backend == 'auto' else f', {args.backend}')
    if args.arch:
        torch.manual_seed(args.seed)
        case = arch_case(args)
        problem = check_case(case, args.device, args.tol, args.backend)
        print(f'{":".join(args.arch)} {"x".join(map(str, args.size))} {args.mode} '
              f'{args.precision}: {problem or "passed"} ({where})')
        return 1 if problem else 0
    rng, torch_seed = random.Random(args.seed), args.seed
    start, done, failed = time.perf_counter(), 0, 0
    while time.perf_counter() - start < args.seconds and (args.cases is None
                                                           or done < args.cases):
        case = random_case(rng, tuple(args.families))
        torch.manual_seed(torch_seed + done)
        problem = check_case(case, args.device, args.tol, args.backend)
        done += 1
        if problem is not None:
            failed += 1
            print(f'case {done - 1} (torch seed {torch_seed + done - 1}): {case}: {problem}',
                  flush=True)
    print(f'{done} cases, {failed} failed (seed {args.seed}, {where})')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
