"""A time model of a GPU step, fitted on measured times: what the counted bytes
and FLOPs of a step predict, and how well they predicted the runs we have.

    python tools/analysis_tools/time_model.py \\
        --measured docs/benchmark_backbone_h200/results_batch8.csv \\
        docs/benchmark_backbone_h200/results_batch1.csv --rev-dir OLD_CHECKOUT \\
        --models flatten-swin-t swin-t flatten-pvt-t pvt-t --batch 8 --size 800x1333

Each case (model, size, batch, forward or training step, dtype) is counted on
fake CUDA tensors as ``trace_cuda.py --count-ops`` counts it (the forward as
``benchmark_backbone.py`` times it: eval mode, no gradients; the training
step: forward and backward of its loss; the Triton ops by their launches),
every op and launch kept: its bytes, FLOPs, and whether it computes in 16 bits.
The model's time of a case is

    max(host, gpu),  host = ops * C,
                     gpu = sum over ops of max(bytes / BW, FLOPs / F)

(F the 16-bit or fp32 matmul rate): the GPU is either waiting for the host to
launch its kernels (each eager op costs the host about C) or streaming bytes
and multiplying, one kernel after the other. BW, C and the two F are fitted
(a grid, least squares on the logarithm of the time) to the measured rows of
the softmax models in the ``--measured`` CSVs (``benchmark_backbone.py``'s
``results.csv``), whose code is mmdet's and the same today. The measured rows
of flatten models ran the flatten_mm of their day: ``--rev-dir`` names a
checkout of it (a ``git worktree`` of that commit: one from before the Triton
ops, or one with these), and the model's error on those rows, which it was
not fitted on, is the figure of merit. Those rows hold no Triton launch: that
a launch costs the host what an ATen op does is the model's assumption, not
tested by them (each counts as one op, with no FLOPs). The cases of
``--models`` at ``--batch``/``--size`` are then counted with this checkout
and predicted, each against its baseline. A model, not a measurement: what it
leaves out (kernels slower than their bytes, overlap of host and GPU) is in
the error it makes on the rows it was not fitted on.
"""
import argparse
import contextlib
import csv
import itertools
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

HERE = Path(__file__).resolve().parent
MODES = ('fwd', 'fwdbwd')
# the grid the parameters are fitted on: bandwidth (B/s), host seconds per op, 16-bit and
# fp32 matmul rates (FLOP/s)
GRID = dict(bw=[0.8e12 + 0.1e12 * i for i in range(23)],
            host=[20e-6 + 2e-6 * i for i in range(21)],
            half=[150e12, 250e12, 400e12, 600e12, 900e12],
            fp32=[15e12, 25e12, 35e12, 45e12, 55e12, 67e12])


class Params(NamedTuple):
    """The model's parameters: bandwidth (B/s), host seconds per op, 16-bit and
    fp32 matmul rates (FLOP/s)."""
    bw: float
    host: float
    half: float
    fp32: float


class Profile(NamedTuple):
    """A counted case: its ops (and launches), the bytes of those without
    FLOPs, and (bytes, FLOPs, half) of each with FLOPs."""
    ops: int
    plain_bytes: int
    matmuls: List[Tuple[int, int, bool]]


def profile_of(log: list) -> Profile:
    """The :class:`Profile` of a ``tally_ops`` log."""
    matmuls = [(b, f, half) for _, b, f, half in log if f]
    return Profile(len(log), sum(b for _, b, f, _ in log if not f), matmuls)


def gpu_s(profile: Profile, bw: float, half: float, fp32: float) -> float:
    """The GPU's seconds of ``profile``: each op by its bytes at ``bw`` or its
    FLOPs at the ``half`` or ``fp32`` rate, whichever takes longer."""
    return profile.plain_bytes / bw + sum(
        max(b / bw, f / (half if is_half else fp32)) for b, f, is_half in profile.matmuls)


def modeled_s(profile: Profile, p: Params) -> Tuple[float, float, float]:
    """(time, host, gpu) of ``profile`` under ``p``, in seconds."""
    gpu = gpu_s(profile, p.bw, p.half, p.fp32)
    host = profile.ops * p.host
    return max(host, gpu), host, gpu


def fit(pairs: List[Tuple[Profile, float]]) -> Tuple[Params, float]:
    """The :data:`GRID` point with the least root-mean-square error of
    log(modeled / measured) over (profile, measured seconds) ``pairs``, and that
    error (:func:`modeled_s`; the GPU's part once per point of the other three)."""
    best = None
    for bw, half, fp32 in itertools.product(GRID['bw'], GRID['half'], GRID['fp32']):
        gpus = [gpu_s(prof, bw, half, fp32) for prof, _ in pairs]
        for host in GRID['host']:
            err = math.sqrt(sum(math.log(max(prof.ops * host, gpu) / t) ** 2
                                for (prof, t), gpu in zip(pairs, gpus)) / len(pairs))
            if best is None or err < best[1]:
                best = (Params(bw, host, half, fp32), err)
    return best


def count_case(name: str, mode: str, dtype: str, batch: int, size: list) -> Profile:
    """The :class:`Profile` of one case, as the module docstring says."""
    import torch
    import trace_cuda
    from benchmark_backbone import training_loss
    from profile_backbone import tally_ops
    model, fake_mode = trace_cuda.fake_cuda_model(name, dtype)
    log = []
    with contextlib.ExitStack() as stack:
        inside = stack.enter_context(trace_cuda.counting_on_fake_gpu(fake_mode))
        x = torch.randn(batch, 3, *size, device='cuda')
        if mode == 'fwd':
            model.eval()
            stack.enter_context(torch.no_grad())
        model(x)  # fills the caches
        if mode == 'fwd':
            tally_ops(lambda: model(x), inside, log)
        else:
            losses = []
            tally_ops(lambda: losses.append(training_loss(model(x))), inside, log)
            tally_ops(lambda: trace_cuda.run_backward(losses[0]), inside, log)
    return profile_of(log)


def worker(spec: dict) -> list:
    """Count ``spec['cases']`` of one model, with ``spec['rev_dir']``'s
    flatten_mm if given: [[case key, profile], ...]."""
    if spec.get('rev_dir'):
        # imported first: the tools put this checkout on the path when imported
        sys.path.insert(0, spec['rev_dir'])
        import flatten_mm
        if Path(spec['rev_dir']).resolve() not in Path(flatten_mm.__file__).resolve().parents:
            raise ImportError(f"--rev-dir {spec['rev_dir']} has no flatten_mm package (found "
                              f'{flatten_mm.__file__})')
    sys.path.append(str(HERE))
    return [[key, count_case(*json.loads(key))] for key in spec['cases']]


def count_all(keys: List[str], rev_dir: Optional[str], jobs: int = 2
              ) -> Dict[str, Profile]:
    """Profiles of the case ``keys`` (JSON of (model, mode, dtype, batch,
    size)), one process a model (``jobs`` at a time): the flatten models
    counted with ``rev_dir``'s flatten_mm where given."""
    by_model = {}
    for key in keys:
        by_model.setdefault(json.loads(key)[0], []).append(key)

    def run(model: str) -> list:
        cases = by_model[model]
        spec = json.dumps(dict(cases=cases, rev_dir=rev_dir if is_flatten(cases[0]) else None))
        done = subprocess.run([sys.executable, __file__, '--worker', spec],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f'counting {model} failed:\n' + done.stderr[-3000:])
        return json.loads(done.stdout.strip().splitlines()[-1])
    profiles = {}
    with ThreadPoolExecutor(jobs) as pool:
        for counted in pool.map(run, by_model):
            for key, prof in counted:
                profiles[key] = Profile(prof[0], prof[1], [tuple(m) for m in prof[2]])
    return profiles


def is_flatten(key: str) -> bool:
    """Whether case ``key`` is of a flatten model (counted with ``--rev-dir``'s
    checkout where measured; the rest fit the model)."""
    return json.loads(key)[0].startswith('flatten-')


def case_key(model: str, mode: str, dtype: str, batch: int, size: str) -> str:
    """A case's key: JSON of (model, mode, dtype, batch, [H, W]), ``size`` 'HxW'."""
    return json.dumps([model, mode, dtype, int(batch), [int(v) for v in size.split('x')]])


def read_measured(paths: List[str]) -> Dict[str, float]:
    """Measured seconds by case key, from ``benchmark_backbone.py`` CSVs (rows
    on CUDA with status ok, eager; a case measured twice is a ValueError)."""
    rows = {}
    for path in paths:
        with open(path, newline='') as f:
            for row in csv.DictReader(f):
                if 'batch' not in row:
                    raise ValueError(f'{path} has no batch column: the time model needs the '
                                     'batch of every row')
                if row['status'] != 'ok' or row.get('compiled', 'False') not in ('', 'False') \
                        or row.get('device', 'cuda') != 'cuda':
                    continue
                key = case_key(row['model'], row['mode'], row['dtype'], row['batch'],
                               row['size'])
                if key in rows:
                    raise ValueError(f'{path} measures {key} again: give each case once')
                rows[key] = float(row['median_ms']) / 1e3
    return rows


def ratio_of(key: str, times: Dict[str, float]) -> Optional[float]:
    """A flatten case's time over its softmax baseline's in ``times``, if there."""
    from benchmark_backbone import baseline_of
    model, *rest = json.loads(key)
    base = baseline_of(model)
    base_key = base and json.dumps([base, *rest])
    return times[key] / times[base_key] if base_key in times else None


def report_rows(keys: List[str], profiles: Dict[str, Profile], p: Params,
                measured: Dict[str, float]) -> List[dict]:
    """A row per case: modeled time and its parts (ms), measured time and ratios
    where measured."""
    parts = {k: modeled_s(profiles[k], p) for k in keys}
    modeled = {k: t for k, (t, _, _) in parts.items()}
    rows = []
    for key in keys:
        model, mode, dtype, batch, size = json.loads(key)
        t, host, gpu = parts[key]
        row = dict(model=model, mode=mode, dtype=dtype, batch=batch,
                   size='x'.join(map(str, size)), ops=profiles[key].ops,
                   modeled_ms=1e3 * t, host_ms=1e3 * host, gpu_ms=1e3 * gpu,
                   modeled_ratio=ratio_of(key, modeled))
        if key in measured:
            row.update(measured_ms=1e3 * measured[key], error=t / measured[key],
                       measured_ratio=ratio_of(key, measured))
        rows.append(row)
    return rows


def fmt(v, spec: str) -> str:
    """``v`` formatted by ``spec``, '-' for None."""
    return '-' if v is None else format(v, spec)


def print_rows(title: str, rows: List[dict]) -> None:
    print(f'\n{title}\n| case | ops | host ms | GPU ms | modeled ms | measured ms | '
          'modeled / measured | × baseline, modeled | × baseline, measured |')
    print('|---' * 9 + '|')
    for r in rows:
        print(f"| {r['model']} {r['mode']} {r['dtype']} b{r['batch']} {r['size']} | {r['ops']} | "
              f"{r['host_ms']:.1f} | {r['gpu_ms']:.1f} | {r['modeled_ms']:.1f} | "
              f"{fmt(r.get('measured_ms'), '.1f')} | {fmt(r.get('error'), '.2f')} | "
              f"{fmt(r['modeled_ratio'], '.2f')} | {fmt(r.get('measured_ratio'), '.2f')} |")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--measured', nargs='+',
                        help="benchmark_backbone.py results.csv files (GPU runs) to fit on")
    parser.add_argument('--rev-dir', help='the flatten_mm checkout the measured flatten rows '
                        'ran (default: this one)')
    parser.add_argument('--models', nargs='+', default=[],
                        help="models to predict with this checkout (benchmark_backbone.py's names)")
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--size', default='800x1333', help='HxW of the predicted cases')
    parser.add_argument('--modes', nargs='+', choices=MODES, default=list(MODES))
    parser.add_argument('--dtypes', nargs='+', choices=('fp32', 'bf16', 'fp16'),
                        default=['fp32', 'bf16'])
    parser.add_argument('--out', help='write the rows and parameters to this JSON file')
    parser.add_argument('--worker', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        if not args.measured:
            parser.error('--measured: at least one results.csv of a GPU run is needed')
        sys.path.insert(0, str(HERE))
        from benchmark_backbone import check_model_names
        check_model_names(parser, args.models)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return {}
    measured = read_measured(args.measured)
    predicted = [case_key(m, mode, dt, args.batch, args.size) for m in args.models
                 for mode in args.modes for dt in args.dtypes]
    profiles = count_all(list(measured), args.rev_dir)
    fitted = [k for k in measured if not is_flatten(k)]
    if not fitted:
        raise ValueError('--measured has no softmax rows to fit the model on')
    p, err = fit([(profiles[k], measured[k]) for k in fitted])
    print(f'fitted on {len(fitted)} softmax rows (rms error of log time {err:.3f}): '
          f'{p.bw / 1e12:.2f} TB/s, {p.host * 1e6:.0f} us a op on the host, '
          f'{p.half / 1e12:.0f} TFLOP/s 16-bit, {p.fp32 / 1e12:.0f} TFLOP/s fp32')
    rows = report_rows(list(measured), profiles, p, measured)
    print_rows('Measured rows', rows)
    # this checkout's; the softmax models' counts (and all, without --rev-dir) reused
    now = {k: profiles[k] for k in predicted
           if k in profiles and not (args.rev_dir and is_flatten(k))}
    now.update(count_all([k for k in predicted if k not in now], None))
    predictions = report_rows(predicted, now, p, {})
    if predictions:
        print_rows('Predicted with this checkout', predictions)
    result = dict(params=p._asdict(), fit_error=err, measured=rows, predicted=predictions)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == '__main__':
    main()
