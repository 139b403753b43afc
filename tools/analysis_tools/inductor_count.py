"""What torch.compile's Inductor makes of a graph for a GPU, without one.

Inductor lowers each graph it is given (with fake CUDA tensors: shapes,
dtypes and devices only) to the kernels it would launch on an sm_90 GPU with
132 multiprocessors (H100 / H200): fused Triton kernels and library calls
(matmuls, convolutions, fused attention, flatten_mm's custom ops). Their
source is generated, nothing is built to machine code or run, and Inductor's
own count of each kernel's bytes read and written
(``get_read_write_buffers_sizes``, as ``GraphLowering.count_bytes`` sums it) is
recorded. Each graph's module then runs the
graph's own ops on the fake tensors, so the program goes on as compiled code
would. :func:`inductor_for_a_fake_gpu` sets this up; ``trace_cuda.py
--count-ops --compiled`` runs a model's training step through it.

What it does not show: how fast those kernels run (their tiling and
autotuning need the GPU), nor what Inductor decides from measurements on one
(off by default: ``max_autotune``). Joint-graph constant folding, which runs
ops on the device, is off; it folds only small, size-made constants.
"""
import contextlib
from types import SimpleNamespace
from typing import Iterator, List
from unittest import mock

import torch

SM90 = SimpleNamespace(name='sm_90 GPU (without one)', multi_processor_count=132, major=9,
                       minor=0, regs_per_multiprocessor=65536,
                       max_threads_per_multi_processor=2048, max_threads_per_block=1024,
                       warp_size=32, total_memory=141 * 2 ** 30,
                       shared_memory_per_block_optin=232448, L2_cache_size=50 * 2 ** 20,
                       gcnArchName='')


def kernel_label(node) -> str:
    """What a scheduled kernel does: a library call's name, or the ATen ops a
    generated kernel fuses."""
    inner = getattr(node, 'node', None)
    name = getattr(inner, 'python_kernel_name', None) or getattr(inner, 'op_overload', None)
    if name is not None:
        return str(name)
    targets = set()
    for sub in node.get_nodes() if hasattr(node, 'get_nodes') else [node]:
        for origin in getattr(getattr(sub, 'node', None), 'origins', ()) or ():
            targets.add(str(origin.target).replace('aten.', '').replace('.default', ''))
    return 'fused: ' + ', '.join(sorted(targets))


def _record_and_run(graphs: List[dict]):
    """A stand-in for ``GraphLowering.compile_to_module``: generate the code,
    record the kernels' bytes, and return a module that runs the graph's ops."""
    def compile_to_module(lowering):
        lowering.codegen()
        kernels = [(kernel_label(node), node.get_read_write_buffers_sizes())  # count_bytes's
                   for node in lowering.scheduler.nodes
                   if type(node).__name__ != 'NopKernelSchedulerNode' and
                   type(getattr(node, 'node', None)).__name__ != 'MultiOutput']  # an index
        module = lowering.module
        graphs.append(dict(bytes=sum(size for _, size in kernels), kernels=kernels, module=module))
        return SimpleNamespace(call=lambda args: module(*args), __file__='<not built>')
    return compile_to_module


def _fake_gpu_patches(props: SimpleNamespace) -> list:
    """What Inductor asks of the device, answered for ``props``."""
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor import scheduler
    from torch._inductor.runtime.hints import DeviceProperties
    capability = (props.major, props.minor)
    created = DeviceProperties(
        type='cuda', index=0, multi_processor_count=props.multi_processor_count,
        cc=props.major * 10 + props.minor, major=props.major,
        regs_per_multiprocessor=props.regs_per_multiprocessor,
        max_threads_per_multi_processor=props.max_threads_per_multi_processor,
        max_threads_per_block=props.max_threads_per_block, warp_size=props.warp_size)
    original = DeviceProperties.create
    return [
        mock.patch.object(DeviceProperties, 'create', classmethod(
            lambda cls, device: created if device.type == 'cuda' else original(device))),
        mock.patch.object(CudaInterface, 'get_device_properties',
                          staticmethod(lambda *args, **kwargs: props)),
        mock.patch.object(CudaInterface, 'get_compute_capability',
                          staticmethod(lambda *args, **kwargs: created.cc)),
        mock.patch.object(CudaInterface, 'is_bf16_supported',
                          staticmethod(lambda *args, **kwargs: True)),
        mock.patch.object(scheduler, 'has_triton', lambda: True),
        mock.patch('torch.cuda.get_device_properties', lambda *args, **kwargs: props),
        mock.patch('torch.cuda.get_device_capability', lambda *args, **kwargs: capability),
        mock.patch('torch.cuda.device_count', lambda: 1),
        mock.patch('torch.cuda.current_device', lambda: 0),
        mock.patch('torch.cuda.get_rng_state', lambda *args, **kwargs: torch.zeros(
            16, dtype=torch.uint8)),
        mock.patch('torch.cuda.set_rng_state', lambda *args, **kwargs: None),
    ]


class _Target:
    """Triton's active driver for code generation: the target GPU, no device."""

    def __init__(self, capability: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget('cuda', capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0


@contextlib.contextmanager
def inductor_for_a_fake_gpu(props: SimpleNamespace = SM90) -> Iterator[List[dict]]:
    """Inside, Inductor compiles graphs of fake CUDA tensors for ``props``'s GPU
    as described in the module docstring; yields the list that receives one
    ``dict(bytes=..., kernels=[(label, bytes), ...], module=...)`` per graph
    (a training step's forward, then its backward, lowered at once; ``module``:
    the FX graph lowered, its nodes' ``meta['val']`` the traced fake values)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.graph import GraphLowering
    from triton.runtime import driver
    graphs: List[dict] = []
    previous = driver._active
    driver.set_active(_Target(props.major * 10 + props.minor))
    try:
        with contextlib.ExitStack() as stack:
            for patch in _fake_gpu_patches(props):
                stack.enter_context(patch)
            stack.enter_context(mock.patch.object(GraphLowering, 'compile_to_module',
                                                  _record_and_run(graphs)))
            # a warm pool of compile workers would build each kernel at once
            stack.enter_context(mock.patch.object(AsyncCompile, 'use_process_pool',
                                                  classmethod(lambda cls: False)))
            stack.enter_context(inductor_config.patch(
                fx_graph_cache=False, joint_graph_constant_folding=False,
                **{'triton.cudagraphs': False}))
            stack.enter_context(functorch_config.patch(
                enable_autograd_cache=False, force_non_lazy_backward_lowering=True))
            yield graphs
    finally:
        driver._active = previous
