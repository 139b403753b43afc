"""Trace backbones for CUDA without a GPU: graph breaks, recompiles, and the
ops a compiled model's graph holds, on the path CUDA tensors take.

    python tools/analysis_tools/trace_cuda.py --size 800x1333 --dtypes fp32 bf16 \\
        --models flatten-swin-t flatten-pvt-t flatten-pvtv2-b1 flatten-cswin-t \\
        --compile-sizes 800x1333 800x1216

Each model (``benchmark_backbone.py``'s names, ``timm:NAME`` included) is built
on CPU; its parameters and buffers are then swapped for fake CUDA tensors
(torch's ``FakeTensorMode``: shapes, dtypes and devices, no memory, no kernel
run), and its training-mode forward is compiled by dynamo with
``fullgraph=True`` (one graph, or an error naming what broke it), under CUDA
autocast for half dtypes (made available without a GPU for the trace). The
code takes the branches a GPU takes: the ``'auto'`` backend chooses the Triton
ops (``flatten_mm::``), whose fake implementations give the shapes. Reported
per model: whether it traced, the graph's ``flatten_mm::`` ops and
convolutions and the dtype the attention ops take, or the error. With
``--compile-sizes``, each model is also compiled at those sizes and the first
again, and must make one graph per distinct size: nothing on the CUDA path
guarded on but the sizes. ``--count-ops`` instead counts the ATen ops of one
eager training step on the CUDA path, forward and backward, the bytes they
read and write and their FLOPs (``profile_backbone.py``'s tally; softmax
models too, their ``F.scaled_dot_product_attention`` as the GPU's fused
kernel; flatten_mm's Triton ops as the kernels they launch, ``launch_count.py``),
after a first forward has filled the model's caches: where steps are
short each op is a kernel launch; where they are long, most ops are bound by
memory bandwidth. The backward runs autograd's nodes from Python
(:func:`run_backward`): the engine itself needs a real GPU for CUDA tensors.
``--count-ops --compiled`` counts instead the kernels torch.compile's Inductor
generates for the step on an sm_90 GPU (:mod:`inductor_count`; not built or
run) and their bytes, the Triton ops again by their launches. The exit status
is 1 if any model fails.

What it does not show: the kernels themselves (the interpreter tests and
``kernel_resources.py``), and speed (``check_compile.py --device cuda`` on a
GPU). Two CUDA-only problems were found this way: a graph break in every fp32 layer (the TF32
setting read through a C getter dynamo cannot trace) and a recompile of every
graph once the fused conv's kernels were imported.
"""
import argparse
import contextlib
import functools
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, List, Optional, Tuple
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_backbone import (build_model, check_model_names, parse_size,  # noqa: E402
                                training_loss)
from check_compile import DTYPES  # noqa: E402

from flatten_mm.analysis import saved_tensor_bytes  # noqa: E402


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


@contextlib.contextmanager
def cuda_autocast_without_gpu():
    """Let ``torch.autocast('cuda')`` cast without a GPU (it turns itself off
    where CUDA is not available): the trace then sees the half dtypes a GPU run
    has. Nothing runs on the fake tensors' device."""
    with mock.patch('torch.cuda.amp.common.amp_definitely_not_available', lambda: False), \
            mock.patch('torch.cuda.is_bf16_supported', lambda *args, **kwargs: True):
        yield


def fake_cuda_model(name: str, dtype: str, release_dir: Optional[str] = None) -> tuple:
    """(model under autocast to ``dtype`` in training mode, its fake mode): one
    model built on CPU (``release:`` ones from ``release_dir``), its weights
    swapped for fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch.manual_seed(0)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_model(name, release_dir)
    model.train()  # mmdet's backbones return None from train()
    return Autocast(to_fake_cuda(model, fake_mode), DTYPES[dtype]), fake_mode


def compile_forward(name: str, sizes: list, dtype: str, batch: int) -> list:
    """Dynamo's graphs of ``torch.compile(fullgraph=True)`` of one model's
    training forward on fake CUDA tensors, called at each size in turn."""
    model, fake_mode = fake_cuda_model(name, dtype)
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        from flatten_mm.models.ops import use_backend
        with use_backend('auto'), cuda_autocast_without_gpu(), built_for_gpu(), fake_mode:
            for size in sizes:
                compiled(torch.randn(batch, 3, *size, device='cuda'))
    finally:
        torch._dynamo.reset()
    return graphs


def graph_ops(gm) -> tuple:
    """Call targets of a dynamo graph, and the dtypes of the attention ops' inputs."""
    ops, dtypes = Counter(), set()
    for node in gm.graph.nodes:
        if node.op == 'call_function':
            target = str(node.target)  # flatten_mm.NAME; torch's functions by their name
            ops[target if 'flatten_mm' in target else getattr(node.target, '__name__', target)] += 1
            if 'triton_focused_attention' in target or 'triton_attention_local' in target:
                dtypes.add(str(node.args[0].meta['example_value'].dtype))
    return ops, dtypes


_SDPA = F.scaled_dot_product_attention


def fused_sdpa(q, k, v, attn_mask=None, dropout_p=0., is_causal=False, scale=None, **kwargs):
    """``F.scaled_dot_product_attention`` on CUDA tensors as a GPU runs it: one
    fused kernel, flash attention for half dtypes without a mask, else the
    memory-efficient one (a fake CUDA tensor cannot ask the device, and torch
    then takes the unfused math path, which writes every score)."""
    if not q.is_cuda or kwargs:
        return _SDPA(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
    if torch.is_autocast_enabled('cuda'):  # SDPA casts to the autocast dtype
        q, k, v = (t.to(torch.get_autocast_dtype('cuda')) for t in (q, k, v))
    with torch.autocast('cuda', enabled=False):
        if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16):
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill_(
                ~attn_mask, float('-inf'))
        if attn_mask is not None:  # read where it lies, broadcast (a GPU keeps it in cache)
            attn_mask = attn_mask.to(q.dtype)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, q.requires_grad, dropout_p, is_causal, scale=scale)[0]


def _nodes_to_inputs(roots: list, targets: set) -> set:
    """The autograd nodes from ``roots`` on a path to a node of ``targets``: the
    ones the engine runs for the gradients of those inputs."""
    leads, stack = {}, [(node, False) for node in roots]
    while stack:
        node, done = stack.pop()
        if done:
            leads[node] = node in targets or any(
                leads.get(nxt, False) for nxt, _ in node.next_functions if nxt is not None)
        elif node not in leads:
            leads[node] = False  # visited; decided once its inputs are
            stack.append((node, True))
            stack.extend((nxt, False) for nxt, _ in node.next_functions
                         if nxt is not None and nxt not in leads)
    return {node for node, lead in leads.items() if lead}


MATERIALIZE = '_materializes_grads'  # a custom Function's choice, kept readable


@contextlib.contextmanager
def materialize_choice_kept():
    """``ctx.set_materialize_grads(value)`` also keeps ``value`` where
    :func:`_call_node` can read it (torch's own attribute is write-only)."""
    setter = torch.autograd.function.FunctionCtx.set_materialize_grads

    def keep(ctx, value: bool) -> None:
        setter(ctx, value)
        setattr(ctx, MATERIALIZE, value)
    with mock.patch.object(torch.autograd.function.FunctionCtx, 'set_materialize_grads', keep):
        yield


def _call_node(node, given: dict) -> tuple:
    """A node's input gradients from those ``given`` to its outputs: a C++
    node takes the absent ones undefined, a Python one (a custom
    ``autograd.Function``) as zeros unless it set ``set_materialize_grads(False)``
    (:func:`materialize_choice_kept`), as the engine passes them."""
    args = [given.get(i) for i in range(len(node._input_metadata))]
    if callable(node):  # C++ node
        outs = node(*args)
    else:
        if getattr(node, MATERIALIZE, True):
            args = [torch.zeros(list(meta.shape), dtype=meta.dtype, device=meta.device)
                    if a is None else a for a, meta in zip(args, node._input_metadata)]
        outs = node.apply(*args)
    return outs if isinstance(outs, tuple) else (outs, )


def as_list(x) -> list:
    """One tensor or a sequence of them, as autograd.grad takes them, as a list."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


def python_grad(outputs, inputs, grad_outputs=None) -> tuple:
    """``torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)``
    with autograd's nodes called from Python, for fake CUDA tensors (autograd's
    engine needs a real device for CUDA tensors): as the engine, only the nodes
    on a path to an input run, each once after all that feed it; each
    gradient summed to the shape and cast to the dtype its next node takes,
    the gradients of one input summed."""
    outputs, inputs = as_list(outputs), as_list(inputs)
    grad_outputs = [None] * len(outputs) if grad_outputs is None else as_list(grad_outputs)
    edges = [torch.autograd.graph.get_gradient_edge(x) for x in inputs]
    grads, roots = {}, []
    for out, grad in zip(outputs, grad_outputs):
        if out.requires_grad:
            edge = torch.autograd.graph.get_gradient_edge(out)
            grad = torch.ones_like(out) if grad is None else grad
            into = grads.setdefault(edge.node, {})
            into[edge.output_nr] = into[edge.output_nr] + grad if edge.output_nr in into else grad
            roots.append(edge.node)
    targets = {edge.node for edge in edges}
    needed = _nodes_to_inputs(list(dict.fromkeys(roots)), targets)
    waiting = Counter(nxt for node in needed if not hasattr(node, 'variable')
                      for nxt, _ in node.next_functions if nxt in needed)
    ready, result = [n for n in dict.fromkeys(roots) if n in needed and not waiting[n]], {}
    while ready:
        node = ready.pop()
        given = grads.pop(node, {})
        if node in targets:
            result[node] = given
        if hasattr(node, 'variable') or not any(n in needed for n, _ in node.next_functions):
            continue  # a leaf, or an input's own node that leads nowhere needed
        for (nxt, slot), grad in zip(node.next_functions, _call_node(node, given)):
            if nxt not in needed:
                continue
            if grad is not None:
                meta = nxt._input_metadata[slot]
                grad = grad.sum_to_size(list(meta.shape)).to(meta.dtype)
                into = grads.setdefault(nxt, {})
                into[slot] = into[slot] + grad if slot in into else grad
            waiting[nxt] -= 1
            if not waiting[nxt]:
                ready.append(nxt)
    return tuple(result.get(edge.node, {}).get(edge.output_nr) for edge in edges)


def run_backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` by :func:`python_grad`: the gradients of every leaf
    that takes part go to its ``.grad``."""
    leaves, stack, seen = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, 'variable'):  # AccumulateGrad: a leaf
            leaves.append(node.variable)
        stack.extend(nxt for nxt, _ in node.next_functions)
    for leaf, grad in zip(leaves, python_grad([loss], leaves)):
        if grad is not None:
            leaf.grad = grad if leaf.grad is None else leaf.grad + grad


@contextlib.contextmanager
def gpu_calls(fake_mode):
    """Calls on fake CUDA tensors take the branches a GPU takes in torch: CUDA
    autocast, softmax attention as the GPU's fused kernel (:func:`fused_sdpa`);
    custom Functions' choice of zero gradients kept for :func:`python_grad`.
    Nothing of flatten_mm's (a checkout from before its ops may be counted in it)."""
    with mock.patch.object(F, 'scaled_dot_product_attention', fused_sdpa), \
            cuda_autocast_without_gpu(), materialize_choice_kept(), fake_mode:
        yield


@contextlib.contextmanager
def on_fake_gpu(fake_mode, backend: str = 'auto'):
    """:func:`gpu_calls`, with the core on ``backend`` and the Triton ops as on a
    GPU they are built for."""
    from flatten_mm.models.ops import use_backend
    with use_backend(backend), built_for_gpu(), gpu_calls(fake_mode):
        yield


@contextlib.contextmanager
def first_use_checks_passed():
    """For a count only (the model is dropped after it, the Triton backends'
    state restored): the tensor caches keep fake tensors, and the Triton ops'
    first-use checks, which run kernels, pass."""
    from flatten_mm.models import utils
    from flatten_mm.models import ops
    from flatten_mm.models.ops import triton_backend, triton_conv
    fused = getattr(ops, 'triton_fused', None)  # (a checkout from before it has none)
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(utils, '_under_tensor_mode', lambda: False))
        for module in (triton_backend, triton_conv) + ((fused, ) if fused else ()):
            stack.enter_context(mock.patch.object(module, '_agrees_on_first_use', lambda *a: True))
            stack.enter_context(mock.patch.dict(module._KERNELS))  # 'ran' on the first call
        yield


def has_triton_ops() -> bool:
    """Whether the flatten_mm imported here has the Triton ops (a checkout from
    before them has none, or no ops package)."""
    import importlib.util
    try:
        return importlib.util.find_spec('flatten_mm.models.ops.triton_backend') is not None
    except ModuleNotFoundError:
        return False


@contextlib.contextmanager
def counting_on_fake_gpu(fake_mode, backend: str = 'auto'):
    """What an op count on fake CUDA tensors runs under, yielding
    ``profile_backbone.tally_ops``'s ``inside`` map: the Triton ops counted by
    their launches (:func:`launch_count.counted_launches`), their first-use
    checks passed, the calls a GPU takes (:func:`on_fake_gpu`). A flatten_mm
    from before the Triton ops (an older checkout) runs under :func:`gpu_calls`
    with an empty map; one with Triton ops other than these cannot be counted
    (RuntimeError naming it)."""
    if not has_triton_ops():
        with gpu_calls(fake_mode):
            yield {}
        return
    from launch_count import counted_launches
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(first_use_checks_passed())
        except (ImportError, AttributeError) as err:
            import flatten_mm
            raise RuntimeError(f'the flatten_mm at {flatten_mm.__file__} has Triton ops that '
                               f'this tool cannot count ({err}): count a checkout from before '
                               'them, or one with these') from err
        stack.enter_context(on_fake_gpu(fake_mode, backend))
        yield stack.enter_context(counted_launches())


def built_for_gpu():
    """'auto' takes the Triton ops for fake CUDA tensors whatever GPU this machine
    has (a V100's capability would send them to torch: ``gpu_supported``)."""
    from flatten_mm.models.ops import triton_backend
    return mock.patch.object(triton_backend, 'gpu_supported', lambda index: True)


def step_row(name: str, size: list, dtype: str, batch: int, backend: str) -> dict:
    """The start of a row of one model's counted training step."""
    return dict(model=name, size='x'.join(map(str, size)), dtype=dtype, batch=batch,
                backend=backend, status='ok')


def count_step_ops(name: str, size: list, dtype: str, batch: int, backend: str = 'auto',
                   release_dir: Optional[str] = None) -> dict:
    """Ops of the second eager training step of one model on fake CUDA tensors
    (``profile_backbone.tally_ops``: calls, bytes, FLOPs), its forward and the
    backward of its loss (``benchmark_backbone.training_loss``, as that tool's
    step; :func:`run_backward`), and the bytes the forward keeps for the
    backward (``flatten_mm.analysis.saved_tensor_bytes``: activations and
    autocast's half copies of weights, not the weights or the input). The core runs on
    ``backend`` (``'auto'``: the Triton ops, as on a GPU), softmax attention as
    the GPU's fused kernel (:func:`fused_sdpa`), the Triton ops' first-use
    checks passed (:func:`counting_on_fake_gpu`)."""
    from profile_backbone import tally_ops
    model, fake_mode = fake_cuda_model(name, dtype, release_dir)
    with counting_on_fake_gpu(fake_mode, backend) as inside:
        x = torch.randn(batch, 3, *size, device='cuda')
        model(x)
        losses = []
        forward = tally_ops(lambda: losses.append(saved_tensor_bytes(
            lambda: training_loss(model(x)), [x, *model.parameters()])), inside)
        backward = tally_ops(lambda: run_backward(losses[0][0]), inside)
    row = step_row(name, size, dtype, batch, backend)
    row['saved_bytes'] = losses[0][1]  # kept for backward: the activation memory
    for part, tally in (('forward', forward), ('backward', backward)):
        row[part] = dict(op_calls=tally.calls, op_bytes=tally.bytes, ops=sum(tally.calls.values()),
                         bytes=sum(tally.bytes.values()), flops=sum(tally.flops.values()))
    return row


def compile_step(model: nn.Module, fake_mode, shape: tuple) -> List[dict]:
    """:func:`inductor_count.inductor_for_a_fake_gpu`'s record of the graphs
    torch.compile (``fullgraph=True``) makes of the training step of ``model``
    (fake CUDA weights, in ``fake_mode``) on images of ``shape``: its forward
    and backward (lowered at once). The joint graph's backward is traced by
    :func:`python_grad` (autograd's engine needs a real device)."""
    from inductor_count import inductor_for_a_fake_gpu
    grad = torch.autograd.grad

    def traced_grad(outputs, inputs, grad_outputs=None, **kwargs):
        if not any(out.is_cuda for out in as_list(outputs)):
            return grad(outputs, inputs, grad_outputs, **kwargs)
        return python_grad(outputs, inputs, grad_outputs)
    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        stack.callback(torch._dynamo.reset)
        stack.enter_context(mock.patch('torch.autograd.grad', traced_grad))
        graphs = stack.enter_context(inductor_for_a_fake_gpu())
        stack.enter_context(on_fake_gpu(fake_mode))
        step = torch.compile(lambda x: training_loss(model(x)), fullgraph=True)
        step(torch.randn(*shape, device='cuda'))
    return graphs


def count_compiled_step(name: str, size: list, dtype: str, batch: int) -> dict:
    """The kernels torch.compile's Inductor makes of one model's training step
    for an sm_90 GPU (:func:`compile_step`), with their bytes read and written:
    generated, not built or run. A graph break is reported."""
    row = step_row(name, size, dtype, batch, 'inductor')
    try:
        graphs = compile_step(*fake_cuda_model(name, dtype), (batch, 3, *size))
    except Exception as err:  # noqa: BLE001 (reported, and the exit status says so)
        row.update(status='failed', error=f'{type(err).__name__}: {str(err)[:1500]}')
        return row
    if len(graphs) != 2:
        row['status'] = f'{len(graphs)} graphs, not a forward and a backward'
        return row
    for part, graph in zip(('forward', 'backward'), graphs):
        labels, sizes = Counter(), Counter()
        for label, size_ in graph['kernels']:
            if not label.startswith(TRITON_OP_LABEL):  # counted by their launches below
                labels[label] += 1
                sizes[label] += size_
        launched, ops = graph_launches(graph['module'])
        externs = sum(label.startswith(TRITON_OP_LABEL) for label, _ in graph['kernels'])
        if ops != externs:  # an op the graph's nodes hide would go uncounted
            raise RuntimeError(f'{name}: {externs} Triton ops among the {part} kernels, '
                               f'{ops} found in its graph')
        labels.update(launched.calls)
        sizes.update(launched.bytes)
        row[part] = dict(op_calls=dict(labels), op_bytes=dict(sizes), ops=sum(labels.values()),
                         bytes=sum(sizes.values()))  # no FLOP count
    return row


TRITON_OP_LABEL = 'torch.ops.flatten_mm.triton_'  # Inductor's extern kernel of one of them


def graph_launches(gm: torch.fx.GraphModule) -> Tuple[Any, int]:
    """``profile_backbone.tally_ops`` of the Triton ops of a compiled graph, which
    Inductor calls as extern kernels (one each, its buffers once): each op's
    kernel launches and its host code's ATen ops (:mod:`launch_count`), run
    on the fake values the graph was traced with; and the number of such ops."""
    from torch._guards import detect_fake_mode
    from launch_count import counted_launches
    from profile_backbone import tally_ops

    def value(node: torch.fx.Node) -> Any:
        return node.meta['val']
    with counted_launches() as inside:
        nodes = [node for node in gm.graph.nodes if node.op == 'call_function' and
                 isinstance(node.target, torch._ops.OpOverload) and node.target.name() in inside]
        fake_mode = detect_fake_mode([value(arg) for node in nodes for arg in node.all_input_nodes])
        with fake_mode or contextlib.nullcontext():
            return tally_ops(lambda: [node.target(*torch.fx.node.map_arg(node.args, value),
                                                  **torch.fx.node.map_arg(node.kwargs, value))
                                      for node in nodes], inside), len(nodes)


def core_bytes(case: str, dtype: str, batch: int) -> dict:
    """Bytes one :class:`FocusedLinearAttention` layer (case ``HxWxCxHEADS``;
    module and input in ``dtype``, as ``benchmark_attention.py --dtype``) keeps
    for backward on fake CUDA tensors, and the bytes its training step (forward,
    and backward of :func:`training_loss`) reads and writes: with the Triton
    ops (the ``'triton'`` backend, as a GPU runs it; counted by their launches)
    and with the reference formula (``flatten_mm.analysis.reference_forward``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from benchmark_attention import parse_case
    from flatten_mm import FocusedLinearAttention
    from flatten_mm.analysis import reference_forward
    from profile_backbone import tally_ops
    H, W, C, heads = parse_case(case)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    layer = FocusedLinearAttention(C, heads, pos_grid=(H, W)).to(DTYPES[dtype]).train()
    layer = to_fake_cuda(layer, fake_mode)
    row = dict(case=case, dtype=dtype, batch=batch, status='ok')
    with counting_on_fake_gpu(fake_mode, 'triton') as inside:
        x = torch.randn(batch, H * W, C, device='cuda', dtype=DTYPES[dtype], requires_grad=True)
        for name, fn in (('triton', lambda: layer(x, (H, W))),
                         ('reference', lambda: reference_forward(layer, x, (H, W)))):
            row[f'{name}_saved_bytes'] = saved_tensor_bytes(fn, [x, *layer.parameters()])[1]
            outs = []
            forward = tally_ops(lambda: outs.append(training_loss(fn())), inside)
            backward = tally_ops(lambda: run_backward(outs[0]), inside)
            row[f'{name}_step_bytes'] = sum(forward.bytes.values()) + sum(backward.bytes.values())
            x.grad = None
            layer.zero_grad(set_to_none=True)  # the next path's backward adds no gradients
    row['saved_ratio'] = row['triton_saved_bytes'] / row['reference_saved_bytes']
    row['step_ratio'] = row['triton_step_bytes'] / row['reference_step_bytes']
    return row


def trace(name: str, size: list, dtype: str, batch: int) -> dict:
    """One model's forward traced for CUDA (see the module docstring)."""
    start = time.perf_counter()
    row = dict(model=name, size='x'.join(map(str, size)), dtype=dtype)
    try:
        ops, dtypes = graph_ops(compile_forward(name, [size], dtype, batch)[0])
        row.update(status='ok', attention_dtypes=sorted(dtypes),
                   ops={k: v for k, v in sorted(ops.items()) if 'flatten_mm' in k or 'conv' in k})
        if dtypes - {str(DTYPES[dtype])}:
            row['status'] = f'the attention ops take {sorted(dtypes)}, not {DTYPES[dtype]}'
    except Exception as err:  # noqa: BLE001 (reported, and the exit status says so)
        row.update(status='failed', error=f'{type(err).__name__}: {str(err)[:1500]}')
    row['seconds'] = round(time.perf_counter() - start, 1)
    return row


def count_graphs(name: str, sizes: list, dtype: str, batch: int) -> dict:
    """Graphs of one model compiled at each size, then the first again: as many
    as distinct sizes when nothing else is guarded on."""
    row = dict(model=name, sizes=['x'.join(map(str, s)) for s in sizes], dtype=dtype)
    try:
        graphs = len(compile_forward(name, list(sizes) + [sizes[0]], dtype, batch))
        distinct = len({tuple(s) for s in sizes})
        row.update(graphs=graphs, status='ok' if graphs <= distinct else
                   f'{graphs} graphs for {distinct} sizes (TORCH_LOGS=recompiles says why)')
    except Exception as err:  # noqa: BLE001 (reported, and the exit status says so)
        row.update(status='failed', error=f'{type(err).__name__}: {str(err)[:1500]}')
    return row


def parse_args(argv=None) -> argparse.Namespace:
    from flatten_mm.models.ops import available_backends
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
    parser.add_argument('--count-ops', action='store_true',
                        help='count the ops of an eager training step instead (any '
                        'model, softmax ones too)')
    parser.add_argument('--compiled', action='store_true',
                        help='with --count-ops: the kernels torch.compile (Inductor) makes '
                        'of the step for an sm_90 GPU, instead of the eager ops')
    parser.add_argument('--backend', choices=available_backends(), default='auto',
                        help="with --count-ops: the attention core's backend ('auto': the "
                        "Triton ops, as on a GPU)")
    parser.add_argument('--release-dir', help="with --count-ops: a checkout of the authors' "
                        'FLatten-Transformer, for release:NAME models')
    parser.add_argument('--core-cases', nargs='+', default=[],
                        help='instead: the bytes one attention layer keeps for backward '
                        '(HxWxCxHEADS cases at --batch, module and input in --dtypes) with '
                        'the Triton ops and with the reference formula')
    parser.add_argument('--out', help='write the rows here as JSON')
    args = parser.parse_args(argv)
    check_model_names(parser, args.models)
    model_options = ('models', 'size', 'compile_sizes', 'count_ops', 'backend', 'release_dir')
    if args.core_cases and any(getattr(args, name) != parser.get_default(name)
                               for name in model_options):
        parser.error('--core-cases counts layers instead of models: it takes --dtypes, '
                     '--batch and --out only')
    if args.compiled and (not args.count_ops or args.release_dir or args.backend != 'auto'):
        parser.error('--compiled goes with --count-ops, and without --release-dir or '
                     "--backend (the core takes the Triton ops, as compiled on a GPU)")
    return args


def summary(row: dict) -> str:
    """One printed line of a row of :func:`trace`, :func:`count_graphs`,
    :func:`count_step_ops` or :func:`count_compiled_step`."""
    if row.get('backend') == 'inductor':
        if 'backward' not in row:
            return f"{row['model']} compiled: {row['status']} {row.get('error', '')}"
        fwd, bwd = row['forward'], row['backward']
        return (f"{row['model']} {row['size']} {row['dtype']} batch {row['batch']}, compiled "
                f"training step: forward {fwd['ops']} kernels, {fwd['bytes'] / 1e9:.2f} GB read "
                f"and written; backward {bwd['ops']} kernels, {bwd['bytes'] / 1e9:.2f} GB")
    if 'forward' in row:
        fwd, bwd = row['forward'], row['backward']
        return (f"{row['model']} {row['size']} {row['dtype']} batch {row['batch']}, "
                f"{row['backend']} core, training step: forward {fwd['ops']} ops, "
                f"{fwd['bytes'] / 1e9:.2f} GB read and written, {fwd['flops'] / 1e9:.0f} GFLOP; "
                f"backward {bwd['ops']} ops, {bwd['bytes'] / 1e9:.2f} GB, "
                f"{bwd['flops'] / 1e9:.0f} GFLOP; saved for backward "
                f"{row['saved_bytes'] / 1e9:.2f} GB")
    if 'saved_ratio' in row:
        return (f"attention layer {row['case']} {row['dtype']} batch {row['batch']}: kept for "
                f"backward {row['triton_saved_bytes'] / 2 ** 20:.0f} MiB with the Triton ops, "
                f"{row['reference_saved_bytes'] / 2 ** 20:.0f} MiB with the reference "
                f"formula ({row['saved_ratio']:.3f}x); training step "
                f"{row['triton_step_bytes'] / 1e9:.2f} GB and "
                f"{row['reference_step_bytes'] / 1e9:.2f} GB read and written "
                f"({row['step_ratio']:.3f}x)")
    if 'sizes' in row:
        return (f"{row['model']} compiled at {' '.join(row['sizes'])} and the first again, "
                f"{row['dtype']}: {row.get('graphs')} graphs, {row['status']} "
                f"{row.get('error', '')}")
    return (f"{row['model']} {row['size']} {row['dtype']}: {row['status']} ({row['seconds']} s) "
            f"{row.get('ops') or row.get('error')}, attention in {row.get('attention_dtypes')}")


def checks_to_run(args: argparse.Namespace) -> list:
    """The calls, each giving one row, that ``args`` ask for."""
    if args.core_cases:
        return [functools.partial(core_bytes, case, dtype, args.batch)
                for case in args.core_cases for dtype in args.dtypes]
    checks = []
    # the authors' models last: importing their code registers its model names
    # with timm again, over ours
    for name in sorted(args.models, key=lambda name: name.startswith('release:')):
        for dtype in args.dtypes:
            step = (name, args.size, dtype, args.batch)
            if args.count_ops and args.compiled:
                checks.append(functools.partial(count_compiled_step, *step))
            elif args.count_ops:  # instead of the traces: softmax models count too
                checks.append(functools.partial(count_step_ops, *step, args.backend,
                                                args.release_dir))
            else:
                checks.append(functools.partial(trace, *step))
                if args.compile_sizes:
                    checks.append(functools.partial(count_graphs, name, args.compile_sizes,
                                                    dtype, args.batch))
    return checks


def main(argv=None) -> list:
    args = parse_args(argv)
    rows = []
    for check in checks_to_run(args):
        rows.append(check())
        print(summary(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if any(r['status'] != 'ok' for r in rows):
        raise SystemExit(1)
    return rows


if __name__ == '__main__':
    main()
