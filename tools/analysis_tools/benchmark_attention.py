"""Time one FocusedLinearAttention layer against the plain reference.

The reference (``flatten_mm.analysis.reference_forward``) follows the
official op order; the fast path is the module's own forward. All paths run on
the same module, weights and input, interleaved (fast, reference, fast, ...);
medians and ratios to the reference are reported, with the bytes autograd
saves for backward (unique storages, input and parameters excluded) and the
relative error of the output. ``--variants fast-torch fast-triton`` force
the core's backend (``fast`` lets it choose: Triton for CUDA tensors,
PyTorch ops elsewhere). ``--variants autograd fast-conv2d two-ops`` adds the
ablations: the same formula left to autograd, the hand-written attention
with the DWC through ``F.conv2d``, and ``fast`` with the attention and its DWC
as two ops (the layer's ``fuse_local_term`` off: on CUDA what the one Triton
op saves). ``--variants projections`` times the
layer's projections alone (q, k, v as the layer forms them, and the output
projection): the floor of any attention layer with these projections (its
output is not the layer's, so it has no error column).

Example (the issue's two cases: stages 1 and 2 of an 800x1333 image)::

    python tools/analysis_tools/benchmark_attention.py --threads 2 \\
        --cases 200x334x64x1 100x167x128x2
"""
import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flatten_mm.analysis import saved_tensor_bytes  # noqa: E402
from flatten_mm.analysis import reference_forward  # noqa: E402
from flatten_mm.models.attention import FocusedLinearAttention  # noqa: E402
from flatten_mm.models.ops import focusing_map, linear_attention, use_backend  # noqa: E402
from flatten_mm.models.utils import map_to_tokens, tokens_to_map  # noqa: E402

# compute the layer's output; 'fast' lets the core choose its backend,
# 'fast-torch' / 'fast-triton' force one
EXACT = ('fast', 'fast-torch', 'fast-triton', 'reference', 'autograd', 'fast-conv2d',
         'two-ops')
VARIANTS = EXACT + ('projections',)


def torch_dwc(module, v, grid, hw_shape):
    """The DWC through F.conv2d (autograd's own backward) on the same
    channels-last view of V as the module's."""
    C = v.shape[2]
    v_map = tokens_to_map(v, grid)
    if tuple(grid) != tuple(hw_shape):
        v_map = F.interpolate(v_map, size=tuple(hw_shape), mode='bilinear', align_corners=False)
    weight = module.dwc.weight.repeat(module.num_heads, 1, 1, 1)
    bias = module.dwc.bias.repeat(module.num_heads)
    return map_to_tokens(F.conv2d(v_map, weight, bias, padding=module.kernel_size // 2,
                                  groups=C))


def autograd_forward(module, x, hw_shape):
    """The fast path's formula (focusing_map, linear_attention) left to
    autograd, with the DWC through F.conv2d: what the hand-written backward
    and DWC replace."""
    q, k, v, grid = module.project_qkv(x, hw_shape)
    s = F.softplus(module.scale)
    p = module.focusing_factor
    out = linear_attention(focusing_map(q, s, p), focusing_map(k, s, p), v, module.num_heads)
    return module.proj(out + torch_dwc(module, v, grid, hw_shape))


def fast_conv2d_forward(module, x, hw_shape):
    """The hand-written attention with the DWC through F.conv2d."""
    q, k, v, grid = module.project_qkv(x, hw_shape)
    out = module.attend(q, k, v, None)
    return module.proj(out + torch_dwc(module, v, grid, hw_shape))


def two_ops_layer(module):
    """A shallow copy of the module (its parameters and submodules shared) whose
    attention and DWC run as two ops; made once, outside the timed (and perhaps
    compiled) step."""
    two = copy.copy(module)
    two.fuse_local_term = False
    return two


def backend_forward(module, x, hw_shape, backend):
    """The module's forward with the attention core on one backend."""
    with use_backend(backend):
        return module(x, hw_shape)


def projections_forward(module, x, hw_shape):
    """The layer's own q/k/v step (``project_qkv``: the key reduction, if
    any, and the positional encoding included) and its output projection, no
    attention between them: proj(q + mean of k + v over the keys)."""
    q, k, v, _ = module.project_qkv(x, hw_shape)
    return module.proj(q + (k + v).mean(1, keepdim=True))


def parse_case(text: str):
    try:
        H, W, C, heads = (int(v) for v in text.lower().split('x'))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'a case is HxWxCxHEADS, e.g. 200x334x64x1; got {text!r}') from None
    if min(H, W, C, heads) < 1 or C % heads:
        raise argparse.ArgumentTypeError(
            f'case {text!r}: sizes must be positive and C divisible by HEADS')
    return H, W, C, heads


def sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def run_case(H, W, C, heads, args, device, dtype):
    torch.manual_seed(0)
    module = FocusedLinearAttention(C, heads, sr_ratio=args.sr_ratio,
                                    pos_grid=args.pos_grid).to(device, dtype)
    with torch.no_grad():  # a trained-like scale and encoding, not zeros
        module.scale.normal_(0, 0.5)
        module.positional_encoding.normal_(0, 0.02)
    x = torch.randn(args.batch, H * W, C, device=device, dtype=dtype,
                    requires_grad=args.mode == 'fwdbwd')
    two_ops = two_ops_layer(module)
    every = {'fast': lambda: module(x, (H, W)),
             'reference': lambda: reference_forward(module, x, (H, W)),
             'autograd': lambda: autograd_forward(module, x, (H, W)),
             'fast-torch': lambda: backend_forward(module, x, (H, W), 'torch'),
             'fast-triton': lambda: backend_forward(module, x, (H, W), 'triton'),
             'fast-conv2d': lambda: fast_conv2d_forward(module, x, (H, W)),
             'two-ops': lambda: two_ops(x, (H, W)),
             'projections': lambda: projections_forward(module, x, (H, W))}
    paths = {name: every[name] for name in args.variants}
    if args.compile:  # compiled at the first (warm-up) step
        paths = {name: torch.compile(fn, backend=args.compile) for name, fn in paths.items()}

    def step(fn):
        if args.mode == 'fwd':
            with torch.no_grad():
                fn()
        else:
            fn().float().sum().backward()

    times = {name: [] for name in paths}
    for i in range(args.warmup + args.repeats):
        for name, fn in paths.items():
            sync(device)
            t0 = time.perf_counter()
            step(fn)
            sync(device)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    row = dict(case=f'{H}x{W}x{C}x{heads}', batch=args.batch, mode=args.mode,
               dtype=str(dtype).split('.')[-1], device=str(device),
               threads=torch.get_num_threads(), compiled=args.compile)
    with torch.no_grad():
        ref = every['reference']()
        for name in paths:
            if name in EXACT:
                row[f'{name}_rel_error'] = ((paths[name]() - ref).norm() / ref.norm()).item()
    for name, fn in paths.items():
        row[f'{name}_ms'] = 1000 * statistics.median(times[name])
        row[f'{name}_time_ratio'] = row[f'{name}_ms'] / (1000 * statistics.median(times['reference']))
        if args.mode == 'fwdbwd':
            _, nbytes = saved_tensor_bytes(fn, [x, *module.parameters()])
            row[f'{name}_saved_MiB'] = nbytes / 2 ** 20
    if args.mode == 'fwdbwd':
        for name in paths:
            row[f'{name}_saved_ratio'] = row[f'{name}_saved_MiB'] / row['reference_saved_MiB']
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--cases', nargs='+', type=parse_case,
                        default=[(200, 334, 64, 1), (100, 167, 128, 2)],
                        help='HxWxCxHEADS per case (default: stages 1 and 2 at 800x1333)')
    parser.add_argument('--mode', choices=['fwd', 'fwdbwd'], default='fwdbwd')
    parser.add_argument('--dtype', choices=['fp32', 'bf16', 'fp16'], default='fp32')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--batch', type=int, default=1, help='images per step')
    parser.add_argument('--threads', type=int, default=None, help='CPU threads (torch)')
    parser.add_argument('--sr-ratio', type=int, default=1)
    parser.add_argument('--pos-grid', type=int, default=56,
                        help='grid of the positional encoding (resized to each case)')
    parser.add_argument('--warmup', type=int, default=1,
                        help='untimed steps first (with --compile: the compilation)')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--compile', nargs='?', const='inductor', metavar='BACKEND',
                        help='torch.compile every path (the reference too) before timing, with '
                        'BACKEND (default: inductor)')
    parser.add_argument('--variants', nargs='+', choices=VARIANTS, default=['fast', 'reference'],
                        help='paths to time; the reference always runs. autograd: the same '
                        'formula left to autograd; fast-conv2d: the DWC through F.conv2d; '
                        'projections: the layer\'s projections alone (project_qkv and proj)')
    parser.add_argument('--out', help='write the rows as JSON here')
    args = parser.parse_args(argv)
    args.variants = list(dict.fromkeys(['reference'] + args.variants))
    if args.compile and args.warmup < 1:
        parser.error('--compile needs --warmup >= 1 (the first step compiles)')
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)[args.dtype]
    rows = [run_case(*case, args, device, dtype) for case in args.cases]
    fwdbwd = args.mode == 'fwdbwd'
    header = '| case HxWxCxh | path | ms | x reference |' + (
        ' saved MiB | x reference |' if fwdbwd else '') + ' rel. error |'
    print(header)
    print('|' + '---|' * (header.count('|') - 1))
    for r in rows:
        for name in args.variants:
            line = (f"| {r['case']} | {name} | {r[f'{name}_ms']:.0f} "
                    f"| {r[f'{name}_time_ratio']:.2f} |")
            if fwdbwd:
                line += f" {r[f'{name}_saved_MiB']:.1f} | {r[f'{name}_saved_ratio']:.2f} |"
            error = r.get(f'{name}_rel_error')
            print(line + (' - |' if error is None else f' {error:.1e} |'))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == '__main__':
    main()
