"""Trace backbones for CUDA without a GPU: graph breaks, and the ops a compiled
model's graph holds, on the path CUDA tensors take.

    python tools/analysis_tools/trace_cuda.py --size 800x1333 --dtypes fp32 bf16 \\
        --models flatten-swin-t flatten-pvt-t flatten-pvtv2-b1 flatten-cswin-t \\
        --compile-sizes 800x1333 800x1216

Each model (``benchmark_backbone.py``'s names, ``timm:NAME`` included) is built
on CPU; its parameters and buffers are then swapped for fake CUDA tensors
(torch's ``FakeTensorMode``: shapes, dtypes and devices, no memory, no kernel
run), and dynamo exports its training-mode forward (``torch.export.export``
with ``strict=True``: one whole graph, or an error naming what broke it),
under autocast for half dtypes. The code takes the branches a GPU takes:
``'auto'`` chooses the Triton ops (``flatten_mm::``), whose fake
implementations give the shapes. Reported per model: whether it traced, the
graph's ``flatten_mm::`` ops and convolutions, or the error. The exit status
is 1 if any model fails. With ``--compile-sizes``, each model is also compiled
(``fullgraph=True``, forward) at those sizes and the first again, and must make
one graph per distinct size: nothing on the CUDA path guarded on but the
sizes (a guard on the lazily imported conv kernels once recompiled every graph).

What it does not show: the kernels themselves (the interpreter tests and
``kernel_resources.py``), recompilation across sizes, and speed
(``check_compile.py --device cuda`` on a GPU). A CUDA-only graph break in every
fp32 layer (the TF32 setting read through a C getter dynamo cannot trace) was
found this way.
"""
import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_backbone import build_model, check_model_names, parse_size  # noqa: E402

DTYPES = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)


class Autocast(nn.Module):
    """The model's forward under CUDA autocast to ``dtype`` (off for fp32)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor):
        with torch.autocast('cuda', dtype=self.dtype, enabled=self.dtype != torch.float32):
            return self.model(x)


def to_fake_cuda(model: nn.Module, fake_mode) -> nn.Module:
    """``model`` with every parameter and buffer swapped for a fake CUDA tensor."""
    with fake_mode:
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is not None:
                    fake = fake_mode.from_tensor(p.detach()).to('cuda')
                    module._parameters[name] = nn.Parameter(fake, p.requires_grad)
            for name, b in list(module._buffers.items()):
                if b is not None:
                    module._buffers[name] = fake_mode.from_tensor(b).to('cuda')
    return model


def graph_ops(program) -> Counter:
    """Call targets of an exported program, its nested graphs (autocast regions) included."""
    return Counter(str(n.target) for gm in program.graph_module.modules()
                   if isinstance(gm, torch.fx.GraphModule)
                   for n in gm.graph.nodes if n.op == 'call_function')


def trace(name: str, size: list, dtype: str, batch: int) -> dict:
    """Export one model's training forward on fake CUDA tensors (see the docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    start = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(name).train()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    row = dict(model=name, size='x'.join(map(str, size)), dtype=dtype)
    try:
        model = to_fake_cuda(model, fake_mode)
        with fake_mode:
            x = torch.randn(batch, 3, *size, device='cuda')
            program = torch.export.export(Autocast(model, DTYPES[dtype]), (x, ), strict=True)
        ops = graph_ops(program)
        row.update(status='ok', ops={k: v for k, v in sorted(ops.items())
                                     if 'flatten_mm' in k or 'conv' in k})
    except Exception as err:  # noqa: BLE001 (reported, and the exit status says so)
        row.update(status='failed', error=f'{type(err).__name__}: {str(err)[:1500]}')
    row['seconds'] = round(time.perf_counter() - start, 1)
    return row


def count_graphs(name: str, sizes: list, dtype: str, batch: int) -> dict:
    """``torch.compile(fullgraph=True)`` of one model's training forward on fake
    CUDA tensors at each size, then the first again: how many graphs dynamo
    made (as many as distinct sizes when nothing else is guarded on). Forward
    only: the autograd engine needs a real GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch._dynamo.reset()
    torch.manual_seed(0)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = Autocast(to_fake_cuda(build_model(name).train(), fake_mode), DTYPES[dtype])
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    row = dict(model=name, sizes=['x'.join(map(str, s)) for s in sizes], dtype=dtype)
    try:
        with fake_mode:
            for size in list(sizes) + [sizes[0]]:
                compiled(torch.randn(batch, 3, *size, device='cuda'))
        distinct = len({tuple(s) for s in sizes})
        row.update(graphs=len(graphs), status='ok' if len(graphs) <= distinct else
                   f'{len(graphs)} graphs for {distinct} sizes (TORCH_LOGS=recompiles says why)')
    except Exception as err:  # noqa: BLE001 (reported, and the exit status says so)
        row.update(status='failed', error=f'{type(err).__name__}: {str(err)[:1500]}')
    return row


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+',
                        default=['flatten-swin-t', 'flatten-pvt-t', 'flatten-pvtv2-b1',
                                 'flatten-cswin-t'])
    parser.add_argument('--size', type=parse_size, default=[800, 1333])
    parser.add_argument('--dtypes', nargs='+', choices=sorted(DTYPES), default=['fp32', 'bf16'])
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--compile-sizes', nargs='+', type=parse_size, default=[],
                        help='also compile each model at these sizes, then the first again, '
                        'and count the graphs')
    parser.add_argument('--out', help='write the rows here as JSON')
    args = parser.parse_args(argv)
    check_model_names(parser, args.models)
    return args


def main(argv=None) -> list:
    args = parse_args(argv)
    rows = []
    for name in args.models:
        for dtype in args.dtypes:
            row = trace(name, args.size, dtype, args.batch)
            rows.append(row)
            print(f"{name} {row['size']} {dtype}: {row['status']} ({row['seconds']} s) "
                  f"{row.get('ops') or row.get('error')}", flush=True)
            if args.compile_sizes:
                row = count_graphs(name, args.compile_sizes, dtype, args.batch)
                rows.append(row)
                print(f"{name} compiled at {' '.join(row['sizes'])} and the first again, "
                      f"{dtype}: {row.get('graphs')} graphs, {row['status']} "
                      f"{row.get('error', '')}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if any(r['status'] != 'ok' for r in rows):
        raise SystemExit(1)
    return rows


if __name__ == '__main__':
    main()
