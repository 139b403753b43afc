"""Time one FocusedLinearAttention layer against the plain reference.

The reference (``flatten_mm.models.attention.reference_forward``) follows the
official op order; the fast path is the module's own forward. Both run on the
same module, weights and input, interleaved (fast, reference, fast, ...);
medians and ratios are reported, with the bytes autograd saves for backward
(unique storages, input and parameters excluded).

Example (the issue's two cases: stages 1 and 2 of an 800x1333 image)::

    python tools/analysis_tools/benchmark_attention.py --threads 2 \\
        --cases 200x334x64x1 100x167x128x2
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flatten_mm.analysis import saved_tensor_bytes  # noqa: E402
from flatten_mm.models.attention import FocusedLinearAttention, reference_forward  # noqa: E402


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
    x = torch.randn(1, H * W, C, device=device, dtype=dtype, requires_grad=args.mode == 'fwdbwd')
    paths = {'fast': lambda: module(x, (H, W)),
             'reference': lambda: reference_forward(module, x, (H, W))}

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
    with torch.no_grad():
        err = ((paths['fast']() - paths['reference']()).norm()
               / paths['reference']().norm()).item()
    row = dict(case=f'{H}x{W}x{C}x{heads}', mode=args.mode, dtype=str(dtype).split('.')[-1],
               device=str(device), threads=torch.get_num_threads(), rel_error=err)
    for name, fn in paths.items():
        row[f'{name}_ms'] = 1000 * statistics.median(times[name])
        if args.mode == 'fwdbwd':
            _, nbytes = saved_tensor_bytes(fn, [x, *module.parameters()])
            row[f'{name}_saved_MiB'] = nbytes / 2 ** 20
    row['time_ratio'] = row['fast_ms'] / row['reference_ms']
    if args.mode == 'fwdbwd':
        row['saved_ratio'] = row['fast_saved_MiB'] / row['reference_saved_MiB']
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--cases', nargs='+', type=parse_case,
                        default=[(200, 334, 64, 1), (100, 167, 128, 2)],
                        help='HxWxCxHEADS per case (default: stages 1 and 2 at 800x1333)')
    parser.add_argument('--mode', choices=['fwd', 'fwdbwd'], default='fwdbwd')
    parser.add_argument('--dtype', choices=['fp32', 'bf16', 'fp16'], default='fp32')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--threads', type=int, default=None, help='CPU threads (torch)')
    parser.add_argument('--sr-ratio', type=int, default=1)
    parser.add_argument('--pos-grid', type=int, default=56,
                        help='grid of the positional encoding (resized to each case)')
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--out', help='write the rows as JSON here')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)[args.dtype]
    rows = [run_case(*case, args, device, dtype) for case in args.cases]
    header = '| case HxWxCxh | mode | fast ms | reference ms | time ratio |'
    if args.mode == 'fwdbwd':
        header += ' fast saved MiB | reference saved MiB | saved ratio |'
    print(header)
    print('|' + '---|' * (header.count('|') - 1))
    for r in rows:
        line = (f"| {r['case']} | {r['mode']} | {r['fast_ms']:.0f} | {r['reference_ms']:.0f} "
                f"| {r['time_ratio']:.2f} |")
        if args.mode == 'fwdbwd':
            line += (f" {r['fast_saved_MiB']:.1f} | {r['reference_saved_MiB']:.1f} "
                     f"| {r['saved_ratio']:.2f} |")
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == '__main__':
    main()
