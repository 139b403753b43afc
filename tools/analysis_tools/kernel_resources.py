"""Build the attention core's Triton kernels for a GPU, without one, and report
what each costs the GPU: registers, spilled bytes and shared memory per program,
and whether its dots run on tensor cores.

Every kernel that one forward and one backward of the core (and of the fused
DWC of V added to its output) launch is built for
each case, with the arguments the launchers would pass on a GPU (the launchers
run on CPU tensors with the launches recorded instead of made; tiling, operand
dtypes and constexprs are the GPU's, not the interpreter's), by Triton's own
compiler for ``--arch`` and then ``ptxas -v``; the tensor-core instructions
of its PTX are counted (``wgmma``: Hopper's warpgroup MMA; ``mma``: the
warp-level one; ``tcgen05``: Blackwell's, sm_100-110), so a dot that fell back
to FMAs shows. The recorded problem is large
enough that every chunked kernel loops over two blocks or more, as at real
sizes: Triton compiles an integer argument equal to 1 as a constant, so a
problem of one block per program would build smaller, loop-free kernels than
any detection or classification size runs. A kernel that does not build is
an error here, not on the first GPU run; spills and registers show what a
tiling change does to occupancy before any timing.

A case is ``DxH`` (head width D, H heads), ``m`` appended for a key mask:
``32x3m`` is a Swin-T stage-1 window layer, ``64x1`` a PVT stage-1 layer, ``32x1``
PVTv2-B0's, ``64x6`` FLatten-DeiT-S's. Example::

    python tools/analysis_tools/kernel_resources.py --arch 90 \\
        --cases 32x3m 64x1 32x1 64x6 --dtypes bf16 fp16 fp32 --json out.json

Needs triton with its NVIDIA backend (it ships ptxas) and ``TRITON_INTERPRET``
unset: under the interpreter there is no kernel to build.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # launch_count
DTYPES = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)
CASE = re.compile(r'(\d+)x(\d+)(m?)$')
# tensor-core instructions in PTX: Hopper's warpgroup MMA, the warp-level one,
# and Blackwell's (sm_100-110: operands in shared memory, accumulator in tensor memory)
WGMMA, MMA = re.compile(r'\bwgmma\.mma_async\.'), re.compile(r'\bmma\.sync\.')
TCGEN05 = re.compile(r'\btcgen05\.mma\b')
PTXAS = re.compile(r'(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers',
                   re.S)


def parse_case(text: str) -> tuple:
    """(head width, heads, masked) from ``DxH`` or ``DxHm``."""
    found = CASE.match(text)
    if not found or int(found[1]) < 1 or int(found[2]) < 1:
        raise argparse.ArgumentTypeError(
            f'a case is DxH with head width D >= 1 and H >= 1 heads, optionally m '
            f'for a key mask (e.g. 32x3m), got {text!r}')
    return int(found[1]), int(found[2]), bool(found[3])


def recorded_launches(d: int, heads: int, masked: bool, dtype: torch.dtype, arch: int) -> list:
    """(kernel, args, kwargs) of each launch of one forward and backward of the
    attention core and of the fused local term (the 5 x 5 DWC of V and a 3 x 3
    LePE added to the output, on a 16 x 24 grid; its input gradient as a new map
    and, as the attention and local term's one op has it, added into v's), the
    launchers run on CPU tensors with every kernel replaced by a recorder and
    the device taken for one of compute capability ``arch``."""
    from launch_count import launches_recorded

    from flatten_mm.models.ops import triton_conv_kernels, triton_kernels
    calls = []
    # (image, head) programs >= 4 x 132 multiprocessors: the plan then gives
    # each program every block of its row, 3 forward, 6 backward at d = 32;
    # the conv's weight gradient 4 blocks of rows per program
    B, N, n, C = -(-600 // heads), 384, 384, d * heads
    q, k, v = (torch.randn(B, L, C).to(dtype) for L in (N, n, n))
    mask = torch.arange(n).expand(B, n) < n - 3 if masked else None
    scale, p = torch.zeros(C), 3.0
    # the local term in parts, as CSwin's: a head's 5 x 5 DWC shared by the heads, LePE's 3 x 3
    weight, bias, lepe = torch.randn(d, 1, 5, 5), torch.randn(d), (torch.randn(C, 1, 3, 3),
                                                                   torch.randn(C))
    with mock.patch.object(triton_kernels, 'capability', lambda device: divmod(arch, 10)), \
            launches_recorded(lambda name, fn, grid, a, kw: calls.append((fn, a, kw))):
        out, kv, km, stats_q, stats_k, s_inv, inv_count = triton_kernels.forward(
            q, k, v, scale, p, heads, mask)
        triton_kernels.backward(out, q, k, v, scale, s_inv, kv, km, stats_q, stats_k, inv_count,
                                p, heads, mask)
        triton_conv_kernels.conv_add(v, weight, bias, out, (16, 24), extra=lepe)
        triton_conv_kernels.conv_add(out, weight, None, None, (16, 24), flip=True, extra=lepe)
        # the one op's backward: the conv of the gradient added into v's in place
        dv = torch.empty_like(v)
        triton_conv_kernels.conv_add(out, weight, None, dv, (16, 24), flip=True, out=dv,
                                     extra=lepe)
        triton_conv_kernels.weight_grad(out, v, weight, bias, (16, 24), lepe)
    return calls


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spilled bytes that ``ptxas -v`` reports for the kernel."""
    from triton.backends.nvidia.compiler import get_ptxas
    suffix = 'a' if arch >= 90 else ''
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, 'kernel.ptx')
        Path(src).write_text(ptx)
        proc = subprocess.run([get_ptxas(arch).path, '-v', f'--gpu-name=sm_{arch}{suffix}',
                               src, '-o', os.path.join(tmp, 'kernel.cubin')],
                              capture_output=True, text=True)
    found = PTXAS.search(proc.stderr)
    if proc.returncode or not found:
        raise RuntimeError(f'ptxas -v for sm_{arch} failed or printed no register count '
                           f'(exit {proc.returncode}):\n{proc.stderr[-2000:]}')
    stores, loads, registers = found.groups()
    return dict(registers=int(registers), spill_stores=int(stores), spill_loads=int(loads))


def build(fn, args: tuple, kwargs: dict, arch: int) -> dict:
    """Build one launch for ``sm_{arch}`` as triton's JIT would on that GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget('cuda', arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    return dict(kernel=fn.__name__, shared=compiled.metadata.shared,
                num_warps=compiled.metadata.num_warps,
                constexprs={fn.arg_names[k[0]]: str(v) for k, v in constexprs.items()},
                blocks_per_prog=dict(zip(fn.arg_names, args)).get('blocks_per_prog'),
                seconds=round(time.perf_counter() - start, 2),
                wgmma=len(WGMMA.findall(compiled.asm['ptx'])),
                mma_sync=len(MMA.findall(compiled.asm['ptx'])),
                tcgen05=len(TCGEN05.findall(compiled.asm['ptx'])),
                **ptxas_usage(compiled.asm['ptx'], arch))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--arch', type=int, default=90,
                        help='compute capability as one number (90: H100/H200, 80: A100, '
                        '100: B200, 120: RTX 50 series)')
    parser.add_argument('--cases', nargs='+', type=parse_case,
                        default=[parse_case(c) for c in ('32x3m', '64x1', '32x1', '64x6')],
                        help='head width x heads, m for a key mask (default: 32x3m 64x1 32x1 64x6)')
    parser.add_argument('--dtypes', nargs='+', choices=sorted(DTYPES), default=['bf16', 'fp32'])
    parser.add_argument('--tf32', action='store_true',
                        help="fp32 inputs as with torch.backends.cuda.matmul.fp32_precision = "
                             "'tf32' (TF32 tensor-core dots; default: torch's setting, IEEE)")
    parser.add_argument('--json', help='write the rows here as JSON')
    return parser.parse_args(argv)


def main(argv=None) -> list:
    args = parse_args(argv)
    if os.environ.get('TRITON_INTERPRET', '0') == '1':
        raise SystemExit('TRITON_INTERPRET=1 is set: the kernels would be interpreted, not '
                         'built; run without it')
    if args.tf32:  # this process only: the launchers read it when they plan
        torch.backends.cuda.matmul.fp32_precision = 'tf32'
    import triton
    rows = []
    # builds differ between triton releases (docs/design.md): each row names its own
    built_with = dict(arch=args.arch, triton=triton.__version__)
    print(f'triton {triton.__version__}, sm_{args.arch}')
    print(f'{"kernel":26} {"case":7} {"dtype":5} {"regs":>4} {"spill st/ld":>11} {"shared":>7} '
          f'{"wgmma/mma/tcgen05":>18}')
    for d, heads, masked in args.cases:
        case = f'{d}x{heads}{"m" if masked else ""}'
        for name in args.dtypes:
            for fn, a, kw in recorded_launches(d, heads, masked, DTYPES[name], args.arch):
                row = dict(case=case, dtype=name, **built_with, **build(fn, a, kw, args.arch))
                rows.append(row)
                print(f'{row["kernel"]:26} {case:7} {name:5} {row["registers"]:4d} '
                      f'{row["spill_stores"]:5d}/{row["spill_loads"]:<5d} {row["shared"]:7d} '
                      f'{"/".join(str(row[k]) for k in ("wgmma", "mma_sync", "tcgen05")):>18}')
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == '__main__':
    main()
