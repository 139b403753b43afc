"""Randomised check of ONNX graphs with dynamic image sizes against eager.

    python tools/analysis_tools/fuzz_onnx.py --seconds 300 --seed 1

Each case draws a random small backbone as ``fuzz_backbones.py`` does (family,
attention types, key reduction, windows, stripes, designs, pretraining size,
image channels; in eval mode, fp32), exports it with torch.onnx's TorchScript
exporter as mmdeploy does (``dynamo=False``, opset 11, dynamic batch, height
and width) at a random image size, and runs the graph in onnxruntime at three
other random sizes and batches against the model in eager mode (every
parameter initialised to zero, as positional encodings are, drawn at random
first). A run passes
where every output equals eager's (relative to its largest value, within
``--tol``). Only FLatten-Swin may stop, at its one-window check (an ``Expand``
node: ``utils.branch_on_sizes``), and only where a stage's map fits in one
window at one size and not at the other (:func:`swin_branches`): a graph cannot
hold both branches of the release's model. Any other stop, a wrong output or a failed export fails the
case; the exit status is 1 if any did.
"""
import argparse
import io
import os
import random
import sys
import time
import warnings
from typing import Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_backbones import FAMILIES, build, random_case  # noqa: E402

OPSET = 11  # mmdeploy's configs'
RUNS = 3  # sizes each graph runs at


def onnx_case(rng: random.Random, families=FAMILIES) -> dict:
    """A case of ``fuzz_backbones`` as a deployed model: eval mode, fp32, no
    checkpointing, frozen stages or drop path; an export size."""
    case = random_case(rng, families)
    for key in ('frozen_stages', 'norm_eval', 'with_cp'):
        case['kwargs'].pop(key, None)
    case['kwargs']['drop_path_rate'] = 0.
    low = case['kwargs'].get('patch_size', 1)
    case['export'] = (rng.randint(low, 90), rng.randint(low, 90))
    case['runs'] = [(rng.randint(1, 3), rng.randint(low, 120), rng.randint(low, 120))
                    for _ in range(RUNS)]
    return case


def fill_zero_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every all-zero parameter (positional encodings, bias
    tables, scales as initialised) drawn from N(0, 0.5): an op that an export
    drops on them shows (torch.onnx dropped the positional encoding's add)."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.5)
    return model


def swin_branches(kwargs: dict, size: Tuple[int, int]) -> Tuple[Optional[bool], ...]:
    """Per stage of a random Swin case at an image ``size``: whether its map
    fits in one window, where its blocks depend on that (softmax stages, whose
    odd blocks shift, and linear ones with ``linear_window``); None elsewhere."""
    h, w = -(-size[0] // 4), -(-size[1] // 4)
    out = []
    for kind in kwargs['attn_type']:
        window = kwargs.get('window_size', 7) if kind == 'S' else kwargs.get('linear_window')
        out.append(None if window is None else h <= window and w <= window)
        h, w = (h + 1) // 2, (w + 1) // 2
    return tuple(out)


def export(model: torch.nn.Module, channels: int, size: Tuple[int, int]):
    """An onnxruntime session of ``model`` exported at ``size``, dynamic axes."""
    import onnxruntime as ort
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the input checks' TracerWarnings
        warnings.simplefilter('ignore')
        torch.onnx.export(model, (torch.randn(1, channels, *size),), buffer, dynamo=False,
                          opset_version=OPSET, input_names=['x'],
                          dynamic_axes={'x': {0: 'batch', 2: 'height', 3: 'width'}})
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a stop is reported by the check, not logged
    return ort.InferenceSession(buffer.getvalue(), options, providers=['CPUExecutionProvider'])


def check_run(session, model: torch.nn.Module, may_stop: bool, x: torch.Tensor,
              tol: float) -> Tuple[Optional[str], bool]:
    """(problem or None, whether the graph stopped as allowed: ``may_stop``,
    at an ``Expand`` node) of one run."""
    with torch.no_grad():
        want = model(x)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    try:
        got = session.run(None, {'x': x.numpy()})
    except Exception as e:  # noqa: BLE001 (onnxruntime's own error types)
        if may_stop and 'Expand' in str(e):
            return None, True
        return f'stopped: {str(e).splitlines()[0][:300]}', False
    if len(got) != len(want):
        return f'{len(got)} outputs, eager gives {len(want)}', False
    for i, (a, b) in enumerate(zip(got, want)):
        a = torch.from_numpy(a)
        if a.shape != b.shape:
            return f'output {i}: shape {tuple(a.shape)}, eager {tuple(b.shape)}', False
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
        if not err <= tol:
            return f'output {i}: off by {err:.2e} (relative)', False
    return None, False


def check_case(case: dict, tol: float) -> Tuple[Optional[str], int]:
    """(problem or None, runs stopped as allowed) of one case."""
    model = fill_zero_parameters(build(case).eval())
    channels = case['kwargs'].get('in_channels', 3)
    try:
        session = export(model, channels, case['export'])
    except Exception as e:  # noqa: BLE001
        return f'export failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}', 0
    stops = 0
    for batch, h, w in case['runs']:
        may_stop = case['family'] == 'swin' and (swin_branches(case['kwargs'], (h, w))
                                                 != swin_branches(case['kwargs'], case['export']))
        problem, stopped = check_run(session, model, may_stop,
                                     torch.randn(batch, channels, h, w), tol)
        if problem:
            return f'at {batch}x{channels}x{h}x{w}: {problem}', stops
        stops += stopped
    return None, stops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--seconds', type=float, default=60., help='time to spend (default 60)')
    parser.add_argument('--cases', type=int, default=None, help='stop after this many cases')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--families', nargs='+', choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument('--tol', type=float, default=1e-4,
                        help='largest relative error of an output (default 1e-4)')
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    start, done, failed, stops = time.perf_counter(), 0, 0, 0
    while time.perf_counter() - start < args.seconds and (args.cases is None
                                                           or done < args.cases):
        case = onnx_case(rng, tuple(args.families))
        torch.manual_seed(args.seed + done)
        problem, stopped = check_case(case, args.tol)
        done, stops = done + 1, stops + stopped
        if problem is not None:
            failed += 1
            print(f'case {done - 1} (torch seed {args.seed + done - 1}): {case}: {problem}',
                  flush=True)
    print(f"{done} cases, {failed} failed, {stops} runs stopped at Swin's one-window check "
          f'(seed {args.seed}, opset {OPSET})')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
