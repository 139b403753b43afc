"""Check that ``torch.compile(model, fullgraph=True)`` trains a backbone at real
sizes: one graph per image size and no graph break, the same outputs and
gradients as eager, and the compiled step's time next to eager's.

    python tools/analysis_tools/check_compile.py --device cuda --dtype bf16 \\
        --models flatten-swin-t flatten-pvt-t flatten-pvtv2-b1 flatten-cswin-t \\
        --sizes 800x1333 800x1216 --out compile.json

Per model (``benchmark_backbone.py``'s names, ``timm:NAME`` included), in
training mode with its stochastic depth on: an eager step, then the compiled
model trained once at each size in turn and once more at the first (which must
reuse the first graph), then ``--iters`` warm steps of each, interleaved. The
outputs and the gradients of all parameters (as one vector) are then compared
with eager on the same weights, drop-path rates set to 0. A model passes with
as many graphs as distinct sizes, no graph break and, in fp32, relative errors
within ``--tol``. In bf16/fp16 two roundings of one step differ by about the
precision's own error (eager bf16 against fp32: up to 1.4e-2 in the outputs,
3.7e-2 in the gradients of the small models), so there the compiled step is
compared with an fp32 eager step and passes when its error is within
``--tol-factor`` times eager's. The exit status is 1 if any model fails.
"""
import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_backbone import (build_model, check_model_names, model_outputs,  # noqa: E402
                                parse_size)

DTYPES = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)


def train_step(model, x: torch.Tensor, dtype: torch.dtype) -> tuple:
    """Forward under autocast (if not fp32) and backward; (seconds, outputs)."""
    model.zero_grad(set_to_none=True)
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
        outs = model_outputs(model(x))
    sum(o.float().pow(2).mean() for o in outs).backward()
    if x.is_cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start, [o.detach().float() for o in outs]


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().double().flatten() for p in model.parameters()
                      if p.grad is not None])


def errors(got: tuple, ref: tuple) -> tuple:
    """Largest output and the all-gradient relative errors of one (outputs,
    gradients) step against another."""
    return (max(relative_error(g, r) for g, r in zip(got[0], ref[0])),
            relative_error(got[1], ref[1]))


def compare_to_eager(model, compiled, x: torch.Tensor, dtype: torch.dtype) -> dict:
    """Output and all-gradient relative errors of compiled against eager, drop
    paths off (every ``drop_prob`` set to 0: the same weights, no randomness);
    in half precision also both steps' errors against an fp32 eager step."""
    for m in model.modules():
        if hasattr(m, 'drop_prob'):
            m.drop_prob = 0.0

    def step(module, step_dtype):
        outs = train_step(module, x, step_dtype)[1]
        return outs, gradients(model)
    ref, got = step(model, dtype), step(compiled, dtype)
    output_error, grad_error = errors(got, ref)
    row = dict(output_error=output_error, grad_error=grad_error)
    if dtype != torch.float32:
        fp32 = step(model, torch.float32)
        row.update(eager_error_fp32=max(errors(ref, fp32)),
                   compiled_error_fp32=max(errors(got, fp32)))
    return row


def within_tolerance(row: dict, args: argparse.Namespace) -> bool:
    """fp32: compiled within ``--tol`` of eager; half precision: compiled as
    close to fp32 as eager is, within ``--tol-factor``."""
    if 'compiled_error_fp32' in row:
        return row['compiled_error_fp32'] <= args.tol_factor * row['eager_error_fp32']
    return max(row['output_error'], row['grad_error']) <= args.tol


def check_model(name: str, args: argparse.Namespace) -> dict:
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    model = build_model(name).to(device).train()
    images = [torch.randn(args.batch, 3, *size, device=device) for size in args.sizes]
    row = dict(model=name, device=args.device, dtype=args.dtype, batch=args.batch,
               sizes=['x'.join(map(str, s)) for s in args.sizes], backend=args.backend)
    train_step(model, images[0], dtype)  # warm-up
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend=args.backend)
    row['first_steps_s'] = [train_step(compiled, x, dtype)[0] for x in images + images[:1]]
    eager, fast = [], []
    for _ in range(args.iters):
        eager.append(train_step(model, images[0], dtype)[0])
        fast.append(train_step(compiled, images[0], dtype)[0])
    row.update(eager_step_s=statistics.median(eager), compiled_step_s=statistics.median(fast),
               graphs=counters['stats'].get('unique_graphs', 0),
               graph_breaks=sum(counters['graph_break'].values()))
    row.update(compare_to_eager(model, compiled, images[0], dtype))
    distinct = len({tuple(s) for s in args.sizes})
    row['ok'] = row['graphs'] == distinct and row['graph_breaks'] == 0 and \
        within_tolerance(row, args)
    return row


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=['flatten-swin-t', 'flatten-pvt-t'])
    parser.add_argument('--sizes', nargs='+', type=parse_size,
                        default=[[800, 1333], [800, 1216]])
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--dtype', choices=sorted(DTYPES), default='fp32')
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--iters', type=int, default=3, help='warm steps of each, interleaved')
    parser.add_argument('--backend', default='inductor', help="torch.compile's backend")
    parser.add_argument('--tol', type=float, default=1e-4,
                        help='fp32: largest relative error against eager')
    parser.add_argument('--tol-factor', type=float, default=1.5,
                        help="bf16/fp16: largest error against fp32 as a multiple of eager's")
    parser.add_argument('--out', help='write the rows here as JSON')
    args = parser.parse_args(argv)
    check_model_names(parser, args.models)
    return args


def main(argv=None) -> list:
    args = parse_args(argv)
    rows = []
    for name in args.models:
        try:
            row = check_model(name, args)
        except Exception as err:  # noqa: BLE001 (reported, then the next model)
            row = dict(model=name, ok=False, error=traceback.format_exc(limit=-3),
                       error_type=type(err).__name__)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print('| model | graphs | breaks | first steps (s) | eager (s) | compiled (s) | '
          'output err | grad err | vs fp32: compiled / eager | ok |')
    print('|---|---|---|---|---|---|---|---|---|---|')
    for r in rows:
        if 'error' in r:
            print(f"| {r['model']} | - | - | - | - | - | - | - | - | {r['error_type']} |")
            continue
        fp32 = f"{r['compiled_error_fp32']:.1e} / {r['eager_error_fp32']:.1e}" \
            if 'eager_error_fp32' in r else '-'
        print(f"| {r['model']} | {r['graphs']} | {r['graph_breaks']} | "
              f"{' / '.join(f'{t:.1f}' for t in r['first_steps_s'])} | "
              f"{r['eager_step_s']:.3f} | {r['compiled_step_s']:.3f} | "
              f"{r['output_error']:.1e} | {r['grad_error']:.1e} | {fp32} | {r['ok']} |")
    if not all(r['ok'] for r in rows):
        sys.exit(1)
    return rows


if __name__ == '__main__':
    main()
