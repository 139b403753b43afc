"""Where a backbone's time goes, per op family, next to its softmax counterpart.

    python tools/analysis_tools/profile_backbone.py --models flatten-swin-t swin-t \\
        --size 800x1333 --mode fwdbwd --threads 2
    python tools/analysis_tools/profile_backbone.py --device cuda --dtype bf16 --batch 8 \\
        --models flatten-swin-t swin-t --size 800x1333 --mode fwdbwd --iters 3

Each model runs in its own subprocess (as ``benchmark_backbone.py``; same
model names): one warm-up step, then ``--iters`` steps under
``torch.profiler``. The self time of every op (aten ops, and the
``flatten_mm::`` custom ops: the Triton kernels of the attention core and of
its DWC) is summed into
families (matmul, conv, attention, norm, element-wise, reduction,
layout/copy, resize/gather, other) so two models can be compared line by
line: CPU time on the CPU, on CUDA the GPU time of the kernels each op
launched. Also prints the top ops of each model, and the ATen ops one step
dispatches (views and other metadata-only ops left out; a ``flatten_mm::``
op counts once): where steps are short (batch 1-2 on a GPU) each is a kernel
launch the host pays for, whatever its size. With them the bytes those ops
read and write and the FLOPs of its matmuls, convolutions and fused attention
(:func:`tally_ops`): on a GPU most element-wise, norm and layout ops are bound
by memory bandwidth, and there the bytes say more than the counts; each top
op's bytes over its time is the rate it reaches (on an H200, against about
4.8 TB/s: how near each kernel, the core's included, comes to the memory's).
``--out`` writes the table as JSON.
"""
import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, NamedTuple, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_backbone import Case, check_model_names, parse_size  # noqa: E402

# op name fragments -> family; the first match wins
FAMILIES = [
    ('attention', ('scaled_dot_product', '_flash_attention', '_efficient_attention', 'softmax',
                   'flatten_mm::triton_focused_attention',
                   'flatten_mm::triton_attention_local')),  # (the latter with its DWC)
    ('conv', ('conv', 'mkldnn_convolution', 'thnn_conv')),  # flatten_mm::triton_local_conv_add too
    ('matmul', ('addmm', 'aten::mm', 'bmm', 'matmul', 'linear', 'einsum', 'baddbmm', 'dot',
                'vecdot')),
    ('norm', ('layer_norm', 'batch_norm', 'group_norm', 'vector_norm', 'linalg_vector_norm')),
    ('resize/gather', ('index', 'gather', 'scatter', 'upsample', 'interpolate', 'lerp',
                       'grid_sampler', 'embedding')),
    ('layout/copy', ('copy_', 'contiguous', 'clone', 'cat', 'constant_pad', 'pad', 'stack',
                     'fill_', 'zero_', 'zeros', 'empty', 'repeat', 'flip', 'roll',
                     'masked_fill', 'where', 'tril', 'triu')),
    ('reduction', ('sum', 'mean', 'amax', 'max', 'min', 'argmax')),
    ('element-wise', ('add', 'sub', 'mul', 'div', 'pow', 'relu', 'gelu', 'clamp', 'threshold',
                      'sqrt', 'rsqrt', 'exp', 'neg', 'reciprocal', 'bernoulli', 'softplus',
                      'sigmoid', 'tanh', 'abs')),
]


def family_of(name: str) -> str:
    low = name.lower()
    for family, keys in FAMILIES:
        if any(k in low for k in keys):
            return family
    return 'other'


def leaf_self_times(prof, device: str = 'cpu') -> dict:
    """Self time (ms) per op, summed over its calls: CPU time, or with
    ``device='cuda'`` the GPU time of the kernels the op itself launched."""
    times = defaultdict(float)
    for evt in prof.key_averages():
        if evt.key.startswith(('aten::', 'mkldnn', 'flatten_mm::')):
            us = evt.self_device_time_total if device == 'cuda' else evt.self_cpu_time_total
            times[evt.key] += us / 1e3
    return {op: ms for op, ms in times.items() if ms > 0 or device == 'cpu'}


# ops that make no kernel: views, metadata, allocation without a fill (and prim::)
NO_KERNEL = {'view', '_unsafe_view', 'reshape', '_reshape_alias', 'view_as', 'alias', 'detach',
             'permute', 'transpose', 't', 'unsqueeze', 'squeeze', 'expand', 'slice', 'select',
             'as_strided', 'split', 'split_with_sizes', 'unbind', 'chunk', 'narrow', 'unflatten',
             'flatten', 'lift_fresh', 'empty', 'empty_like', 'new_empty', 'empty_strided',
             'new_empty_strided', 'sym_size', 'sym_stride', 'sym_numel', 'is_same_size',
             'promote_types'}


class OpTally(NamedTuple):
    """Per op name: calls, bytes read and written, FLOPs (see :func:`tally_ops`)."""
    calls: dict
    bytes: dict
    flops: dict


def tensor_bytes(tree) -> int:
    """Bytes of the distinct tensors in ``tree`` (any nesting of lists, tuples
    and dicts), each counted once at its own extent (a view: what it spans)."""
    from torch.utils._pytree import tree_flatten
    seen, total = set(), 0
    for t in tree_flatten(tree)[0]:
        if hasattr(t, 'element_size') and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def conv_backward_flops(grad_out, x, w, bias_sizes, stride, padding, dilation, transposed,
                        output_padding, groups, output_mask, out_val=None) -> int:
    """FLOPs of ``aten.convolution_backward``: the forward convolution's for
    each of the input's and the weight's gradients asked for. (torch's own
    formula ignores groups: 32x too many for a depth-wise conv of 64
    channels.)"""
    import torch
    from torch.utils.flop_counter import flop_registry
    forward = flop_registry[torch.ops.aten.convolution](
        x, w, None, stride, padding, dilation, transposed, output_padding, groups,
        out_val=grad_out)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def is_half(tree) -> bool:
    """Whether the first floating-point tensor in ``tree`` is 16-bit."""
    import torch
    from torch.utils._pytree import tree_flatten
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.element_size() == 2
    return False


def tally_ops(step, inside: Optional[Dict[str, Callable]] = None,
              log: Optional[list] = None) -> OpTally:
    """The ATen (and ``flatten_mm::``) ops one call of ``step`` dispatches, ops
    that make no kernel (``NO_KERNEL``, ``prim::``) left out: their calls; the
    bytes of the tensors each reads and writes (inputs, then outputs: an
    in-place op's tensor counts as read and written; what a kernel re-reads
    internally or finds in cache is not seen); and the FLOPs of torch's FLOP
    counter's formulas (matmuls, convolutions, fused attention; none for the
    rest, ``flatten_mm::`` ops included). An op named in ``inside`` (e.g.
    ``'flatten_mm::triton_focused_attention'``) is counted by what its function there
    runs on the op's arguments instead: the ATen ops it dispatches, tallied as
    above, and the kernel launches it returns as (name, bytes) pairs. Each
    counted call (op or launch) is also appended to ``log``, if given, as
    (name, bytes, FLOPs, half): half if its first floating-point tensor
    argument is 16-bit (the rate its matmul runs at)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry
    formulas = {**flop_registry, torch.ops.aten.convolution_backward: conv_backward_flops}
    inside = inside or {}
    tally = OpTally(defaultdict(int), defaultdict(int), defaultdict(int))

    def count(name: str, nbytes: int, flops: int, args) -> None:
        tally.calls[name] += 1
        tally.bytes[name] += nbytes
        if flops:
            tally.flops[name] += flops
        if log is not None:
            log.append((name, nbytes, int(flops), is_half(args)))

    class Tally(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            packet = func.overloadpacket
            if packet.__name__ in NO_KERNEL or func.namespace == 'prim':  # prim::device
                return out
            # an op that returns its input unwritten made no kernel (a .contiguous() or
            # .to() with nothing to do); in-place and out= ops return theirs written
            if args and out is args[0] and not func._schema.is_mutable:
                return out
            name = f'{func.namespace}::{packet.__name__}'
            if name in inside:
                with Tally():  # the ATen ops it runs, on the same counts
                    launches = inside[name](*args, **kwargs)
                for kernel, nbytes in launches:
                    count(kernel, nbytes, 0, (args, kwargs))
                return out
            flops = formulas[packet](*args, **kwargs, out_val=out) if packet in formulas else 0
            count(name, tensor_bytes((args, kwargs)) + tensor_bytes(out), flops, (args, kwargs))
            return out
    with Tally():
        step()
    return OpTally(*(dict(d) for d in tally))


def run_worker(spec: dict) -> dict:
    """One warm-up step, then ``iters`` steps of benchmark_backbone's Case under the profiler."""
    from torch.profiler import ProfilerActivity, profile
    device = spec.get('device', 'cpu')
    case = Case(dict(spec, device=device, dtype=spec.get('dtype', 'fp32')))
    case.step()
    activities = [ProfilerActivity.CPU]
    if device.startswith('cuda'):
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        wall = sum(case.step().wall_s for _ in range(spec['iters'])) * 1e3 / spec['iters']
    times = leaf_self_times(prof, 'cuda' if device.startswith('cuda') else 'cpu')
    ops = {k: v / spec['iters'] for k, v in times.items()}
    tally = tally_ops(case.step)
    return dict(spec, wall_ms=wall, ops=ops, op_calls=tally.calls, op_bytes=tally.bytes,
                flops=sum(tally.flops.values()))


def summarise(results):
    families = {}
    for r in results:
        fam = defaultdict(float)
        for op, ms in r['ops'].items():
            fam[family_of(op)] += ms
        families[r['model']] = dict(fam)
    names = [family for family, _ in FAMILIES] + ['other']
    models = [r['model'] for r in results]
    print(f"| op family | {' | '.join(f'{m} (ms)' for m in models)} |")
    print('|---|' + '---|' * len(models))
    for fam in names:
        print(f'| {fam} | ' + ' | '.join(f"{families[m].get(fam, 0):.0f}" for m in models) + ' |')
    print('| total (self time of ops) | ' + ' | '.join(
        f"{sum(families[m].values()):.0f}" for m in models) + ' |')
    print('| wall time under the profiler | ' + ' | '.join(
        f"{r['wall_ms']:.0f}" for r in results) + ' |')
    print('| ops dispatched per step (count) | ' + ' | '.join(
        f"{sum(r['op_calls'].values())}" for r in results) + ' |')
    print('| bytes the ops read and write per step (GB) | ' + ' | '.join(
        f"{sum(r['op_bytes'].values()) / 1e9:.2f}" for r in results) + ' |')
    print('| FLOPs of matmuls, convs, fused attention per step (G) | ' + ' | '.join(
        f"{r['flops'] / 1e9:.1f}" for r in results) + ' |')
    for r in results:
        print(f"\ntop ops of {r['model']} (time, bytes read and written, their rate):")
        for op, ms in sorted(r['ops'].items(), key=lambda kv: -kv[1])[:15]:
            gb = r['op_bytes'].get(op, 0) / 1e9
            rate = f'{gb / ms * 1e3:7.0f} GB/s' if ms > 0 and gb else ' ' * 12
            print(f'  {ms:8.1f} ms  {gb:7.2f} GB  {rate}  {op}  [{family_of(op)}]')
    return families


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=['flatten-swin-t', 'swin-t'])
    parser.add_argument('--size', type=parse_size, default=[800, 1333])
    parser.add_argument('--mode', choices=['fwd', 'fwdbwd'], default='fwdbwd')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--iters', type=int, default=1)
    parser.add_argument('--device', default='cpu', help="'cpu' or 'cuda'")
    parser.add_argument('--dtype', choices=['fp32', 'bf16', 'fp16'], default='fp32',
                        help='autocast dtype (default fp32: none)')
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--out', help='write the per-op and per-family times here (JSON)')
    parser.add_argument('--worker', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print('RESULT ' + json.dumps(run_worker(json.loads(args.worker))), flush=True)
        return None
    if args.device.startswith('cuda'):
        import torch
        if not torch.cuda.is_available():
            parser.error(f'--device {args.device}: torch sees no CUDA device here')
    check_model_names(parser, args.models)
    results = []
    for name in args.models:
        spec = dict(model=name, size=args.size, mode=args.mode, threads=args.threads,
                    iters=args.iters, device=args.device, dtype=args.dtype, batch=args.batch)
        proc = subprocess.run([sys.executable, __file__, '--worker', json.dumps(spec)],
                              capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('RESULT ')]
        if not lines:
            sys.exit(f'{name} failed:\n{proc.stderr[-2000:]}')
        results.append(json.loads(lines[-1][len('RESULT '):]))
    families = summarise(results)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(results=results, families=families), indent=1))
    return families


if __name__ == '__main__':
    main()
